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
