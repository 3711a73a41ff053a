"""The robot client's chunk intake: what an arriving action chunk means for the action buffer.

Pure bookkeeping and arithmetic with an injected clock: every method that depends on time takes
``now_s`` (one process's ``time.perf_counter()``), nothing here reads a clock, sleeps or does I/O.
The reference client (`client/client.py`) and both fleet benchmarks run the same code, so what a
benchmark measures is what the client does.

Sending (:meth:`ChunkIntake.on_send`)
    Records the request in the send trigger's in-flight table (``scheduling/in_flight.py``) with its
    step at capture (the buffer's ``next_step`` when the observation was taken: the step row 0 of its
    chunk is meant for) and predicted delay (what a real-time-chunking observation carried, else
    None): one record holds the send time, the slot and the capture.

Re-fetch (:meth:`ChunkIntake.on_refresh`, docs/protocol.md §10.7)
    A refresh (a fresh capture of a request still waiting, with its own ``seq_id``) is remembered in
    its request's record, with its own capture step; it holds no slot and starts no RTT. The chunk that answers it is aligned to the refresh's capture step (the
    observation the server actually served), its RTT runs from the request's first send, and once
    one publication of a request is answered the others are forgotten (a second answer to the same
    request is rejected, ``unknown_seq``).

Receiving (:meth:`ChunkIntake.on_chunk`, or :meth:`ChunkIntake.plan` without a buffer), in order:

1. ``SendTrigger.receive(seq_id)``, one look-up in the in-flight table: the RTT from the exact
   ``seq_id`` (also for a chunk that is then rejected: its round trip was real), the slot freed, the
   capture step answered (the request and its refreshes are forgotten). A chunk answering nothing
   remembered is rejected, ``unknown_seq`` (never asked, evicted, a duplicate, or from before
   :meth:`~ChunkIntake.clear`).
3. Horizon cut: at most ``max_actions`` rows (the client's ``actions_per_chunk``), then at most the
   chunk's ``execution_horizon`` (Kairos 3.1: the server vouches for those only; 0 keeps 1 row).
4. Stale trim (mode ``blend``; docs/client.md, "Timing: send trigger, RTT and trimming"): ``expired = int(rtt / dt)`` leading rows are in
   the past, none before the first RTT is known (the first chunk is applied whole), capped at the
   steps the robot actually executed since the capture (``delay_steps``): a robot that held still
   while its buffer was empty has lost nothing, so its chunk still starts at row 0.
5. Merge: the remaining rows go to ``ActionBuffer.merge(rows, capture_step + expired)``, which
   also drops rows for steps executed meanwhile and blends the overlap.

Merge modes (:class:`MergeMode`)
    ``blend``: steps 4 and 5 above. ``rtc`` (real-time chunking): a chunk that echoes
    ``rtc_delay_steps`` was computed by the server as the continuation of the leftover the
    observation carried, so there is no RTT trim and no blending: ``ActionBuffer.replace_from(rows,
    capture_step)`` drops the rows for the steps executed meanwhile and replaces the buffer from the
    step the chunk actually starts at (``next_step`` under the buffer's lock). The delay that
    happened, ``actual_delay_steps``, is that step minus the capture step, and is compared with the
    delay predicted when the observation left (:meth:`ChunkIntake.predict_delay_steps`). In ``rtc``
    mode a chunk without the echo (a server that did not apply RTC, e.g. an older standby) is
    blended as in ``blend`` mode, and a chunk answering an observation older than the last one
    replaced from is rejected, ``superseded`` (it continues a plan that was since replaced).

Delay estimate (:func:`estimate_delay_steps`)
    ``ceil(q / dt)`` with ``q`` the RTT quantile the send trigger keeps (capture to arrival: encoding,
    network, the server's queue and inference), clamped to ``[0, max_steps]``; before the first RTT,
    ``initial_delay_steps`` (clamped the same way).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer, MergeResult
from lerobot_zenoh.scheduling.send_trigger import SendTrigger, expired_steps

__all__ = ["ChunkIntake", "IntakeResult", "MergeMode", "estimate_delay_steps"]


class MergeMode(StrEnum):
    """How a chunk's rows enter the buffer."""

    BLEND = "blend"  # trim int(rtt/dt) expired rows, blend the overlap (ActionBuffer.merge)
    RTC = "rtc"  # real-time chunking: replace the buffer from the chunk's actual start (replace_from)


def estimate_delay_steps(rtt_s: float | None, dt_s: float, *, initial_steps: int, max_steps: int) -> int:
    """Control steps expected between an observation's capture and its chunk's arrival.

    ``ceil(rtt_s / dt_s)`` (the steps the robot starts meanwhile), or `initial_steps` when no RTT is
    known yet; clamped to ``[0, max_steps]``.
    """
    if not dt_s > 0:
        raise ValueError(f"dt_s must be positive, got {dt_s}")
    steps = initial_steps if rtt_s is None else math.ceil(max(rtt_s, 0.0) / dt_s - 1e-9)
    return max(0, min(int(steps), int(max_steps)))


@dataclass(frozen=True, slots=True)
class IntakeResult:
    """What the intake did with one chunk. Rows are counted after each stage, in order.

    ``rows`` (``kept - expired``) rows of the chunk, starting at row ``expired``, were (or, from
    :meth:`ChunkIntake.plan`, are to be) merged as steps ``first_step, first_step + 1, ...``.
    """

    seq_id: int
    accepted: bool
    reason: str | None = None  # why it was rejected: unknown_seq, or the buffer's ProtocolError reason
    detail: str = ""
    rtt_s: float | None = None  # None when the send time was unknown
    capture_step: int | None = None  # the step row 0 is meant for
    delay_steps: int = 0  # steps the robot executed between the capture and this intake
    kept: int = 0  # rows left by the horizon cut
    horizon_cut: int = 0  # trailing rows dropped because of the chunk's execution_horizon
    expired: int = 0  # leading rows trimmed by the RTT (<= kept)
    first_step: int | None = None  # the step of the first row handed to the merge
    rows: int = 0  # rows handed to the merge
    merge: MergeResult | None = None  # what the buffer did with them (None from `plan`)
    mode: MergeMode = MergeMode.BLEND  # how the rows went in (rtc: replace_from, no trim, no blend)
    predicted_delay_steps: int | None = None  # the delay the observation carried (rtc), else None
    # Steps executed between capture and merge, read under the buffer's lock (from `plan`: delay_steps).
    actual_delay_steps: int | None = None
    server_delay_steps: int | None = None  # the chunk's rtc_delay_steps echo: the delay the server assumed
    request_seq: int | None = None  # the request answered: seq_id itself, or the one this refresh stood for
    capture_age_s: float | None = None  # arrival minus the capture of the observation answered

    @property
    def trimmed_steps(self) -> int:
        """Leading rows not executed because they were in the past: RTT trim + the buffer's stale rows."""
        return self.expired + (self.merge.discarded_stale if self.merge is not None else 0)

    @property
    def delay_error_steps(self) -> int | None:
        """``actual - predicted`` delay (positive: the chunk came later than predicted), or None."""
        if self.predicted_delay_steps is None or self.actual_delay_steps is None:
            return None
        return self.actual_delay_steps - self.predicted_delay_steps


class ChunkIntake:
    """Capture steps of sent observations, and the fate of each chunk that answers one.

    Args:
        trigger: the client's send trigger; its in-flight table holds the captures, its RTT estimate
            measures every round trip.
        dt_s: the control period.
        max_actions: most rows taken from a chunk (the client's ``actions_per_chunk``); None: all.
        mode: how rows are merged (:class:`MergeMode`); may be changed later (the client switches
            to ``rtc`` when its server advertises it).
        max_pending: most requests remembered: narrows the trigger's in-flight table to it (the
            oldest is dropped beyond it).
        initial_delay_steps: the delay predicted before the first RTT is measured.
        delay_quantile: the RTT quantile the delay is predicted from; None: the send trigger's
            ``rtt_quantile``.

    `on_send` and `on_chunk` may run on different threads: the in-flight table has its lock, the
    buffer its own.
    """

    def __init__(self, trigger: SendTrigger, dt_s: float, *, max_actions: int | None = None,
                 mode: MergeMode | str = MergeMode.BLEND, max_pending: int = 1024,
                 initial_delay_steps: int = 3, delay_quantile: float | None = None) -> None:
        if not dt_s > 0:
            raise ConfigError("fps", f"control period must be positive, got dt_s={dt_s}")
        if max_actions is not None and max_actions < 1:
            raise ConfigError("actions_per_chunk", f"must be at least 1, got {max_actions}")
        if max_pending < 1:
            raise ConfigError("chunk_intake.max_pending", f"must be at least 1, got {max_pending}")
        if isinstance(initial_delay_steps, bool) or not isinstance(initial_delay_steps, int) or initial_delay_steps < 0:
            raise ConfigError("rtc.initial_delay_steps", f"must be an integer >= 0, got {initial_delay_steps!r}")
        if delay_quantile is not None and not (math.isfinite(delay_quantile) and 0.0 <= delay_quantile <= 1.0):
            raise ConfigError("rtc.delay_quantile", f"must be within [0, 1] or None, got {delay_quantile}")
        self.trigger = trigger
        self.table = trigger.table
        self.table.max_requests = min(self.table.max_requests, max_pending)
        self.dt_s = dt_s
        self.max_actions = max_actions
        self.mode = MergeMode(mode)
        self.initial_delay_steps = initial_delay_steps
        self.delay_quantile = delay_quantile
        self._lock = threading.Lock()
        self._last_replaced_seq: int | None = None  # rtc: the newest observation whose chunk replaced the buffer

    # -- sending

    def predict_delay_steps(self, max_steps: int) -> int:
        """The delay (control steps) an observation captured now will see: :func:`estimate_delay_steps`
        from the RTT quantile, at most `max_steps` (the rows of the leftover it carries)."""
        q = self.delay_quantile if self.delay_quantile is not None else self.trigger.config.rtt_quantile
        return estimate_delay_steps(self.trigger.rtt.quantile_s(q), self.dt_s,
                                    initial_steps=self.initial_delay_steps, max_steps=max_steps)

    def on_send(self, seq_id: int, step: int, now_s: float, *, predicted_delay_steps: int | None = None,
                nonce: int | None = None) -> None:
        """Observation `seq_id`, captured when the robot was about to execute `step`, leaves at `now_s`
        (carrying `predicted_delay_steps` when it has real-time-chunking inputs)."""
        self.trigger.on_send(seq_id, now_s, step=step, predicted_delay_steps=predicted_delay_steps, nonce=nonce)

    def on_refresh(self, seq_id: int, request_seq_id: int, step: int, now_s: float, *,
                   predicted_delay_steps: int | None = None) -> bool:
        """Re-fetch: observation `seq_id`, a fresh capture at `step` of the outstanding request
        `request_seq_id`, leaves at `now_s`. False (nothing remembered: do not publish it) when the
        request was answered or timed out meanwhile."""
        return self.trigger.on_refresh(seq_id, request_seq_id, now_s, step=step,
                                       predicted_delay_steps=predicted_delay_steps)

    def clear(self) -> int:
        """Forget every capture step (a new episode): later answers are rejected, still measured."""
        with self._lock:
            self._last_replaced_seq = None
        return self.table.forget_captures()

    @property
    def pending(self) -> int:
        """Publications (requests and refreshes) whose capture step is remembered."""
        return self.table.captures

    # -- receiving

    def on_chunk(self, seq_id: int, actions: np.ndarray, now_s: float, buffer: ActionBuffer, *,
                 execution_horizon: int | None = None, rtc_delay_steps: int | None = None) -> IntakeResult:
        """Take the chunk `actions` ``(T, D)`` answering `seq_id`, arrived at `now_s`, into `buffer`.

        `rtc_delay_steps` is the chunk's echo of the delay the server assumed (None: it did not apply
        real-time chunking). Never raises for a bad chunk: a rejection is a result with
        ``accepted=False`` and a reason, and the buffer is left unchanged.
        """
        planned = self._plan(seq_id, len(actions), now_s, buffer.next_step, execution_horizon, rtc_delay_steps)
        if not planned.accepted:
            return planned
        start = planned.expired
        rows = actions[start: start + planned.rows]
        try:
            if planned.mode is MergeMode.RTC:
                with self._lock:
                    last = self._last_replaced_seq
                if last is not None and seq_id < last:
                    return replace(planned, accepted=False, reason=Reason.SUPERSEDED,
                                   detail=f"answers observation {seq_id}, older than {last} whose chunk is in use")
                merged = buffer.replace_from(rows, planned.first_step)
                with self._lock:
                    if self._last_replaced_seq is None or seq_id > self._last_replaced_seq:
                        self._last_replaced_seq = seq_id
            else:
                merged = buffer.merge(rows, planned.first_step)
        except ProtocolError as exc:
            return replace(planned, accepted=False, reason=exc.reason, detail=str(exc))
        return replace(planned, merge=merged, actual_delay_steps=max(merged.next_step - planned.capture_step, 0))

    def plan(self, seq_id: int, rows: int, now_s: float, next_step: int, *,
             execution_horizon: int | None = None, rtc_delay_steps: int | None = None) -> IntakeResult:
        """The same decisions for a chunk of `rows` rows when there is no buffer to merge into.

        `next_step` is the step the robot executes next (a model's stand-in for ``buffer.next_step``).
        The caller applies the result: rows ``expired .. expired + rows`` as steps from ``first_step``
        (blended, or with ``mode`` rtc replacing everything from the first step not yet executed).
        """
        return self._plan(seq_id, rows, now_s, next_step, execution_horizon, rtc_delay_steps)

    def _plan(self, seq_id: int, rows: int, now_s: float, next_step: int,
              execution_horizon: int | None, rtc_delay_steps: int | None) -> IntakeResult:
        first_known = self.trigger.rtt.last_rtt_s is not None  # before this chunk's own sample
        answer = self.trigger.receive(seq_id, now_s)
        rtt_s, capture = answer.rtt_s, answer.capture
        if capture is None or capture.step is None:
            return IntakeResult(seq_id, False, Reason.UNKNOWN_SEQ, "not an answer to a remembered observation", rtt_s)
        step, predicted, captured_s, request = capture.step, capture.predicted_delay_steps, capture.captured_s, answer.request_seq
        delay = max(int(next_step) - step, 0)
        # Replace only a chunk the server says it conditioned on our leftover; any other is blended.
        mode = MergeMode.RTC if self.mode is MergeMode.RTC and rtc_delay_steps is not None else MergeMode.BLEND
        kept = rows if self.max_actions is None else min(rows, self.max_actions)
        horizon_cut = 0
        if execution_horizon is not None and execution_horizon < kept:
            h = max(int(execution_horizon), 1)  # 0 would mean "nothing": keep at least one
            horizon_cut, kept = kept - h, h
        expired = 0
        if mode is MergeMode.BLEND and first_known:
            expired = min(expired_steps(rtt_s, self.dt_s), delay, kept)
        return IntakeResult(seq_id, True, rtt_s=rtt_s, capture_step=step, delay_steps=delay, kept=kept,
                            horizon_cut=horizon_cut, expired=expired, first_step=step + expired, rows=kept - expired,
                            mode=mode, predicted_delay_steps=predicted, actual_delay_steps=delay,
                            server_delay_steps=rtc_delay_steps, request_seq=request,
                            capture_age_s=now_s - captured_s)
