"""The robot client: a control loop that never waits on the network, composed of parts with one job each.

    part                    module                          thread              job
    control loop            client/control_loop.py          the caller of run   capture -> outbox -> pop action ->
                                                                                robot -> next deadline; episodes and
                                                                                the recorder hookup
    observation publisher   client/observation_publisher.py "publisher"         newest capture -> JPEG (or /dev/shm)
                                                                                -> msgpack -> put (best effort, DROP)
    chunk receiver          client/chunk_receiver.py        Zenoh callback,     callback: (bytes, arrival) -> inbox;
                                                            "receiver"          thread: decode, check, chunk intake
    server watch            client/server_watch.py          "receiver"          discovery, what the status switches
                                                                                on, watchdog, re-validation, the
                                                                                session nonce and its renewal
    reporting               client/reporting.py             telemetry thread    counters -> telemetry and summary
    task (a strategy)       client/task.py, pipeline.py     its own, if any     what an observation asks, overrides,
                                                                                attempts (a multi-model task)

The scheduling they share is pure (``scheduling/``): the action buffer, the send trigger and the
chunk intake over one in-flight table (seq_id -> request record, ``scheduling/in_flight.py``).

The transport seam (``client/link.py``, ``ClientSession``): the client talks to the network only
through the session it is given or opens (``transport.session.ZenohSession``: ``publisher``,
``subscribe``, ``watch_liveliness``, ``declare_token``, ``query``). ``RobotClient(..., session=...)`` takes one already open (the client
then does not close it); ``RobotClient(..., session_factory=...)`` opens it from the settings the
task asks for (default :func:`open_session`; a test or a benchmark wraps it to count or slow what is
put). Each part is constructed with what it uses, so it can be built and tested alone.

Sessions (docs/protocol.md §10.5): every observation carries ``session_nonce``, drawn once per client (a
restarted client has a new one, so the server counts its seq_ids afresh) and again after
``new_nonce_after_unanswered`` requests in a row got no chunk, and ``episode_id``, the episode number
as a string (the server resets per-episode state when it changes). docs/client.md describes the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from lerobot_zenoh.client.chunk_receiver import ChunkReceiver
from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.control_loop import ControlLoop
from lerobot_zenoh.client.discovery import RobotFeatures
from lerobot_zenoh.client.link import ClientSession, open_session
from lerobot_zenoh.client.observation_publisher import Capture, ObservationPublisher, Outbox
from lerobot_zenoh.client.reporting import ClientCounters, ClientReport
from lerobot_zenoh.client.server_watch import ServerWatch
from lerobot_zenoh.client.task import Task, TaskContext
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake
from lerobot_zenoh.scheduling.send_trigger import SendTrigger
from lerobot_zenoh.telemetry.publisher import TelemetryPublisher
from lerobot_zenoh.transport.session import OBSERVATION_QOS
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)

__all__ = ["Capture", "ClientCounters", "Outbox", "RobotClient", "open_session"]

class RobotClient:
    """Construct with a config and a robot (no I/O); `start()` connects and validates; `run()` loops.

    `robot` is any `lerobot.robots.Robot`; it is connected by `start()` if it is not already.
    `recorder` (optional) has `record(observation, action, failsafe=)`, `end_episode()` and `close()`.
    Keyword-only parts, each optional: `task` (the strategy, `client/task.py`; the plain task by
    default), `session` (an open session to use instead of opening one; not closed by the client),
    `session_factory` (``settings -> open session``, closed by the client; default `open_session`),
    `buffer` and `trigger` (the action buffer and the send trigger the client schedules with).
    """

    def __init__(self, config: RobotClientConfig, robot, recorder=None, *, task: Task | None = None,
                 session: ClientSession | None = None,
                 session_factory: Callable[[ZenohSettings], ClientSession] | None = None,
                 buffer: ActionBuffer | None = None, trigger: SendTrigger | None = None):
        self.config = config
        self.robot = robot
        self.recorder = recorder
        self.task = task if task is not None else Task()
        self.dt_s = config.dt_s
        self.buffer = buffer if buffer is not None else ActionBuffer(config.aggregate)
        self.trigger = trigger if trigger is not None else SendTrigger(config.send, dt_s=self.dt_s)
        self.intake = ChunkIntake(self.trigger, self.dt_s, max_actions=config.actions_per_chunk,
                                  initial_delay_steps=config.rtc.initial_delay_steps,
                                  delay_quantile=config.rtc.delay_quantile)
        self.counters = ClientCounters()
        self.outbox = Outbox()
        self.features: RobotFeatures | None = None
        self._session = session
        self._own_session = session is None
        self._session_factory = session_factory
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._telemetry: TelemetryPublisher | None = None
        # The parts (built by `start`, each with what it uses).
        self.watch: ServerWatch | None = None
        self.loop: ControlLoop | None = None
        self.publisher: ObservationPublisher | None = None
        self.receiver: ChunkReceiver | None = None
        self.report: ClientReport | None = None
        # The server's permanent refusal that stopped the client (protocol 1.5), or None.
        self.refusal = None

    # -- start-up -----------------------------------------------------------------------------

    def start(self) -> RobotClient:
        """Connect, discover and validate. Raises CompatibilityError (no action was sent) on mismatch."""
        cfg = self.config
        if not self.robot.is_connected:
            self.robot.connect()
        self.features = RobotFeatures.of(self.robot)
        settings = self.task.session_settings(cfg.zenoh_settings())
        if self._session is None:
            self._session = (self._session_factory(settings) if self._session_factory is not None
                             else open_session(settings, cfg.discovery_timeout_s))
        session = self._session
        self.watch = ServerWatch(cfg, session, self.features, trigger=self.trigger, intake=self.intake,
                                 counters=self.counters, stop=self._stop,
                                 same_host_allowed=self.task.same_host_allowed,
                                 refetch_allowed=self.task.refetch_allowed, on_refused=self._refused)
        self.loop = ControlLoop(cfg, self.robot, self.features, buffer=self.buffer, intake=self.intake,
                                outbox=self.outbox, watch=self.watch, task=self.task, counters=self.counters,
                                recorder=self.recorder, stop=self._stop)
        self.report = ClientReport(cfg.client_uuid, self.counters, trigger=self.trigger, buffer=self.buffer,
                                   outbox=self.outbox, watch=self.watch, recorder=self.recorder,
                                   extra=self.task.figures)
        self.watch.discover(", ".join(settings.connect))
        self.task.start(TaskContext(session, self.watch.status, self.features, self._stop, self.loop.wake,
                                    lambda: self.loop.last_action, self.counters))
        obs_key, metrics_key = self.task.stream_keys(cfg)
        self.publisher = ObservationPublisher(
            session.publisher(obs_key, OBSERVATION_QOS), self.outbox, self.features, client_uuid=cfg.client_uuid,
            task_text=cfg.task_text, jpeg_quality=cfg.jpeg_quality, counters=self.counters,
            same_host_active=lambda: self.watch.same_host_active, on_same_host_failed=self.watch.same_host_failed,
            route=self.task.observation_route(session), refusals=self.task.reads_refusals)
        self.receiver = ChunkReceiver(self.intake, self.buffer, action_dim=len(self.features.action_names),
                                      watch=self.watch, counters=self.counters, client_uuid=cfg.client_uuid,
                                      mispredict_steps=cfg.rtc.mispredict_steps, on_accepted=self.task.on_chunk,
                                      on_refused=self._refused)
        session.subscribe(cfg.client_key.action, self.receiver.on_chunk)
        session.watch_liveliness(cfg.app_key.all_servers, self.watch.on_liveliness)
        self.task.declare(session)
        # The token's key is the client's metrics key: monitors see the client appear and vanish.
        session.declare_token(metrics_key)
        if cfg.telemetry_period_s > 0:
            self._telemetry = TelemetryPublisher(session, metrics_key, "client", cfg.client_uuid,
                                                 self.report.telemetry_figures, cfg.telemetry_period_s,
                                                 labels=self.task.telemetry_labels(self.robot)).start()
        targets = [(lambda: self.publisher.run(self._stop), "publisher"),
                   (lambda: self.receiver.run(self._stop), "receiver"), *self.task.threads()]
        for target, name in targets:
            t = threading.Thread(target=target, name=f"{cfg.client_uuid}:{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.watch.state = "running"
        return self

    # -- running ------------------------------------------------------------------------------

    def run(self, duration_s: float | None = None) -> ClientCounters:
        """Run the control loop until `stop()`, `duration_s` (default `--duration_s`), or the last episode.

        Recording (`--dataset.*`): `num_episodes` episodes of `episode_time_s`, each followed (but the
        last) by a reset phase of `reset_time_s` in which the robot is held, no observation is sent
        and nothing is recorded, as lerobot-record. Without a dataset: one episode, until stopped.
        """
        if self.loop is None:
            raise RuntimeError("start() the client before run()")
        return self.loop.run(duration_s)

    def _refused(self, refusal) -> None:
        """The server refuses every request like ours (a permanent `Refusal`): stop; `refusal` says why."""
        self.refusal = refusal
        self.stop()

    def wake(self) -> None:
        """Interrupt the control loop's wait between steps (any thread): the task reacts at once."""
        if self.loop is not None:
            self.loop.wake()

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        self.outbox.wake()

    def close(self) -> None:
        """Leave the robot in its fail-safe state, save the recording, undeclare, disconnect."""
        self.stop()
        if self._telemetry is not None:
            self._telemetry.close()
        for t in self._threads:
            t.join(timeout=2.0)
        if self.counters.steps > 0 and self.robot.is_connected and self.loop is not None:  # never act if it never ran
            try:
                self.robot.send_action(self.loop.failsafe_action(self.robot.get_observation()))
            except Exception as exc:
                log.warning("%s: fail-safe action at exit failed: %s", self.config.client_uuid, exc)
        if self.recorder is not None:
            self.recorder.close()
        if self._session is not None and self._own_session:
            self._session.close()
        if self.watch is not None:
            self.watch.state = "stopped"

    # -- what the parts know, read through the client (the public API of earlier versions) -----

    @property
    def state(self) -> str:
        """stopped | running | revalidating."""
        return self.watch.state if self.watch is not None else "stopped"

    @property
    def status(self):
        return self.watch.status if self.watch is not None else None

    @property
    def serving_server_id(self) -> str | None:
        return self.watch.serving_server_id if self.watch is not None else None

    @property
    def session_nonce(self) -> int | None:
        return self.watch.session_nonce if self.watch is not None else None

    @property
    def rtc_active(self) -> bool:
        return self.watch is not None and self.watch.rtc_active

    @property
    def same_host_active(self) -> bool:
        return self.watch is not None and self.watch.same_host_active

    @property
    def failsafe_mode(self) -> str | None:
        return self.loop.failsafe_mode if self.loop is not None else None

    @property
    def episode(self) -> int:
        """The episode (attempt) running, from 0."""
        return self.loop.episode if self.loop is not None else 0

    # -- telemetry and summary ----------------------------------------------------------------

    def telemetry_figures(self) -> tuple[dict, dict]:
        """Figures for the Telemetry message (docs/telemetry.md)."""
        return self._report().telemetry_figures()

    def summary(self) -> dict:
        out = self._report().summary()
        task = self.task.summary()
        if task is not None:
            out.update(task)
        return out

    def write_summary(self, path: str | Path) -> None:
        self._report().write_summary(path, self.summary())

    def _report(self) -> ClientReport:
        if self.report is None:  # never started: figures of nothing, from the same code
            self.report = ClientReport(self.config.client_uuid, self.counters, trigger=self.trigger,
                                       buffer=self.buffer, outbox=self.outbox,
                                       watch=_NeverStarted(), recorder=self.recorder, extra=self.task.figures)
        return self.report


class _NeverStarted:
    """What the report reads of a server watch when the client never started."""

    state = "stopped"
    status = None
    rtc_active = False
