"""ACT (LeRobot ``act``): a pure function of the observation, batched in one forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lerobot_zenoh.errors import PolicyError
from lerobot_zenoh.server.runners.base import (
    InferenceRequest,
    InferenceResult,
    RunnerCapabilities,
    check_observation,
)
from lerobot_zenoh.server.runners.lerobot import LeRobotRunner, concat_batches

if TYPE_CHECKING:
    import torch


class ActRunner(LeRobotRunner):
    """ACT: `predict_action_chunk` is a pure function of the batch in eval mode (no RNG, no state).

    The chunk has ``chunk_size`` actions (``n_action_steps`` is how many LeRobot would execute; the
    client decides that here). Temporal ensembling (``temporal_ensemble_coeff``) lives in
    ``select_action`` and is not used: the client blends chunks itself. `seed` and the task are unused.
    """

    not_compiled = ""  # compiles whole without breaks, but gains little on a CPU (docs/benchmarks.md)

    @classmethod
    def chunk_size_for(cls, config: Any) -> int:
        return int(config.chunk_size)

    @classmethod
    def capabilities_for(cls, config: Any) -> RunnerCapabilities:
        return RunnerCapabilities(max_batch=None)

    def _chunk(self, request: InferenceRequest, batch: dict[str, Any], updates: list | None) -> torch.Tensor:
        return self._predict(batch)

    def run(
        self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False
    ) -> list[InferenceResult]:
        """One forward pass for the whole call: each observation goes through the saved preprocessor
        on its own (exactly as alone), the results are concatenated along the batch dimension, and the
        chunk is unnormalized as a whole, then split. Equal to one request at a time within float
        tolerance (batched kernels may sum in another order); tested. A single request takes the
        one-request path, so its chunk is bit for bit what it would be alone.
        """
        import torch

        if len(requests) <= 1:
            return super().run(requests, capture_updates=capture_updates)
        for r in requests:
            check_observation(self.spec, r.state, r.images)
        try:
            with torch.inference_mode():
                batch = concat_batches([self._preprocess(r.state, r.images, r.task) for r in requests])
                actions = self.postprocessor(self._predict(batch))
        except PolicyError:
            raise
        except Exception as exc:  # torch/lerobot runtime failure: report, never return "no actions"
            raise PolicyError(f"{self.path}: batched inference of {len(requests)} failed: {exc}") from exc
        return [InferenceResult(np.ascontiguousarray(chunk)) for chunk in self._chunks(actions, len(requests))]
