"""Execution-horizon policies: how many leading actions of a chunk the robot should execute (Kairos 3.1).

A chunk's later actions are conditioned on an older observation than its first ones; the execution
horizon ``H`` says how many to trust before replanning. A horizon policy maps what the model exposes
about one chunk to ``H``; the server sends it as ``ActionChunk.execution_horizon``.

- `StaticHorizon(h)`: the same ``H`` every round (today's practice; the baseline of Kairos 5.2).
- `DiffusionConfidenceHorizon(threshold, h_min)`: the diffusion process tells, per action, how
  settled it is. With the per-step updates ``U[k, i]`` of action ``i`` at denoising step ``k`` (the
  change the step made to it), an action is converged when its final update is at most
  ``(1 + threshold)`` times the mean of its earlier updates. Walking from the first action, ``H`` is
  the number of leading converged actions (the first unconverged one and everything after it are
  dropped: the robot executes in order), and at least ``h_min``.

The same rule reads a flow-matching sampler's Euler steps, but from another baseline: a noise
schedule (DDPM/DDIM) shrinks the last steps, so a settled action's final update is a fraction of its
earlier ones; Euler steps of a velocity field all have the same ``dt``, so on a straight path every
update is the same and the ratio sits at 1, with the threshold's margin inside its scatter. The
default threshold therefore depends on the kind of steps (`DEFAULT_THRESHOLDS`, the runner's
``capabilities.refinement_kind``); a manifest that sets one overrides it (docs/scheduling.md,
"Execution horizon"; the flow-matching value is measured in docs/benchmarks.md).

Pure functions of their inputs (numpy only). Wiring: the manifest's ``horizon`` entry picks the
policy, the Diffusion and flow-matching runners capture the updates (``run(..., capture_updates=True)``, returned as
``InferenceResult.refinement_updates``), the server sends ``H`` in
``ActionChunk.execution_horizon``, and the client executes at most ``H`` actions of the chunk
(docs/scheduling.md, "Execution horizon").
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from pydantic import Field

from lerobot_zenoh.config import Settings

#: ``diffusion_confidence``'s threshold when the manifest sets none, by the runner's refinement kind:
#: Kairos' 0.4 for denoising; for flow matching the value measured on a trained SmolVLA, where the
#: final-to-mean ratio of an action's Euler updates scatters around 1 (p95 1.27 at 10 steps) and 0.4
#: cut about half of the chunks on the trained path, unrelated to their error (docs/benchmarks.md).
DEFAULT_THRESHOLDS = {"denoising": 0.4, "flow_matching": 0.6}


class HorizonPolicy(Protocol):
    name: str
    needs_updates: bool  # whether `horizon` reads `updates` (the server captures them only then)

    def horizon(self, chunk_len: int, updates: np.ndarray | None = None) -> int:
        """``H`` in ``[1, chunk_len]`` for one chunk; `updates` is ``(steps, chunk_len[, action_dim])``."""
        ...


class StaticHorizon:
    name = "static"
    needs_updates = False

    def __init__(self, h: int | StaticHorizonConfig):
        """`h`, or its validated config (``StaticHorizon(5)`` checks 5 with the same class)."""
        self.h = (h if isinstance(h, StaticHorizonConfig) else StaticHorizonConfig(h=h)).h

    def __repr__(self) -> str:
        return f"{self.name}(h={self.h})"

    def horizon(self, chunk_len: int, updates: np.ndarray | None = None) -> int:
        return max(1, min(self.h, chunk_len))


class DiffusionConfidenceHorizon:
    """Kairos' threshold policy on the denoising updates (module docstring)."""

    name = "diffusion_confidence"
    needs_updates = True

    def __init__(self, threshold: float | DiffusionConfidenceConfig = DEFAULT_THRESHOLDS["denoising"], h_min: int = 1):
        """A threshold and `h_min`, or their validated config (with a threshold)."""
        config = (threshold if isinstance(threshold, DiffusionConfidenceConfig)
                  else DiffusionConfidenceConfig(threshold=threshold, h_min=h_min))
        if config.threshold is None:
            raise ValueError("a DiffusionConfidenceHorizon needs a threshold (DiffusionConfidenceConfig.build picks the default)")
        self.threshold = float(config.threshold)
        self.h_min = config.h_min

    def __repr__(self) -> str:
        return f"{self.name}(threshold={self.threshold:g}, h_min={self.h_min})"

    def horizon(self, chunk_len: int, updates: np.ndarray | None = None) -> int:
        if updates is None:
            return chunk_len  # no signal: trust the whole chunk, as a static policy with H = chunk would
        converged = converged_actions(updates, self.threshold)
        if converged.shape[0] < chunk_len:
            raise ValueError(f"updates cover {converged.shape[0]} actions, the chunk has {chunk_len}")
        first_bad = int(np.argmin(converged)) if not converged[:chunk_len].all() else chunk_len
        return max(1, min(chunk_len, max(first_bad, self.h_min)))


def converged_actions(updates: np.ndarray, threshold: float) -> np.ndarray:
    """Per action, whether its final update is <= (1 + threshold) x the mean of its earlier ones.

    `updates` is ``(steps, actions)`` magnitudes or ``(steps, actions, action_dim)`` vectors (their
    L2 norm over the last axis is taken). With fewer than two steps nothing can be compared and every
    action counts as converged.
    """
    u = np.asarray(updates, dtype=np.float64)
    if u.ndim == 3:
        u = np.linalg.norm(u, axis=-1)
    if u.ndim != 2:
        raise ValueError(f"updates must be (steps, actions) or (steps, actions, dim), got shape {u.shape}")
    if u.shape[0] < 2:
        return np.ones(u.shape[1], dtype=bool)
    earlier = np.abs(u[:-1]).mean(axis=0)
    return np.abs(u[-1]) <= (1.0 + threshold) * earlier




# -- the settings of each policy (a manifest's `horizon: {type: ..., <settings>}`) ----------------------


class NoHorizonConfig(Settings):
    """``none``: no horizon is sent (the client uses the whole chunk)."""

    config_prefix = "horizon"

    def build(self, refinement_kind: str = "denoising") -> HorizonPolicy | None:
        return None


class StaticHorizonConfig(Settings):
    """``static``: ``h`` every round."""

    config_prefix = "horizon"

    h: int = Field(ge=1, strict=True)

    def build(self, refinement_kind: str = "denoising") -> HorizonPolicy:
        return StaticHorizon(self)


class DiffusionConfidenceConfig(Settings):
    """``diffusion_confidence``: ``H`` from the refinement updates (`threshold` = Kairos' t, `h_min`);
    without `threshold`, the default for the runner's kind of refinement steps (`DEFAULT_THRESHOLDS`)."""

    config_prefix = "horizon"

    threshold: float | None = Field(None, ge=0, allow_inf_nan=False)
    h_min: int = Field(1, ge=1, strict=True)

    def build(self, refinement_kind: str = "denoising") -> HorizonPolicy:
        if self.threshold is None:
            return DiffusionConfidenceHorizon(self.model_copy(update={"threshold": DEFAULT_THRESHOLDS[refinement_kind]}))
        return DiffusionConfidenceHorizon(self)


#: Policy type -> its config class (what the manifest's `horizon` block is validated by).
HORIZON_CONFIGS: dict[str, type[Settings]] = {
    "none": NoHorizonConfig, StaticHorizon.name: StaticHorizonConfig,
    DiffusionConfidenceHorizon.name: DiffusionConfidenceConfig}
