import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.request_schedulers import FifoScheduler, RoundRobinScheduler, make_scheduler

pytestmark = pytest.mark.core  # the pure serving core: make test-core


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
    assert info.value.field == "server.m.scheduler.colour"  # no type takes it: named on the key itself


# -- the interface and the registry -----------------------------------------------------------------


def test_every_builtin_declares_the_interface_and_reports_its_declared_stats():
    from typing import get_type_hints

    from lerobot_zenoh.scheduling.request_schedulers import SCHEDULERS, RequestScheduler
    from lerobot_zenoh.scheduling.scheduler_interface import SchedulerConfig

    assert set(SCHEDULERS) >= {"round_robin", "fifo", "wait_ratio"}
    members = [n for n in vars(RequestScheduler) if not n.startswith("_")] + list(RequestScheduler.__annotations__)
    for name in ("round_robin", "fifo", "wait_ratio"):  # (others may be registered by other tests)
        kind = SCHEDULERS[name]
        assert issubclass(kind.config_class, SchedulerConfig)
        s = kind.build()
        assert s.name == name and isinstance(s.needs_execution_info, bool)
        for member in members:
            assert hasattr(s, member), (name, member)
        s.on_arrival("a", 0.0)
        assert s.pick(["a"], 0.0) == ["a"]
        s.on_served(["a"], 0.1, 0.1)
        declared = get_type_hints(type(s).stats)["return"]
        assert set(s.stats()) == set(get_type_hints(declared)), name  # the TypedDict it declares
        s.forget("a")


def _lottery_type():
    from pydantic import Field

    from lerobot_zenoh.scheduling.scheduler_interface import SchedulerConfig

    class LotteryConfig(SchedulerConfig):
        tickets: int = Field(3, ge=1, strict=True)
        seed: int = 0

    class Lottery:
        """A third party's scheduler: the highest ticket draw goes first."""

        name = "lottery"
        needs_execution_info = False

        def __init__(self, config: LotteryConfig):
            self.config = config
            self.draws = 0

        def on_arrival(self, client_id, now_s, execution=None):
            pass

        def pick(self, ready, now_s, max_batch=1):
            import random

            self.draws += 1
            order = sorted(ready, key=lambda c: random.Random(f"{self.config.seed}{c}").randrange(self.config.tickets))
            return order[:max_batch]

        def on_served(self, client_ids, now_s, duration_s):
            pass

        def forget(self, client_id):
            pass

        def stats(self):
            return {"draws": self.draws}

    return Lottery, LotteryConfig


@pytest.fixture
def lottery():
    from lerobot_zenoh.scheduling.request_schedulers import SCHEDULERS, register_scheduler

    scheduler_cls, config_cls = _lottery_type()
    register_scheduler("lottery", scheduler_cls, config_cls)
    try:
        yield scheduler_cls
    finally:
        SCHEDULERS.pop("lottery", None)


def test_a_registered_scheduler_gets_its_settings_validated_by_its_own_config_class(lottery):
    from lerobot_zenoh.scheduling.request_schedulers import register_scheduler

    s = make_scheduler("lottery", tickets=5, seed=2)
    assert isinstance(s, lottery) and (s.config.tickets, s.config.seed) == (5, 2)
    assert make_scheduler("lottery").config.tickets == 3  # its default
    with pytest.raises(ConfigError) as info:
        make_scheduler("lottery", "server.m.scheduler", tickets=0)
    assert info.value.field == "server.m.scheduler.tickets"
    with pytest.raises(ConfigError) as info:
        make_scheduler("lottery", "server.m.scheduler", buckets=4)  # wait_ratio's
    assert info.value.field == "server.m.scheduler" and "its settings: seed, tickets" in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_scheduler("fifo", "server.m.scheduler", tickets=4)  # a plugin's setting on another type
    assert info.value.field == "server.m.scheduler"
    with pytest.raises(ValueError, match="already registered"):
        register_scheduler("lottery", lottery)
    with pytest.raises(TypeError, match="SchedulerConfig subclass"):
        register_scheduler("other", lottery, dict)
