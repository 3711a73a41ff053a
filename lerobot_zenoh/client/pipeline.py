"""The robot client of a multi-model task: System 1, System 2, safety and monitor (docs/pipelines.md).

A task strategy (`client/task.py`) handed to the plain `RobotClient`: the same control loop,
publisher, action buffer and chunk intake, with the decisions of `pipelines/runtime.py` (pure)
behind `PipelineTask`'s methods. `PipelineClient(config, robot, plan)` is `RobotClient` with this
task (and the task's figures and state read through it).

    control loop   each step: System 1 due (the send trigger) -> the runtime's component mask -> one
                   capture in the outbox (nothing when no component is due); expired deadlines
                   (`poll`); the runtime's mode replaces the policy's action (hold, zero velocity,
                   safe pose); an ended attempt -> the task retry policy (client.run)
    publisher      publishes each observation ONCE on the task's stream
                   `<cluster>/<experiment>/_pipeline/1/<task>/<robot>/obs` with `component_mask`
                   (and System 1's task string: System 2's latest plan)
    receiver       System 1's action chunks, as the plain client (then booked against the SLO)
    pipeline       TextResult / Verdict from the other components' servers (each on its own app key,
                   `.../<robot>/text|verdict`) -> the runtime; a verdict that puts the robot in a
                   danger mode wakes the control loop, which applies it at once (well within one
                   control period of the verdict's arrival) instead of at its next step

One lock (`PipelineTask._lock`) guards the runtime; it is held for a few dictionary operations, never across I/O.
At start-up every component's server is found on its own app key (a status query naming this robot)
and checked: it serves this robot, answers with what the component needs (`Status.output`: actions,
text or verdict), and reads the robot's cameras and state (action dimension and fps are System 1's
business only). A System 2 routed to System 1's own app (a pi0.5 serving both from one prefill) is
System 1's server: it must answer actions and be a pi05 (its text comes on the same app's `text`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.discovery import compare, discover
from lerobot_zenoh.client.task import Ask, Task, TaskContext
from lerobot_zenoh.errors import CompatibilityError, ConfigError, ProtocolError
from lerobot_zenoh.pipelines.robot_plan import RobotPlan
from lerobot_zenoh.pipelines.runtime import OUTPUT_OF_KIND, PipelineRuntime
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.reasons import OutputKind
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport.session import OBSERVATION_QOS
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)

#: Most observation keys (component masks) a pipeline robot keeps a publisher for (`observation_route`).
MAX_ROUTES = 64


def configure(config: RobotClientConfig, plan: RobotPlan) -> RobotClientConfig:
    """The client configuration for a planned robot: System 1's app key and endpoint, the plan's fps
    and chunk length, and System 1's planned rate as the send cap (unless --send.max_rate_hz is set)."""
    s1 = plan.system1
    config.cluster_uuid, config.experiment_tag = plan.cluster, plan.experiment
    config.model_id, config.model_version, config.application_tag = s1.app.model, s1.app.version, s1.app.app
    if s1.endpoint:
        config.endpoint = s1.endpoint
    if plan.fps is not None:
        config.fps = plan.fps
        if config.dataset is not None:
            config.dataset.fps = plan.fps
    if plan.actions_per_chunk is not None:
        config.actions_per_chunk = plan.actions_per_chunk
    if config.send.max_rate_hz is None and s1.rate_hz:
        config.send.max_rate_hz = s1.rate_hz
    config.validate()
    return config


class PipelineTask(Task):
    """The task of `plan` for this robot, as a strategy of `RobotClient` (no I/O until `start`)."""

    # The observation goes to every component's server: no same-host frames (each would need its
    # probe), and no re-fetch (one observation asks several components: not designed yet). No
    # refusals either: they would arrive on the text and verdict keys too, which read no Refusal yet.
    same_host_allowed = False
    refetch_allowed = False
    reads_refusals = False

    def __init__(self, config: RobotClientConfig, plan: RobotPlan):
        if config.client_uuid != plan.robot:
            raise ConfigError("client_uuid", f"{config.client_uuid!r} but the plan is {plan.robot!r}'s")
        if config.send.refetch_after_s:
            raise ConfigError("send.refetch_after_s", "re-fetch is not supported for a multi-model task (--pipeline.plan)")
        self.config = config
        self.plan = plan
        self.runtime = PipelineRuntime(plan.task, rates_hz=plan.rates_hz, base_task=config.task_text)
        self._lock = threading.Lock()
        self._s1_bit = self.runtime.bit(self.runtime.system1)
        self._results: queue.Queue = queue.Queue(maxsize=256)
        self.statuses: dict[str, object] = {}
        self.stream_key = plan.stream.client(config.client_uuid)
        self.results_dropped = 0  # a full results inbox (the pipeline thread got no CPU)
        self.results_rejected = 0  # undecodable TextResult / Verdict
        # Danger: when the verdict that put the robot in a danger mode arrived, and how long after it
        # the mode's first action went to the robot (ms), for telemetry and the tests.
        self._danger_arrived_s: float | None = None
        self.danger_reactions_ms: deque = deque(maxlen=256)
        self._context: TaskContext | None = None
        self._action_names: tuple[str, ...] = ()

    # -- start-up -------------------------------------------------------------------------------

    def session_settings(self, settings: ZenohSettings) -> ZenohSettings:
        """Connect to every component's server; with several, as a peer (a Zenoh client has one link)."""
        settings = settings.with_connect(*(r.endpoint for r in self.plan.routes.values()))
        if settings.mode == "auto" and len(settings.connect) > 1 and not settings.listen:
            settings = settings.replace(mode="peer")
        elif settings.mode == "client" and len(settings.connect) > 1:
            log.warning("%s: --zenoh.mode=client links to one of %d endpoints: the components behind the others "
                        "are reachable only through a router", self.config.client_uuid, len(settings.connect))
        return settings

    def stream_keys(self, config) -> tuple[str, str]:
        # Observations, the robot's token and its telemetry live on the task's stream (docs/protocol.md §2.2).
        return self.stream_key.obs, self.stream_key.metrics

    def observation_route(self, session):
        """Each observation on the key that names the components it asks (`ClientKey.obs_for`), so that
        a router sends it only to their servers: a publisher per mask, declared at its first use (the
        plan asks a few masks; past MAX_ROUTES the oldest is undeclared)."""
        publishers: dict[int, object] = {}

        def route(mask: int):
            publisher = publishers.get(mask)
            if publisher is None:
                if len(publishers) >= MAX_ROUTES:
                    publishers.pop(next(iter(publishers))).close()
                publisher = publishers[mask] = session.publisher(self.stream_key.obs_for(mask), OBSERVATION_QOS)
            return publisher

        return route

    def telemetry_labels(self, robot) -> dict[str, str]:
        return {"robot_type": getattr(robot, "name", ""), "task": self.plan.task.name}

    def start(self, context: TaskContext) -> None:
        """System 1 passed the plain client's checks: check it answers actions, then find and check
        every other component's server."""
        self._context = context
        cfg = self.config
        s1 = self.plan.system1
        self._check_output(s1.component, "system1", context.status)
        self.statuses[s1.component] = context.status
        features = context.features
        for name, route in self.plan.routes.items():
            if route.kind == "system1":
                continue
            if route.kind == "system2" and route.app == s1.app:
                self._check_shared_prefill(name, context.status)
                self.statuses[name] = context.status
                log.info("%s: component %s (system2) served by %s from System 1's prefill (%s %s)", cfg.client_uuid,
                         name, context.status.server_id, context.status.model_id, context.status.model_version)
                continue
            status = discover(context.session, route.app, cfg.discovery_timeout_s, context.stop,
                              client_uuid=cfg.client_uuid)
            if status is None:
                raise CompatibilityError(f"component {name!r} ({route.kind}): no server answers {route.app.status} "
                                         f"within {cfg.discovery_timeout_s:.0f} s (is its server up at {route.endpoint}?)")
            if status.client_admitted is False:
                raise CompatibilityError(f"component {name!r}: server {status.server_id} does not serve client "
                                         f"{cfg.client_uuid!r}")
            self._check_output(name, route.kind, status)
            # It reads the same observation: cameras and state must fit; actions and fps are System 1's.
            problems = [p for p in compare(status, features, cfg.fps)
                        if not p.startswith(("action_dim", "fps"))]
            if problems:
                raise CompatibilityError(f"component {name!r}: server {status.server_id} is incompatible: "
                                         + "; ".join(problems))
            self.statuses[name] = status
            log.info("%s: component %s (%s) served by %s (%s %s)", cfg.client_uuid, name, route.kind,
                     status.server_id, status.model_id, status.model_version)
        names = features.action_names
        for comp in self.plan.task.components.values():
            for fb in (comp.on_danger, comp.on_slo_miss):
                if fb is not None and fb.pose is not None and len(fb.pose) != len(names):
                    raise CompatibilityError(f"task {self.plan.task.name!r}: a safe_pose has {len(fb.pose)} joints, "
                                             f"the robot takes {len(names)} actions")
        self._action_names = names

    @staticmethod
    def _check_shared_prefill(name: str, status) -> None:
        """System 2 planned on System 1's own server and app (one stream, one prefill): that server
        must answer actions and say that it streams text on the same app (`Status.streams_text`), as a
        pi0.5 with a `language` block does (docs/policies.md)."""
        if (status.output or OutputKind.ACTIONS) != OutputKind.ACTIONS or status.streams_text is not True:
            raise CompatibilityError(
                f"component {name!r} (system2) is planned on System 1's server {status.server_id} (one stream), "
                f"which needs a server answering actions and streaming text from one prefill (a pi0.5 with a "
                f"`language` block), but it serves {status.policy_type or 'an unnamed policy'} answering "
                f"{status.output or 'actions'}" + ("" if status.streams_text else " and streaming no text"))

    @staticmethod
    def _check_output(name: str, kind: str, status) -> None:
        expected = OUTPUT_OF_KIND[kind]
        got = status.output or OutputKind.ACTIONS
        if got != expected:
            raise CompatibilityError(f"component {name!r} ({kind}) needs a server answering {expected}, but server "
                                     f"{status.server_id} answers {got}")

    def declare(self, session) -> None:
        cfg = self.config
        for name, route in self.plan.routes.items():
            if route.kind == "system2":
                session.subscribe(route.app.client(cfg.client_uuid).text, self._result_handler(name))
            elif route.kind in ("safety", "monitor"):
                session.subscribe(route.app.client(cfg.client_uuid).verdict, self._result_handler(name))

    def threads(self) -> list:
        return [(self._result_loop, "pipeline")]

    # -- results (Zenoh callbacks, then the pipeline thread) ------------------------------------

    def _result_handler(self, component: str):
        def on_result(key: str, payload: bytes) -> None:  # Zenoh callback: hand over, nothing else
            try:
                self._results.put_nowait((component, payload, time.perf_counter()))
            except queue.Full:
                self.results_dropped += 1
        return on_result

    def _result_loop(self) -> None:
        stop = self._context.stop
        while not stop.is_set():
            try:
                component, payload, arrived_s = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            self.handle_result(component, payload, arrived_s)

    def handle_result(self, component: str, payload: bytes, arrived_s: float) -> None:
        """One TextResult / Verdict of `component`, arrived at `arrived_s`, into the runtime."""
        kind = self.runtime.kind(component)
        try:
            msg = codec.decode_text_result(payload) if kind == "system2" else codec.decode_verdict(payload)
        except ProtocolError as exc:
            self.results_rejected += 1
            if worth_logging(self.results_rejected):
                log.warning("%s: rejected a %s answer: %s", self.config.client_uuid, component, exc)
            return
        with self._lock:
            before = self.runtime.mode
            if kind == "system2":
                if not msg.partial:  # text still being written is not System 2's answer yet
                    self.runtime.on_text(component, msg.response_to_seq_id, msg.text, arrived_s)
                return
            self.runtime.on_verdict(component, msg.response_to_seq_id, msg.label, arrived_s)
            after = self.runtime.mode
            ended = self.runtime.outcome is not None
        if msg.label in ("unsafe", "failed", "done"):
            log.warning("%s: %s says %s about observation %d", self.config.client_uuid, component, msg.label,
                        msg.response_to_seq_id)
        if after is not None and after != before:
            self._danger_arrived_s = arrived_s
            self._context.wake()  # the control loop applies it now, not at its next step
        elif ended:
            self._context.wake()

    # -- the control loop's questions -----------------------------------------------------------

    def ask(self, seq_id: int, now_s: float, system1_due: bool) -> Ask | None:
        """Each step: the components due (System 1 when the send rule says so), or None."""
        with self._lock:
            mask = self.runtime.due_mask(now_s, system1_due)
            if not mask:
                return None
            self.runtime.on_sent(seq_id, mask, now_s)
            task = self.runtime.task_text
        return Ask(system1=bool(mask & self._s1_bit), component_mask=mask, task_text=task)

    def on_chunk(self, seq_id: int, arrived_s: float) -> None:
        with self._lock:
            self.runtime.on_chunk(seq_id, arrived_s)

    def override(self, observation: dict, now_s: float) -> dict | None:
        with self._lock:
            self.runtime.poll(now_s)
            mode = self.runtime.mode
        if mode is None:
            return None
        self._note_reaction(now_s)
        return self._mode_action(mode, observation)

    def _mode_action(self, mode, observation: dict | None) -> dict:
        names = self._action_names
        if mode.action == "zero_velocity":
            return dict.fromkeys(names, 0.0)
        if mode.action == "safe_pose":
            return dict(zip(names, (float(x) for x in mode.pose)))
        if observation is not None and all(n in observation for n in names):  # hold: the measured position
            return {n: float(observation[n]) for n in names}
        last = self._context.last_action() if self._context is not None else None
        return dict(last) if last else dict.fromkeys(names, 0.0)

    def failsafe(self, observation: dict, default: dict) -> dict:
        """At exit and between attempts, too, the robot keeps a danger or fallback mode."""
        with self._lock:
            mode = self.runtime.mode
        return default if mode is None else self._mode_action(mode, observation)

    def react(self, observation: dict | None, now_s: float) -> dict | None:
        """Woken by a verdict: the robot takes its mode now (the next step would be up to a period away)."""
        with self._lock:
            mode = self.runtime.mode
        if mode is None:
            return None
        self._note_reaction(now_s)
        return self._mode_action(mode, observation)

    def _note_reaction(self, now_s: float) -> None:
        arrived = self._danger_arrived_s
        if arrived is not None:
            self._danger_arrived_s = None
            self.danger_reactions_ms.append((now_s - arrived) * 1000.0)

    def begin_attempt(self, now_s: float) -> None:
        with self._lock:
            self.runtime.begin_attempt(now_s)
        log.info("%s: task %s, attempt %d", self.config.client_uuid, self.plan.task.name, self.runtime.attempt)

    def outcome(self, now_s: float) -> str | None:
        with self._lock:
            outcome = self.runtime.outcome
            if outcome is None or self.runtime.concluded:
                return None
            decision = self.runtime.conclude()
            halted = self.runtime.halted
        log.log(logging.INFO if decision == "done" else logging.WARNING, "%s: attempt %d ended (%s): %s",
                self.config.client_uuid, self.runtime.attempt, outcome.reason,
                {"done": "task done", "retry": "retrying the task", "stop": "task retries spent: stopping",
                 "halt": f"task retries spent: {halted.action if halted else ''} until stopped"}[decision])
        if decision == "done":
            with self._lock:
                self.runtime.failures = 0
        return None if decision == "halt" else decision

    def retry_reset_s(self) -> float:
        return self.config.pipeline.reset_s

    # -- reporting ------------------------------------------------------------------------------

    def figures(self) -> dict:
        with self._lock:
            figures = self.runtime.figures()
        reactions = list(self.danger_reactions_ms)
        figures.update({
            "pipeline.results_dropped": self.results_dropped,
            "pipeline.results_rejected": self.results_rejected,
            # control steps whose action came from a mode (the control loop counts them)
            "pipeline.override_steps": self._context.counters.override_steps if self._context else 0,
            "pipeline.danger_reaction_ms_max": max(reactions) if reactions else None,
        })
        return figures

    def summary(self) -> dict:
        return {"pipeline": {"task": self.plan.task.name, "attempts": self.runtime.attempt,
                             "failures": self.runtime.failures, "task_text": self.runtime.task_text,
                             **self.figures()}}


class PipelineClient(RobotClient):
    """`RobotClient` running `PipelineTask(config, plan)`. Construct with no I/O; `start()`, `run()`, `close()`."""

    def __init__(self, config: RobotClientConfig, robot, plan: RobotPlan, recorder=None, **parts):
        super().__init__(config, robot, recorder, task=PipelineTask(config, plan), **parts)

    @property
    def plan(self) -> RobotPlan:
        return self.task.plan

    @property
    def runtime(self) -> PipelineRuntime:
        return self.task.runtime

    @property
    def statuses(self) -> dict:
        return self.task.statuses

    @property
    def stream_key(self):
        return self.task.stream_key

    @property
    def danger_reactions_ms(self) -> deque:
        return self.task.danger_reactions_ms

    def pipeline_figures(self) -> dict:
        return self.task.figures()
