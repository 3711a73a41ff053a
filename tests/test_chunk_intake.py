"""The chunk intake (scheduling/chunk_intake.py) with a fake clock: times are passed in, nothing sleeps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer, LatestOnlyConfig
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake, MergeMode, estimate_delay_steps
from lerobot_zenoh.scheduling.send_trigger import SendTrigger, SendTriggerConfig

DT = 0.1  # 10 Hz keeps the arithmetic readable


def chunk(rows, first_value=0.0, dim=2):
    """Rows whose first column is first_value, first_value + 1, ... (so a row shows its index)."""
    values = np.arange(rows, dtype=np.float32) + first_value
    return np.stack([values] + [np.zeros(rows, np.float32)] * (dim - 1), axis=1)


def make(max_actions=None, aggregate=None):
    trigger = SendTrigger(dt_s=DT)
    return ChunkIntake(trigger, DT, max_actions=max_actions), ActionBuffer(aggregate or LatestOnlyConfig())


def pop(buffer, n):
    return [buffer.pop() for _ in range(n)]


def test_the_first_chunk_is_applied_whole_and_its_rtt_measured():
    intake, buffer = make()
    intake.on_send(1, buffer.next_step, 0.0)
    r = intake.on_chunk(1, chunk(10), 0.35, buffer)
    assert r.accepted and r.rtt_s == pytest.approx(0.35)
    assert (r.capture_step, r.first_step, r.expired, r.rows, r.kept) == (0, 0, 0, 10, 10)
    assert r.merge.appended == 10 and buffer.depth == 10 and r.trimmed_steps == 0
    assert intake.trigger.stats().answered == 1


def test_later_chunks_lose_int_rtt_over_dt_leading_rows():
    intake, buffer = make()
    intake.on_send(1, 0, 0.0)
    intake.on_chunk(1, chunk(10), 0.1, buffer)  # the first RTT is now known
    pop(buffer, 2)  # steps 0, 1 executed
    intake.on_send(2, buffer.next_step, 1.0)  # captured at step 2
    pop(buffer, 3)  # steps 2, 3, 4 executed while it travels
    r = intake.on_chunk(2, chunk(10, first_value=100), 1.34, buffer)  # rtt 0.34: int(3.4) = 3
    assert (r.capture_step, r.delay_steps, r.expired, r.first_step, r.rows) == (2, 3, 3, 5, 7)
    assert buffer.pop() == (5, pytest.approx(np.array([103, 0], np.float32)))


def test_the_trim_is_capped_by_the_steps_actually_executed():
    intake, buffer = make()
    intake.on_send(1, 0, 0.0)
    intake.on_chunk(1, chunk(2), 0.1, buffer)
    pop(buffer, 2)  # the buffer is now empty: the robot holds still
    intake.on_send(2, buffer.next_step, 1.0)
    r = intake.on_chunk(2, chunk(10, first_value=100), 1.5, buffer)  # rtt 0.5 s = 5 steps, none executed
    assert (r.delay_steps, r.expired, r.first_step, r.rows) == (0, 0, 2, 10)
    assert buffer.pop()[1][0] == 100  # row 0: the robot lost nothing while it held


def test_horizon_cut_max_actions_then_execution_horizon():
    intake, buffer = make(max_actions=8)
    intake.on_send(1, 0, 0.0)
    r = intake.on_chunk(1, chunk(20), 0.1, buffer, execution_horizon=5)
    assert (r.kept, r.horizon_cut, r.rows) == (5, 3, 5)  # 20 -> 8 (client's cap) -> 5 (server's horizon)
    intake.on_send(2, buffer.next_step, 1.0)
    r = intake.on_chunk(2, chunk(20), 1.1, buffer, execution_horizon=0)  # 0 would be nothing: keep 1
    assert (r.kept, r.horizon_cut) == (1, 7)
    intake.on_send(3, buffer.next_step, 2.0)
    r = intake.on_chunk(3, chunk(4), 2.1, buffer, execution_horizon=30)  # a horizon past the end cuts nothing
    assert (r.kept, r.horizon_cut) == (4, 0)


def test_unknown_duplicate_and_cleared_answers_are_rejected_but_measured():
    intake, buffer = make()
    r = intake.on_chunk(7, chunk(3), 1.0, buffer)
    assert not r.accepted and r.reason == "unknown_seq" and r.rtt_s is None and buffer.depth == 0
    intake.on_send(1, 0, 0.0)
    assert intake.on_chunk(1, chunk(3), 0.2, buffer).accepted
    assert intake.on_chunk(1, chunk(3), 0.3, buffer).reason == "unknown_seq"  # a duplicate
    intake.on_send(2, 0, 1.0)
    assert intake.clear() == 1 and intake.pending == 0  # a new episode
    r = intake.on_chunk(2, chunk(3), 1.25, buffer)
    assert r.reason == "unknown_seq" and r.rtt_s == pytest.approx(0.25)  # its round trip was real


def test_a_chunk_the_buffer_refuses_is_rejected_with_its_reason_and_changes_nothing():
    intake, buffer = make()
    intake.on_send(1, 0, 0.0)
    bad = chunk(4)
    bad[2, 0] = np.nan
    r = intake.on_chunk(1, bad, 0.1, buffer)
    assert not r.accepted and r.reason == "non_finite" and r.merge is None and buffer.depth == 0


def test_pending_capture_steps_are_bounded_oldest_first():
    trigger = SendTrigger(dt_s=DT)
    intake = ChunkIntake(trigger, DT, max_pending=3)
    for seq in range(1, 6):
        intake.on_send(seq, seq, float(seq))
    assert intake.pending == 3
    buffer = ActionBuffer()
    assert intake.on_chunk(2, chunk(2), 9.0, buffer).reason == "unknown_seq"
    assert intake.on_chunk(5, chunk(2), 9.0, buffer).accepted


def test_plan_without_a_buffer_makes_the_same_decisions():
    a, buffer = make(max_actions=12)
    b = ChunkIntake(SendTrigger(dt_s=DT), DT, max_actions=12)
    for intake in (a, b):
        intake.on_send(1, 0, 0.0)
    a.on_chunk(1, chunk(20), 0.1, buffer)
    b.plan(1, 20, 0.1, next_step=0)
    pop(buffer, 4)
    for intake in (a, b):
        intake.on_send(2, 4, 1.0)
    pop(buffer, 3)
    merged = a.on_chunk(2, chunk(20), 1.25, buffer, execution_horizon=9)
    planned = b.plan(2, 20, 1.25, next_step=7, execution_horizon=9)
    fields = ("accepted", "rtt_s", "capture_step", "delay_steps", "kept", "horizon_cut", "expired", "first_step", "rows")
    assert [getattr(merged, f) for f in fields] == [getattr(planned, f) for f in fields]
    assert planned.merge is None and (planned.expired, planned.first_step, planned.rows) == (2, 6, 7)


def test_a_chunk_answering_a_refresh_is_aligned_to_the_refresh_and_timed_from_the_first_send():
    trigger = SendTrigger(SendTriggerConfig(refetch_after_s=0.25, request_timeout_s=5.0), dt_s=DT)
    intake, buffer = ChunkIntake(trigger, DT), ActionBuffer(LatestOnlyConfig())
    intake.on_send(1, 0, 0.0)
    intake.on_chunk(1, chunk(20), 0.1, buffer)  # the first RTT is known
    pop(buffer, 2)
    intake.on_send(2, buffer.next_step, 1.0)  # request 2, captured at step 2
    pop(buffer, 2)
    assert trigger.refresh_due(1.25) == 2
    assert intake.on_refresh(3, 2, buffer.next_step, 1.25)  # refresh 3, captured at step 4
    pop(buffer, 1)  # step 4 executed while it waits
    r = intake.on_chunk(3, chunk(10, first_value=100), 1.375, buffer)
    # RTT from the request's first send (0.375 s: int(3.75) = 3 rows), capped by the one step
    # executed since the refresh's capture: row 1 of the chunk is step 5.
    assert r.accepted and r.rtt_s == pytest.approx(0.375) and r.request_seq == 2
    assert (r.capture_step, r.delay_steps, r.expired, r.first_step) == (4, 1, 1, 5)
    assert r.capture_age_s == pytest.approx(0.125)
    assert buffer.pop() == (5, pytest.approx(np.array([101, 0], np.float32)))
    # The request is answered: an answer to the request itself (a second inference) is unknown.
    assert intake.on_chunk(2, chunk(10), 1.5, buffer).reason == "unknown_seq"
    assert intake.pending == 0


def test_a_refresh_of_an_answered_request_is_not_remembered():
    trigger = SendTrigger(SendTriggerConfig(refetch_after_s=0.1, request_timeout_s=5.0), dt_s=DT)
    intake, buffer = ChunkIntake(trigger, DT), ActionBuffer(LatestOnlyConfig())
    intake.on_send(1, 0, 0.0)
    assert trigger.refresh_due(0.1) == 1
    intake.on_chunk(1, chunk(5), 0.1, buffer)  # answered between refresh_due and the capture
    assert not intake.on_refresh(2, 1, 0, 0.1)
    assert intake.pending == 0 and trigger.stats().refreshes == 0


def test_bad_settings_name_the_field():
    trigger = SendTrigger(dt_s=DT)
    with pytest.raises(ConfigError, match="actions_per_chunk"):
        ChunkIntake(trigger, DT, max_actions=0)
    with pytest.raises(ConfigError, match="max_pending"):
        ChunkIntake(trigger, DT, max_pending=0)
    with pytest.raises(ValueError):
        ChunkIntake(trigger, DT, mode="telepathy")
    assert ChunkIntake(trigger, DT, mode="blend").mode is MergeMode.BLEND


# -- properties over random timelines -------------------------------------------------------------


timelines = st.lists(
    st.tuples(
        st.integers(0, 6),  # steps popped before the send
        st.integers(1, 8),  # steps popped while the chunk travels
        st.floats(0.0, 1.5),  # round trip, s
        st.integers(1, 25),  # chunk rows
        st.none() | st.integers(0, 30),  # execution horizon
    ),
    min_size=1, max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(timelines, st.none() | st.integers(1, 20))
def test_rows_are_accounted_for_and_nothing_executed_is_merged(timeline, max_actions):
    intake, buffer = make(max_actions=max_actions)
    now, seq, rtt_known = 0.0, 0, False
    for before, during, rtt_s, rows, horizon in timeline:
        pop(buffer, before)
        seq += 1
        captured = buffer.next_step
        intake.on_send(seq, captured, now)
        pop(buffer, during)
        delay = buffer.next_step - captured
        now += rtt_s
        r = intake.on_chunk(seq, chunk(rows), now, buffer, execution_horizon=horizon)
        assert r.accepted and r.capture_step == captured and r.delay_steps == delay >= 0
        assert r.rtt_s == pytest.approx(rtt_s)
        # every row is either cut by a horizon, trimmed as expired, dropped as stale by the buffer, or merged
        cap = rows if max_actions is None else min(rows, max_actions)
        assert r.kept + r.horizon_cut == cap and 1 <= r.kept <= cap
        assert r.expired + r.rows == r.kept
        assert r.rows == r.merge.discarded_stale + r.merge.blended + r.merge.appended
        # the trim: int(rtt/dt), none before the first RTT, never more than the robot executed
        want = 0 if not rtt_known else min(int(r.rtt_s / DT), delay, r.kept)
        assert r.expired == want and r.first_step == captured + want
        # with the buffer's own stale rows, exactly the rows for executed steps are dropped
        assert r.trimmed_steps == min(delay, r.kept)
        # and the robot's next action is this chunk's row for that step (latest_only: the newest wins)
        executed_before = buffer.stats().popped_steps
        popped = buffer.pop()
        if delay < r.kept:
            assert popped[0] == captured + delay and popped[1][0] == delay
        else:  # the whole chunk was in the past: none of it entered the buffer
            assert r.merge.blended + r.merge.appended == 0
        assert buffer.stats().popped_steps == executed_before + (popped is not None)
        rtt_known = True
        now += 0.01


# -- real-time chunking (mode rtc) ----------------------------------------------------------------


def make_rtc(**kw):
    trigger = SendTrigger(dt_s=DT)
    return ChunkIntake(trigger, DT, mode=MergeMode.RTC, **kw), ActionBuffer(LatestOnlyConfig())


def test_rtc_replaces_from_the_actual_start_without_trim_or_blend():
    intake, buffer = make_rtc()
    intake.on_send(1, 0, 0.0, predicted_delay_steps=0)
    intake.on_chunk(1, chunk(10), 0.1, buffer, rtc_delay_steps=0)  # the RTT is now known (0.1 s)
    pop(buffer, 2)
    step, leftover = buffer.leftover()
    assert step == 2 and leftover[:, 0].tolist() == list(range(2, 10))
    intake.on_send(2, step, 1.0, predicted_delay_steps=3)
    pop(buffer, 4)  # one more step than predicted ran while it travelled
    new = chunk(12, first_value=100)
    r = intake.on_chunk(2, new, 1.45, buffer, rtc_delay_steps=3)  # rtt 0.45: a blend would trim int(4.5) = 4
    assert r.accepted and r.mode is MergeMode.RTC and r.expired == 0 and r.first_step == 2
    assert (r.predicted_delay_steps, r.actual_delay_steps, r.delay_error_steps, r.server_delay_steps) == (3, 4, 1, 3)
    # rows 0..3 were for steps executed meanwhile; rows 4.. replace everything buffered from step 6
    assert (r.merge.discarded_stale, r.merge.appended, r.merge.blended, r.merge.replaced) == (4, 8, 0, 4)
    assert r.trimmed_steps == 4
    _, after = buffer.leftover()
    np.testing.assert_array_equal(after, new[4:])  # exactly the chunk's rows, nothing blended, nothing old


def test_rtc_without_the_echo_is_blended_and_says_so():
    intake, buffer = make_rtc()
    intake.on_send(1, 0, 0.0, predicted_delay_steps=0)
    intake.on_chunk(1, chunk(10), 0.1, buffer)  # no echo: blend mode (first chunk, whole)
    pop(buffer, 2)
    intake.on_send(2, 2, 1.0, predicted_delay_steps=3)
    pop(buffer, 3)
    r = intake.on_chunk(2, chunk(10, first_value=100), 1.34, buffer)
    assert r.mode is MergeMode.BLEND and r.expired == 3 and r.merge.replaced == 0 and r.merge.blended == 5
    assert r.predicted_delay_steps == 3 and r.actual_delay_steps == 3


def test_rtc_an_answer_older_than_the_chunk_in_use_is_superseded():
    intake, buffer = make_rtc()
    intake.on_send(1, 0, 0.0, predicted_delay_steps=0)
    intake.on_send(2, 0, 0.05, predicted_delay_steps=0)
    assert intake.on_chunk(2, chunk(5, first_value=200), 0.2, buffer, rtc_delay_steps=0).accepted
    r = intake.on_chunk(1, chunk(5, first_value=100), 0.3, buffer, rtc_delay_steps=0)
    assert not r.accepted and r.reason == "superseded" and buffer.leftover()[1][0, 0] == 200
    intake.clear()  # a new episode forgets it
    intake.on_send(1, 0, 1.0, predicted_delay_steps=0)
    assert intake.on_chunk(1, chunk(5), 1.1, buffer, rtc_delay_steps=0).accepted


def test_the_delay_prediction_is_ceil_of_the_rtt_quantile_in_steps_clamped():
    intake, _ = make_rtc(initial_delay_steps=4)
    assert intake.predict_delay_steps(10) == 4 and intake.predict_delay_steps(2) == 2  # before any RTT
    for seq, rtt_s in enumerate([0.21, 0.22, 0.23, 0.24, 0.25, 0.26, 0.27, 0.28, 0.29, 0.41], start=1):
        intake.trigger.on_send(seq, 0.0)
        intake.trigger.on_receive(seq, rtt_s)
    q90 = intake.trigger.rtt.quantile_s(0.9)  # the send trigger's rtt_quantile
    assert q90 == pytest.approx(0.302) and intake.predict_delay_steps(50) == math.ceil(q90 / DT) == 4
    assert intake.predict_delay_steps(1) == 1 and intake.predict_delay_steps(0) == 0
    assert ChunkIntake(intake.trigger, DT, delay_quantile=1.0).predict_delay_steps(50) == 5  # ceil(0.41 / 0.1)
    assert estimate_delay_steps(0.2, DT, initial_steps=0, max_steps=9) == 2  # an exact multiple is not rounded up
    assert estimate_delay_steps(None, DT, initial_steps=7, max_steps=5) == 5
    with pytest.raises(ConfigError, match="rtc.initial_delay_steps"):
        ChunkIntake(intake.trigger, DT, initial_delay_steps=-1)
    with pytest.raises(ConfigError, match="rtc.delay_quantile"):
        ChunkIntake(intake.trigger, DT, delay_quantile=1.5)


@settings(max_examples=200, deadline=None)
@given(timelines)
def test_rtc_the_robot_executes_its_leftover_then_the_new_chunk_from_its_actual_start(timeline):
    """Whatever the timing: the actions executed while a chunk travels are the leftover sent with its
    observation, and from the merge on the robot executes exactly that chunk's rows from the actual delay."""
    intake, buffer = make_rtc()
    now, seq = 0.0, 0
    for before, during, rtt_s, rows, horizon in timeline:
        pop(buffer, before)
        seq += 1
        captured, leftover = buffer.leftover()
        predicted = intake.predict_delay_steps(len(leftover))
        intake.on_send(seq, captured, now, predicted_delay_steps=predicted)
        executed = [a for _, a in filter(None, pop(buffer, during))]
        actual = buffer.next_step - captured
        assert actual == len(executed) <= len(leftover)
        np.testing.assert_array_equal(np.array(executed, np.float32).reshape(-1, 2), leftover[:actual].reshape(-1, 2))
        now += rtt_s
        new = chunk(rows, first_value=1000 * seq)
        r = intake.on_chunk(seq, new, now, buffer, execution_horizon=horizon, rtc_delay_steps=predicted)
        assert r.accepted and r.mode is MergeMode.RTC and r.expired == 0
        assert r.actual_delay_steps == actual and r.delay_error_steps == actual - predicted
        assert 0 <= predicted <= len(leftover)
        _, after = buffer.leftover()
        if actual < r.kept:
            np.testing.assert_array_equal(after, new[actual:r.kept])  # replaced, not blended
        else:  # the chunk was all in the past: the buffer is as it was
            assert r.merge.appended == 0 and r.merge.replaced == 0
        now += 0.01
