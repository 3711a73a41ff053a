"""Answers coming back from the engines, relayed to the robots (the inference thread).

An answer of a remote engine reaches here decoded and checked by the answer thread
(`server/dispatch/engine_link.py`); it is delivered only when it matches an outstanding request exactly
(`RequestTable.match`: this process's incarnation, the engine, client, nonce and seq_id). Its
chunk is built for the observation that request carried and published on the robot's key; the
engine's load (`EngineLoad`) and its measured figures (estimate against actual, queueing delay,
bandwidth) are corrected from it. An answer of the wrong model or shape refuses the engine and
re-queues the request; an error answer is counted on the engine and on the robot, never towards the
robot's cool-down. A chunk goes out only as a local answer would (`failover.answer_check`): never to
an observation that arrived before this process froze, nor while it is held after a freeze or
replaced; a held one is counted in `answers_held` and its request closed. The local engine reports
each batch it ran (`on_local`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from lerobot_zenoh.protocol.reasons import OutputKind, Reason
from lerobot_zenoh.server.dispatch.engine_health import EngineHealth
from lerobot_zenoh.server.dispatch.engine_link import Answer, EngineState
from lerobot_zenoh.server.engine.request_table import MATCHED, InFlight, RequestTable
from lerobot_zenoh.server.runners.base import RTC_EXTRA_DELAY, InferenceResult
from lerobot_zenoh.server.model.failover import answer_check
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.telemetry.publisher import worth_logging

if TYPE_CHECKING:
    from lerobot_zenoh.server.dispatch.host import DispatchHost

log = logging.getLogger(__name__)

#: A network time this much above the probe's round trip is read as transfer time (below: noise).
MIN_TRANSFER_S = 0.002

__all__ = ["AnswerRelay"]


class AnswerRelay:
    """Delivers the engines' answers of one model; `served_by_client` counts chunks per tier."""

    def __init__(self, host: DispatchHost, model: ServedModel, engines: dict[str, EngineState], table: RequestTable,
                 health: EngineHealth, counts: Counter, clock: Callable[[], float]):
        self.host, self.model, self.engines, self.table = host, model, engines, table
        self.health, self.counts, self.clock = health, counts, clock
        self.local = next((e for e in engines.values() if e.entry.local), None)
        self.served_by_client: dict[str, Counter] = {}  # client -> {tier: chunks}, bounded by sessions

    def on_local(self, request_ids: list[int], t0: float, t1: float) -> None:
        state = self.local
        for request_id in request_ids:
            flight = self.table.take(request_id)
            state.load.answered(request_id, t1)
            if flight is None:
                continue
            if flight.estimate is not None and math.isfinite(flight.estimate.latency_s):
                state.estimates.append((flight.estimate.latency_s, t1 - flight.dispatched_s))
            if flight.queue_estimate_s is not None:  # the batch started at t0, on the local engine's thread
                state.queueing.append((flight.queue_estimate_s, t0 - flight.admitted_s))
            state.counts["answered"] += 1
            self.served_by_client.setdefault(flight.client_id, Counter())[state.tier] += 1

    def on_answer(self, received: Answer) -> None:
        model = self.model
        state = self.engines[received.engine_id]
        answer = received.answer
        flight, why = self.table.match(state.engine_id, answer.request_id, answer.edge_incarnation,
                                       answer.client_id, answer.seq_id, answer.session_nonce)
        if why != MATCHED:
            state.counts[why if why == "late" else f"refused.{why}"] += 1
            return
        state.load.answered(flight.request_id, received.arrived_s - (state.rtt_s or 0.0) / 2)
        if state.probation or state.suspect_since_s is not None:
            state.probation, state.suspect_since_s = False, None  # it answers again
        spec = model.runner.spec
        refusal = None
        if (answer.model_id, answer.model_version) != (model.entry.model_id, model.entry.model_version):
            refusal = (Reason.WRONG_MODEL, f"answered as {answer.model_id}/{answer.model_version}"[:200])
        elif received.error == Reason.WRONG_MODEL:
            refusal = (Reason.WRONG_MODEL, answer.detail[:200])
        elif received.error is None and (answer.actions is None or answer.actions.ndim != 2
                                         or answer.actions.shape[1] != spec.action_dim
                                         or answer.actions.shape[0] < model.actions_per_chunk):
            shape = None if answer.actions is None else answer.actions.shape
            refusal = ("wrong_shape", f"actions {shape}, expected (>= {model.actions_per_chunk}, {spec.action_dim})")
        if refusal is not None:
            self._refuse_engine(state, flight, *refusal)
            return
        session = flight.session
        elapsed_s = received.arrived_s - flight.dispatched_s
        self._measure(state, received, flight, elapsed_s)
        queue_ms = (flight.dispatched_s - flight.slot.arrival_s) * 1000 + answer.queue_ms
        if received.error is not None:  # the engine could not serve it: counted, never a cool-down
            state.counts[f"errors.{received.error}"] += 1
            self.host.reject(model, session, received.error, f"engine {state.engine_id}: {answer.detail[:200]}",
                             cool_down=False)
            model.session_table.finish([], [session.client_id], self.clock(), elapsed_s)
            return
        result = InferenceResult(actions=answer.actions, refinement_updates=answer.refinement_updates,
                                 extras={} if answer.rtc_delay_steps is None else {RTC_EXTRA_DELAY: answer.rtc_delay_steps})
        try:
            chunk = model.adapter.chunk(flight.observation, result, answer.inference_ms, queue_ms,
                                         served_by=(state.engine_id, state.tier))
        except Exception as exc:
            self._refuse_engine(state, flight, "bad_answer", f"{type(exc).__name__}: {exc}"[:200])
            return
        published = []
        # The local path's rule (`answer_check`), asked now and again by the publisher's thread: no
        # answer to an observation that arrived before a freeze, none while held after one or replaced.
        valid = answer_check(model.role, flight.slot.arrival_s, self.clock)
        if valid is not None and not valid():
            pass  # held, counted in `answers_held`; its request is closed below, as a local one would be
        elif model.session_table.sessions.get(session.client_id) is session:
            try:
                self.host.publish(model, session.client_id, chunk, valid=valid)
                model.inferences += 1
                model.answers[OutputKind.ACTIONS] += 1
                published.append((session, flight.seq_id, answer.inference_ms, queue_ms))
                self.served_by_client.setdefault(session.client_id, Counter())[state.tier] += 1
            except Exception as exc:
                self.host.reject(model, session, Reason.PUBLISH_ERROR, str(exc))
        else:
            self.counts["answers_closed"] += 1  # its session closed meanwhile
        state.counts["answered"] += 1
        model.session_table.finish(published, [session.client_id], self.clock(), elapsed_s)

    def _refuse_engine(self, state: EngineState, flight: InFlight, reason: str, detail: str) -> None:
        state.counts[f"refused.{reason}"] += 1
        n = state.counts[f"refused.{reason}"]
        if worth_logging(n):
            log.warning("%s: engine %s refused (%s: %s); request re-queued [%d so far]", self.model.app.prefix,
                        state.engine_id, reason, detail, n)
        self.health.down(state, reason)
        self.health.requeue(state, flight, reason)

    def _measure(self, state: EngineState, received: Answer, flight: InFlight, elapsed_s: float) -> None:
        answer = received.answer
        if flight.estimate is not None and math.isfinite(flight.estimate.latency_s):
            state.estimates.append((flight.estimate.latency_s, elapsed_s))
        network_s = elapsed_s - (answer.queue_ms + answer.inference_ms) / 1000
        if flight.queue_estimate_s is not None:
            # The batch started after the trip out (half this request's own network time) and the
            # engine's reported wait in its inbox.
            started_s = flight.dispatched_s + max(0.0, network_s) / 2 + answer.queue_ms / 1000
            state.queueing.append((flight.queue_estimate_s, started_s - flight.admitted_s))
        moving_s = network_s - (state.rtt_s or 0.0)
        if moving_s > MIN_TRANSFER_S:
            state.bandwidth_samples.append((flight.request_bytes + received.nbytes) / moving_s)
            state.bandwidth_bps = max(state.bandwidth_samples)
