"""The standby's judgement of its primary from heartbeats of served work (pure, fake clock)."""

from __future__ import annotations

from lerobot_zenoh.server.model.failover import Beat, ServedWorkWatch, ServingRole


def beat(served=0, waiting=0, serving=True, slowest=0.02, incarnation="a", replaces=None):
    return Beat("gpu0", incarnation, serving, served, waiting, slowest, replaces)


def test_a_primary_never_heard_is_judged_by_its_token_alone():
    watch = ServedWorkWatch(takeover_after_s=1.0)
    watch.on_work(0.0)
    assert watch.verdict(100.0) is None


def test_an_idle_primary_is_never_taken_over_even_when_silent():
    watch = ServedWorkWatch(takeover_after_s=1.0)
    watch.on_beat(beat(served=5, waiting=0), 0.0)
    assert watch.verdict(0.5) is None
    assert watch.verdict(60.0) is None  # frozen or gone quiet, but nobody waits: nothing to prove


def test_a_silent_primary_with_work_pending_is_stalled():
    watch = ServedWorkWatch(takeover_after_s=1.0)
    watch.on_beat(beat(served=5, waiting=0), 0.0)
    watch.on_work(0.3)  # a robot's observation reached the standby
    assert watch.verdict(0.9) is None
    assert "no heartbeat" in watch.verdict(1.1)
    # The same once it said it had work waiting, before it went silent.
    watch = ServedWorkWatch(takeover_after_s=1.0)
    watch.on_beat(beat(served=5, waiting=1), 0.0)
    assert watch.verdict(1.1) is not None


def test_a_primary_idle_for_long_then_asked_is_taken_over_as_soon_as_work_arrives():
    watch = ServedWorkWatch(takeover_after_s=1.0)
    watch.on_beat(beat(served=5, waiting=0), 0.0)
    assert watch.verdict(30.0) is None
    watch.on_work(30.0)
    assert watch.verdict(30.1) is not None  # silent for 30 s: it cannot be inside a batch (heartbeats go on)


def test_a_stuck_loop_whose_heartbeats_go_on_is_stalled_after_the_limit():
    watch = ServedWorkWatch(takeover_after_s=1.0)
    for k in range(10):  # serving: the counter moves
        watch.on_beat(beat(served=k, waiting=1), k * 0.1)
    for k in range(10, 30):  # stuck: beats go on, waiting, the counter stands still
        watch.on_beat(beat(served=9, waiting=1), k * 0.1)
        if k * 0.1 <= 1.9:
            assert watch.verdict(k * 0.1) is None, k
    assert "nothing served" in watch.verdict(2.95)


def test_a_slow_model_does_not_flap_a_stuck_one_does():
    """Turns of 2 s: heartbeats go on while the batch runs, the counter moves every 2 s; the
    limit is 3 x the slowest turn (6 s), so no takeover. A turn that never ends is caught after 6 s."""
    watch = ServedWorkWatch(takeover_after_s=1.0, slack=3.0)
    t, served = 0.0, 0
    while t < 20.0:
        if int(t * 10) % 20 == 0:
            served += 1
        watch.on_beat(beat(served=served, waiting=2, slowest=2.0), t)
        assert watch.verdict(t) is None, t
        t = round(t + 0.1, 1)
    while t < 26.5:
        watch.on_beat(beat(served=served, waiting=2, slowest=2.0), t)
        t = round(t + 0.1, 1)
    assert watch.verdict(t) is not None


def test_a_primary_in_its_hand_over_grace_is_not_judged():
    watch = ServedWorkWatch(takeover_after_s=1.0)
    watch.on_beat(beat(serving=False, waiting=3), 0.0)
    watch.on_work(0.1)
    assert watch.verdict(5.0) is None


def test_beat_round_trips_through_the_codec():
    b = beat(served=7, waiting=2, slowest=0.25, replaces="gpu0/x")
    assert Beat.decode(b.encode(3, 1.5)) == b
    assert Beat.decode(beat().encode(1, 0.1)).replaces is None


def test_a_standby_that_replaced_a_stalled_primary_ignores_its_token_and_steps_back_for_a_restart():
    role = ServingRole("gpu1:app", "gpu0", incarnation="s")
    role.take_over_stalled("old", "test")
    assert role.active.is_set() and role.replaced == "gpu0/old" and role.takeovers == role.takeovers_stalled == 1
    role.on_primary(True)  # the frozen process's token (re)appears: it is the one replaced
    assert role.active.is_set()
    role.on_primary_incarnation("old")
    assert role.active.is_set()
    role.on_primary_incarnation("new")  # a restarted primary
    assert not role.active.is_set() and role.replaced is None and role.stepped_back == 1
    role.on_primary(False)  # a later death is taken over by the token as before
    assert role.active.is_set() and role.takeovers == 2 and role.takeovers_stalled == 1  # told apart


def test_answers_wait_for_a_recent_heartbeat_tick_and_the_hold():
    role = ServingRole("gpu0:app", None)
    role.start_primary(False, 0.0)
    assert role.may_serve(10.0)  # no heartbeat thread: not gated
    role.beat_tick_s = 10.0
    assert role.may_serve(10.5) and not role.may_serve(11.5)  # woke before the heartbeat thread did
    role.hold_until_s = 12.0
    role.beat_tick_s = 11.9
    assert not role.may_serve(11.95) and role.may_serve(12.0)


def test_a_watch_that_forgets_judges_nothing_until_the_next_heartbeat():
    """A standby that stepped back for a restarted primary must not judge it by the heartbeats of
    the process it had replaced: it waits for the new one's first heartbeat."""
    watch = ServedWorkWatch()
    watch.on_beat(beat(served=5, waiting=2), 0.0)
    assert watch.verdict(5.0) is not None  # silent for 5 s with work waiting
    watch.forget()
    assert watch.verdict(5.0) is None and watch.last is None
    watch.on_beat(beat(served=0, waiting=0, incarnation="b"), 5.1)
    assert watch.verdict(5.5) is None


def test_a_heartbeat_out_of_range_or_too_large_is_refused():
    import pytest

    from lerobot_zenoh.errors import ProtocolError
    from lerobot_zenoh.server.model.failover import MAX_BEAT_BYTES

    assert Beat.decode(beat(served=3, waiting=1).encode(1, 1.0)).served == 3
    for bad in (beat(slowest=float("nan")), beat(slowest=float("inf")), beat(slowest=-1.0), beat(waiting=-2)):
        with pytest.raises(ProtocolError):
            Beat.decode(bad.encode(1, 1.0))
    with pytest.raises(ProtocolError, match="bytes"):
        Beat.decode(b"\x00" * (MAX_BEAT_BYTES + 1))


def test_a_heartbeat_whose_counts_are_not_finite_is_refused_not_a_crash():
    """A forged heartbeat with `served: NaN` or an infinite count once raised ValueError/OverflowError
    from int() in the heartbeat thread, which died: failover by served work was gone."""
    import pytest

    from lerobot_zenoh.errors import ProtocolError
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import Telemetry

    for name in ("serving", "served", "waiting", "slowest_turn_s"):
        for value in (float("nan"), float("inf"), float("-inf")):
            metrics = {"serving": 1, "served": 1, "waiting": 0, "slowest_turn_s": 0.1, name: value}
            forged = codec.encode(Telemetry("server", "gpu9", 1, 1.0, 0.1, metrics=metrics, labels={"incarnation": "x"}))
            with pytest.raises(ProtocolError):
                Beat.decode(forged)
