"""Server-side request schedulers: which waiting client the inference loop serves next.

A scheduler is a pure decision object (no I/O, no clock of its own: `now_s` is passed in), driven
by the inference loop through four calls:

    on_arrival(client_id, now_s, execution)   a new observation landed in the client's slot
    pick(ready, now_s, max_batch) -> [ids]    choose whom to serve now (ready = clients with a slot);
                                              with `choose`, the scheduler orders every ready client
                                              and `choose(order)` says which of them go now (the
                                              edge scheduler's placement across engines)
    on_served(client_ids, now_s, duration_s)  the inference for them finished
    forget(client_id)                         the client is gone

New policies register in SCHEDULERS and plug in without touching the loop; their constructor's
keyword arguments are their settings (`make_scheduler(name, field, **settings)`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Protocol

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol.messages import ExecutionInfo


#: Given every ready client in the scheduler's order, those to serve now (a subset, in order).
Choose = Callable[[list[str]], list[str]]


class RequestScheduler(Protocol):
    name: str

    def on_arrival(self, client_id: str, now_s: float, execution: ExecutionInfo | None = None) -> None: ...

    def pick(self, ready: Sequence[str], now_s: float, max_batch: int = 1,
             choose: Choose | None = None) -> list[str]: ...

    def on_served(self, client_ids: Sequence[str], now_s: float, duration_s: float) -> None: ...

    def forget(self, client_id: str) -> None: ...

    def stats(self) -> dict[str, float | int]: ...


class RoundRobinScheduler:
    """Serve ready clients in a fixed rotation: after serving X, the next ready client after X.

    Fair under load: with N clients always ready, each is served once every N inferences.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._order: list[str] = []  # clients in order of first appearance
        self._last: str | None = None

    def on_arrival(self, client_id: str, now_s: float, execution: ExecutionInfo | None = None) -> None:
        if client_id not in self._order:
            self._order.append(client_id)

    def pick(self, ready: Sequence[str], now_s: float, max_batch: int = 1,
             choose: Choose | None = None) -> list[str]:
        ready_set = set(ready)
        for client_id in ready:
            self.on_arrival(client_id, now_s)
        if not ready_set:
            return []
        start = self._order.index(self._last) + 1 if self._last in self._order else 0
        rotation = self._order[start:] + self._order[:start]
        order = [c for c in rotation if c in ready_set]
        return choose(order) if choose is not None else order[:max_batch]

    def on_served(self, client_ids: Sequence[str], now_s: float, duration_s: float) -> None:
        if client_ids:
            self._last = client_ids[-1]

    def forget(self, client_id: str) -> None:
        if client_id in self._order:
            if self._last == client_id:
                i = self._order.index(client_id)
                self._last = self._order[i - 1] if i > 0 and len(self._order) > 1 else None
            self._order.remove(client_id)

    def stats(self) -> dict[str, float | int]:
        return {"clients": len(self._order)}


class FifoScheduler:
    """Serve the client whose waiting observation arrived first (oldest first)."""

    name = "fifo"

    def __init__(self) -> None:
        self._arrival_s: dict[str, float] = {}

    def on_arrival(self, client_id: str, now_s: float, execution: ExecutionInfo | None = None) -> None:
        # A newer observation replaces an older one in its slot but keeps its place in line:
        # the client has been waiting since its first unserved arrival.
        self._arrival_s.setdefault(client_id, now_s)

    def pick(self, ready: Sequence[str], now_s: float, max_batch: int = 1,
             choose: Choose | None = None) -> list[str]:
        order = sorted(ready, key=lambda c: (self._arrival_s.get(c, now_s), c))
        return choose(order) if choose is not None else order[:max_batch]

    def on_served(self, client_ids: Sequence[str], now_s: float, duration_s: float) -> None:
        for client_id in client_ids:
            self._arrival_s.pop(client_id, None)

    def forget(self, client_id: str) -> None:
        self._arrival_s.pop(client_id, None)

    def stats(self) -> dict[str, float | int]:
        return {"waiting": len(self._arrival_s)}


from lerobot_zenoh.scheduling.wait_ratio import WaitRatioScheduler  # noqa: E402  (imports nothing from here)

SCHEDULERS: dict[str, Callable[..., RequestScheduler]] = {
    RoundRobinScheduler.name: RoundRobinScheduler,
    FifoScheduler.name: FifoScheduler,
    WaitRatioScheduler.name: WaitRatioScheduler,
}


def make_scheduler(name: str, field: str = "scheduler", **settings) -> RequestScheduler:
    """The scheduler registered as `name`, built with `settings` (e.g. wait_ratio's `buckets`).

    ConfigError naming `field` for an unknown name or a setting the scheduler does not take; a bad
    value is the scheduler's own ConfigError.
    """
    factory = SCHEDULERS.get(name)
    if factory is None:
        raise ConfigError(field, f"unknown scheduler {name!r}; choose one of {', '.join(sorted(SCHEDULERS))}")
    try:
        inspect.signature(factory).bind(**settings)
    except TypeError as exc:
        raise ConfigError(field, f"{name}: {exc}") from None
    return factory(**settings)
