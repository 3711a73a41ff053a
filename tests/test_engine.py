"""The serving engine alone (no Zenoh, no model): sessions, reserved places, expiry, replays, episodes."""

from __future__ import annotations

import numpy as np
import pytest

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
from lerobot_zenoh.scheduling.request_schedulers import make_scheduler
from lerobot_zenoh.server.engine import (
    REPLAYED,
    TOO_LARGE,
    TOO_MANY_CLIENTS,
    UNKNOWN_CLIENT,
    Engine,
    EngineConfig,
)


def obs(client: str, seq: int, *, episode: str | None = "0", nonce: int | None = 7, buffered: int = 0) -> Observation:
    return Observation(seq, client, np.zeros(2, np.float32), {}, "", ExecutionInfo(actions_buffered=buffered,
                       control_period_s=1 / 30), episode_id=episode, session_nonce=nonce)


def engine(listed=("robot",), *, scheduler="round_robin", **kw) -> Engine:
    return Engine(EngineConfig(listed=frozenset(listed), **kw), make_scheduler(scheduler))


def serve(e: Engine, now: float) -> list[str]:
    """Schedule, check and finish one batch the way the executor does; the ids served."""
    batch = e.schedule(now, codec.decode_observation)
    if batch is None:
        return []
    served = []
    for session, slot in batch.items:
        o = slot.observation or codec.decode_observation(slot.payload)
        if e.check(session, o) is None:
            e.take_reset(session)
            served.append((session, o.seq_id, 1.0, 0.0))
        else:
            e.reject(session, REPLAYED, now)
    e.finish(served, [s.client_id for s, _ in batch.items], now, 0.01)
    return [s.client_id for s, *_ in served]


def test_unknown_ids_are_refused_when_not_accepted_and_counted_boundedly():
    e = engine()
    for i in range(1000):
        assert e.admit(f"x{i}", b"p", 0.0) == UNKNOWN_CLIENT
    snap = e.snapshot()
    assert snap["dropped"][UNKNOWN_CLIENT] == 1000 and len(e.unknown_refused) == 256
    assert snap["sessions"] == {}


def test_listed_client_has_its_place_however_many_unknown_ids_arrive():
    e = engine(accept_unknown=True, max_unknown_clients=4)
    for i in range(200):
        e.admit(f"forged{i}", codec.encode(obs(f"forged{i}", 1)), 0.0)
    assert e.snapshot()["dropped"][TOO_MANY_CLIENTS] == 196
    assert e.admit("robot", codec.encode(obs("robot", 1)), 0.0) is None
    assert "robot" in e.sessions and len(e.sessions) == 5


def test_unknown_place_is_freed_when_the_token_goes_after_the_grace_period():
    e = engine(accept_unknown=True, max_unknown_clients=1, liveliness_grace_s=2.0, idle_timeout_s=100.0)
    assert e.admit("a", b"x", 0.0) is None
    assert e.admit("b", b"x", 0.0) == TOO_MANY_CLIENTS
    e.on_token("a", False, 1.0)
    assert e.expire(2.9) == []  # still within the grace period
    e.on_token("a", True, 2.0)  # back in time: nothing closes
    assert e.expire(10.0) == []
    e.on_token("a", False, 11.0)
    assert [s.client_id for s in e.expire(13.0)] == ["a"]
    assert e.admit("b", b"x", 13.0) is None
    assert e.snapshot()["sessions_closed"] == {"liveliness": 1}


def test_idle_sessions_expire_and_their_scheduler_state_is_forgotten():
    e = engine(scheduler="fifo", accept_unknown=True, idle_timeout_s=5.0)
    e.admit("robot", codec.encode(obs("robot", 1)), 0.0)
    e.admit("u", codec.encode(obs("u", 1)), 0.0)
    e.schedule(0.0)  # announced to the scheduler, not served
    assert [s.client_id for s in e.expire(4.0)] == []
    e.admit("robot", codec.encode(obs("robot", 2)), 4.0)
    closed = e.expire(5.5)
    assert [s.client_id for s in closed] == ["u"]
    assert e.scheduler.stats()["waiting"] == 1  # robot only
    assert e.snapshot()["totals"]["received"] == 1  # u's counts outlive its session


def test_replayed_observations_are_dropped_and_counted():
    e = engine()
    e.admit("robot", codec.encode(obs("robot", 5)), 0.0)
    assert serve(e, 0.0) == ["robot"]
    for seq in (5, 3, 5):
        e.admit("robot", codec.encode(obs("robot", seq)), 1.0)
        assert serve(e, 1.0) == []
    e.admit("robot", codec.encode(obs("robot", 6)), 2.0)
    assert serve(e, 2.0) == ["robot"]
    assert e.snapshot()["sessions"]["robot"]["rejected"] == {REPLAYED: 3}


def test_replays_are_dropped_before_serving_with_a_scheduler_that_decodes_on_arrival():
    e = engine(scheduler="wait_ratio")
    e.admit("robot", codec.encode(obs("robot", 5)), 0.0)
    assert serve(e, 0.0) == ["robot"]
    e.admit("robot", codec.encode(obs("robot", 5)), 1.0)
    batch = e.schedule(1.0, codec.decode_observation)
    assert batch.items == [] and [r[2] for r in batch.rejected] == [REPLAYED]


def test_a_restarted_client_is_served_from_its_first_observation():
    e = engine()
    e.admit("robot", codec.encode(obs("robot", 50, nonce=1)), 0.0)
    assert serve(e, 0.0) == ["robot"]
    e.admit("robot", codec.encode(obs("robot", 1, nonce=2)), 1.0)
    batch = e.schedule(1.0)
    session, slot = batch.items[0]
    assert e.check(session, codec.decode_observation(slot.payload)) is None
    assert e.take_reset(session) and not e.take_reset(session)


def test_a_new_episode_resets_the_session_before_it_is_served():
    e = engine(scheduler="wait_ratio")
    e.admit("robot", codec.encode(obs("robot", 1, episode="0")), 0.0)
    batch = e.schedule(0.0, codec.decode_observation)
    assert not e.take_reset(batch.items[0][0])  # the first episode needs no reset
    e.finish([(batch.items[0][0], 1, 1.0, 0.0)], ["robot"], 0.1, 0.1)
    e.admit("robot", codec.encode(obs("robot", 2, episode="0")), 0.2)
    batch = e.schedule(0.2, codec.decode_observation)
    assert not e.take_reset(batch.items[0][0])
    e.finish([(batch.items[0][0], 2, 1.0, 0.0)], ["robot"], 0.3, 0.1)
    e.admit("robot", codec.encode(obs("robot", 3, episode="1")), 0.4)
    batch = e.schedule(0.4, codec.decode_observation)
    assert e.take_reset(batch.items[0][0])
    assert "robot" in e.scheduler._tasks  # a new task was started by this arrival, after the reset


def test_oversized_payload_is_rejected_before_taking_a_slot():
    e = engine(max_message_bytes=10)
    assert e.admit("robot", b"x" * 11, 0.0) == TOO_LARGE
    assert e.sessions["robot"].slot is None
    assert e.snapshot()["sessions"]["robot"]["rejected"] == {TOO_LARGE: 1}


def test_newest_only_slot_counts_superseded():
    e = engine()
    for seq in (1, 2, 3):
        e.admit("robot", codec.encode(obs("robot", seq)), 0.0)
    batch = e.schedule(0.0)
    assert codec.decode_observation(batch.items[0][1].payload).seq_id == 3
    assert e.snapshot()["sessions"]["robot"]["superseded"] == 2


def test_undecodable_observation_is_rejected_without_a_seat():
    e = engine(scheduler="wait_ratio")
    e.admit("robot", b"\x00garbage", 0.0)
    batch = e.schedule(0.0, codec.decode_observation)
    assert batch.items == [] and batch.rejected[0][2] != REPLAYED


@pytest.mark.parametrize("n", [1, 3])
def test_batch_is_bounded_by_max_batch_size(n):
    e = engine(listed=("a", "b", "c", "d"), max_batch_size=n)
    for c in "abcd":
        e.admit(c, codec.encode(obs(c, 1)), 0.0)
    assert len(e.schedule(0.0).items) == n


def test_close_all_frees_everything():
    e = engine(accept_unknown=True)
    e.admit("robot", b"x", 0.0)
    e.admit("u", b"x", 0.0)
    assert {s.client_id for s in e.close_all()} == {"robot", "u"}
    assert e.sessions == {} and e.snapshot()["unknown_open"] == 0
