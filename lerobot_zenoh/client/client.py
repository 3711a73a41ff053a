"""The robot client: a control loop that never waits on the network.

Threads and what each owns:

    control loop (the caller of `run`)   capture -> outbox -> pop action -> send to robot -> wait for
                                          the next deadline of a monotonic schedule. Never touches
                                          Zenoh, JPEG or the dataset writer; only hands things over.
    publisher thread                     newest observation from the outbox -> JPEG -> msgpack -> put
                                          (best effort, congestion DROP: never blocks).
    Zenoh callback                       appends (bytes, arrival time) to the inbox and returns.
    receiver thread                      decode and check the chunk, hand it to the chunk intake (RTT
                                          from its exact seq_id, horizon cut, stale trim, merge into
                                          the action buffer under its lock), count what it did;
                                          also the watchdog and re-validation.

Timing (all from this process's perf_counter): an observation captured when the robot is about to
execute step s is answered by a chunk whose row 0 is meant for step s. When it arrives after a
round trip of `rtt`, `expired = int(rtt / dt)` leading rows are already in the past (none before
the first RTT is known); the rest is merged as steps s + expired, ... and blended with what the
buffer already holds. The arithmetic is `scheduling/chunk_intake.py`, shared with the benchmarks.

Re-fetch (protocol 1.3, `--send.refetch_after_s`, docs/protocol.md §10.7): while a request waits
unanswered, the control loop publishes a fresh capture of the robot every `refetch_after_s` as a
refresh of it (a new seq_id, `refreshes_seq_id` = the request's), at the point of the loop where
captures happen anyway, through the same newest-only outbox; the server serves the newest of them
in the request's place in line. The chunk is aligned to the capture step of the observation it
answers; the RTT runs from the request's first send (`scheduling/send_trigger.py`).

Real-time chunking (protocol 1.1, when the server's status advertises `rtc` and `config.rtc.enabled`):
each observation also carries the buffer's leftover from the capture step on (exactly the actions the
robot will still execute) and the predicted delay, ceil(RTT quantile / dt) steps; a chunk that echoes
`rtc_delay_steps` replaces the buffer from the step it actually starts at (no trim, no blending). Per
chunk the predicted and the actual delay are recorded; a wrong estimate is counted and logged at a
bounded rate (docs/client.md, "Real-time chunking").

A multi-model task (client/pipeline.py, `PipelineClient`) plugs into the control loop's hooks: `_send`
(which components an observation asks), `_override_action` (a fallback or danger mode replaces the
policy's action), `_attempt_outcome` / `_on_episode_start` (the task ends, is retried, starts again) and
`wake` / `_react_now` (a verdict interrupts the wait between steps). The plain client's hooks do nothing.

Sessions (protocol 1.1): every observation carries `session_nonce`, drawn once per RobotClient (a
restarted client has a new one, so the server counts its seq_ids afresh), and `episode_id`, the
episode number `self._episode` as a string (the server resets per-episode state when it changes).
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import secrets
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.discovery import RobotFeatures, compare, discover, query_status, wait_connected
from lerobot_zenoh.errors import CompatibilityError, ProtocolError, TlsRefusedError, TransportError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, HistoryFrame, Observation, RtcInputs
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake, IntakeResult, MergeMode
from lerobot_zenoh.scheduling.send_trigger import DEFAULT_REFETCH_AFTER_S, SendTrigger
from lerobot_zenoh.telemetry.publisher import TelemetryPublisher, percentile
from lerobot_zenoh.transport import same_host
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
    episode_id: str
    rtc: RtcInputs | None = None
    # The robot's raw observations of the control steps just before this one, oldest first (for a
    # model that conditions on several consecutive observations: Status.history_length > 1).
    history: tuple[dict, ...] = ()
    refreshes_seq_id: int | None = None  # re-fetch: the waiting request this capture refreshes
    # A multi-model task (client/pipeline.py): the components asked, and System 1's task string now.
    component_mask: int | None = None
    task: str | None = None


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
    observations_same_host: int = 0  # of those, sent as raw frames through /dev/shm
    publish_errors: int = 0
    chunks_received: int = 0
    chunks_rejected: int = 0
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
        self.intake = ChunkIntake(self.trigger, self.dt_s, max_actions=config.actions_per_chunk,
                                  initial_delay_steps=config.rtc.initial_delay_steps,
                                  delay_quantile=config.rtc.delay_quantile)
        self.rtc_active = False  # the server advertises RTC and config.rtc.enabled: set from each status
        # Raw frames through /dev/shm (the server's probe proved one host and user): set from each
        # status, and off for good once shared memory failed here (`_same_host_failed`).
        self.same_host_active = False
        self._refetch_ok = False  # the server takes re-fetch refreshes (Status.refreshes): set from each status
        self._refetch_auto = False  # the default threshold: 100 ms, or the model's median time if longer
        self._same_host_failed = False
        # The last Status.history_length - 1 raw observations, one per control step (the control loop's).
        self._history: deque = deque(maxlen=0)
        # Drawn per client, not per process: each RobotClient counts seq_ids from 1 (docs/protocol.md, "Sessions").
        self.session_nonce = secrets.randbits(63)
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
        # When the oldest observation still without any chunk after it was sent (watchdog).
        self._waiting_since_s: float | None = None
        self._server_alive = threading.Event()
        self._server_lost = threading.Event()
        self._last_action: dict | None = None
        self._episode = 0
        self._empty_streak = 0
        self._telemetry: TelemetryPublisher | None = None
        self._last_figures = (time.perf_counter(), 0)
        self._wake = threading.Event()

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
        settings = self._session_settings(cfg.zenoh_settings())
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
            if isinstance(exc, TlsRefusedError):  # something answers, with a certificate we refuse (or it refuses ours)
                raise CompatibilityError(f"cannot connect to {endpoints}: {exc}") from exc
            raise CompatibilityError(f"cannot connect to {endpoints}: nothing answers there (is the server or "
                                     "router running, and is the address right?)") from exc
        if not wait_connected(self._session, settings.connect, timeout_s=CONNECT_WAIT_S):  # peer mode
            raise CompatibilityError(f"cannot connect to {endpoints}: nothing answers there (is the server or router "
                                     "running, and is the address right?)")
        self._discover_components(endpoints)
        self._declare()
        for target, name in self._thread_targets():
            t = threading.Thread(target=target, name=f"{cfg.client_uuid}:{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.state = "running"
        return self

    def _session_settings(self, settings: ZenohSettings) -> ZenohSettings:
        """The Zenoh settings the session opens with (a pipeline client connects to several servers)."""
        return settings

    def _discover_components(self, endpoints: str) -> None:
        """Find and validate the server (System 1); raises CompatibilityError."""
        cfg = self.config
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
        self._use_status(status)
        log.info("%s: server %s serves %s %s (%s), chunks of up to %d, real-time chunking %s", cfg.client_uuid,
                 status.server_id, status.model_id, status.model_version, status.policy_type,
                 status.max_actions_per_chunk, "on" if self.rtc_active else
                 ("off (--rtc.enabled=false)" if status.rtc is not None else "not offered"))
        log.info("%s: frames travel %s", cfg.client_uuid, "raw through /dev/shm (same host)" if self.same_host_active
                 else "as JPEG" + (" (--same_host=false)" if status.same_host is not None and not cfg.same_host else ""))

    def _thread_targets(self) -> list:
        return [(self._publish_loop, "publisher"), (self._receive_loop, "receiver")]

    def _declare(self) -> None:
        """Publisher, subscriptions, liveliness token and telemetry."""
        cfg = self.config
        self._pub = self._session.publisher(cfg.client_key.obs, OBSERVATION_QOS)
        self._session.subscribe(cfg.client_key.action, self._on_chunk)
        self._session.watch_liveliness(cfg.app_key.all_servers, self._on_liveliness)
        # The token's key is the client's metrics key: monitors see the client appear and vanish.
        self._session.declare_token(cfg.client_key.metrics)
        if cfg.telemetry_period_s > 0:
            self._telemetry = TelemetryPublisher(self._session, cfg.client_key.metrics, "client", cfg.client_uuid,
                                                 self.telemetry_figures, cfg.telemetry_period_s,
                                                 labels={"robot_type": getattr(self.robot, "name", "")}).start()

    def _use_status(self, status) -> None:
        """Real-time chunking and the observation history follow the server that answers (a
        replacement may not offer RTC, or may serve a model with another history length)."""
        self.rtc_active = self.config.rtc.enabled and status.rtc is not None
        # Re-fetch only toward a server that drops late refreshes (1.3): an older one would serve each
        # refresh as a new request, an inference apiece, exactly when it is overloaded. By default
        # not with RTC either: a refresh's delay is predicted from first-send RTTs, an overestimate.
        wanted = self.config.send.refetch_after_s
        if wanted is None:
            wanted = None if self.rtc_active else DEFAULT_REFETCH_AFTER_S
        self._refetch_ok = bool(status.refreshes) and bool(wanted)
        self._refetch_auto = self._refetch_ok and self.config.send.refetch_after_s is None
        self.trigger.refetch_after_s = wanted if self._refetch_ok else None
        if self.config.send.refetch_after_s and not status.refreshes:
            log.warning("%s: server %s does not take re-fetch refreshes (protocol before 1.3): --send.refetch_after_s "
                        "is off while it serves", self.config.client_uuid, status.server_id)
        self.same_host_active = (self.config.same_host and not self._same_host_failed
                                 and same_host.probe_ok(status.same_host))
        self.intake.mode = MergeMode.RTC if self.rtc_active else MergeMode.BLEND
        wanted = max((status.history_length or 1) - 1, 0)
        if self._history.maxlen != wanted:
            self._history = deque(maxlen=wanted)  # (one assignment: the control loop sees old or new)

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
        self._on_episode_start(t0)
        while not self._stop.is_set():
            now = time.perf_counter()
            if limit_s is not None and now - t0 >= limit_s:
                break
            # A multi-model task may end its attempt early (done, failed, a fallback): client/pipeline.py.
            outcome = None if resetting else self._attempt_outcome(now)
            if outcome == "stop" or (outcome == "done" and ds is None):
                break
            if outcome == "retry" and ds is None:  # no dataset: a reset phase, then the task again
                resetting, phase_start = True, now
                self._begin_reset()
                reset_s = self._retry_reset_s()
                log.info("%s: task reset for %g s, then attempt %d", cfg.client_uuid, reset_s, self._episode + 2)
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
                self._episode += 1
                steps_at_start, held_at_start = self.counters.steps, self.counters.empty_cycles
                self._log_episode_start(episodes, episode_s)
                self._on_episode_start(now)
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
                self._wait_until(next_deadline)
            else:
                self.counters.overruns += 1
                self.counters.max_lateness_ms = max(self.counters.max_lateness_ms, -remaining * 1000)
                if -remaining > 5 * self.dt_s:  # far behind: skip missed deadlines rather than burst
                    next_deadline = time.perf_counter()
        return self.counters

    def _wait_until(self, deadline_s: float) -> None:
        """Sleep until the step's deadline; `wake()` (a danger verdict) interrupts it for `_react_now`."""
        while not self._stop.is_set():
            remaining = deadline_s - time.perf_counter()
            if remaining <= 0 or not self._wake.wait(remaining):
                return
            self._wake.clear()
            if not self._stop.is_set():
                self._react_now()

    def wake(self) -> None:
        """Interrupt the control loop's wait (any thread): it calls `_react_now` at once."""
        self._wake.set()

    # Hooks for a multi-model task (client/pipeline.py); the plain client has none of these.
    def _on_episode_start(self, now_s: float) -> None:
        """An episode (an attempt at the task) starts."""

    def _attempt_outcome(self, now_s: float) -> str | None:
        """None (go on), or how the attempt ended: done, retry, stop."""
        return None

    def _retry_reset_s(self) -> float:
        return 0.0

    def _override_action(self, observation: dict) -> dict | None:
        """An action that replaces the policy's this step (a fallback or a danger mode), or None."""
        return None

    def _react_now(self) -> None:
        """Woken between steps (`wake`): act at once rather than at the next step."""

    def _log_episode_start(self, episodes: int, episode_s: float | None) -> None:
        if self.config.dataset is None:
            return
        log.info("%s: episode %d/%d: recording for %g s into %s", self.config.client_uuid,
                 self._episode + 1, episodes, episode_s, getattr(self.recorder, "root", "(no recorder)"))

    def _begin_reset(self) -> None:
        """Between episodes: drop what the policy planned, forget requests in flight (their answers
        belong to the episode that ended and are refused when they arrive) and the frames of the
        episode that ended (a new episode's history starts with it)."""
        self.buffer.clear()
        self._history.clear()
        self.intake.clear()
        self.trigger.forget_outstanding()
        self._waiting_since_s = None

    def _hold_step(self) -> None:
        """One reset-phase step: the robot gets its fail-safe action; nothing is sent or recorded."""
        observation = self.robot.get_observation()
        self.buffer.clear()  # a late chunk of the previous episode must not move the robot
        self.robot.send_action(self._override_action(observation) or self._failsafe_action(observation))
        self.counters.reset_steps += 1

    def _step(self, now: float, episode_start: float) -> None:
        observation = self.robot.get_observation()
        self._send(observation, now, episode_start)
        if self._history.maxlen:
            self._history.append(observation)  # one control period apart: every step is kept
        override = self._override_action(observation)
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
        """Hand the observation to the publisher when the send rule says so."""
        step = self.buffer.next_step
        depth = self.buffer.depth
        if self.state == "running":
            if self.trigger.should_send(depth, now):
                self._capture(observation, now, episode_start, step, depth)
            elif self._refetch_ok and (request := self.trigger.refresh_due(now)) is not None:  # None when off
                self._capture(observation, now, episode_start, step, depth, refreshes=request)

    def _capture(self, observation: dict, now: float, episode_start: float, step: int, depth: int,
                 refreshes: int | None = None) -> None:
        """Hand this step's observation to the publisher as a new request, or as a refresh of the
        waiting request `refreshes` (re-fetch). Bookkeeping and a queue put only: never blocks."""
        seq_id = self._seq_id + 1
        rtc = None
        if self.rtc_active:
            # The capture step and the actions left from it, read together under the buffer's lock.
            step, prefix = self.buffer.leftover(self.status.max_actions_per_chunk)
            if len(prefix) == 0:
                prefix = np.zeros((0, len(self.features.action_names)), dtype=np.float32)
            rtc = RtcInputs(prefix, self.intake.predict_delay_steps(len(prefix)))
        predicted = None if rtc is None else rtc.delay_steps
        if refreshes is None:
            self.intake.on_send(seq_id, step, now, predicted_delay_steps=predicted)
            if self._waiting_since_s is None:
                self._waiting_since_s = now
        elif not self.intake.on_refresh(seq_id, refreshes, step, now, predicted_delay_steps=predicted):
            return  # answered (or timed out) since refresh_due named it: nothing to refresh
        self._seq_id = seq_id
        self.outbox.put(_Capture(seq_id, step, now, observation, ExecutionInfo(
            task_elapsed_s=now - episode_start, actions_buffered=depth, control_period_s=self.dt_s),
            episode_id=str(self._episode), rtc=rtc, history=tuple(self._history), refreshes_seq_id=refreshes))

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

        def encode_frame(obs: dict) -> tuple[np.ndarray, dict[str, bytes]]:
            state = np.fromiter((obs[n] for n in names.state_names), dtype=np.float32, count=len(names.state_names))
            others = [(cam, helpers.submit(codec.encode_jpeg, np.asarray(obs[cam]), quality)) for cam in cameras[1:]]
            images = {cameras[0]: codec.encode_jpeg(np.asarray(obs[cameras[0]]), quality)} if cameras else {}
            for cam, encoded in others:
                images[cam] = encoded.result()
            return state, images

        ring: same_host.FrameRing | None = None  # this loop's shared-memory files, removed when it ends

        def shared_frame(obs: dict):
            """(state, {}, SharedFrames) through /dev/shm, or None when shared memory just failed."""
            nonlocal ring
            try:
                if ring is None:
                    ring = same_host.FrameRing()
                shared = ring.write({cam: np.asarray(obs[cam]) for cam in cameras})
            except OSError as exc:
                self._same_host_failed, self.same_host_active = True, False
                log.warning("%s: shared memory failed (%s); sending JPEG over the network from now on",
                            self.config.client_uuid, exc)
                if ring is not None:
                    ring.close()
                    ring = None
                return None
            state = np.fromiter((obs[n] for n in names.state_names), dtype=np.float32, count=len(names.state_names))
            return state, {}, shared

        try:
            while not self._stop.is_set():
                item = self.outbox.take(0.1)
                if item is None:
                    continue
                obs = item.observation
                try:
                    framed = shared_frame(obs) if self.same_host_active and cameras else None
                    state, images, shared = framed or (*encode_frame(obs), None)
                    history = tuple(HistoryFrame(*encode_frame(past)) for past in item.history)
                    message = Observation(item.seq_id, self.config.client_uuid, state, images,
                                          self.config.task_text if item.task is None else item.task,
                                          item.execution, episode_id=item.episode_id,
                                          session_nonce=self.session_nonce, rtc=item.rtc, history=history,
                                          shared_frames=shared, refreshes_seq_id=item.refreshes_seq_id,
                                          component_mask=item.component_mask)
                    # The header lets the server rank it without decoding it (protocol.md §5.1.1).
                    self._pub.put(codec.encode(message), attachment=codec.encode_observation_header(message))
                    self.counters.observations_published += 1
                    self.counters.observations_same_host += shared is not None
                except Exception as exc:  # one observation's failure must not end publishing for good
                    self.counters.publish_errors += 1
                    n = self.counters.publish_errors
                    if n in (1, 10, 100) or n % 1000 == 0:
                        log.warning("%s: could not publish observation %d (%s: %s) [%d so far]", self.config.client_uuid,
                                    item.seq_id, type(exc).__name__, exc, n)
        finally:
            if helpers is not None:
                helpers.shutdown(wait=True)
            if ring is not None:
                ring.close()

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
        result = self.intake.on_chunk(chunk.response_to_seq_id, chunk.actions, arrived_s, self.buffer,
                                      execution_horizon=chunk.execution_horizon,
                                      rtc_delay_steps=chunk.rtc_delay_steps)
        if not result.accepted:
            self.counters.chunks_rejected += 1
            if result.reason != "unknown_seq":  # unknown: an answer to nothing we asked (or far too old)
                log.warning("%s: rejected action chunk: %s", self.config.client_uuid, result.detail)
            return
        self.counters.chunks_received += 1
        self._count_rtc(result)
        self.counters.trimmed_steps += result.trimmed_steps
        self.counters.horizon_cut_steps += result.horizon_cut
        if result.rtt_s is not None:
            self.counters.rtt_ms.append(result.rtt_s * 1000)
        if result.capture_age_s is not None:
            self.counters.observation_age_ms.append(max(result.capture_age_s * 1000 - chunk.inference_time_ms, 0.0))
        self.counters.inference_ms.append(chunk.inference_time_ms)
        if self._refetch_auto:
            # The default threshold is never below the model's own time (median of the last 16): a
            # request younger than that may be in inference rather than waiting, and a refresh of it
            # would be late (a capture and an encode for nothing).
            recent = sorted(itertools.islice(reversed(self.counters.inference_ms), 16))  # no copy of the deque
            self.trigger.refetch_after_s = max(DEFAULT_REFETCH_AFTER_S, recent[len(recent) // 2] / 1000)
        self._waiting_since_s = None
        if chunk.server_id and chunk.server_id != self.serving_server_id:
            # A standby took over, or the primary came back: follow whoever answers.
            log.info("%s: now served by %s (was %s)", self.config.client_uuid, chunk.server_id, self.serving_server_id)
            self.serving_server_id = chunk.server_id
            self.counters.server_changes += 1
        self._on_chunk_accepted(chunk.response_to_seq_id, arrived_s)

    def _on_chunk_accepted(self, seq_id: int, arrived_s: float) -> None:
        """A chunk answering `seq_id` went into the buffer (a pipeline client books it against its SLO)."""

    def _count_rtc(self, result: IntakeResult) -> None:
        """Predicted vs actual delay of a chunk that answered a real-time-chunking observation."""
        c = self.counters
        if result.predicted_delay_steps is None:
            return
        if result.mode is not MergeMode.RTC:
            c.rtc_fallback_chunks += 1
            if c.rtc_fallback_chunks in (1, 10, 100) or c.rtc_fallback_chunks % 1000 == 0:
                log.warning("%s: chunk %d answers a real-time-chunking observation without rtc_delay_steps; "
                            "blended instead [%d so far]", self.config.client_uuid, result.seq_id, c.rtc_fallback_chunks)
            return
        c.rtc_chunks += 1
        c.rtc_delays.append((result.predicted_delay_steps, result.actual_delay_steps))
        if result.server_delay_steps is not None and result.server_delay_steps != result.predicted_delay_steps:
            c.rtc_delay_overridden += 1
        error = result.delay_error_steps
        if error is not None and abs(error) >= self.config.rtc.mispredict_steps:
            c.rtc_delay_mispredicted += 1
            n = c.rtc_delay_mispredicted
            if n in (1, 10, 100) or n % 1000 == 0:
                log.warning("%s: inference delay mispredicted: chunk %d started %d steps after its capture, "
                            "predicted %d (RTT %s ms) [%d wrong estimates in %d RTC chunks]",
                            self.config.client_uuid, result.seq_id, result.actual_delay_steps,
                            result.predicted_delay_steps,
                            "?" if result.rtt_s is None else f"{result.rtt_s * 1000:.0f}", n, c.rtc_chunks)

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
                    self._use_status(status)
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
        self._wake.set()
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
        ages = list(c.observation_age_ms)[-512:]
        figures = {
            "loop_hz": (c.steps - steps_prev) / (now - t_prev) if now > t_prev else None,
            "control_period_ms_p50": percentile(periods, 50),
            "control_period_ms_p99": percentile(periods, 99),
            "loop_overruns": c.overruns,
            "rtt_ms_p50": percentile(rtts, 50),
            "rtt_ms_p99": percentile(rtts, 99),
            "inference_ms_p50": percentile(list(c.inference_ms)[-512:], 50),
            "observation_age_ms_p50": percentile(ages, 50),
            "observation_age_ms_p99": percentile(ages, 99),
            "refreshes_sent": self.trigger.stats().refreshes,
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
            "requests_unanswered": self.trigger.stats().presumed_lost,
            "watchdog_events": c.watchdog_events,
            "revalidating": self.state == "revalidating",
            "steps": c.steps,
            "dataset_frames": getattr(self.recorder, "frames_written", None),
            **self._rtc_figures(list(c.rtc_delays)[-512:]),
        }
        return figures, {}

    def _rtc_figures(self, delays: list[tuple[int, int]]) -> dict:
        c = self.counters
        errors = [actual - predicted for predicted, actual in delays]
        return {
            "rtc_active": self.rtc_active,
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
            "observation_age_ms_p50": pct(c.observation_age_ms, 50),
            "observation_age_ms_p99": pct(c.observation_age_ms, 99),
            "refreshes_sent": self.trigger.stats().refreshes,
            "control_period_ms_p50": pct(c.period_ms, 50),
            "control_period_ms_p99": pct(c.period_ms, 99),
            "empty_buffer_cycles": c.empty_cycles,
            "loop_overruns": c.overruns,
            "watchdog_events": c.watchdog_events,
            # sent but unanswered when the run ended (lost best-effort observations, or in flight)
            "requests_outstanding_at_exit": self.trigger.stats().outstanding,
            "requests_unanswered": self.trigger.stats().presumed_lost,
            "dataset_path": str(getattr(self.recorder, "root", "")) or None if self.recorder else None,
            "dataset_frames": getattr(self.recorder, "frames_written", None) if self.recorder else None,
            "rtc": self._rtc_summary(),
        }

    def _rtc_summary(self) -> dict:
        """Real-time chunking over the run: the delay error's histogram (actual - predicted, steps)."""
        c = self.counters
        delays = list(c.rtc_delays)
        errors = Counter(actual - predicted for predicted, actual in delays)
        return {
            "active": self.rtc_active,
            "chunks": c.rtc_chunks,
            "delay_mispredicted": c.rtc_delay_mispredicted,
            "delay_overridden": c.rtc_delay_overridden,
            "fallback_chunks": c.rtc_fallback_chunks,
            "replaced_steps": self.buffer.stats().replaced_steps,
            "delay_predicted_steps_p50": percentile([p for p, _ in delays], 50),
            "delay_actual_steps_p50": percentile([a for _, a in delays], 50),
            "delay_error_steps_histogram": {str(k): errors[k] for k in sorted(errors)},
        }

    def write_summary(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.summary(), indent=2))
