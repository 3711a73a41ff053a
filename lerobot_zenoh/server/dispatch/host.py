"""What the dispatcher asks of the process around it: a leaf, so that the dispatcher's parts (the
answer relay) name it without importing the dispatcher."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lerobot_zenoh.server.engine.interface import EngineExecutor
    from lerobot_zenoh.server.model.served_model import ServedModel
    from lerobot_zenoh.server.session_table.records import Session

__all__ = ["DispatchHost"]


class DispatchHost(Protocol):
    """What the dispatcher asks of the process around it (`PolicyServer` implements it; tests hand
    in a fake)."""

    def reject(self, model: ServedModel, session: Session, reason: str, detail: str, *,
               cool_down: bool = True) -> None: ...
    def publish(self, model: ServedModel, client_id: str, payload: bytes, *,
                valid: Callable[[], bool] | None = None) -> None: ...
    def wake(self) -> None: ...
    def local_executor(self, model: ServedModel) -> EngineExecutor: ...
    def measure_profile(self, model: ServedModel) -> dict[int, float]: ...
