"""A remote engine as an executor (`server/engine/interface.py`): another `lerobot-policy-server`
process started with `role: engine` (`server/shell/engine_worker.py`), on the site or across a WAN.

`submit` encodes each request as an `EngineRequest` (`protocol/dispatch.py`: the observation's
bytes as received, bound to this process's incarnation, the client, its session nonce and seq_id)
and puts it on the engine's dispatch key; it never waits. The engine's answers, status and token
come back through `server/dispatch/engine_link.py` to the dispatcher, which matches each answer against its
request table. A request the link refuses is handed back (the dispatcher re-queues it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lerobot_zenoh.protocol import dispatch
from lerobot_zenoh.protocol.dispatch import EngineRequest
from lerobot_zenoh.server.model.runner_adapter import request_seed

if TYPE_CHECKING:
    from lerobot_zenoh.server.engine.interface import Work
    from lerobot_zenoh.server.dispatch.engine_link import EngineState
    from lerobot_zenoh.server.engine.request_table import InFlight
    from lerobot_zenoh.server.model.served_model import ServedModel

log = logging.getLogger(__name__)

__all__ = ["RemoteExecutor"]


class RemoteExecutor:
    """The engine `state` (its `publisher` set once its links are open, `Dispatcher.start`)."""

    def __init__(self, model: ServedModel, state: EngineState, edge_incarnation: str):
        self.model, self.state, self.edge_incarnation = model, state, edge_incarnation

    def submit(self, work: Work) -> list[InFlight]:
        model, state = self.model, self.state
        refused = []
        for flight in work.flights:
            session = flight.session
            payload = dispatch.encode(EngineRequest(
                request_id=flight.request_id, client_id=session.client_id, model_id=model.entry.model_id,
                model_version=model.entry.model_version, observation=bytes(flight.slot.payload),
                seed=request_seed(session.client_id, flight.seq_id), edge_incarnation=self.edge_incarnation,
                seq_id=flight.seq_id, session_nonce=flight.nonce, reset=session.client_id in work.reset))
            flight.request_bytes = len(payload)
            try:
                state.publisher.put(payload)
            except Exception as exc:  # the link refused it: the request goes back to wait
                log.warning("%s: dispatch to %s failed: %s", model.app.prefix, state.engine_id, exc)
                refused.append(flight)
        return refused

    def forget(self, client_id: str) -> None:
        pass  # the engine drops a client's state when a request says `reset` (a new episode)

    def stop(self, timeout_s: float) -> bool:
        return True
