"""The control loop: capture -> outbox -> pop action -> robot -> wait for the next deadline.

Runs on the caller's thread (`RobotClient.run`) and never waits on the network: it touches no Zenoh,
no JPEG and no dataset writer beyond handing things over (the recorder's `record` queues a frame).

Each step: the robot's observation; when the send rule says so (``SendTrigger.should_send``) and the
task asks (``Task.ask``), a :class:`Capture` goes to the outbox as a new request, recorded in the
in-flight table with its capture step (``ChunkIntake.on_send``); otherwise, with re-fetch on, a
fresh capture refreshes the oldest waiting request (``refresh_due``, ``on_refresh``). Then the next
action: the task's override, else the buffer's next action, else the fail-safe (hold or zero
velocity). Deadlines are ``t0 + k * dt`` (a late step does not shift the rest; far behind, missed
deadlines are skipped rather than burst).

Episodes and recording (``--dataset.*``): ``num_episodes`` episodes of ``episode_time_s``, each
followed (but the last) by a reset phase of ``reset_time_s`` in which the robot is held, no
observation is sent and nothing is recorded, as lerobot-record. Without a dataset: one episode,
until stopped, unless the task ends or retries its attempt.

Timing (all from this process's perf_counter): an observation captured when the robot is about to
execute step s is answered by a chunk whose row 0 is meant for step s (``scheduling/chunk_intake.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.discovery import RobotFeatures
from lerobot_zenoh.client.observation_publisher import Capture, Outbox
from lerobot_zenoh.client.reporting import ClientCounters
from lerobot_zenoh.client.task import Task
from lerobot_zenoh.protocol.messages import ExecutionInfo, RtcInputs
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake

log = logging.getLogger(__name__)

__all__ = ["ControlLoop", "failsafe_mode_of"]


def failsafe_mode_of(config_value: str, features: RobotFeatures) -> str:
    """hold or zero_velocity: `auto` is zero_velocity when every action is a velocity (*.vel)."""
    if config_value != "auto":
        return config_value
    return "zero_velocity" if all(n.endswith(".vel") for n in features.action_names) else "hold"


class ControlLoop:
    """Args:
        config: the client's config (fps, dataset episodes, fail-safe, warnings).
        robot: a connected `lerobot.robots.Robot`.
        features: its action, state and camera names.
        buffer, intake, outbox: the action buffer, the chunk intake (and its send trigger), the
            hand-over to the publisher.
        watch: the server watch (running or re-validating, RTC, re-fetch, history, the session nonce).
        task: the strategy (`client/task.py`).
        counters: steps, actions, holds, overruns are counted here.
        recorder: has `record(observation, action, failsafe=)` and `end_episode()`; or None.
        stop: the client's stop event.
    """

    def __init__(self, config: RobotClientConfig, robot, features: RobotFeatures, *, buffer: ActionBuffer,
                 intake: ChunkIntake, outbox: Outbox, watch, task: Task, counters: ClientCounters, recorder=None,
                 stop: threading.Event) -> None:
        self.config = config
        self.robot = robot
        self.features = features
        self.buffer = buffer
        self.intake = intake
        self.trigger = intake.trigger
        self.outbox = outbox
        self.watch = watch
        self.task = task
        self.counters = counters
        self.recorder = recorder
        self.stop = stop
        self.dt_s = config.dt_s
        self.failsafe_mode = failsafe_mode_of(config.failsafe, features)
        self.episode = 0  # sent as the observation's episode_id (the server resets per-episode state on a change)
        self._seq_id = 0
        self._history: deque = deque(maxlen=0)  # the last history_length raw observations, one per step
        self._last_action: dict | None = None
        self._last_observation: dict | None = None
        self._empty_streak = 0
        self._wake = threading.Event()

    # -- the loop

    def run(self, duration_s: float | None = None) -> ClientCounters:
        """Run until `stop`, `duration_s` (default `--duration_s`), or the last episode."""
        cfg = self.config
        ds = cfg.dataset
        limit_s = duration_s if duration_s is not None else cfg.duration_s
        episode_s = float(ds.episode_time_s) if ds is not None else None
        episodes = ds.num_episodes if ds is not None else 1
        reset_s = float(ds.reset_time_s) if ds is not None else 0.0
        t0 = time.perf_counter()
        phase_start = t0
        resetting = False
        episodes_done = 0
        steps_at_start, held_at_start = self.counters.steps, self.counters.empty_cycles
        self._log_episode_start(episodes, episode_s)
        next_deadline = t0
        last_tick = None
        self.task.begin_attempt(t0)
        while not self.stop.is_set():
            now = time.perf_counter()
            if limit_s is not None and now - t0 >= limit_s:
                break
            # A multi-model task may end its attempt early (done, failed, a fallback): client/pipeline.py.
            outcome = None if resetting else self.task.outcome(now)
            if outcome == "stop" or (outcome == "done" and ds is None):
                break
            if outcome == "retry" and ds is None:  # no dataset: a reset phase, then the task again
                resetting, phase_start = True, now
                self._begin_reset()
                reset_s = self.task.retry_reset_s()
                log.info("%s: task reset for %g s, then attempt %d", cfg.client_uuid, reset_s, self.episode + 2)
            elif outcome in ("retry", "done") or (
                    not resetting and episode_s is not None and now - phase_start >= episode_s):
                episodes_done += 1
                if self.recorder is not None:
                    self.recorder.end_episode()
                log.info("%s: episode %d/%d done: %d steps, %d held for want of an action", cfg.client_uuid,
                         episodes_done, episodes, self.counters.steps - steps_at_start,
                         self.counters.empty_cycles - held_at_start)
                if episodes_done >= episodes:
                    break
                resetting, phase_start = True, now
                self._begin_reset()
                log.info("%s: reset for %g s: robot held, nothing recorded", cfg.client_uuid, reset_s)
            if resetting and now - phase_start >= reset_s:
                resetting, phase_start = False, now
                self.episode += 1
                steps_at_start, held_at_start = self.counters.steps, self.counters.empty_cycles
                self._log_episode_start(episodes, episode_s)
                self.task.begin_attempt(now)
            if last_tick is not None:
                self.counters.period_ms.append((now - last_tick) * 1000)
            last_tick = now
            if resetting:
                self.hold_step()
            else:
                self.step(now, phase_start)
            # Absolute schedule: deadlines are t0 + k*dt, so a late step does not shift the rest.
            next_deadline += self.dt_s
            remaining = next_deadline - time.perf_counter()
            if remaining > 0:
                self._wait_until(next_deadline)
            else:
                self.counters.overruns += 1
                self.counters.max_lateness_ms = max(self.counters.max_lateness_ms, -remaining * 1000)
                if -remaining > 5 * self.dt_s:  # far behind: skip missed deadlines rather than burst
                    next_deadline = time.perf_counter()
        return self.counters

    def _wait_until(self, deadline_s: float) -> None:
        """Sleep until the step's deadline; `wake()` (a danger verdict) interrupts it for the task's `react`."""
        while not self.stop.is_set():
            remaining = deadline_s - time.perf_counter()
            if remaining <= 0 or not self._wake.wait(remaining):
                return
            self._wake.clear()
            if not self.stop.is_set():
                action = self.task.react(self._last_observation, time.perf_counter())
                if action is not None:  # the robot takes the task's mode now, not a period later
                    self.buffer.clear()
                    self.robot.send_action(action)
                    self.counters.override_steps += 1

    def wake(self) -> None:
        """Interrupt the wait between steps (any thread)."""
        self._wake.set()

    def _log_episode_start(self, episodes: int, episode_s: float | None) -> None:
        if self.config.dataset is None:
            return
        log.info("%s: episode %d/%d: recording for %g s into %s", self.config.client_uuid,
                 self.episode + 1, episodes, episode_s, getattr(self.recorder, "root", "(no recorder)"))

    def _begin_reset(self) -> None:
        """Between episodes: drop what the policy planned, forget requests in flight (their answers
        belong to the episode that ended and are refused when they arrive) and the frames of the
        episode that ended (a new episode's history starts with it)."""
        self.buffer.clear()
        self._history.clear()
        self.intake.clear()
        self.trigger.forget_outstanding()
        self.watch.forget_waiting()

    # -- one step

    def hold_step(self) -> None:
        """One reset-phase step: the robot gets its fail-safe action; nothing is sent or recorded."""
        observation = self.robot.get_observation()
        self.buffer.clear()  # a late chunk of the previous episode must not move the robot
        override = self.task.override(observation, time.perf_counter())
        self.robot.send_action(override or self.failsafe_action(observation))
        self.counters.reset_steps += 1

    def step(self, now: float, episode_start: float) -> None:
        """One control step at `now` of an episode that started at `episode_start`."""
        observation = self.robot.get_observation()
        self._last_observation = observation
        self._send(observation, now, episode_start)
        wanted = self.watch.history_length
        if self._history.maxlen != wanted:
            self._history = deque(self._history, maxlen=wanted)
        if wanted:
            self._history.append(observation)  # one control period apart: every step is kept
        override = self.task.override(observation, now)
        if override is not None:
            self.buffer.clear()  # the robot does not follow the policy now: its plan goes stale
            sent = self.robot.send_action(override)
            self.counters.override_steps += 1
            popped = None
        else:
            popped = self.buffer.pop()
            if popped is not None:
                _, vector = popped
                action = dict(zip(self.features.action_names, (float(x) for x in vector)))
                sent = self.robot.send_action(action)
                self._last_action = action
                self.counters.actions_executed += 1
                self._empty_streak = 0
            else:
                sent = self._failsafe(observation)
        self.counters.steps += 1
        if self.recorder is not None:
            self.recorder.record(observation, sent, failsafe=popped is None)

    def _send(self, observation: dict, now: float, episode_start: float) -> None:
        """Hand the observation to the publisher when the send rule and the task say so."""
        step = self.buffer.next_step
        depth = self.buffer.depth
        running = self.watch.running
        due = running and self.trigger.should_send(depth, now)
        ask = self.task.ask(self._seq_id + 1, now, due)
        if ask is not None:
            self._capture(observation, now, episode_start, step, depth, ask=ask)
        elif running and self.watch.refetch_ok and (request := self.trigger.refresh_due(now)) is not None:
            self._capture(observation, now, episode_start, step, depth, refreshes=request)

    def _capture(self, observation: dict, now: float, episode_start: float, step: int, depth: int, *,
                 ask=None, refreshes: int | None = None) -> None:
        """Hand this step's observation to the publisher as a new request (what `ask` asks), or as a
        refresh of the waiting request `refreshes`. Bookkeeping and a queue put only: never blocks."""
        seq_id = self._seq_id + 1
        system1 = refreshes is not None or ask.system1
        nonce = self.watch.session_nonce
        rtc = None
        if system1 and self.watch.rtc_active:
            # The capture step and the actions left from it, read together under the buffer's lock.
            step, prefix = self.buffer.leftover(self.watch.status.max_actions_per_chunk)
            if len(prefix) == 0:
                prefix = np.zeros((0, len(self.features.action_names)), dtype=np.float32)
            rtc = RtcInputs(prefix, self.intake.predict_delay_steps(len(prefix)))
        predicted = None if rtc is None else rtc.delay_steps
        if refreshes is not None:
            if not self.intake.on_refresh(seq_id, refreshes, step, now, predicted_delay_steps=predicted):
                return  # answered (or timed out) since refresh_due named it: nothing to refresh
        elif system1:
            self.intake.on_send(seq_id, step, now, predicted_delay_steps=predicted, nonce=nonce)
            self.watch.note_request(now)
        self._seq_id = seq_id
        t_hand = time.perf_counter()
        self.outbox.put(Capture(seq_id, step, now, observation, ExecutionInfo(
            task_elapsed_s=now - episode_start, actions_buffered=depth, control_period_s=self.dt_s),
            episode_id=str(self.episode), session_nonce=nonce, rtc=rtc, history=tuple(self._history),
            refreshes_seq_id=refreshes, component_mask=None if ask is None else ask.component_mask,
            task=None if ask is None else ask.task_text))
        # how long the loop was held handing the observation over (Prometheus: client_handover_seconds)
        self.counters.handover_hist.observe_s(time.perf_counter() - t_hand)

    # -- fail-safe

    def failsafe_action(self, observation: dict) -> dict:
        """The action when there is none: the task's mode if it has one, else hold or zero velocity."""
        names = self.features.action_names
        if self.failsafe_mode == "zero_velocity":
            default = dict.fromkeys(names, 0.0)
        elif all(n in observation for n in names):
            # hold: command the measured position where the action names match the state names,
            default = {n: float(observation[n]) for n in names}
        else:  # otherwise repeat the last command
            default = dict(self._last_action) if self._last_action else dict.fromkeys(names, 0.0)
        return self.task.failsafe(observation, default)

    @property
    def last_action(self) -> dict | None:
        return self._last_action

    def _failsafe(self, observation: dict) -> dict:
        cfg = self.config
        self.counters.empty_cycles += 1
        self._empty_streak += 1
        if self._empty_streak == cfg.max_empty_cycles_before_warning or (
            self._empty_streak > cfg.max_empty_cycles_before_warning and self._empty_streak % (10 * cfg.fps) == 0
        ):
            log.warning("%s: action buffer empty for %d cycles, %s", cfg.client_uuid, self._empty_streak,
                        "holding position" if self.failsafe_mode == "hold" else "zero velocity")
        return self.robot.send_action(self.failsafe_action(observation))
