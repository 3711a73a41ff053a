"""What every LeRobot policy family shares: reading a checkpoint folder, deriving the spec, and
feeding an observation through the checkpoint's own pre- and post-processors.

A family (act.py, diffusion.py, ...) is a `LeRobotRunner` subclass that says how long its chunk is
and what it can do (`chunk_size_for`, `capabilities_for`) and implements `_chunk` (a preprocessed
batch in, a normalized chunk out); `runners/__init__.py` maps LeRobot's policy type to it.

Checkpoints are served exactly as LeRobot's own rollout feeds them (`SyncInferenceEngine`):
``build_dataset_frame`` -> ``prepare_observation_for_inference`` -> saved preprocessor -> model ->
saved postprocessor, except that the model is asked for a whole chunk (``predict_action_chunk``),
never for one action (``select_action`` keeps per-episode queues inside the shared model).

torch and lerobot are imported on first use, not at import time: importing the runner registry (as
the torch-free synthetic policy does) must not pay for them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.server.runners.base import (
    OBS_IMAGES_PREFIX,
    OBS_STATE_KEY,
    BaseRunner,
    InferenceRequest,
    InferenceResult,
    PolicySpec,
    RunnerCapabilities,
    check_observation,
    dummy_observation,
)
from lerobot_zenoh.server.runners.compiled import CompileSettings

if TYPE_CHECKING:
    import torch

    from lerobot_zenoh.server.runners.compiled import CompiledChunk

log = logging.getLogger(__name__)

# Written next to a checkpoint by `lerobot_zenoh.checkpoint_builder.build.build_checkpoint`; a LeRobot
# config stores feature shapes but not the joint names or the control rate.
FEATURES_SIDECAR_NAME = "lerobot_zenoh_features.json"
FEATURES_SIDECAR_VERSION = 1

ACTION_KEY = "action"
WEIGHTS_FILE = "model.safetensors"

#: Manifest spellings of a dtype -> torch's name.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}

#: LeRobot's RTC prefix attention schedules (``RTCAttentionSchedule``), as the manifest spells them.
RtcSchedule = Literal["zeros", "ones", "linear", "exp"]


class RtcSettings(Settings):
    """Real-time chunking of one model (the manifest entry's ``rtc`` block; docs/policies.md).

    The defaults are LeRobot's `RTCConfig`'s. `execution_horizon`: the leading chunk rows the guidance
    draws from the prefix; `max_guidance_weight`: the clamp of the guidance weight;
    `prefix_attention_schedule`: how the prefix weights decay from the delay to the horizon. Only the
    flow-matching VLAs (smolvla, pi0, pi05) can enable it; any other family refuses ``enabled: true``
    at load.
    """

    config_prefix = "rtc"

    enabled: bool = Field(False, strict=True)
    execution_horizon: int = Field(10, ge=1, strict=True)
    max_guidance_weight: float = Field(10.0, gt=0, allow_inf_nan=False)
    prefix_attention_schedule: RtcSchedule = "linear"


@dataclass(frozen=True)
class LoadOptions:
    """How the server loads a checkpoint: the manifest entry's settings for it.

    `device` and `dtype` (``float32``/``bfloat16``) place the model. `tokenizer_path` and `vlm_path`
    are local folders standing in for assets a checkpoint names but does not hold (a VLA's tokenizer,
    SmolVLA's VLM config and processor). `rtc`: real-time chunking (refused at load by a family
    that cannot do it). `compile`: compiled inference (runners/compiled.py), with batch buckets up to
    `max_batch` unless it lists its own. `field_prefix` (e.g. ``"server[pi0]."``) makes errors name
    the manifest field to set. `images_on_device` (CUDA only): JPEG frames decoded on the device and
    the others copied there as uint8 through pinned memory (runners/device_images.py).
    """

    device: str = "cpu"
    dtype: str = "float32"
    tokenizer_path: Path | None = None
    vlm_path: Path | None = None
    rtc: RtcSettings = RtcSettings()
    compile: CompileSettings = CompileSettings()
    max_batch: int = 1
    images_on_device: bool = False
    field_prefix: str = ""

    def field(self, name: str) -> str:
        return f"{self.field_prefix}{name}"


def read_config(path: Path) -> Any:
    """The LeRobot config (``PreTrainedConfig``) of a local checkpoint folder; `PolicyError` naming
    the path when the folder or its ``config.json`` is missing or unreadable."""
    if not path.is_dir():
        raise PolicyError(f"{path}: checkpoint folder does not exist (download hub checkpoints first)")
    if not (path / "config.json").is_file():
        raise PolicyError(f"{path}: no config.json; not a LeRobot policy checkpoint")
    try:
        import lerobot.policies  # noqa: F401  (registers every policy type's config class)
        from lerobot.configs import PreTrainedConfig
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise PolicyError(f"cannot import lerobot to load {path}: {exc}") from exc
    try:
        return PreTrainedConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # draccus/json/type errors: all mean "unreadable config"
        raise PolicyError(f"{path}: cannot read policy config: {exc}") from exc


class CompiledCalls:
    """A LeRobot runner's compiled inference (runners/compiled.py): the chunk call through the compiled
    graphs once they are warm, else eager; every bucket compiled and warmed before the plain warm-up.
    Mixed into `LeRobotRunner`, whose `spec`, `policy`, `device`, `path`, `run` and `forget` it uses."""

    _compiled: CompiledChunk | None = None

    def set_compile(self, options: LoadOptions) -> None:
        settings = options.compile
        if not settings.enabled:
            return
        field = options.field("compile")
        if self.not_compiled:
            raise PolicyError(f"{field}: {self.spec.policy_type} is not compiled: {self.not_compiled}; use off")
        from lerobot_zenoh.server.runners.compiled import CompiledChunk, batch_buckets

        largest = self.spec.capabilities.max_batch or options.max_batch
        self._compiled = CompiledChunk(self.compile_target(), settings, batch_buckets(settings, largest),
                                       device_type=self.device.type, name=f"{self.path.name} ({self.spec.policy_type})",
                                       field=field, dtype=DTYPES.get(options.dtype, options.dtype))

    def compile_target(self) -> Any:
        """The function compiled: ``predict_action_chunk`` of the policy, whole."""
        return self.policy.predict_action_chunk

    def _predict(self, batch: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        """The policy's normalized chunk for a preprocessed `batch`: through the compiled graphs once
        they are warm, else eager."""
        compiled = self._compiled
        if compiled is not None and compiled.active:
            return compiled(batch, **kwargs)
        return self.policy.predict_action_chunk(batch, **kwargs)

    def warmup(self) -> None:
        """Compile and warm every batch bucket first when compiled (a failure refuses to start, or
        with ``compile.fallback: eager`` serves eager), then the plain warm-up."""
        compiled = self._compiled
        if compiled is not None and not compiled.serving:
            try:
                compiled.warm(self._dummy_chunks)
            except PolicyError as exc:
                if compiled.settings.fallback != "eager":
                    raise
                log.warning("%s; serving it eager (compile.fallback: eager)", exc)
                compiled.close()
                self._compiled = None
        super().warmup()

    def _dummy_chunks(self, size: int) -> np.ndarray:
        """``run`` on `size` dummy observations of distinct private sessions: (size, T, action_dim)."""
        requests = self._dummy_requests(size)
        try:
            return np.stack([r.actions for r in self.run(requests)])
        finally:
            for r in requests:
                self.forget(r.session_id)

    def _dummy_requests(self, size: int) -> list[InferenceRequest]:
        """The compile warm-up's requests: `size` dummy observations of distinct private sessions."""
        state, images = dummy_observation(self.spec)
        return [InferenceRequest(f"\x00compile-{i}", state, images, "", seed=i) for i in range(size)]

    def figures(self) -> dict[str, float]:
        return self._compiled.figures() if self._compiled is not None else {}


class LeRobotRunner(CompiledCalls, BaseRunner):
    """A LeRobot checkpoint behind the runner seam: shared loading and pre/post-processing.

    Subclasses implement `_chunk` (normalized in, ``(1, T, action_dim)`` normalized out) and may
    override `chunk_size_for`, `capabilities_for`, `forget` and `run` (to share a forward pass).
    The default `run` serves its requests one after another; when ``capture_updates`` is set and the
    family declares ``refinement_updates``, `_chunk` is handed a list to append each refinement step's
    ``(T, action_dim)`` update to.
    """

    def __init__(self, spec: PolicySpec, policy: Any, preprocessor: Any, postprocessor: Any,
                 device: torch.device, path: Path):
        self.spec = spec
        self.policy = policy
        self.preprocessor = preprocessor
        self.postprocessor = postprocessor
        self.device = device
        self.path = path
        self._features = spec.observation_features()

    # -- what a family declares ------------------------------------------------------------------

    @classmethod
    def chunk_size_for(cls, config: Any) -> int:
        """Actions per chunk for this config (LeRobot's ``n_action_steps`` by default)."""
        return int(config.n_action_steps)

    @classmethod
    def capabilities_for(cls, config: Any) -> RunnerCapabilities:
        """What this family's runner can do with this config (one request at a time by default)."""
        return RunnerCapabilities()

    # -- loading -----------------------------------------------------------------------------------

    #: dtypes a family can serve (LoadOptions.dtype); ACT and Diffusion feed float32 inputs.
    supported_dtypes: tuple[str, ...] = ("float32",)

    #: The family can apply real-time-chunking guidance (LoadOptions.rtc); ACT and Diffusion cannot.
    supports_rtc: bool = False

    #: Why the family's chunk cannot be compiled (LoadOptions.compile is then refused at load), or ""
    #: when its `_predict` goes through `compile_target` (runners/compiled.py).
    not_compiled: str = "no compiled path is written for this family"

    @classmethod
    def from_checkpoint(cls, path: Path, config: Any, options: LoadOptions | str = "cpu") -> LeRobotRunner:
        """Load the checkpoint folder `path` whose config `read_config` returned, as `options` say
        (a bare string is the device).

        The folder must hold what ``policy.save_pretrained`` + ``preprocessor/postprocessor.save_pretrained``
        write (``config.json``, ``model.safetensors``, ``policy_preprocessor.json``,
        ``policy_postprocessor.json`` and their normalizer stats). Every tensor of ``model.safetensors``
        must have reached the model (`check_weights`): some LeRobot families return random weights
        without raising when it is missing or its shapes do not match. Raises `PolicyError` naming the
        path (and the manifest field, for a bad device, dtype or asset).
        """
        if isinstance(options, str):
            options = LoadOptions(device=options)
        try:
            import torch

            from lerobot.policies import make_pre_post_processors
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise PolicyError(f"cannot import torch/lerobot to load {path}: {exc}") from exc
        try:
            torch_device = torch.device(options.device)
        except (RuntimeError, TypeError) as exc:
            raise PolicyError(f"{options.field('device')}: invalid device {options.device!r}: {exc}") from exc
        if torch_device.type == "cuda" and not torch.cuda.is_available():
            raise PolicyError(f"{options.field('device')}: {options.device!r} but CUDA is not available here")
        if torch_device.type == "mps" and not torch.backends.mps.is_available():
            raise PolicyError(f"{options.field('device')}: {options.device!r} but MPS is not available here")
        dtype = DTYPES.get(options.dtype)
        if dtype not in cls.supported_dtypes:
            raise PolicyError(f"{options.field('dtype')}: {options.dtype!r} is not supported for {config.type} "
                              f"(supported: {', '.join(cls.supported_dtypes)})")
        if options.rtc.enabled and not cls.supports_rtc:
            raise PolicyError(f"{options.field('rtc.enabled')}: {config.type} cannot do real-time chunking "
                              "(only the flow-matching VLAs can: smolvla, pi0, pi05)")
        image_device = None
        if options.images_on_device:
            if torch_device.type != "cuda":
                raise PolicyError(f"{options.field('images_on_device')}: decoding images on the device needs a CUDA "
                                  f"device, the model is on {options.device!r}")
            try:
                import torchvision.io  # noqa: F401  (nvJPEG's decoder)
            except ImportError as exc:  # pragma: no cover - depends on the installation
                raise PolicyError(f"{options.field('images_on_device')}: torchvision is not importable: {exc}") from exc
            index = torch_device.index if torch_device.index is not None else torch.cuda.current_device()
            image_device = f"cuda:{index}"
        weights = path / cls.weights_name if cls.weights_name else None
        if weights is not None and not weights.is_file():
            raise PolicyError(f"{weights}: missing: cannot load a checkpoint without its weights")
        config.device = torch_device.type
        cls.prepare_config(path, config, options)
        # Read after prepare_config, which sets what they depend on (e.g. the RTC config).
        capabilities = replace(cls.capabilities_for(config), image_device=image_device)
        spec = _spec_from_config(path, config, cls.chunk_size_for(config), capabilities)
        try:
            policy = cls.load_policy(path, config, options)
        except PolicyError:
            raise
        except RuntimeError as exc:  # torch's load_state_dict: size mismatches, missing/unexpected keys
            raise PolicyError(f"{weights}: the weights did not load into the model: "
                              f"{' '.join(str(exc).split())}") from exc
        except Exception as exc:
            raise PolicyError(f"{path}: cannot load {config.type} checkpoint: {exc}") from exc
        try:
            policy.to(torch_device)
            if dtype != "float32":
                cls.cast_policy(policy, getattr(torch, dtype))
            policy.eval()
            # Served, never trained: parameters that do not require grad change no output and keep
            # autograd from recording the model's graph where a call enables it (RTC's guidance does).
            policy.requires_grad_(False)
            preprocessor, postprocessor = make_pre_post_processors(
                config,
                pretrained_path=str(path),
                preprocessor_overrides={"device_processor": {"device": str(torch_device)},
                                        **cls.preprocessor_overrides(path, config, options)},
            )
        except PolicyError:
            raise
        except Exception as exc:  # safetensors/torch/processor errors: the checkpoint is unusable
            raise PolicyError(f"{path}: cannot load {config.type} checkpoint: {exc}") from exc
        check_weights(weights, policy, cls.file_key_candidates)
        runner = cls(spec, policy, preprocessor, postprocessor, torch_device, path)
        runner.set_compile(options)
        return runner

    # -- loading hooks (a family overrides what it needs) ------------------------------------------

    @classmethod
    def prepare_config(cls, path: Path, config: Any, options: LoadOptions) -> None:
        """Adjust the config before the model is built (e.g. point at local assets). Nothing by default."""

    #: The weights' file in the folder, checked against the loaded model (`check_weights`); None only for
    #: a runner whose `load_policy` makes them (`checkpoint_builder.in_memory`: benchmarks, never a server).
    weights_name: str | None = WEIGHTS_FILE

    @classmethod
    def policy_class(cls, path: Path, config: Any) -> type:
        """The class that builds the model: LeRobot's own for ``config.type``."""
        from lerobot.policies import get_policy_class

        return get_policy_class(config.type)

    @classmethod
    def load_policy(cls, path: Path, config: Any, options: LoadOptions) -> Any:
        """The policy with its weights, through `policy_class` and LeRobot's ``from_pretrained``."""
        return cls.policy_class(path, config).from_pretrained(path, config=config, local_files_only=True)

    @classmethod
    def cast_policy(cls, policy: Any, dtype: Any) -> None:
        """Cast a loaded policy to a non-float32 `dtype` (only for `supported_dtypes`)."""
        policy.to(dtype)

    @classmethod
    def preprocessor_overrides(cls, path: Path, config: Any, options: LoadOptions) -> dict[str, Any]:
        """Per-step overrides of the saved preprocessor (registry name -> settings). None by default."""
        return {}

    @classmethod
    def file_key_candidates(cls, key: str) -> tuple[str, ...]:
        """The model state-dict keys a ``model.safetensors`` key may load into."""
        return (key, f"model.{key}")

    # -- serving -----------------------------------------------------------------------------------

    def run(
        self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False
    ) -> list[InferenceResult]:
        """One request after another: the default for models whose forward pass cannot be shared."""
        capture = capture_updates and self.spec.capabilities.refinement_updates
        return [self._run_one(r, capture) for r in requests]

    def _run_one(self, request: InferenceRequest, capture: bool) -> InferenceResult:
        if not capture:
            return InferenceResult(self._infer_one(request, None))
        import torch

        steps: list[torch.Tensor] = []
        actions = self._infer_one(request, steps)
        if not steps:
            raise PolicyError(f"{self.path}: the model reported no refinement steps")
        updates = torch.stack(steps).to("cpu", torch.float32).numpy()  # (steps, T, action_dim)
        return InferenceResult(actions, refinement_updates=updates)

    def _infer_one(self, request: InferenceRequest, updates: list | None) -> np.ndarray:
        """One request's unnormalized chunk; `updates` (a list, or None) goes to `_chunk`."""
        import torch

        check_observation(self.spec, request.state, request.images)
        try:
            with torch.inference_mode():
                batch = self._preprocess(request.state, request.images, request.task)
                chunk = self._chunk(request, batch, updates)  # (1, T, action_dim), normalized
                actions = self.postprocessor(chunk)
        except PolicyError:
            raise
        except Exception as exc:  # torch/lerobot runtime failure: report, never return "no actions"
            raise PolicyError(f"{self.path}: inference failed: {exc}") from exc
        out = actions.detach().to("cpu", torch.float32).numpy()[0]
        expected = (self.spec.chunk_size, self.spec.action_dim)
        if out.shape != expected:
            raise PolicyError(f"{self.path}: model returned actions {out.shape}, expected {expected}")
        return out

    def _chunks(self, actions: Any, n: int) -> np.ndarray:
        """A batched forward pass's unnormalized actions as float32 ``(n, chunk_size, action_dim)``;
        `PolicyError` when the model returned another shape."""
        import torch

        out = actions.detach().to("cpu", torch.float32).numpy()
        expected = (n, self.spec.chunk_size, self.spec.action_dim)
        if out.shape != expected:
            raise PolicyError(f"{self.path}: model returned actions {out.shape}, expected {expected}")
        return out

    def _preprocess(self, state: np.ndarray, images: dict[str, np.ndarray], task: str) -> dict[str, Any]:
        """Exactly LeRobot's rollout path: dataset frame -> tensors -> saved preprocessor (the same
        tensors made on the device when the model takes its images there: `device_images`)."""
        if self.spec.capabilities.image_device is not None:
            from lerobot_zenoh.server.runners.device_images import observation_tensors

            observation: dict[str, Any] = observation_tensors(self.spec, [state], [images], self.device)
            observation |= {"task": task if task else "", "robot_type": ""}
            return self.preprocessor(observation)
        from lerobot.policies import prepare_observation_for_inference
        from lerobot.utils.feature_utils import build_dataset_frame

        values: dict[str, Any] = {name: float(state[i]) for i, name in enumerate(self.spec.state_names)}
        for cam, img in images.items():
            # torch.from_numpy needs a writable, contiguous array (decoded frames may be read-only).
            values[cam] = img if img.flags.writeable and img.flags.c_contiguous else np.array(img)
        frame = build_dataset_frame(self._features, values, prefix="observation")
        observation = prepare_observation_for_inference(frame, self.device, task, None)
        return self.preprocessor(observation)

    def _chunk(self, request: InferenceRequest, batch: dict[str, Any], updates: list | None) -> torch.Tensor:
        """The preprocessed `batch` of one request -> its normalized ``(1, T, action_dim)`` chunk."""
        raise NotImplementedError


def check_weights(weights: Path | None, policy: Any, candidates: Any = None) -> None:
    """`PolicyError` naming `weights` unless every tensor of the model came from that file (None: a
    model whose weights were made, not read: `LeRobotRunner.weights_name`).

    Each file key must map (`candidates`) to a model key of the same shape whose loaded value equals
    it (cast to the model's dtype); each model key must have come from the file, or share storage
    with one that did (tied embeddings are saved once). Reads one tensor at a time.
    """
    if weights is None:
        return
    import torch
    from safetensors import safe_open

    candidates = candidates or (lambda key: (key, f"model.{key}"))
    model = policy.state_dict(keep_vars=False)
    loaded: set[str] = set()
    problems: list[str] = []
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                target = next((k for k in candidates(key) if k in model), None)
                if target is None:
                    problems.append(f"unexpected {key}")
                    continue
                tensor = model[target]
                saved = f.get_tensor(key)
                if tuple(saved.shape) != tuple(tensor.shape):
                    problems.append(f"{key}: shape {tuple(saved.shape)} in the file, {tuple(tensor.shape)} in the model")
                elif not torch.equal(saved.to(tensor.dtype), tensor.detach().to("cpu")):
                    problems.append(f"{key}: the model's value is not the file's")
                else:
                    loaded.add(target)
                if len(problems) >= 3:
                    break
    except Exception as exc:  # a truncated or corrupt file
        raise PolicyError(f"{weights}: unreadable weights: {exc}") from exc
    if not problems:
        storages = {model[k].untyped_storage().data_ptr() for k in loaded if model[k].numel()}
        missing = [k for k, t in model.items()
                   if k not in loaded and not (t.numel() and t.untyped_storage().data_ptr() in storages)]
        problems = [f"missing {k}" for k in missing[:3]]
        if len(missing) > 3:
            problems.append(f"... {len(missing)} tensors missing in all")
    if problems:
        raise PolicyError(f"{weights}: the weights did not load into the model: {'; '.join(problems)}")


def concat_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Preprocessed single-observation batches -> one batch: tensors along dim 0, lists joined.

    Anything else (the transition's scalar placeholders such as ``next.reward``) is the same for every
    observation and is taken from the first.
    """
    import torch

    out: dict[str, Any] = {}
    for key, first in batches[0].items():
        if isinstance(first, torch.Tensor):
            out[key] = torch.cat([b[key] for b in batches], dim=0)
        elif isinstance(first, list):
            out[key] = [item for b in batches for item in b[key]]
        else:
            out[key] = first
    return out


def _spec_from_config(
    path: Path, config: Any, chunk_size: int, capabilities: RunnerCapabilities
) -> PolicySpec:
    """Derive the robot-facing spec from a LeRobot config (+ our sidecar when present)."""
    from lerobot.configs import FeatureType

    inputs = dict(config.input_features or {})
    outputs = dict(config.output_features or {})
    state_ft = inputs.get(OBS_STATE_KEY)
    if state_ft is None or state_ft.type is not FeatureType.STATE or len(state_ft.shape) != 1:
        raise PolicyError(f"{path}: config has no 1-D {OBS_STATE_KEY!r} input feature")
    action_ft = outputs.get(ACTION_KEY)
    if action_ft is None or action_ft.type is not FeatureType.ACTION or len(action_ft.shape) != 1:
        raise PolicyError(f"{path}: config has no 1-D {ACTION_KEY!r} output feature")

    cameras: dict[str, tuple[int, int]] = {}
    for key, ft in inputs.items():
        if key == OBS_STATE_KEY:
            continue
        if ft.type is not FeatureType.VISUAL:
            raise PolicyError(f"{path}: input feature {key!r} ({ft.type.value}) is not supported")
        if not key.startswith(OBS_IMAGES_PREFIX) or len(ft.shape) != 3 or ft.shape[0] != 3:
            raise PolicyError(
                f"{path}: image feature {key!r} must be named '{OBS_IMAGES_PREFIX}<camera>' "
                f"with shape (3, H, W), got {tuple(ft.shape)}"
            )
        cameras[key.removeprefix(OBS_IMAGES_PREFIX)] = (int(ft.shape[1]), int(ft.shape[2]))

    state_dim, action_dim = int(state_ft.shape[0]), int(action_ft.shape[0])
    state_names = tuple(f"state_{i}" for i in range(state_dim))
    action_names = tuple(f"action_{i}" for i in range(action_dim))
    fps: int | None = None
    sidecar = path / FEATURES_SIDECAR_NAME
    if sidecar.is_file():
        state_names, action_names, fps = _read_sidecar(sidecar, state_dim, action_dim, cameras)

    try:
        return PolicySpec(
            policy_type=config.type,
            state_names=state_names,
            cameras=cameras,
            action_names=action_names,
            chunk_size=chunk_size,
            fps=fps,
            capabilities=capabilities,
        )
    except ConfigError as exc:
        raise PolicyError(f"{path}: inconsistent features: {exc}") from exc


def _read_sidecar(
    sidecar: Path, state_dim: int, action_dim: int, cameras: dict[str, tuple[int, int]]
) -> tuple[tuple[str, ...], tuple[str, ...], int | None]:
    try:
        data = json.loads(sidecar.read_text())
        version = data.get("version")
        state_names = tuple(data["state_names"])
        action_names = tuple(data["action_names"])
        sidecar_cameras = {str(k): tuple(v) for k, v in data.get("cameras", {}).items()}
        fps = data.get("fps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PolicyError(f"{sidecar}: unreadable features file: {exc}") from exc
    if version != FEATURES_SIDECAR_VERSION:
        raise PolicyError(f"{sidecar}: unsupported version {version!r}")
    if len(state_names) != state_dim or len(action_names) != action_dim:
        raise PolicyError(
            f"{sidecar}: {len(state_names)} state / {len(action_names)} action names do not match "
            f"the config's dims {state_dim} / {action_dim}"
        )
    if sidecar_cameras != cameras:
        raise PolicyError(f"{sidecar}: cameras {sidecar_cameras} do not match the config's {cameras}")
    if fps is not None and (not isinstance(fps, int) or fps < 1):
        raise PolicyError(f"{sidecar}: fps must be a positive integer or null, got {fps!r}")
    return state_names, action_names, fps
