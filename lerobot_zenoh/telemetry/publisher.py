"""Periodic telemetry off the hot paths: a thread of its own takes a snapshot and puts it.

The snapshot function is called on the telemetry thread; it must only copy counters (under the
owner's lock, briefly). Publishing is best effort with congestion DROP: telemetry never delays
observations or action chunks, and a failed put is counted, never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Telemetry
from lerobot_zenoh.telemetry.fleet import MAX_MESSAGE_BYTES
from lerobot_zenoh.telemetry.histogram import SUFFIX
from lerobot_zenoh.transport.session import METRICS_QOS, ZenohSession

log = logging.getLogger(__name__)

Figures = dict[str, float | int]
Snapshot = Callable[[], tuple[Figures, dict[str, Figures]]]


def percentile(values: Iterable[float], q: float) -> float | None:
    """`numpy.percentile(values, q)` (linear interpolation), None for no values.

    In plain Python: the server calls it four times per client per telemetry period on windows of
    at most a few hundred values, where numpy's call overhead (~40 us) was 3 % of a core at 100
    clients (docs/benchmarks.md, "Server ingest"); sorting 100 floats takes ~3 us.
    """
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(ordered) - 1) * (q / 100.0)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    a, b = float(ordered[lo]), float(ordered[hi])
    # numpy's _lerp: the form that is exact at both ends
    return a + (b - a) * frac if frac < 0.5 else b - (b - a) * (1.0 - frac)


def worth_logging(count: int) -> bool:
    """Whether the `count`-th occurrence of a repeated event gets a log line: the 1st, 10th, 100th
    and every 1000th. A flood costs a few lines; every occurrence is still counted (and reported in
    telemetry), so the line carries the count so far."""
    return count in (1, 10, 100) or (count > 0 and count % 1000 == 0)


def numbers_only(figures: dict) -> Figures:
    """Drop None values (a percentile of nothing) and turn bools into ints: the wire carries numbers."""
    return {k: (int(v) if isinstance(v, bool) else v) for k, v in figures.items() if v is not None}


def process_memory() -> Figures:
    """Resident memory of this process, and GPU memory in use when torch has CUDA loaded."""
    out: Figures = {}
    try:
        with open("/proc/self/statm") as f:
            import os

            out["cpu_rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        pass
    import sys

    torch = sys.modules.get("torch")  # only if the process already uses torch: never import it here
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                out["gpu_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
                out["gpu_reserved_mb"] = torch.cuda.memory_reserved() / 2**20
        except Exception:
            pass
    return out


class TelemetryPublisher:
    def __init__(self, session: ZenohSession, key: str, source: str, source_id: str, snapshot: Snapshot,
                 period_s: float = 1.0, labels: dict[str, str] | None = None):
        self.key = key
        self.source = source
        self.source_id = source_id
        self.period_s = period_s
        self.labels = dict(labels or {})
        self._session = session
        self._snapshot = snapshot
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self.published = 0
        self.errors = 0
        self.shed = 0  # messages sent with less than their per-robot figures (`_within_limit`)

    def start(self) -> TelemetryPublisher:
        self._publisher = self._session.publisher(self.key, METRICS_QOS)
        self._thread = threading.Thread(target=self._run, name=f"telemetry:{self.source_id}", daemon=True)
        self._thread.start()
        return self

    def publish_once(self) -> None:
        metrics, per_client = self._snapshot()
        msg = Telemetry(
            source=self.source,
            source_id=self.source_id,
            seq=self.published,
            uptime_s=time.monotonic() - self._t0,
            period_s=self.period_s,
            metrics=numbers_only(metrics),
            per_client={c: numbers_only(f) for c, f in per_client.items()},
            labels=self.labels,
        )
        payload = codec.encode(msg)
        if len(payload) > MAX_MESSAGE_BYTES or len(msg.per_client) > codec.DEFAULT_LIMITS.max_container_len:
            payload = self._within_limit(msg, len(payload))
        self._publisher.put(payload)
        self.published += 1

    def _within_limit(self, msg: Telemetry, size: int) -> bytes:
        """A message a monitor would refuse unread (over `fleet.MAX_MESSAGE_BYTES`: a server with
        about a thousand robots; or more robots than a map may hold) loses its per-robot histograms,
        then if need be every per-robot figure, rather than the whole member:
        `telemetry.per_client_shed` says which (1, 2)."""
        import dataclasses

        bare = {c: {k: v for k, v in f.items() if f"{SUFFIX}." not in k} for c, f in msg.per_client.items()}
        for level, per_client in ((1, bare), (2, {})):
            payload = codec.encode(dataclasses.replace(
                msg, per_client=per_client, metrics={**msg.metrics, "telemetry.per_client_shed": level}))
            fits = len(payload) <= MAX_MESSAGE_BYTES and len(per_client) <= codec.DEFAULT_LIMITS.max_container_len
            if fits or level == 2:
                break
        self.shed += 1
        if worth_logging(self.shed):
            log.warning("telemetry on %s: %d bytes with %d robots is over the monitor's %d; sent without %s "
                        "[%d so far]", self.key, size, len(msg.per_client), MAX_MESSAGE_BYTES,
                        "the per-robot histograms" if level == 1 else "per-robot figures", self.shed)
        return payload

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.publish_once()
            except Exception as exc:  # telemetry must never take its owner down
                self.errors += 1
                if worth_logging(self.errors):
                    log.warning("telemetry on %s failed (%d): %s", self.key, self.errors, exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
