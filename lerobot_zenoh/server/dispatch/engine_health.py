"""The edge scheduler's failure machine for its engines: up, down, suspect, restarted (pure: no I/O).

Fed on the inference thread with what the probe threads and the answer thread established
(`server/dispatch/engine_link.py`), and with the clock, it decides whether each engine may be placed on and
takes back what an engine will not answer:

- a probe that is not answered: lost; `probes_lost` in a row (or the engine's liveliness token
  gone) take the engine *down* (`partition`, `gone`) and re-queue its requests at once;
- a status that cannot be believed (`refused.bad_status`) or names another model
  (`refused.wrong_model`): the engine is down until its status is right again;
- a new incarnation: the engine restarted; its requests are re-queued and its profile taken again;
- no answer within `answer_timeout_s`: the request is re-queued and the engine *suspect*: nothing is
  placed on it until a probe sent at least `answer_timeout_s` later answers, then one request at a
  time (probation) until one is answered.

A re-queued request goes back to its session's slot, keeping its place in line (`SessionTable.requeue`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.dispatch.engine_link import EngineState, Probe
from lerobot_zenoh.server.config.manifest import DispatchEntry
from lerobot_zenoh.server.engine.request_table import InFlight, RequestTable
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.telemetry.publisher import worth_logging

log = logging.getLogger(__name__)

__all__ = ["EngineHealth"]


class EngineHealth:
    """Up/down/suspect of the `engines` of one model; `counts` is the dispatcher's model-wide counter."""

    def __init__(self, model: ServedModel, engines: dict[str, EngineState], table: RequestTable,
                 settings: DispatchEntry, wake: Callable[[], None], counts: Counter):
        self.model, self.engines, self.table, self.settings = model, engines, table, settings
        self.wake, self.counts = wake, counts
        self.local = next((e for e in engines.values() if e.entry.local), None)

    def on_token(self, state: EngineState, alive: bool) -> None:
        if not alive and state.up:
            self.down(state, "gone")

    def on_probe(self, state: EngineState, probe: Probe) -> None:
        if probe.status is None:
            if probe.refusal is not None:  # it answered, with a status that cannot be believed
                state.counts["refused.bad_status"] += 1
                if state.up and worth_logging(state.counts["refused.bad_status"]):
                    log.warning("%s: engine %s refused: %s", self.model.app.prefix, state.engine_id, probe.refusal)
                self.down(state, "bad_status")
                return
            state.lost_probes += 1
            if state.up and state.lost_probes >= self.settings.probes_lost:
                self.down(state, "partition")
            return
        status = probe.status
        state.lost_probes = 0
        state.rtt_samples.append(probe.rtt_s)
        state.rtt_s = min(state.rtt_samples)
        if self.status_refusal(status) is not None:
            state.counts["refused.wrong_model"] += 1
            self.down(state, Reason.WRONG_MODEL)
            return
        if status.incarnation != state.incarnation:
            if state.incarnation is not None:
                state.counts["restarts"] += 1
                log.info("%s: engine %s restarted (%s); re-profiled", self.model.app.prefix, state.engine_id,
                         status.incarnation[:64])
                for flight in self.table.take_all(state.engine_id):  # lost with the old process
                    self.requeue(state, flight, "restart")
            state.incarnation = status.incarnation
            if not isinstance(state.entry.profile, dict):  # measured: the engine's own start-up profile
                state.set_profile(probe.profile)
            elif state.load is not None:
                state.load.reset()
        if state.suspect_since_s is not None and probe.sent_s >= state.suspect_until_s:
            state.suspect_since_s, state.probation = None, True  # alive: one request at a time until it answers
        if not state.up:
            if state.down_reason not in (None, "not probed yet"):
                log.info("%s: engine %s is back (was %s); offloading resumes", self.model.app.prefix,
                         state.engine_id, state.down_reason)
            state.up, state.down_reason = True, None

    def status_refusal(self, status) -> str | None:
        entry, spec = self.model.entry, self.model.runner.spec
        if (status.model_id, status.model_version) != (entry.model_id, entry.model_version):
            return (f"engine loads {status.model_id}/{status.model_version}, this server "
                    f"{entry.model_id}/{entry.model_version}")[:300]
        if status.action_dim != spec.action_dim or status.chunk_size < self.model.actions_per_chunk:
            return (f"engine's model has action_dim {status.action_dim}, chunk {status.chunk_size}; this server's "
                    f"{spec.action_dim}, {self.model.actions_per_chunk}")
        return None

    def down(self, state: EngineState, reason: str) -> None:
        if state.up:
            state.counts["partitions" if reason in ("partition", "gone") else "quarantined"] += 1
            log.warning("%s: engine %s is down (%s): edge-only until it answers again", self.model.app.prefix,
                        state.engine_id, reason)
        state.up, state.down_reason = False, reason
        for flight in self.table.take_all(state.engine_id):
            self.requeue(state, flight, reason)

    def timeouts(self, now_s: float) -> None:
        remote = {eid for eid, e in self.engines.items() if e is not self.local}  # (the local one always reports back)
        for flight in self.table.expired(now_s, self.settings.answer_timeout_s, remote):
            state = self.engines[flight.engine_id]
            if state.suspect_since_s is None:
                log.warning("%s: engine %s did not answer within %.2f s: suspect, requests re-queued",
                            self.model.app.prefix, state.engine_id, self.settings.answer_timeout_s)
            state.suspect_since_s = now_s
            state.suspect_until_s = now_s + self.settings.answer_timeout_s
            state.probation = False
            self.requeue(state, flight, "timeout")

    def requeue(self, state: EngineState, flight: InFlight, reason: str) -> None:
        """Put an unanswered request back in its session's slot, to be placed again (counted)."""
        if state.load is not None:
            state.load.withdrawn(flight.request_id)
        state.counts["requeued"] += 1
        state.counts[f"requeued.{reason}"] += 1
        if not self.model.session_table.requeue(flight.session, flight.slot):
            self.counts["requeue_superseded"] += 1  # a newer observation waits: it stands for the request
        self.wake()
