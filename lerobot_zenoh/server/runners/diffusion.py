"""Diffusion (LeRobot ``diffusion``): per-session observation history, per-request seeded noise, and
the denoising loop's per-step updates on request."""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from lerobot_zenoh.errors import PolicyError
from lerobot_zenoh.server.runners.base import (
    OBS_STATE_KEY,
    InferenceRequest,
    RunnerCapabilities,
    check_observation,
)
from lerobot_zenoh.server.runners.lerobot import LeRobotRunner

if TYPE_CHECKING:
    import torch


class DiffusionRunner(LeRobotRunner):
    """Diffusion with per-session observation history and per-request noise.

    LeRobot's DiffusionPolicy keeps one observation queue inside the model (filled by
    ``select_action``) and samples from the global RNG. Here each session has its own deque of its last
    ``n_obs_steps`` preprocessed observations (padded by repeating the first, as LeRobot's
    ``populate_queues`` does), and sampling uses a ``torch.Generator`` seeded with the request's `seed`,
    passed to ``DiffusionModel.conditional_sample`` (initial noise and every DDPM step). The policy's own
    queues are never filled, and ``generate_actions`` is re-done here only to pass the generator.
    ``conditional_sample`` re-sets the shared scheduler's timesteps to the same value on every call;
    `_model_lock` keeps concurrent calls from interleaving inside it.

    `run` serves its requests one after another (the inherited loop): each request samples from its
    own seeded generator and conditions on its own session's history, and ``conditional_sample`` takes
    one generator for the whole batch, so a true batch would have to re-implement the sampling loop
    with per-row noise. The loop keeps the results exact; it saves nothing.

    With ``capture_updates`` it also returns the per-step denoising updates (for the
    diffusion-confidence horizon). They are recorded by wrapping the shared noise scheduler's ``step``
    for the duration of one ``conditional_sample`` call (under `_model_lock`): LeRobot's own sampling
    loop runs unchanged, and the wrapper only reads ``prev_sample - sample``, so the chunk is bit for
    bit the one without capture (tested).
    """

    not_compiled = ("its sampling loop is re-done here per request with a seeded generator and a scheduler "
                    "shared inside the model, one request per pass")


    @classmethod
    def capabilities_for(cls, config: Any) -> RunnerCapabilities:
        return RunnerCapabilities(max_batch=None, history_length=int(config.n_obs_steps), refinement_updates=True)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        cfg = self.policy.config
        if cfg.env_state_feature is not None:  # _spec_from_config already rejects it
            raise PolicyError(f"{self.path}: environment-state inputs are not supported")
        self._n_obs_steps = int(cfg.n_obs_steps)
        self._image_keys = list(cfg.image_features)
        self._histories: dict[str, dict[str, deque]] = {}
        self._history_lock = threading.Lock()
        self._model_lock = threading.Lock()

    def forget(self, session_id: str) -> None:
        with self._history_lock:
            self._histories.pop(session_id, None)

    def _chunk(self, request: InferenceRequest, batch: dict[str, Any], updates: list | None) -> torch.Tensor:
        import torch
        from lerobot.policies.utils import populate_queues

        step = self._step(batch)
        if request.history:
            # The client's own frames, 1/fps apart: a pure function of the request; the session's
            # served observations are neither read nor written.
            history = {k: deque(maxlen=self._n_obs_steps) for k in step}
            for past_state, past_images in request.history[-(self._n_obs_steps - 1):]:
                check_observation(self.spec, past_state, past_images)
                populate_queues(history, self._step(self._preprocess(past_state, past_images, request.task)))
            populate_queues(history, step)
            stacked = {k: torch.stack(list(q), dim=1) for k, q in history.items()}
        else:
            with self._history_lock:
                history = self._histories.get(request.session_id)
                if history is None:
                    history = {k: deque(maxlen=self._n_obs_steps) for k in step}
                    self._histories[request.session_id] = history
                populate_queues(history, step)
                stacked = {k: torch.stack(list(q), dim=1) for k, q in history.items()}

        model = self.policy.diffusion
        generator = torch.Generator(device=self.device).manual_seed(int(request.seed))
        start = self._n_obs_steps - 1
        window = slice(start, start + self.policy.config.n_action_steps)
        with self._model_lock:
            global_cond = model._prepare_global_conditioning(stacked)
            if updates is None:
                sample = model.conditional_sample(1, global_cond=global_cond, generator=generator)
            else:
                with _recording_steps(model.noise_scheduler, updates, window):
                    sample = model.conditional_sample(1, global_cond=global_cond, generator=generator)
        return sample[:, window]


    def _step(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One preprocessed observation as the history holds it: state + stacked images."""
        import torch

        step = {OBS_STATE_KEY: batch[OBS_STATE_KEY]}
        if self._image_keys:
            # Same stacking as DiffusionPolicy.select_action: (B, n_cameras, C, H, W).
            step["observation.images"] = torch.stack([batch[k] for k in self._image_keys], dim=-4)
        return step


class _recording_steps:
    """Within the block, ``scheduler.step`` also appends ``prev_sample - sample`` (batch row 0, the
    action `window`) to `updates`; afterwards the class's own ``step`` is visible again.

    The wrapper is an instance attribute shadowing the class method, so it touches nothing else and
    leaves every argument and result (and the generator's draws) exactly as they were.
    """

    def __init__(self, scheduler: Any, updates: list, window: slice):
        self.scheduler, self.updates, self.window = scheduler, updates, window

    def __enter__(self) -> None:
        original = self.scheduler.step  # the bound class method
        updates, window = self.updates, self.window

        def step(model_output, timestep, sample, *args, **kwargs):
            out = original(model_output, timestep, sample, *args, **kwargs)
            prev = out.prev_sample if hasattr(out, "prev_sample") else out[0]
            updates.append((prev - sample)[0, window].detach().clone())
            return out

        self.scheduler.step = step

    def __exit__(self, *exc_info) -> None:
        vars(self.scheduler).pop("step", None)
