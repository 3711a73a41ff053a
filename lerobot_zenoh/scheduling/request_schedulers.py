"""The built-in request schedulers (round robin, FIFO; wait ratio in wait_ratio.py), registered under
their names, and `make_scheduler`. The interface they implement and the registry are declared in
scheduler_interface.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from pydantic import ValidationError

from lerobot_zenoh.config import config_error
from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol.messages import ExecutionInfo
from lerobot_zenoh.scheduling.scheduler_interface import (
    SCHEDULERS,
    RequestScheduler,
    SchedulerConfig,
    SchedulerType,
    register_scheduler,
    scheduler_type,
)
from lerobot_zenoh.scheduling.wait_ratio import WaitRatioConfig, WaitRatioScheduler

__all__ = ["SCHEDULERS", "FifoScheduler", "RequestScheduler", "RoundRobinScheduler", "SchedulerConfig",
           "SchedulerType", "WaitRatioScheduler", "make_scheduler", "register_scheduler", "scheduler_type"]


class RoundRobinStats(TypedDict):
    clients: int  # clients in the rotation


class FifoStats(TypedDict):
    waiting: int  # clients with an unserved observation


class RoundRobinScheduler:
    """Serve ready clients in a fixed rotation: after serving X, the next ready client after X.

    Fair under load: with N clients always ready, each is served once every N inferences.
    """

    name = "round_robin"
    needs_execution_info = False

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config if config is not None else SchedulerConfig()
        self._order: list[str] = []  # clients in order of first appearance
        self._last: str | None = None

    def on_arrival(self, client_id: str, now_s: float, execution: ExecutionInfo | None = None) -> None:
        if client_id not in self._order:
            self._order.append(client_id)

    def rank(self, ready: Sequence[str], now_s: float) -> list[str]:
        ready_set = set(ready)
        for client_id in ready:
            self.on_arrival(client_id, now_s)
        if not ready_set:
            return []
        start = self._order.index(self._last) + 1 if self._last in self._order else 0
        rotation = self._order[start:] + self._order[:start]
        return [c for c in rotation if c in ready_set]

    def took(self, chosen: Sequence[str], ranked: Sequence[str], now_s: float) -> None:
        pass  # the rotation moves on when they are served (`on_served`)

    def pick(self, ready: Sequence[str], now_s: float, max_batch: int = 1) -> list[str]:
        return self.rank(ready, now_s)[:max_batch]

    def on_served(self, client_ids: Sequence[str], now_s: float, duration_s: float) -> None:
        if client_ids:
            self._last = client_ids[-1]

    def forget(self, client_id: str) -> None:
        if client_id in self._order:
            if self._last == client_id:
                i = self._order.index(client_id)
                self._last = self._order[i - 1] if i > 0 and len(self._order) > 1 else None
            self._order.remove(client_id)

    def stats(self) -> RoundRobinStats:
        return {"clients": len(self._order)}


class FifoScheduler:
    """Serve the client whose waiting observation arrived first (oldest first)."""

    name = "fifo"
    needs_execution_info = False

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config if config is not None else SchedulerConfig()
        self._arrival_s: dict[str, float] = {}

    def on_arrival(self, client_id: str, now_s: float, execution: ExecutionInfo | None = None) -> None:
        # A newer observation replaces an older one in its slot but keeps its place in line:
        # the client has been waiting since its first unserved arrival.
        self._arrival_s.setdefault(client_id, now_s)

    def rank(self, ready: Sequence[str], now_s: float) -> list[str]:
        return sorted(ready, key=lambda c: (self._arrival_s.get(c, now_s), c))

    def took(self, chosen: Sequence[str], ranked: Sequence[str], now_s: float) -> None:
        pass  # served ones leave the line in `on_served`

    def pick(self, ready: Sequence[str], now_s: float, max_batch: int = 1) -> list[str]:
        return self.rank(ready, now_s)[:max_batch]

    def on_served(self, client_ids: Sequence[str], now_s: float, duration_s: float) -> None:
        for client_id in client_ids:
            self._arrival_s.pop(client_id, None)

    def forget(self, client_id: str) -> None:
        self._arrival_s.pop(client_id, None)

    def stats(self) -> FifoStats:
        return {"waiting": len(self._arrival_s)}


def make_scheduler(name: str, field: str = "scheduler", **settings: Any) -> RequestScheduler:
    """The scheduler registered as `name`, built with `settings` (e.g. wait_ratio's `buckets`)
    validated by its config class. ConfigError naming `field` (or ``field.<setting>``)."""
    kind = scheduler_type(name, field)
    try:
        config = kind.validate(settings)
    except ValidationError as exc:
        raise config_error(exc, field) from None
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from None
    return kind.build(config)


register_scheduler(RoundRobinScheduler.name, RoundRobinScheduler)
register_scheduler(FifoScheduler.name, FifoScheduler)
register_scheduler(WaitRatioScheduler.name, WaitRatioScheduler, WaitRatioConfig)
