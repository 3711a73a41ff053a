"""Latency histograms as telemetry figures: counts since start, so that Prometheus can aggregate them
across servers and over any time window (a p99 gauge can be neither summed nor rated).

A histogram named `rtt` travels in a Telemetry message's flat `metrics` map (no schema change) as:

    rtt_hist.le_<bound in µs>   observations in the bin that ends at that bound (not cumulative),
                                sent only for bins that are not empty; `le_inf` above the last bound
    rtt_hist.sum_s              the sum of every observation, in seconds
    rtt_hist.count              how many observations

The monitor (telemetry/prometheus.py) rebuilds the cumulative `_bucket{le=...}` series of every bound
of the histogram's declared set, in seconds. Bounds are declared here once (:data:`LATENCY_BOUNDS_S`,
:data:`HANDOVER_BOUNDS_S`); a bound a sender adds that the monitor does not know is exported too.
Pure; not thread-safe (the owner's lock, or one thread, guards it).
"""

from __future__ import annotations

import bisect

__all__ = ["HANDOVER_BOUNDS_S", "LATENCY_BOUNDS_S", "LatencyHistogram", "bound_name", "parse_bound"]

#: Round trips, inference, queue waits: 1 ms .. 10 s.
LATENCY_BOUNDS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: The control loop's hand-over of an observation to its publisher: 10 µs .. 100 ms.
HANDOVER_BOUNDS_S: tuple[float, ...] = (1e-05, 2.5e-05, 5e-05, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                        0.025, 0.1)

SUFFIX = "_hist"
INF = "le_inf"


def bound_name(bound_s: float) -> str:
    """The figure chunk of a bound: `le_2500` for 2.5 ms (whole microseconds), `le_inf`."""
    return INF if bound_s == float("inf") else f"le_{round(bound_s * 1e6)}"


def parse_bound(chunk: str) -> float | None:
    """The bound in seconds of a `le_<µs>` chunk (`le_inf`: +inf); None for anything else."""
    if chunk == INF:
        return float("inf")
    if chunk.startswith("le_") and chunk[3:].isdigit() and len(chunk) <= 16:
        return int(chunk[3:]) / 1e6
    return None


class LatencyHistogram:
    """Counts of observations per bin, their sum and count, since it was made."""

    __slots__ = ("bounds_s", "bins", "sum_s", "count")

    def __init__(self, bounds_s: tuple[float, ...] = LATENCY_BOUNDS_S):
        self.bounds_s = bounds_s
        self.bins = [0] * (len(bounds_s) + 1)  # the last: above every bound
        self.sum_s = 0.0
        self.count = 0

    def observe_s(self, value_s: float) -> None:
        if value_s != value_s:  # NaN: not a time
            return
        self.bins[bisect.bisect_left(self.bounds_s, value_s)] += 1
        self.sum_s += max(value_s, 0.0)
        self.count += 1

    def observe_ms(self, value_ms: float) -> None:
        self.observe_s(value_ms / 1000)

    def merge(self, other: LatencyHistogram) -> None:
        """Add `other`'s counts (same bounds)."""
        self.bins = [a + b for a, b in zip(self.bins, other.bins)]
        self.sum_s += other.sum_s
        self.count += other.count

    def copy(self) -> LatencyHistogram:
        out = LatencyHistogram(self.bounds_s)
        out.merge(self)
        return out

    def figures(self, name: str) -> dict[str, float | int]:
        """The figures of histogram `name` (see the module's docstring); {} before any observation."""
        if not self.count:
            return {}
        out: dict[str, float | int] = {}
        for bound, n in zip((*self.bounds_s, float("inf")), self.bins):
            if n:
                out[f"{name}{SUFFIX}.{bound_name(bound)}"] = n
        out[f"{name}{SUFFIX}.sum_s"] = round(self.sum_s, 6)
        out[f"{name}{SUFFIX}.count"] = self.count
        return out
