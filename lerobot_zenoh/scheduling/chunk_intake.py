"""The robot client's chunk intake: what an arriving action chunk means for the action buffer.

Pure bookkeeping and arithmetic with an injected clock: every method that depends on time takes
``now_s`` (one process's ``time.perf_counter()``), nothing here reads a clock, sleeps or does I/O.
The reference client (`client/client.py`) and both fleet benchmarks run the same code, so what a
benchmark measures is what the client does.

Sending (:meth:`ChunkIntake.on_send`)
    Remembers ``seq_id -> step at capture`` (the buffer's ``next_step`` when the observation was
    taken: the step row 0 of its chunk is meant for) in a bounded table (the oldest is dropped
    beyond ``max_pending``), and tells the `SendTrigger` (RTT send time, in-flight slot).

Receiving (:meth:`ChunkIntake.on_chunk`, or :meth:`ChunkIntake.plan` without a buffer), in order:

1. RTT: ``SendTrigger.on_receive(seq_id)`` from the exact ``seq_id`` (also for a chunk that is then
   rejected: its round trip was real).
2. The capture step is looked up (and forgotten); a chunk answering nothing remembered is rejected,
   ``unknown_seq`` (never asked, evicted, a duplicate, or from before :meth:`~ChunkIntake.clear`).
3. Horizon cut: at most ``max_actions`` rows (the client's ``actions_per_chunk``), then at most the
   chunk's ``execution_horizon`` (Kairos 3.1: the server vouches for those only; 0 keeps 1 row).
4. Stale trim (seed 002 section 8.2, mode ``blend``): ``expired = int(rtt / dt)`` leading rows are in
   the past, none before the first RTT is known (the first chunk is applied whole), capped at the
   steps the robot actually executed since the capture (``delay_steps``): a robot that held still
   while its buffer was empty has lost nothing, so its chunk still starts at row 0.
5. Merge: the remaining rows go to ``ActionBuffer.merge(rows, capture_step + expired)``, which
   also drops rows for steps executed meanwhile and blends the overlap.

Merge modes
    :class:`MergeMode` names how step 4 and 5 are done. Only ``blend`` exists now. Real-time
    chunking (the next issue) is another mode: no RTT trim (the server already conditioned the
    chunk on the actions the robot executes meanwhile), the buffer replaced from the step the chunk
    actually starts, no blending; the pending record gains the predicted delay sent with the
    observation, which the result compares with ``delay_steps``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer, MergeResult
from lerobot_zenoh.scheduling.send_trigger import SendTrigger, expired_steps

__all__ = ["ChunkIntake", "IntakeResult", "MergeMode"]


class MergeMode(StrEnum):
    """How a chunk's rows enter the buffer."""

    BLEND = "blend"  # trim int(rtt/dt) expired rows, blend the overlap (ActionBuffer.merge)


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

    @property
    def trimmed_steps(self) -> int:
        """Leading rows not executed because they were in the past: RTT trim + the buffer's stale rows."""
        return self.expired + (self.merge.discarded_stale if self.merge is not None else 0)


class ChunkIntake:
    """Capture steps of sent observations, and the fate of each chunk that answers one.

    Args:
        trigger: the client's send trigger; its RTT tracker measures every round trip.
        dt_s: the control period.
        max_actions: most rows taken from a chunk (the client's ``actions_per_chunk``); None: all.
        mode: how rows are merged (:class:`MergeMode`).
        max_pending: most capture steps remembered; the oldest is dropped beyond it.

    `on_send` and `on_chunk` may run on different threads: the table is guarded by a lock held
    for a dictionary operation only (the buffer has its own).
    """

    def __init__(self, trigger: SendTrigger, dt_s: float, *, max_actions: int | None = None,
                 mode: MergeMode | str = MergeMode.BLEND, max_pending: int = 1024) -> None:
        if not dt_s > 0:
            raise ConfigError("fps", f"control period must be positive, got dt_s={dt_s}")
        if max_actions is not None and max_actions < 1:
            raise ConfigError("actions_per_chunk", f"must be at least 1, got {max_actions}")
        if max_pending < 1:
            raise ConfigError("chunk_intake.max_pending", f"must be at least 1, got {max_pending}")
        self.trigger = trigger
        self.dt_s = dt_s
        self.max_actions = max_actions
        self.mode = MergeMode(mode)
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._capture_steps: OrderedDict[int, int] = OrderedDict()  # seq_id -> step at capture

    # -- sending

    def on_send(self, seq_id: int, step: int, now_s: float) -> None:
        """Observation `seq_id`, captured when the robot was about to execute `step`, leaves at `now_s`."""
        with self._lock:
            self._capture_steps.pop(seq_id, None)
            self._capture_steps[seq_id] = int(step)
            while len(self._capture_steps) > self._max_pending:
                self._capture_steps.popitem(last=False)
        self.trigger.on_send(seq_id, now_s)

    def clear(self) -> int:
        """Forget every capture step (a new episode): later answers are rejected, still measured."""
        with self._lock:
            n = len(self._capture_steps)
            self._capture_steps.clear()
            return n

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._capture_steps)

    # -- receiving

    def on_chunk(self, seq_id: int, actions: np.ndarray, now_s: float, buffer: ActionBuffer, *,
                 execution_horizon: int | None = None) -> IntakeResult:
        """Take the chunk `actions` ``(T, D)`` answering `seq_id`, arrived at `now_s`, into `buffer`.

        Never raises for a bad chunk: a rejection is a result with ``accepted=False`` and a reason,
        and the buffer is left unchanged.
        """
        planned = self._plan(seq_id, len(actions), now_s, buffer.next_step, execution_horizon)
        if not planned.accepted:
            return planned
        start = planned.expired
        try:
            merged = buffer.merge(actions[start: start + planned.rows], planned.first_step)
        except ProtocolError as exc:
            return replace(planned, accepted=False, reason=exc.reason, detail=str(exc))
        return replace(planned, merge=merged)

    def plan(self, seq_id: int, rows: int, now_s: float, next_step: int, *,
             execution_horizon: int | None = None) -> IntakeResult:
        """The same decisions for a chunk of `rows` rows when there is no buffer to merge into.

        `next_step` is the step the robot executes next (a model's stand-in for ``buffer.next_step``).
        The caller applies the result: rows ``expired .. expired + rows`` as steps from ``first_step``.
        """
        return self._plan(seq_id, rows, now_s, next_step, execution_horizon)

    def _plan(self, seq_id: int, rows: int, now_s: float, next_step: int,
              execution_horizon: int | None) -> IntakeResult:
        first_known = self.trigger.rtt.last_rtt_s is not None  # before this chunk's own sample
        rtt_s = self.trigger.on_receive(seq_id, now_s)
        with self._lock:
            step = self._capture_steps.pop(seq_id, None)
        if step is None:
            return IntakeResult(seq_id, False, "unknown_seq", "not an answer to a remembered observation", rtt_s)
        delay = max(int(next_step) - step, 0)
        kept = rows if self.max_actions is None else min(rows, self.max_actions)
        horizon_cut = 0
        if execution_horizon is not None and execution_horizon < kept:
            h = max(int(execution_horizon), 1)  # 0 would mean "nothing": keep at least one
            horizon_cut, kept = kept - h, h
        expired = 0
        if self.mode is MergeMode.BLEND and first_known:
            expired = min(expired_steps(rtt_s, self.dt_s), delay, kept)
        return IntakeResult(seq_id, True, rtt_s=rtt_s, capture_step=step, delay_steps=delay, kept=kept,
                            horizon_cut=horizon_cut, expired=expired, first_step=step + expired, rows=kept - expired)
