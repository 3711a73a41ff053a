"""What one engine is running, as the scheduler that dispatched to it knows it (pure).

The one copy of the placement bookkeeping: the edge scheduler (`server/dispatch/dispatcher.py`) keeps an
`EngineLoad` per engine, and the fleet model (`benchmarks/studies/fleet.py`) keeps the same object
per simulated engine, so the rule the model validates is the rule the server runs.

A dispatch adds a *group* (the requests sent together, and when they are expected to reach the
engine); an answer removes its request and tells when the engine was last seen free; a request
taken back (timeout, partition, restart) is removed without that. `busy_until_s`, what placement
reads (`EngineView.busy_until_s`), is recomputed from what is still outstanding after every change
(`placement.expected_busy_until_s`): an estimate corrected by every answer, never a running sum of
the batch latencies dispatched.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from lerobot_zenoh.scheduling.placement import BatchProfile, expected_busy_until_s

__all__ = ["EngineLoad"]


@dataclass
class _Group:
    arrival_s: float  # expected arrival at the engine
    keys: set = field(default_factory=set)


class EngineLoad:
    """Outstanding groups of one engine and the estimate of when it is done with them.

    >>> load = EngineLoad(BatchProfile({1: 0.1, 2: 0.12}), capacity=2)
    >>> load.dispatched(["a"], sent_s=0.0, arrival_s=0.05); round(load.busy_until_s, 3)
    0.15
    >>> load.dispatched(["b"], sent_s=0.06, arrival_s=0.11); round(load.busy_until_s, 3)
    0.25
    >>> load.answered("a", free_s=0.14); round(load.busy_until_s, 3), load.running
    (0.24, 1)
    """

    def __init__(self, profile: BatchProfile, capacity: int):
        self.profile = profile
        self.capacity = capacity
        self.free_s = 0.0  # when the engine was last known free
        self.busy_until_s = 0.0
        self._groups: list[_Group] = []
        self._group_of: dict[Hashable, _Group] = {}

    @property
    def running(self) -> int:
        """Requests dispatched and neither answered nor taken back."""
        return len(self._group_of)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._group_of

    def dispatched(self, keys: Iterable[Hashable], sent_s: float, arrival_s: float) -> None:
        """A group sent at `sent_s`, expected at the engine at `arrival_s`. An engine with nothing
        outstanding is taken to be free from `sent_s` on."""
        group = _Group(arrival_s, set(keys))
        if not group.keys:
            return
        if not self._groups:
            self.free_s = max(self.free_s, sent_s)
        for key in group.keys:
            if key in self._group_of:
                raise ValueError(f"request {key!r} is outstanding already")
            self._group_of[key] = group
        self._groups.append(group)
        self._update()

    def answered(self, key: Hashable, free_s: float) -> bool:
        """The answer to `key` is back; the engine was free (done with its batch) at `free_s`.
        False when `key` was not outstanding (nothing changes)."""
        if not self._remove(key):
            return False
        self.free_s = max(self.free_s, free_s)
        self._update()
        return True

    def withdrawn(self, key: Hashable) -> bool:
        """`key` will not be answered (timed out, its engine down or restarted): no longer counted."""
        if not self._remove(key):
            return False
        self._update()
        return True

    def reset(self, profile: BatchProfile | None = None, capacity: int | None = None) -> None:
        """Nothing outstanding (a restarted engine); optionally a new profile and capacity."""
        self._groups.clear()
        self._group_of.clear()
        if profile is not None:
            self.profile = profile
        if capacity is not None:
            self.capacity = capacity
        self.free_s = self.busy_until_s = 0.0

    def _remove(self, key: Hashable) -> bool:
        group = self._group_of.pop(key, None)
        if group is None:
            return False
        group.keys.discard(key)
        if not group.keys:
            self._groups.remove(group)
        return True

    def _update(self) -> None:
        self.busy_until_s = expected_busy_until_s([(g.arrival_s, len(g.keys)) for g in self._groups], self.free_s,
                                                  self.profile, self.capacity)
