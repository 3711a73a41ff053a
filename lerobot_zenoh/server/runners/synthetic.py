"""A synthetic policy: deterministic actions and a set latency, no torch.

It stands in for a model wherever weights or a GPU are missing (tests, benchmarks of the transport and
of the schedulers). Its chunk is `synthetic_actions(...)`, a pure function that tests can evaluate on
their own to check, end to end, that a chunk answers the observation it was computed from.

With `confidence_from_state` it also fakes the refinement (denoising) updates a diffusion model exposes
(`synthetic_denoise_updates`), so that the `diffusion_confidence` execution horizon can be driven end
to end without torch. This is a simulation knob: the robot (or benchmark) says in its own state how far
the chunk can be trusted; a real model derives that from its own sampling.

With `rtc` it declares real-time chunking and continues the prefix it is given (`rtc_continue`): the
first ``delay_steps`` rows are the prefix's, the rest is `synthetic_actions`, so a test can see that a
chunk continues exactly what the robot was executing.

With `circle` its chunk is a scripted smooth motion instead (`circle_actions`): every joint follows a
sinusoid whose phase is read from the first two state values, so a robot driven by it goes round a
circle. It is what the real-time-chunking benchmark records a dataset from and measures tracking
against (benchmarks/rtc.py).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.server.runners.base import (
    RTC_EXTRA,
    RTC_EXTRA_DELAY,
    BaseRunner,
    InferenceRequest,
    InferenceResult,
    PolicySpec,
    RunnerCapabilities,
    check_observation,
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


@dataclass(frozen=True)
class CircleMotion:
    """A scripted smooth motion (`circle_actions`): one turn every `period_s`, joints at `amplitude`,
    commands `lead_steps` control periods ahead of the phase the state shows (a first-order joint lags
    its target: with time constant tau, by about ``atan(2 pi tau / period_s)`` radians)."""

    period_s: float = 4.0
    amplitude: float = 40.0
    lead_steps: float = 3.0

    def __post_init__(self) -> None:
        for name in ("period_s", "amplitude"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"circle.{name}", f"must be a number > 0, got {value!r}")
        if not (isinstance(self.lead_steps, (int, float)) and math.isfinite(self.lead_steps)):
            raise ConfigError("circle.lead_steps", f"must be a finite number, got {self.lead_steps!r}")


def circle_actions(state: np.ndarray, chunk_size: int, action_dim: int, motion: CircleMotion, dt_s: float) -> np.ndarray:
    """The scripted chunk: ``actions[t, j] = A * cos(phi + w * dt * (t + lead) - j * pi / 2)``.

    ``phi = atan2(state[1], state[0])`` is where the robot is on its circle, ``w = 2 pi / period_s``:
    joints 0 and 1 go round a circle of radius ``A`` (cos, sin), the others follow the same sinusoid a
    quarter turn apart. Row ``t`` is for the ``t``-th step after the observation. Smooth: consecutive
    rows differ by at most ``A * w * dt``. float32 ``(chunk_size, action_dim)``.
    """
    state = np.asarray(state, dtype=np.float64).reshape(-1)
    if state.size < 2:
        raise ValueError(f"circle needs at least 2 state values, got {state.size}")
    phi = math.atan2(state[1], state[0])
    step = 2 * math.pi * dt_s / motion.period_s
    phase = phi + step * (np.arange(chunk_size, dtype=np.float64) + motion.lead_steps)
    joints = np.arange(action_dim, dtype=np.float64) * (math.pi / 2)
    return (motion.amplitude * np.cos(phase[:, None] - joints[None, :])).astype(np.float32)


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


def rtc_continue(actions: np.ndarray, prefix: np.ndarray, delay_steps: int) -> np.ndarray:
    """The synthetic stand-in for RTC guidance: rows ``0 .. delay_steps - 1`` of `actions` become the
    prefix's (the robot executes those from its leftover anyway), the others are kept."""
    out = np.array(actions, dtype=np.float32, copy=True)
    d = min(int(delay_steps), len(prefix), len(out))
    out[:d] = prefix[:d]
    return out


@dataclass
class SyntheticPolicyConfig:
    """Shape of the synthetic policy and its simulated inference time.

    `latency_ms` is the time one `run` on one request sleeps. `batch_latency_ms` optionally profiles
    batched inference ({batch size: ms per batch}); see `SyntheticPolicy.latency_s`.
    `confidence_from_state` (a state index, or None) makes the policy declare refinement updates and
    report, when asked (``run(..., capture_updates=True)``), updates that trust the first
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
    rtc: bool = False  # declare real-time chunking and continue the prefix (`rtc_continue`)
    history_length: int = 1  # declare this many consecutive observations (its actions ignore the history)
    circle: CircleMotion | None = None  # a scripted smooth motion instead of `synthetic_actions`

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
        if self.circle is not None:
            if len(self.state_names) < 2:
                raise ConfigError("circle", f"needs a state of at least 2 values, got {len(self.state_names)}")
            if not self.fps:
                raise ConfigError("circle", "needs the control rate (fps)")


class SyntheticPolicy(BaseRunner):
    """A `PolicyRunner` returning `synthetic_actions` after sleeping the configured latency.

    Stateless across calls, hence pure across sessions; `seed` and the task are accepted and ignored.
    Takes any number of requests per `run` (one sleep of `latency_s(n)` for the call). Declares
    refinement updates only with `config.confidence_from_state`, and reports them only when asked.
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
            capabilities=RunnerCapabilities(
                max_batch=None, refinement_updates=config.confidence_from_state is not None, rtc=bool(config.rtc),
                history_length=config.history_length),
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

    def run(
        self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False
    ) -> list[InferenceResult]:
        """Every request's `synthetic_actions` (and, when capturing with `confidence_from_state`, its
        faked updates), after checking them all and one sleep of `latency_s(len(requests))`.

        The single sleep is what makes the latency profile a batching model: a batch of 16 costs what
        the profile says, not 16 single calls.
        """
        for r in requests:
            check_observation(self.spec, r.state, r.images)
        if requests:
            delay_s = self.latency_s(len(requests))
            if delay_s > 0:
                time.sleep(delay_s)
        chunk, dim = self.spec.chunk_size, self.spec.action_dim
        index = self.config.confidence_from_state if capture_updates else None
        results = []
        for r in requests:
            if self.config.circle is not None:
                actions = circle_actions(r.state, chunk, dim, self.config.circle, 1.0 / self.config.fps)
            else:
                actions = synthetic_actions(r.state, r.images, chunk, dim)
            extras = {}
            rtc = r.extras.get(RTC_EXTRA) if self.config.rtc else None
            if rtc is not None:
                actions = rtc_continue(actions, rtc.prefix, rtc.delay_steps)
                extras[RTC_EXTRA_DELAY] = int(rtc.delay_steps)
            updates = None if index is None else synthetic_denoise_updates(r.state, index, chunk, dim)
            results.append(InferenceResult(actions, updates, extras))
        return results
