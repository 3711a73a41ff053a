"""The policy server: pre-warmed models, newest-only slots per client, one inference loop.

Threads:
- Zenoh's callback thread runs `_on_observation`: parse the key, check the client is admitted, put
  the raw bytes in that client's slot (replacing, and counting, an unserved older one), wake the
  loop. Nothing is decoded there.
- One inference thread (`_run`): decode each new observation once (the scheduler needs its
  `ExecutionInfo`), ask each served model's scheduler whom to serve (up to `max_batch_size` clients),
  check and infer them in one forward pass, publish each chunk reliably on its client's action key.
- A responder thread per model answers status queries (transport/session.py).

A bad observation or a failed inference is counted against its client and the loop moves on:
one client can cost the others at most one inference (a failed batch is re-run one request at a time).
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from lerobot_zenoh.errors import ConfigError, KeyExprError, PolicyError, ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey, Topic, parse_client_key
from lerobot_zenoh.protocol.messages import ActionChunk, Observation, Status
from lerobot_zenoh.scheduling.batch_profile import saturation_batch_size
from lerobot_zenoh.scheduling.horizon import HorizonPolicy
from lerobot_zenoh.scheduling.request_schedulers import RequestScheduler
from lerobot_zenoh.server.failover import ServingRole
from lerobot_zenoh.server.manifest import Manifest, ModelEntry
from lerobot_zenoh.server.batch_profiling import can_batch, measure_batch_profile
from lerobot_zenoh.server.policies import InferenceInfo, InferenceRequest
from lerobot_zenoh.server.rate_limit import RejectionRateLimit
from lerobot_zenoh.telemetry.publisher import TelemetryPublisher, percentile, process_memory
from lerobot_zenoh.transport.session import ACTION_QOS, Publisher, ZenohSession

log = logging.getLogger(__name__)

#: How many distinct unknown client ids are tracked for rejection counts (hostile peers can invent many).
MAX_TRACKED_UNKNOWN = 256


@dataclass
class ClientStats:
    received: int = 0
    superseded: int = 0
    served: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    inference_ms: deque = field(default_factory=lambda: deque(maxlen=256))
    queue_ms: deque = field(default_factory=lambda: deque(maxlen=256))
    last_seq_id: int | None = None


@dataclass
class _Slot:
    payload: bytes
    arrival_s: float
    announced: bool = False
    # Set by the inference thread when it first sees the slot (`_take`), outside the lock.
    observation: Observation | None = None
    error: ProtocolError | None = None


@dataclass
class _Work:
    """What `_take` hands to `_serve`: the clients picked for one forward pass, and the slots whose
    observation could not be decoded (rejected without taking a seat in the batch)."""

    model: ServedModel
    batch: list[tuple[str, _Slot]]
    undecodable: list[tuple[str, _Slot]]


class ServedModel:
    """One manifest entry: its runner, scheduler, client slots, publishers and counters."""

    def __init__(self, manifest: Manifest, entry: ModelEntry, runner, server_id: str,
                 batch_profile_s: dict[int, float] | None = None):
        self.entry = entry
        self.app: AppKey = manifest.app_key(entry)
        self.runner = runner
        self.scheduler: RequestScheduler = entry.scheduler.build(f"server.{entry.model_id}.scheduler")
        # Runners without `infer_batch` serve one client per call whatever the manifest says.
        # `max_batch_size: auto`: the saturation point of the profile measured at start-up
        # (`batch_profile_s`, {batch size: seconds per pass}); 1 without a profile.
        self.batch_profile_s = dict(batch_profile_s or {})
        if entry.max_batch_size == "auto":
            wanted = saturation_batch_size(self.batch_profile_s) if self.batch_profile_s else 1
        else:
            wanted = entry.max_batch_size
        self.max_batch_size = wanted if can_batch(runner) else 1
        if self.max_batch_size < wanted:
            log.warning("%s: runner %s cannot batch; max_batch_size %d -> 1", entry.model_id,
                        type(runner).__name__, wanted)
        self.batch_sizes: deque = deque(maxlen=256)  # requests per forward pass, recent ones
        self.batch_fallbacks = 0  # batches that failed and were served one request at a time
        spec = runner.spec
        self.actions_per_chunk = entry.actions_per_chunk or spec.chunk_size
        if self.actions_per_chunk > spec.chunk_size:
            raise ConfigError(
                f"server[{entry.model_id}].actions_per_chunk",
                f"{self.actions_per_chunk} is more than the model's chunk size {spec.chunk_size}",
                source=manifest.source,
            )
        # Execution horizon sent with each chunk (None: not sent). Updates are captured only when the
        # policy reads them and the runner can report them (`infer_with_info`, and for a batch
        # `infer_batch_with_info` if it has one); otherwise the policy gets none (diffusion_confidence
        # then vouches for the whole chunk).
        self.horizon: HorizonPolicy | None = entry.horizon.build()
        self.capture_updates = bool(getattr(self.horizon, "needs_updates", False)) and callable(
            getattr(runner, "infer_with_info", None))
        if self.horizon is not None and getattr(self.horizon, "needs_updates", False) and not self.capture_updates:
            log.warning("%s: runner %s exposes no denoising updates; horizon %s will send the whole chunk",
                        entry.model_id, type(runner).__name__, self.horizon.name)
        self.allowed: frozenset[str] | None = (
            None if entry.accept_unknown_clients else frozenset(c.client_uuid for c in entry.clients)
        )
        self.status = Status(
            model_id=entry.model_id,
            model_version=entry.model_version,
            expected_cameras=dict(spec.cameras),
            action_dim=spec.action_dim,
            max_actions_per_chunk=self.actions_per_chunk,
            observation_features=spec.observation_features(),
            policy_type=spec.policy_type,
            fps=entry.fps,
            server_id=server_id,
            state_dim=spec.state_dim,
            action_names=tuple(spec.action_names),
            accepts_unknown_clients=entry.accept_unknown_clients,
        )
        self.status_bytes = codec.encode(self.status)
        # A query naming a client (`status?client=<id>`) learns whether this model serves it.
        self._status_for = {admitted: codec.encode(replace(self.status, client_admitted=admitted))
                            for admitted in (True, False)}
        self.slots: dict[str, _Slot] = {}
        self.clients: dict[str, ClientStats] = {}
        self.unknown_rejected: Counter = Counter()  # client id -> count, bounded
        self.unknown_rejected_total = 0
        self.publishers: dict[str, Publisher] = {}
        # Observations dropped in the callback before a client is tracked, by reason (too_many_clients).
        self.dropped: Counter = Counter()
        self.rejection_limit = RejectionRateLimit()
        self.role: ServingRole | None = None  # set at start(): primary or hot standby
        self.standby_dropped = 0  # observations not admitted while standing by

    def status_reply(self, parameters: dict[str, str]) -> bytes:
        """The status bytes for a query; with `client=<id>`, `client_admitted` says if it is served."""
        client = parameters.get("client")
        if not client:
            return self.status_bytes
        return self._status_for[self.allowed is None or client in self.allowed]


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
        self._jpeg_helpers: ThreadPoolExecutor | None = None  # made by the inference thread in `_prepare`
        self.models: list[ServedModel] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._session: ZenohSession | None = None
        self._thread: threading.Thread | None = None
        self._subscriptions: list = []
        self._telemetry: list[TelemetryPublisher] = []
        self.started = threading.Event()
        self.inferences = 0
        self.started_at_s = 0.0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> PolicyServer:
        self.started_at_s = time.monotonic()
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
            self.models.append(ServedModel(self.manifest, entry, runner, self.server_id, profile_s))

        self._session = ZenohSession(self.manifest.zenoh_settings()).open()
        for model in self.models:
            model.role = ServingRole(f"{self.server_id}:{model.app.prefix}", self.manifest.standby_for,
                                     on_deactivate=lambda m=model: self._drop_slots(m))
            self._subscriptions.append(self._session.subscribe(
                model.app.all_observations, lambda key, payload, m=model: self._admit(m, key, payload)))
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._thread.start()
        for model in self.models:
            self._session.serve(model.app.status, lambda params, m=model: m.status_reply(params) if m.role.active.is_set()
                                else None, with_parameters=True)
            self._session.declare_token(model.app.server_token(self.server_id))
            self._start_role(model)
            if self.manifest.telemetry_period_s > 0:
                self._telemetry.append(TelemetryPublisher(
                    self._session, model.app.server_metrics(self.server_id), "server", self.server_id,
                    lambda m=model: self.telemetry_figures(m), self.manifest.telemetry_period_s,
                    labels={"model_id": model.entry.model_id, "policy_type": model.runner.spec.policy_type,
                            "device": model.entry.device}).start())
            log.info("serving %s (status: %s)", model.app.all_observations, model.app.status)
        self.started.set()
        return self

    @staticmethod
    def _profile(entry: ModelEntry, runner) -> dict[int, float] | None:
        """The latency-vs-batch profile for `max_batch_size: auto` (None for a runner that cannot batch)."""
        if not can_batch(runner):
            log.warning("%s: runner %s cannot batch; max_batch_size auto -> 1", entry.model_id,
                        type(runner).__name__)
            return None
        log.info("%s: profiling batch sizes up to %d (at most %.0f s) ...", entry.model_id, entry.profile_max_batch,
                 entry.profile_budget_s)
        profile_s = measure_batch_profile(runner, entry.profile_max_batch, budget_s=entry.profile_budget_s)
        chosen = saturation_batch_size(profile_s) if profile_s else 1
        log.info("batch profile of %s (ms per pass): %s; max_batch_size auto -> %d", entry.model_id,
                 ", ".join(f"{b}: {t * 1000:.1f} ({b / t if t else float('inf'):.1f} req/s)"
                           for b, t in profile_s.items()) or "none", chosen)
        return profile_s

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking observations, finish the inference in flight, undeclare everything."""
        for sub in self._subscriptions:
            sub.close()
        self._subscriptions.clear()
        for pub in self._telemetry:
            pub.close()
        for model in self.models:
            if model.role is not None:
                model.role.close()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.warning("inference thread did not finish within %.1f s", timeout_s)
        if self._session is not None:
            self._session.close()
        if self._jpeg_helpers is not None and not (self._thread is not None and self._thread.is_alive()):
            self._jpeg_helpers.shutdown(wait=False)  # (a stuck inference thread may still need it)
        for model in self.models:
            for cid, st in model.clients.items():
                log.info("%s %s: received %d, superseded %d, served %d, rejected %s", model.app.prefix, cid,
                         st.received, st.superseded, st.served, dict(st.rejected) or 0)

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

    def _admit(self, model: ServedModel, key: str, payload: bytes) -> None:
        """Zenoh callback: a server that is not serving (standby) drops observations unseen."""
        if model.role.active.is_set():
            self._on_observation(model, key, payload)
        else:
            model.standby_dropped += 1

    def _drop_slots(self, model: ServedModel) -> None:
        with self._lock:
            model.slots.clear()

    # -- Zenoh callback: hand over only -------------------------------------------------------

    def _on_observation(self, model: ServedModel, key: str, payload: bytes) -> None:
        try:
            _, client_id = parse_client_key(key, Topic.OBS)
        except KeyExprError:
            return  # the wildcard only matches .../*/obs; a reserved id like "server" ends here
        now = time.monotonic()
        with self._lock:
            if model.allowed is not None and client_id not in model.allowed:
                model.unknown_rejected_total += 1
                if client_id in model.unknown_rejected or len(model.unknown_rejected) < MAX_TRACKED_UNKNOWN:
                    model.unknown_rejected[client_id] += 1
                if model.unknown_rejected_total in (1, 10, 100, 1000):
                    log.warning("rejected observation(s) from unknown client %r on %s (%d so far)",
                                client_id, model.app.prefix, model.unknown_rejected_total)
                return
            stats = model.clients.get(client_id)
            if stats is None:
                if len(model.clients) >= model.entry.max_clients:
                    self._drop_untracked(model, client_id, "too_many_clients")
                    return
                stats = model.clients[client_id] = ClientStats()
            if model.rejection_limit.blocked(client_id, now):
                stats.rejected["rate_limited"] += 1  # not a rejection for the limiter: the cool-down ends on time
                return
            if len(payload) > self._limits.max_message_bytes:  # before it takes a slot; the codec checks again
                self._count_rejection(model, client_id, stats, "too_large", now)
                return
            stats.received += 1
            if client_id in model.slots:
                stats.superseded += 1
            model.slots[client_id] = _Slot(payload, now)
        self._wake.set()

    # -- inference loop -----------------------------------------------------------------------

    def _run(self) -> None:
        turn = 0
        while not self._stop.is_set():
            self._wake.clear()
            work = None
            for i in range(len(self.models)):
                model = self.models[(turn + i) % len(self.models)]
                work = self._take(model)
                if work is not None:
                    turn = (turn + i + 1) % len(self.models)
                    break
            if work is None:
                self._wake.wait(0.1)
                continue
            self._serve(work)

    def _take(self, model: ServedModel) -> _Work | None:
        """Announce new observations to the scheduler, then let it pick up to `max_batch_size` clients.

        Observations are decoded only when about to be served (`_serve`), so one superseded in its
        slot costs nothing, except for schedulers that rank by the robot's execution phase
        (`needs_execution_info`, e.g. wait_ratio): those get each slot decoded once, outside the
        lock, when the loop first sees it, and `_serve` reuses the message. JPEG decoding always
        waits until the client is picked.
        """
        with self._lock:
            if not model.slots:
                return None
            fresh = [(cid, slot) for cid, slot in model.slots.items() if not slot.announced]
            for _, slot in fresh:
                slot.announced = True
        if getattr(model.scheduler, "needs_execution_info", False):
            for _, slot in fresh:
                try:
                    slot.observation = codec.decode_observation(slot.payload, self._limits)
                except ProtocolError as exc:
                    slot.error = exc
        now = time.monotonic()
        undecodable: list[tuple[str, _Slot]] = []
        with self._lock:
            for cid, slot in fresh:
                if slot.error is None:
                    execution = slot.observation.execution if slot.observation is not None else None
                    model.scheduler.on_arrival(cid, slot.arrival_s, execution)
                elif model.slots.get(cid) is slot:
                    undecodable.append((cid, model.slots.pop(cid)))
            ready = [cid for cid, slot in model.slots.items() if slot.announced]
            chosen = model.scheduler.pick(ready, now, model.max_batch_size) if ready else []
            batch = [(cid, model.slots.pop(cid)) for cid in dict.fromkeys(chosen) if cid in model.slots]
        if not batch and not undecodable:
            return None
        return _Work(model, batch, undecodable)

    def _serve(self, work: _Work) -> None:
        """Check each picked observation on its own, infer the valid ones together, publish each chunk.

        A bad observation is rejected before batching; a batch that fails is served again one request
        at a time (`_infer`), so one bad request costs the others a retry, never their chunk.
        """
        model = work.model
        for client_id, slot in work.undecodable:
            self._reject(model, client_id, slot.error.reason, str(slot.error))
        if not work.batch:
            return
        t_start = time.monotonic()
        requests: list[tuple[_Slot, InferenceRequest]] = []
        for client_id, slot in work.batch:
            try:
                obs = slot.observation
                if obs is None:
                    obs = slot.observation = codec.decode_observation(slot.payload, self._limits)
                state, images = self._prepare(model, client_id, obs)
            except ProtocolError as exc:
                self._reject(model, client_id, exc.reason, str(exc))
                continue
            seed = (zlib.crc32(client_id.encode()) << 32) ^ (obs.seq_id & 0xFFFFFFFF)
            requests.append((slot, InferenceRequest(client_id, state, images, obs.task, seed)))
        results = self._infer(model, [r for _, r in requests])
        t_done = time.monotonic()
        with self._lock:
            model.scheduler.on_served([cid for cid, _ in work.batch], t_done, t_done - t_start)
            if requests:
                model.batch_sizes.append(len(requests))
        inference_ms = (t_done - t_start) * 1000
        for (slot, request), result in zip(requests, results, strict=True):
            if isinstance(result, Exception):  # a failing inference is this client's problem, not the loop's
                self._reject(model, request.client_id, "inference_error", f"{type(result).__name__}: {result}")
                continue
            self._publish(model, request.client_id, slot, result, inference_ms, (t_start - slot.arrival_s) * 1000)

    def _infer(self, model: ServedModel, requests: list[InferenceRequest]) -> list[np.ndarray | InferenceInfo | Exception]:
        """One result per request: its chunk (with its denoising updates when the horizon policy needs
        them), or the exception its inference raised.

        Several requests go through the runner's batch call (`infer_batch`, or `infer_batch_with_info`
        when capturing updates) in one call; if that call fails, each request is run again on its own,
        so that only the bad one fails. A runner that captures updates but has no
        `infer_batch_with_info` is served one request at a time (`infer_with_info`).
        """
        def one_by_one(infer) -> list[np.ndarray | InferenceInfo | Exception]:
            out: list[np.ndarray | InferenceInfo | Exception] = []
            for r in requests:
                try:
                    out.append(infer(r.client_id, r.state, r.images, r.task, seed=r.seed))
                except Exception as exc:
                    out.append(exc)
            return out

        if model.capture_updates:
            infer_one, infer_many = model.runner.infer_with_info, getattr(model.runner, "infer_batch_with_info", None)
        else:
            infer_one, infer_many = model.runner.infer, getattr(model.runner, "infer_batch", None)
        if len(requests) > 1 and callable(infer_many):
            try:
                results = list(infer_many(requests))
                if len(results) != len(requests):
                    raise PolicyError(f"{getattr(infer_many, '__name__', 'the batch call')} returned {len(results)} "
                                      f"results for {len(requests)} requests")
                return results
            except Exception as exc:
                model.batch_fallbacks += 1
                if model.batch_fallbacks in (1, 10, 100) or model.batch_fallbacks % 1000 == 0:
                    log.warning("%s: batch of %d failed (%s: %s); serving it one request at a time [%d so far]",
                                model.app.prefix, len(requests), type(exc).__name__, exc, model.batch_fallbacks)
        return one_by_one(infer_one)

    def _publish(self, model: ServedModel, client_id: str, slot: _Slot, result: np.ndarray | InferenceInfo,
                 inference_ms: float, queue_ms: float) -> None:
        obs = slot.observation
        try:
            updates = result.denoise_updates if isinstance(result, InferenceInfo) else None
            actions = result.actions if isinstance(result, InferenceInfo) else result
            actions = np.ascontiguousarray(np.asarray(actions)[: model.actions_per_chunk], dtype=np.float32)
            horizon = None
            if model.horizon is not None:
                sent = updates[:, : len(actions)] if updates is not None else None
                horizon = int(model.horizon.horizon(len(actions), sent))
            chunk = ActionChunk(
                response_to_seq_id=obs.seq_id,
                inference_time_ms=inference_ms,
                actions=actions,
                server_id=self.server_id,
                queue_time_ms=queue_ms,
                execution_horizon=horizon,
            )
        except Exception as exc:  # the runner returned something that is not an array of numbers
            self._reject(model, client_id, "inference_error", f"{type(exc).__name__}: {exc}")
            return
        try:
            self._publisher(model, client_id).put(codec.encode(chunk))
        except Exception as exc:
            self._reject(model, client_id, "publish_error", str(exc))
            return
        self.inferences += 1
        stats = model.clients[client_id]
        with self._lock:
            stats.served += 1
            stats.last_seq_id = obs.seq_id
            stats.inference_ms.append(inference_ms)
            stats.queue_ms.append(queue_ms)

    def _prepare(self, model: ServedModel, client_id: str, obs: Observation) -> tuple[np.ndarray, dict]:
        """Check the observation against the model's features; decode images. ProtocolError if not."""
        spec = model.runner.spec
        if obs.client_uuid != client_id:
            raise ProtocolError("client_mismatch", f"client_uuid {obs.client_uuid!r} published on {client_id!r}'s key")
        if obs.state.shape != (spec.state_dim,):
            raise ProtocolError("wrong_state_dim", f"state has shape {obs.state.shape}, expected ({spec.state_dim},)")
        state = obs.state.astype(np.float32)
        if not np.all(np.isfinite(state)):
            raise ProtocolError("bad_state", "state has NaN or infinite values")
        if set(obs.images) != set(spec.cameras):
            raise ProtocolError("wrong_cameras", f"cameras {sorted(obs.images)}, expected {sorted(spec.cameras)}")
        # The first camera is decoded on this thread and the others at the same time on helper threads:
        # OpenCV releases the GIL while it decodes, so two cameras cost one decode of wall time when a
        # core is free. Only the inference thread calls this, so the lazy creation does not race.
        cameras = list(spec.cameras.items())
        if len(cameras) > 1 and self._jpeg_helpers is None:
            most = max(len(m.runner.spec.cameras) for m in self.models)
            self._jpeg_helpers = ThreadPoolExecutor(max_workers=most - 1, thread_name_prefix="jpeg")
        others = [(name, self._jpeg_helpers.submit(codec.decode_jpeg, obs.images[name], hw, self._limits))
                  for name, hw in cameras[1:]]
        images = {name: codec.decode_jpeg(obs.images[name], hw, self._limits) for name, hw in cameras[:1]}
        for name, decoded in others:
            images[name] = decoded.result()
        return state, images

    def _reject(self, model: ServedModel, client_id: str, reason: str, detail: str) -> None:
        with self._lock:
            stats = model.clients[client_id]
            n = self._count_rejection(model, client_id, stats, reason, time.monotonic())
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("client %s on %s: rejected (%s) %s [%d rejections]", client_id, model.app.prefix, reason, detail, n)

    def _count_rejection(self, model: ServedModel, client_id: str, stats: ClientStats, reason: str, now_s: float) -> int:
        """Count one rejection (caller holds `_lock`); start a cool-down when the client floods. Returns its total."""
        stats.rejected[reason] += 1
        if reason != "publish_error" and model.rejection_limit.on_rejection(client_id, now_s):
            log.warning("client %s on %s: more than %d rejections in %.1f s; dropping its observations for %.1f s",
                        client_id, model.app.prefix, model.rejection_limit.max_rejections,
                        model.rejection_limit.window_s, model.rejection_limit.cooldown_s)
        return sum(stats.rejected.values())

    def _drop_untracked(self, model: ServedModel, client_id: str, reason: str) -> None:
        """Count an observation dropped before its client is tracked (caller holds `_lock`)."""
        model.dropped[reason] += 1
        n = model.dropped[reason]
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("dropped observation(s) from %r on %s: %s (%d so far)", client_id, model.app.prefix, reason, n)

    def _publisher(self, model: ServedModel, client_id: str) -> Publisher:
        pub = model.publishers.get(client_id)
        if pub is None:
            pub = model.publishers[client_id] = self._session.publisher(model.app.client(client_id).action, ACTION_QOS)
        return pub

    # -- introspection ------------------------------------------------------------------------

    def telemetry_figures(self, model: ServedModel) -> tuple[dict, dict]:
        """(model-level figures, per-client figures) for the Telemetry message (docs/telemetry.md)."""
        per_client: dict[str, dict] = {}
        rejected_by_reason: Counter = Counter()
        inference_ms: list[float] = []
        queue_ms: list[float] = []
        with self._lock:
            for cid, s in model.clients.items():
                rejected_by_reason.update(s.rejected)
                inference_ms += s.inference_ms
                queue_ms += s.queue_ms
                per_client[cid] = {
                    "observations_received": s.received,
                    "observations_superseded": s.superseded,
                    "observations_rejected": sum(s.rejected.values()),
                    "inferences": s.served,
                    "inference_ms_p50": percentile(s.inference_ms, 50),
                    "inference_ms_p99": percentile(s.inference_ms, 99),
                    "queue_ms_p50": percentile(s.queue_ms, 50),
                    "queue_ms_p99": percentile(s.queue_ms, 99),
                    **{f"rejected.{reason}": n for reason, n in s.rejected.items()},
                }
            scheduler_stats = model.scheduler.stats()
            batch_sizes = list(model.batch_sizes)
            unknown = model.unknown_rejected_total
            dropped = dict(model.dropped)
        metrics = {
            "clients": len(per_client),
            "observations_received": sum(c["observations_received"] for c in per_client.values()),
            "observations_superseded": sum(c["observations_superseded"] for c in per_client.values()),
            "observations_rejected": sum(rejected_by_reason.values()) + unknown + sum(dropped.values()),
            "rejected.unknown_client": unknown,
            **{f"rejected.{reason}": n for reason, n in dropped.items()},
            **{f"rejected.{reason}": n for reason, n in rejected_by_reason.items()},
            "inferences": sum(c["inferences"] for c in per_client.values()),
            "inference_ms_p50": percentile(inference_ms, 50),
            "inference_ms_p99": percentile(inference_ms, 99),
            "queue_ms_p50": percentile(queue_ms, 50),
            "queue_ms_p99": percentile(queue_ms, 99),
            "serving": int(model.role is not None and model.role.active.is_set()),
            "takeovers": model.role.takeovers if model.role is not None else 0,
            "standby_dropped": model.standby_dropped,
            "batch_size_mean": float(np.mean(batch_sizes)) if batch_sizes else 1.0,
            "max_batch_size": model.max_batch_size,
            **{f"batch_profile.{b}_ms": t * 1000 for b, t in model.batch_profile_s.items()},
            **{f"scheduler.{k}": v for k, v in scheduler_stats.items()},
            **process_memory(),
        }
        return metrics, per_client

    def stats(self) -> dict:
        """A snapshot of every counter, per model and per client (telemetry publishes this)."""
        with self._lock:
            return {
                model.app.prefix: {
                    "unknown_rejected": model.unknown_rejected_total,
                    "dropped": dict(model.dropped),
                    "clients": {
                        cid: {
                            "received": s.received,
                            "superseded": s.superseded,
                            "served": s.served,
                            "rejected": dict(s.rejected),
                            "inference_ms_p50": float(np.percentile(s.inference_ms, 50)) if s.inference_ms else None,
                        }
                        for cid, s in model.clients.items()
                    },
                }
                for model in self.models
            }


def load_runner(manifest: Manifest, entry: ModelEntry):
    """Build the runner an entry asks for. Raises PolicyError/ConfigError naming the entry."""
    if entry.synthetic is not None:
        from lerobot_zenoh.server.synthetic import SyntheticPolicy, SyntheticPolicyConfig

        syn = entry.synthetic
        return SyntheticPolicy(SyntheticPolicyConfig(
            state_names=tuple(f"state_{i}" for i in range(syn.state_dim)),
            cameras={k: tuple(v) for k, v in syn.cameras.items()},
            action_names=tuple(f"action_{i}" for i in range(syn.action_dim)),
            chunk_size=syn.chunk_size,
            fps=entry.fps,
            latency_ms=syn.latency_ms,
            batch_latency_ms=syn.batch_latency_ms,
            confidence_from_state=syn.confidence_from_state,
        ))
    from lerobot_zenoh.server.policies import load_policy_runner

    path = manifest.resolve_path(entry)
    if not path.exists():
        raise PolicyError(f"{manifest.source}: server[{entry.model_id}].pretrained_path: {path} does not exist "
                          "(build one offline with lerobot-zenoh-build-checkpoint)")
    return load_policy_runner(path, entry.device)
