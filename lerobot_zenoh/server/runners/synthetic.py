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
against (benchmarks/studies/rtc.py).

For multi-model tasks (docs/pipelines.md) it also stands in for the other components, with scripted
answers counted per session (request k = the k-th request of that session since it opened or its
episode began, so the purity invariant holds):

- `output: text` (System 2): the next subtask from `subtasks`, advancing every `advance_every`
  requests, cycling (or holding the last one);
- `output: verdict` (safety, monitor): a label sequence (`verdicts`) and single overrides
  (`verdict_at`, e.g. ``{7: unsafe}``), with an optional `score`;
- `silent_after: N`: answer the first N requests of a session, then withhold every answer (a component
  that stops answering, for fallback tests);
- `echo_task` (System 1): the chunk's last action dimension is `task_code(task)`, so a test can read
  off a chunk which task string conditioned it (System 2's text reaching System 1).
"""

from __future__ import annotations

import bisect
import math
import time
import zlib
from collections.abc import Sequence
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, ValidationInfo, field_validator

from lerobot_zenoh.config import Settings, VerdictsByRequest, VerdictSequence
from lerobot_zenoh.errors import ConfigError, PolicyError, ProtocolError
from lerobot_zenoh.server.runners.base import (
    COMPONENT_EXTRA,
    RTC_EXTRA,
    RTC_EXTRA_DELAY,
    BaseRunner,
    InferenceRequest,
    InferenceResult,
    PolicySpec,
    RunnerCapabilities,
    check_observation,
)
from lerobot_zenoh.protocol.reasons import OutputKind, Reason

#: Denoising steps of the faked updates (`synthetic_denoise_updates`).
SYNTHETIC_DENOISE_STEPS = 4
#: Distinct values of `task_code` (a power of two: each is exact in float32).
TASK_CODES = 1 << 16


def task_code(task: str) -> float:
    """What `echo_task` writes into the last action dimension of every row: ``crc32(task) mod 2**16``
    divided by ``2**16``, in [0, 1), exact in float32 (compare with ``==``)."""
    return (zlib.crc32(task.encode()) % TASK_CODES) / TASK_CODES


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


class CircleMotion(Settings):
    """A scripted smooth motion (`circle_actions`): one turn every `period_s`, joints at `amplitude`,
    commands `lead_steps` control periods ahead of the phase the state shows (a first-order joint lags
    its target: with time constant tau, by about ``atan(2 pi tau / period_s)`` radians)."""

    config_prefix = "circle"

    period_s: float = Field(4.0, gt=0, allow_inf_nan=False)
    amplitude: float = Field(40.0, gt=0, allow_inf_nan=False)
    lead_steps: float = Field(3.0, allow_inf_nan=False)


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


#: Settings that apply to one output only -> that output.
_ONLY_FOR = {"subtasks": "text", "verdicts": "verdict", "verdict_at": "verdict", "score": "verdict",
             "echo_task": "actions", "circle": "actions", "rtc": "actions", "confidence_from_state": "actions"}


class SyntheticPolicyConfig(Settings):
    """The synthetic policy: its shape, its simulated inference time and its script. A manifest
    entry's `synthetic:` block is this class (docs/server.md, "Manifest reference").

    `latency_ms` is the time one `run` on one request sleeps. `batch_latency_ms` optionally profiles
    batched inference ({batch size: ms per batch}); see `SyntheticPolicy.latency_s`.
    `confidence_from_state` (a state index, or None) makes the policy declare refinement updates and
    report, when asked (``run(..., capture_updates=True)``), updates that trust the first
    ``round(state[index])`` actions (`synthetic_denoise_updates`): a simulation knob for the
    ``diffusion_confidence`` horizon (docs/scheduling.md).
    """

    state_dim: int = Field(6, ge=1)
    action_dim: int = Field(6, ge=1)
    chunk_size: int = Field(50, ge=1)
    cameras: dict[str, tuple[int, int]] = Field(default_factory=lambda: {"front": (96, 128)})
    # What the policy answers (multi-model components, module docstring); the script follows below.
    output: Literal["actions", "text", "verdict"] = "actions"
    latency_ms: float = Field(0.0, ge=0, allow_inf_nan=False)
    batch_latency_ms: dict[Annotated[int, Field(ge=1)], Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = \
        Field(None, min_length=1)
    confidence_from_state: int | None = Field(None, ge=0, strict=True)
    # Declare real-time chunking: the chunk's first delay_steps rows are the observation's prefix
    # (`rtc_continue`; the status then advertises rtc).
    rtc: bool = Field(False, strict=True)
    # Declare a model that conditions on this many consecutive observations (the status then asks
    # clients for their last history_length - 1 frames; the synthetic actions ignore them).
    history_length: int = Field(1, ge=1, le=17, strict=True)
    # A scripted smooth motion instead of `synthetic_actions` (benchmarks/studies/rtc.py records from it).
    circle: CircleMotion | None = None
    # The script of a text or verdict component.
    subtasks: tuple[Annotated[str, Field(min_length=1)], ...] = ()  # text: the script (empty: "subtask <i>")
    advance_every: int = Field(1, ge=1, strict=True)  # requests per entry of `subtasks` / `verdicts`
    cycle: bool = Field(True, strict=True)  # after the last entry: start again, else keep the last
    verdicts: VerdictSequence = ()  # verdict: one label per `advance_every` requests
    verdict_at: VerdictsByRequest = Field(default_factory=dict)  # verdict: request k (1-based) -> label
    score: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # verdict: sent with every label
    silent_after: int | None = Field(None, ge=0, strict=True)  # withhold every answer after a session's first N
    echo_task: bool = Field(False, strict=True)  # actions: the last dimension is task_code(task)
    # A VLA's task token limit, simulated: a task of more words than this is refused (task_too_long),
    # as a flow-matching VLA refuses one its tokenizer makes too long. None: any task.
    max_task_tokens: int | None = Field(None, ge=1, strict=True)

    @field_validator(*_ONLY_FOR)
    @classmethod
    def _fits_output(cls, value, info: ValidationInfo):
        # Fields are validated in order: `output` (declared before these) is known unless it was bad.
        output, wants = info.data.get("output"), _ONLY_FOR[info.field_name]
        if value not in (None, False, (), {}) and output is not None and output != wants:
            raise ValueError(f"does not apply to output {output!r} (only to {wants!r})")
        return value

    @field_validator("circle", "confidence_from_state")
    @classmethod
    def _state_index(cls, value, info: ValidationInfo):
        state_dim = info.data.get("state_dim")
        if value is None or state_dim is None:
            return value
        if info.field_name == "circle" and state_dim < 2:
            raise ValueError(f"needs state_dim >= 2 (its phase is read from state[0:2]), got {state_dim}")
        if info.field_name == "confidence_from_state" and value >= state_dim:
            raise ValueError(f"{value} is not a state index (state_dim is {state_dim})")
        return value

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(f"state_{i}" for i in range(self.state_dim))

    @property
    def action_names(self) -> tuple[str, ...]:
        return tuple(f"action_{i}" for i in range(self.action_dim))


class SyntheticPolicy(BaseRunner):
    """A `PolicyRunner` returning `synthetic_actions` after sleeping the configured latency.

    Stateless across calls, hence pure across sessions; `seed` and the task are accepted and ignored.
    Takes any number of requests per `run` (one sleep of `latency_s(n)` for the call). Declares
    refinement updates only with `config.confidence_from_state`, and reports them only when asked.
    """

    def __init__(self, config: SyntheticPolicyConfig, *, fps: int | None = None):
        """`fps`: the control rate the robots run at (the manifest entry's); `circle` needs it."""
        if config.circle is not None and not fps:
            raise ConfigError("circle", "needs the control rate (fps)")
        self.config = config
        self.fps = fps
        self.spec = PolicySpec(
            policy_type="synthetic",
            state_names=config.state_names,
            cameras=dict(config.cameras),
            action_names=config.action_names,
            chunk_size=config.chunk_size,
            fps=fps,
            capabilities=RunnerCapabilities(
                max_batch=None, refinement_updates=config.confidence_from_state is not None, rtc=bool(config.rtc),
                history_length=config.history_length, reads_task=bool(config.echo_task), output=config.output),
        )
        self._requests: dict[str, int] = {}  # session -> requests seen (the script's position)
        self.max_task_tokens = config.max_task_tokens  # (the status says it)
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
            k = self._requests[r.session_id] = self._requests.get(r.session_id, 0) + 1
            if self.config.silent_after is not None and k > self.config.silent_after:
                results.append(InferenceResult(silent=True))
                continue
            if self.config.output == OutputKind.TEXT:
                results.append(InferenceResult.of_text(self.subtask(k)))
                continue
            if self.config.output == OutputKind.VERDICT:
                results.append(InferenceResult.of_verdict(self.verdict(k, r.extras.get(COMPONENT_EXTRA)),
                                                          self.config.score))
                continue
            if self.config.circle is not None:
                actions = circle_actions(r.state, chunk, dim, self.config.circle, 1.0 / self.fps)
            else:
                actions = synthetic_actions(r.state, r.images, chunk, dim)
            extras = {}
            rtc = r.extras.get(RTC_EXTRA) if self.config.rtc else None
            if rtc is not None:
                actions = rtc_continue(actions, rtc.prefix, rtc.delay_steps)
                extras[RTC_EXTRA_DELAY] = int(rtc.delay_steps)
            if self.config.echo_task:
                actions[:, -1] = task_code(r.task)
            updates = None if index is None else synthetic_denoise_updates(r.state, index, chunk, dim)
            results.append(InferenceResult(actions, updates, extras))
        return results

    def count_task_tokens(self, task: str) -> int:
        """A word counts as a token (any thread)."""
        return len(task.split())

    def check_request(self, request: InferenceRequest) -> None:
        """`task_too_long` for a task of more words than `max_task_tokens` (a word counts as a token)."""
        n = self.count_task_tokens(request.task)
        if self.max_task_tokens is not None and n > self.max_task_tokens:
            raise ProtocolError(Reason.TASK_TOO_LONG,
                                f"the task is {n} tokens, synthetic reads at most {self.max_task_tokens}")

    def forget(self, session_id: str) -> None:
        """A closed session or a new episode: its script starts again."""
        self._requests.pop(session_id, None)

    def _entry(self, script: Sequence[str], k: int) -> str:
        i = (k - 1) // self.config.advance_every
        return script[i % len(script)] if self.config.cycle else script[min(i, len(script) - 1)]

    def subtask(self, k: int) -> str:
        """The text answer to a session's k-th request (1-based)."""
        if self.config.subtasks:
            return self._entry(self.config.subtasks, k)
        i = (k - 1) // self.config.advance_every
        return f"subtask {i}"

    def verdict(self, k: int, component=None) -> str:
        """The label answering a session's k-th request (1-based): `verdict_at`, else `verdicts`, else the
        first label the component asks for (its task's label set), else ``safe``."""
        if k in self.config.verdict_at:
            return self.config.verdict_at[k]
        if self.config.verdicts:
            return self._entry(self.config.verdicts, k)
        labels = component.labels if component is not None else ()
        return labels[0] if labels else "safe"
