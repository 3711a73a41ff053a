"""An engine process (`role: engine`): runs what an edge scheduler dispatches to it, nothing else.

It subscribes ONLY to its own dispatch key ``<app>/engine/<engine_id>/dispatch`` of each model it
loads, never to the robots' observation keys (a WAN would carry every frame of every robot), and
answers each `EngineRequest` on ``<app>/engine/<engine_id>/answer``. The scheduler keeps every
robot's bookkeeping (sessions, generation intervals, wait ratios) and relays the chunk
(docs/server.md, "Engines"). What it holds per client is only the runner's per-episode state,
for at most `MAX_CLIENTS` clients (the oldest is forgotten beyond it).

Threads: Zenoh's callback thread puts each dispatch in a bounded inbox (the oldest dropped when
full: counted, and the scheduler re-queues what it never hears back of); one worker thread per model
takes up to `capacity` requests, runs them in one `RunnerAdapter.infer` pass and publishes the answers;
a responder thread answers status queries (the scheduler's probe of this engine's round trip).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import replace

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec, dispatch
from lerobot_zenoh.protocol.dispatch import EngineAnswer, EngineKeys, EngineRequest, EngineStatus
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.scheduling.batch_profile import saturation_batch_size
from lerobot_zenoh.server.model.batch_profiling import measure_batch_profile
from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter
from lerobot_zenoh.server.config.manifest import Manifest, ModelEntry
from lerobot_zenoh.server.config.runner_loading import load_runner
from lerobot_zenoh.server.runners.base import RTC_EXTRA_DELAY, PolicyRunner
from lerobot_zenoh.transport.session import ACTION_QOS, ZenohSession

log = logging.getLogger(__name__)

#: Clients whose runner state one engine keeps (a remote party can name any id: bounded).
MAX_CLIENTS = 1024
#: Dispatched requests waiting at the engine, per capacity (beyond: the oldest is dropped).
INBOX_PER_CAPACITY = 4


class EngineModel:
    """One manifest entry served as an engine: its runner, runner adapter, inbox and answer publisher."""

    def __init__(self, manifest: Manifest, entry: ModelEntry, runner: PolicyRunner, engine_id: str,
                 incarnation: str, limits: codec.CodecLimits):
        self.entry = entry
        self.runner = runner
        self.keys = EngineKeys(manifest.app_key(entry), engine_id)
        self.incarnation = incarnation
        self.limits = limits
        spec = runner.spec
        cap = spec.capabilities.max_batch
        self.profile_s: dict[int, float] = {}
        wanted = entry.max_batch_size if entry.max_batch_size != "auto" else entry.profile_max_batch
        largest = wanted if cap is None else min(wanted, cap)
        # The profile the scheduler places by (`profile: measured` in its manifest): measured here,
        # on this engine's hardware, at start-up.
        self.profile_s = measure_batch_profile(runner, largest, budget_s=entry.profile_budget_s) or {}
        if entry.max_batch_size == "auto":
            self.capacity = saturation_batch_size(self.profile_s) if self.profile_s else 1
        else:
            self.capacity = largest
        self.adapter = RunnerAdapter(f"engine:{self.keys.token}", runner,
                                 actions_per_chunk=entry.actions_per_chunk or spec.chunk_size,
                                 server_id=engine_id, horizon=entry.horizon.build(spec.capabilities.refinement_kind),
                                 limits=limits)
        self.inbox: deque = deque()  # (arrival_s, payload bytes)
        self.inbox_limit = INBOX_PER_CAPACITY * self.capacity
        self.wake = threading.Event()
        self.clients: OrderedDict[str, None] = OrderedDict()  # runner state held, oldest first
        self.counts: Counter = Counter()  # received, answered, dropped_full, refused.<reason>
        self.status_bytes = dispatch.encode(EngineStatus(
            engine_id=engine_id, incarnation=incarnation, model_id=entry.model_id, model_version=entry.model_version,
            policy_type=spec.policy_type, action_dim=spec.action_dim, chunk_size=spec.chunk_size,
            capacity=self.capacity, profile_ms={b: t * 1000 for b, t in self.profile_s.items()}))
        self.publisher = None

    def on_dispatch(self, key: str, payload: bytes) -> None:
        """Zenoh callback: queue it (no decode, no Zenoh call)."""
        self.counts["received"] += 1
        if len(self.inbox) >= self.inbox_limit:
            self.inbox.popleft()
            self.counts["dropped_full"] += 1
        self.inbox.append((time.monotonic(), payload))
        self.wake.set()


class EngineWorker:
    """The `role: engine` process: construct with the manifest, `start()`, `stop()`."""

    def __init__(self, manifest: Manifest, runners: dict | None = None,
                 codec_limits: codec.CodecLimits = codec.DEFAULT_LIMITS):
        assert manifest.role == "engine" and manifest.engine_id is not None
        self.manifest = manifest
        self.engine_id = manifest.engine_id
        # A new value at every start: the scheduler sees a restarted engine and profiles it again.
        self.incarnation = f"{os.getpid()}-{time.time_ns():x}"
        self._injected = runners or {}
        self._limits = codec_limits
        self.models: list[EngineModel] = []
        self._session: ZenohSession | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def start(self) -> EngineWorker:
        for entry in self.manifest.server:
            runner = self._injected.get(entry.model_id) or load_runner(self.manifest, entry)
            runner.warmup()
            model = EngineModel(self.manifest, entry, runner, self.engine_id, self.incarnation, self._limits)
            log.info("engine %s: %s/%s capacity %d, profile (ms) %s", self.engine_id, entry.model_id,
                     entry.model_version, model.capacity,
                     {b: round(t * 1000, 1) for b, t in model.profile_s.items()})
            self.models.append(model)
        self._session = ZenohSession(self.manifest.zenoh_settings()).open()
        for model in self.models:
            model.publisher = self._session.publisher(model.keys.answer, ACTION_QOS)
            self._session.subscribe(model.keys.dispatch, model.on_dispatch)
            self._session.serve(model.keys.status, lambda m=model: m.status_bytes)
            thread = threading.Thread(target=self._run, args=(model,), name=f"engine:{model.entry.model_id}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
            self._session.declare_token(model.keys.token)
            log.info("engine %s serving %s (dispatch only; no robot keys)", self.engine_id, model.keys.dispatch)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for model in self.models:
            model.wake.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        for model in self.models:
            model.adapter.close()
        if self._session is not None:
            self._session.close()

    def stats(self) -> dict:
        return {m.keys.token: dict(m.counts) for m in self.models}

    # -- worker thread ------------------------------------------------------------------------

    def _run(self, model: EngineModel) -> None:
        while not self._stop.is_set():
            model.wake.clear()
            taken = []
            while model.inbox and len(taken) < model.capacity:
                taken.append(model.inbox.popleft())
            if not taken:
                model.wake.wait(0.25)
                continue
            try:
                self._serve(model, taken)
            except Exception:  # never let one batch end the engine
                log.exception("engine %s: batch failed", self.engine_id)

    def _serve(self, model: EngineModel, taken: list[tuple[float, bytes]]) -> None:
        entry = model.entry
        pending = []  # (request message, observation, arrival): prepared together below
        answers: list[EngineAnswer] = []
        for arrival_s, payload in taken:
            try:
                msg = dispatch.decode(payload, model.limits)
                if not isinstance(msg, EngineRequest):
                    raise ProtocolError(Reason.WRONG_TYPE, f"{type(msg).__name__} on a dispatch key")
            except ProtocolError as exc:
                model.counts[f"refused.{exc.reason}"] += 1
                continue  # no request id to answer: the scheduler re-queues it after its bound
            error = None
            if (msg.model_id, msg.model_version) != (entry.model_id, entry.model_version):
                error = (Reason.WRONG_MODEL, f"this engine loads {entry.model_id}/{entry.model_version}, "
                                        f"asked for {msg.model_id}/{msg.model_version}")
            else:
                try:
                    obs = model.adapter.decode(msg.observation)
                    if msg.reset or msg.client_id not in model.clients:
                        model.runner.forget(msg.client_id)
                    self._remember(model, msg.client_id)
                    pending.append((msg, obs, arrival_s))
                except ProtocolError as exc:
                    error = (exc.reason, str(exc))
            if error is not None:
                model.counts[f"refused.{error[0]}"] += 1
                answers.append(self._answer(model, msg, error=error[0], detail=error[1]))
        ready = []  # (request message, inference request, arrival)
        prepared = model.adapter.prepare_batch([(msg.client_id, obs, None) for msg, obs, _ in pending])
        for (msg, _, arrival_s), request in zip(pending, prepared, strict=True):
            if isinstance(request, ProtocolError):
                model.counts[f"refused.{request.reason}"] += 1
                answers.append(self._answer(model, msg, error=request.reason, detail=str(request)))
            else:
                ready.append((msg, replace(request, seed=msg.seed), arrival_s))
        if ready:
            t0 = time.monotonic()
            results = model.adapter.infer([r for _, r, _ in ready])
            inference_ms = (time.monotonic() - t0) * 1000
            for (msg, _, arrival_s), result in zip(ready, results, strict=True):
                queue_ms = (t0 - arrival_s) * 1000
                if isinstance(result, Exception):
                    reason = result.reason if isinstance(result, ProtocolError) else Reason.INFERENCE_ERROR
                    answers.append(self._answer(model, msg, error=reason, detail=f"{type(result).__name__}: {result}",
                                                inference_ms=inference_ms, queue_ms=queue_ms, batch=len(ready)))
                    continue
                delay = result.extras.get(RTC_EXTRA_DELAY)
                answers.append(self._answer(model, msg, actions=result.actions, updates=result.refinement_updates,
                                            rtc_delay=None if delay is None else int(delay),
                                            inference_ms=inference_ms, queue_ms=queue_ms, batch=len(ready)))
        for answer in answers:
            try:
                model.publisher.put(dispatch.encode(answer))
                model.counts["answered" if answer.error is None else "answered_error"] += 1
            except Exception as exc:  # the scheduler re-queues what it never hears back of
                model.counts[Reason.PUBLISH_ERROR] += 1
                log.warning("engine %s: could not answer request %d: %s", self.engine_id, answer.request_id, exc)

    def _answer(self, model: EngineModel, msg: EngineRequest, *, actions=None, updates=None, rtc_delay=None,
                inference_ms=0.0, queue_ms=0.0, batch=1, error=None, detail="") -> EngineAnswer:
        entry = model.entry
        return EngineAnswer(request_id=msg.request_id, engine_id=self.engine_id, incarnation=self.incarnation,
                            model_id=entry.model_id, model_version=entry.model_version,
                            edge_incarnation=msg.edge_incarnation, client_id=msg.client_id, seq_id=msg.seq_id,
                            session_nonce=msg.session_nonce, actions=actions,
                            refinement_updates=updates, rtc_delay_steps=rtc_delay, inference_ms=inference_ms,
                            queue_ms=queue_ms, batch_size=batch, error=error, detail=detail)

    @staticmethod
    def _remember(model: EngineModel, client_id: str) -> None:
        model.clients[client_id] = None
        model.clients.move_to_end(client_id)
        while len(model.clients) > MAX_CLIENTS:
            old, _ = model.clients.popitem(last=False)
            model.runner.forget(old)
