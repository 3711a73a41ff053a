"""Execution-aware request scheduling by wait ratio (Kairos' Algorithm 1; docs/scheduling.md).

A robot's request is urgent or not depending on what the robot is doing, not on when the request
arrived: one that still has a second of actions buffered can wait, one about to run dry cannot.
This scheduler keeps, per task (a client's episode), the history Kairos needs to measure how much
the task has been delayed compared with an ideal schedule, and serves the most delayed first.

A task starts with the first request of a client it holds no state for. The server's session calls
`forget(client_id)` when the client's episode changes (a new `Observation.episode_id`) or its
session closes, so the client's next request starts a new task; the scheduler itself does not
look at episode ids.

Per task, on the server's clock only (no clock is shared with the robot):

- generation intervals ``G_j = [start, end]`` of inference, from `on_served`;
- execution intervals ``E_j``, reconstructed on the arrival of the request for round ``j+1`` from
  the durations it reports (`ExecutionInfo`): ``E_j.end = arrival + actions_buffered * dt``
  (the robot runs dry then if nothing new arrives); ``E_j.start = G_j.end`` (the chunk cannot
  have started before it was computed; network time is ignored);
- the wait ``W_j`` between rounds ``j`` and ``j+1``, recorded when ``G_{j+1}`` ends, on the
  dominant side of round ``j`` (Kairos Fig. 8): generation-dominated (``|G_j| >= |E_j|``):
  ``G_{j+1}.start - G_j.end``; execution-dominated: ``E_{j+1}.start - E_j.end``, where
  ``E_{j+1}.start = max(E_j.end, G_{j+1}.end)``, i.e. how long the robot stood with nothing to do.

Decision (`pick`), for every ready request:

1. wait ratio ``w = sum(W) / (now - task start)``, bucket ``b = min(B-1, floor(w * B))``;
2. aging: a request skipped ``s >= A`` times moves up ``s // A`` buckets (capped at ``B-1``). Kairos
   writes ``ceil(s / A)``, which jumps two buckets at ``s = A + 1``; its text ("after every A
   skipped rounds, promoted by one bucket") is what is implemented;
3. buckets from highest to lowest; inside a bucket, longest estimated execution first, the estimate
   ``|E_last| * (1 + s)`` (so a generation-dominated task, whose ``|E_last|`` is small, still ages);
4. the first ``max_batch`` are dispatched (skip counter reset), every other ready request's skip
   counter grows by one. `pick` therefore records a decision: call it once per dispatch.

A task with no recorded wait yet (its first two requests: ``W_0`` needs ``G_1``) has ``sum(W) = 0``;
`first_request` says where it ranks. ``"literal"`` (the default) is Algorithm 1 read as written:
ratio 0 (bucket 0), and before the task has an ``E`` its execution estimate is 0 (there is no
``|E_last|`` to scale), so a new task goes after every running task of its bucket. The other rules
are kept for comparison (docs/scheduling.md): ``"lowest"`` (bucket 0, but the estimate is the mean
``|E_last|`` of the other tasks), ``"mean"`` (the mean ratio of the tasks that have one, same
estimate) and ``"highest"`` (top bucket, same estimate). Requests from clients that send no
`ExecutionInfo` are ranked with ``|E| = 0``: every round counts as generation-dominated.

Pure: no I/O, no clock; `now_s` is passed in. Defaults were chosen by `benchmarks/studies/fleet.py`
(docs/scheduling.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict

from pydantic import Field

from lerobot_zenoh.protocol.messages import ExecutionInfo
from lerobot_zenoh.scheduling.scheduler_interface import SchedulerConfig

#: Aging interval A: chosen by the model sweep (docs/scheduling.md, "Settings and defaults").
AGING_DEFAULT = 1
FirstRequestRule = Literal["literal", "lowest", "mean", "highest"]


class WaitRatioConfig(SchedulerConfig):
    """The settings of `scheduler: {type: wait_ratio, ...}` (docs/scheduling.md, "Settings and defaults")."""

    config_prefix = "wait_ratio"

    #: B: the wait-ratio buckets a request is ranked in (strict: `true` or "3" is not a count).
    buckets: int = Field(10, ge=1, strict=True)
    #: A: a request skipped this many times moves up one bucket.
    aging: int = Field(AGING_DEFAULT, ge=1, strict=True)
    #: Where a task with no recorded wait yet ranks (module docstring).
    first_request: FirstRequestRule = "literal"


class WaitRatioStats(TypedDict):
    tasks: int  # clients with a task (an episode) held
    waiting: int  # of them, with an unserved request
    skipped_max: int  # the most times a waiting request has been skipped
    decisions: int  # picks made


@dataclass
class _Task:
    """One client's current task (episode) as the server sees it."""

    start_s: float
    total_wait_s: float = 0.0
    rounds: int = 0  # recorded waits W_j
    gen: tuple[float, float] | None = None  # G_j of the last served round
    execution: tuple[float, float] | None = None  # E_j of that round, once the next request told us
    last_exec_s: float | None = None  # |E_last|, the within-bucket estimate
    pending_since_s: float | None = None  # first arrival of the request waiting now
    skipped: int = 0


class WaitRatioScheduler:
    """Kairos Algorithm 1 behind the `RequestScheduler` interface (see the module docstring).

    Its settings are a `WaitRatioConfig` (`buckets` B, `aging` A, `first_request`), given as one or
    as keywords (``WaitRatioScheduler(buckets=4)``); `max_batch` comes per call.
    """

    #: The server decodes each observation on arrival to hand over its ExecutionInfo.
    needs_execution_info = True

    name = "wait_ratio"

    def __init__(self, config: WaitRatioConfig | None = None, /, **settings):
        if config is not None and settings:
            raise TypeError("give a WaitRatioConfig or its settings as keywords, not both")
        self.config = config if config is not None else WaitRatioConfig(**settings)
        self.buckets = self.config.buckets
        self.aging = self.config.aging
        self.first_request = self.config.first_request
        self._tasks: dict[str, _Task] = {}
        self.decisions = 0

    # -- events -------------------------------------------------------------------------------

    def on_arrival(self, client_id: str, now_s: float, execution: ExecutionInfo | None = None) -> None:
        task = self._tasks.get(client_id)
        if task is None:  # a new task: first request ever, or after `forget` (new episode, session closed)
            elapsed = _duration(execution.task_elapsed_s) if execution is not None else None
            task = self._tasks[client_id] = _Task(start_s=now_s - (elapsed or 0.0))
        if task.pending_since_s is None:
            task.pending_since_s = now_s
        if task.gen is None or execution is None:
            return
        # The request for round j+1 tells when E_j ends; a newer observation for the same round
        # (it superseded the older one in the slot) refines the estimate.
        buffered = execution.actions_buffered
        dt = _duration(execution.control_period_s)
        if buffered is None or not dt:
            return
        start = task.gen[1]
        end = max(start, now_s + buffered * dt)
        task.execution = (start, end)
        task.last_exec_s = end - start

    def on_served(self, client_ids: Sequence[str], now_s: float, duration_s: float) -> None:
        gen = (now_s - max(0.0, duration_s), now_s)
        for client_id in client_ids:
            task = self._tasks.get(client_id)
            if task is None:
                continue
            if task.gen is not None:
                task.total_wait_s += round_wait(task.gen, task.execution, gen)
                task.rounds += 1
            task.gen = gen
            task.execution = None
            task.pending_since_s = None
            task.skipped = 0

    def forget(self, client_id: str) -> None:
        """Drop the client's task: its next request starts a new one (new episode, or session closed)."""
        self._tasks.pop(client_id, None)

    # -- decision -----------------------------------------------------------------------------

    def ranking(self, ready: Sequence[str], now_s: float) -> list[tuple[str, int, float]]:
        """(client, bucket, estimate) for each ready client, in dispatch order. No side effects."""
        ratios = [self.wait_ratio(c, now_s) for c, t in self._tasks.items() if t.rounds > 0]
        mean_ratio = sum(ratios) / len(ratios) if ratios else 0.0
        known = [t.last_exec_s for t in self._tasks.values() if t.last_exec_s is not None]
        prior_exec_s = 0.0
        if known and self.first_request != "literal":
            prior_exec_s = sum(known) / len(known)
        rows = []
        for client_id in dict.fromkeys(ready):
            task = self._tasks[client_id]
            if task.rounds == 0:
                ratio = {"highest": 1.0, "lowest": 0.0, "literal": 0.0, "mean": mean_ratio}[self.first_request]
            else:
                ratio = self.wait_ratio(client_id, now_s)
            bucket = min(self.buckets - 1, int(ratio * self.buckets))
            if task.skipped >= self.aging:
                bucket = min(self.buckets - 1, bucket + task.skipped // self.aging)
            exec_s = task.last_exec_s if task.last_exec_s is not None else prior_exec_s
            estimate = exec_s * (1 + task.skipped)
            since = task.pending_since_s if task.pending_since_s is not None else now_s
            rows.append((bucket, estimate, since, client_id))
        rows.sort(key=lambda r: (-r[0], -r[1], r[2], r[3]))
        return [(client_id, bucket, estimate) for bucket, estimate, _, client_id in rows]

    def rank(self, ready: Sequence[str], now_s: float) -> list[str]:
        """Every ready client in Algorithm 1's order; records nothing."""
        for client_id in ready:
            if client_id not in self._tasks:
                self.on_arrival(client_id, now_s)
        return [c for c, _, _ in self.ranking(ready, now_s)]

    def took(self, chosen: Sequence[str], ranked: Sequence[str], now_s: float) -> None:
        """One decision: every ranked request not taken counts as skipped (aging)."""
        picked = set(chosen)
        for client_id in ranked:
            task = self._tasks.get(client_id)
            if task is not None:
                task.skipped = 0 if client_id in picked else task.skipped + 1
        self.decisions += 1

    def pick(self, ready: Sequence[str], now_s: float, max_batch: int = 1) -> list[str]:
        """The first `max_batch` of the order; every other ready request counts as skipped."""
        order = self.rank(ready, now_s)
        chosen = order[:max_batch]
        self.took(chosen, order, now_s)
        return chosen

    # -- introspection ------------------------------------------------------------------------

    def wait_ratio(self, client_id: str, now_s: float) -> float:
        """sum(W) / lifetime of the client's task, in [0, 1]; 0 for an unknown client."""
        task = self._tasks.get(client_id)
        if task is None:
            return 0.0
        lifetime = now_s - task.start_s
        if lifetime <= 0:
            return 0.0
        return min(1.0, max(0.0, task.total_wait_s / lifetime))

    def total_wait_s(self, client_id: str) -> float:
        task = self._tasks.get(client_id)
        return task.total_wait_s if task is not None else 0.0

    def skipped(self, client_id: str) -> int:
        task = self._tasks.get(client_id)
        return task.skipped if task is not None else 0

    def stats(self) -> WaitRatioStats:
        tasks = self._tasks.values()
        return {
            "tasks": len(self._tasks),
            "waiting": sum(t.pending_since_s is not None for t in tasks),
            "skipped_max": max((t.skipped for t in tasks), default=0),
            "decisions": self.decisions,
        }


def round_wait(gen: tuple[float, float], execution: tuple[float, float] | None,
               next_gen: tuple[float, float]) -> float:
    """W_j on the dominant side of round j (Kairos Fig. 8), >= 0.

    ``gen`` = G_j, ``execution`` = E_j (None when the robot reported nothing: |E_j| = 0),
    ``next_gen`` = G_{j+1}. The next execution starts when both the robot is free and the chunk
    exists: ``E_{j+1}.start = max(E_j.end, G_{j+1}.end)``.
    """
    gen_len = gen[1] - gen[0]
    exec_len = execution[1] - execution[0] if execution is not None else 0.0
    if execution is None or gen_len >= exec_len:
        return max(0.0, next_gen[0] - gen[1])
    return max(0.0, next_gen[1] - execution[1])


def _duration(value: float | None) -> float | None:
    """A reported duration if it is a finite number >= 0, else None (a bad value is ignored)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None
