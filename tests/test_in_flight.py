"""The in-flight table (scheduling/in_flight.py) with a fake clock: times are passed in."""

from __future__ import annotations

import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.in_flight import InFlightTable
from lerobot_zenoh.scheduling.send_trigger import SendTrigger, SendTriggerConfig


def test_one_record_holds_send_time_slot_and_captures_of_a_request_and_its_refreshes():
    table = InFlightTable()
    table.add_request(1, 0.0, step=5, predicted_delay_steps=2, nonce=7)
    assert table.add_refresh(2, 1, 0.2, step=11)
    record = table.get(1)
    assert (record.sent_s, record.published_s, record.nonce, record.refreshes) == (0.0, 0.2, 7, 1)
    assert table.outstanding == 1 and table.captures == 2 and table.request_of(2) == 1
    answer = table.answer(2, 0.5)
    assert (answer.request_seq, answer.rtt_s, answer.slot, answer.capture.step) == (1, 0.5, "answered", 11)
    assert len(table) == 0 and table.outstanding == 0 and table.request_of(2) == 2  # everything of it gone
    assert table.answer(1, 0.6).slot == "unknown" and not table.add_refresh(3, 1, 0.6)


def test_timed_out_requests_free_their_slot_and_are_still_answered_late():
    table = InFlightTable()
    table.add_request(1, 0.0, step=0)
    table.add_request(2, 0.5, step=3)
    assert table.expire(1.2, 1.0) == [1] and table.outstanding == 1
    assert not table.add_refresh(3, 1, 1.2)  # no refresh of a request presumed lost
    late = table.answer(1, 1.3)
    assert late.slot == "late" and late.rtt_s == pytest.approx(1.3) and late.capture.step == 0
    assert table.forget_outstanding() == [2] and table.answer(2, 2.0).slot == "late"


def test_forgotten_captures_still_time_the_answer():
    table = InFlightTable()
    table.add_request(1, 0.0, step=0)
    assert table.forget_captures() == 1 and table.captures == 0
    answer = table.answer(1, 0.25)
    assert answer.rtt_s == pytest.approx(0.25) and answer.capture is None


def test_records_are_bounded_and_expire():
    table = InFlightTable(max_requests=3, max_age_s=10.0, max_refreshes=2)
    for seq in range(5):
        table.add_request(seq, float(seq))
    assert len(table) == 3 and table.evicted == 2 and 0 not in table and 4 in table
    for refresh in range(10, 15):
        assert table.add_refresh(refresh, 4, 4.5)
    assert table.get(4).refreshes == 2 and table.request_of(10) == 10 and table.request_of(14) == 4
    table.add_request(20, 13.5)  # 2 leaves for the bound, then 3, sent 10 s or more before, for its age
    assert sorted(s for s in (2, 3, 4, 20) if s in table) == [4, 20] and (table.evicted, table.expired) == (3, 1)
    table.expire(15.0, 100.0)  # any call that looks at the clock drops what is too old
    assert 4 not in table and table.expired == 2


def test_mixed_clocks_change_nothing():
    table = InFlightTable()
    table.add_request(1, 5.0)
    with pytest.raises(ValueError):
        table.answer(1, 4.0)
    assert 1 in table and table.outstanding == 1


def test_bad_bounds_name_the_field():
    with pytest.raises(ConfigError, match="max_requests"):
        InFlightTable(max_requests=0)
    with pytest.raises(ConfigError, match="max_age_s"):
        InFlightTable(max_age_s=0.0)


def test_the_trigger_counts_requests_unanswered_in_a_row():
    trigger = SendTrigger(SendTriggerConfig(buffer_time_s=1.0, request_timeout_s=1.0), dt_s=0.1)
    for seq, t in ((1, 0.0), (2, 1.0), (3, 2.0)):
        trigger.on_send(seq, t)
        trigger.outstanding(t + 1.0)
    assert trigger.unanswered_in_a_row == 3 and trigger.stats().unanswered_in_a_row == 3
    trigger.on_send(4, 3.5)
    trigger.on_receive(4, 3.6)  # one answer ends the streak
    assert trigger.unanswered_in_a_row == 0
    trigger.on_send(5, 4.0)
    trigger.outstanding(5.0)
    trigger.reset_unanswered()
    assert trigger.unanswered_in_a_row == 0 and trigger.stats().presumed_lost == 4
