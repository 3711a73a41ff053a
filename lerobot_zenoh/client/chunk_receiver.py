"""The chunk receiver: action chunks from the Zenoh callback into the action buffer.

The Zenoh callback (:meth:`ChunkReceiver.on_chunk`) only appends ``(payload, arrival time)`` to a
bounded inbox and returns. The receiver thread (:meth:`ChunkReceiver.run`) decodes and checks each
chunk, hands it to the chunk intake (``scheduling/chunk_intake.py``: RTT from its exact seq_id,
horizon cut, stale trim, merge under the buffer's lock), counts what happened and tells the server
watch (nothing waits now; which server answered). Between chunks, and at least every 50 ms, it
ticks the server watch (watchdog, session renewal).

Testable alone: :meth:`handle` takes the payload and its arrival time, no thread and no session.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from lerobot_zenoh.client.reporting import ClientCounters
from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Refusal
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake, IntakeResult, MergeMode
from lerobot_zenoh.scheduling.send_trigger import DEFAULT_REFETCH_AFTER_S
from lerobot_zenoh.telemetry.publisher import worth_logging

log = logging.getLogger(__name__)

__all__ = ["ChunkReceiver"]


class ChunkReceiver:
    """Args:
        intake: the chunk intake (it owns the in-flight table's answer and the merge).
        buffer: the action buffer chunks are merged into.
        action_dim: the robot's action dimension (a chunk of another width is rejected).
        watch: the server watch (told of each accepted chunk; ticked by `run`).
        counters: chunks received / rejected, RTT, trims, RTC figures are counted here.
        client_uuid: for the logs.
        mispredict_steps: a real-time-chunking delay this far off the prediction is counted as wrong.
        on_accepted: ``(seq_id, arrived_s)`` after a chunk went into the buffer (a task books it), or None.
        on_refused: ``(refusal)`` when the server refuses a request of ours for a reason every
            request like it will meet (`Refusal.permanent`): the client stops on it. None: logged only.

    A `Refusal` (protocol 1.5) is believed only when it answers a request still in flight (so a stray
    or forged one about another request changes nothing); a permanent one is handed to `on_refused`,
    a transient one (a cool-down, a busy engine) is logged once per reason and the client carries on.
    """

    def __init__(self, intake: ChunkIntake, buffer: ActionBuffer, *, action_dim: int, watch, counters: ClientCounters,
                 client_uuid: str, mispredict_steps: int, on_accepted: Callable[[int, float], None] | None = None,
                 on_refused: Callable[[Refusal], None] | None = None, inbox_size: int = 256) -> None:
        self.intake = intake
        self.buffer = buffer
        self.action_dim = action_dim
        self.watch = watch
        self.counters = counters
        self.client_uuid = client_uuid
        self.mispredict_steps = mispredict_steps
        self.on_accepted = on_accepted
        self.on_refused = on_refused
        self._refusals_shown: set[str] = set()
        self.inbox: queue.Queue = queue.Queue(maxsize=inbox_size)

    def on_chunk(self, key: str, payload: bytes) -> None:
        """Zenoh callback: hand over with the arrival time, nothing else."""
        try:
            self.inbox.put_nowait((payload, time.perf_counter()))
        except queue.Full:
            self.counters.chunks_rejected += 1

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                payload, arrived_s = self.inbox.get(timeout=0.05)
            except queue.Empty:
                self.watch.tick(time.perf_counter())
                continue
            self.handle(payload, arrived_s)
            self.watch.tick(time.perf_counter())

    def handle(self, payload: bytes, arrived_s: float) -> IntakeResult | None:
        """Decode, check and take one chunk; returns the intake's result (None: undecodable)."""
        c = self.counters
        try:
            chunk = codec.decode_action_answer(payload)
            if isinstance(chunk, Refusal):
                self._refusal(chunk)
                return None
            if chunk.actions.shape[1] != self.action_dim:
                raise ProtocolError(Reason.ACTION_SHAPE, f"{chunk.actions.shape[1]} dims, robot takes {self.action_dim}")
        except ProtocolError as exc:
            c.chunks_rejected += 1
            log.warning("%s: rejected action chunk: %s", self.client_uuid, exc)
            return None
        result = self.intake.on_chunk(chunk.response_to_seq_id, chunk.actions, arrived_s, self.buffer,
                                      execution_horizon=chunk.execution_horizon,
                                      rtc_delay_steps=chunk.rtc_delay_steps)
        if not result.accepted:
            c.chunks_rejected += 1
            if result.reason != Reason.UNKNOWN_SEQ:  # unknown: an answer to nothing we asked (or far too old)
                log.warning("%s: rejected action chunk: %s", self.client_uuid, result.detail)
            return result
        c.chunks_received += 1
        self._count_rtc(result)
        c.trimmed_steps += result.trimmed_steps
        c.horizon_cut_steps += result.horizon_cut
        if result.rtt_s is not None:
            c.rtt_ms.append(result.rtt_s * 1000)
            c.rtt_hist.observe_s(result.rtt_s)
        if result.capture_age_s is not None:
            c.observation_age_ms.append(max(result.capture_age_s * 1000 - chunk.inference_time_ms, 0.0))
        c.inference_ms.append(chunk.inference_time_ms)
        if self.watch.refetch_auto:
            # The default threshold is never below the model's own time (median of the last 16): a
            # request younger than that may be in inference rather than waiting, and a refresh of it
            # would be late (a capture and an encode for nothing).
            recent = sorted(itertools.islice(reversed(c.inference_ms), 16))  # no copy of the deque
            self.intake.trigger.refetch_after_s = max(DEFAULT_REFETCH_AFTER_S, recent[len(recent) // 2] / 1000)
        self.watch.note_chunk(chunk.server_id)
        if self.on_accepted is not None:
            self.on_accepted(chunk.response_to_seq_id, arrived_s)
        return result

    def _refusal(self, refusal: Refusal) -> None:
        if refusal.response_to_seq_id not in self.intake.table:  # not about a request of ours in flight
            self.counters.chunks_rejected += 1
            return
        self.counters.refusals += 1
        if refusal.permanent and self.on_refused is not None:
            self.on_refused(refusal)
        elif refusal.reason not in self._refusals_shown:
            self._refusals_shown.add(refusal.reason)
            log.warning("%s: the server refused request %d (%s): %s; retrying (shown once per reason)",
                        self.client_uuid, refusal.response_to_seq_id, refusal.reason, refusal.detail)

    def _count_rtc(self, result: IntakeResult) -> None:
        """Predicted vs actual delay of a chunk that answered a real-time-chunking observation."""
        c = self.counters
        if result.predicted_delay_steps is None:
            return
        if result.mode is not MergeMode.RTC:
            c.rtc_fallback_chunks += 1
            if worth_logging(c.rtc_fallback_chunks):
                log.warning("%s: chunk %d answers a real-time-chunking observation without rtc_delay_steps; "
                            "blended instead [%d so far]", self.client_uuid, result.seq_id, c.rtc_fallback_chunks)
            return
        c.rtc_chunks += 1
        c.rtc_delays.append((result.predicted_delay_steps, result.actual_delay_steps))
        if result.server_delay_steps is not None and result.server_delay_steps != result.predicted_delay_steps:
            c.rtc_delay_overridden += 1
        error = result.delay_error_steps
        if error is not None and abs(error) >= self.mispredict_steps:
            c.rtc_delay_mispredicted += 1
            n = c.rtc_delay_mispredicted
            if worth_logging(n):
                log.warning("%s: inference delay mispredicted: chunk %d started %d steps after its capture, "
                            "predicted %d (RTT %s ms) [%d wrong estimates in %d RTC chunks]",
                            self.client_uuid, result.seq_id, result.actual_delay_steps,
                            result.predicted_delay_steps,
                            "?" if result.rtt_s is None else f"{result.rtt_s * 1000:.0f}", n, c.rtc_chunks)
