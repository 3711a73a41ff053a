"""The robot client's counters and the two ways they are reported: live telemetry and the exit summary.

Every part of the client (control loop, observation publisher, chunk receiver, server watch) counts
into one :class:`ClientCounters`, each into its own fields; :class:`ClientReport` reads them, with the
send trigger's and the action buffer's own statistics, into the figures of the Telemetry message
(docs/telemetry.md) and the JSON summary (docs/client.md). Percentiles: one implementation,
``telemetry.publisher.percentile`` (numpy's linear interpolation).
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lerobot_zenoh.telemetry.histogram import HANDOVER_BOUNDS_S, LatencyHistogram
from lerobot_zenoh.telemetry.publisher import percentile

__all__ = ["ClientCounters", "ClientReport"]


@dataclass
class ClientCounters:
    steps: int = 0
    actions_executed: int = 0
    empty_cycles: int = 0  # control steps without an action: the fail-safe action was sent
    overruns: int = 0
    max_lateness_ms: float = 0.0
    observations_published: int = 0
    observations_same_host: int = 0  # of those, sent as raw frames through /dev/shm
    publish_errors: int = 0
    chunks_received: int = 0
    chunks_rejected: int = 0
    refusals: int = 0  # Refusals the server sent (protocol 1.5): requests it refused, saying why
    trimmed_steps: int = 0
    horizon_cut_steps: int = 0  # trailing actions dropped because the chunk's execution_horizon said so
    # Real-time chunking: chunks that replaced the buffer, wrong delay estimates among them
    # (|actual - predicted| >= rtc.mispredict_steps), chunks the server echoed another delay for, and
    # chunks answering an RTC observation without the echo (blended instead).
    rtc_chunks: int = 0
    rtc_delay_mispredicted: int = 0
    rtc_delay_overridden: int = 0
    rtc_fallback_chunks: int = 0
    rtc_delays: deque = field(default_factory=lambda: deque(maxlen=2048))  # (predicted, actual) steps per RTC chunk
    watchdog_events: int = 0
    session_renewals: int = 0  # new session nonces drawn after requests went unanswered in a row
    reset_steps: int = 0  # steps of the reset phases between episodes (robot held, nothing recorded)
    override_steps: int = 0  # steps whose action came from a fallback or danger mode (multi-model task)
    revalidations: int = 0
    server_changes: int = 0
    rtt_ms: deque = field(default_factory=lambda: deque(maxlen=2048))
    # Capture-to-inference age of each answered observation: (chunk arrival - its capture) minus the
    # server's inference time; it includes the chunk's way back (docs/client.md, "Re-fetch").
    observation_age_ms: deque = field(default_factory=lambda: deque(maxlen=2048))
    inference_ms: deque = field(default_factory=lambda: deque(maxlen=2048))
    period_ms: deque = field(default_factory=lambda: deque(maxlen=4096))
    # Every round trip and every hand-over since start, in bins (Prometheus histograms; telemetry/histogram.py).
    rtt_hist: LatencyHistogram = field(default_factory=LatencyHistogram)
    handover_hist: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(HANDOVER_BOUNDS_S))


def _rounded(values, q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value, 3)


class ClientReport:
    """Figures of a running client, read from its parts.

    Args:
        client_uuid: the robot's id.
        counters: the counters every part writes.
        trigger: the send trigger (refreshes, unanswered and outstanding requests).
        buffer: the action buffer (its depth and merge statistics).
        outbox: the hand-over to the publisher (observations dropped as older than a newer one).
        watch: the server watch (serving server, real-time chunking, revalidating).
        recorder: the dataset recorder or None.
        extra: a callable returning figures a task adds (a multi-model task's SLO figures), or None.
    """

    def __init__(self, client_uuid: str, counters: ClientCounters, *, trigger, buffer, outbox, watch,
                 recorder=None, extra: Callable[[], dict] | None = None) -> None:
        self.client_uuid = client_uuid
        self.counters = counters
        self.trigger = trigger
        self.buffer = buffer
        self.outbox = outbox
        self.watch = watch
        self.recorder = recorder
        self.extra = extra
        self._last_figures = (time.perf_counter(), 0)

    def telemetry_figures(self) -> tuple[dict, dict]:
        """Figures for the Telemetry message (docs/telemetry.md); runs on the telemetry thread."""
        c = self.counters
        now = time.perf_counter()
        t_prev, steps_prev = self._last_figures
        self._last_figures = (now, c.steps)
        periods = list(c.period_ms)[-512:]
        rtts = list(c.rtt_ms)[-512:]
        ages = list(c.observation_age_ms)[-512:]
        sent = self.trigger.stats()
        figures = {
            "loop_hz": (c.steps - steps_prev) / (now - t_prev) if now > t_prev else None,
            "control_period_ms_p50": percentile(periods, 50),
            "control_period_ms_p99": percentile(periods, 99),
            "loop_overruns": c.overruns,
            "rtt_ms_p50": percentile(rtts, 50),
            "rtt_ms_p99": percentile(rtts, 99),
            **c.rtt_hist.figures("rtt"),
            **c.handover_hist.figures("handover"),
            "inference_ms_p50": percentile(list(c.inference_ms)[-512:], 50),
            "observation_age_ms_p50": percentile(ages, 50),
            "observation_age_ms_p99": percentile(ages, 99),
            "refreshes_sent": sent.refreshes,
            "trimmed_steps": c.trimmed_steps,
            "buffer_depth": self.buffer.depth,
            "empty_buffer_cycles": c.empty_cycles,
            "chunks_received": c.chunks_received,
            "chunks_rejected": c.chunks_rejected,
            "observations_published": c.observations_published,
            "observations_same_host": c.observations_same_host,
            "observations_dropped_in_outbox": self.outbox.dropped,
            # observations that got no chunk within the request timeout: lost on the way (best effort,
            # too large for a link, shared memory), dropped by the server, or their chunk dropped
            "requests_unanswered": sent.presumed_lost,
            "session_renewals": c.session_renewals,
            "watchdog_events": c.watchdog_events,
            "revalidating": self.watch.state == "revalidating",
            "steps": c.steps,
            "dataset_frames": getattr(self.recorder, "frames_written", None),
            **self._rtc_figures(list(c.rtc_delays)[-512:]),
        }
        if self.extra is not None:
            figures.update(self.extra())
        return figures, {}

    def _rtc_figures(self, delays: list[tuple[int, int]]) -> dict:
        c = self.counters
        errors = [actual - predicted for predicted, actual in delays]
        return {
            "rtc_active": self.watch.rtc_active,
            "rtc_chunks": c.rtc_chunks,
            "rtc_delay_mispredicted": c.rtc_delay_mispredicted,
            "rtc_delay_overridden": c.rtc_delay_overridden,
            "rtc_fallback_chunks": c.rtc_fallback_chunks,
            "rtc_delay_predicted_steps_p50": percentile([p for p, _ in delays], 50),
            "rtc_delay_actual_steps_p50": percentile([a for _, a in delays], 50),
            "rtc_delay_error_steps_p10": percentile(errors, 10),
            "rtc_delay_error_steps_p50": percentile(errors, 50),
            "rtc_delay_error_steps_p90": percentile(errors, 90),
        }

    def summary(self) -> dict:
        c = self.counters
        buf = self.buffer.stats()
        sent = self.trigger.stats()
        status = self.watch.status
        recorder = self.recorder
        return {
            "client_uuid": self.client_uuid,
            "server_id": status.server_id if status else None,
            "steps": c.steps,
            "actions_executed": c.actions_executed,
            "chunks_received": c.chunks_received,
            "chunks_rejected": c.chunks_rejected,
            "observations_published": c.observations_published,
            "observations_dropped_in_outbox": self.outbox.dropped,
            "trimmed_steps": c.trimmed_steps,
            "blended_steps": buf.blended_steps,
            "rtt_ms_p50": _rounded(c.rtt_ms, 50),
            "rtt_ms_p99": _rounded(c.rtt_ms, 99),
            "inference_ms_p50": _rounded(c.inference_ms, 50),
            "observation_age_ms_p50": _rounded(c.observation_age_ms, 50),
            "observation_age_ms_p99": _rounded(c.observation_age_ms, 99),
            "refreshes_sent": sent.refreshes,
            "control_period_ms_p50": _rounded(c.period_ms, 50),
            "control_period_ms_p99": _rounded(c.period_ms, 99),
            "empty_buffer_cycles": c.empty_cycles,
            "reset_steps": c.reset_steps,
            "horizon_cut_steps": c.horizon_cut_steps,
            "loop_overruns": c.overruns,
            "max_lateness_ms": round(c.max_lateness_ms, 3),
            "publish_errors": c.publish_errors,
            "watchdog_events": c.watchdog_events,
            "revalidations": c.revalidations,  # status queries while re-validating
            "server_changes": c.server_changes,
            "session_renewals": c.session_renewals,
            # sent but unanswered when the run ended (lost best-effort observations, or in flight)
            "requests_outstanding_at_exit": sent.outstanding,
            "requests_unanswered": sent.presumed_lost,
            "dataset_path": str(getattr(recorder, "root", "")) or None if recorder else None,
            "dataset_frames": getattr(recorder, "frames_written", None) if recorder else None,
            "rtc": self._rtc_summary(buf),
        }

    def _rtc_summary(self, buf) -> dict:
        """Real-time chunking over the run: the delay error's histogram (actual - predicted, steps)."""
        c = self.counters
        delays = list(c.rtc_delays)
        errors = Counter(actual - predicted for predicted, actual in delays)
        return {
            "active": self.watch.rtc_active,
            "chunks": c.rtc_chunks,
            "delay_mispredicted": c.rtc_delay_mispredicted,
            "delay_overridden": c.rtc_delay_overridden,
            "fallback_chunks": c.rtc_fallback_chunks,
            "replaced_steps": buf.replaced_steps,
            "delay_predicted_steps_p50": percentile([p for p, _ in delays], 50),
            "delay_actual_steps_p50": percentile([a for _, a in delays], 50),
            "delay_error_steps_histogram": {str(k): errors[k] for k in sorted(errors)},
        }

    def write_summary(self, path: str | Path, summary: dict) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(summary, indent=2))
