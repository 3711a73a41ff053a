"""The edge scheduler's engines: where each batch it picks runs (docs/server.md, "Engines").

A model with `engines` in its manifest entry is served by one *edge scheduler*: this process keeps
every robot's session, slot and wait-ratio bookkeeping (`server/engine.py`, the request scheduler)
and places each request it picks, with `scheduling.placement.place` (Kairos' rule), on one of
its engines:

- the *local* engine (`local: true`): this process's own runner, run by `LocalWorker`'s thread
  through the server's usual `_serve` (decode, one forward pass, publish);
- remote engines: `lerobot-policy-server` processes started with `role: engine`
  (`server/engine_worker.py`) on this site or at a cloud site behind a Zenoh router. Each gets
  `EngineRequest`s on its own dispatch key and answers on its answer key (`protocol/dispatch.py`);
  the answer comes back by Zenoh callback into `events`, and the inference loop relays the chunk to
  the robot (so the robot's server stays this one; docs/server.md says why).

Nothing here waits on an engine: a dispatch is a queued publish, answers and probes arrive as
events, and the loop (`PolicyServer._run` -> `Dispatcher.round`) only drains them. What a slow,
dead, partitioned, restarted or wrong engine costs:

- no answer within `dispatch.answer_timeout_s`: the request goes back to its session's slot
  (`Engine.requeue`) and is placed again; counted (`requeued`). Its late answer, if one comes, is
  dropped (`late`): a robot never gets two chunks for one request;
- `probes_lost` status probes unanswered in a row, or the engine's liveliness token gone: the
  engine is *down* (`partition`): no request is placed on it from the next round on (edge-only),
  its requests in flight are re-queued at once; the first answered probe brings it back;
- a new `incarnation` in its status (it restarted): its profile is taken again from the status it
  measured at start-up (unless the manifest declares one) and its requests in flight re-queued;
- an answer or a status naming another model or version, or actions of another shape: refused and
  counted, the request re-queued, and the engine left out until its status is right again.

Measured continuously, never configured: each remote engine's round trip (the status probe,
smoothed) and its bandwidth (from each answered request: the dispatch-to-answer time less the
engine's reported queueing and inference time and the probe round trip, against the bytes moved).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.protocol import dispatch
from lerobot_zenoh.protocol.dispatch import EngineAnswer, EngineKeys, EngineRequest, EngineStatus
from lerobot_zenoh.protocol.reasons import OutputKind, Reason
from lerobot_zenoh.scheduling.placement import CLOUD, EDGE, BatchProfile, EngineView, Estimate, RequestView, place, transfer_s
from lerobot_zenoh.server import admission
from lerobot_zenoh.server.engine import Batch, Session, Slot
from lerobot_zenoh.server.executor import request_seed
from lerobot_zenoh.server.manifest import EngineEntry
from lerobot_zenoh.server.runners.base import RTC_EXTRA_DELAY, InferenceResult
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport.session import ACTION_QOS, ZenohSession

if TYPE_CHECKING:
    from lerobot_zenoh.server.server import PolicyServer, ServedModel

log = logging.getLogger(__name__)

#: The round trip is the smallest of the last RTT_WINDOW probes (a probe can only be delayed by a
#: busy host, never sped up: the minimum filters that out; a longer path shows within the window).
RTT_WINDOW = 8
#: The bandwidth is the largest of the last BANDWIDTH_WINDOW samples (same reasoning: noise only
#: adds time, so it only lowers a sample).
BANDWIDTH_WINDOW = 32
#: A network time this much above the probe's round trip is read as transfer time (below: noise).
MIN_TRANSFER_S = 0.002
#: A remote edge engine's next batch is dispatched this long (plus a round trip) before its
#: current batch is expected to end (`Dispatcher._running_for_placement`).
DISPATCH_AHEAD_S = 0.010
#: How often the inference loop refreshes the figures telemetry reads.
FIGURES_PERIOD_S = 0.5
#: Estimate-vs-actual pairs kept per engine for telemetry.
KEPT_SAMPLES = 256

__all__ = ["Dispatcher", "EngineState", "LocalWorker", "InFlight", "EDGE", "CLOUD"]


@dataclass
class InFlight:
    """A request placed on an engine and not answered yet."""

    request_id: int
    engine_id: str
    session: Session
    slot: Slot
    dispatched_s: float
    request_bytes: int
    estimate: Estimate | None
    observation: object = None  # the decoded Observation (remote engines)
    admitted_s: float = 0.0  # when the request reached this scheduler (its slot's first arrival)
    queue_estimate_s: float | None = None  # expected admission -> start of its batch, at placement


@dataclass
class EngineState:
    """One engine as the edge scheduler knows it."""

    entry: EngineEntry
    keys: EngineKeys | None  # None for the local engine
    profile: BatchProfile | None = None
    up: bool = False
    down_reason: str | None = "not probed yet"
    incarnation: str | None = None
    rtt_s: float | None = None
    bandwidth_bps: float = math.inf
    lost_probes: int = 0
    rtt_samples: deque = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))
    bandwidth_samples: deque = field(default_factory=lambda: deque(maxlen=BANDWIDTH_WINDOW))
    busy_until_s: float = 0.0
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    estimates: deque = field(default_factory=lambda: deque(maxlen=KEPT_SAMPLES))  # (estimate s, actual s)
    # Queueing delay, admission -> start of the batch that served it: (expected at placement, actual) s
    queueing: deque = field(default_factory=lambda: deque(maxlen=KEPT_SAMPLES))
    publisher: object = None

    @property
    def engine_id(self) -> str:
        return self.entry.engine_id

    @property
    def tier(self) -> str:
        return self.entry.tier

    def usable(self) -> bool:
        return self.up and self.profile is not None

    def view(self, running: int | None = None) -> EngineView:
        return EngineView(engine_id=self.engine_id, tier=self.tier, capacity=self.entry.capacity,
                          running=len(self.in_flight) if running is None else running, busy_until_s=self.busy_until_s, profile=self.profile,
                          rtt_s=self.rtt_s or 0.0, bandwidth_bps=self.bandwidth_bps,
                          max_in_flight=self.entry.max_in_flight)

    def figures(self, answered_total: int) -> dict:
        """Telemetry of this engine (docs/telemetry.md, "Engines")."""
        pairs = list(self.estimates)
        waits = list(self.queueing)
        answered = self.counts["answered"]
        out = {
            "up": int(self.up),
            "in_flight": len(self.in_flight),  # (remote engines)
            "dispatched": self.counts["dispatched"],
            "answered": answered,
            "requeued": self.counts["requeued"],
            "late": self.counts["late"],
            "refused": sum(v for k, v in self.counts.items() if k.startswith("refused.")),
            "restarts": self.counts["restarts"],
            "partitions": self.counts["partitions"],
            "offload_share": answered / answered_total if answered_total else 0.0,
            "estimate_ms_mean": 1000 * sum(e for e, _ in pairs) / len(pairs) if pairs else 0.0,
            "actual_ms_mean": 1000 * sum(a for _, a in pairs) / len(pairs) if pairs else 0.0,
            "queue_estimate_ms_mean": 1000 * sum(e for e, _ in waits) / len(waits) if waits else 0.0,
            "queue_actual_ms_mean": 1000 * sum(a for _, a in waits) / len(waits) if waits else 0.0,
        }
        if self.keys is not None:
            out["rtt_ms"] = 1000 * self.rtt_s if self.rtt_s is not None else -1.0
            out["bandwidth_mbps"] = self.bandwidth_bps * 8 / 1e6 if math.isfinite(self.bandwidth_bps) else -1.0
        out |= {k: v for k, v in self.counts.items() if k.startswith("refused.")}
        return out


def _admitted_s(slot: Slot) -> float:
    """When the request a slot holds reached the scheduler (a refresh keeps its request's first arrival)."""
    return slot.first_arrival[0] if slot.first_arrival is not None else slot.arrival_s


def _queue_estimate_s(slot: Slot, view: EngineView, now_s: float) -> float:
    """The queueing delay placement expects for a request placed now on `view`'s engine: from its
    admission to the start of its batch there (its wait so far, then the trip out and its bytes'
    transfer, or the engine's current work when that ends later; as `placement.service_estimate_s`)."""
    trip_s = view.rtt_s / 2 + transfer_s(view, len(slot.payload))
    return now_s - _admitted_s(slot) + max(trip_s, view.busy_until_s - now_s)


class LocalWorker:
    """The local engine: a thread that runs the batches placed on it through `PolicyServer._serve`,
    so the scheduler loop keeps placing (and relaying cloud answers) while this process's own
    model computes. It alone calls the runner (forgetting a closed session's state included)."""

    def __init__(self, server: PolicyServer, model: ServedModel, on_done):
        self.server = server
        self.model = model
        self.on_done = on_done
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"local-engine:{model.entry.model_id}", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch, forget: list[str]) -> None:
        self._jobs.put(("batch", batch, forget))

    def forget(self, client_id: str) -> None:
        self._jobs.put(("forget", client_id, None))

    def stop(self, timeout_s: float) -> bool:
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, arg, forget = job
            if kind == "forget":
                self.model.runner.forget(arg)
                continue
            for client_id in forget:
                self.model.runner.forget(client_id)  # a new episode since this engine last served it
            t0 = time.monotonic()
            try:
                self.server._serve(self.model, arg)
            except Exception:  # the loop must hear back whatever happened
                log.exception("%s: local engine batch failed", self.model.app.prefix)
            self.on_done([s.client_id for s, _ in arg.items], t0, time.monotonic())


class Dispatcher:
    """The engines of one model and everything the scheduler loop does with them (`round`)."""

    def __init__(self, server: PolicyServer, model: ServedModel, session: ZenohSession):
        self.server = server
        self.model = model
        self.session = session
        self.settings = model.entry.dispatch
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.engines: dict[str, EngineState] = {}
        for entry in model.entry.engines:
            keys = None if entry.local else EngineKeys(model.app, entry.engine_id)
            state = EngineState(entry, keys)
            if isinstance(entry.profile, dict):
                state.profile = BatchProfile.from_ms(entry.profile)
            self.engines[entry.engine_id] = state
        self.local: EngineState | None = next((e for e in self.engines.values() if e.entry.local), None)
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._probers: list[threading.Thread] = []
        self._worker: LocalWorker | None = None
        self._local_clients: set[str] = set()  # clients whose request the local engine is running
        self._local_batches: deque = deque()  # (clients, dispatched_s, estimates) per batch submitted
        # Per-episode runner state: each engine keeps its own, so a new episode (Engine.take_reset)
        # bumps the client's epoch and each engine drops its state when it next serves the client.
        self._epoch: Counter = Counter()
        self._served_epoch: dict[str, dict[str, int]] = {eid: {} for eid in self.engines}
        self.served_by_client: dict[str, Counter] = {}  # client -> {tier: chunks}, bounded by sessions
        self.counts: Counter = Counter()  # model-wide: requeue_superseded, answers_closed, malformed
        # What telemetry reads (another thread): copies the inference thread refreshes each period.
        self._figures: dict = {}
        self._client_figures: dict[str, dict] = {}
        self._figures_at_s = 0.0

    # -- start / stop -------------------------------------------------------------------------

    def start(self) -> None:
        model = self.model
        if self.local is not None:
            if self.local.profile is None:  # `measured`: this process's own start-up profile
                if not model.batch_profile_s:
                    model.batch_profile_s = self.server._profile(model.entry, model.runner, force=True) or {}
                if not model.batch_profile_s:
                    raise ConfigError(f"server[{model.entry.model_id}].engines[{self.local.engine_id}].profile",
                                      "measured, but this runner could not be profiled; declare {batch size: ms}",
                                      source=self.server.manifest.source)
                self.local.profile = BatchProfile(model.batch_profile_s)
            self.local.up, self.local.down_reason, self.local.rtt_s = True, None, 0.0
            model.executor.served_by = (self.local.engine_id, self.local.tier)
            self._worker = LocalWorker(self.server, model, self._on_local_done)
        remote = [e for e in self.engines.values() if e.keys is not None]
        for state in remote:
            state.publisher = self.session.publisher(state.keys.dispatch, ACTION_QOS)
            self.session.subscribe(state.keys.answer, lambda key, payload, s=state: self._event(
                ("answer", s.engine_id, time.monotonic(), payload)))
            self.session.watch_liveliness(state.keys.token, lambda key, alive, s=state: self._event(
                ("token", s.engine_id, alive)))
        # Start-up: every remote engine answers its status (it is reachable, loads this model) in time.
        deadline = time.monotonic() + self.settings.start_timeout_s
        for state in remote:
            status, rtt = None, None
            while status is None and time.monotonic() < deadline:
                status, rtt = self._probe(state, timeout_s=min(1.0, max(0.05, deadline - time.monotonic())))
                if status is None:
                    time.sleep(0.1)
            where = f"server[{model.entry.model_id}].engines[{state.engine_id}]"
            if status is None:
                raise ConfigError(where, f"engine unreachable: no answer on {state.keys.status} within "
                                  f"{self.settings.start_timeout_s:g} s (start it with role: engine, engine_id: "
                                  f"{state.engine_id}; check endpoint and routers)", source=self.server.manifest.source)
            why = self._status_refusal(status)
            if why is not None:
                raise ConfigError(where, why, source=self.server.manifest.source)
            # The first answer also waited for the route to form: its time is not a round trip.
            again = [self._probe(state, timeout_s=1.0) for _ in range(3)]
            rtts = [r for st, r in again if st is not None]
            self._on_probe(state, min(rtts) if rtts else 1.0, status, time.monotonic())
        for state in remote:
            thread = threading.Thread(target=self._prober, args=(state,), name=f"probe:{state.engine_id}", daemon=True)
            thread.start()
            self._probers.append(thread)

    def stop(self, timeout_s: float = 5.0) -> bool:
        self._stop.set()
        for thread in self._probers:
            thread.join(timeout=timeout_s)
        return self._worker.stop(timeout_s) if self._worker is not None else True

    def forget(self, client_id: str) -> None:
        """A closed session (inference thread): drop what is kept for it; the local runner's state
        is dropped on the local engine's thread."""
        self._epoch.pop(client_id, None)
        for served in self._served_epoch.values():
            served.pop(client_id, None)
        self.served_by_client.pop(client_id, None)
        if self._worker is not None:
            self._worker.forget(client_id)
        else:
            self.model.runner.forget(client_id)

    # -- Zenoh callbacks and threads: events only -----------------------------------------------

    def _event(self, event: tuple) -> None:
        self.events.put(event)
        self.server._wake.set()

    def _on_local_done(self, clients: list[str], t0: float, t1: float) -> None:
        self._event(("local_done", clients, t0, t1))

    def _prober(self, state: EngineState) -> None:
        period = self.settings.probe_period_s
        while not self._stop.wait(period):
            status, rtt = self._probe(state, timeout_s=max(period, 1.0))
            self._event(("probe", state.engine_id, rtt, status))

    def _probe(self, state: EngineState, timeout_s: float) -> tuple[EngineStatus | None, float | None]:
        t0 = time.monotonic()
        try:
            replies = self.session.query(state.keys.status, timeout_s=timeout_s)
        except Exception:  # a closed session at stop, a transport error: an unanswered probe
            return None, None
        rtt = time.monotonic() - t0
        for _, payload in replies:
            try:
                msg = dispatch.decode(payload)
            except ProtocolError:
                continue
            if isinstance(msg, EngineStatus) and msg.engine_id == state.engine_id:
                return msg, rtt
        return None, None

    # -- the scheduler loop's round -------------------------------------------------------------

    def round(self, now_s: float) -> bool:
        """Drain answers and probes, re-queue what timed out, place and dispatch what waits.
        True when something was dispatched (the loop then goes round again at once)."""
        self._drain()
        self._timeouts(now_s)
        if now_s - self._figures_at_s >= FIGURES_PERIOD_S:
            self._figures_at_s = now_s
            self._figures = self._compute_figures()
            self._client_figures = {c: {f"served.{tier}": n.get(tier, 0) for tier in (EDGE, CLOUD)}
                                    for c, n in self.served_by_client.items()}
        usable = [e for e in self.engines.values() if e.usable()]
        views = [e.view(self._running_for_placement(e, now_s)) for e in usable]
        # Placement feeds an edge engine only when it is idle and a cloud engine while it has room
        # (up to its in-flight limit, which may be more than one batch): with neither, nothing can go
        # now, and a decision would only count every request as skipped.
        if not any(v.running == 0 if v.tier == EDGE else v.running < v.in_flight_limit for v in views):
            return False
        box: dict = {}

        def choose(order: list[str], slots: dict[str, Slot]) -> list[str]:
            requests = [RequestView(c, len(slots[c].payload)) for c in order]
            placement = place(requests, views, now_s)
            box["placement"] = placement
            if log.isEnabledFor(logging.DEBUG):
                log.debug("placement at %.3f: %s; views %s", now_s, placement, views)
            chosen = {c for ids in placement.assigned.values() for c in ids}
            return [c for c in order if c in chosen]

        busy = set(self._local_clients)
        for state in self.engines.values():
            busy.update(f.session.client_id for f in state.in_flight.values())
        model = self.model
        batch = admission.schedule(model, time.monotonic(), choose=choose, exclude=busy)
        if batch is None:
            return False
        for session, _slot, reason, detail in batch.rejected:
            self.server._reject(model, session, reason, detail)
        placement = box.get("placement")
        if not batch.items or placement is None:
            return False
        engine_of = {c: eid for eid, ids in placement.assigned.items() for c in ids}
        view_of = {v.engine_id: v for v in views}
        local_items = []
        t = time.monotonic()
        sent: Counter = Counter()  # remote engine -> requests dispatched to it now (its next batch)
        for session, slot in batch.items:
            state = self.engines[engine_of[session.client_id]]
            estimate = placement.estimates.get(session.client_id)
            waited = _queue_estimate_s(slot, view_of[state.engine_id], now_s)
            if state is self.local:
                local_items.append((session, slot, estimate, waited))
            else:
                self._dispatch(state, session, slot, estimate, t, waited)
                sent[state.engine_id] += 1
        for engine_id, n in sent.items():  # that batch starts when it is there and the engine is free
            state = self.engines[engine_id]
            start = max(state.busy_until_s, t + (state.rtt_s or 0.0) / 2)
            state.busy_until_s = start + state.profile.latency_s(n)
        if local_items:
            forget = []
            for session, *_ in local_items:
                if self._reset_for(self.local, session):
                    forget.append(session.client_id)
            clients = [s.client_id for s, *_ in local_items]
            self._local_clients.update(clients)
            self._local_batches.append((clients, t, [(e, _admitted_s(sl), w) for _, sl, e, w in local_items]))
            self.local.counts["dispatched"] += len(local_items)
            self.local.busy_until_s = t + self.local.profile.latency_s(len(local_items))
            self._worker.submit(Batch([(s, sl) for s, sl, *_ in local_items], []), forget)
        return True

    def _running_for_placement(self, state: EngineState, now_s: float) -> int:
        """What placement is told an engine is running. Placement feeds an edge engine only when it
        is idle; a remote one would then idle for a round trip between batches (the last answer
        travels back, the next batch travels out). So a remote edge engine running one batch counts
        as idle from a round trip before that batch's expected end: its next batch then waits in
        the engine's inbox and starts as the current one ends."""
        if state is self.local:
            return len(self._local_clients)
        running = len(state.in_flight)
        if (state.tier == EDGE and 0 < running <= state.entry.capacity
                and now_s >= state.busy_until_s - (state.rtt_s or 0.0) - DISPATCH_AHEAD_S):
            return 0
        return running

    def _reset_for(self, state: EngineState, session: Session) -> bool:
        """Whether `state`'s engine must drop the client's runner state before serving it."""
        if self.model.engine.take_reset(session):
            self._epoch[session.client_id] += 1
        served = self._served_epoch[state.engine_id]
        epoch = self._epoch[session.client_id]
        reset = served.get(session.client_id, 0) != epoch
        served[session.client_id] = epoch
        return reset

    def _dispatch(self, state: EngineState, session: Session, slot: Slot, estimate: Estimate | None,
                  now_s: float, queue_estimate_s: float | None = None) -> None:
        model = self.model
        try:
            obs = admission.observation(model, session, slot)  # (kept in the slot: a re-queued request is not decoded again)
        except ProtocolError as exc:
            model.engine.release(session)  # picked, refused now: computed no longer
            self.server._reject(model, session, exc.reason, str(exc))
            return
        request_id = next(self._ids)
        payload = dispatch.encode(EngineRequest(
            request_id=request_id, client_id=session.client_id, model_id=model.entry.model_id,
            model_version=model.entry.model_version, observation=bytes(slot.payload),
            seed=request_seed(session.client_id, obs.seq_id), reset=self._reset_for(state, session)))
        flight = InFlight(request_id, state.engine_id, session, slot, now_s, len(payload), estimate, obs,
                          admitted_s=_admitted_s(slot), queue_estimate_s=queue_estimate_s)
        try:
            state.publisher.put(payload)
        except Exception as exc:  # the link refused it: the request goes back to wait
            log.warning("%s: dispatch to %s failed: %s", model.app.prefix, state.engine_id, exc)
            self._requeue(state, flight, Reason.PUBLISH_ERROR)
            return
        state.in_flight[request_id] = flight
        state.counts["dispatched"] += 1

    # -- events ---------------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            kind = event[0]
            if kind == "answer":
                self._on_answer(self.engines[event[1]], event[2], event[3])
            elif kind == "local_done":
                self._on_local(*event[1:])
            elif kind == "probe":
                self._on_probe(self.engines[event[1]], event[2], event[3], time.monotonic())
            elif kind == "token":
                state = self.engines[event[1]]
                if not event[2] and state.up:
                    self._down(state, "gone")

    def _on_local(self, clients: list[str], t0: float, t1: float) -> None:
        state = self.local
        self._local_clients.difference_update(clients)
        if self._local_batches:
            _, dispatched_s, items = self._local_batches.popleft()
            for estimate, admitted_s, waited in items:
                if estimate is not None:
                    state.estimates.append((estimate.latency_s, t1 - dispatched_s))
                if waited is not None:  # the batch started at t0, on the local engine's thread
                    state.queueing.append((waited, t0 - admitted_s))
        state.counts["answered"] += len(clients)
        for client_id in clients:
            self.served_by_client.setdefault(client_id, Counter())[state.tier] += 1
        if not self._local_clients:
            state.busy_until_s = min(state.busy_until_s, t1)

    def _on_answer(self, state: EngineState, arrived_s: float, payload: bytes) -> None:
        model = self.model
        try:
            answer = dispatch.decode(payload)
            if not isinstance(answer, EngineAnswer) or answer.engine_id != state.engine_id:
                raise ProtocolError(Reason.WRONG_TYPE, "not an answer of this engine")
        except ProtocolError as exc:
            state.counts[f"refused.{exc.reason}"] += 1
            return
        flight = state.in_flight.pop(answer.request_id, None)
        if flight is None:  # re-queued already (timeout, partition, restart): never served twice
            state.counts["late"] += 1
            return
        if state.incarnation is not None and answer.incarnation != state.incarnation:
            state.counts["incarnation_changed"] += 1  # the next probe re-profiles it
        spec = model.runner.spec
        refusal = None
        if (answer.model_id, answer.model_version) != (model.entry.model_id, model.entry.model_version):
            refusal = (Reason.WRONG_MODEL, f"answered as {answer.model_id}/{answer.model_version}")
        elif answer.error == Reason.WRONG_MODEL:
            refusal = (Reason.WRONG_MODEL, answer.detail)
        elif answer.error is None and (answer.actions is None or answer.actions.ndim != 2
                                       or answer.actions.shape[1] != spec.action_dim
                                       or answer.actions.shape[0] < model.actions_per_chunk):
            shape = None if answer.actions is None else answer.actions.shape
            refusal = ("wrong_shape", f"actions {shape}, expected (>= {model.actions_per_chunk}, {spec.action_dim})")
        if refusal is not None:
            state.counts[f"refused.{refusal[0]}"] += 1
            n = state.counts[f"refused.{refusal[0]}"]
            if worth_logging(n):
                log.warning("%s: engine %s refused (%s: %s); request re-queued [%d so far]", model.app.prefix,
                            state.engine_id, refusal[0], refusal[1], n)
            self._down(state, refusal[0])
            self._requeue(state, flight, refusal[0])
            return
        session = flight.session
        obs = flight.observation
        elapsed_s = arrived_s - flight.dispatched_s
        self._measure(state, answer, flight, elapsed_s, len(payload))
        queue_ms = (flight.dispatched_s - flight.slot.arrival_s) * 1000 + answer.queue_ms
        if answer.error is not None:  # the request's own fault (bad cameras, a failing inference)
            self.server._reject(model, session, answer.error, f"engine {state.engine_id}: {answer.detail}")
            model.engine.finish([], [session.client_id], time.monotonic(), elapsed_s)
            return
        result = InferenceResult(actions=answer.actions, refinement_updates=answer.refinement_updates,
                                 extras={} if answer.rtc_delay_steps is None else {RTC_EXTRA_DELAY: answer.rtc_delay_steps})
        try:
            chunk = model.executor.chunk(obs, result, answer.inference_ms, queue_ms,
                                         served_by=(state.engine_id, state.tier))
        except Exception as exc:
            state.counts["refused.bad_answer"] += 1
            self._down(state, "bad_answer")
            self._requeue(state, flight, "bad_answer")
            log.warning("%s: engine %s answer refused: %s", model.app.prefix, state.engine_id, exc)
            return
        published = []
        if model.engine.sessions.get(session.client_id) is session:
            try:
                self.server._publisher(model, session.client_id).put(chunk)
                model.inferences += 1
                model.answers[OutputKind.ACTIONS] += 1
                published.append((session, obs.seq_id, answer.inference_ms, queue_ms))
                self.served_by_client.setdefault(session.client_id, Counter())[state.tier] += 1
            except Exception as exc:
                self.server._reject(model, session, Reason.PUBLISH_ERROR, str(exc))
        else:
            self.counts["answers_closed"] += 1  # its session closed meanwhile
        state.counts["answered"] += 1
        model.engine.finish(published, [session.client_id], time.monotonic(), elapsed_s)

    def _measure(self, state: EngineState, answer: EngineAnswer, flight: InFlight, elapsed_s: float,
                 answer_bytes: int) -> None:
        if flight.estimate is not None and math.isfinite(flight.estimate.latency_s):
            state.estimates.append((flight.estimate.latency_s, elapsed_s))
        network_s = elapsed_s - (answer.queue_ms + answer.inference_ms) / 1000
        if flight.queue_estimate_s is not None:
            # The batch started after the trip out (half this request's own network time) and the
            # engine's reported wait in its inbox.
            started_s = flight.dispatched_s + max(0.0, network_s) / 2 + answer.queue_ms / 1000
            state.queueing.append((flight.queue_estimate_s, started_s - flight.admitted_s))
        rtt = state.rtt_s or 0.0
        moving_s = network_s - rtt
        if moving_s > MIN_TRANSFER_S:
            state.bandwidth_samples.append((flight.request_bytes + answer_bytes) / moving_s)
            state.bandwidth_bps = max(state.bandwidth_samples)

    def _on_probe(self, state: EngineState, rtt: float | None, status: EngineStatus | None, now_s: float) -> None:
        if status is None:
            state.lost_probes += 1
            if state.up and state.lost_probes >= self.settings.probes_lost:
                self._down(state, "partition")
            return
        state.lost_probes = 0
        state.rtt_samples.append(rtt)
        state.rtt_s = min(state.rtt_samples)
        why = self._status_refusal(status)
        if why is not None:
            state.counts["refused.wrong_model"] += 1
            self._down(state, Reason.WRONG_MODEL)
            return
        if status.incarnation != state.incarnation:
            if state.incarnation is not None:
                state.counts["restarts"] += 1
                log.info("%s: engine %s restarted (%s); re-profiled", self.model.app.prefix, state.engine_id,
                         status.incarnation)
                for flight in list(state.in_flight.values()):  # lost with the old process
                    state.in_flight.pop(flight.request_id, None)
                    self._requeue(state, flight, "restart")
            state.incarnation = status.incarnation
            if not isinstance(state.entry.profile, dict):  # measured: the engine's own start-up profile
                state.profile = BatchProfile.from_ms(status.profile_ms) if status.profile_ms else None
            state.busy_until_s = 0.0
        if not state.up:
            if state.down_reason not in (None, "not probed yet"):
                log.info("%s: engine %s is back (was %s); offloading resumes", self.model.app.prefix,
                         state.engine_id, state.down_reason)
            state.up, state.down_reason = True, None

    def _status_refusal(self, status: EngineStatus) -> str | None:
        entry, spec = self.model.entry, self.model.runner.spec
        if (status.model_id, status.model_version) != (entry.model_id, entry.model_version):
            return f"engine loads {status.model_id}/{status.model_version}, this server {entry.model_id}/{entry.model_version}"
        if status.action_dim != spec.action_dim or status.chunk_size < self.model.actions_per_chunk:
            return (f"engine's model has action_dim {status.action_dim}, chunk {status.chunk_size}; this server's "
                    f"{spec.action_dim}, {self.model.actions_per_chunk}")
        return None

    def _down(self, state: EngineState, reason: str) -> None:
        if state.up:
            state.counts["partitions" if reason in ("partition", "gone") else "quarantined"] += 1
            log.warning("%s: engine %s is down (%s): edge-only until it answers again", self.model.app.prefix,
                        state.engine_id, reason)
        state.up, state.down_reason = False, reason
        for flight in list(state.in_flight.values()):
            state.in_flight.pop(flight.request_id, None)
            self._requeue(state, flight, reason)

    def _timeouts(self, now_s: float) -> None:
        bound = self.settings.answer_timeout_s
        for state in self.engines.values():
            for flight in [f for f in state.in_flight.values() if now_s - f.dispatched_s > bound]:
                state.in_flight.pop(flight.request_id, None)
                self._requeue(state, flight, "timeout")

    def _requeue(self, state: EngineState, flight: InFlight, reason: str) -> None:
        """Put an unanswered request back in its session's slot, to be placed again (counted)."""
        state.counts["requeued"] += 1
        state.counts[f"requeued.{reason}"] += 1
        if not self.model.engine.requeue(flight.session, flight.slot):
            self.counts["requeue_superseded"] += 1  # a newer observation waits: it stands for the request
        self.server._wake.set()

    # -- telemetry ------------------------------------------------------------------------------

    def figures(self) -> dict:
        """Per-engine and model-wide dispatch figures (any thread: a copy refreshed by the loop)."""
        return self._figures

    def client_figures(self, client_id: str) -> dict:
        """Chunks of this client computed per tier (any thread)."""
        return self._client_figures.get(client_id, {f"served.{EDGE}": 0, f"served.{CLOUD}": 0})

    def _compute_figures(self) -> dict:
        answered = sum(e.counts["answered"] for e in self.engines.values())
        out = {f"engine.{eid}.{k}": v for eid, e in self.engines.items() for k, v in e.figures(answered).items()}
        offloaded = sum(e.counts["answered"] for e in self.engines.values() if e.tier == CLOUD)
        out["offload_share"] = offloaded / answered if answered else 0.0
        out |= {f"dispatch.{k}": v for k, v in self.counts.items()}
        return out
