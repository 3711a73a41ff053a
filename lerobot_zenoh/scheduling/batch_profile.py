"""Latency-vs-batch profiles and the batch size they suggest (pure; no clock, no model).

A profile maps a batch size to the time one forward pass over that many requests takes. Its
throughput is ``b / latency(b)`` requests per second. The *saturation point* is the smallest batch
size whose throughput is within `SATURATION_TOLERANCE` (10 %) of the best measured throughput:
beyond it a bigger batch adds latency to every request in it without adding throughput (Kairos
section 3.2; docs/scheduling.md, "`max_batch_size: auto`"). Choosing the smallest such size keeps batches, and so the latency
each client pays, as small as the throughput allows.

The server measures a profile at start-up for `max_batch_size: auto` (`server/model/batch_profiling.py`);
`benchmarks/studies/fleet.py` applies the same rule to its synthetic GPU profile.
"""

from __future__ import annotations

from collections.abc import Mapping

SATURATION_TOLERANCE = 0.1


def profile_batch_sizes(max_batch: int) -> list[int]:
    """Sizes to profile: powers of two 1, 2, 4, ... up to `max_batch`, and `max_batch` itself.

    >>> profile_batch_sizes(16), profile_batch_sizes(12), profile_batch_sizes(1)
    ([1, 2, 4, 8, 16], [1, 2, 4, 8, 12], [1])
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch)
    return sizes


def saturation_batch_size(latency_s: Mapping[int, float], tolerance: float = SATURATION_TOLERANCE) -> int:
    """The smallest batch size b in `latency_s` ({batch size: seconds per pass}) whose throughput
    ``b / latency_s[b]`` is at least ``(1 - tolerance)`` times the best throughput in the profile.

    A pass that took no measurable time counts as infinitely fast (the smallest such size wins).
    Only the sizes given are candidates; an empty profile is an error.

    >>> saturation_batch_size({1: 0.060, 2: 0.064, 4: 0.072, 8: 0.100, 16: 0.200})  # peak at 8
    8
    >>> saturation_batch_size({1: 0.010, 2: 0.020, 4: 0.040})  # no gain from batching
    1
    """
    if not latency_s:
        raise ValueError("empty latency profile")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    for b, t in latency_s.items():
        if b < 1 or t < 0:
            raise ValueError(f"bad profile entry {b}: {t} (batch size >= 1, latency >= 0)")
    throughput = {b: (b / t if t > 0 else float("inf")) for b, t in latency_s.items()}
    best = max(throughput.values())
    return min(b for b, x in throughput.items() if x >= (1 - tolerance) * best)
