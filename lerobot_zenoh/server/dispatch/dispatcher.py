"""The edge scheduler's engines: where each batch it picks runs (docs/server.md, "Engines").

A model with `engines` in its manifest entry is served by one *edge scheduler*: this process keeps
every robot's session, slot and wait-ratio bookkeeping (`server/session_table/table.py`, the request scheduler)
and places each request it picks, with `scheduling.placement.place` (Kairos' rule), on one of
its engines. Every engine is an executor of one interface (`server/engine/interface.py`) that the
dispatcher hands requests to (`Work`) and hears answers from:

- the *local* engine (`local: true`): this process's own runner, a `BatchExecutor` on a thread of
  its own (`ThreadedExecutor`), which reports each batch it ran;
- remote engines (`RemoteExecutor`): `lerobot-policy-server` processes started with `role: engine`
  (`server/shell/engine_worker.py`). Each gets `EngineRequest`s on its own dispatch key and answers on its
  answer key (`protocol/dispatch.py`); answers are decoded and checked on a thread of their own
  (`server/dispatch/engine_link.py`), and the inference loop relays the chunk to the robot.

One bookkeeping for everything in flight (`server/engine/request_table.py`): each request is bound to this
process's incarnation, its client, nonce and seq_id, and an answer that does not match an
outstanding request exactly is refused and counted, never delivered. One placement bookkeeping per
engine (`scheduling/engine_load.py`, the code the fleet model runs too): a dispatch adds a group,
an answer removes its request and tells when the engine was free, so estimates are corrected by
answers.

Nothing here waits on an engine. What a slow, dead, partitioned, restarted or wrong engine costs:

- no answer within `dispatch.answer_timeout_s`: the request goes back to its session's slot and is
  placed again (`requeued`); the engine is *suspect*: nothing is placed on it until a probe sent at
  least `answer_timeout_s` later answers, then one request at a time until one is answered;
- `probes_lost` probes unanswered in a row (each waits at most `probe_period_s`), or its liveliness
  token gone: the engine is *down* (`partition`); its requests are re-queued at once;
- a new `incarnation` in its status: its profile is taken again and its requests re-queued;
- a status that is malformed or whose profile is not believable (`placement.profile_from_peer_ms`),
  or that names another model: the engine is refused (`refused.bad_status`, `refused.wrong_model`)
  and left out until its status is right again;
- an answer naming another model, or actions of another shape: refused and counted, the request
  re-queued, the engine left out until its status is right again;
- an error answer: its reason mapped to the protocol's (else `engine_error`), counted on the engine
  and on the robot, but never towards the robot's rejection cool-down.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.protocol.dispatch import EngineKeys
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.scheduling.placement import CLOUD, EDGE, BatchProfile, EngineView, RequestView, place, transfer_s
from lerobot_zenoh.server.engine import admission
from lerobot_zenoh.server.session_table.records import Batch, Session, Slot
from lerobot_zenoh.server.dispatch.answer_relay import AnswerRelay
from lerobot_zenoh.server.dispatch.engine_health import EngineHealth
from lerobot_zenoh.server.engine.interface import EngineExecutor, Work
from lerobot_zenoh.server.dispatch.engine_link import AnswerInbox, EngineState, Probe, Prober
from lerobot_zenoh.server.dispatch.remote_executor import RemoteExecutor
from lerobot_zenoh.server.engine.request_table import InFlight, RequestTable
from lerobot_zenoh.server.engine.threaded_executor import ThreadedExecutor
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport.session import ACTION_QOS

if TYPE_CHECKING:
    from lerobot_zenoh.server.dispatch.engine_link import EngineLinkSession
    from lerobot_zenoh.server.dispatch.host import DispatchHost
    from lerobot_zenoh.server.model.served_model import ServedModel

log = logging.getLogger(__name__)

#: A remote edge engine's next batch is dispatched this long (plus a round trip) before its
#: current batch is expected to end (`Dispatcher._running_for_placement`).
DISPATCH_AHEAD_S = 0.010
#: How often the inference loop refreshes the figures telemetry reads.
FIGURES_PERIOD_S = 0.5

__all__ = ["DispatchHost", "Dispatcher", "EDGE", "CLOUD"]


def _admitted_s(slot: Slot) -> float:
    """When the request a slot holds reached the scheduler (a refresh keeps its request's first arrival)."""
    return slot.first_arrival[0] if slot.first_arrival is not None else slot.arrival_s


def _queue_estimate_s(slot: Slot, view: EngineView, now_s: float) -> float:
    """The queueing delay placement expects for a request placed now on `view`'s engine: from its
    admission to the start of its batch there (as `placement.service_estimate_s`)."""
    trip_s = view.rtt_s / 2 + transfer_s(view, len(slot.payload))
    return now_s - _admitted_s(slot) + max(trip_s, view.busy_until_s - now_s)


class Dispatcher:
    """The engines of one model and everything the scheduler loop does with them (`round`)."""

    def __init__(self, host: DispatchHost, model: ServedModel, session: EngineLinkSession,
                 clock: Callable[[], float] = time.monotonic, edge_incarnation: str | None = None):
        self.host = host
        self.model = model
        self.session = session
        self.clock = clock
        self.settings = model.entry.dispatch
        self.max_bytes = model.adapter.limits.max_message_bytes
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.engines: dict[str, EngineState] = {}
        for entry in model.entry.engines:
            state = EngineState(entry, None if entry.local else EngineKeys(model.app, entry.engine_id))
            if isinstance(entry.profile, dict):
                state.set_profile(BatchProfile.from_ms(entry.profile))
            self.engines[entry.engine_id] = state
        self.local: EngineState | None = next((e for e in self.engines.values() if e.entry.local), None)
        # New at every start of this process: an answer to a request an earlier process sent is refused.
        self.table = RequestTable(edge_incarnation or f"{os.getpid()}-{time.time_ns():x}")
        self.inbox = AnswerInbox(self.table.edge_incarnation, self.max_bytes, self.table.engine_of,
                                 lambda rid: 0 < rid <= self.table.last_id, lambda a: self._event(("answer", a)), clock)
        self.probers: list[Prober] = []  # one per remote engine, in `engines` order
        self.executors: dict[str, EngineExecutor] = {}  # engine id -> what runs its work, built at `start`
        # Per-episode runner state: each engine keeps its own, so a new episode (SessionTable.take_reset)
        # bumps the client's epoch and each engine drops its state when it next serves the client.
        self._epoch: Counter = Counter()
        self._served_epoch: dict[str, dict[str, int]] = {eid: {} for eid in self.engines}
        self.counts: Counter = Counter()  # model-wide: requeue_superseded, answers_closed, event_errors
        self.health = EngineHealth(model, self.engines, self.table, self.settings, host.wake, self.counts)
        self.relay = AnswerRelay(host, model, self.engines, self.table, self.health, self.counts, clock)
        self.served_by_client = self.relay.served_by_client
        self._figures: dict = {}
        self._client_figures: dict[str, dict] = {}
        self._figures_at_s = -math.inf

    # -- start / stop -------------------------------------------------------------------------

    def start(self, threads: bool = True) -> None:
        """Check every engine and start listening; `threads=False` (tests with a fake clock) starts
        neither the probe threads nor the answer thread: the caller drives `probers[i].probe` and
        `inbox.drain` itself."""
        model = self.model
        where = f"server[{model.entry.model_id}].engines"
        if model.runner.spec.capabilities.iteration_level:
            raise ConfigError(where, f"{model.runner.spec.policy_type} decodes at the iteration level; serve it "
                              "without engines", source=model.source)
        if self.local is not None:
            if self.local.load is None:  # `measured`: this process's own start-up profile
                profile = self.host.measure_profile(model)
                if not profile:
                    raise ConfigError(f"{where}[{self.local.engine_id}].profile",
                                      "measured, but this runner could not be profiled; declare {batch size: ms}",
                                      source=model.source)
                self.local.set_profile(BatchProfile(profile))
            self.local.up, self.local.down_reason, self.local.rtt_s = True, None, 0.0
            model.adapter.served_by = (self.local.engine_id, self.local.tier)
            self.executors[self.local.engine_id] = ThreadedExecutor(
                self.host.local_executor(model), model.entry.model_id,
                lambda ids, t0, t1: self._event(("local_done", ids, t0, t1)), self.clock)
        remote = [e for e in self.engines.values() if e.keys is not None]
        if threads:
            self.inbox.start()
        for state in remote:
            self.executors[state.engine_id] = RemoteExecutor(model, state, self.table.edge_incarnation)
            state.publisher = self.session.publisher(state.keys.dispatch, ACTION_QOS)
            self.session.subscribe(state.keys.answer, lambda key, payload, s=state: self.inbox.on_answer(
                s.engine_id, payload))
            self.session.watch_liveliness(state.keys.token, lambda key, alive, s=state: self._event(
                ("token", s.engine_id, alive)))
            self.probers.append(Prober(self.session, state, self.settings.probe_period_s, self.max_bytes,
                                        lambda eid, probe: self._event(("probe", eid, probe)), self.clock))
        # Start-up: every remote engine answers its status (it is reachable, loads this model) in time.
        deadline = time.monotonic() + self.settings.start_timeout_s
        for state, prober in zip(remote, self.probers, strict=True):
            probe = Probe(0.0, None, None)
            while probe.status is None and time.monotonic() < deadline:
                probe = prober.probe(timeout_s=min(1.0, max(0.05, deadline - time.monotonic())))
                if probe.status is None:
                    if probe.refusal is not None:
                        break
                    time.sleep(0.1)
            if probe.status is None:
                why = (f"its status is refused: {probe.refusal}" if probe.refusal else
                       f"engine unreachable: no answer on {state.keys.status} within {self.settings.start_timeout_s:g} s "
                       f"(start it with role: engine, engine_id: {state.engine_id}; check endpoint and routers)")
                raise ConfigError(f"{where}[{state.engine_id}]", why, source=model.source)
            why = self.health.status_refusal(probe.status)
            if why is not None:
                raise ConfigError(f"{where}[{state.engine_id}]", why, source=model.source)
            # The first answer also waited for the route to form: its time is not a round trip.
            again = [prober.probe(timeout_s=1.0) for _ in range(3)]
            rtts = [p.rtt_s for p in again if p.status is not None]
            self.health.on_probe(state, Probe(probe.sent_s, min(rtts) if rtts else 1.0, probe.status, probe.profile))
            if state.rtt_s is not None and state.rtt_s >= self.settings.probe_period_s:
                log.warning("%s: engine %s's round trip (%.0f ms) is not under dispatch.probe_period_s (%.0f ms): "
                            "its probes will be lost; raise probe_period_s", model.app.prefix, state.engine_id,
                            state.rtt_s * 1000, self.settings.probe_period_s * 1000)
        for prober in self.probers if threads else ():
            prober.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        for prober in self.probers:
            prober.stop(timeout_s)
        self.inbox.stop(timeout_s)
        return all([executor.stop(timeout_s) for executor in self.executors.values()])

    def forget(self, client_id: str) -> None:
        """A closed session (inference thread): drop what is kept for it; the local runner's state
        is dropped on the local engine's thread."""
        self._epoch.pop(client_id, None)
        for served in self._served_epoch.values():
            served.pop(client_id, None)
        self.served_by_client.pop(client_id, None)
        for executor in self.executors.values():
            executor.forget(client_id)

    def _event(self, event: tuple) -> None:
        """From Zenoh callbacks and threads: events only, handled on the inference thread."""
        self.events.put(event)
        self.host.wake()

    # -- the scheduler loop's round -------------------------------------------------------------

    def round(self, now_s: float | None = None) -> bool:
        """Drain answers and probes, re-queue what timed out, place and dispatch what waits.
        True when something was dispatched (the loop then goes round again at once)."""
        now_s = self.clock() if now_s is None else now_s
        self._drain()
        self.health.timeouts(now_s)
        if now_s - self._figures_at_s >= FIGURES_PERIOD_S:
            self._figures_at_s = now_s
            self._figures = self._compute_figures()
            self._client_figures = {c: {f"served.{tier}": n.get(tier, 0) for tier in (EDGE, CLOUD)}
                                    for c, n in self.served_by_client.items()}
        role = self.model.role
        if role is not None and not role.may_serve(now_s):
            return False  # standing by, or held after waking from a freeze: nothing placed, as the local path
        views = [e.view(self._running_for_placement(e, now_s)) for e in self.engines.values() if e.usable()]
        # Placement feeds an edge engine only when it is idle and a cloud engine while it has room.
        if not any(v.running == 0 if v.tier == EDGE else v.running < v.in_flight_limit for v in views):
            return False
        # Rank, then take: the scheduler's order under the session table's lock, placement outside it.
        # A round that places nothing is no decision (nobody counts as skipped), as in the fleet model.
        model = self.model
        ranking = admission.rank(model, now_s, exclude=self.table.clients())
        for session, _slot, reason, detail in ranking.rejected:
            self.host.reject(model, session, reason, detail)
        if not ranking.order:
            return False
        placement = place([RequestView(c, ranking.sizes[c]) for c in ranking.order], views, now_s)
        placed = {c for ids in placement.assigned.values() for c in ids}
        if not placed:
            return False
        batch = model.session_table.take([c for c in ranking.order if c in placed], ranking, now_s)
        if batch is None or not batch.items:
            return False
        engine_of = {c: eid for eid, ids in placement.assigned.items() for c in ids}
        view_of = {v.engine_id: v for v in views}
        groups: dict[str, list] = {}
        for session, slot in batch.items:
            state = self.engines[engine_of[session.client_id]]
            flight = self._flight(state, session, slot, placement.estimates.get(session.client_id),
                                  _queue_estimate_s(slot, view_of[state.engine_id], now_s), now_s)
            if flight is not None:
                groups.setdefault(state.engine_id, []).append(flight)
        for engine_id, flights in groups.items():
            self._submit(self.engines[engine_id], flights, now_s)
        return bool(groups)

    def _running_for_placement(self, state: EngineState, now_s: float) -> int:
        """What placement is told an engine is running. A remote edge engine running one batch
        counts as idle from a round trip before that batch's expected end, so its next batch waits
        in the engine's inbox and starts as the current one ends instead of a round trip later."""
        running = state.load.running
        if (state is not self.local and state.tier == EDGE and 0 < running <= state.capacity
                and now_s >= state.busy_until_s - (state.rtt_s or 0.0) - DISPATCH_AHEAD_S):
            return 0
        return running

    def _reset_for(self, state: EngineState, session: Session) -> bool:
        """Whether `state`'s engine must drop the client's runner state before serving it."""
        if self.model.session_table.take_reset(session):
            self._epoch[session.client_id] += 1
        served = self._served_epoch[state.engine_id]
        epoch = self._epoch[session.client_id]
        reset = served.get(session.client_id, 0) != epoch
        served[session.client_id] = epoch
        return reset

    def _flight(self, state: EngineState, session: Session, slot: Slot, estimate, queue_estimate_s: float,
                now_s: float) -> InFlight | None:
        """The record of one placed request; None when its body is refused now (rejected)."""
        model = self.model
        try:
            obs = admission.observation(model, session, slot)  # (kept in the slot: a re-queued request is not decoded again)
        except ProtocolError as exc:
            model.session_table.release(session)  # picked, refused now: computed no longer
            self.host.reject(model, session, exc.reason, str(exc))
            return None
        return InFlight(self.table.next_id(), state.engine_id, session, slot, obs.seq_id, obs.session_nonce, now_s,
                        estimate=estimate, observation=obs if state is not self.local else None,
                        admitted_s=_admitted_s(slot), queue_estimate_s=queue_estimate_s)

    def _submit(self, state: EngineState, flights: list[InFlight], now_s: float) -> None:
        """Hand one group to its engine's executor: recorded in flight first (an answer can only
        match what is recorded), started when it is there and the engine is free."""
        reset = frozenset(f.client_id for f in flights if self._reset_for(state, f.session))
        for flight in flights:
            self.table.add(flight)
        refused = self.executors[state.engine_id].submit(
            Work(Batch([(f.session, f.slot) for f in flights], []), flights, reset))
        for flight in refused:  # its link refused it: back to wait
            self.table.take(flight.request_id)
            self.health.requeue(state, flight, Reason.PUBLISH_ERROR)
        gone = {f.request_id for f in refused}
        sent = [f for f in flights if f.request_id not in gone]
        if sent:
            state.counts["dispatched"] += len(sent)
            arrival = now_s + (state.rtt_s or 0.0) / 2 + transfer_s(state.view(0), sum(f.request_bytes for f in sent))
            state.load.dispatched([f.request_id for f in sent], now_s, arrival)

    # -- events ---------------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(event)
            except Exception:  # a bug here must not end the loop: counted, logged
                self.counts["event_errors"] += 1
                if worth_logging(self.counts["event_errors"]):
                    log.exception("%s: engine event %s failed", self.model.app.prefix, event[0])

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "answer":
            self.relay.on_answer(event[1])
        elif kind == "local_done":
            self.relay.on_local(*event[1:])
        elif kind == "probe":
            self.health.on_probe(self.engines[event[1]], event[2])
        elif kind == "token":
            self.health.on_token(self.engines[event[1]], event[2])

    # -- telemetry ------------------------------------------------------------------------------

    def figures(self, fresh: bool = False) -> dict:
        """Per-engine and model-wide dispatch figures (any thread: a copy the loop refreshes every
        `FIGURES_PERIOD_S`; `fresh`: computed now, for a caller that knows the loop is idle)."""
        return self._compute_figures() if fresh else self._figures

    def client_figures(self, client_id: str) -> dict:
        """Chunks of this client computed per tier (any thread)."""
        return self._client_figures.get(client_id, {f"served.{EDGE}": 0, f"served.{CLOUD}": 0})

    def _compute_figures(self) -> dict:
        counted_there: dict[str, Counter] = {eid: Counter() for eid in self.engines}  # on the answers' thread
        for (engine_id, name), n in list(self.inbox.counts.items()):
            counted_there[engine_id][name] += n
        answered = sum(e.counts["answered"] for e in self.engines.values())
        out = {f"engine.{eid}.{k}": v for eid, e in self.engines.items()
               for k, v in e.figures(self.table.count_on(eid), answered, counted_there[eid]).items()}
        offloaded = sum(e.counts["answered"] for e in self.engines.values() if e.tier == CLOUD)
        out["offload_share"] = offloaded / answered if answered else 0.0
        out |= {f"dispatch.{k}": v for k, v in self.counts.items()}
        return out

