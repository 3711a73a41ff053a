"""The fleet benchmarks' workload: task traces (how long each task is and how far each chunk can be
trusted), the control rate and the served model's latency profile.

A trace stands for one task recorded in isolation (as the Kairos paper does, its section 5.1: tasks are run
alone, recorded, then replayed many at a time against the server). For the replay what matters is
the execution horizon of every round:

- ``static_h``: the task-optimal static horizon, the largest fixed H that keeps the task's accuracy.
  It is set by the hardest section of the task, so it is the same every round (today's practice and
  the static baselines of Kairos 5.3). Drawn log-uniformly in [``min_h``, ``max_h``] = [9, 48]
  actions, i.e. execution phases of 0.3-1.6 s at 30 Hz (Kairos 2.2), so short- and long-horizon
  tasks are equally common (heterogeneous tasks).
- ``rounds``: the round-optimal horizons of the same task recorded with the dynamic (confidence)
  policy, ``H_j = static_h * r_j`` capped at the chunk size. Kairos Fig. 4: half the rounds can run
  at least 2x the task-optimal horizon and some none at all (the hard sections). Here ``r_j`` is 1
  with probability ``hard_share`` (0.3) and uniform in [1.5, 2.8] otherwise (2.8x is Kairos' largest
  gain), so about 43 % of rounds reach 2x. Phases persist across rounds (Kairos Fig. 10: 52-85 % of
  consecutive rounds differ by less than 10 %): with probability ``stay`` (0.8) a round keeps the
  previous round's ratio up to +/- ``jitter`` (10 %), otherwise a new ratio is drawn.
- ``length``: the task's length in actions, ``n_rounds * static_h`` with ``n_rounds`` uniform in
  [``min_rounds``, ``max_rounds``]. It is the same whatever horizon policy runs the task: a longer
  horizon means fewer inferences for the same motion, not a shorter motion. ``rounds`` covers it
  (its sum is at least ``length``); `Task.trusted_actions(progress)` gives the horizon the model
  can vouch for at any point of the task.

Traces are plain JSON (``{"fps": 30, "tasks": [{"static_h": .., "length": .., "rounds": [..]}]}``):
``python -m benchmarks.studies.fleet_zenoh --write-traces traces.json`` writes the generated ones, and
``--traces traces.json`` replays recorded ones instead.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import numpy as np

FPS = 30
CHUNK_SIZE = 50  # actions per chunk the model produces (the cap of every horizon)
#: The model both fleet studies serve: ms per forward pass by batch size, a GPU-like profile (the
#: synthetic policy interpolates linearly in between; 4.8x peak-to-single throughput).
GPU_PROFILE_MS = {1: 60.0, 2: 66.0, 4: 80.0, 8: 120.0, 16: 200.0}
#: The generated trace set both fleet studies replay by default (`generate_traces(TASKS, TRACE_SEED)`).
TASKS = 200
TRACE_SEED = 1


@dataclass(frozen=True)
class Task:
    static_h: int
    length: int
    rounds: tuple[int, ...]
    _ends: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.static_h < 1 or self.length < 1 or not self.rounds or min(self.rounds) < 1:
            raise ValueError(f"bad task trace: {self}")
        object.__setattr__(self, "_ends", tuple(accumulate(self.rounds)))

    def trusted_actions(self, progress: int) -> int:
        """The dynamic horizon at `progress` actions into the task: that of the round covering it."""
        i = bisect.bisect_right(self._ends, progress)
        return self.rounds[min(i, len(self.rounds) - 1)]

    def executed_rounds(self, dynamic: bool) -> list[int]:
        """The horizons of the rounds that run this task in isolation, back to back: ``static_h``
        every round, or the trusted horizon at each round's start; the last round is cut at the end."""
        done, out = 0, []
        while done < self.length:
            h = min(self.trusted_actions(done) if dynamic else self.static_h, self.length - done)
            out.append(h)
            done += h
        return out

    def to_json(self) -> dict:
        return {"static_h": self.static_h, "length": self.length, "rounds": list(self.rounds)}


def generate_traces(n_tasks: int, seed: int, *, min_rounds: int = 4, max_rounds: int = 12, min_h: int = 9,
                    max_h: int = 48, chunk_size: int = CHUNK_SIZE, hard_share: float = 0.3,
                    gain: tuple[float, float] = (1.5, 2.8), stay: float = 0.8, jitter: float = 0.1) -> list[Task]:
    """`n_tasks` traces drawn as the module docstring says (deterministic for a `seed`)."""
    rng = np.random.default_rng(seed)

    def ratio() -> float:
        return 1.0 if rng.random() < hard_share else float(rng.uniform(*gain))

    tasks = []
    for _ in range(n_tasks):
        static_h = int(round(math.exp(rng.uniform(math.log(min_h), math.log(max_h)))))
        length = int(rng.integers(min_rounds, max_rounds + 1)) * static_h
        rounds: list[int] = []
        r = ratio()
        while sum(rounds) < length:
            if rounds and rng.random() >= stay:
                r = ratio()
            h = static_h * max(1.0, r * (1 + rng.uniform(-jitter, jitter)))
            rounds.append(int(min(chunk_size, max(static_h, round(h)))))
        tasks.append(Task(static_h, length, tuple(rounds)))
    return tasks


def load_traces(path: str | Path) -> list[Task]:
    data = json.loads(Path(path).read_text())
    return [Task(int(t["static_h"]), int(t["length"]), tuple(int(h) for h in t["rounds"])) for t in data["tasks"]]


def write_traces(path: str | Path, tasks: list[Task]) -> None:
    Path(path).write_text(json.dumps({"fps": FPS, "tasks": [t.to_json() for t in tasks]}))


def describe(tasks: list[Task]) -> str:
    """One sentence about a trace set, for reports."""
    static = np.array([t.static_h for t in tasks])
    dyn = np.array([h for t in tasks for h in t.rounds])
    lengths = np.array([t.length for t in tasks]) / FPS
    ratios = np.array([h / t.static_h for t in tasks for h in t.rounds])
    return (f"{len(tasks)} tasks; length {lengths.mean():.1f} s mean ({lengths.min():.1f}-{lengths.max():.1f} s); "
            f"static H {static.mean():.1f} mean ({static.min()}-{static.max()}); dynamic H {dyn.mean():.1f} mean, "
            f"{100 * (ratios >= 2).mean():.0f} % of rounds >= 2x static; "
            f"inferences per task in isolation: static {np.mean([len(t.executed_rounds(False)) for t in tasks]):.1f}, "
            f"dynamic {np.mean([len(t.executed_rounds(True)) for t in tasks]):.1f}")
