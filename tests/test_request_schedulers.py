import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.request_schedulers import FifoScheduler, RoundRobinScheduler, make_scheduler


def drive(scheduler, ready_each_turn, turns):
    served = []
    t = 0.0
    for _ in range(turns):
        for c in ready_each_turn:
            scheduler.on_arrival(c, t)
        chosen = scheduler.pick(ready_each_turn, t, 1)
        scheduler.on_served(chosen, t + 0.01, 0.01)
        served += chosen
        t += 0.02
    return served


def test_round_robin_rotates_over_always_ready_clients():
    assert drive(RoundRobinScheduler(), ["a", "b", "c"], 7) == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_clients_that_are_not_ready():
    s = RoundRobinScheduler()
    for c in "abc":
        s.on_arrival(c, 0)
    s.on_served(["a"], 0, 0)
    assert s.pick(["a", "c"], 0) == ["c"]
    s.on_served(["c"], 0, 0)
    assert s.pick(["a", "b"], 0) == ["a"]


def test_round_robin_forget_keeps_rotation():
    s = RoundRobinScheduler()
    for c in "abc":
        s.on_arrival(c, 0)
    s.on_served(["b"], 0, 0)
    s.forget("b")
    assert s.pick(["a", "c"], 0) == ["c"]


def test_fifo_serves_oldest_waiting_first_even_if_superseded():
    s = FifoScheduler()
    s.on_arrival("a", 1.0)
    s.on_arrival("b", 0.5)
    s.on_arrival("a", 2.0)  # a newer observation does not reset a's place in line
    assert s.pick(["a", "b"], 3.0) == ["b"]
    s.on_served(["b"], 3.0, 0.1)
    s.on_arrival("b", 3.1)
    assert s.pick(["a", "b"], 3.2) == ["a"]


def test_batch_pick_respects_max_batch():
    assert RoundRobinScheduler().pick(["a", "b", "c"], 0, max_batch=2) == ["a", "b"]
    assert len(FifoScheduler().pick(["a", "b", "c"], 0, max_batch=2)) == 2


def test_unknown_scheduler_names_the_field():
    with pytest.raises(ConfigError, match="scheduler"):
        make_scheduler("lottery")


def test_make_scheduler_passes_settings_and_rejects_ones_it_does_not_take():
    s = make_scheduler("wait_ratio", buckets=4, aging=2, first_request="mean")
    assert (s.buckets, s.aging, s.first_request) == (4, 2, "mean")
    with pytest.raises(ConfigError) as info:
        make_scheduler("fifo", "server.m.scheduler", buckets=4)
    assert info.value.field == "server.m.scheduler" and "buckets" in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_scheduler("wait_ratio", "server.m.scheduler", colour="red")
    assert info.value.field == "server.m.scheduler"
