"""The robot client: a control loop that never waits on the network.

Threads and what each owns:

    control loop (the caller of `run`)   capture -> outbox -> pop action -> send to robot -> wait for
                                          the next deadline of a monotonic schedule. Never touches
                                          Zenoh, JPEG or the dataset writer; only hands things over.
    publisher thread                     newest observation from the outbox -> JPEG -> msgpack -> put
                                          (best effort, congestion DROP: never blocks).
    Zenoh callback                       appends (bytes, arrival time) to the inbox and returns.
    receiver thread                      decode chunk, RTT from its exact seq_id, trim expired steps,
                                          merge into the action buffer (one lock, whole merge);
                                          also the watchdog and re-validation.

Timing (all from this process's perf_counter): an observation captured when the robot is about to
execute step s is answered by a chunk whose row 0 is meant for step s. When it arrives after a
round trip of `rtt`, `expired = int(rtt / dt)` leading rows are already in the past (none before
the first RTT is known); the rest is merged as steps s + expired, ... and blended with what the
buffer already holds.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.discovery import RobotFeatures, compare, discover, query_status, wait_connected
from lerobot_zenoh.errors import CompatibilityError, ProtocolError, TransportError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer
from lerobot_zenoh.scheduling.send_trigger import SendTrigger, expired_steps
from lerobot_zenoh.telemetry.publisher import TelemetryPublisher, percentile
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)

#: How long start-up waits for a Zenoh link to the endpoint before saying it cannot connect.
CONNECT_WAIT_S = 2.0


@dataclass
class _Capture:
    seq_id: int
    step: int
    captured_s: float
    observation: dict
    execution: ExecutionInfo


class Outbox:
    """Newest-only hand-over from the control loop to the publisher thread.

    `put` is one `SimpleQueue.put` (C code, no Python-level lock or condition): it is the only cost
    the control loop pays per observation, 24 us median vs 67 us for a Condition-based slot on the
    2-core development VM. `take` drains the queue and keeps the newest item; older ones count as
    dropped.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.dropped = 0  # written by the taking thread only

    def put(self, item: _Capture) -> None:
        self._queue.put(item)

    def take(self, timeout_s: float) -> _Capture | None:
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        while True:
            try:
                newer = self._queue.get_nowait()
            except queue.Empty:
                return item
            if newer is None:  # a wake-up, not an observation
                continue
            if item is not None:
                self.dropped += 1
            item = newer

    def wake(self) -> None:
        """Unblock a waiting `take` (it returns None)."""
        self._queue.put(None)


@dataclass
class ClientCounters:
    steps: int = 0
    actions_executed: int = 0
    empty_cycles: int = 0
    failsafe_actions: int = 0
    overruns: int = 0
    max_lateness_ms: float = 0.0
    observations_published: int = 0
    publish_errors: int = 0
    chunks_received: int = 0
    chunks_rejected: int = 0
    trimmed_steps: int = 0
    horizon_cut_steps: int = 0  # trailing actions dropped because the chunk's execution_horizon said so
    watchdog_events: int = 0
    reset_steps: int = 0  # steps of the reset phases between episodes (robot held, nothing recorded)
    revalidations: int = 0
    server_changes: int = 0
    rtt_ms: deque = field(default_factory=lambda: deque(maxlen=2048))
    inference_ms: deque = field(default_factory=lambda: deque(maxlen=2048))
    period_ms: deque = field(default_factory=lambda: deque(maxlen=4096))


class RobotClient:
    """Construct with a config and a robot (no I/O); `start()` connects and validates; `run()` loops.

    `robot` is any `lerobot.robots.Robot`; it is connected by `start()` if it is not already.
    `recorder` (optional) has `record(observation, action)`, `end_episode()` and `close()`.
    """

    def __init__(self, config: RobotClientConfig, robot, recorder=None):
        self.config = config
        self.robot = robot
        self.recorder = recorder
        self.dt_s = config.dt_s
        self.buffer = ActionBuffer(config.aggregate)
        self.trigger = SendTrigger(config.send, dt_s=self.dt_s)
        self.counters = ClientCounters()
        self.outbox = Outbox()
        self.status = None
        self.serving_server_id: str | None = None  # the server whose chunks we get (failover follows it)
        self.features: RobotFeatures | None = None
        self.state = "stopped"  # stopped | running | revalidating
        self._stop = threading.Event()
        self._session: ZenohSession | None = None
        self._inbox: queue.Queue = queue.Queue(maxsize=256)
        self._threads: list[threading.Thread] = []
        self._seq_id = 0
        self._capture_steps: dict[int, int] = {}  # seq_id -> step at capture (bounded)
        # When the oldest observation still without any chunk after it was sent (watchdog).
        self._waiting_since_s: float | None = None
        self._server_alive = threading.Event()
        self._server_lost = threading.Event()
        self._last_action: dict | None = None
        self._episode = 0
        self._empty_streak = 0
        self._telemetry: TelemetryPublisher | None = None
        self._last_figures = (time.perf_counter(), 0)

    # -- start-up -----------------------------------------------------------------------------

    def start(self) -> RobotClient:
        """Connect, discover and validate. Raises CompatibilityError (no action was sent) on mismatch."""
        cfg = self.config
        if not self.robot.is_connected:
            self.robot.connect()
        self.features = RobotFeatures.of(self.robot)
        self.failsafe_mode = cfg.failsafe
        if cfg.failsafe == "auto":
            velocity = all(n.endswith(".vel") for n in self.features.action_names)
            self.failsafe_mode = "zero_velocity" if velocity else "hold"
        settings = cfg.zenoh_settings()
        endpoints = ", ".join(settings.connect)
        if settings.effective_mode == "client":
            # Opening waits for an endpoint. A dead one is reported within CONNECT_WAIT_S unless
            # --zenoh.connect_timeout_s asks to wait longer (say, for a server that is still starting).
            wait_s = (CONNECT_WAIT_S if settings.connect_timeout_s == ZenohSettings.connect_timeout_s
                      else settings.connect_timeout_s)
            settings = settings.replace(connect_timeout_s=min(wait_s, cfg.discovery_timeout_s))
        try:
            self._session = ZenohSession(settings).open()
        except TransportError as exc:
            if not settings.connect:
                raise
            raise CompatibilityError(f"cannot connect to {endpoints}: nothing answers there (is the server or "
                                     "router running, and is the address right?)") from exc
        if not wait_connected(self._session, settings.connect, timeout_s=CONNECT_WAIT_S):  # peer mode
            raise CompatibilityError(f"cannot connect to {endpoints}: nothing answers there (is the server or router "
                                     "running, and is the address right?)")
        log.info("%s: looking for %s", cfg.client_uuid, cfg.app_key.status)
        status = discover(self._session, cfg.app_key, cfg.discovery_timeout_s, self._stop, client_uuid=cfg.client_uuid)
        if status is None and self._stop.is_set():
            raise CompatibilityError("stopped (SIGINT/SIGTERM) before a server answered")
        if status is None:
            where = f"connected to {endpoints}, but" if endpoints else ""
            raise CompatibilityError(f"{where} no server answers {cfg.app_key.status} within "
                                     f"{cfg.discovery_timeout_s:.0f} s (check --cluster_uuid, --experiment_tag, "
                                     "--model_id, --model_version, --application_tag against the server's manifest)"
                                     .strip())
        if status.client_admitted is False:
            raise CompatibilityError(f"server {status.server_id} does not serve client {cfg.client_uuid!r}: list it "
                                     "under the model's `clients` in the server's manifest (or set accept_unknown_clients)")
        problems = compare(status, self.features, cfg.fps)
        if problems:
            for p in problems:
                log.error("%s: incompatible server %s: %s", cfg.client_uuid, status.server_id, p)
            raise CompatibilityError(f"server {status.server_id} is incompatible: " + "; ".join(problems))
        self.status = status
        self.serving_server_id = status.server_id
        log.info("%s: server %s serves %s %s (%s), chunks of up to %d", cfg.client_uuid, status.server_id,
                 status.model_id, status.model_version, status.policy_type, status.max_actions_per_chunk)
        self._pub = self._session.publisher(cfg.client_key.obs, OBSERVATION_QOS)
        self._session.subscribe(cfg.client_key.action, self._on_chunk)
        self._session.watch_liveliness(cfg.app_key.all_servers, self._on_liveliness)
        # The token's key is the client's metrics key: monitors see the client appear and vanish.
        self._session.declare_token(cfg.client_key.metrics)
        if cfg.telemetry_period_s > 0:
            self._telemetry = TelemetryPublisher(self._session, cfg.client_key.metrics, "client", cfg.client_uuid,
                                                 self.telemetry_figures, cfg.telemetry_period_s,
                                                 labels={"robot_type": getattr(self.robot, "name", "")}).start()
        for target, name in ((self._publish_loop, "publisher"), (self._receive_loop, "receiver")):
            t = threading.Thread(target=target, name=f"{cfg.client_uuid}:{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.state = "running"
        return self

    # -- control loop (main thread) -----------------------------------------------------------

    def run(self, duration_s: float | None = None) -> ClientCounters:
        """Run the control loop until `stop()`, `duration_s` (default `--duration_s`), or the last episode.

        Recording (`--dataset.*`): `num_episodes` episodes of `episode_time_s`, each followed (but the
        last) by a reset phase of `reset_time_s` in which the robot is held, no observation is sent
        and nothing is recorded, as lerobot-record. Without a dataset: one episode, until stopped.
        """
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
        while not self._stop.is_set():
            now = time.perf_counter()
            if limit_s is not None and now - t0 >= limit_s:
                break
            if not resetting and episode_s is not None and now - phase_start >= episode_s:
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
                self._episode += 1
                steps_at_start, held_at_start = self.counters.steps, self.counters.empty_cycles
                self._log_episode_start(episodes, episode_s)
            if last_tick is not None:
                self.counters.period_ms.append((now - last_tick) * 1000)
            last_tick = now
            if resetting:
                self._hold_step()
            else:
                self._step(now, phase_start)
            # Absolute schedule: deadlines are t0 + k*dt, so a late step does not shift the rest.
            next_deadline += self.dt_s
            remaining = next_deadline - time.perf_counter()
            if remaining > 0:
                self._stop.wait(remaining)
            else:
                self.counters.overruns += 1
                self.counters.max_lateness_ms = max(self.counters.max_lateness_ms, -remaining * 1000)
                if -remaining > 5 * self.dt_s:  # far behind: skip missed deadlines rather than burst
                    next_deadline = time.perf_counter()
        return self.counters

    def _log_episode_start(self, episodes: int, episode_s: float | None) -> None:
        if self.config.dataset is None:
            return
        log.info("%s: episode %d/%d: recording for %g s into %s", self.config.client_uuid,
                 self._episode + 1, episodes, episode_s, getattr(self.recorder, "root", "(no recorder)"))

    def _begin_reset(self) -> None:
        """Between episodes: drop what the policy planned, forget requests in flight (their answers
        belong to the episode that ended and are refused when they arrive)."""
        self.buffer.clear()
        self._capture_steps.clear()
        self.trigger.forget_outstanding()
        self._waiting_since_s = None

    def _hold_step(self) -> None:
        """One reset-phase step: the robot gets its fail-safe action; nothing is sent or recorded."""
        observation = self.robot.get_observation()
        self.buffer.clear()  # a late chunk of the previous episode must not move the robot
        self.robot.send_action(self._failsafe_action(observation))
        self.counters.reset_steps += 1

    def _step(self, now: float, episode_start: float) -> None:
        observation = self.robot.get_observation()
        step = self.buffer.next_step
        depth = self.buffer.depth
        if self.state == "running" and self.trigger.should_send(depth, now):
            self._seq_id += 1
            self._capture_steps[self._seq_id] = step
            if len(self._capture_steps) > 1024:
                self._capture_steps.pop(next(iter(self._capture_steps)))
            self.trigger.on_send(self._seq_id, now)
            if self._waiting_since_s is None:
                self._waiting_since_s = now
            self.outbox.put(_Capture(self._seq_id, step, now, observation, ExecutionInfo(
                episode_id=str(self._episode), round_id=self._seq_id, task_elapsed_s=now - episode_start,
                actions_buffered=depth, control_period_s=self.dt_s)))
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

    def _failsafe_action(self, observation: dict) -> dict:
        names = self.features.action_names
        if self.failsafe_mode == "zero_velocity":
            return dict.fromkeys(names, 0.0)
        # hold: command the measured position where the action names match the state names,
        # otherwise repeat the last command.
        if all(n in observation for n in names):
            return {n: float(observation[n]) for n in names}
        return dict(self._last_action) if self._last_action else {n: 0.0 for n in names}

    def _failsafe(self, observation: dict) -> dict:
        self.counters.empty_cycles += 1
        self._empty_streak += 1
        if self._empty_streak == self.config.max_empty_cycles_before_warning or (
            self._empty_streak > self.config.max_empty_cycles_before_warning and self._empty_streak % (10 * self.config.fps) == 0
        ):
            log.warning("%s: action buffer empty for %d cycles, %s", self.config.client_uuid, self._empty_streak,
                        "holding position" if self.failsafe_mode == "hold" else "zero velocity")
        action = self._failsafe_action(observation)
        self.counters.failsafe_actions += 1
        return self.robot.send_action(action)

    # -- publisher thread ---------------------------------------------------------------------

    def _publish_loop(self) -> None:
        names = self.features
        quality = self.config.jpeg_quality
        cameras = list(names.cameras)
        # The first camera is encoded on this thread and the others at the same time on helper threads:
        # OpenCV releases the GIL while it converts and encodes, so with a free core two 480x640 cameras
        # cost one encode of wall time instead of two (docs/benchmarks.md).
        helpers = (ThreadPoolExecutor(max_workers=len(cameras) - 1, thread_name_prefix=f"{self.config.client_uuid}:jpeg")
                   if len(cameras) > 1 else None)
        try:
            while not self._stop.is_set():
                item = self.outbox.take(0.1)
                if item is None:
                    continue
                obs = item.observation
                try:
                    state = np.fromiter((obs[n] for n in names.state_names), dtype=np.float32, count=len(names.state_names))
                    others = [(cam, helpers.submit(codec.encode_jpeg, np.asarray(obs[cam]), quality)) for cam in cameras[1:]]
                    images = {cameras[0]: codec.encode_jpeg(np.asarray(obs[cameras[0]]), quality)} if cameras else {}
                    for cam, encoded in others:
                        images[cam] = encoded.result()
                    payload = codec.encode(Observation(item.seq_id, self.config.client_uuid, state, images,
                                                       self.config.task, item.execution))
                    self._pub.put(payload)
                    self.counters.observations_published += 1
                except (ProtocolError, TransportError, KeyError, ValueError) as exc:
                    self.counters.publish_errors += 1
                    log.warning("%s: could not publish observation %d: %s", self.config.client_uuid, item.seq_id, exc)
        finally:
            if helpers is not None:
                helpers.shutdown(wait=True)

    # -- reception ----------------------------------------------------------------------------

    def _on_chunk(self, key: str, payload: bytes) -> None:
        """Zenoh callback: hand over with the arrival time, nothing else."""
        try:
            self._inbox.put_nowait((payload, time.perf_counter()))
        except queue.Full:
            self.counters.chunks_rejected += 1

    def _on_liveliness(self, key: str, alive: bool) -> None:
        """Zenoh callback: a server token appeared (wake a re-validation) or ours vanished."""
        if alive:
            self._server_alive.set()
        elif key.rsplit("/", 1)[-1] == self.serving_server_id:
            self._server_lost.set()

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                payload, arrived_s = self._inbox.get(timeout=0.05)
            except queue.Empty:
                self._watchdog()
                continue
            self._handle_chunk(payload, arrived_s)
            self._watchdog()

    def _handle_chunk(self, payload: bytes, arrived_s: float) -> None:
        try:
            chunk = codec.decode_action_chunk(payload)
            if chunk.actions.shape[1] != len(self.features.action_names):
                raise ProtocolError("action_shape", f"{chunk.actions.shape[1]} dims, robot takes {len(self.features.action_names)}")
        except ProtocolError as exc:
            self.counters.chunks_rejected += 1
            log.warning("%s: rejected action chunk: %s", self.config.client_uuid, exc)
            return
        first_known = self.trigger.rtt.last_rtt_s is not None
        rtt_s = self.trigger.on_receive(chunk.response_to_seq_id, arrived_s)
        step = self._capture_steps.pop(chunk.response_to_seq_id, None)
        if step is None:
            self.counters.chunks_rejected += 1  # not an answer to anything we asked (or far too old)
            return
        actions = chunk.actions[: self.config.actions_per_chunk]
        # Kairos 3.1: the server vouches for the first `execution_horizon` actions only; the rest are
        # never executed, so the buffer runs dry H steps after the chunk's start and the send trigger
        # asks for the next chunk early enough for that (it follows the buffer depth).
        if chunk.execution_horizon is not None and chunk.execution_horizon < len(actions):
            h = max(int(chunk.execution_horizon), 1)  # 0 would mean "nothing": keep at least one
            self.counters.horizon_cut_steps += len(actions) - h
            actions = actions[:h]
        # Seed 002 section 8.2: int(rtt / dt) leading steps have expired (none before the first RTT
        # is known). Capped at the steps the robot actually executed since the capture: a robot that
        # held still while its buffer was empty has lost nothing, and its chunk still starts at row 0.
        expired = expired_steps(rtt_s, self.dt_s) if first_known else 0
        expired = min(expired, max(self.buffer.next_step - step, 0))
        try:
            result = self.buffer.merge(actions[expired:], step + expired)
        except ProtocolError as exc:
            self.counters.chunks_rejected += 1
            log.warning("%s: rejected action chunk: %s", self.config.client_uuid, exc)
            return
        self.counters.chunks_received += 1
        self.counters.trimmed_steps += min(expired, len(actions)) + result.discarded_stale
        if rtt_s is not None:
            self.counters.rtt_ms.append(rtt_s * 1000)
        self.counters.inference_ms.append(chunk.inference_time_ms)
        self._waiting_since_s = None
        if chunk.server_id and chunk.server_id != self.serving_server_id:
            # A standby took over, or the primary came back: follow whoever answers.
            log.info("%s: now served by %s (was %s)", self.config.client_uuid, chunk.server_id, self.serving_server_id)
            self.serving_server_id = chunk.server_id
            self.counters.server_changes += 1

    # -- watchdog (receiver thread) -----------------------------------------------------------

    def _watchdog(self) -> None:
        now = time.perf_counter()
        if self.state != "running":
            return
        waiting_since = self._waiting_since_s
        silent = waiting_since is not None and now - waiting_since > self.config.watchdog_timeout_s
        lost = self._server_lost.is_set()
        if not (silent or lost):
            return
        self.counters.watchdog_events += 1
        log.warning("%s: %s; re-validating", self.config.client_uuid,
                    "server liveliness lost" if lost else f"no action chunk for {self.config.watchdog_timeout_s:.1f} s")
        self.state = "revalidating"
        self._revalidate()

    def _revalidate(self) -> None:
        """Query status until a compatible server answers; the control loop keeps holding meanwhile."""
        cfg = self.config
        while not self._stop.is_set():
            self.counters.revalidations += 1
            self._server_alive.clear()
            status = query_status(self._session, cfg.app_key, timeout_s=0.3, client_uuid=cfg.client_uuid)
            if status is not None:
                problems = compare(status, self.features, cfg.fps)
                if not problems:
                    if status.server_id != (self.status.server_id if self.status else None):
                        log.info("%s: now served by %s", cfg.client_uuid, status.server_id)
                    self.status = status
                    self.serving_server_id = status.server_id
                    self._server_lost.clear()
                    self._waiting_since_s = None
                    self.trigger.forget_outstanding()  # requests to a dead server will never be answered
                    self.state = "running"
                    log.info("%s: server %s valid again; resuming", cfg.client_uuid, status.server_id)
                    return
                log.error("%s: server %s is now incompatible: %s", cfg.client_uuid, status.server_id, "; ".join(problems))
            self._server_alive.wait(0.2)  # a token appearing wakes us at once

    # -- shutdown -----------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        self.outbox.wake()

    def close(self) -> None:
        """Leave the robot in its fail-safe state, save the recording, undeclare, disconnect."""
        self.stop()
        if self._telemetry is not None:
            self._telemetry.close()
        for t in self._threads:
            t.join(timeout=2.0)
        if self.counters.steps > 0 and self.robot.is_connected:  # never act if the loop never ran
            try:
                self.robot.send_action(self._failsafe_action(self.robot.get_observation()))
            except Exception as exc:
                log.warning("%s: fail-safe action at exit failed: %s", self.config.client_uuid, exc)
        if self.recorder is not None:
            self.recorder.close()
        if self._session is not None:
            self._session.close()
        self.state = "stopped"

    # -- telemetry and summary ----------------------------------------------------------------

    def telemetry_figures(self) -> tuple[dict, dict]:
        """Figures for the Telemetry message (docs/telemetry.md); runs on the telemetry thread."""
        c = self.counters
        now = time.perf_counter()
        t_prev, steps_prev = self._last_figures
        self._last_figures = (now, c.steps)
        periods = list(c.period_ms)[-512:]
        rtts = list(c.rtt_ms)[-512:]
        figures = {
            "loop_hz": (c.steps - steps_prev) / (now - t_prev) if now > t_prev else None,
            "control_period_ms_p50": percentile(periods, 50),
            "control_period_ms_p99": percentile(periods, 99),
            "loop_overruns": c.overruns,
            "rtt_ms_p50": percentile(rtts, 50),
            "rtt_ms_p99": percentile(rtts, 99),
            "inference_ms_p50": percentile(list(c.inference_ms)[-512:], 50),
            "trimmed_steps": c.trimmed_steps,
            "buffer_depth": self.buffer.depth,
            "empty_buffer_cycles": c.empty_cycles,
            "chunks_received": c.chunks_received,
            "chunks_rejected": c.chunks_rejected,
            "observations_published": c.observations_published,
            "observations_dropped_in_outbox": self.outbox.dropped,
            "watchdog_events": c.watchdog_events,
            "revalidating": self.state == "revalidating",
            "steps": c.steps,
            "dataset_frames": getattr(self.recorder, "frames_written", None),
        }
        return figures, {}

    def summary(self) -> dict:
        c = self.counters
        pct = lambda xs, q: round(float(np.percentile(xs, q)), 3) if xs else None  # noqa: E731
        buf = self.buffer.stats()
        return {
            "client_uuid": self.config.client_uuid,
            "server_id": self.status.server_id if self.status else None,
            "steps": c.steps,
            "actions_executed": c.actions_executed,
            "chunks_received": c.chunks_received,
            "chunks_rejected": c.chunks_rejected,
            "observations_published": c.observations_published,
            "observations_dropped_in_outbox": self.outbox.dropped,
            "trimmed_steps": c.trimmed_steps,
            "blended_steps": buf.blended_steps,
            "rtt_ms_p50": pct(c.rtt_ms, 50),
            "rtt_ms_p99": pct(c.rtt_ms, 99),
            "inference_ms_p50": pct(c.inference_ms, 50),
            "control_period_ms_p50": pct(c.period_ms, 50),
            "control_period_ms_p99": pct(c.period_ms, 99),
            "empty_buffer_cycles": c.empty_cycles,
            "loop_overruns": c.overruns,
            "watchdog_events": c.watchdog_events,
            # sent but unanswered when the run ended (lost best-effort observations, or in flight)
            "requests_outstanding_at_exit": self.trigger.stats().outstanding,
            "dataset_path": str(getattr(self.recorder, "root", "")) or None if self.recorder else None,
            "dataset_frames": getattr(self.recorder, "frames_written", None) if self.recorder else None,
        }

    def write_summary(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.summary(), indent=2))
