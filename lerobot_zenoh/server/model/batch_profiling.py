"""Measure a runner's latency-vs-batch profile at start-up (for `max_batch_size: auto`).

Runs during pre-warming, before the server announces anything, on the serving hardware itself:
for each size of `profile_batch_sizes(max_batch)` (1, 2, 4, 8, ...), one untimed call (first calls
at a new shape pay allocation and kernel selection), then `repetitions` timed calls of the runner's `run`
on that many dummy observations from distinct fake sessions; the size's latency is the fastest of
them (noise only ever adds time). The pure rule in `scheduling/batch_profile.py` then picks the
saturation point.

Bounded in time: a size is only started while its estimated cost (twice the previous size's
latency, for each of its calls) still fits in `budget_s`; the profile then ends at the sizes
measured so far. A size whose call fails (`PolicyError`, or a `RuntimeError` such as running out of
GPU memory) ends the profile too: bigger batches would not fit either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lerobot_zenoh.errors import PolicyError
from lerobot_zenoh.scheduling.batch_profile import profile_batch_sizes
from lerobot_zenoh.server.runners.base import InferenceRequest, PolicyRunner, dummy_observation

log = logging.getLogger(__name__)


def measure_batch_profile(
    runner: PolicyRunner,
    max_batch: int,
    *,
    repetitions: int = 2,
    budget_s: float = 10.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[int, float]:
    """{batch size: seconds per `run` call}, smallest sizes first; empty if size 1 failed.

    Sizes go up to `max_batch`, and no further than the runner's `capabilities.max_batch`.
    """
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    runner_max = runner.spec.capabilities.max_batch
    sizes = profile_batch_sizes(max_batch if runner_max is None else min(max_batch, runner_max))
    state, images = dummy_observation(runner.spec)
    profile: dict[int, float] = {}
    start = clock()
    for size in sizes:
        if profile:
            estimate_s = 2 * max(profile.values()) * (repetitions + 1)
            if clock() - start + estimate_s > budget_s:
                log.info("batch profile stops before size %d: time budget %.1f s", size, budget_s)
                break
        requests = [InferenceRequest(f"profile-{i}", state, images, "", seed=i) for i in range(size)]
        times_s = []
        try:
            runner.run(requests)  # untimed: first call at this shape
            for _ in range(repetitions):
                t0 = clock()
                runner.run(requests)
                times_s.append(clock() - t0)
        except (PolicyError, RuntimeError) as exc:
            log.warning("batch profile stops at size %d: %s", size, exc)
            break
        profile[size] = min(times_s)
        log.info("batch profile: %d observation(s) per pass: %.1f ms", size, profile[size] * 1000)
    for i in range(max_batch):
        runner.forget(f"profile-{i}")  # stateful runners (Diffusion) keep per-session history
    return profile
