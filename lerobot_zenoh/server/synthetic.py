"""A synthetic policy: deterministic actions and a set latency, no torch.

It stands in for a model wherever weights or a GPU are missing (tests, benchmarks of the transport and
of the schedulers). Its chunk is `synthetic_actions(...)`, a pure function that tests can evaluate on
their own to check, end to end, that a chunk answers the observation it was computed from.

With `confidence_from_state` it also fakes the denoising updates a diffusion model exposes
(`synthetic_denoise_updates`), so that the `diffusion_confidence` execution horizon can be driven end
to end without torch. This is a simulation knob: the robot (or benchmark) says in its own state how far
the chunk can be trusted; a real model derives that from its own sampling.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.server.policies import (
    InferenceInfo,
    InferenceRequest,
    PolicySpec,
    check_observation,
    dummy_observation,
)

#: Denoising steps of the faked updates (`synthetic_denoise_updates`).
SYNTHETIC_DENOISE_STEPS = 4


def synthetic_actions(
    state: np.ndarray, images: dict[str, np.ndarray], chunk_size: int, action_dim: int
) -> np.ndarray:
    """The synthetic chunk: ``actions[t, d] = state[d % len(state)] + 0.01 * (t + 1) + image_term``.

    ``image_term`` is the mean of every pixel of every image divided by 255 (0 without images), so a
    chunk changes when any input changes. Computed in float64, returned as float32 ``(chunk_size,
    action_dim)``.
    """
    state = np.asarray(state, dtype=np.float64).reshape(-1)
    if state.size == 0:
        raise ValueError("state must not be empty")
    pixels = sum(int(img.size) for img in images.values())
    image_term = (
        sum(float(np.sum(img, dtype=np.float64)) for img in images.values()) / pixels / 255.0
        if pixels
        else 0.0
    )
    per_dim = state[np.arange(action_dim) % state.size]
    per_step = 0.01 * np.arange(1, chunk_size + 1, dtype=np.float64)
    return (per_step[:, None] + per_dim[None, :] + image_term).astype(np.float32)


def synthetic_denoise_updates(
    state: np.ndarray, index: int, chunk_size: int, action_dim: int, steps: int = SYNTHETIC_DENOISE_STEPS
) -> np.ndarray:
    """Fake denoising updates saying that the first ``k = clip(round(state[index]), 1, chunk_size)``
    actions are settled and the rest are not.

    ``(steps, chunk_size, action_dim)`` float32: 1.0 everywhere, except the final step's update of
    actions ``i >= k``, which is 4.0. An action's final update is then 1x the mean of its earlier ones
    when settled and 4x when not, so `DiffusionConfidenceHorizon` with any threshold below 3 gives
    ``H = max(k, h_min)`` (capped at the chunk).
    """
    state = np.asarray(state).reshape(-1)
    value = float(state[index])
    if not np.isfinite(value):
        raise PolicyError(f"state[{index}] (confidence_from_state) must be finite, got {value}")
    k = int(np.clip(round(value), 1, chunk_size))
    updates = np.ones((steps, chunk_size, action_dim), dtype=np.float32)
    updates[-1, k:] = 4.0
    return updates


@dataclass
class SyntheticPolicyConfig:
    """Shape of the synthetic policy and its simulated inference time.

    `latency_ms` is the time one `infer` sleeps. `batch_latency_ms` optionally profiles batched
    inference ({batch size: ms per batch}); see `SyntheticPolicy.latency_s`. `confidence_from_state`
    (a state index, or None) makes `infer_with_info` report denoising updates that trust the first
    ``round(state[index])`` actions (`synthetic_denoise_updates`).
    """

    state_names: tuple[str, ...]
    cameras: dict[str, tuple[int, int]]
    action_names: tuple[str, ...]
    chunk_size: int
    fps: int | None = None
    latency_ms: float = 0.0
    batch_latency_ms: dict[int, float] | None = field(default=None)
    confidence_from_state: int | None = None

    def __post_init__(self) -> None:
        index = self.confidence_from_state
        if index is not None and (not isinstance(index, int) or isinstance(index, bool)
                                  or not 0 <= index < len(self.state_names)):
            raise ConfigError("confidence_from_state",
                              f"must be a state index in [0, {len(self.state_names)}), got {index!r}")
        if not isinstance(self.latency_ms, (int, float)) or not self.latency_ms >= 0:
            raise ConfigError("latency_ms", f"must be a number >= 0, got {self.latency_ms!r}")
        if self.batch_latency_ms is not None:
            if not self.batch_latency_ms:
                raise ConfigError("batch_latency_ms", "must not be empty (use None for no profile)")
            for size, ms in self.batch_latency_ms.items():
                if not isinstance(size, int) or size < 1:
                    raise ConfigError("batch_latency_ms", f"batch sizes must be integers >= 1, got {size!r}")
                if not isinstance(ms, (int, float)) or not ms >= 0:
                    raise ConfigError(f"batch_latency_ms.{size}", f"must be a number >= 0, got {ms!r}")


class SyntheticPolicy:
    """A `PolicyRunner` returning `synthetic_actions` after sleeping the configured latency.

    Stateless across calls, hence pure across clients; `seed` is accepted and ignored. Also a
    `BatchPolicyRunner` and an `InfoPolicyRunner`; the `*_with_info` calls carry denoising updates
    only with `config.confidence_from_state` (otherwise ``None``).
    """

    def __init__(self, config: SyntheticPolicyConfig):
        self.config = config
        self.spec = PolicySpec(
            policy_type="synthetic",
            state_names=config.state_names,
            cameras=config.cameras,
            action_names=config.action_names,
            chunk_size=config.chunk_size,
            fps=config.fps,
        )
        profile = sorted((config.batch_latency_ms or {}).items())
        self._profile_sizes = [size for size, _ in profile]
        self._profile_ms = [float(ms) for _, ms in profile]

    def latency_s(self, batch_size: int = 1) -> float:
        """Simulated time for one call on `batch_size` observations.

        Without a profile: `latency_ms` whatever the batch size. With one: linear interpolation between
        the profiled sizes, held flat below the smallest, extrapolated along the last segment above the
        largest (proportionally to the batch size when only one size is profiled).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        sizes, ms = self._profile_sizes, self._profile_ms
        if not sizes:
            return self.config.latency_ms / 1000.0
        if batch_size <= sizes[0] or len(sizes) == 1:
            if batch_size <= sizes[0]:
                return ms[0] / 1000.0
            return ms[0] * batch_size / sizes[0] / 1000.0
        i = min(bisect.bisect_left(sizes, batch_size), len(sizes) - 1)
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], ms[i - 1], ms[i]
        return max(0.0, y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)) / 1000.0

    def warmup(self) -> None:
        state, images = dummy_observation(self.spec)
        self.infer("", state, images, "", seed=0)

    def infer(
        self,
        client_id: str,
        state: np.ndarray,
        images: dict[str, np.ndarray],
        task: str,
        *,
        seed: int,
    ) -> np.ndarray:
        self._simulate([(state, images)])
        return synthetic_actions(state, images, self.spec.chunk_size, self.spec.action_dim)

    def infer_with_info(
        self,
        client_id: str,
        state: np.ndarray,
        images: dict[str, np.ndarray],
        task: str,
        *,
        seed: int,
    ) -> InferenceInfo:
        """`infer`'s chunk with the faked denoising updates (None without `confidence_from_state`)."""
        self._simulate([(state, images)])
        return self._info(state, images)

    def infer_batch(self, requests: Sequence[InferenceRequest]) -> list[np.ndarray]:
        """Every request's `synthetic_actions`, after one sleep of `latency_s(len(requests))`.

        This is what makes the latency profile a batching model: a batch of 16 costs what the profile
        says, not 16 single calls.
        """
        self._simulate([(r.state, r.images) for r in requests])
        return [synthetic_actions(r.state, r.images, self.spec.chunk_size, self.spec.action_dim) for r in requests]

    def infer_batch_with_info(self, requests: Sequence[InferenceRequest]) -> list[InferenceInfo]:
        """`infer_with_info` for every request, after one sleep of `latency_s(len(requests))`."""
        self._simulate([(r.state, r.images) for r in requests])
        return [self._info(r.state, r.images) for r in requests]

    def _simulate(self, observations: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> None:
        """Check every observation (PolicyError), then sleep once for the whole call."""
        for state, images in observations:
            check_observation(self.spec, state, images)
        delay_s = self.latency_s(len(observations)) if observations else 0.0
        if delay_s > 0:
            time.sleep(delay_s)

    def _info(self, state: np.ndarray, images: dict[str, np.ndarray]) -> InferenceInfo:
        chunk, dim = self.spec.chunk_size, self.spec.action_dim
        index = self.config.confidence_from_state
        updates = None if index is None else synthetic_denoise_updates(state, index, chunk, dim)
        return InferenceInfo(synthetic_actions(state, images, chunk, dim), updates)

    def forget(self, client_id: str) -> None:
        """Nothing to forget."""
