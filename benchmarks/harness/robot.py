"""The simulated robot every benchmark drives: the reference client's own parts in one class.

A robot here is what `client/control_loop.py`'s `ControlLoop.step` and `client/chunk_receiver.py` do,
without the robot hardware, the camera and the threads: the client's `SendTrigger` (when to send,
request time-outs, re-fetch), its `ChunkIntake` (the capture step a chunk is aligned to, the RTT
from the exact seq_id, the horizon cut, the stale trim or real-time chunking) and its `ActionBuffer`
(what is executed at each step). Nothing in this module decides a rule of its own: a change to the
client's send rule or intake changes every benchmark that drives this class.

A study's driver calls, once per control period of each robot (``ControlLoop.step``'s order):

    capture = robot.capture(now)        # a new request when the send rule fires, else a due refresh
    if capture is not None:
        publisher.put(codec.encode(robot.observation(capture, state, images, task)))
    robot.act()                         # pop the action for this step (None: the robot stalls)

and, for each chunk that reaches it (decoded by the driver, which counts what it cannot decode),
``robot.take(chunk, arrived_s)``. What the driver counts (stalls, RTTs, rejections) is its own.

Knobs the client's parts lack, for the studies that compare against them (never a second rule):

- ``merge="no_trim"``: a chunk goes into the buffer from the step the robot is at on arrival, with
  no stale trim (the intake still checks and measures it; the RTC study's baseline);
- ``capture(now, allowed=False)``: the driver forbids a new request this step (a task whose remaining
  actions are all buffered already asks for nothing more); a due refresh is still published.

A discrete-event model without real time (``benchmarks/studies/fleet.py``) builds this class too and
uses its trigger and intake (:meth:`buffer_time_s`, :meth:`record_send`, :meth:`plan`) where the
buffer's steps are computed, not executed.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from lerobot_zenoh.protocol.messages import ActionChunk, ExecutionInfo, Observation, RtcInputs
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer, AggregateConfig
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake, IntakeResult, MergeMode
from lerobot_zenoh.scheduling.send_trigger import RttTracker, SendTrigger, SendTriggerConfig

__all__ = ["MERGES", "Capture", "SimulatedRobot"]

#: How a chunk enters the buffer: the client's two modes, and the baseline without the stale trim.
MERGES = ("blend", "rtc", "no_trim")


@dataclass(frozen=True, slots=True)
class Capture:
    """An observation the robot hands over at a step: a new request, or a refresh (re-fetch) of the
    waiting request `refreshes`."""

    seq: int
    step: int  # the step row 0 of its chunk is meant for (the buffer's next step at capture)
    depth: int  # actions buffered at capture
    now_s: float
    refreshes: int | None = None
    rtc: RtcInputs | None = None  # the leftover and predicted delay (merge "rtc" only)


class SimulatedRobot:
    """One simulated robot around the reference client's send trigger, chunk intake and action buffer.

    Args:
        client_id: its client id on the wire.
        dt_s: the control period.
        send_rule: the send trigger's settings (the client's defaults when None).
        rtt: an RTT estimate kept across tasks (:meth:`new_task`); a new one of the rule's window by default.
        max_actions: most rows taken from a chunk (the client's ``actions_per_chunk``); None: all.
        merge: one of :data:`MERGES`.
        aggregate: how the buffer blends an overlap (the client's default when None).
        action_dim: the buffer's action dimension (None: set by the first chunk).
        rtc_rows: most leftover rows an observation carries with ``merge="rtc"`` (the server's
            ``max_actions_per_chunk``); None: all buffered.
    """

    def __init__(self, client_id: str, *, dt_s: float, send_rule: SendTriggerConfig | None = None,
                 rtt: RttTracker | None = None, max_actions: int | None = None, merge: str = "blend",
                 aggregate: AggregateConfig | None = None, action_dim: int | None = None,
                 rtc_rows: int | None = None) -> None:
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
        self.client_id, self.dt_s, self.merge, self.rtc_rows = client_id, dt_s, merge, rtc_rows
        self.send_rule = send_rule if send_rule is not None else SendTriggerConfig()
        self.rtt = rtt if rtt is not None else RttTracker(window=self.send_rule.rtt_window)
        self._aggregate, self._action_dim = aggregate, action_dim
        self.buffer = self._new_buffer()
        self.trigger, self.intake = self._new_rule(self.send_rule, max_actions)
        self.session_nonce = secrets.randbits(63)  # one per robot, as one per reference client
        self.seq = 0  # the last seq_id handed over
        self.episode = 0
        self.moving = False  # it has executed an action since its last task began

    def _new_buffer(self) -> ActionBuffer:
        return ActionBuffer(self._aggregate, action_dim=self._action_dim)

    def _new_rule(self, send_rule: SendTriggerConfig, max_actions: int | None) -> tuple[SendTrigger, ChunkIntake]:
        trigger = SendTrigger(send_rule, dt_s=self.dt_s, rtt=self.rtt)
        mode = MergeMode.RTC if self.merge == "rtc" else MergeMode.BLEND
        return trigger, ChunkIntake(trigger, self.dt_s, max_actions=max_actions, mode=mode)

    # -- tasks

    def new_task(self, *, send_rule: SendTriggerConfig | None = None, max_actions: int | None = None) -> None:
        """A new task (episode): the buffer emptied, a new trigger and intake (answers still in flight
        are for the last task: measured, never merged); the RTT estimate is kept (the robot's link
        has not changed)."""
        self.episode += 1
        self.moving = False
        self.buffer.clear()
        self.trigger, self.intake = self._new_rule(send_rule or self.send_rule, max_actions)

    def end_task(self) -> None:
        """The task is done: answers still in flight are measured, not merged."""
        self.intake.clear()

    # -- one control step

    def capture(self, now_s: float, *, allowed: bool = True) -> Capture | None:
        """The observation this step hands over, as `ControlLoop._send` decides: a new request when
        `allowed` and the send rule fires, else a refresh of the waiting request when one is due
        (re-fetch on), else None. The capture is recorded in the intake before it is returned."""
        depth = self.buffer.depth
        if allowed and self.trigger.should_send(depth, now_s):
            return self._capture(now_s, depth, None)
        request = self.trigger.refresh_due(now_s)
        if request is not None:
            return self._capture(now_s, depth, request)
        return None

    def would_send(self, now_s: float, depth: int | None = None) -> bool:
        """Whether the send rule fires at `now_s` for `depth` buffered actions (the buffer's by
        default), without capturing anything."""
        return self.trigger.should_send(self.buffer.depth if depth is None else depth, now_s)

    def _capture(self, now_s: float, depth: int, refreshes: int | None) -> Capture | None:
        seq = self.seq + 1
        step, rtc = self.buffer.next_step, None
        if self.merge == "rtc":
            step, prefix = self.buffer.leftover(self.rtc_rows)
            if prefix.shape[1] == 0 and self._action_dim:
                prefix = np.zeros((0, self._action_dim), dtype=np.float32)
            rtc = RtcInputs(prefix, self.intake.predict_delay_steps(len(prefix)))
        predicted = None if rtc is None else rtc.delay_steps
        if refreshes is None:
            self.intake.on_send(seq, step, now_s, predicted_delay_steps=predicted, nonce=self.session_nonce)
        elif not self.intake.on_refresh(seq, refreshes, step, now_s, predicted_delay_steps=predicted):
            return None  # answered or timed out since refresh_due named it
        self.seq = seq
        return Capture(seq, step, depth, now_s, refreshes, rtc)

    def observation(self, capture: Capture, state: np.ndarray, images: dict[str, bytes] | None = None,
                    task: str = "", *, task_elapsed_s: float | None = None, **fields) -> Observation:
        """The message of `capture`: `state`, JPEG `images` and `task`, with the robot's session nonce,
        episode, buffered actions and control period, and its refresh and RTC inputs; `fields`: other
        `Observation` fields (e.g. ``component_mask``)."""
        execution = ExecutionInfo(actions_buffered=capture.depth, control_period_s=self.dt_s) if task_elapsed_s is None \
            else ExecutionInfo(task_elapsed_s=task_elapsed_s, actions_buffered=capture.depth, control_period_s=self.dt_s)
        return Observation(capture.seq, self.client_id, state, images or {}, task, execution,
                           episode_id=str(self.episode), session_nonce=self.session_nonce, rtc=capture.rtc,
                           refreshes_seq_id=capture.refreshes, **fields)

    def act(self) -> tuple[int, np.ndarray] | None:
        """Execute this step: the buffered ``(step, action)``, or None (the robot stands still: a
        stall once it has moved, a wait for its first chunk before)."""
        popped = self.buffer.pop()
        if popped is not None:
            self.moving = True
        return popped

    # -- chunks

    def take(self, chunk: ActionChunk, arrived_s: float) -> IntakeResult:
        """A chunk that arrived at `arrived_s`, through the client's intake into the buffer (a
        rejection is a result with a reason; the buffer is then unchanged)."""
        return self.take_actions(chunk.response_to_seq_id, chunk.actions, arrived_s,
                                 execution_horizon=chunk.execution_horizon, rtc_delay_steps=chunk.rtc_delay_steps)

    def take_actions(self, seq: int, actions: np.ndarray, arrived_s: float, *, execution_horizon: int | None = None,
                     rtc_delay_steps: int | None = None) -> IntakeResult:
        """:meth:`take` for the rows `actions` ``(T, D)`` answering `seq` (a study without the wire)."""
        if self.merge == "no_trim":
            result = self.intake.plan(seq, len(actions), arrived_s, self.buffer.next_step,
                                      execution_horizon=execution_horizon)
            if result.accepted:
                self.buffer.merge(actions[:result.kept], self.buffer.next_step)
            return result
        return self.intake.on_chunk(seq, actions, arrived_s, self.buffer, execution_horizon=execution_horizon,
                                    rtc_delay_steps=rtc_delay_steps)

    # -- for a model without real time (no buffer executed)

    def buffer_time_s(self) -> float:
        """The send rule's threshold now: send when the buffered actions last less than this."""
        return self.trigger.buffer_time_s()

    def record_send(self, seq: int, step: int, now_s: float) -> None:
        """Request `seq`, captured for `step`, leaves at `now_s` (a model that decides the send time itself)."""
        self.seq = seq
        self.intake.on_send(seq, step, now_s)

    def plan(self, seq: int, rows: int, now_s: float, next_step: int, *,
             execution_horizon: int | None = None) -> IntakeResult:
        """The intake's decisions for a chunk of `rows` rows where the buffer is a model's (`next_step`)."""
        return self.intake.plan(seq, rows, now_s, next_step, execution_horizon=execution_horizon)
