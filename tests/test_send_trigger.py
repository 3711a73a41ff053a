"""Send trigger and RTT bookkeeping, driven by a fake clock (plain floats passed as now_s)."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer, LatestOnlyConfig
from lerobot_zenoh.scheduling.send_trigger import (
    RttTracker,
    SendTrigger,
    SendTriggerConfig,
    expired_steps,
)

DT = 1 / 30


# --------------------------------------------------------------------------- expired_steps


def test_expired_steps():
    assert expired_steps(None, DT) == 0
    assert expired_steps(0.0, DT) == 0
    assert expired_steps(-0.5, DT) == 0
    assert expired_steps(0.1, 0.03) == 3
    assert expired_steps(0.029, 0.03) == 0
    with pytest.raises(ValueError):
        expired_steps(0.1, 0.0)


# --------------------------------------------------------------------------- RttTracker


def test_rtt_deletes_only_the_exact_key_so_out_of_order_replies_are_measured():
    rtt = RttTracker()
    rtt.on_send(1, 10.0)
    rtt.on_send(2, 10.1)
    rtt.on_send(3, 10.2)
    assert rtt.on_receive(3, 10.5) == pytest.approx(0.3)
    assert rtt.in_flight == 2
    assert rtt.on_receive(1, 10.6) == pytest.approx(0.6)  # older, arrived later: still measured
    assert rtt.is_in_flight(2) and not rtt.is_in_flight(1)
    assert rtt.last_rtt_s == pytest.approx(0.6)
    assert rtt.on_receive(1, 10.7) is None  # duplicate
    assert rtt.unknown_responses == 1
    assert rtt.measured == 2


def test_rtt_table_is_bounded_oldest_dropped():
    rtt = RttTracker(max_in_flight=3)
    for seq in range(5):
        rtt.on_send(seq, float(seq))
    assert rtt.in_flight == 3
    assert rtt.evicted == 2
    assert rtt.on_receive(0, 9.0) is None
    assert rtt.on_receive(4, 9.0) == pytest.approx(5.0)


def test_rtt_percentiles_over_a_rolling_window():
    rtt = RttTracker(window=10)
    assert rtt.p50_s is None and rtt.p99_s is None and rtt.last_rtt_s is None
    for seq in range(20):  # RTTs 0.00 .. 0.19; the window keeps 0.10 .. 0.19
        rtt.on_send(seq, 100.0)
        rtt.on_receive(seq, 100.0 + seq / 100)
    assert rtt.p50_s == pytest.approx(0.145)
    assert rtt.quantile_s(0.0) == pytest.approx(0.10)
    assert rtt.quantile_s(1.0) == pytest.approx(0.19)
    assert rtt.p90_s == pytest.approx(0.181)
    assert 0.18 < rtt.p99_s <= 0.19


def test_rtt_percentiles_are_cached_until_the_next_sample():
    """The send rule reads p90 every control period; it is recomputed only when a sample arrives."""
    rtt = RttTracker(window=10)
    for i in range(5):
        rtt.on_send(i, 0.0)
        rtt.on_receive(i, 0.1 * (i + 1))
    p90 = rtt.p90_s
    assert rtt.p90_s == p90 == pytest.approx(np.quantile([0.1, 0.2, 0.3, 0.4, 0.5], 0.9))
    rtt.on_send(9, 0.0)
    rtt.on_receive(9, 5.0)
    assert rtt.p90_s == pytest.approx(np.quantile([0.1, 0.2, 0.3, 0.4, 0.5, 5.0], 0.9))
    assert rtt.p50_s == pytest.approx(0.35)


def test_automatic_buffer_time_follows_the_configured_rtt_quantile():
    p90 = SendTrigger(dt_s=DT)
    p99 = SendTrigger(SendTriggerConfig(rtt_quantile=0.99), dt_s=DT)
    for trigger in (p90, p99):
        for seq in range(100):  # RTTs 10 ms .. 1 s
            trigger.on_send(seq, 0.0)
            trigger.on_receive(seq, (seq + 1) / 100)
    assert p90.buffer_time_s() == pytest.approx(np.quantile(np.arange(1, 101) / 100, 0.9) + DT)
    assert p99.buffer_time_s() == pytest.approx(np.quantile(np.arange(1, 101) / 100, 0.99) + DT)
    with pytest.raises(ConfigError, match="rtt_quantile"):
        SendTriggerConfig(rtt_quantile=0.2)


def test_rtt_rejects_mixed_clocks_and_bad_settings():
    rtt = RttTracker()
    rtt.on_send(1, 5.0)
    with pytest.raises(ValueError):
        rtt.on_receive(1, 4.0)
    assert rtt.is_in_flight(1)  # kept: a later, valid reply can still be measured
    assert rtt.forget(1) and not rtt.forget(1)
    with pytest.raises(ConfigError):
        RttTracker(window=0)


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["send", "recv"]), st.integers(0, 20), st.floats(0, 0.5)), max_size=60
    ),
    cap=st.integers(1, 8),
)
def test_rtt_table_matches_a_reference_dict(events, cap):
    rtt = RttTracker(max_in_flight=cap)
    reference: dict[int, float] = {}
    now = 0.0
    for kind, seq, advance in events:
        now += advance
        if kind == "send":
            reference.pop(seq, None)
            reference[seq] = now
            while len(reference) > cap:
                del reference[next(iter(reference))]
            rtt.on_send(seq, now)
        else:
            expected = now - reference.pop(seq) if seq in reference else None
            got = rtt.on_receive(seq, now)
            assert got == expected
        assert rtt.in_flight == len(reference) <= cap


# --------------------------------------------------------------------------- SendTrigger


def test_fixed_buffer_time_rule():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=0.2, max_in_flight=5), dt_s=0.05)
    assert trigger.should_send(queue_size=3, now_s=0.0)  # 0.15 s < 0.2 s
    decision = trigger.decide(queue_size=4, now_s=0.0)  # 0.20 s, not below
    assert not decision and decision.reason == "buffer_ok"
    assert decision.buffered_s == pytest.approx(0.2)
    assert trigger.decide(0, 0.0).reason == "buffer_low"


def test_max_in_flight_and_reply_frees_the_slot():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0), dt_s=DT)
    assert trigger.should_send(0, 0.0)
    trigger.on_send(7, 0.0)
    decision = trigger.decide(0, 0.1)
    assert not decision.send and decision.reason == "in_flight_full" and decision.outstanding == 1
    assert trigger.on_receive(7, 0.25) == pytest.approx(0.25)
    assert trigger.should_send(0, 0.26)
    assert trigger.stats().answered == 1


def test_two_in_flight():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0, max_in_flight=2), dt_s=DT)
    trigger.on_send(1, 0.0)
    assert trigger.should_send(0, 0.01)
    trigger.on_send(2, 0.01)
    assert not trigger.should_send(0, 0.02)


def test_lost_request_frees_its_slot_after_the_timeout():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0, request_timeout_s=0.5), dt_s=DT)
    trigger.on_send(1, 0.0)
    assert not trigger.should_send(0, 0.49)
    assert trigger.should_send(0, 0.5)
    stats = trigger.stats()
    assert (stats.presumed_lost, stats.outstanding) == (1, 0)
    trigger.on_send(2, 0.5)
    # The reply to 1 arrives late: measured and counted, but it does not free 2's slot.
    assert trigger.on_receive(1, 0.7) == pytest.approx(0.7)
    assert trigger.stats().late_replies == 1
    assert trigger.outstanding(0.7) == 1


def test_forget_outstanding_frees_every_slot_and_keeps_rtt():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0, max_in_flight=2), dt_s=DT)
    trigger.on_send(1, 0.0)
    trigger.on_receive(1, 0.1)
    trigger.on_send(2, 0.2)
    trigger.on_send(3, 0.3)
    assert not trigger.should_send(0, 0.35)
    assert trigger.forget_outstanding() == 2
    assert trigger.should_send(0, 0.35)
    assert trigger.on_receive(3, 0.5) == pytest.approx(0.2)  # still measured, counted as late
    stats = trigger.stats()
    assert (stats.presumed_lost, stats.late_replies, stats.rtt_p50_s) == (2, 1, pytest.approx(0.15))


def test_automatic_buffer_time_follows_rtt_p90_plus_one_period():
    cfg = SendTriggerConfig(initial_buffer_time_s=0.4)
    trigger = SendTrigger(cfg, dt_s=DT)
    assert trigger.buffer_time_s() == pytest.approx(0.4)
    assert trigger.request_timeout_s() == pytest.approx(1.0)
    for seq in range(10):
        trigger.on_send(seq, seq * 1.0)
        trigger.on_receive(seq, seq * 1.0 + 0.2)
    assert trigger.buffer_time_s() == pytest.approx(0.2 + DT)
    assert trigger.request_timeout_s() == pytest.approx(1.0)  # 3 * 0.2 < 1 s floor
    for seq in range(10, 20):
        trigger.on_send(seq, seq * 1.0)
        trigger.on_receive(seq, seq * 1.0 + 0.5)
    assert trigger.request_timeout_s() == pytest.approx(1.5)
    stats = trigger.stats()
    assert stats.rtt_last_s == pytest.approx(0.5)
    assert stats.sent == stats.answered == 20


# --------------------------------------------------------------------------- re-fetch (protocol.md §10.7)


def test_refetch_is_off_by_default():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0), dt_s=DT)
    trigger.on_send(1, 0.0)
    assert trigger.refresh_due(0.9) is None


def test_a_waiting_request_is_due_every_refetch_after_s_until_answered():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0, refetch_after_s=0.1, request_timeout_s=1.0), dt_s=DT)
    trigger.on_send(1, 0.0)
    assert trigger.refresh_due(0.09) is None
    assert trigger.refresh_due(0.1) == 1
    assert trigger.on_refresh(2, 1, 0.1)
    assert trigger.refresh_due(0.15) is None  # counted from the last publication, not the first send
    assert trigger.refresh_due(0.2) == 1 and trigger.on_refresh(3, 1, 0.2)
    assert not trigger.should_send(0, 0.25)  # a refresh holds no slot of its own: still one in flight
    assert trigger.request_of(3) == 1 and trigger.request_of(1) == 1
    # The chunk answers the refresh 2: the request is answered, the RTT runs from its first send.
    assert trigger.on_receive(2, 0.3) == pytest.approx(0.3)
    assert trigger.refresh_due(0.5) is None and trigger.should_send(0, 0.3)
    assert not trigger.on_refresh(4, 1, 0.5)  # answered meanwhile: nothing to refresh
    assert trigger.on_receive(3, 0.31) is None  # a second answer to the same request is not measured
    stats = trigger.stats()
    assert (stats.sent, stats.answered, stats.refreshes, stats.rtt_last_s) == (1, 1, 2, pytest.approx(0.3))


def test_refreshes_stop_when_the_request_times_out_from_its_first_send():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0, refetch_after_s=0.25, request_timeout_s=0.875), dt_s=DT)
    trigger.on_send(1, 0.0)
    for k, now in enumerate((0.25, 0.5, 0.75)):
        assert trigger.refresh_due(now) == 1 and trigger.on_refresh(10 + k, 1, now)
    assert trigger.refresh_due(1.0) is None  # 1 s after the first send: presumed lost
    assert trigger.stats().presumed_lost == 1
    assert trigger.on_receive(12, 1.25) == pytest.approx(1.25)  # a late answer to a refresh: its request's RTT
    assert trigger.stats().late_replies == 1


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("send_trigger.buffer_time_s", {"buffer_time_s": 0.0}),
        ("send_trigger.max_in_flight", {"max_in_flight": 0}),
        ("send_trigger.request_timeout_s", {"request_timeout_s": -1.0}),
        ("send_trigger.margin_steps", {"margin_steps": -1.0}),
        ("send_trigger.refetch_after_s", {"refetch_after_s": -0.1}),
    ],
)
def test_bad_settings_name_the_field(field, kwargs):
    with pytest.raises(ConfigError) as excinfo:
        SendTriggerConfig(**kwargs)
    assert excinfo.value.field == field


# --------------------------------------------------------------------------- closed-loop simulation


def simulate(trigger: SendTrigger, latency_s, steps: int, chunk_len: int = 50, drop=lambda seq: False):
    """A 30 Hz control loop against a server with the given latency, in simulated time.

    Each period: deliver replies due by now, decide and maybe send (observation tagged with the
    step about to execute), pop one action. Returns (empty pops after the first reply, sends).
    """
    buffer = ActionBuffer(LatestOnlyConfig())
    pending: list[tuple[float, int, int]] = []  # (arrival time, seq, first_step)
    seq, sends, empty_after_first, got_first = 0, [], 0, False
    for k in range(steps):
        now = k * trigger.dt_s
        while pending and pending[0][0] <= now:
            _, reply_seq, first_step = heapq.heappop(pending)
            trigger.on_receive(reply_seq, now)
            buffer.merge(np.zeros((chunk_len, 1), np.float32), first_step)
            got_first = True
        if trigger.should_send(len(buffer), now):
            trigger.on_send(seq, now)
            sends.append(now)
            if not drop(seq):
                heapq.heappush(pending, (now + latency_s(seq), seq, buffer.next_step))
            seq += 1
        if buffer.pop() is None and got_first:
            empty_after_first += 1
    return empty_after_first, sends


def test_automatic_buffer_time_keeps_the_buffer_fed():
    rng = np.random.default_rng(0)
    jitter = rng.uniform(0.0, 0.01, size=10_000)
    trigger = SendTrigger(SendTriggerConfig(), dt_s=DT)
    empty, sends = simulate(trigger, lambda seq: 0.12 + jitter[seq], steps=3000)
    assert empty == 0
    # One send per chunk's worth of actions consumed, roughly (not one per period).
    assert len(sends) < 3000 / 30


def test_a_too_small_fixed_buffer_time_runs_dry():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=0.02), dt_s=DT)
    empty, _ = simulate(trigger, lambda seq: 0.12, steps=3000)
    assert empty > 0


def test_dropped_observations_do_not_stall_sending():
    trigger = SendTrigger(SendTriggerConfig(), dt_s=DT)
    empty, sends = simulate(trigger, lambda seq: 0.1, steps=600, drop=lambda seq: seq % 3 == 0)
    assert len(sends) > 10
    # After a dropped observation (seq 0, 3, 6, ...) the next one leaves one timeout later.
    after_drop = [sends[i + 1] - sends[i] for i in range(0, len(sends) - 1, 3)]
    assert max(after_drop) <= trigger.request_timeout_s() + DT + 1e-9
    assert trigger.stats().presumed_lost > 0


@settings(max_examples=50, deadline=None)
@given(
    max_in_flight=st.integers(1, 4),
    events=st.lists(
        st.tuples(st.sampled_from(["tick", "reply"]), st.integers(0, 60), st.floats(0, 0.3)), max_size=80
    ),
)
def test_outstanding_never_exceeds_max_in_flight(max_in_flight, events):
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=10.0, max_in_flight=max_in_flight), dt_s=DT)
    now, seq, sent_at = 0.0, 0, {}
    for kind, value, advance in events:
        now += advance
        if kind == "tick":
            decision = trigger.decide(value, now)
            assert decision.outstanding <= max_in_flight
            if decision.send:
                trigger.on_send(seq, now)
                sent_at[seq] = now
                seq += 1
        elif sent_at:
            trigger.on_receive(value % seq, now)
        assert trigger.outstanding(now) <= max_in_flight
    # Every request older than the timeout has been released.
    timeout = trigger.request_timeout_s()
    assert trigger.outstanding(now + timeout + 1e-9) == 0


def test_max_rate_hz_caps_sends_even_with_an_empty_buffer():
    trig = SendTrigger(SendTriggerConfig(buffer_time_s=0.5, max_in_flight=4, max_rate_hz=5.0), dt_s=1 / 30)
    assert trig.decide(0, 0.0).send
    trig.on_send(1, 0.0)
    assert trig.decide(0, 0.1).reason == "rate_cap"
    assert trig.decide(0, 0.199).reason == "rate_cap"
    assert trig.decide(0, 0.2).send
    with pytest.raises(ConfigError, match="max_rate_hz"):
        SendTriggerConfig(max_rate_hz=0.0)
