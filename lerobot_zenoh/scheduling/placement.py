"""Where each ordered request runs: edge first, the cloud only when it is faster (pure).

The hybrid placement of Kairos (Algorithm 1, phase 3), as a decision with injected numbers: no
clock of its own, no I/O. The edge scheduler orders its waiting requests (wait ratio, or any
`RequestScheduler`), describes each engine as an `EngineView` and calls `place`; it then dispatches
`Placement.assigned` and leaves `Placement.waiting` to wait and age. The fleet model
(`benchmarks/studies/fleet.py`) makes the same calls on its virtual clock.

The rule, for `ordered` requests at `now_s`:

1. **Fill the idle edge engines.** An edge engine with nothing in flight (``running == 0``) takes up
   to `capacity` requests, the first of the order; each request goes to the idle edge engine on
   which it would be answered first (for equal engines: spread, so batches stay small).
   Edge engines run one batch at a time and are fed only when idle, so a waiting request stays at
   the scheduler, where it can still be reordered and its observation refreshed.
2. **Offload the rest only when that is faster.** For each further request, in order:
   - its *edge queueing delay* is the time until its answer if it waited at the edge
     (`_EdgeQueue`): the requests before it that stay at the edge are served first, in order, in
     batches of up to `capacity` on whichever edge engine frees first (the busy ones at their
     `busy_until_s`, those filled in step 1 after their batch); the delay is from `now_s` to the
     start of the batch it would join, plus that engine's latency at the batch's size with it;
   - its *cloud estimate* on each cloud engine that still has room (``running`` + requests placed
     on it now < `capacity`, or `max_in_flight`) is `service_estimate_s`: round trip + (payload +
     history bytes) / bandwidth + the engine's latency at the size of the batch it would join (the
     requests placed on it now, itself included), waiting for the engine's current work when the
     bytes get there before it ends;
   - it goes to the cloud engine with the lowest estimate if that estimate is strictly lower than
     its edge queueing delay; otherwise it waits (and, waiting, it occupies the edge queue of the
     requests after it).

Ties go to the edge (waiting) and, among engines, to the one listed first. docs/scheduling.md
("Placement across engines") describes the rule and its numbers for users.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from lerobot_zenoh.scheduling.batch_profile import saturation_batch_size

EDGE, CLOUD = "edge", "cloud"
TIERS = (EDGE, CLOUD)


class BatchProfile:
    """Seconds one pass over a batch of b requests takes, from measured or declared points.

    Between points: linear interpolation. Below the smallest point: its latency (a smaller batch is
    never slower). Above the largest: the last segment's slope per request (with one point, the
    latency grows in proportion to b: no batching gain is assumed beyond what was measured).

    >>> p = BatchProfile({1: 0.060, 4: 0.072, 8: 0.100})
    >>> p.latency_s(1), p.latency_s(2), round(p.latency_s(16), 3), p.saturation_batch_size()
    (0.06, 0.064, 0.156, 8)
    """

    def __init__(self, points: Mapping[int, float]):
        if not points:
            raise ValueError("a batch profile needs at least one (batch size, seconds) point")
        for b, t in points.items():
            if not isinstance(b, int) or isinstance(b, bool) or b < 1:
                raise ValueError(f"batch size must be an integer >= 1, got {b!r}")
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise ValueError(f"latency at batch {b} must be a finite number of seconds >= 0, got {t!r}")
        self._sizes = sorted(points)
        self._latency = [float(points[b]) for b in self._sizes]

    @classmethod
    def from_ms(cls, points_ms: Mapping[int, float]) -> BatchProfile:
        """From {batch size: milliseconds} (the synthetic policy's `batch_latency_ms`, a manifest)."""
        return cls({int(b): float(ms) / 1000.0 for b, ms in points_ms.items()})

    @classmethod
    def constant(cls, seconds: float) -> BatchProfile:
        """Batching is free: every batch size takes `seconds` (one point at batch 1 extrapolates
        linearly, so this declares two)."""
        return cls({1: seconds, 2: seconds})

    @property
    def points(self) -> dict[int, float]:
        """The points, {batch size: seconds}, smallest first."""
        return dict(zip(self._sizes, self._latency, strict=True))

    def latency_s(self, batch_size: int) -> float:
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        sizes, lat = self._sizes, self._latency
        if batch_size <= sizes[0]:
            return lat[0]
        if batch_size >= sizes[-1]:
            if len(sizes) == 1:
                return lat[0] * batch_size / sizes[0]
            slope = max(0.0, (lat[-1] - lat[-2]) / (sizes[-1] - sizes[-2]))
            return lat[-1] + slope * (batch_size - sizes[-1])
        i = bisect.bisect_left(sizes, batch_size)
        if sizes[i] == batch_size:
            return lat[i]
        b0, b1, t0, t1 = sizes[i - 1], sizes[i], lat[i - 1], lat[i]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)

    def saturation_batch_size(self) -> int:
        """The capacity the profile suggests (`batch_profile.saturation_batch_size` of its points)."""
        return saturation_batch_size(self.points)

    def scaled(self, factor: float) -> BatchProfile:
        """The same shape, every latency times `factor` (a faster or slower GPU of the same kind)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"scale factor must be a finite number > 0, got {factor}")
        return BatchProfile({b: t * factor for b, t in self.points.items()})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchProfile) and self.points == other.points

    def __hash__(self) -> int:
        return hash(tuple(self.points.items()))

    def __repr__(self) -> str:
        return f"BatchProfile({self.points!r})"


#: Limits on a profile another process declares (an engine's status): points, largest batch, and
#: the slowest pass believed (ms). A larger batch may not take less than `MONOTONE_SLACK` times
#: what a smaller one took (measurement noise, never a real speed-up).
MAX_PROFILE_POINTS = 64
MAX_PROFILE_BATCH = 4096
MAX_PROFILE_MS = 600_000.0
MONOTONE_SLACK = 0.5


def profile_from_peer_ms(points_ms: Mapping[int, float]) -> BatchProfile:
    """A `BatchProfile` from {batch size: ms} that another process sent (an engine's status):
    validated as hostile input, so a bad one is refused with `ValueError` (its reason, in words)
    before it reaches any estimate: 1 to `MAX_PROFILE_POINTS` points, integer batch sizes from 1 to
    `MAX_PROFILE_BATCH`, finite times above 0 and at most `MAX_PROFILE_MS`, and no batch taking
    less than `MONOTONE_SLACK` times a smaller one."""
    if not isinstance(points_ms, Mapping) or not 1 <= len(points_ms) <= MAX_PROFILE_POINTS:
        raise ValueError(f"a profile needs 1 to {MAX_PROFILE_POINTS} points")
    last = None
    for b in sorted(points_ms, key=lambda x: x if isinstance(x, int) else -1):
        t = points_ms[b]
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= MAX_PROFILE_BATCH:
            raise ValueError(f"batch size {b!r} is not an integer from 1 to {MAX_PROFILE_BATCH}")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (math.isfinite(t) and 0 < t <= MAX_PROFILE_MS):
            raise ValueError(f"time at batch {b} is not a number of ms above 0 and at most {MAX_PROFILE_MS:g}")
        if last is not None and t < MONOTONE_SLACK * last:
            raise ValueError(f"batch {b} takes {t:g} ms, under {MONOTONE_SLACK:g} x a smaller batch's {last:g} ms")
        last = t if last is None else max(last, t)
    return BatchProfile.from_ms(points_ms)


@dataclass(frozen=True)
class EngineView:
    """What the scheduler knows of one engine at a decision.

    `running` counts requests dispatched to it and not answered yet; `busy_until_s` is when the
    engine is expected to finish the work it already has, on the scheduler's clock (<= now when it
    has none). `rtt_s` and `bandwidth_bps` (bytes/s towards the engine) are measured: 0 and inf for
    the scheduler's own engine.
    """

    engine_id: str
    tier: str  # EDGE or CLOUD
    capacity: int  # most requests in one batch (N_e / N_c), >= 1; and in flight, unless max_in_flight
    running: int
    busy_until_s: float
    profile: BatchProfile
    rtt_s: float = 0.0
    bandwidth_bps: float = math.inf
    # Most requests in flight on a cloud engine (0: `capacity`). Above `capacity`, the engine queues
    # a next batch behind the running one, so a saturated engine does not idle for a round trip
    # between batches; its `busy_until_s` must then include the queued work.
    max_in_flight: int = 0

    @property
    def in_flight_limit(self) -> int:
        return self.max_in_flight or self.capacity

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"engine {self.engine_id!r}: tier must be one of {TIERS}, got {self.tier!r}")
        if self.capacity < 1:
            raise ValueError(f"engine {self.engine_id!r}: capacity must be >= 1, got {self.capacity}")
        if self.running < 0:
            raise ValueError(f"engine {self.engine_id!r}: running must be >= 0, got {self.running}")
        if not (self.rtt_s >= 0 and math.isfinite(self.rtt_s)):
            raise ValueError(f"engine {self.engine_id!r}: rtt_s must be a finite number >= 0, got {self.rtt_s}")
        if not self.bandwidth_bps > 0:
            raise ValueError(f"engine {self.engine_id!r}: bandwidth_bps must be > 0, got {self.bandwidth_bps}")
        if self.max_in_flight < 0:
            raise ValueError(f"engine {self.engine_id!r}: max_in_flight must be >= 0, got {self.max_in_flight}")
        if not isinstance(self.profile, BatchProfile):
            raise TypeError(f"engine {self.engine_id!r}: profile must be a BatchProfile")


@dataclass(frozen=True)
class RequestView:
    request_id: object  # opaque to placement
    payload_bytes: int
    history_bytes: int = 0  # state a stateful policy needs that travels with the request

    @property
    def transfer_bytes(self) -> int:
        return self.payload_bytes + self.history_bytes


class Estimate(NamedTuple):
    """Why a request went where it did. `engine_id`: the engine it was placed on, or for a waiting
    request the cloud engine that was considered (None when no cloud engine had room);
    `latency_s`: the expected time until its answer there, from now (inf when none had room);
    `edge_delay_s`: its edge queueing delay (for a request placed on an idle edge engine, its
    latency there)."""

    engine_id: str | None
    latency_s: float
    edge_delay_s: float


@dataclass(frozen=True)
class Placement:
    assigned: dict[str, list] = field(default_factory=dict)  # engine_id -> request_ids, in order
    waiting: list = field(default_factory=list)  # request_ids left to wait at the edge, in order
    estimates: dict = field(default_factory=dict)  # request_id -> Estimate

    def tier_of(self, request_id: object, engines: Sequence[EngineView]) -> str | None:
        """The tier a request was placed on (None: it waits)."""
        tiers = {e.engine_id: e.tier for e in engines}
        for engine_id, ids in self.assigned.items():
            if request_id in ids:
                return tiers[engine_id]
        return None


def transfer_s(engine: EngineView, transfer_bytes: int) -> float:
    """Seconds to move `transfer_bytes` to the engine at its measured bandwidth (0 when local)."""
    if transfer_bytes <= 0 or math.isinf(engine.bandwidth_bps):
        return 0.0
    return transfer_bytes / engine.bandwidth_bps


def service_estimate_s(engine: EngineView, batch_size: int, transfer_bytes: int, now_s: float) -> float:
    """Expected seconds from `now_s` until a request's answer is back, dispatched now to `engine`
    in a batch of `batch_size`: it travels half the round trip plus its bytes' transfer, starts when
    it is there and the engine's current work is done (``busy_until_s``), runs for the profile's
    latency at that size, and the answer travels the other half. An idle engine:
    ``rtt_s + bytes / bandwidth + latency(batch_size)``."""
    there_s = engine.rtt_s / 2 + transfer_s(engine, transfer_bytes)
    start_s = max(there_s, engine.busy_until_s - now_s)
    return start_s + engine.profile.latency_s(batch_size) + engine.rtt_s / 2


def expected_busy_until_s(outstanding: Sequence[tuple[float, int]], free_s: float, profile: BatchProfile,
                          capacity: int) -> float:
    """When an engine is expected to be done with the groups dispatched to it and not answered yet,
    for its `EngineView.busy_until_s`.

    `outstanding`: (expected arrival at the engine, requests) per dispatched group, in the order they
    were sent; `free_s`: when its GPU was last known free (the last answer's arrival minus half the
    round trip; the dispatch time of the first group for an engine that had nothing). The engine is
    taken to batch what has reached it when its GPU frees, whole groups in order up to `capacity`
    (a group larger than that runs alone), each batch taking the profile's latency. Without
    outstanding groups: `free_s`.

    >>> p = BatchProfile({1: 0.1, 2: 0.12})
    >>> round(expected_busy_until_s([(0.05, 1), (0.06, 1), (0.3, 1)], 0.0, p, 2), 3)  # runs 0.05-0.15, 0.15-0.25, 0.3-0.4
    0.4
    """
    t, i = free_s, 0
    while i < len(outstanding):
        start = max(t, outstanding[i][0])
        n, j = 0, i
        while j < len(outstanding) and outstanding[j][0] <= start and (n == 0 or n + outstanding[j][1] <= capacity):
            n += outstanding[j][1]
            j += 1
        t = start + profile.latency_s(n)
        i = j
    return t


class _EdgeQueue:
    """The edge as the waiting requests would see it: per edge engine, when the scheduler can next
    dispatch to it (its answers are back: edge engines are fed only when idle), and the batch that
    forms there next.

    Requests that wait join, in order, the batch that is dispatched first: the open batch of the
    engine that frees first fills up to its capacity, then that engine frees again one round trip
    and one batch latency later. A request's edge queueing delay is the time from now until that
    batch can be dispatched, plus the round trip, its bytes' transfer and the engine's latency at
    the batch's size with it in (for the scheduler's own engine: when the engine frees plus the
    latency); `join` then keeps it there, so the requests after it queue behind it."""

    def __init__(self, engines: Sequence[EngineView], now_s: float, filled: Mapping[str, int]):
        self.now_s = now_s
        self.engines = list(engines)
        self.dispatch_s = []
        for e in self.engines:
            n = filled.get(e.engine_id, 0)
            if n:  # filled in this decision: free when that batch's answers are back
                self.dispatch_s.append(now_s + e.rtt_s + e.profile.latency_s(n))
            elif e.running:  # busy: free when its work is done and the answers are back
                self.dispatch_s.append(max(now_s, e.busy_until_s + e.rtt_s / 2))
            else:
                self.dispatch_s.append(now_s)
        self.open = [0] * len(self.engines)  # requests in the batch forming next on each engine

    def _next(self) -> int:
        """The engine whose next batch is dispatched first (ties: the one listed first)."""
        return min(range(len(self.engines)), key=lambda i: (self.dispatch_s[i], i))

    def edge_delay_s(self, transfer_bytes: int) -> float:
        """The edge queueing delay of the next request to wait (inf without edge engines)."""
        if not self.engines:
            return math.inf
        i = self._next()
        e = self.engines[i]
        return (self.dispatch_s[i] - self.now_s + e.rtt_s + transfer_s(e, transfer_bytes)
                + e.profile.latency_s(self.open[i] + 1))

    def join(self) -> None:
        """The request whose delay was asked last waits: it takes its place in the edge queue."""
        if not self.engines:
            return
        i = self._next()
        self.open[i] += 1
        e = self.engines[i]
        if self.open[i] >= e.capacity:  # full: the engine runs it, then the next batch forms
            self.dispatch_s[i] += e.rtt_s + e.profile.latency_s(self.open[i])
            self.open[i] = 0


def place(ordered: Sequence[RequestView], engines: Sequence[EngineView], now_s: float) -> Placement:
    """Place `ordered` (the scheduler's order, first = most urgent) on `engines` at `now_s`.

    Every request appears exactly once, in `assigned` or in `waiting`, and in `estimates`.
    Engine ids must be unique; request ids must be unique."""
    ids = [e.engine_id for e in engines]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate engine id in {ids}")
    if len({r.request_id for r in ordered}) != len(ordered):
        raise ValueError("duplicate request id")
    edges = [e for e in engines if e.tier == EDGE]
    clouds = [e for e in engines if e.tier == CLOUD]
    assigned: dict[str, list] = {}
    placed_n: dict[str, int] = {e.engine_id: 0 for e in engines}
    estimates: dict = {}
    waiting: list = []
    requests = list(ordered)

    # 1. idle edge engines, up to capacity, each request where it is answered first
    idle = [e for e in edges if e.running == 0]
    k = 0
    while k < len(requests) and idle:
        r = requests[k]
        room = [e for e in idle if placed_n[e.engine_id] < e.capacity]
        if not room:
            break
        best = min(room, key=lambda e: service_estimate_s(e, placed_n[e.engine_id] + 1, r.transfer_bytes, now_s))
        placed_n[best.engine_id] += 1
        est = service_estimate_s(best, placed_n[best.engine_id], r.transfer_bytes, now_s)
        assigned.setdefault(best.engine_id, []).append(r.request_id)
        estimates[r.request_id] = Estimate(best.engine_id, est, est)
        k += 1

    # 2. the rest: the cloud when strictly faster than waiting at the edge, else wait
    queue = _EdgeQueue(edges, now_s, {e.engine_id: placed_n[e.engine_id] for e in idle})
    for r in requests[k:]:
        edge_delay = queue.edge_delay_s(r.transfer_bytes)
        best_cloud, best_est = None, math.inf
        for c in clouds:
            if c.running + placed_n[c.engine_id] >= c.in_flight_limit:
                continue
            est = service_estimate_s(c, placed_n[c.engine_id] + 1, r.transfer_bytes, now_s)
            if est < best_est:
                best_cloud, best_est = c, est
        if best_cloud is not None and best_est < edge_delay:
            placed_n[best_cloud.engine_id] += 1
            assigned.setdefault(best_cloud.engine_id, []).append(r.request_id)
            estimates[r.request_id] = Estimate(best_cloud.engine_id, best_est, edge_delay)
        else:
            queue.join()
            waiting.append(r.request_id)
            estimates[r.request_id] = Estimate(best_cloud.engine_id if best_cloud else None, best_est, edge_delay)
    return Placement(assigned=assigned, waiting=waiting, estimates=estimates)
