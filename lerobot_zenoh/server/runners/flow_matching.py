"""Language-conditioned flow-matching VLAs (LeRobot ``smolvla``, ``pi0``, ``pi05``): true batching
with per-request noise, local assets for offline servers.

One runner serves the three families, which LeRobot exposes the same way: a tokenizer step in the
saved preprocessor, ``predict_action_chunk(batch, noise=...)`` sampling ``chunk_size`` actions from
noise of shape ``(B, chunk_size, max_action_dim)`` with ``num_steps`` Euler steps.

Serving (`run`): every request of the call is turned into LeRobot's rollout frame, the frames are
stacked, and the saved preprocessor runs **once** on the stacked batch with the list of task strings
(SmolVLA pads tokens to the longest task of the call: preprocessing rows one by one and concatenating
would not even line up). Each row's noise is drawn from a ``torch.Generator`` seeded with that
request's `seed` alone, so a row's chunk does not depend on who else is in the batch, and the global
RNG is never used. One lock covers preprocess -> model -> postprocess: pi0's relative-action steps
share state between the pre- and the postprocessor, and SmolVLA's ``predict_action_chunk`` writes its
observation queues (of length ``n_obs_steps`` = 1, so they hold the current batch only).
``torch.no_grad`` rather than ``inference_mode``: LeRobot's real-time chunking needs autograd.

Real-time chunking (`LoadOptions.rtc` enabled; docs/policies.md, "Real-time chunking"): per row,
inside the one forward pass. A request's prefix (``extras[RTC_EXTRA]``, robot units) goes through
the same preprocessor call as the observations, as the batch's ``action`` (zero rows pad it to the
chunk): the checkpoint's own relative-action and normalizer steps turn it into model space, exactly
as they turn a training action. Each row then gets its own delay and its own execution horizon
(clamped to its prefix length) from `runners.rtc.RowwiseRTCProcessor`, installed on the policy in
place of LeRobot's one-delay processor. A call in which no request has a prefix is plain sampling.
Compiled (`LoadOptions.compile`), every call takes the guidance in closed form inside the graph, its
inputs built on the device once per call (`RowwiseRTCProcessor.row_guidance`; a call without any
prefix has all weights zero); uncompiled, the guidance is LeRobot's own autograd step.

Refinement updates (``run(..., capture_updates=True)``, for the execution horizon): the change each
Euler step made to each row's sample, recorded through LeRobot's per-step hook by the processor
`runners.rtc` installs on the model (with RTC off, one for the hook alone); the chunk is bit for bit
the uncaptured one (docs/policies.md, "Refinement (denoising) updates").

Assets (`LoadOptions`): a checkpoint names its tokenizer (``policy_preprocessor.json``) and, for
SmolVLA, its VLM config + processor (``vlm_model_name``) but does not hold them. Each is looked up as
the manifest's ``tokenizer_path`` / ``vlm_path``, then the checkpoint sidecar's ``assets`` (what
``lerobot-zenoh-build-checkpoint`` writes), then the named folder or Hugging Face cache entry; the
server never downloads. Not found: one `PolicyError` naming the asset and the manifest field.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from lerobot_zenoh.errors import PolicyError, ProtocolError
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.runners.base import (
    RTC_EXTRA,
    RTC_EXTRA_DELAY,
    InferenceRequest,
    InferenceResult,
    RunnerCapabilities,
    check_observation,
)
from lerobot_zenoh.server.runners.lerobot import ACTION_KEY, FEATURES_SIDECAR_NAME, LeRobotRunner, LoadOptions

log = logging.getLogger(__name__)

_PREPROCESSOR_JSON = "policy_preprocessor.json"
_TOKENIZER_STEP = "tokenizer_processor"


class FlowMatchingRunner(LeRobotRunner):
    """SmolVLA, pi0 and pi0.5 behind the runner seam (see the module docstring)."""

    supported_dtypes = ("float32", "bfloat16")
    supports_rtc = True
    not_compiled = ""

    @classmethod
    def chunk_size_for(cls, config: Any) -> int:
        return int(config.chunk_size)

    @classmethod
    def capabilities_for(cls, config: Any) -> RunnerCapabilities:
        rtc = config.rtc_config is not None and bool(config.rtc_config.enabled)  # set by prepare_config
        return RunnerCapabilities(max_batch=None, history_length=int(config.n_obs_steps), reads_task=True, rtc=rtc,
                                  refinement_updates=True, refinement_kind="flow_matching")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        from lerobot.processor import TokenizerProcessorStep

        steps = [s for s in self.preprocessor.steps if isinstance(s, TokenizerProcessorStep)]
        if len(steps) != 1:
            raise PolicyError(f"{self.path}: expected one tokenizer step in {_PREPROCESSOR_JSON}, found {len(steps)}")
        self._tokenizer = steps[0].input_tokenizer
        self.max_task_tokens = int(steps[0].max_length)
        # A copy for `count_task_tokens` (the status responder's thread): a fast tokenizer's call sets
        # its truncation and padding, so one instance shared by two threads can fail ("Already borrowed").
        self._counting_tokenizer = copy.deepcopy(self._tokenizer)
        self._counting_lock = threading.Lock()
        self._max_action_dim = int(self.policy.config.max_action_dim)
        self._lock = threading.Lock()
        self._rtc_horizon: int | None = None
        from lerobot_zenoh.server.runners import rtc

        if self.spec.capabilities.rtc:
            self._step_recorder = rtc.install(self.policy).to(self.device)
            self._rtc_horizon = int(self.policy.config.rtc_config.execution_horizon)
        else:
            self._step_recorder = rtc.install_step_recorder(self.policy)
        import torch

        from lerobot_zenoh.server.runners.compiled import enable_tf32

        enable_tf32(self.device, any(p.dtype == torch.bfloat16 for p in self.policy.parameters()), self.path.name)

    # -- loading -----------------------------------------------------------------------------------

    @classmethod
    def prepare_config(cls, path: Path, config: Any, options: LoadOptions) -> None:
        if int(config.n_obs_steps) != 1:
            # SmolVLA keeps observation queues inside the shared model; longer ones would mix sessions.
            raise PolicyError(f"{path}: n_obs_steps {config.n_obs_steps} is not supported for {config.type} (1 only)")
        _configure_rtc(path, config, options)
        if config.type in ("pi0", "pi05"):
            # LeRobot's own mixed precision (vision tower and norms stay float32).
            from lerobot_zenoh.server.runners.lerobot import DTYPES

            config.dtype = DTYPES[options.dtype]
        if config.type == "smolvla":
            extras = sidecar_extras(path)
            named = config.vlm_model_name
            folder = resolve_asset(path, "VLM config and processor", named, "config.json's vlm_model_name",
                                   options.vlm_path, extras.get("assets", {}).get("vlm"),
                                   options.field("vlm_path"), "config.json")
            config.vlm_model_name = str(folder)
            # The VLM's weights are in the checkpoint's model.safetensors (checked after loading):
            # never fetch them again from the VLM folder or the hub.
            config.load_vlm_weights = False

    @classmethod
    def policy_class(cls, path: Path, config: Any) -> type:
        return declared_policy_class(path, config)

    @classmethod
    def cast_policy(cls, policy: Any, dtype: Any) -> None:
        if policy.config.type == "smolvla":
            # As LeRobot runs a SmolVLA whose VLM it loads in bfloat16: the VLM and the action expert
            # in `dtype` (they cast their inputs to each layer's dtype), the state/action projections
            # in float32 (SmolVLA casts the expert's output back to float32 before them).
            policy.model.vlm_with_expert.to(dtype)
        # pi0/pi05 were built with config.dtype (LeRobot keeps their vision path in float32)

    @classmethod
    def preprocessor_overrides(cls, path: Path, config: Any, options: LoadOptions) -> dict[str, Any]:
        named = _tokenizer_name(path)
        extras = sidecar_extras(path)
        bundled = extras.get("assets", {}).get("tokenizer")
        if options.tokenizer_path is None and bundled is None and config.type == "smolvla":
            bundled = config.vlm_model_name  # SmolVLA's tokenizer is its VLM processor's (resolved above)
        folder = resolve_asset(path, "tokenizer", named, f"{_PREPROCESSOR_JSON}'s {_TOKENIZER_STEP}",
                               options.tokenizer_path, bundled, options.field("tokenizer_path"),
                               "tokenizer_config.json")
        step: dict[str, Any] = {"tokenizer_name": str(folder)}
        if options.compile.enabled:
            # Static shapes for the compiled graphs: SmolVLA's saved step pads to the longest task of
            # the call; every task padded to the tokenizer's max_length instead (pi0/pi0.5 already do).
            step["padding"] = "max_length"
        return {_TOKENIZER_STEP: step}

    @classmethod
    def file_key_candidates(cls, key: str) -> tuple[str, ...]:
        # pi0's from_pretrained also maps openpi's time_mlp_* names (`_fix_pytorch_state_dict_keys`).
        out = [key, f"model.{key}"]
        for old, new in (("time_mlp_in.", "action_time_mlp_in."), ("time_mlp_out.", "action_time_mlp_out.")):
            if key.startswith(old) or key.startswith(f"model.{old}"):
                out.append("model." + key.removeprefix("model.").replace(old, new, 1))
        return tuple(out)

    # -- serving -----------------------------------------------------------------------------------

    def check_request(self, request: InferenceRequest) -> None:
        """`ProtocolError(Reason.TASK_TOO_LONG)` when the task takes more tokens than the model reads.

        LeRobot's tokenizer step would silently truncate it (``truncation=True``); a cut instruction
        may mean another task, so it is refused instead. Counted as the step tokenizes it (with the
        newline LeRobot appends and the tokenizer's special tokens). pi0.5 also writes the discretized
        state into its prompt; those tokens are not counted here (LeRobot truncates them).
        """
        n = _task_tokens(self._tokenizer, request.task)
        if n > self.max_task_tokens:
            raise ProtocolError(Reason.TASK_TOO_LONG,
                                f"the task is {n} tokens, {self.spec.policy_type} reads at most {self.max_task_tokens}")
        self._rtc_inputs(request)

    def count_task_tokens(self, task: str) -> int:
        """The tokens `check_request` counts for `task` (any thread: the status responder asks)."""
        with self._counting_lock:
            return _task_tokens(self._counting_tokenizer, task)

    def _rtc_inputs(self, request: InferenceRequest) -> Any:
        """The request's RTC inputs (None without), checked against the model: `ProtocolError`
        (``bad_rtc_prefix``/``bad_rtc_delay``) for what the runner adapter and the codec also refuse, so
        that a request built elsewhere cannot fail a whole batch either."""
        rtc = request.extras.get(RTC_EXTRA) if self._rtc_horizon is not None else None
        if rtc is None:
            return None
        prefix = np.asarray(rtc.prefix)
        if prefix.ndim != 2 or prefix.shape[1] != self.spec.action_dim or len(prefix) > self.spec.chunk_size:
            raise ProtocolError(Reason.BAD_RTC_PREFIX, f"rtc.prefix has shape {prefix.shape}, expected (n <= "
                                                  f"{self.spec.chunk_size}, {self.spec.action_dim})")
        if prefix.dtype.kind != "f" or not np.all(np.isfinite(prefix)):
            raise ProtocolError(Reason.BAD_RTC_PREFIX, "rtc.prefix must hold finite floats")
        delay = rtc.delay_steps
        if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) or not 0 <= delay <= len(prefix):
            raise ProtocolError(Reason.BAD_RTC_DELAY, f"rtc.delay_steps={delay!r} outside 0..{len(prefix)}")
        return rtc

    def run(
        self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False
    ) -> list[InferenceResult]:
        """One forward pass for the whole call (see the module docstring); row `i` equals
        ``run([requests[i]])`` within float tolerance, and a request alone is bit for bit the same
        whatever was served before."""
        import torch

        if not requests:
            return []
        rtc_rows = []
        for r in requests:
            check_observation(self.spec, r.state, r.images)
            try:
                rtc_rows.append(self._rtc_inputs(r))
            except ProtocolError as exc:
                raise PolicyError(f"session {r.session_id}: {exc}") from exc
        rows = [0 if rtc is None else len(rtc.prefix) for rtc in rtc_rows]
        delays = [0 if rtc is None else int(rtc.delay_steps) for rtc in rtc_rows]
        guided = any(rows)  # no prefix anywhere: plain sampling, bit for bit
        try:
            with self._lock, torch.no_grad():  # not inference_mode: RTC guidance runs autograd
                observation = self._stack(requests)
                if guided:
                    observation[ACTION_KEY] = self._prefix_batch(rtc_rows)
                batch = self.preprocessor(observation)
                noise = torch.stack([self._noise(r.seed) for r in requests]).to(self.device)
                steps: list | None = [] if capture_updates else None
                compiled = self._compiled is not None and self._compiled.active and steps is None
                kwargs: dict[str, Any] = {}
                if self._rtc_horizon is not None and (guided or compiled):
                    from lerobot_zenoh.server.runners.rtc import row_horizons

                    horizons = row_horizons(rows, self._rtc_horizon)
                    prefix = batch.pop(ACTION_KEY, None)
                    if prefix is None:  # compiled and no leftover anywhere: the same graph, all weights 0
                        prefix = torch.zeros((len(requests), self.spec.chunk_size, self.spec.action_dim),
                                             device=noise.device)
                    if compiled:  # the closed form, in the graph (runners/rtc.py, "The closed form")
                        kwargs = self._step_recorder.row_guidance(prefix, rows, delays, horizons,
                                                                  self._max_action_dim).kwargs()
                    else:  # LeRobot's own guidance (autograd), one delay and horizon per row
                        for i, n in enumerate(rows):
                            prefix[i, n:] = 0.0  # LeRobot pads a leftover with zeros in model space
                        kwargs = {"prev_chunk_left_over": prefix, "inference_delay": tuple(delays),
                                  "execution_horizon": horizons}
                if compiled:
                    chunk = self._predict(batch, noise=noise, **kwargs)
                else:  # eager: LeRobot's RTC guidance, step capture (runners/compiled.py)
                    with self._step_recorder.recording_steps(steps) if steps is not None else nullcontext():
                        chunk = self.policy.predict_action_chunk(batch, noise=noise, **kwargs)
                actions = self.postprocessor(chunk)
                updates = self._updates(noise, steps) if steps is not None else None
        except PolicyError:
            raise
        except Exception as exc:  # torch/lerobot runtime failure: report, never return "no actions"
            raise PolicyError(f"{self.path}: inference of {len(requests)} request(s) failed: {exc}") from exc
        results = []
        for i, (chunk, rtc, d) in enumerate(zip(self._chunks(actions, len(requests)), rtc_rows, delays, strict=True)):
            # The delay the guidance assumed: LeRobot's weights force min(d, horizon) rows.
            extras = {} if rtc is None else {RTC_EXTRA_DELAY: min(d, self._rtc_horizon)}
            row_updates = None if updates is None else np.ascontiguousarray(updates[:, i])
            results.append(InferenceResult(np.ascontiguousarray(chunk), refinement_updates=row_updates, extras=extras))
        return results

    def compile_target(self) -> Any:
        """``predict_action_chunk``, with SmolVLA's vision embeddings made graph-break free first
        (`static_position_ids`)."""
        if self.spec.policy_type == "smolvla":
            static_position_ids(self.policy.model.vlm_with_expert.get_vlm_model().vision_model.embeddings,
                                self.path.name)
        return super().compile_target()

    def _dummy_requests(self, size: int) -> list[InferenceRequest]:
        """With RTC on, every other warm-up row carries a leftover (half a chunk, delay 1): the start-up
        check then compares the compiled guidance with LeRobot's, in a batch of mixed rows."""
        requests = super()._dummy_requests(size)
        if self._rtc_horizon is None:
            return requests
        from dataclasses import replace

        from lerobot_zenoh.protocol.messages import RtcInputs

        rows = max(1, self.spec.chunk_size // 2)
        prefix = np.linspace(-1.0, 1.0, rows * self.spec.action_dim, dtype=np.float32).reshape(rows, -1)
        return [replace(r, extras={RTC_EXTRA: RtcInputs(prefix, min(1, rows))}) if i % 2 == 0 else r
                for i, r in enumerate(requests)]

    def _updates(self, noise: Any, steps: list) -> np.ndarray:
        """``(num_steps, B, chunk_size, action_dim)`` float32: the change each Euler step made to the
        sample (``x_after - x_before``, the first from the noise the loop started from; guided steps
        as the loop took them), model space, the padding dimensions beyond the action dropped."""
        import torch

        if not steps:
            raise PolicyError(f"{self.path}: the sampling loop reported no Euler steps (LeRobot's step hook "
                              "was not called: see runners/rtc.py)")
        samples = torch.stack([noise.float(), *(x.float() for x in steps)])
        return (samples[1:] - samples[:-1])[..., : self.spec.action_dim].cpu().numpy()

    def _prefix_batch(self, rtc_rows: Sequence[Any]) -> Any:
        """The prefixes as the batch's ``(B, chunk_size, action_dim)`` float32 action, robot units,
        zero rows after each row's own (and for a request without one)."""
        import torch

        out = np.zeros((len(rtc_rows), self.spec.chunk_size, self.spec.action_dim), dtype=np.float32)
        for i, rtc in enumerate(rtc_rows):
            if rtc is not None and len(rtc.prefix):
                out[i, : len(rtc.prefix)] = rtc.prefix
        return torch.from_numpy(out).to(self.device)

    def _noise(self, seed: int) -> Any:
        """``(chunk_size, max_action_dim)`` standard normal noise from a generator seeded with `seed`
        alone, drawn on the CPU (the same numbers on every device)."""
        import torch

        generator = torch.Generator().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return torch.randn((self.spec.chunk_size, self._max_action_dim), generator=generator)

    def _stack(self, requests: Sequence[InferenceRequest]) -> dict[str, Any]:
        """LeRobot's rollout observation for each request, stacked on dim 0, tasks as a list (made on
        the device when the model takes its images there: `device_images`)."""
        import torch

        if self.spec.capabilities.image_device is not None:
            from lerobot_zenoh.server.runners.device_images import observation_tensors

            observation: dict[str, Any] = observation_tensors(
                self.spec, [r.state for r in requests], [r.images for r in requests], self.device)
            return observation | {"task": [r.task if r.task else "" for r in requests], "robot_type": ""}
        from lerobot.policies import prepare_observation_for_inference
        from lerobot.utils.feature_utils import build_dataset_frame

        rows = []
        for r in requests:
            values: dict[str, Any] = {name: float(r.state[i]) for i, name in enumerate(self.spec.state_names)}
            for cam, img in r.images.items():
                values[cam] = img if img.flags.writeable and img.flags.c_contiguous else np.array(img)
            frame = build_dataset_frame(self._features, values, prefix="observation")
            rows.append(prepare_observation_for_inference(frame, self.device, r.task, None))
        out: dict[str, Any] = {}
        for key, first in rows[0].items():
            if isinstance(first, torch.Tensor):
                out[key] = torch.cat([row[key] for row in rows], dim=0)
            elif key == "task":
                out[key] = [row[key] for row in rows]
            else:
                out[key] = first
        return out


def static_position_ids(embeddings: Any, name: str) -> bool:
    """SmolVLA compiled: transformers' `SmolVLMVisionEmbeddings.forward` writes the patch position ids
    with boolean-mask indexing (``position_ids[mask] = pos_ids[mask]``), whose output shape depends on
    the data: 7 graph breaks per graph (``aten.nonzero``). The same forward with ``torch.where(mask,
    pos_ids, position_ids)`` computes the same ids with static shapes. Installed on this one module
    only, and kept only if it gives bit for bit the original's embeddings on a probe input (so a
    transformers release that changed the forward keeps its own). True when installed."""
    import types

    import torch

    original = type(embeddings).forward

    def forward(self, pixel_values, patch_attention_mask):
        batch_size, _, max_im_h, max_im_w = pixel_values.shape
        patch_embeds = self.patch_embedding(pixel_values)
        out = patch_embeds.flatten(2).transpose(1, 2)
        max_nb_patches_h, max_nb_patches_w = max_im_h // self.patch_size, max_im_w // self.patch_size
        boundaries = torch.arange(1 / self.num_patches_per_side, 1.0, 1 / self.num_patches_per_side,
                                  device=pixel_values.device)
        position_ids = torch.full(size=(batch_size, max_nb_patches_h * max_nb_patches_w), fill_value=0,
                                  device=pixel_values.device)
        step_h = 1.0 / patch_attention_mask[:, :, 0].sum(dim=1)
        step_w = 1.0 / patch_attention_mask[:, 0, :].sum(dim=1)
        h_indices = torch.arange(patch_attention_mask.size(1), device=position_ids.device, dtype=torch.float32)
        w_indices = torch.arange(patch_attention_mask.size(2), device=position_ids.device, dtype=torch.float32)
        coords_h = torch.clamp(h_indices[None, :] * step_h[:, None], max=(1.0 - 1e-6)).to(pixel_values.dtype)
        coords_w = torch.clamp(w_indices[None, :] * step_w[:, None], max=(1.0 - 1e-6)).to(pixel_values.dtype)
        bucket_h = torch.bucketize(coords_h, boundaries, right=True)
        bucket_w = torch.bucketize(coords_w, boundaries, right=True)
        pos_ids = (bucket_h[:, :, None] * self.num_patches_per_side + bucket_w[:, None, :]).reshape(batch_size, -1)
        position_ids = torch.where(patch_attention_mask.view(batch_size, -1), pos_ids, position_ids)
        return out + self.position_embedding(position_ids)

    side = embeddings.num_patches_per_side * embeddings.patch_size
    weight = embeddings.patch_embedding.weight
    probe = torch.linspace(-1, 1, 2 * weight.shape[1] * side * side, device=weight.device, dtype=weight.dtype)
    probe = probe.reshape(2, weight.shape[1], side, side)
    mask = torch.ones((2, embeddings.num_patches_per_side, embeddings.num_patches_per_side), dtype=torch.bool,
                      device=weight.device)
    mask[1, -1:, :] = False  # a partly masked image too
    with torch.no_grad():
        same = torch.equal(forward(embeddings, probe, mask), original(embeddings, probe, mask))
    if not same:
        log.warning("%s: SmolVLM's vision embeddings differ from the static-shape copy; compiling the original "
                    "(with its graph breaks)", name)
        return False
    embeddings.forward = types.MethodType(forward, embeddings)
    return True


def _configure_rtc(path: Path, config: Any, options: LoadOptions) -> None:
    """LeRobot's ``rtc_config`` from the manifest's settings (None when off, whatever the checkpoint
    saved: RTC is the server's decision). `PolicyError` naming the field for a horizon longer than
    the chunk."""
    settings = options.rtc
    if not settings.enabled:
        config.rtc_config = None
        return
    if settings.execution_horizon > int(config.chunk_size):
        raise PolicyError(f"{options.field('rtc.execution_horizon')}: {settings.execution_horizon} is longer "
                          f"than {path}'s chunk ({config.chunk_size} actions)")
    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    config.rtc_config = RTCConfig(
        enabled=True, execution_horizon=settings.execution_horizon,
        max_guidance_weight=float(settings.max_guidance_weight),
        prefix_attention_schedule=RTCAttentionSchedule(settings.prefix_attention_schedule.upper()))


def resolve_asset(path: Path, what: str, named: str | None, named_where: str, given: Path | None,
                  bundled: str | None, field: str, marker: str) -> Path:
    """The local folder holding an asset a checkpoint names: the manifest's `given` folder, else the
    checkpoint's `bundled` one (relative to it, or absolute), else `named` as a folder or a Hugging
    Face cache entry. `marker` is a file the folder must hold. `PolicyError` naming `field` otherwise."""
    if given is not None:
        if not (given / marker).is_file():
            raise PolicyError(f"{field}: {given} does not hold a {what} (no {marker})")
        return given
    for candidate in (bundled, named):
        if candidate and (path / candidate / marker).is_file():
            return path / candidate  # an absolute candidate stays absolute
    cached = _hf_cached(named, marker)
    if cached is not None:
        return cached
    from lerobot_zenoh.server.runners.hub import HubRef, is_offline, snapshot

    ref = HubRef.parse(named) if named else None
    if ref is not None and not is_offline():  # as LeRobot would: fetch it (configs and tokenizer files only)
        folder = snapshot(ref, field, allow_patterns=["*.json", "*.txt", "*.model", "*.jinja"])
        if (folder / marker).is_file():
            return folder
    raise PolicyError(
        f"{path}: the {what} {named!r} ({named_where}) is neither a local folder nor in the Hugging Face "
        f"cache{' (HF_HUB_OFFLINE is set)' if is_offline() else ''}; fetch it with `hf download {named}`, or set "
        f"{field} to a local folder holding it")


def _hf_cached(repo_id: str | None, filename: str) -> Path | None:
    if not repo_id or os.path.isabs(repo_id):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename)
    except Exception:  # an invalid repo id is simply not cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def _tokenizer_name(path: Path) -> str | None:
    """The tokenizer name the checkpoint's saved preprocessor asks for."""
    try:
        steps = json.loads((path / _PREPROCESSOR_JSON).read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PolicyError(f"{path / _PREPROCESSOR_JSON}: unreadable: {exc}") from exc
    for step in steps:
        if isinstance(step, dict) and step.get("registry_name") == _TOKENIZER_STEP:
            return (step.get("config") or {}).get("tokenizer_name")
    raise PolicyError(f"{path / _PREPROCESSOR_JSON}: no {_TOKENIZER_STEP} step")


def declared_policy_class(path: Path, config: Any) -> type:
    """LeRobot's class for ``config.type``, unless the checkpoint's sidecar declares the
    ``test_architecture`` it was built with (`lerobot_zenoh.checkpoint_builder`): then the builder's
    subclass that builds those sizes (LeRobot fixes pi0's Gemma sizes by variant name; see
    docs/policies.md, "Tiny VLAs offline"). Nothing of LeRobot is modified either way."""
    arch = sidecar_extras(path).get("test_architecture")
    if arch is None:
        from lerobot.policies import get_policy_class

        return get_policy_class(config.type)
    from lerobot_zenoh.checkpoint_builder.tiny_pi import tiny_policy_class, validate_architecture

    arch = validate_architecture(config.type, arch, str(path / FEATURES_SIDECAR_NAME))
    log.warning("%s: building the test architecture its %s declares (tiny Gemma/SigLIP, "
                "lerobot_zenoh.checkpoint_builder.tiny_pi)", path, FEATURES_SIDECAR_NAME)
    return tiny_policy_class(config.type, arch)


def sidecar_extras(path: Path) -> dict[str, Any]:
    """The builder's optional sidecar keys (``assets``, ``test_architecture``); {} without a sidecar."""
    sidecar = path / FEATURES_SIDECAR_NAME
    if not sidecar.is_file():
        return {}
    try:
        data = json.loads(sidecar.read_text())
    except (OSError, ValueError) as exc:
        raise PolicyError(f"{sidecar}: unreadable features file: {exc}") from exc
    assets = data.get("assets", {})
    if not isinstance(assets, dict) or not all(isinstance(v, str) for v in assets.values()):
        raise PolicyError(f"{sidecar}: assets must map names to folder paths, got {assets!r}")
    return {k: data[k] for k in ("assets", "test_architecture") if k in data}


def _task_tokens(tokenizer: Any, task: str) -> int:
    """The tokens LeRobot's tokenizer step makes of `task` (with the newline it appends and the
    tokenizer's special tokens)."""
    return len(tokenizer(task if task.endswith("\n") else f"{task}\n")["input_ids"])
