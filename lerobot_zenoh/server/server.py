"""The policy server: pre-warmed models, newest-only slots per client, one inference loop.

Threads:
- Zenoh's callback thread runs `_on_observation`: parse the key, check the client is admitted, put
  the raw bytes in that client's slot (replacing, and counting, an unserved older one), wake the
  loop. Nothing is decoded there.
- One inference thread (`_run`): ask each served model's scheduler whom to serve, decode that
  client's observation, run the policy, publish the chunk reliably on the client's action key.
- A responder thread per model answers status queries (transport/session.py).

A bad observation or a failed inference is counted against its client and the loop moves on:
one client can cost the others at most one inference.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from lerobot_zenoh.errors import ConfigError, KeyExprError, PolicyError, ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey, Topic, parse_client_key
from lerobot_zenoh.protocol.messages import ActionChunk, Observation, Status
from lerobot_zenoh.scheduling.request_schedulers import RequestScheduler, make_scheduler
from lerobot_zenoh.server.manifest import Manifest, ModelEntry
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


class ServedModel:
    """One manifest entry: its runner, scheduler, client slots, publishers and counters."""

    def __init__(self, manifest: Manifest, entry: ModelEntry, runner, server_id: str):
        self.entry = entry
        self.app: AppKey = manifest.app_key(entry)
        self.runner = runner
        self.scheduler: RequestScheduler = make_scheduler(entry.scheduler, f"server.{entry.model_id}.scheduler")
        spec = runner.spec
        self.actions_per_chunk = entry.actions_per_chunk or spec.chunk_size
        if self.actions_per_chunk > spec.chunk_size:
            raise ConfigError(
                f"server[{entry.model_id}].actions_per_chunk",
                f"{self.actions_per_chunk} is more than the model's chunk size {spec.chunk_size}",
                source=manifest.source,
            )
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
        self.slots: dict[str, _Slot] = {}
        self.clients: dict[str, ClientStats] = {}
        self.unknown_rejected: Counter = Counter()  # client id -> count, bounded
        self.unknown_rejected_total = 0
        self.publishers: dict[str, Publisher] = {}


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
            runner = self._injected.get(entry.model_id) or load_runner(self.manifest, entry)
            t0 = time.perf_counter()
            runner.warmup()  # before anything is announced: a client never waits for a cold model
            log.info("pre-warmed %s/%s (%s) in %.0f ms", entry.model_id, entry.model_version,
                     runner.spec.policy_type, (time.perf_counter() - t0) * 1000)
            self.models.append(ServedModel(self.manifest, entry, runner, self.server_id))

        self._session = ZenohSession(self.manifest.zenoh_settings()).open()
        for model in self.models:
            self._subscriptions.append(self._session.subscribe(
                model.app.all_observations, lambda key, payload, m=model: self._on_observation(m, key, payload)))
        self._thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self._thread.start()
        for model in self.models:
            self._session.serve(model.app.status, lambda m=model: m.status_bytes)
            self._session.declare_token(model.app.server_token(self.server_id))
            if self.manifest.telemetry_period_s > 0:
                self._telemetry.append(TelemetryPublisher(
                    self._session, model.app.server_metrics(self.server_id), "server", self.server_id,
                    lambda m=model: self.telemetry_figures(m), self.manifest.telemetry_period_s,
                    labels={"model_id": model.entry.model_id, "policy_type": model.runner.spec.policy_type,
                            "device": model.entry.device}).start())
            log.info("serving %s (status: %s)", model.app.all_observations, model.app.status)
        self.started.set()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking observations, finish the inference in flight, undeclare everything."""
        for sub in self._subscriptions:
            sub.close()
        self._subscriptions.clear()
        for pub in self._telemetry:
            pub.close()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.warning("inference thread did not finish within %.1f s", timeout_s)
        if self._session is not None:
            self._session.close()
        for model in self.models:
            for cid, st in model.clients.items():
                log.info("%s %s: received %d, superseded %d, served %d, rejected %s", model.app.prefix, cid,
                         st.received, st.superseded, st.served, dict(st.rejected) or 0)

    def __enter__(self) -> PolicyServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

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
                    model.unknown_rejected_total += 1
                    return
                stats = model.clients[client_id] = ClientStats()
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
            self._serve(*work)

    def _take(self, model: ServedModel) -> tuple[ServedModel, str, _Slot] | None:
        now = time.monotonic()
        with self._lock:
            if not model.slots:
                return None
            for client_id, slot in model.slots.items():
                if not slot.announced:
                    slot.announced = True
                    model.scheduler.on_arrival(client_id, slot.arrival_s)
            chosen = model.scheduler.pick(list(model.slots), now, 1)
            if not chosen:
                return None
            return model, chosen[0], model.slots.pop(chosen[0])

    def _serve(self, model: ServedModel, client_id: str, slot: _Slot) -> None:
        t_start = time.monotonic()
        stats = model.clients[client_id]
        try:
            obs = codec.decode_observation(slot.payload, self._limits)
            state, images = self._prepare(model, client_id, obs)
            seed = (zlib.crc32(client_id.encode()) << 32) ^ (obs.seq_id & 0xFFFFFFFF)
            actions = model.runner.infer(client_id, state, images, obs.task, seed=seed)
        except ProtocolError as exc:
            self._reject(model, client_id, exc.reason, str(exc))
            return
        except Exception as exc:  # a failing inference is this client's problem, not the loop's
            self._reject(model, client_id, "inference_error", f"{type(exc).__name__}: {exc}")
            return
        finally:
            model.scheduler.on_served([client_id], time.monotonic(), time.monotonic() - t_start)
        inference_ms = (time.monotonic() - t_start) * 1000
        chunk = ActionChunk(
            response_to_seq_id=obs.seq_id,
            inference_time_ms=inference_ms,
            actions=np.ascontiguousarray(actions[: model.actions_per_chunk], dtype=np.float32),
            server_id=self.server_id,
            queue_time_ms=(t_start - slot.arrival_s) * 1000,
        )
        try:
            self._publisher(model, client_id).put(codec.encode(chunk))
        except Exception as exc:
            self._reject(model, client_id, "publish_error", str(exc))
            return
        self.inferences += 1
        with self._lock:
            stats.served += 1
            stats.last_seq_id = obs.seq_id
            stats.inference_ms.append(inference_ms)
            stats.queue_ms.append(chunk.queue_time_ms)

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
        images = {name: codec.decode_jpeg(obs.images[name], hw, self._limits) for name, hw in spec.cameras.items()}
        return state, images

    def _reject(self, model: ServedModel, client_id: str, reason: str, detail: str) -> None:
        with self._lock:
            stats = model.clients[client_id]
            stats.rejected[reason] += 1
            n = sum(stats.rejected.values())
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("client %s on %s: rejected (%s) %s [%d rejections]", client_id, model.app.prefix, reason, detail, n)

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
            unknown = model.unknown_rejected_total
        metrics = {
            "clients": len(per_client),
            "observations_received": sum(c["observations_received"] for c in per_client.values()),
            "observations_superseded": sum(c["observations_superseded"] for c in per_client.values()),
            "observations_rejected": sum(rejected_by_reason.values()) + unknown,
            "rejected.unknown_client": unknown,
            **{f"rejected.{reason}": n for reason, n in rejected_by_reason.items()},
            "inferences": sum(c["inferences"] for c in per_client.values()),
            "inference_ms_p50": percentile(inference_ms, 50),
            "inference_ms_p99": percentile(inference_ms, 99),
            "queue_ms_p50": percentile(queue_ms, 50),
            "queue_ms_p99": percentile(queue_ms, 99),
            "batch_size_mean": 1.0,
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
        ))
    from lerobot_zenoh.server.policies import load_policy_runner

    path = manifest.resolve_path(entry)
    if not path.exists():
        raise PolicyError(f"{manifest.source}: server[{entry.model_id}].pretrained_path: {path} does not exist "
                          "(build one offline with lerobot-zenoh-build-checkpoint)")
    return load_policy_runner(path, entry.device)
