"""What a hostile peer can make the server keep and spend through its Zenoh callbacks, without the
network: the callbacks (`Ingest`) and the serving path (`Serving`) are called directly, the action
publishers are an in-memory fake.

- the parsed-key cache is bounded in bytes as well as in keys, and forgets its oldest keys first;
- a key naming a client id over 128 bytes is dropped and counted before it is parsed or kept;
- a task over 2,048 bytes is refused by its length before the runner's check (a VLA's tokenizer)
  sees it: from an unlisted id in the callback, on arrival (the inference thread never decodes it),
  from a listed robot when its body is decoded;
- ids the manifest does not list share one rejection cool-down, so fresh ids do not multiply it.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from lerobot_zenoh.errors import KeyExprError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import MAX_CLIENT_ID_BYTES, AppKey, client_chunk_too_long, validate_client_id
from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES, Observation
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.engine import admission
from lerobot_zenoh.server.model.failover import ServingRole
from lerobot_zenoh.server.shell.ingest import MAX_CACHED_KEY_BYTES, MAX_CACHED_KEYS, Ingest, KeyCache
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.session_table.rate_limit import RejectionRateLimit
from lerobot_zenoh.server.config.runner_loading import load_runner
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.server.engine.serving import Serving

pytestmark = pytest.mark.core

APP = AppKey("c1", "e1", "m1", "v1", "a1")
CAMS = {"front": (16, 24)}


class FakeSession:
    """The one call `Serving` makes on the network here: an action publisher, kept in memory."""

    def __init__(self):
        self.sent: list[tuple[str, bytes]] = []

    def publisher(self, key, qos):
        session = self

        class Publisher:
            dropped = 0

            def put(self, payload, attachment=None, *, valid=None):
                if valid is None or valid():
                    session.sent.append((key, payload))

        return Publisher()


def served_model(*, accept_unknown: bool = True, echo_task: bool = False) -> ServedModel:
    manifest = parse_manifest({
        "cluster_uuid": APP.cluster, "experiment_tag": APP.experiment, "server_id": "gpu0", "telemetry_period_s": 0,
        "zenoh": {"listen": ["tcp/127.0.0.1:7999"], "multicast_scouting": False},
        "server": [{"model_id": APP.model, "model_version": APP.version, "application_tag": APP.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 10, "cameras": CAMS,
                                  "latency_ms": 0, "echo_task": echo_task},
                    "clients": [{"client_uuid": "robot"}], "accept_unknown_clients": accept_unknown}],
    })
    entry = manifest.server[0]
    model = ServedModel(manifest, entry, load_runner(manifest, entry), "gpu0")
    model.role = ServingRole(APP.prefix, None)
    model.role.active.set()
    return model


def observation(client_id: str, seq_id: int = 1, task: str = "pick the cube", **kw) -> tuple[bytes, bytes]:
    jpegs = {n: codec.encode_jpeg(np.zeros((*hw, 3), np.uint8)) for n, hw in CAMS.items()}
    obs = Observation(seq_id, client_id, np.zeros(6, np.float32), jpegs, task, session_nonce=7, **kw)
    return codec.encode(obs), codec.encode_observation_header(obs)


def obs_key(client_id: str) -> str:
    return f"{APP.prefix}/{client_id}/obs"


# -- the parsed-key cache ---------------------------------------------------------------------------


def test_the_key_cache_is_bounded_in_bytes_and_forgets_its_oldest_keys_first():
    cache = KeyCache(max_keys=1000, max_bytes=20_000)
    ids = [f"robot_{i:03d}_" + "x" * 100 for i in range(400)]
    for cid in ids:
        cache.put(obs_key(cid), cid)
        assert cache.bytes <= 20_000
    # Far fewer than the 1000 keys it could count: bytes decided.
    one = sys.getsizeof(obs_key(ids[0])) + sys.getsizeof(ids[0])
    assert len(cache) == 20_000 // one and cache.evicted == 400 - len(cache)
    assert cache.get(obs_key(ids[-1])) == ids[-1] and cache.get(obs_key(ids[0])) is None
    assert cache.bytes == sum(sys.getsizeof(obs_key(c)) + sys.getsizeof(c) for c in ids[-len(cache):])
    # Putting a key again does not count it twice.
    cache.put(obs_key(ids[-1]), ids[-1])
    assert cache.bytes == sum(sys.getsizeof(obs_key(c)) + sys.getsizeof(c) for c in ids[-len(cache):])
    # A key longer than any key with a valid id is neither kept nor looked up.
    long_key = f"{APP.prefix}/robot/obs/" + "c" * 2000
    cache.put(long_key, "robot")
    assert cache.get(long_key) is None


def test_a_flood_of_fresh_ids_keeps_the_server_key_cache_within_its_byte_bound():
    model = served_model(accept_unknown=False)
    ingest = Ingest([model], threading.Event())
    payload, header = observation("robot")
    for i in range(MAX_CACHED_KEYS + 500):  # ids of the longest allowed length, each new
        cid = f"{i:06d}" + "y" * (MAX_CLIENT_ID_BYTES - 6)
        ingest.on_observation(model, obs_key(cid), payload, header)
        assert ingest.keys.bytes <= MAX_CACHED_KEY_BYTES
    assert len(ingest.keys) <= MAX_CACHED_KEYS and ingest.keys.evicted > 0
    assert model.session_table.dropped[Reason.UNKNOWN_CLIENT] == MAX_CACHED_KEYS + 500


# -- client ids over the limit ----------------------------------------------------------------------


@pytest.mark.parametrize("client_id", ["r" * (MAX_CLIENT_ID_BYTES + 1), "é" * 65, "x" * 60_000])
def test_a_key_naming_an_over_long_client_id_is_dropped_unparsed_and_counted(client_id, monkeypatch):
    model = served_model()
    ingest = Ingest([model], threading.Event())
    parsed = []
    import lerobot_zenoh.server.shell.ingest as ingest_module

    monkeypatch.setattr(ingest_module, "parse_client_key", lambda *a: parsed.append(a))
    payload, header = observation("robot")
    for _ in range(3):
        ingest.on_observation(model, obs_key(client_id), payload, header)
    assert model.refused_unread == {Reason.CLIENT_ID_TOO_LONG: 3}
    assert parsed == [] and len(ingest.keys) == 0 and ingest.keys.bytes == 0
    snap = model.session_table.snapshot()
    assert snap.sessions == {} and snap.dropped == {}  # the session table never heard of it


def test_the_longest_client_id_is_served_and_a_longer_one_fails_where_it_is_named():
    model = served_model()
    ingest = Ingest([model], threading.Event())
    longest = "z" * MAX_CLIENT_ID_BYTES
    ingest.on_observation(model, obs_key(longest), *observation(longest))
    assert longest in model.session_table.snapshot().sessions and model.refused_unread == {}
    assert not client_chunk_too_long(obs_key(longest)) and client_chunk_too_long(obs_key(longest + "z"))
    with pytest.raises(KeyExprError, match="at most 128"):
        validate_client_id("client_uuid", longest + "z")
    with pytest.raises(ValueError, match="client_uuid"):  # a manifest naming one fails at start-up
        parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "server_id": "s",
                        "server": [{"model_id": "m", "model_version": "v", "application_tag": "a",
                                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 10},
                                    "clients": [{"client_uuid": longest + "z"}]}]})


# -- tasks over the limit ---------------------------------------------------------------------------


def test_an_unlisted_ids_task_over_the_byte_limit_is_refused_on_arrival_never_decoded_nor_tokenized():
    model = served_model(echo_task=True)
    checked: list[str] = []
    decoded: list[bytes] = []
    check, decode = model.runner.check_request, model.adapter.decode

    def spy(request):  # where a VLA runner tokenizes the task
        checked.append(request.task)
        return check(request)

    def decode_spy(payload, header=None):  # the inference thread's decode of a picked body
        decoded.append(payload)
        return decode(payload, header)

    model.runner.check_request = spy
    model.adapter.decode = decode_spy
    ingest = Ingest([model], threading.Event())
    serving = Serving("gpu0", [model], threading.Event())
    serving.session = FakeSession()
    for seq, task in enumerate(["t" * (MAX_TASK_BYTES + 1), "ü" * (MAX_TASK_BYTES // 2 + 1), "x" * 64_000], 1):
        ingest.on_observation(model, obs_key("visitor"), *observation("visitor", seq, task))
        assert model.session_table.sessions["visitor"].slot is None  # refused in the callback, kept nowhere
        assert admission.schedule(model, time.monotonic()) is None  # nothing for the inference thread
    assert checked == [] and decoded == [] and serving.session.sent == []
    assert model.session_table.snapshot().sessions["visitor"].stats.rejected == {Reason.TASK_TOO_LONG: 3}
    # A task of exactly the limit is read and served: its body decoded once, from the copy the callback kept.
    payload, header = observation("visitor", 4, "t" * MAX_TASK_BYTES)
    ingest.on_observation(model, obs_key("visitor"), FakeZenohBuffer(payload), header)
    serving.serve(model, admission.schedule(model, time.monotonic()))
    assert checked == ["t" * MAX_TASK_BYTES] and len(serving.session.sent) == 1
    assert decoded == [payload] and type(decoded[0]) is bytes


def test_a_listed_robots_body_stays_in_zenohs_buffer_until_one_of_its_observations_is_rejected():
    """Only ids anyone can invent pay the copy of the screen, and a listed robot once refused: its
    first long task is refused by its length when it is decoded, before any tokenizer, and the next
    ones on arrival, for a minute."""
    model = served_model(echo_task=True)
    ingest = Ingest([model], threading.Event())
    serving = Serving("gpu0", [model], threading.Event())
    serving.session = FakeSession()
    honest = FakeZenohBuffer(observation("robot", 1)[0])
    ingest.on_observation(model, obs_key("robot"), honest, observation("robot", 1)[1])
    assert model.session_table.sessions["robot"].slot.payload is honest  # not copied on arrival
    serving.serve(model, admission.schedule(model, time.monotonic()))
    assert len(serving.session.sent) == 1
    long_task = FakeZenohBuffer(observation("robot", 2, "x" * (MAX_TASK_BYTES + 1))[0])
    ingest.on_observation(model, obs_key("robot"), long_task, observation("robot", 2)[1])
    assert model.session_table.sessions["robot"].slot.payload is long_task
    serving.serve(model, admission.schedule(model, time.monotonic()))  # refused when decoded
    assert model.session_table.snapshot().sessions["robot"].stats.rejected == {Reason.TASK_TOO_LONG: 1}
    ingest.on_observation(model, obs_key("robot"), *observation("robot", 3, "x" * (MAX_TASK_BYTES + 1)))
    assert model.session_table.sessions["robot"].slot is None  # now refused on arrival
    assert model.session_table.snapshot().sessions["robot"].stats.rejected == {Reason.TASK_TOO_LONG: 2}
    again = FakeZenohBuffer(observation("robot", 4)[0])
    ingest.on_observation(model, obs_key("robot"), again, observation("robot", 4)[1])
    assert model.session_table.sessions["robot"].slot.payload == again.data  # screened: a copy
    assert len(serving.session.sent) == 1
    unlisted = FakeZenohBuffer(observation("visitor", 1)[0])
    ingest.on_observation(model, obs_key("visitor"), unlisted, observation("visitor", 1)[1])
    assert model.session_table.sessions["visitor"].slot.payload == unlisted.data  # screened: the copy is kept


def test_observations_the_table_drops_anyway_are_not_screened(monkeypatch):
    """No copy for what `SessionTable.admit` drops unread: an unknown id the manifest refuses, or
    any client while its cool-down runs."""
    screened = []
    screen = admission.screen
    monkeypatch.setattr(admission, "screen", lambda payload, limits: screened.append(payload) or screen(payload, limits))
    closed = served_model(accept_unknown=False)
    Ingest([closed], threading.Event()).on_observation(closed, obs_key("stranger"), *observation("stranger"))
    assert screened == [] and closed.session_table.snapshot().dropped == {Reason.UNKNOWN_CLIENT: 1}
    model = served_model()
    ingest = Ingest([model], threading.Event())
    model.session_table.rate_limit.cooldown_s = 600.0
    for _ in range(model.session_table.rate_limit.max_rejections + 1):  # the unknown ids' shared cool-down starts
        model.session_table.rate_limit.on_rejection("visitor", time.monotonic())
    ingest.on_observation(model, obs_key("visitor"), *observation("visitor", 1, "x" * (MAX_TASK_BYTES + 1)))
    assert screened == []  # dropped as rate_limited, never copied
    ingest.on_observation(model, obs_key("robot"), *observation("robot"))  # listed, never refused: not screened
    assert screened == []


def test_the_task_length_read_after_bytes_it_could_not_read_is_right():
    good, _ = observation("robot", 1, "t" * (MAX_TASK_BYTES + 1))
    for bad in (good[:len(good) // 2], good + b"\xc1trailing", b"\x92\x01", b"\xc1"):
        codec.observation_task_bytes(bad)
        assert codec.observation_task_bytes(good) == MAX_TASK_BYTES + 1


class FakeZenohBuffer:
    """A payload as Zenoh hands it over (`transport.session.Payload`): read only by copying it."""

    def __init__(self, data: bytes):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __bytes__(self) -> bytes:
        return self.data


# -- one cool-down for every unknown id -------------------------------------------------------------


def test_unknown_ids_share_one_cool_down_and_a_listed_robot_keeps_its_own():
    model = served_model()
    table, limit = model.session_table, model.session_table.rate_limit
    limit.cooldown_s = 600.0  # (the callback reads the clock itself: no stall of a busy machine outlasts this)
    now = time.monotonic()
    payload, _ = observation("x")
    # One bad observation from each of 21 fresh ids: more than 20 rejections in 1 s, together.
    for i in range(limit.max_rejections + 1):
        cid = f"fresh_{i}"
        assert table.admit(cid, payload, now) is None
        table.reject(table.sessions[cid], Reason.BAD_JPEG, now)
    assert table.admit("fresh_new", payload, now) == Reason.RATE_LIMITED
    assert limit.blocked("fresh_0", now) and limit.blocked("anyone_else", now)
    assert table.admit("robot", observation("robot")[0], now) is None  # listed: its own limit
    # Meanwhile a fresh id does not even open a session (nor take a place in the pool), through the callback too.
    ingest = Ingest([model], threading.Event())
    opened = table.snapshot().sessions_opened
    ingest.on_observation(model, obs_key("fresh_other"), *observation("fresh_other"))
    assert "fresh_other" not in table.sessions and table.snapshot().sessions_opened == opened
    assert table.snapshot().dropped[Reason.RATE_LIMITED] == 2  # fresh_new and fresh_other, counted
    # Closing the unknown sessions does not lift the shared cool-down; its end does.
    unknown = [cid for cid, session in table.sessions.items() if not session.listed]
    assert table.update_clients(table.config.listed, close=unknown) == unknown
    assert not any(cid in table.sessions for cid in unknown)
    assert limit.blocked("fresh_1", now + 1.0)
    assert not limit.blocked("fresh_1", now + limit.cooldown_s + 0.01)


def test_a_limiter_without_a_list_keeps_one_limit_per_id():
    limit = RejectionRateLimit(max_rejections=2, window_s=1.0, cooldown_s=5.0)
    for cid in ("a", "b", "c"):
        for _ in range(2):
            assert not limit.on_rejection(cid, 0.0)
    assert not any(limit.blocked(c, 0.0) for c in "abc")
    shared = RejectionRateLimit(max_rejections=2, window_s=1.0, cooldown_s=5.0, listed=lambda c: c == "a")
    assert not shared.on_rejection("b", 0.0) and not shared.on_rejection("c", 0.0)
    assert shared.on_rejection("d", 0.0) and shared.blocked("e", 0.1) and not shared.blocked("a", 0.1)
