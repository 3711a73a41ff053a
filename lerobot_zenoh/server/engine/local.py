"""The one executor of a model without `engines:`: this process's own runner on the caller's thread
(the inference thread), or on a thread of its own as the local engine of a model with them. A module
of its own so that the interface (`interface.py`) stays a leaf the executor kinds import."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lerobot_zenoh.server.engine.batch_executor import BatchExecutor
from lerobot_zenoh.server.engine.decoding_executor import DecodingExecutor

if TYPE_CHECKING:
    from lerobot_zenoh.server.engine.interface import EngineExecutor
    from lerobot_zenoh.server.engine.serving import Serving
    from lerobot_zenoh.server.model.served_model import ServedModel

__all__ = ["local_executor"]


def local_executor(serving: Serving, model: ServedModel) -> EngineExecutor:
    """This process's own runner as an executor on the caller's thread: the iteration-level
    decoder for a runner that declares it, else the batch executor."""
    kind = DecodingExecutor if model.runner.spec.capabilities.iteration_level else BatchExecutor
    return kind(serving, model)
