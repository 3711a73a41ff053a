import pytest

from lerobot_zenoh.errors import KeyExprError
from lerobot_zenoh.protocol.keys import ALL_METRICS, AppKey, Topic, parse_client_key, parse_key

APP = AppKey("jupiter", "fabio2", "pi0", "v1", "cookie")


def test_builds_the_seed_keys():
    client = APP.client("robot_a4b9")
    assert client.obs == "jupiter/fabio2/pi0/v1/cookie/robot_a4b9/obs"
    assert client.action == "jupiter/fabio2/pi0/v1/cookie/robot_a4b9/action"
    assert client.metrics == "jupiter/fabio2/pi0/v1/cookie/robot_a4b9/metrics"
    assert APP.all_observations == "jupiter/fabio2/pi0/v1/cookie/*/obs"
    assert APP.status == "jupiter/fabio2/pi0/v1/cookie/status"
    assert APP.server_token("gpu0") == "jupiter/fabio2/pi0/v1/cookie/server/gpu0"
    assert APP.server_metrics("gpu0") == "jupiter/fabio2/pi0/v1/cookie/server/gpu0/metrics"
    assert ALL_METRICS == "**/metrics"


@pytest.mark.parametrize("topic", list(Topic))
def test_parse_round_trips(topic):
    key = APP.client("r1").topic(topic)
    parsed = parse_key(key)
    assert (parsed.app, parsed.client_id, parsed.topic) == (APP, "r1", topic.value)
    assert parse_client_key(key, topic) == (APP, "r1")


def test_parse_status_and_server_keys():
    assert parse_key(APP.status).topic == "status"
    parsed = parse_key(APP.server_metrics("gpu0"))
    assert (parsed.server_id, parsed.topic, parsed.client_id) == ("gpu0", "metrics", None)


@pytest.mark.parametrize("bad", ["", "a/b", "a*", "$x", "a?", "a#", "a@b", "a b", "tab\t", "new\nline"])
def test_rejects_reserved_chunks_naming_field_and_value(bad):
    with pytest.raises(KeyExprError) as err:
        AppKey("c", "e", bad, "v", "a")
    assert "model" in str(err.value) and repr(bad) in str(err.value)
    with pytest.raises(KeyExprError, match="client_id"):
        APP.client(bad)


@pytest.mark.parametrize("bad", ["server", "status"])
def test_reserved_client_ids(bad):
    with pytest.raises(KeyExprError, match="reserved"):
        APP.client(bad)


@pytest.mark.parametrize(
    "key",
    ["a/b/c", "c/e/m/v/a/r1/telemetry", "c/e/m/v/a/r1/obs/extra", "c/e/m/v/a/server/x/y", "c/e/m/v/a//obs"],
)
def test_parse_rejects_foreign_keys(key):
    with pytest.raises(KeyExprError):
        parse_key(key)


def test_parse_client_key_checks_topic():
    with pytest.raises(KeyExprError, match="expected obs"):
        parse_client_key(APP.client("r1").action, Topic.OBS)


def test_pipeline_keys_and_result_topics():
    """1.3: a task's observation stream and the text / verdict topics parse like any client key."""
    from lerobot_zenoh.protocol.keys import ClientKey, parse_client_key, pipeline_app

    app = pipeline_app("factory", "mix2", "assemble_kit")
    assert app.client("robot-3").obs == "factory/mix2/_pipeline/1/assemble_kit/robot-3/obs"
    assert parse_client_key(app.client("robot-3").obs, "obs") == (app, "robot-3")
    ck = ClientKey(AppKey("factory", "mix2", "qwen7b", "v1", "system2-srv1"), "robot-3")
    assert ck.text.endswith("/robot-3/text") and ck.verdict.endswith("/robot-3/verdict")
    assert parse_client_key(ck.verdict, "verdict")[1] == "robot-3"


def test_a_task_observation_key_names_the_components_it_asks_one_key_per_mask():
    """An observation on a task's stream is put on `.../obs/c<i>/c<j>` (bits lowest first), so that a
    router sends it only to the servers of those components; its server subscribes per bit."""
    from lerobot_zenoh.protocol.keys import names_components, pipeline_app

    app = pipeline_app("factory", "mix2", "assemble_kit")
    key = app.client("robot-3").obs_for(0b101)
    assert key == "factory/mix2/_pipeline/1/assemble_kit/robot-3/obs/c0/c2"
    assert app.client("robot-3").obs_for(None) == app.client("robot-3").obs
    parsed = parse_key(key)
    assert (parsed.client_id, parsed.topic, parsed.component_mask) == ("robot-3", "obs", 0b101)
    assert parse_client_key(key, "obs") == (app, "robot-3") and parse_key(app.client("r").obs).component_mask is None
    assert app.component_observations(2) == "factory/mix2/_pipeline/1/assemble_kit/*/obs/**/c2/**"
    assert names_components(key, (2,)) and names_components(key, (1, 0)) and not names_components(key, (1, 3))
    assert not names_components(app.client("c0").obs, (0,))  # a client id that looks like a component chunk
    assert names_components(pipeline_app("f", "m", "obs").client("c1").obs_for(0b1), (0,))
    for bad in (0, -1, 1 << 32):
        with pytest.raises(KeyExprError, match="component_mask"):
            app.client("r").obs_for(bad)
    # One mask, one key: chunks other than increasing c<bit> below 32 are refused.
    for suffix in ("c2/c0", "c1/c1", "c02", "c32", "x", "c", "c-1", "obs", "c²", "c٣", "c+1", "c 1"):
        with pytest.raises(KeyExprError, match="component chunks"):
            parse_key(f"{app.client('r').obs}/{suffix}")
