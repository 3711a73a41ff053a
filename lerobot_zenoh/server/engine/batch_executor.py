"""The batch executor (`server/engine/interface.py`): this process's runner, one forward pass per
batch, on the caller's thread — the inference thread for a model without `engines`, the local
engine's own thread for one with them (`ThreadedExecutor`).

A batch goes through `Serving.serve`: admission (decode, route, prepare), one forward pass, one
answer per request on its client's key, the session table told what was served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lerobot_zenoh.server.engine.interface import Work
    from lerobot_zenoh.server.engine.request_table import InFlight
    from lerobot_zenoh.server.model.served_model import ServedModel
    from lerobot_zenoh.server.engine.serving import Serving

__all__ = ["BatchExecutor"]


class BatchExecutor:
    """`submit` runs the batch now, on the calling thread."""

    def __init__(self, serving: Serving, model: ServedModel):
        self.serving, self.model = serving, model

    def submit(self, work: Work) -> list[InFlight]:
        for client_id in work.reset:
            self.model.runner.forget(client_id)  # a new episode since this engine last served it
        self.serving.serve(self.model, work.batch)
        return []

    def forget(self, client_id: str) -> None:
        self.model.runner.forget(client_id)

    def stop(self, timeout_s: float) -> bool:
        return True
