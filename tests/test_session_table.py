"""The session table alone (no Zenoh, no model): sessions, reserved places, expiry, replays, episodes."""

from __future__ import annotations

import numpy as np
import pytest

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
from lerobot_zenoh.scheduling.request_schedulers import FifoScheduler, make_scheduler
from lerobot_zenoh.server.engine.admission import read_header
from lerobot_zenoh.server.session_table.table import (
    MAX_SEQ_RATE_HZ,
    MAX_SEQ_STEP,
    NONCE_REQUIRED,
    NONCELESS_REPLAY_WINDOW_S,
    REFRESH_LATE,
    REPLAYED,
    SEQ_JUMP,
    TOO_LARGE,
    TOO_MANY_CLIENTS,
    UNKNOWN_CLIENT,
    SessionTable,
    SessionTableConfig,
)

pytestmark = pytest.mark.core  # the pure serving core: make test-core


def obs(client: str, seq: int, *, episode: str | None = "0", nonce: int | None = 7, buffered: int = 0,
        refreshes: int | None = None) -> Observation:
    return Observation(seq, client, np.zeros(2, np.float32), {}, "", ExecutionInfo(actions_buffered=buffered,
                       control_period_s=1 / 30), episode_id=episode, session_nonce=nonce, refreshes_seq_id=refreshes)


def admit(e: SessionTable, o: Observation, now: float) -> str | None:
    """Admit with its header, read as the server's callback does."""
    return e.admit(o.client_uuid, codec.encode(o), now, *read_header(codec.encode_observation_header(o)))


def schedule(e: SessionTable, now: float):
    """Decode what came without a header (the executor's job in the server), then schedule."""
    for slot in e.unread():
        try:
            slot.observation = codec.decode_observation(slot.payload)
        except Exception as exc:
            slot.error = exc
    return e.schedule(now)


def session_table(listed=("robot",), *, scheduler="round_robin", **kw) -> SessionTable:
    return SessionTable(SessionTableConfig(listed=frozenset(listed), **kw), make_scheduler(scheduler))


def serve(e: SessionTable, now: float) -> list[str]:
    """Schedule and finish one batch the way the server does; the ids served."""
    batch = schedule(e, now)
    if batch is None:
        return []
    served = []
    for session, _slot, reason, _detail in batch.rejected:
        e.reject(session, reason, now)
    for session, slot in batch.items:
        slot.observation = o = slot.observation or codec.decode_observation(slot.payload)
        refused = e.judge(session, slot)  # (a header-less one, with a scheduler that did not need it earlier)
        if refused is not None:
            e.reject(session, refused[0], now)
            continue
        e.take_reset(session)
        served.append((session, o.seq_id, 1.0, 0.0))
    e.finish(served, [s.client_id for s, _ in batch.items], now, 0.01)
    return [s.client_id for s, *_ in served]


def test_unknown_ids_are_refused_when_not_accepted_and_counted_boundedly():
    e = session_table()
    for i in range(1000):
        assert e.admit(f"x{i}", b"p", 0.0) == UNKNOWN_CLIENT
    snap = e.snapshot()
    assert snap.dropped[UNKNOWN_CLIENT] == 1000 and len(e.roster.unknown_refused) == 256
    assert snap.sessions == {}


def test_listed_client_has_its_place_however_many_unknown_ids_arrive():
    e = session_table(accept_unknown=True, max_unknown_clients=4)
    for i in range(200):
        e.admit(f"forged{i}", codec.encode(obs(f"forged{i}", 1)), 0.0)
    assert e.snapshot().dropped[TOO_MANY_CLIENTS] == 196
    assert e.admit("robot", codec.encode(obs("robot", 1)), 0.0) is None
    assert "robot" in e.sessions and len(e.sessions) == 5


def test_unknown_place_is_freed_when_the_token_goes_after_the_grace_period():
    e = session_table(accept_unknown=True, max_unknown_clients=1, liveliness_grace_s=2.0, idle_timeout_s=100.0)
    assert e.admit("a", b"x", 0.0) is None
    assert e.admit("b", b"x", 0.0) == TOO_MANY_CLIENTS
    e.on_token("a", False, 1.0)
    assert e.expire(2.9) == []  # still within the grace period
    e.on_token("a", True, 2.0)  # back in time: nothing closes
    assert e.expire(10.0) == []
    e.on_token("a", False, 11.0)
    assert [s.client_id for s in e.expire(13.0)] == ["a"]
    assert e.admit("b", b"x", 13.0) is None
    assert e.snapshot().sessions_closed == {"liveliness": 1}


def test_idle_sessions_expire_and_their_scheduler_state_is_forgotten():
    e = session_table(scheduler="fifo", accept_unknown=True, idle_timeout_s=5.0)
    e.on_token("u", True, 0.0)  # declared before its first observation
    e.admit("robot", codec.encode(obs("robot", 1)), 0.0)
    e.admit("u", codec.encode(obs("u", 1)), 0.0)
    schedule(e, 0.0)  # announced to the scheduler, not served
    assert [s.client_id for s in e.expire(4.0)] == []
    e.admit("robot", codec.encode(obs("robot", 2)), 4.0)
    closed = e.expire(5.5)
    assert [s.client_id for s in closed] == ["u"]
    assert e.scheduler.stats()["waiting"] == 1  # robot only
    assert e.snapshot().closed.received == 1  # u's counts outlive its session


def test_replayed_observations_are_dropped_and_counted():
    e = session_table()
    e.admit("robot", codec.encode(obs("robot", 5)), 0.0)
    assert serve(e, 0.0) == ["robot"]
    for seq in (5, 3, 5):
        e.admit("robot", codec.encode(obs("robot", seq)), 1.0)
        assert serve(e, 1.0) == []
    e.admit("robot", codec.encode(obs("robot", 6)), 2.0)
    assert serve(e, 2.0) == ["robot"]
    assert e.snapshot().sessions["robot"].stats.rejected == {REPLAYED: 3}


def test_replays_are_dropped_before_serving_with_a_scheduler_that_decodes_on_arrival():
    e = session_table(scheduler="wait_ratio")
    e.admit("robot", codec.encode(obs("robot", 5)), 0.0)
    assert serve(e, 0.0) == ["robot"]
    e.admit("robot", codec.encode(obs("robot", 5)), 1.0)
    batch = schedule(e, 1.0)
    assert batch.items == [] and [r[2] for r in batch.rejected] == [REPLAYED]


@pytest.mark.parametrize("nonce", [7, None])
def test_a_resend_of_a_request_still_on_an_engine_is_not_computed_twice(nonce):
    """An edge scheduler picked seq 5 and an engine is computing it; the robot sends seq 5 again (its
    chunk is late): refused as `replayed`, not a second inference. The request, re-queued (its
    engine timed out), is still served; and the robot's next request is too."""
    e = session_table(scheduler="wait_ratio")
    admit(e, obs("robot", 5, nonce=nonce), 0.0)
    batch = schedule(e, 0.0)
    [(session, slot)] = batch.items  # on an engine now: not finished yet
    admit(e, obs("robot", 5, nonce=nonce), 0.5)  # the resend
    again = schedule(e, 0.5)
    assert again.items == [] and [r[2] for r in again.rejected] == [REPLAYED]
    assert "being computed" in again.rejected[0][3]
    assert e.requeue(session, slot)  # the engine timed out: the request itself goes back
    back = schedule(e, 1.0)
    assert [s.client_id for s, _ in back.items] == ["robot"] and back.rejected == []
    e.finish([], ["robot"], 1.1, 0.01)  # ... and failed (no chunk): a resend of it is served, not refused
    admit(e, obs("robot", 5, nonce=nonce), 1.2)
    [(session, _)] = schedule(e, 1.2).items
    e.finish([(session, 5, 10.0, 0.0)], ["robot"], 1.3, 0.01)
    admit(e, obs("robot", 6, nonce=nonce), 1.4)
    assert [s.client_id for s, _ in schedule(e, 1.4).items] == ["robot"]


def test_a_resend_waiting_when_its_request_is_requeued_stands_for_it():
    """Seq 5 is on an engine; its resend waits in the slot when the engine times out: the re-queue
    finds the slot taken, so the resend stands for the request and is served, not refused (a clean
    CI run caught the refusal: the robot was never answered)."""
    e = session_table(scheduler="wait_ratio")
    admit(e, obs("robot", 5), 0.0)
    [(session, slot)] = schedule(e, 0.0).items
    admit(e, obs("robot", 5), 0.5)  # waits in the slot, not announced yet
    assert not e.requeue(session, slot)  # the engine timed out; the slot is taken
    batch = schedule(e, 1.0)
    assert [s.client_id for s, _ in batch.items] == ["robot"] and batch.rejected == []


def test_a_request_refused_after_it_was_picked_is_computed_no_longer():
    """A picked request refused at dispatch (its body unreadable) or by its engine: a resend is served."""
    e = session_table(scheduler="wait_ratio")
    admit(e, obs("robot", 5), 0.0)
    [(session, _)] = schedule(e, 0.0).items
    e.release(session)  # (what admission and dispatch do with a picked request they refuse)
    e.reject(session, "bad_observation", 0.1)
    admit(e, obs("robot", 5), 0.5)
    assert [s.client_id for s, _ in schedule(e, 0.5).items] == ["robot"]


def test_another_observation_refused_while_a_request_computes_leaves_it_computing():
    """Seq 5 is on an engine; an unreadable observation on the robot's key is refused meanwhile (a
    forged packet, say). That refusal is not the computing request's: a resend of seq 5 is still
    `replayed`, not a second inference."""
    e = session_table(scheduler="wait_ratio")
    admit(e, obs("robot", 5), 0.0)
    [(session, _)] = schedule(e, 0.0).items
    e.admit("robot", b"\x00garbage", 0.2)
    refused = schedule(e, 0.2)
    assert refused.items == [] and refused.rejected
    for s, _slot, reason, _detail in refused.rejected:
        e.reject(s, reason, 0.2)
    admit(e, obs("robot", 5), 0.5)
    again = schedule(e, 0.5)
    assert again.items == [] and [r[2] for r in again.rejected] == [REPLAYED]


def test_a_restarted_client_is_served_from_its_first_observation():
    e = session_table()
    e.admit("robot", codec.encode(obs("robot", 50, nonce=1)), 0.0)
    assert serve(e, 0.0) == ["robot"]
    e.admit("robot", codec.encode(obs("robot", 1, nonce=2)), 1.0)
    batch = schedule(e, 1.0)
    session, slot = batch.items[0]
    slot.observation = codec.decode_observation(slot.payload)  # no header: judged once decoded
    assert e.judge(session, slot) is None
    assert e.take_reset(session) and not e.take_reset(session)


def test_a_new_episode_resets_the_session_before_it_is_served():
    e = session_table(scheduler="wait_ratio")
    e.admit("robot", codec.encode(obs("robot", 1, episode="0")), 0.0)
    batch = schedule(e, 0.0)
    assert not e.take_reset(batch.items[0][0])  # the first episode needs no reset
    e.finish([(batch.items[0][0], 1, 1.0, 0.0)], ["robot"], 0.1, 0.1)
    e.admit("robot", codec.encode(obs("robot", 2, episode="0")), 0.2)
    batch = schedule(e, 0.2)
    assert not e.take_reset(batch.items[0][0])
    e.finish([(batch.items[0][0], 2, 1.0, 0.0)], ["robot"], 0.3, 0.1)
    e.admit("robot", codec.encode(obs("robot", 3, episode="1")), 0.4)
    batch = schedule(e, 0.4)
    assert e.take_reset(batch.items[0][0])
    assert "robot" in e.scheduler._tasks  # a new task was started by this arrival, after the reset


def test_oversized_payload_is_rejected_before_taking_a_slot():
    e = session_table(max_message_bytes=10)
    assert e.admit("robot", b"x" * 11, 0.0) == TOO_LARGE
    assert e.sessions["robot"].slot is None
    assert e.snapshot().sessions["robot"].stats.rejected == {TOO_LARGE: 1}


def test_newest_only_slot_counts_superseded():
    e = session_table()
    for seq in (1, 2, 3):
        e.admit("robot", codec.encode(obs("robot", seq)), 0.0)
    batch = schedule(e, 0.0)
    assert codec.decode_observation(batch.items[0][1].payload).seq_id == 3
    assert e.snapshot().sessions["robot"].stats.superseded == 2


def test_undecodable_observation_is_rejected_without_a_seat():
    e = session_table(scheduler="wait_ratio")
    e.admit("robot", b"\x00garbage", 0.0)
    batch = schedule(e, 0.0)
    assert batch.items == [] and batch.rejected[0][2] != REPLAYED


@pytest.mark.parametrize("n", [1, 3])
def test_batch_is_bounded_by_max_batch_size(n):
    e = session_table(listed=("a", "b", "c", "d"), max_batch_size=n)
    for c in "abcd":
        e.admit(c, codec.encode(obs(c, 1)), 0.0)
    assert len(schedule(e, 0.0).items) == n


def test_close_all_frees_everything():
    e = session_table(accept_unknown=True)
    e.admit("robot", b"x", 0.0)
    e.admit("u", b"x", 0.0)
    assert {s.client_id for s in e.close_all()} == {"robot", "u"}
    assert e.sessions == {} and e.snapshot().unknown_open == 0


# -- re-fetch: refreshes of waiting requests (docs/protocol.md §10.7) ----------------------------------


def served_seq(batch) -> list[tuple[str, int]]:
    return [(s.client_id, codec.decode_observation(slot.payload).seq_id) for s, slot in batch.items]


@pytest.mark.parametrize("scheduler", ["fifo", "wait_ratio"])
def test_a_refresh_replaces_its_waiting_request_and_keeps_its_place_in_line(scheduler):
    e = session_table(listed=("a", "b"), scheduler=scheduler)
    assert admit(e, obs("b", 1, buffered=30), 0.0) is None  # b's request waits first...
    assert schedule(e, 0.0) is not None  # (b served: busy)
    e.finish([], ["b"], 0.05, 0.05)
    assert admit(e, obs("b", 2, buffered=3), 0.1) is None  # b's next request
    assert admit(e, obs("a", 1, buffered=3), 0.2) is None  # a asks after it
    # b's fresh capture, refreshing 2, arrives before the inference thread has even seen 2 (busy).
    assert admit(e, obs("b", 3, buffered=2, refreshes=2), 0.3) is None
    batch = schedule(e, 0.35)
    # b still goes first (it waits since 0.1), and is served with the fresher capture.
    assert served_seq(batch) == [("b", 3)]
    snap = e.snapshot().sessions["b"].stats
    assert (snap.refreshes, snap.refreshes_late, snap.superseded) == (1, 0, 1)


class Recording(FifoScheduler):
    """FIFO that records what it hears and serves nobody while `hold` is set."""

    def __init__(self):
        super().__init__()
        self.heard, self.hold = [], True

    def on_arrival(self, client_id, now_s, execution=None):
        self.heard.append((client_id, now_s, None if execution is None else execution.actions_buffered))
        super().on_arrival(client_id, now_s, execution)

    def pick(self, ready, now_s, max_batch=1):
        return [] if self.hold else super().pick(ready, now_s, max_batch)


@pytest.mark.parametrize("announced_first", [True, False])
def test_the_scheduler_hears_a_refresh_as_a_newer_observation_after_its_request(announced_first):
    e = SessionTable(SessionTableConfig(listed=frozenset({"b"})), Recording())
    admit(e, obs("b", 2, buffered=30), 0.2)
    if announced_first:
        schedule(e, 0.25)  # the inference thread saw the request before its refresh replaced it
    admit(e, obs("b", 3, buffered=6, refreshes=2), 0.5)
    e.scheduler.hold = False
    assert served_seq(schedule(e, 0.5)) == [("b", 3)]
    # Either way: the request's arrival (its place in line), then the refresh's newer execution report.
    assert e.scheduler.heard == [("b", 0.2, 30), ("b", 0.5, 6)]


def test_a_refresh_arriving_after_its_request_was_picked_is_dropped_and_counted():
    e = session_table(scheduler="fifo")
    admit(e, obs("robot", 1), 0.0)
    batch = schedule(e, 0.0)
    assert served_seq(batch) == [("robot", 1)]
    # During the inference and after it: never in the slot, never served.
    assert admit(e, obs("robot", 2, refreshes=1), 0.01) == REFRESH_LATE
    e.finish([(batch.items[0][0], 1, 1.0, 0.0)], ["robot"], 0.05, 0.05)
    assert admit(e, obs("robot", 3, refreshes=1), 0.06) == REFRESH_LATE
    assert e.sessions["robot"].slot is None
    assert schedule(e, 0.1) is None
    snap = e.snapshot().sessions["robot"].stats
    assert (snap.refreshes_late, snap.refreshes, snap.received, snap.served) == (2, 0, 1, 1)
    assert snap.rejected == {}  # not a rejection: the client did nothing wrong
    # The next request is served as usual, and refreshes of it are welcome.
    assert admit(e, obs("robot", 4), 0.2) is None
    assert admit(e, obs("robot", 5, refreshes=4), 0.3) is None
    assert served_seq(schedule(e, 0.3)) == [("robot", 5)]


def test_a_refresh_of_an_older_request_than_the_one_waiting_is_dropped():
    e = session_table()
    admit(e, obs("robot", 5), 0.0)
    assert admit(e, obs("robot", 6, refreshes=3), 0.1) == REFRESH_LATE
    assert served_seq(schedule(e, 0.1)) == [("robot", 5)]


def test_a_refresh_of_a_request_never_received_stands_in_for_it():
    e = session_table()
    assert admit(e, obs("robot", 2, refreshes=1), 0.0) is None  # request 1 was lost on the way
    assert served_seq(schedule(e, 0.0)) == [("robot", 2)]


def test_a_restarted_client_is_not_judged_by_its_previous_process_seq_ids():
    e = session_table()
    admit(e, obs("robot", 50, nonce=1), 0.0)
    serve(e, 0.0)
    assert admit(e, obs("robot", 2, nonce=2, refreshes=1), 1.0) is None
    assert served_seq(schedule(e, 1.0)) == [("robot", 2)]


def test_a_header_less_observation_picked_makes_later_refreshes_of_it_late():
    e = session_table()
    e.admit("robot", codec.encode(obs("robot", 1)), 0.0)  # no header: known only once served
    assert serve(e, 0.0) == ["robot"]
    assert admit(e, obs("robot", 2, refreshes=1), 0.1) == REFRESH_LATE


def test_a_malformed_header_is_rejected_with_its_reason_whatever_the_scheduler():
    e = session_table()
    e.admit("robot", codec.encode(obs("robot", 1)), 0.0, *read_header(b"\x02garbage"))
    batch = schedule(e, 0.0)
    assert batch.items == [] and [r[2] for r in batch.rejected] == ["bad_header"]


# -- sessions against a forger (docs/protocol.md §10.5, docs/security.md) -------------------------------


@pytest.mark.parametrize("with_header", [True, False])
def test_a_forged_nonce_less_observation_cannot_poison_a_session_that_has_a_nonce(with_header):
    """The audit's packet: seq_id 2**64-1, no nonce, on a listed robot's key. Refused at once; the
    robot's next request is served and nothing of its session changed."""
    e = session_table()
    send = admit if with_header else (lambda e, o, now: e.admit(o.client_uuid, codec.encode(o), now))
    send(e, obs("robot", 5, nonce=9), 0.0)
    assert serve(e, 0.0) == ["robot"]
    session = e.sessions["robot"]
    send(e, obs("robot", 2**64 - 1, nonce=None, episode="forged"), 0.1)
    assert serve(e, 0.1) == []
    assert (session.nonce, session.last_served_seq, session.episode_id, session.needs_reset) == (9, 5, "0", False)
    send(e, obs("robot", 6, nonce=9), 0.2)
    assert serve(e, 0.2) == ["robot"]
    assert e.snapshot().sessions["robot"].stats.rejected == {NONCE_REQUIRED: 1}


def test_a_forged_observation_before_the_robot_starts_costs_it_nothing():
    """A nonce-less 2**64-1 opens the session and is served; the robot's nonce starts its own count."""
    e = session_table()
    admit(e, obs("robot", 2**64 - 1, nonce=None), 0.0)
    assert serve(e, 0.0) == ["robot"]
    admit(e, obs("robot", 1, nonce=9), 0.5)
    assert serve(e, 0.5) == ["robot"]
    assert e.sessions["robot"].last_served_seq == 1


def test_seq_ids_cannot_jump_beyond_the_bound_and_the_bound_grows_with_time():
    e = session_table()
    admit(e, obs("robot", 10), 0.0)
    assert serve(e, 0.0) == ["robot"]
    admit(e, obs("robot", 2**64 - 1), 0.1)  # the robot's own nonce (a forger who read it)
    assert serve(e, 0.1) == []
    admit(e, obs("robot", 10 + MAX_SEQ_STEP + 101), 0.1)  # 1 s of counting at the bound's rate: 1000 more
    assert serve(e, 0.1) == []
    assert e.snapshot().sessions["robot"].stats.rejected == {SEQ_JUMP: 2}
    admit(e, obs("robot", 11), 0.2)
    assert serve(e, 0.2) == ["robot"]  # the robot was never shut out
    # A client that went unserved for a minute (a failover, a long queue) counted on: still served.
    late = 11 + MAX_SEQ_STEP + int(MAX_SEQ_RATE_HZ * 59)
    admit(e, obs("robot", late), 60.2)
    assert serve(e, 60.2) == ["robot"]
    # The refusals did not cool the robot down: they are not its bad input.
    assert e.rate_limit.blocked("robot", 60.2) is False


def test_a_forged_stream_with_another_nonce_costs_the_robot_one_reset_not_its_service():
    e = session_table()
    admit(e, obs("robot", 10, nonce=1), 0.0)
    assert serve(e, 0.0) == ["robot"]
    for i, seq in enumerate(range(10_000, 10_005)):  # made-up nonce, seq ids moved far ahead
        admit(e, obs("robot", seq, nonce=666), 0.1 + i * 0.01)
        serve(e, 0.1 + i * 0.01)
    admit(e, obs("robot", 11, nonce=1), 0.2)
    batch = schedule(e, 0.2)
    session, slot = batch.items[0]
    assert e.take_reset(session)  # its per-episode state starts again: the cost of a forger in plain mode
    e.finish([(session, 11, 1.0, 0.0)], ["robot"], 0.2, 0.01)


def test_switching_to_made_up_nonces_and_back_does_not_lift_the_bound_on_the_robots_own():
    e = session_table()
    admit(e, obs("robot", 10, nonce=1), 0.0)
    assert serve(e, 0.0) == ["robot"]
    for i in range(20):  # more made-up nonces than a session remembers
        admit(e, obs("robot", 5, nonce=1000 + i), 0.1)
        assert serve(e, 0.1) == ["robot"]
    admit(e, obs("robot", 2**64 - 1, nonce=1), 0.2)  # back on the robot's nonce, far ahead
    assert serve(e, 0.2) == []
    assert e.snapshot().sessions["robot"].stats.rejected == {SEQ_JUMP: 1}
    admit(e, obs("robot", 11, nonce=1), 0.3)
    assert serve(e, 0.3) == ["robot"]
    assert len(e.sessions["robot"].past_nonces) <= 8


def test_a_forged_stream_with_the_robots_nonce_shuts_it_out_until_it_draws_a_new_nonce():
    """Within the bound, a forger who read the robot's nonce moves its count ahead (plain mode
    cannot tell them apart); the client's new nonce after unanswered requests serves it at once."""
    e = session_table()
    admit(e, obs("robot", 10, nonce=1), 0.0)
    assert serve(e, 0.0) == ["robot"]
    admit(e, obs("robot", 500, nonce=1), 0.1)
    assert serve(e, 0.1) == ["robot"]
    for seq in (11, 12, 13):
        admit(e, obs("robot", seq, nonce=1), 0.2)
        assert serve(e, 0.2) == []
    admit(e, obs("robot", 1, nonce=2), 0.3)
    assert serve(e, 0.3) == ["robot"]


def test_a_nonce_less_client_that_restarts_is_served_again_at_once():
    e = session_table()
    e.on_token("robot", True, 0.0)
    for seq in range(1, 51):
        admit(e, obs("robot", seq, nonce=None), seq * 0.01)
        assert serve(e, seq * 0.01) == ["robot"]
    admit(e, obs("robot", 3, nonce=None), 0.6)  # a replay while it runs: refused
    assert serve(e, 0.6) == []
    e.on_token("robot", False, 0.7)  # the process exits: its token goes; the new one declares it again
    e.on_token("robot", True, 0.9)
    admit(e, obs("robot", 1, nonce=None), 1.0)
    batch = schedule(e, 1.0)
    session, slot = batch.items[0]
    assert e.take_reset(session)
    e.finish([(session, 1, 1.0, 0.0)], ["robot"], 1.0, 0.01)
    # Without a token: a restart is told from a replay once nothing was served for the window.
    admit(e, obs("robot", 2, nonce=None), 1.1)
    assert serve(e, 1.1) == ["robot"]
    admit(e, obs("robot", 1, nonce=None), 1.2)
    assert serve(e, 1.2) == []
    admit(e, obs("robot", 1, nonce=None), 1.1 + NONCELESS_REPLAY_WINDOW_S)
    assert serve(e, 1.1 + NONCELESS_REPLAY_WINDOW_S) == ["robot"]
    assert e.snapshot().sessions["robot"].stats.rejected == {REPLAYED: 2}


def test_rejected_observations_do_not_keep_a_session_alive():
    e = session_table(idle_timeout_s=5.0)
    admit(e, obs("robot", 10), 0.0)
    assert serve(e, 0.0) == ["robot"]
    for t in range(1, 8):  # replays, and nonce-less forgeries, once a second
        admit(e, obs("robot", 3), float(t))
        admit(e, obs("robot", 2**64 - 1, nonce=None), t + 0.5)
        serve(e, t + 0.5)
    assert [s.closed_reason for s in e.expire(7.6)] == ["idle"]


def test_an_unknown_id_that_never_declares_a_token_frees_its_place_after_the_grace():
    e = session_table(accept_unknown=True, max_unknown_clients=2, liveliness_grace_s=1.0, idle_timeout_s=60.0)
    e.on_token("visitor", True, 0.0)  # a real client declares its token before its first observation
    assert admit(e, obs("visitor", 1), 0.1) is None
    assert admit(e, obs("invented1", 1), 0.1) is None
    assert serve(e, 0.1)
    assert e.expire(5.0) == []  # nobody else wants a place: a client without a token keeps its session
    assert admit(e, obs("invented2", 1), 5.0) == TOO_MANY_CLIENTS
    assert sorted(s.client_id for s in e.expire(5.1)) == ["invented1"]  # not the visitor, whose token is there
    assert admit(e, obs("invented2", 1), 5.2) is None  # the place is free again
    assert e.snapshot().sessions_closed == {"no_token": 1}
    assert admit(e, obs("invented3", 1), 5.3) == TOO_MANY_CLIENTS
    assert e.expire(6.1) == []  # invented2's grace is not over yet
    e.on_token("invented2", True, 6.15)  # a token seen keeps it
    assert admit(e, obs("invented3", 1), 6.3) == TOO_MANY_CLIENTS
    assert e.expire(7.0) == []
    # Tokens of ids without a session are remembered, boundedly.
    for i in range(10_000):
        e.on_token(f"t{i}", True, 2.0)
    assert e.roster.tokens_remembered <= 4096


def test_rank_then_take_records_a_decision_only_when_taken_and_never_takes_an_unjudged_slot():
    """The edge scheduler ranks under the table's lock, places outside it, then takes what it placed;
    the wait-ratio scheduler counts the rest as skipped only then."""
    e = session_table(("a", "b", "c"), scheduler="wait_ratio")
    for client in ("a", "b", "c"):
        assert admit(e, obs(client, 1), 0.0) is None
    ranking = e.rank(0.1)
    assert sorted(ranking.order) == ["a", "b", "c"] and set(ranking.sizes) == {"a", "b", "c"}
    assert e.scheduler.decisions == 0  # ranking records nothing
    assert admit(e, obs("c", 2), 0.15) is None  # c's slot holds a newer, not yet judged observation
    batch = e.take(["a", "c"], ranking, 0.2)
    assert [s.client_id for s, _ in batch.items] == ["a"]  # c waits for the next round
    assert e.scheduler.decisions == 1
    assert e.scheduler._tasks["b"].skipped == 1 and e.scheduler._tasks["a"].skipped == 0
    again = e.rank(0.3)
    assert sorted(again.order) == ["b", "c"]


def test_opened_sessions_are_handed_to_the_log_once_and_boundedly():
    e = session_table(("robot",), accept_unknown=True, max_unknown_clients=500)
    assert admit(e, obs("robot", 1), 0.0) is None
    assert admit(e, obs("guest", 1), 0.0) is None
    assert e.take_opened() == [("robot", True), ("guest", False)]
    assert e.take_opened() == []
    for i in range(200):
        admit(e, obs(f"x{i}", 1), 0.0)
    assert len(e.take_opened()) == 64  # a flood of new ids logs a bounded number of lines
