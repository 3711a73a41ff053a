"""The policy server's shell: wires Zenoh, liveliness, failover and telemetry around each model
(`server/model/served_model.py`: its session table, whom to serve; its runner adapter, decode, infer,
encode), through admission (`server/engine/admission.py`: the header read once, the one step every
picked request goes through).

Who owns what (docs/architecture.md, "Server process"):
- `server/shell/ingest.py`: the subscriptions and Zenoh callbacks (hand-over only: the header read once,
  `SessionTable.admit` into the session's newest-only slot, client tokens), and what a reload changes;
- `server/shell/inference_loop.py`: the one inference thread and its supervision (a model whose turns
  keep failing is withdrawn where everyone can see it);
- `server/engine/`: the executor interface every engine is (the batch executor, the iteration-level
  decoder, a thread of either, a remote engine); a model without `engines` is the session table's
  scheduler with one local executor (`server/engine/local.py`);
- `server/engine/serving.py`: what this process's executors share: the batch path, answers, the action publishers;
- `server/dispatch/`: a model with `engines` (docs/server.md, "Engines"): placement across engines,
  each an executor the dispatcher hands requests to; this class is its `DispatchHost`;
- `server/shell/figures.py`: telemetry figures and counters, computed outside the session table's lock.

This shell starts and stops them: pre-warm and profile each model, open Zenoh, declare status
responders and liveliness tokens, hot standby roles, telemetry publishers.

A bad observation or a failed inference is counted against its client and the loop moves on:
one client can cost the others at most one inference (a failed batch is re-run one request at a time).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable


from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import SameHostAdvert
from lerobot_zenoh.scheduling.batch_profile import saturation_batch_size
from lerobot_zenoh.server.model.batch_profiling import measure_batch_profile
from lerobot_zenoh.server.dispatch.dispatcher import Dispatcher
from lerobot_zenoh.server.engine.interface import EngineExecutor
from lerobot_zenoh.server.engine.local import local_executor
from lerobot_zenoh.server.session_table.records import Session
from lerobot_zenoh.server.shell.engine_worker import EngineWorker
from lerobot_zenoh.server.shell.figures import model_figures, model_stats
from lerobot_zenoh.server.shell.inference_loop import InferenceLoop
from lerobot_zenoh.server.shell.ingest import Ingest
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.server.engine.serving import Serving
from lerobot_zenoh.server.model.failover import Heartbeats
from lerobot_zenoh.server.config.manifest import Manifest, ModelEntry, reload_refusal
from lerobot_zenoh.server.config.runner_loading import load_runner
from lerobot_zenoh.server.runners.base import PolicyRunner
from lerobot_zenoh.telemetry.publisher import TelemetryPublisher
from lerobot_zenoh.transport import same_host
from lerobot_zenoh.transport.session import ZenohSession

log = logging.getLogger(__name__)


class PolicyServer:
    """Construct with a manifest (no I/O); `start()` pre-warms every model, then opens Zenoh.

    `runners` may be given to inject already-built runners (keyed by model_id); otherwise they are
    loaded from the manifest.
    """

    def __init__(self, manifest: Manifest, runners: dict | None = None, codec_limits: codec.CodecLimits = codec.DEFAULT_LIMITS):
        self.manifest = manifest
        self.server_id = manifest.server_id
        self._injected = runners or {}
        self._limits = codec_limits
        self.models: list[ServedModel] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._session: ZenohSession | None = None
        self._telemetry: list[TelemetryPublisher] = []
        self.started = threading.Event()
        self._reload_lock = threading.Lock()
        # Same-host frames live in this host's /dev/shm: a model whose requests may run on another
        # host's engine is offered JPEG only.
        self._probe = (same_host.Probe() if manifest.same_host and manifest.role == "server"
                       and not any(e.engines for e in manifest.server) else None)
        self._worker: EngineWorker | None = None  # role: engine (server/shell/engine_worker.py)
        self._tokens: dict[str, object] = {}  # app prefix -> this server's liveliness token for it
        self.serving = Serving(self.server_id, self.models, self._stop)  # the serving paths (server/engine/serving.py)
        self.ingest = Ingest(self.models, self._wake)  # Zenoh callbacks and subscriptions (server/shell/ingest.py)
        self._loop = InferenceLoop(self.models, self.serving, self._stop, self._wake, self._tokens)
        self.incarnation = f"{os.getpid()}-{time.time_ns():x}"  # this process: heartbeats name it
        self._heartbeats: Heartbeats | None = None  # served work, for a hot standby (server/model/failover.py)

    @property
    def failed(self) -> threading.Event:
        """Set when no model is served any more (each withdrawn after faults): the console script
        then exits non-zero instead of leaving a process that serves nothing."""
        return self._loop.failed

    @property
    def inferences(self) -> int:
        return sum(m.inferences for m in self.models)

    def reload(self, manifest: Manifest) -> str | None:
        """Take a re-read manifest's client lists, planned batch sizes and task streams (`pipeline`)
        without a restart (SIGHUP; docs/server.md, "Reloading the client list"); None when applied, else
        why it was refused (logged in one line; the running manifest stays in force). A client no longer
        listed, or a robot of a task stream no longer listed, has its session closed like an expired one
        (`delisted`); the inference thread forgets its state."""
        with self._reload_lock:
            why = reload_refusal(self.manifest, manifest)
            if why is None and self._worker is not None:
                why = "an engine (role: engine) takes no reload; restart it (its scheduler re-profiles it)"
            why = why or self.ingest.reload(manifest)
            if why is not None:
                log.error("manifest reload refused: %s (only clients, max_batch_size and pipeline are reloaded; "
                          "restart the server for the rest); the running manifest stays in force", why)
                return why
            self.manifest = manifest
        self._wake.set()  # the inference thread forgets closed sessions at its next expiry pass
        return None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> PolicyServer:
        if self.manifest.role == "engine":
            self._worker = EngineWorker(self.manifest, self._injected, self._limits).start()
            self.started.set()
            return self
        advert = self._probe.advert if self._probe is not None and self._probe.create() else None
        try:
            return self._start(advert)
        except BaseException:
            if self._session is not None:
                self._session.close()
            if self._probe is not None:
                self._probe.close()  # a server that failed to start leaves no probe file behind
            raise

    def _start(self, advert: SameHostAdvert | None) -> PolicyServer:
        # The endpoints are bound before any model loads: a busy port fails at once, not after the warm-up.
        self._session = self.serving.session = self.ingest.session = ZenohSession(self.manifest.zenoh_settings()).open()
        warmup_s: dict[str, float] = {}
        for entry in self.manifest.server:
            if entry.model_id not in self._injected:
                log.info("loading %s/%s ...", entry.model_id, entry.model_version)  # progress: seconds for a big model
            runner = self._injected.get(entry.model_id) or load_runner(self.manifest, entry)
            log.info("warming up %s/%s (%s) ...", entry.model_id, entry.model_version, runner.spec.policy_type)
            t0 = time.perf_counter()
            runner.warmup()  # before anything is announced: a client never waits for a cold model
            warmup_s[entry.model_id] = time.perf_counter() - t0
            log.info("pre-warmed %s/%s (%s) in %.0f ms", entry.model_id, entry.model_version,
                     runner.spec.policy_type, (time.perf_counter() - t0) * 1000)
            profile_s = self._profile(entry, runner) if entry.max_batch_size == "auto" else None
            if profile_s is None and any(e.local and e.profile == "measured" for e in entry.engines):
                profile_s = self._profile(entry, runner, force=True)
            self.models.append(ServedModel(self.manifest, entry, runner, self.server_id, profile_s, self._limits,
                                           same_host=advert, incarnation=self.incarnation, runs_on=self._runs_on))

        for model in self.models:
            if model.dispatcher is not None:
                try:
                    model.dispatcher.start()  # every remote engine reachable, loading this model
                except BaseException:
                    model.dispatcher.stop(1.0)
                    self._session.close()
                    raise
        for model in self.models:
            model.role.note_turn(warmup_s.get(model.entry.model_id))  # the slowest turn until it serves
            # Its own app's observations (a plain robot client routed here) and, for a component of
            # multi-model tasks, each task's observation stream.
            self.ingest.subscribe(model, model.app, None, model.subscriptions.setdefault(None, []))
            for task, stream in model.streams.items():
                self.ingest.subscribe(model, stream, task, model.subscriptions.setdefault(task, []))
        self._loop.start()
        # Heartbeats of served work, before the roles start: a restarted primary is heard in its grace.
        self._heartbeats = Heartbeats(self._session, self.server_id, self.models, self._loop.withdraw).start()
        for model in self.models:
            self._session.serve(model.app.status, lambda params, m=model: m.status_reply(params) if m.role.active.is_set()
                                else None, with_parameters=True)
            self._tokens[model.app.prefix] = self._session.declare_token(model.app.server_token(self.server_id))
            self._start_role(model)
            if self.manifest.telemetry_period_s > 0:
                self._telemetry.append(TelemetryPublisher(
                    self._session, model.app.server_metrics(self.server_id), "server", self.server_id,
                    lambda m=model: self.telemetry_figures(m), self.manifest.telemetry_period_s,
                    labels={"model_id": model.entry.model_id, "policy_type": model.runner.spec.policy_type,
                            "device": model.entry.device}).start())
            serves = model.output + (" + text" if any(s.item.text is not None for s in model.streams.values()) else "")
            log.info("serving %s (%s; status: %s)", ", ".join(
                [model.app.all_observations, *(sel for s in model.streams.values() for sel in
                                               (s.key.all_observations, *map(s.key.component_observations, s.bits)))]),
                serves, model.app.status)
        if "server_id" not in self.manifest.model_fields_set:
            # Its telemetry key, its Prometheus `server` label and its certificate's name follow the id:
            # one that changes every run starts new series at each restart.
            log.warning("no server_id in the manifest (or --server_id): serving as %s, which changes with every "
                        "start; set server_id for stable metrics series (docs/telemetry.md)", self.server_id)
        self.started.set()
        return self

    def _runs_on(self, model: ServedModel) -> EngineExecutor | Dispatcher:
        """Who runs a model's requests (`ServedModel(runs_on=...)`): a model without `engines` is a
        scheduler with one local executor, run by the inference thread; one with them, a dispatcher
        (this server is its `DispatchHost`), started once every model is built."""
        if not model.entry.engines:
            return local_executor(self.serving, model)
        return Dispatcher(self, model, self._session)

    @staticmethod
    def _profile(entry: ModelEntry, runner: PolicyRunner, force: bool = False) -> dict[int, float] | None:
        """The latency-vs-batch profile for `max_batch_size: auto` (None for a runner that cannot batch);
        `force`: measured even for a runner that cannot batch (a local engine's `profile: measured`)."""
        cap = runner.spec.capabilities.max_batch
        if cap == 1 and not force:
            log.warning("%s: %s runners serve one request per pass; max_batch_size auto -> 1", entry.model_id,
                        runner.spec.policy_type)
            return None
        largest = entry.profile_max_batch if cap is None else min(entry.profile_max_batch, cap)
        log.info("%s: profiling batch sizes up to %d (at most %.0f s) ...", entry.model_id, largest,
                 entry.profile_budget_s)
        profile_s = measure_batch_profile(runner, largest, budget_s=entry.profile_budget_s)
        chosen = saturation_batch_size(profile_s) if profile_s else 1
        log.info("batch profile of %s (ms per pass): %s; max_batch_size auto -> %d", entry.model_id,
                 ", ".join(f"{b}: {t * 1000:.1f} ({b / t if t else float('inf'):.1f} req/s)"
                           for b, t in profile_s.items()) or "none", chosen)
        return profile_s

    def heard_primary(self, model_index: int = 0) -> bool:
        """Whether this server, a standby, hears its primary's heartbeat of served work for that model."""
        return self._heartbeats is not None and self._heartbeats.heard_primary(model_index)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking observations, finish the inference in flight, close every session, undeclare."""
        if self._worker is not None:
            self._worker.stop(timeout_s)
            return
        for model in self.models:
            for subscriptions in model.subscriptions.values():
                for sub in subscriptions:
                    sub.close()
            model.subscriptions.clear()
        for pub in self._telemetry:
            pub.close()
        if self._heartbeats is not None:
            self._heartbeats.close()
        for model in self.models:
            if model.role is not None:
                model.role.close()
        self._stop.set()
        self._wake.set()
        stuck = not self._loop.join(timeout_s)
        if stuck:
            log.warning("inference thread did not finish within %.1f s", timeout_s)
        for model in self.models:
            if model.dispatcher is not None and not model.dispatcher.stop(timeout_s):
                stuck = True  # the local engine's thread may still be inside the runner
        for model in self.models:
            if not stuck:  # (a stuck inference thread may still be inside the runner)
                for session in model.session_table.close_all():
                    self.serving.forget(model, session)  # (logs each session's counts)
                model.adapter.close()
        if self._session is not None:
            self._session.close()
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- hot standby --------------------------------------------------------------------------

    def _start_role(self, model: ServedModel) -> None:
        role = model.role
        if role.is_standby:
            # No judgement from a liveliness query here: before the transport routes, Zenoh may answer
            # it from this session's own empty view. The heartbeat thread judges once there is evidence
            # (`failover.StartupJudge`): the primary's heartbeat or token, or robots' observations.
            role.start_standby(time.monotonic())
            primary = model.app.server_token(role.standby_for)
            self._session.watch_liveliness(primary, lambda key, alive, r=role: r.on_primary(alive))
        else:
            others = [k for k in self._session.alive(model.app.all_servers, timeout_s=0.3)
                      if k != model.app.server_token(self.server_id)]
            role.start_primary(bool(others), self.manifest.handover_grace_s)

    # -- what the dispatcher asks of this process (`dispatch.DispatchHost`) -----------------------

    def reject(self, model: ServedModel, session: Session, reason: str, detail: str, *, cool_down: bool = True) -> None:
        self.serving.reject(model, session, reason, detail, cool_down=cool_down)

    def publish(self, model: ServedModel, client_id: str, payload: bytes, *,
                valid: Callable[[], bool] | None = None) -> None:
        self.serving.publish(model, client_id, payload, valid=valid)

    def wake(self) -> None:
        self._wake.set()

    def local_executor(self, model: ServedModel) -> EngineExecutor:
        """The local engine's executor (run on its own thread by the dispatcher)."""
        return local_executor(self.serving, model)

    def measure_profile(self, model: ServedModel) -> dict[int, float]:
        """The local engine's `profile: measured`: the start-up profile, measured now if it was not."""
        if not model.batch_profile_s:
            model.batch_profile_s = self._profile(model.entry, model.runner, force=True) or {}
        return model.batch_profile_s

    # -- introspection ------------------------------------------------------------------------

    def telemetry_figures(self, model: ServedModel) -> tuple[dict, dict]:
        """(model-level figures, per-client figures) for the Telemetry message (docs/telemetry.md)."""
        return model_figures(model)

    def stats(self) -> dict:
        """A snapshot of every counter, per model and per open session."""
        return {model.app.prefix: model_stats(model) for model in self.models}
