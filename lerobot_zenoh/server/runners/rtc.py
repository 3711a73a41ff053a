"""Real-time chunking with one delay per row: LeRobot's RTC guidance, weights built per request.

LeRobot's `RTCProcessor.denoise_step` takes one scalar ``inference_delay`` and one
``execution_horizon`` for the whole batch, and clamps the horizon to the prefix tensor's length. A
server batching robots with different delays and different leftovers needs both per row: here
``inference_delay`` and ``execution_horizon`` may be sequences of ints, one per row (the horizon
already clamped to that row's own prefix length, as LeRobot clamps it for a single call). The
prefix weights are then built per row with LeRobot's own `get_prefix_weights`, stacked to
``(B, T, 1)``; everything else (padding, the guidance "gradient", the guidance weight and its clamp)
is LeRobot's math, copied line for line. Scalar arguments go to LeRobot's method unchanged.

A row whose weights are all zero (no prefix: ``d = 0``, horizon 0) gets exactly the unguided
velocity plus ``0 * correction`` = its plain velocity.

The same processor also records the sampling's Euler steps on request (`recording_steps`), for the
flow-matching execution horizon. LeRobot's sampling loop (``lerobot.policies.common.flow_matching.
euler_integrate``, shared by SmolVLA, pi0 and pi0.5) calls ``rtc_processor.track(time=, x_t=, v_t=)``
after every step, with the sample *after* the step, whenever the model's processor reports
``is_debug_enabled()`` -- with or without RTC guidance. That debug hook is the only per-step seam
LeRobot offers (the loop is a local function: wrapping ``denoise_step`` would see the unguided
velocity only, and copying the loop would drift from LeRobot's); it only reads tensors, so the sample
is bit for bit the same. With RTC off the runner installs a processor on the model for that hook
alone (`install_step_recorder`): the model decides guidance from ``config.rtc_config`` (None then),
so its ``denoise_step`` is never called.

The closed form (compiled inference, `RowGuidance`). LeRobot 0.6.1 evaluates the velocity *before*
``x_t.requires_grad_()``, so ``x1_t = x_t - time * v_t`` depends on ``x_t`` through the identity only
and ``torch.autograd.grad(x1_t, x_t, err)`` returns ``err`` itself: the correction is the weighted
prefix error, ``(prefix - x1_t) * weights``. Computed that way (no autograd, no graph break) the
guidance compiles into the same graph as the sampling loop. Everything it needs is built on the
model's device once per batch, before the loop (`RowGuidance`: the padded prefix and the ``(B, T, 1)``
weights, gathered from a table of LeRobot's own `get_prefix_weights` made once at load); the
guidance weight of each Euler step depends on the step's time only and is a Python float from a
table made at load with LeRobot's own float32 expression (`guidance_weight`). Nothing in the loop
reads the host. The eager path (above) stays LeRobot's autograd math, the reference the closed form
is tested against.

Imported lazily by `flow_matching` (it imports lerobot and torch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lerobot.policies.rtc.modeling_rtc import RTCProcessor


class RowwiseRTCProcessor(RTCProcessor):
    """`RTCProcessor` whose `denoise_step` also takes one delay and one horizon per row, and which
    records the Euler steps' samples within `recording_steps` (module docstring)."""

    def __init__(self, rtc_config: Any, num_steps: int | None = None, chunk_size: int | None = None):
        super().__init__(rtc_config)
        self._steps: list | None = None
        # The closed form's tables (module docstring): the guidance weight of each Euler step's time,
        # and LeRobot's prefix weights for every (delay, horizon), moved to the device by `to`.
        self._guidance: dict[float, float] = {}
        self._weights_table: torch.Tensor | None = None
        if num_steps is not None and rtc_config.enabled:
            dt = -1.0 / num_steps  # the times LeRobot's euler_integrate gives its steps, bit for bit
            self._guidance = {1.0 + step * dt: guidance_weight(1.0 + step * dt, rtc_config.max_guidance_weight)
                              for step in range(num_steps)}
        if chunk_size is not None and rtc_config.enabled:
            # [delay, horizon] -> (chunk_size,) weights; LeRobot clamps the delay to the horizon.
            self._weights_table = torch.stack([
                torch.stack([self.get_prefix_weights(d, h, chunk_size) for h in range(chunk_size + 1)])
                for d in range(chunk_size + 1)]).float()

    def to(self, device: Any) -> RowwiseRTCProcessor:
        """The closed form's weight table on `device` (once, at load)."""
        if self._weights_table is not None:
            self._weights_table = self._weights_table.to(device)
        return self

    def row_guidance(self, prefix: torch.Tensor, rows: Sequence[int], delays: Sequence[int],
                     horizons: Sequence[int], width: int) -> RowGuidance:
        """The closed form's inputs for one batch, built on `prefix`'s device once, before the loop:
        the prefix (model space, ``(B, T, A)``) zeroed after each row's own length and padded with
        zeros to `width` dimensions (as LeRobot pads a leftover), and each row's ``(T, 1)`` weights
        for its delay and horizon (the horizon already clamped to the row's length: `row_horizons`).
        A row without a leftover (length 0) has all-zero weights: its velocity is left unguided."""
        if self._weights_table is None:
            raise ValueError("this processor was made without the closed form's tables (chunk_size)")
        device = prefix.device
        batch, total = prefix.shape[0], prefix.shape[1]
        # One host-to-device copy of the per-row integers; everything else is made on the device.
        ints = torch.tensor([list(rows), list(delays), list(horizons)], dtype=torch.long).to(device)
        kept = torch.arange(total, device=device)[None, :] < ints[0][:, None]
        prefix = torch.where(kept[..., None], prefix, torch.zeros((), dtype=prefix.dtype, device=device))
        if prefix.shape[2] < width:
            prefix = torch.nn.functional.pad(prefix, (0, width - prefix.shape[2]))
        weights = self._weights_table[torch.minimum(ints[1], ints[2]), ints[2]]
        if weights.shape != (batch, total):
            raise ValueError(f"weights for {batch} rows of {total} actions, got {tuple(weights.shape)}")
        return RowGuidance(prefix, weights.unsqueeze(-1))

    @contextmanager
    def recording_steps(self, steps: list) -> Iterator[None]:
        """Within the block, append the sample after each Euler step (a detached copy) to `steps`.

        The caller serializes sampling (one call at a time on this model: the runner's lock)."""
        self._steps = steps
        try:
            yield
        finally:
            self._steps = None

    def is_debug_enabled(self) -> bool:
        return self._steps is not None or super().is_debug_enabled()

    def track(self, time, x_t=None, v_t=None, **kwargs) -> None:
        # The sampling loop's call carries x_t and v_t; the guidance's own call (below) neither.
        if self._steps is not None and x_t is not None and v_t is not None:
            self._steps.append(x_t.detach().clone())
        super().track(time, x_t=x_t, v_t=v_t, **kwargs)  # LeRobot's debug tracker, when configured

    def denoise_step(self, x_t, prev_chunk_left_over, inference_delay, time, original_denoise_step_partial,
                     execution_horizon=None) -> torch.Tensor:
        if isinstance(inference_delay, torch.Tensor):  # the closed form: `RowGuidance.kwargs`
            return self._closed_form(x_t, prev_chunk_left_over, inference_delay, time, original_denoise_step_partial)
        if not isinstance(inference_delay, Sequence):
            return super().denoise_step(x_t, prev_chunk_left_over, inference_delay, time,
                                        original_denoise_step_partial, execution_horizon)
        if prev_chunk_left_over is None:
            return original_denoise_step_partial(x_t)
        delays, horizons = tuple(inference_delay), tuple(execution_horizon)
        if x_t.ndim != 3 or prev_chunk_left_over.ndim != 3:
            raise ValueError(f"per-row RTC needs (B, T, A) tensors, got {tuple(x_t.shape)} and "
                             f"{tuple(prev_chunk_left_over.shape)}")
        batch_size, action_chunk_size, action_dim = x_t.shape
        if len(delays) != batch_size or len(horizons) != batch_size:
            raise ValueError(f"{len(delays)} delays and {len(horizons)} horizons for a batch of {batch_size}")

        tau = 1 - time
        x_t = x_t.clone().detach()
        if prev_chunk_left_over.shape[1] < action_chunk_size or prev_chunk_left_over.shape[2] < action_dim:
            padded = torch.zeros(batch_size, action_chunk_size, action_dim).to(x_t.device)
            padded[:, : prev_chunk_left_over.shape[1], : prev_chunk_left_over.shape[2]] = prev_chunk_left_over
            prev_chunk_left_over = padded
        assert prev_chunk_left_over.shape == x_t.shape, (
            "The padded previous chunk must be the same size as the input tensor"
        )
        # The one change: (B, T, 1) weights, row i from its own delay and horizon.
        weights = torch.stack([self.get_prefix_weights(int(d), int(h), action_chunk_size)
                               for d, h in zip(delays, horizons, strict=True)]).to(x_t.device).unsqueeze(-1)

        with torch.enable_grad():
            v_t = original_denoise_step_partial(x_t)
            x_t.requires_grad_(True)

            x1_t = x_t - time * v_t  # noqa: N806
            err = (prev_chunk_left_over - x1_t) * weights
            grad_outputs = err.clone().detach()
            correction = torch.autograd.grad(x1_t, x_t, grad_outputs, retain_graph=False)[0]

        max_guidance_weight = torch.as_tensor(self.rtc_config.max_guidance_weight)
        tau_tensor = torch.as_tensor(tau)
        squared_one_minus_tau = (1 - tau_tensor) ** 2
        inv_r2 = (squared_one_minus_tau + tau_tensor**2) / (squared_one_minus_tau)
        c = torch.nan_to_num((1 - tau_tensor) / tau_tensor, posinf=max_guidance_weight)
        guidance_weight = torch.nan_to_num(c * inv_r2, posinf=max_guidance_weight)
        guidance_weight = torch.minimum(guidance_weight, max_guidance_weight)

        result = v_t - guidance_weight * correction
        self.track(time=time, x1_t=x1_t, correction=correction, err=err, weights=weights,
                   guidance_weight=guidance_weight, inference_delay=delays, execution_horizon=horizons)
        return result


    def _closed_form(self, x_t: torch.Tensor, prefix: torch.Tensor, weights: torch.Tensor, time: float,
                     original_denoise_step_partial: Any) -> torch.Tensor:
        """LeRobot's guided velocity without autograd (module docstring): `prefix` ``(B, T, A)`` and
        `weights` ``(B, T, 1)`` from `row_guidance`, on the device; the guidance weight a constant."""
        v_t = original_denoise_step_partial(x_t)
        x1_t = x_t - time * v_t  # noqa: N806
        # d(x1_t)/d(x_t) is the identity (v_t was evaluated on x_t, not through it): correction = err.
        correction = (prefix - x1_t) * weights
        weight = self._guidance.get(time)
        if weight is None:  # a time the tables were not made for (another step count): LeRobot's expression
            weight = guidance_weight(time, self.rtc_config.max_guidance_weight)
        if self.tracker is not None:  # LeRobot's debug tracker (eager use only)
            self.track(time=time, x1_t=x1_t, correction=correction, err=correction, weights=weights,
                       guidance_weight=weight)
        return v_t - weight * correction


@dataclass(frozen=True)
class RowGuidance:
    """The closed form's per-batch inputs (`RowwiseRTCProcessor.row_guidance`), on the device."""

    prefix: torch.Tensor  # (B, T, max_action_dim), model space, zero after each row's leftover
    weights: torch.Tensor  # (B, T, 1)

    def kwargs(self) -> dict[str, torch.Tensor]:
        """The keywords ``predict_action_chunk`` forwards to the processor's `denoise_step` (a tensor
        as ``inference_delay`` selects the closed form): tensors only, batch on dim 0, so that the
        compiled graphs pad them with the batch."""
        return {"prev_chunk_left_over": self.prefix, "inference_delay": self.weights}


def guidance_weight(time: float, max_guidance_weight: float) -> float:
    """The guidance weight LeRobot's `RTCProcessor.denoise_step` applies at `time`, computed with its
    own float32 expression (then exact as a Python float)."""
    max_w = torch.as_tensor(max_guidance_weight)
    tau = torch.as_tensor(1 - time)
    squared_one_minus_tau = (1 - tau) ** 2
    inv_r2 = (squared_one_minus_tau + tau**2) / squared_one_minus_tau
    c = torch.nan_to_num((1 - tau) / tau, posinf=max_w)
    weight = torch.nan_to_num(c * inv_r2, posinf=max_w)
    return float(torch.minimum(weight, max_w))


def install(policy: Any) -> RowwiseRTCProcessor:
    """Replace the RTC processor LeRobot built from ``policy.config.rtc_config`` (SmolVLA, pi0, pi0.5:
    ``policy.init_rtc_processor()`` at construction, shared with ``policy.model``) by a
    `RowwiseRTCProcessor` with the same config, where both read it."""
    config = policy.config.rtc_config
    if config is None or not config.enabled:
        raise ValueError("the policy's config has no enabled rtc_config")
    processor = RowwiseRTCProcessor(config, num_steps=_num_steps(policy.config),
                                    chunk_size=int(policy.config.chunk_size))
    policy.rtc_processor = processor
    policy.model.rtc_processor = processor  # sample_actions reads the model's
    return processor


def install_step_recorder(policy: Any) -> RowwiseRTCProcessor:
    """With RTC off (``policy.config.rtc_config`` None): a processor on the model only, for the
    Euler-step hook (`RowwiseRTCProcessor.recording_steps`). Guidance stays off: the model reads
    ``config.rtc_config``, not the processor, to decide it."""
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    if policy.config.rtc_config is not None and policy.config.rtc_config.enabled:
        raise ValueError("RTC is enabled: use install(), whose processor records steps too")
    processor = RowwiseRTCProcessor(RTCConfig(enabled=False))
    policy.model.rtc_processor = processor  # sample_actions passes the model's to euler_integrate
    return processor


def row_horizons(prefix_rows: Sequence[int], execution_horizon: int) -> tuple[int, ...]:
    """Each row's execution horizon: the configured one, clamped to that row's prefix length (what
    LeRobot's `denoise_step` does for a single call with an unpadded prefix)."""
    return tuple(min(int(execution_horizon), int(n)) for n in prefix_rows)


def _num_steps(config: Any) -> int | None:
    """The Euler steps of the model's sampling loop (pi0/pi0.5: ``num_inference_steps``; SmolVLA: ``num_steps``)."""
    for name in ("num_inference_steps", "num_steps"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
