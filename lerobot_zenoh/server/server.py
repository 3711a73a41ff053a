"""The policy server's shell: wires Zenoh, liveliness, failover and telemetry around each model's
engine (`server/engine.py`: sessions, slots, whom to serve) and executor (`server/executor.py`:
decode, infer, encode), through admission (`server/admission.py`: the header read once, the one
step every picked request goes through).

Threads, and what each may touch:
- Zenoh's callback threads: `_on_observation` parses the key, reads the observation's small header
  (`admission.read_header`, a struct unpack; nothing is decoded) and calls `engine.admit` (the raw
  bytes and that verdict go into the session's newest-only slot, so that a late re-fetch refresh is
  dropped before it takes one); `_on_client_token` tells the engine a client's liveliness token
  appeared or vanished. Both take only the engine's short lock. A model serving a component of
  multi-model tasks (`pipeline` in its manifest entry) also subscribes to each task's observation
  stream (and its robots' tokens there): `_on_task_observation` asks the model's task routing
  (`server/routing.py`) first, which drops, from the same header, an observation whose
  `component_mask` does not ask it (`observations_for_other_components`).
- A model with `engines` (docs/server.md, "Engines") is served by an edge scheduler
  (`server/dispatch.py`): the inference thread places each request the engine picks on one of its
  engines and never waits for one; the local engine's batches run on their own thread (which then
  alone calls that runner), remote engines answer by callback into the dispatcher's event queue,
  drained by the inference thread, which relays each chunk to its robot.
- Whoever calls `reload` (the CLI's main thread on SIGHUP): takes a re-read manifest's client lists,
  batch sizes and task streams under `_reload_lock`; a model's streams are one dict replaced whole,
  so the callbacks and the inference thread read either the old map or the new one.
- One inference thread (`_run`): closes expired sessions (and forgets their runner state and
  action publisher), asks each model's engine for a batch (`admission.schedule`), admits it
  (`admission.prepare`: decoded, routed, prepared), runs it in one forward pass, publishes each
  answer reliably on its client's key of the runner's output (`action` for a chunk, `text` for a
  TextResult, `verdict` for a Verdict; `_answer`, for both serving paths), reports to the engine.
  Nothing else calls the runner, so sessions are never closed under a running inference.
- A responder thread per model answers status queries (transport/session.py); a telemetry thread
  per model copies the engine's counters (`Engine.snapshot`) and computes percentiles outside any lock.

A bad observation or a failed inference is counted against its client and the loop moves on:
one client can cost the others at most one inference (a failed batch is re-run one request at a time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from lerobot_zenoh.errors import ConfigError, KeyExprError, ProtocolError, TransportError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import ANSWER_TOPICS, AppKey, Topic, names_components, parse_client_key
from lerobot_zenoh.protocol.messages import RtcAdvert, SameHostAdvert, Status
from lerobot_zenoh.protocol.reasons import OutputKind, Reason
from lerobot_zenoh.scheduling.batch_profile import saturation_batch_size
from lerobot_zenoh.server import admission, text_stream
from lerobot_zenoh.server.admission import Ready
from lerobot_zenoh.server.batch_profiling import measure_batch_profile
from lerobot_zenoh.server.engine import (
    REPLAYED,
    TOO_MANY_CLIENTS,
    UNKNOWN_CLIENT,
    Batch,
    Engine,
    EngineConfig,
    Session,
    SessionStats,
)
from lerobot_zenoh.server.engine_worker import EngineWorker
from lerobot_zenoh.server.executor import Executor
from lerobot_zenoh.server.failover import ServingRole
from lerobot_zenoh.server.manifest import Manifest, ModelEntry, reload_refusal
from lerobot_zenoh.server.routing import TaskRouting, TaskStream, stream_changes, task_streams
from lerobot_zenoh.server.runners import load_runner
from lerobot_zenoh.server.runners.base import InferenceRequest, InferenceResult, PolicyRunner
from lerobot_zenoh.telemetry.publisher import TelemetryPublisher, percentile, process_memory, worth_logging
from lerobot_zenoh.transport import same_host
from lerobot_zenoh.transport.session import ACTION_QOS, Payload, Publisher, ZenohSession

log = logging.getLogger(__name__)

#: How often the inference loop looks for sessions to close.
EXPIRY_PERIOD_S = 0.25
#: Parsed observation keys kept (one per client and model); beyond it the cache starts again.
MAX_CACHED_KEYS = 4096
#: Faults in a row in one model's serving turn after which it is withdrawn (`PolicyServer._withdraw`).
MAX_FAULTS_IN_A_ROW = 3


class ServedModel:
    """One manifest entry: its runner, engine, executor, status and action publishers."""

    def __init__(self, manifest: Manifest, entry: ModelEntry, runner: PolicyRunner, server_id: str,
                 batch_profile_s: dict[int, float] | None = None,
                 codec_limits: codec.CodecLimits = codec.DEFAULT_LIMITS, same_host: SameHostAdvert | None = None):
        self.entry = entry
        self.source = manifest.source  # (errors at start-up name the manifest file)
        self.app: AppKey = manifest.app_key(entry)
        self.runner = runner
        spec = runner.spec
        # `max_batch_size: auto`: the saturation point of the profile measured at start-up
        # (`batch_profile_s`, {batch size: seconds per pass}); 1 without a profile. A runner takes at
        # most `capabilities.max_batch` requests per call, whatever the manifest says.
        self.batch_profile_s = dict(batch_profile_s or {})
        if entry.max_batch_size == "auto":
            wanted = saturation_batch_size(self.batch_profile_s) if self.batch_profile_s else 1
        else:
            wanted = entry.max_batch_size
        cap = spec.capabilities.max_batch
        self.max_batch_size = wanted if cap is None else min(wanted, cap)
        if self.max_batch_size < wanted:
            log.warning("%s: %s runners take at most %d request(s) per pass; max_batch_size %d -> %d",
                        entry.model_id, spec.policy_type, cap, wanted, self.max_batch_size)
        actions_per_chunk = entry.actions_per_chunk or spec.chunk_size
        if actions_per_chunk > spec.chunk_size:
            raise ConfigError(
                f"server[{entry.model_id}].actions_per_chunk",
                f"{actions_per_chunk} is more than the model's chunk size {spec.chunk_size}",
                source=manifest.source,
            )
        self.actions_per_chunk = actions_per_chunk
        sessions = manifest.sessions
        self.engine = Engine(EngineConfig(
            listed=frozenset(c.client_uuid for c in entry.clients),
            accept_unknown=entry.accept_unknown_clients,
            max_unknown_clients=entry.max_unknown_clients,
            idle_timeout_s=sessions.idle_timeout_s,
            liveliness_grace_s=sessions.liveliness_grace_s,
            max_message_bytes=codec_limits.max_message_bytes,
            max_batch_size=self.max_batch_size,
        ), entry.scheduler.build(f"server.{entry.model_id}.scheduler"))
        self.executor = Executor(self.app.prefix, runner, actions_per_chunk=actions_per_chunk,
                                 server_id=server_id, horizon=entry.horizon.build(spec.capabilities.refinement_kind),
                                 limits=codec_limits)
        self.status = Status(
            model_id=entry.model_id,
            model_version=entry.model_version,
            expected_cameras=dict(spec.cameras),
            action_dim=spec.action_dim,
            max_actions_per_chunk=actions_per_chunk,
            observation_features=spec.observation_features(),
            policy_type=spec.policy_type,
            fps=entry.fps,
            server_id=server_id,
            state_dim=spec.state_dim,
            action_names=tuple(spec.action_names),
            accepts_unknown_clients=entry.accept_unknown_clients,
            **spec.status_fields(),
            # Real-time chunking: observations may carry a prefix and a delay (docs/protocol.md §5.1).
            rtc=(RtcAdvert(entry.rtc.execution_horizon if entry.rtc.enabled else None) if spec.capabilities.rtc
                 else None),
            same_host=same_host,  # clients on this host and user send raw frames through /dev/shm
            refreshes=True,  # the engine keeps a refresh's place and drops a late one (protocol.md §10.7)
            streams_text=True if text_stream.writes_text(runner) else None,  # System 2 from the same prefill
        )
        self.status_bytes = codec.encode(self.status)
        self.publishers: dict[str, Publisher] = {}  # client id -> action publisher, closed with its session
        self.actions_dropped_closed = 0  # chunks dropped by publishers of sessions since closed
        # A query naming a client (`status?client=<id>`) learns whether this model serves it.
        self._status_for = {admitted: codec.encode(replace(self.status, client_admitted=admitted))
                            for admitted in (True, False)}
        self.role: ServingRole | None = None  # set at start(): primary or hot standby
        self.standby_dropped = 0  # observations not admitted while standing by
        self.inferences = 0
        # What the model answers, on which topic (the runner's declared output, never probed).
        self.output = spec.capabilities.output
        self.topic = ANSWER_TOPICS[self.output]
        self.answers: Counter = Counter()  # answers published: "actions", "text", "verdict.<label>"
        self.answers_withheld = 0  # results the runner marked silent (fault injection)
        # Multi-model tasks (`entry.pipeline`, server/routing.py); None: a model of robots alone, which
        # never goes through task routing. Set (once) by a reload that gives it task streams.
        self.routing: TaskRouting | None = TaskRouting(task_streams(manifest, entry)) if entry.pipeline else None
        # The subscriptions (observations, client tokens) of its own app (None) and of each task stream.
        self.subscriptions: dict[str | None, list] = {}
        self.dispatcher = None  # server/dispatch.py Dispatcher, set at start() when the entry lists engines
        self.loop_faults = 0  # faults in its serving turn (logged with their traceback)
        self.faults_in_a_row = 0
        self.failed: str | None = None  # why it is no longer served (`PolicyServer._withdraw`)

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def streams(self) -> dict:
        """The task streams it serves (task -> `routing.TaskStream`; empty without task routing)."""
        return self.routing.streams if self.routing is not None else {}

    @property
    def for_other_components(self) -> int:
        """Task-stream observations that asked another component (dropped unread, or once decoded)."""
        return self.routing.for_other_components if self.routing is not None else 0

    def status_reply(self, parameters: dict[str, str]) -> bytes:
        """The status bytes for a query; with `client=<id>`, `client_admitted` says if it is served."""
        client = parameters.get("client")
        if not client:
            return self.status_bytes
        config = self.engine.config
        return self._status_for[config.accept_unknown or client in config.listed]


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
        # Observation key -> client id, for keys that parsed as client observation keys: parsing
        # (split, AppKey, chunk validation) cost 12 us per sample, a dict hit 0.1 us (docs/benchmarks.md,
        # "Server ingest"). Bounded: emptied when it reaches MAX_CACHED_KEYS (a client per key).
        self._client_of_key: dict[str, str] = {}
        self._stop = threading.Event()
        self._session: ZenohSession | None = None
        self._thread: threading.Thread | None = None
        self._telemetry: list[TelemetryPublisher] = []
        self.started = threading.Event()
        self._reload_lock = threading.Lock()
        # Same-host frames live in this host's /dev/shm: a model whose requests may run on another
        # host's engine is offered JPEG only.
        self._probe = (same_host.Probe() if manifest.same_host and manifest.role == "server"
                       and not any(e.engines for e in manifest.server) else None)
        self._worker: EngineWorker | None = None  # role: engine (server/engine_worker.py)
        self._tokens: dict[str, object] = {}  # app prefix -> this server's liveliness token for it
        # Set when no model is served any more (every one withdrawn after faults): the console
        # script exits non-zero instead of leaving a process that serves nothing.
        self.failed = threading.Event()
        self._publishers_lock = threading.Lock()  # the local engine's thread publishes too

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
            if why is None:
                # New task streams are subscribed before any client is listed, so a robot that the
                # status query says is served is heard on its stream; none applied if one fails.
                streams = [task_streams(manifest, entry) for entry in manifest.server]
                opened: list[tuple[ServedModel, str, list]] = []
                try:
                    for model, new in zip(self.models, streams, strict=True):
                        # New streams, and those whose components (bits) changed: their keys did.
                        for task in sorted(t for t in new if t not in model.streams
                                           or model.streams[t].bits != new[t].bits):
                            opened.append((model, task, []))
                            self._subscribe(model, new[task], task, opened[-1][2])
                except TransportError as exc:
                    for *_, subscriptions in opened:
                        for sub in subscriptions:
                            sub.close()
                    why = f"a task stream could not be subscribed: {exc}"
            if why is not None:
                log.error("manifest reload refused: %s (only clients, max_batch_size and pipeline are reloaded; "
                          "restart the server for the rest); the running manifest stays in force", why)
                return why
            for model, task, subscriptions in opened:
                for sub in model.subscriptions.pop(task, []):  # a stream whose bits changed: its old keys
                    sub.close()
                model.subscriptions[task] = subscriptions
            for model, entry, new in zip(self.models, manifest.server, streams, strict=True):
                before_streams, unheard = {}, set()
                if model.routing is not None:
                    before_streams, unheard = model.routing.update(new)
                elif new:
                    model.routing = TaskRouting(new)  # (until now its new streams' observations were dropped)
                for task in before_streams.keys() - new.keys():
                    for sub in model.subscriptions.pop(task, []):
                        sub.close()
                cap = model.runner.spec.capabilities.max_batch
                batch = entry.max_batch_size if entry.max_batch_size != "auto" else model.max_batch_size
                before = model.engine.config.listed
                listed = frozenset(c.client_uuid for c in entry.clients)
                model.entry, model.max_batch_size = entry, batch if cap is None else min(batch, cap)
                closed = model.engine.update_clients(listed, model.max_batch_size, close=unheard)
                log.info("%s: clients reloaded: +%s -%s (sessions closed: %s), max_batch_size %d%s", model.app.prefix,
                         sorted(listed - before) or "none", sorted(before - listed) or "none", closed or "none",
                         model.max_batch_size, stream_changes(before_streams, new))
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
        self._session = ZenohSession(self.manifest.zenoh_settings()).open()
        for entry in self.manifest.server:
            if entry.model_id not in self._injected:
                log.info("loading %s/%s ...", entry.model_id, entry.model_version)  # progress: seconds for a big model
            runner = self._injected.get(entry.model_id) or load_runner(self.manifest, entry)
            log.info("warming up %s/%s (%s) ...", entry.model_id, entry.model_version, runner.spec.policy_type)
            t0 = time.perf_counter()
            runner.warmup()  # before anything is announced: a client never waits for a cold model
            log.info("pre-warmed %s/%s (%s) in %.0f ms", entry.model_id, entry.model_version,
                     runner.spec.policy_type, (time.perf_counter() - t0) * 1000)
            profile_s = self._profile(entry, runner) if entry.max_batch_size == "auto" else None
            if profile_s is None and any(e.local and e.profile == "measured" for e in entry.engines):
                profile_s = self._profile(entry, runner, force=True)
            self.models.append(ServedModel(self.manifest, entry, runner, self.server_id, profile_s, self._limits,
                                           same_host=advert))

        for model in self.models:
            if model.entry.engines:
                from lerobot_zenoh.server.dispatch import Dispatcher  # (imports this module)

                model.dispatcher = Dispatcher(self, model, self._session)  # (this server is its DispatchHost)
                try:
                    model.dispatcher.start()  # every remote engine reachable, loading this model
                except BaseException:
                    model.dispatcher.stop(1.0)
                    self._session.close()
                    raise
        for model in self.models:
            model.role = ServingRole(f"{self.server_id}:{model.app.prefix}", self.manifest.standby_for,
                                     on_deactivate=model.engine.drop_slots)
            # Its own app's observations (a plain robot client routed here) and, for a component of
            # multi-model tasks, each task's observation stream.
            self._subscribe(model, model.app, None, model.subscriptions.setdefault(None, []))
            for task, stream in model.streams.items():
                self._subscribe(model, stream, task, model.subscriptions.setdefault(task, []))
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._thread.start()
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
        self.started.set()
        return self

    def _subscribe(self, model: ServedModel, source: AppKey | TaskStream, task: str | None, into: list) -> None:
        """Subscribe `model` to the observations of `source` (its own app, or the stream of `task`) and
        to the liveliness tokens of the clients there; each subscription is appended to `into`.

        On a task stream it subscribes to the observations whose key names one of the components it
        serves there (`AppKey.component_observations`: a router sends it no other), and to those
        whose key names none (a client that sends the mask in the header only, protocol.md §2.2)."""
        bits = source.bits if isinstance(source, TaskStream) else ()
        app = source.key if isinstance(source, TaskStream) else source

        if task is None:
            def on_observation(key, payload, attachment, m=model):
                self._on_observation(m, key, payload, attachment)
        else:
            def on_observation(key, payload, attachment, m=model, t=task):
                self._on_task_observation(m, t, key, payload, attachment)

        def subscribe(selector: str, callback) -> None:
            # copy=False: kept in Zenoh's buffer, copied once when decoded, never if superseded
            into.append(self._session.subscribe(selector, callback, with_attachment=True, copy=False))

        subscribe(app.all_observations, on_observation)
        for i, bit in enumerate(bits):
            # An observation that asks two of its components matches two subscriptions: the first serves it.
            def on_component(key, payload, attachment, earlier=bits[:i]):
                if not names_components(key, earlier):
                    on_observation(key, payload, attachment)

            subscribe(app.component_observations(bit), on_component)
        # Each client declares a token on its metrics key: its session closes when the token goes.
        into.append(self._session.watch_liveliness(
            app.all_client_tokens, lambda key, alive, m=model: self._on_client_token(m, key, alive)))

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
        for model in self.models:
            if model.role is not None:
                model.role.close()
        self._stop.set()
        self._wake.set()
        stuck = False
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            stuck = self._thread.is_alive()
            if stuck:
                log.warning("inference thread did not finish within %.1f s", timeout_s)
        for model in self.models:
            if model.dispatcher is not None and not model.dispatcher.stop(timeout_s):
                stuck = True  # the local engine's thread may still be inside the runner
        for model in self.models:
            if not stuck:  # (a stuck inference thread may still be inside the runner)
                for session in model.engine.close_all():
                    self._forget(model, session)  # (logs each session's counts)
                model.executor.close()
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
            primary = model.app.server_token(role.standby_for)
            self._session.watch_liveliness(primary, lambda key, alive, r=role: r.on_primary(alive))
            if not self._session.alive(primary, timeout_s=0.5):
                role.on_primary(False)  # no primary at all: serve until one appears
        else:
            others = [k for k in self._session.alive(model.app.all_servers, timeout_s=0.3)
                      if k != model.app.server_token(self.server_id)]
            role.start_primary(bool(others), self.manifest.handover_grace_s)

    # -- Zenoh callbacks: hand over only ------------------------------------------------------

    def _on_observation(self, model: ServedModel, key: str, payload: Payload | bytes,
                        attachment: bytes | None = None) -> None:
        """An observation on the model's own app: its header read once, then admitted."""
        client_id = self._client_of(model, key)
        if client_id is not None:
            self._admit(model, client_id, payload, *admission.read_header(attachment))

    def _on_task_observation(self, model: ServedModel, task: str, key: str, payload: Payload | bytes,
                             attachment: bytes | None = None) -> None:
        """An observation on a multi-model task's stream: admitted when the task routing says it asks this model."""
        client_id = self._client_of(model, key)
        if client_id is None:
            return
        header, header_error = admission.read_header(attachment)
        routing = model.routing
        if routing is None or not routing.accepts(task, client_id, header, header_error):
            return
        if self._admit(model, client_id, payload, header, header_error, task) in (UNKNOWN_CLIENT, TOO_MANY_CLIENTS):
            routing.refused(client_id)

    def _client_of(self, model: ServedModel, key: str) -> str | None:
        """The client whose observation key `key` is; None when it is none, or while standing by."""
        if not model.role.active.is_set():  # a standby drops observations unseen
            model.standby_dropped += 1
            return None
        client_id = self._client_of_key.get(key)
        if client_id is None:
            try:
                _, client_id = parse_client_key(key, Topic.OBS)
            except KeyExprError:
                return None  # the wildcard only matches .../*/obs; a reserved id like "server" ends here
            if len(self._client_of_key) >= MAX_CACHED_KEYS:
                self._client_of_key.clear()
            self._client_of_key[key] = client_id
        return client_id

    def _admit(self, model: ServedModel, client_id: str, payload: Payload | bytes, header, header_error,
               task: str | None = None) -> str | None:
        dropped = model.engine.admit(client_id, payload, time.monotonic(), header, header_error, task)
        if dropped is None:
            self._wake.set()
        elif dropped == UNKNOWN_CLIENT:
            n = model.engine.dropped[UNKNOWN_CLIENT]
            if n in (1, 10, 100, 1000):
                log.warning("rejected observation(s) from unknown client %r on %s (%d so far)",
                            client_id, model.app.prefix, n)
        elif dropped == TOO_MANY_CLIENTS:
            n = model.engine.dropped[TOO_MANY_CLIENTS]
            if worth_logging(n):
                log.warning("dropped observation(s) from %r on %s: %d unknown clients already have a session "
                            "(max_unknown_clients) [%d so far]", client_id, model.app.prefix,
                            model.entry.max_unknown_clients, n)
        return dropped

    def _on_client_token(self, model: ServedModel, key: str, alive: bool) -> None:
        try:
            _, client_id = parse_client_key(key, Topic.METRICS)
        except KeyExprError:
            return
        model.engine.on_token(client_id, alive, time.monotonic())

    # -- inference loop -----------------------------------------------------------------------

    def _run(self) -> None:
        """The inference thread, supervised: a fault in one model's turn is logged with its
        traceback and counted, and after `MAX_FAULTS_IN_A_ROW` in a row that model stops being
        served *visibly* (`_withdraw`); a fault outside any model's turn withdraws them all. A dead
        loop never leaves a server that still looks healthy."""
        try:
            self._loop()
        except BaseException as exc:
            log.critical("the inference loop died: %s: %s", type(exc).__name__, exc, exc_info=True)
            for model in self.models:
                self._withdraw(model, f"inference loop died ({type(exc).__name__})")

    def _loop(self) -> None:
        turn = 0
        next_expiry = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            now = time.monotonic()
            if now >= next_expiry:
                next_expiry = now + EXPIRY_PERIOD_S
                for model in self.models:
                    self._supervised(model, self._expire, model, now)
            served = False
            for model in self.models:
                if model.dispatcher is not None and model.failed is None:  # place, dispatch, relay; never wait
                    served = bool(self._supervised(model, model.dispatcher.round, time.monotonic())) or served
            for i in range(len(self.models)):
                model = self.models[(turn + i) % len(self.models)]
                if model.dispatcher is not None or model.failed is not None:
                    continue
                batch = self._supervised(model, admission.schedule, model, time.monotonic())
                if batch is not None:
                    turn = (turn + i + 1) % len(self.models)
                    self._supervised(model, self._serve, model, batch, served=True, on_fault=lambda m=model, b=batch: m.engine.finish(
                        [], [s.client_id for s, _ in b.items], time.monotonic(), 0.0))
                    served = True
                    break
            if not served and not sum(self._supervised(m, self._advance_text, m) or 0 for m in self.models):
                self._wake.wait(EXPIRY_PERIOD_S)

    def _expire(self, model: ServedModel, now: float) -> None:
        for session in model.engine.expire(now):
            self._forget(model, session)

    def _supervised(self, model: ServedModel, fn, *args, on_fault=None, served: bool = False):
        """`fn(*args)` for one model's turn; a fault is logged, counted and, `MAX_FAULTS_IN_A_ROW`
        with no work done in between (`served`, or `fn` returned something: a batch, a dispatch),
        ends the model's service (`_withdraw`). Returns what `fn` returned (None on a fault)."""
        if model.failed is not None:
            return None
        try:
            out = fn(*args)
        except Exception as exc:
            model.loop_faults += 1
            model.faults_in_a_row += 1
            log.error("%s: serving loop fault %d in a row (%s: %s)", model.app.prefix, model.faults_in_a_row,
                      type(exc).__name__, exc, exc_info=True)
            if on_fault is not None:
                try:
                    on_fault()
                except Exception:
                    log.exception("%s: could not release the batch of the failed turn", model.app.prefix)
            if model.faults_in_a_row >= MAX_FAULTS_IN_A_ROW:
                self._withdraw(model, f"{model.faults_in_a_row} serving loop faults in a row ({type(exc).__name__})")
            return None
        if served or out:
            model.faults_in_a_row = 0
        return out

    def _withdraw(self, model: ServedModel, why: str) -> None:
        """Stop serving a model where everyone can see it: its role never serves again (status
        queries go unanswered, observations are dropped), its liveliness token is undeclared (a hot
        standby takes over), telemetry says `serving: 0` and `failed: 1`. When no model is served
        any more, `failed` is set and the console script exits non-zero."""
        if model.failed is not None:
            return
        model.failed = why
        if model.role is not None:
            model.role.fail()
        token = self._tokens.pop(model.app.prefix, None)
        if token is not None:
            try:
                token.undeclare()
            except Exception as exc:
                log.warning("%s: could not withdraw its liveliness token: %s", model.app.prefix, exc)
        log.critical("%s: no longer served (%s); its liveliness token and status are withdrawn", model.app.prefix, why)
        if all(m.failed is not None for m in self.models):
            self.failed.set()

    def _forget(self, model: ServedModel, session: Session) -> None:
        """A closed session: drop its runner state and its action publisher (inference thread only)."""
        if model.dispatcher is not None:
            model.dispatcher.forget(session.client_id)  # the local runner's state: on its own thread
        else:
            model.runner.forget(session.client_id)
        if model.routing is not None:
            model.routing.forget(session.client_id)
        with self._publishers_lock:
            pub = model.publishers.pop(session.client_id, None)
        if pub is not None:
            model.actions_dropped_closed += pub.dropped
            pub.close()
        st = session.stats
        log.info("%s %s: received %d, superseded %d, served %d, rejected %s (session closed: %s)", model.app.prefix,
                 session.client_id, st.received, st.superseded, st.served, dict(st.rejected) or 0,
                 session.closed_reason)

    def _serve(self, model: ServedModel, batch: Batch) -> None:
        """Admit each picked observation on its own, infer the valid ones together, publish each answer.

        A bad observation is rejected before batching; a batch that fails is served again one request
        at a time, so one bad request costs the others a retry, never their chunk.
        """
        if model.runner.spec.capabilities.iteration_level:
            self._serve_streaming(model, batch)
            return
        t_start = time.monotonic()
        ready = admission.prepare(model, batch, lambda *r: self.reject(model, *r))
        if not batch.items:
            return
        results = model.executor.infer([r.request for r in ready]) if ready else []
        t_done = time.monotonic()
        inference_ms = (t_done - t_start) * 1000
        published: list[tuple[Session, int, float, float]] = []
        for r, result in zip(ready, results, strict=True):
            queue_ms = (t_start - r.slot.arrival_s) * 1000
            if self._answer(model, r, result, inference_ms, queue_ms):
                published.append((r.session, r.observation.seq_id, inference_ms, queue_ms))
        model.engine.finish(published, [r.session.client_id for r in ready], time.monotonic(), t_done - t_start)
        self._advance_text(model)

    def _answer(self, model: ServedModel, r: Ready, result: InferenceResult | Exception, inference_ms: float,
                queue_ms: float) -> bool:
        """Publish the answer to one request (both serving paths); whether it counts as served."""
        session = r.session
        if isinstance(result, ProtocolError):  # shm_stale, decode_limit, undecodable_action_tokens
            self.reject(model, session, result.reason, str(result))
            return False
        if isinstance(result, Exception):  # a failing inference is this client's problem, not the loop's
            self.reject(model, session, Reason.INFERENCE_ERROR, f"{type(result).__name__}: {result}")
            return False
        if model.routing is not None and model.routing.text_only(model.runner, model.output, result):
            return True  # text only: it streams (`_advance_text`)
        if result.silent:  # a fault-injecting runner withholds this answer
            model.answers_withheld += 1
            return False
        try:
            payload = model.executor.answer(r.observation, result, inference_ms, queue_ms)
        except Exception as exc:  # the runner returned something that is not an answer of its kind
            self.reject(model, session, Reason.INFERENCE_ERROR, f"{type(exc).__name__}: {exc}")
            return False
        try:
            self._publisher(model, session.client_id).put(payload)
        except Exception as exc:
            self.reject(model, session, Reason.PUBLISH_ERROR, str(exc))
            return False
        model.inferences += 1
        model.answers[model.output if model.output != OutputKind.VERDICT else f"verdict.{result.label}"] += 1
        return True

    def _advance_text(self, model: ServedModel) -> int:
        """A language runner's text of every robot, one frame's worth (a task's System 2, server/routing.py)."""
        if model.routing is None:
            return 0
        return model.routing.advance_text(model, lambda client_id: self._session.publisher(
            model.app.client(client_id).topic(Topic.TEXT), ACTION_QOS), self.server_id)

    def _serve_streaming(self, model: ServedModel, batch: Batch) -> None:
        """Iteration-level serving (docs/server.md): the picked observations start decoding; between
        decode steps the engine picks the next observations of this model, which join the running
        batch; each answer is published the step its request finishes. Returns when nothing of this
        model is left to decode (or the server stops taking new ones)."""
        in_flight: dict[tuple[str, int], tuple[Ready, float]] = {}

        def prepare(picked: Batch | None) -> list[tuple[tuple[str, int], InferenceRequest]]:
            if picked is None:
                return []
            out = []
            for r in admission.prepare(model, picked, lambda *rej: self.reject(model, *rej)):
                key = (r.session.client_id, r.observation.seq_id)
                if key in in_flight:
                    self.reject(model, r.session, REPLAYED, f"seq_id {key[1]} is being decoded")
                    continue
                in_flight[key] = (r, time.monotonic())
                out.append((key, r.request))
            return out

        started = next_expiry = time.monotonic()

        def join() -> list[tuple[tuple[str, int], InferenceRequest]]:
            nonlocal next_expiry
            now = time.monotonic()
            if now >= next_expiry:  # the loop's chores go on while a decode runs (sessions expire)
                next_expiry = now + EXPIRY_PERIOD_S
                for other in self.models:
                    for session in other.engine.expire(now):
                        self._forget(other, session)
            # Stop taking new requests when stopping, or after a while when other models wait for
            # the inference thread (the running batch then drains and the loop serves them).
            if self._stop.is_set() or (len(self.models) > 1 and now - started > EXPIRY_PERIOD_S):
                return []
            # Fair admission: a robot has at most one request decoding; a free slot goes to the next
            # robot by the scheduler's rank, never to a robot whose request is still decoding.
            return prepare(admission.schedule(model, now, exclude={client for client, _ in in_flight}))

        def emit(key: tuple[str, int], result: InferenceResult | Exception) -> None:
            r, t_start = in_flight.pop(key)
            t_done = time.monotonic()
            inference_ms = (t_done - t_start) * 1000
            queue_ms = (t_start - r.slot.arrival_s) * 1000
            published = []
            if self._answer(model, r, result, inference_ms, queue_ms):
                published.append((r.session, r.observation.seq_id, inference_ms, queue_ms))
            model.engine.finish(published, [r.session.client_id], t_done, t_done - t_start)

        model.executor.stream(prepare(batch), join, emit)

    # -- what the dispatcher asks of this process (`dispatch.DispatchHost`) -----------------------

    def reject(self, model: ServedModel, session: Session, reason: str, detail: str, *, cool_down: bool = True) -> None:
        """Count a rejection against a client; `cool_down=False`: not its fault (an engine's), so it
        never counts towards the client's rejection cool-down."""
        n = model.engine.reject(session, reason, time.monotonic(), cool_down=cool_down)
        if worth_logging(n):
            log.warning("client %s on %s: rejected (%s) %s [%d rejections]", session.client_id, model.app.prefix,
                        reason, detail, n)

    def publish(self, model: ServedModel, client_id: str, payload: bytes) -> None:
        """Put an answer on the client's key of the model's output (raises when the publish fails)."""
        self._publisher(model, client_id).put(payload)

    def wake(self) -> None:
        self._wake.set()

    def serve_batch(self, model: ServedModel, batch: Batch) -> None:
        self._serve(model, batch)

    def measure_profile(self, model: ServedModel) -> dict[int, float]:
        """The local engine's `profile: measured`: the start-up profile, measured now if it was not."""
        if not model.batch_profile_s:
            model.batch_profile_s = self._profile(model.entry, model.runner, force=True) or {}
        return model.batch_profile_s

    def _publisher(self, model: ServedModel, client_id: str) -> Publisher:
        pub = model.publishers.get(client_id)
        if pub is None:
            with self._publishers_lock:
                pub = model.publishers.get(client_id)
                if pub is None:
                    # Chunks, texts and verdicts alike: reliable, never waited for (ACTION_QOS).
                    pub = model.publishers[client_id] = self._session.publisher(
                        model.app.client(client_id).topic(model.topic), ACTION_QOS)
        return pub

    # -- introspection ------------------------------------------------------------------------

    def telemetry_figures(self, model: ServedModel) -> tuple[dict, dict]:
        """(model-level figures, per-client figures) for the Telemetry message (docs/telemetry.md).

        The engine's lock is held only while its counters are copied (`Engine.snapshot`, typed);
        percentiles are computed here.
        """
        snap = model.engine.snapshot()
        publishers = dict(model.publishers)
        per_client: dict[str, dict] = {}
        for cid, s in snap.sessions.items():
            pub = publishers.get(cid)
            per_client[cid] = {
                **_session_figures(s.stats),
                "inference_ms_p50": percentile(s.stats.inference_ms, 50),
                "inference_ms_p99": percentile(s.stats.inference_ms, 99),
                "queue_ms_p50": percentile(s.stats.queue_ms, 50),
                "queue_ms_p99": percentile(s.stats.queue_ms, 99),
                **{f"rejected.{reason}": n for reason, n in s.stats.rejected.items()},
                # which tier computed this robot's chunks (a model with engines)
                **(model.dispatcher.client_figures(cid) if model.dispatcher is not None else {}),
                # chunks a client's stalled link made its publisher drop (transport/session.py QueuedPublisher)
                "actions_dropped": pub.dropped if pub is not None else 0,
            }
        total = snap.total()  # open and closed sessions
        inference_ms = [x for s in snap.sessions.values() for x in s.stats.inference_ms]
        queue_ms = [x for s in snap.sessions.values() for x in s.stats.queue_ms]
        metrics = {
            "clients": len(per_client),
            "sessions_open": len(per_client),
            "sessions_unknown_open": snap.unknown_open,
            "sessions_opened": snap.sessions_opened,
            **{f"sessions_closed.{reason}": n for reason, n in snap.sessions_closed.items()},
            **_session_figures(total),
            # (rejected: also those dropped before any session, unknown_client and too_many_clients)
            "observations_rejected": total.rejected_total + sum(snap.dropped.values()),
            **{f"rejected.{reason}": n for reason, n in snap.dropped.items()},
            **{f"rejected.{reason}": n for reason, n in total.rejected.items()},
            "actions_dropped": model.actions_dropped_closed + sum(p.dropped for p in publishers.values()),
            "inference_ms_p50": percentile(inference_ms, 50),
            "inference_ms_p99": percentile(inference_ms, 99),
            "queue_ms_p50": percentile(queue_ms, 50),
            "queue_ms_p99": percentile(queue_ms, 99),
            "serving": int(model.role is not None and model.role.active.is_set()),
            "failed": int(model.failed is not None),
            "loop_faults": model.loop_faults,
            "takeovers": model.role.takeovers if model.role is not None else 0,
            "standby_dropped": model.standby_dropped,
            "observations_for_other_components": model.for_other_components,
            "answers_withheld": model.answers_withheld,
            **{f"answers.{kind}": n for kind, n in model.answers.items()},
            "batch_size_mean": float(np.mean(snap.batch_sizes)) if snap.batch_sizes else 1.0,
            "batch_fallbacks": model.executor.batch_fallbacks,
            **model.executor.shared_memory_figures,
            **model.runner.figures(),  # the runner's own: language.*, decode.*, vlm.*
            "max_batch_size": model.max_batch_size,
            **{f"batch_profile.{b}_ms": t * 1000 for b, t in model.batch_profile_s.items()},
            **{f"scheduler.{k}": v for k, v in snap.scheduler.items()},
            # per engine: dispatched, answered, offload share, WAN RTT, estimate vs actual, re-queues
            **(model.dispatcher.figures() if model.dispatcher is not None else {}),
            **process_memory(),
        }
        return metrics, per_client

    def stats(self) -> dict:
        """A snapshot of every counter, per model and per open session."""
        out = {}
        for model in self.models:
            snap = model.engine.snapshot()
            closed = snap.closed
            out[model.app.prefix] = {
                "unknown_rejected": snap.unknown_refused,
                "dropped": {k: v for k, v in snap.dropped.items() if k != UNKNOWN_CLIENT},
                "sessions_opened": snap.sessions_opened,
                "sessions_closed": snap.sessions_closed,
                # the counts of sessions since closed; served: every chunk served
                "totals": {"received": closed.received, "superseded": closed.superseded,
                           "refreshes": closed.refreshes, "refreshes_late": closed.refreshes_late,
                           **{f"rejected.{k}": v for k, v in closed.rejected.items()},
                           **{f"dropped.{k}": v for k, v in closed.dropped.items()},
                           "served": snap.total().served},
                "observations_for_other_components": model.for_other_components,
                "answers": dict(model.answers),
                "answers_withheld": model.answers_withheld,
                "clients": {
                    cid: {
                        "received": s.stats.received,
                        "superseded": s.stats.superseded,
                        "served": s.stats.served,
                        "refreshes": s.stats.refreshes,
                        "refreshes_late": s.stats.refreshes_late,
                        "rejected": dict(s.stats.rejected),
                        "dropped": dict(s.stats.dropped),
                        "inference_ms_p50": percentile(s.stats.inference_ms, 50),
                    }
                    for cid, s in snap.sessions.items()
                },
            }
        return out


def _session_figures(st: SessionStats) -> dict[str, int]:
    """The telemetry counters of one session, or of all (docs/telemetry.md)."""
    return {
        "observations_received": st.received,
        "observations_superseded": st.superseded,
        "observations_rejected": st.rejected_total,
        "observations_rate_limited": st.dropped.get(Reason.RATE_LIMITED, 0),
        "inferences": st.served,
        # re-fetch (protocol.md §10.7): refreshes that took their request's slot, and those dropped
        # on arrival because their request no longer waited (never served: no inference spent)
        "observations_refreshes": st.refreshes,
        "refreshes_late": st.refreshes_late,
    }
