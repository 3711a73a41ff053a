"""Policy runners: the one seam between the inference loop and a model.

Every runner implements `PolicyRunner`: `infer()` takes one robot's raw observation (state vector,
RGB uint8 images, task) and returns a float32 ``(chunk_size, action_dim)`` chunk of *unnormalized*
actions. One runner instance serves every client, so a result may depend only on the arguments and on
the history of *that* client (``client_id``), never on who was served before: this is the purity
invariant the whole system relies on.

LeRobot checkpoints are served exactly as LeRobot's own rollout feeds them (`SyncInferenceEngine`):
``build_dataset_frame`` -> ``prepare_observation_for_inference`` -> saved preprocessor -> model ->
saved postprocessor, except that the model is asked for a whole chunk (``predict_action_chunk``),
never for one action (``select_action`` keeps per-episode queues inside the shared model).

torch and lerobot are imported on first use, not at import time: `PolicySpec` and the synthetic policy
are used by processes that must not pay for (or even have) torch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from lerobot_zenoh.errors import ConfigError, PolicyError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Written next to a checkpoint by `lerobot_zenoh.server.checkpoint.build_checkpoint`; a LeRobot
# config stores feature shapes but not the joint names or the control rate.
FEATURES_SIDECAR_NAME = "lerobot_zenoh_features.json"
FEATURES_SIDECAR_VERSION = 1

SUPPORTED_POLICY_TYPES = ("act", "diffusion")

OBS_STATE_KEY = "observation.state"
OBS_IMAGES_PREFIX = "observation.images."
ACTION_KEY = "action"

# Client id under which `warmup()` runs; forgotten right after.
_WARMUP_CLIENT_ID = "\x00warmup"


@dataclass(frozen=True)
class PolicySpec:
    """What a policy consumes and produces, in the robot's vocabulary.

    `cameras` maps the robot-side camera name (``"front"``, not ``"observation.images.front"``) to its
    (height, width); images are RGB uint8 ``(H, W, 3)``. Dict order is the order the model sees them.
    """

    policy_type: str
    state_names: tuple[str, ...]
    cameras: dict[str, tuple[int, int]]
    action_names: tuple[str, ...]
    chunk_size: int
    fps: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state_names", _names("state_names", self.state_names))
        object.__setattr__(self, "action_names", _names("action_names", self.action_names))
        cameras: dict[str, tuple[int, int]] = {}
        for name, hw in dict(self.cameras).items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError("cameras", f"camera name {name!r} must be a non-empty string without '/'")
            try:
                h, w = (int(v) for v in hw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"cameras.{name}", f"expected (height, width), got {hw!r}") from exc
            if h <= 0 or w <= 0:
                raise ConfigError(f"cameras.{name}", f"height and width must be positive, got {hw!r}")
            cameras[name] = (h, w)
        object.__setattr__(self, "cameras", cameras)
        clash = set(self.state_names) & set(cameras)
        if clash:
            raise ConfigError("cameras", f"names used both for a state and a camera: {sorted(clash)}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ConfigError("chunk_size", f"must be a positive integer, got {self.chunk_size!r}")
        if self.fps is not None and (not isinstance(self.fps, int) or self.fps < 1):
            raise ConfigError("fps", f"must be a positive integer or None, got {self.fps!r}")

    @property
    def action_dim(self) -> int:
        return len(self.action_names)

    @property
    def state_dim(self) -> int:
        return len(self.state_names)

    def observation_features(self) -> dict[str, dict[str, Any]]:
        """LeRobotDataset-style observation features, JSON/msgpack friendly (lists, no tuples).

        Equal to ``hw_to_dataset_features({**{s: float}, **{cam: (H, W, 3)}}, "observation",
        use_video=False)`` (a test checks it); written out here because lerobot's feature_utils
        imports torch.
        """
        features: dict[str, dict[str, Any]] = {
            OBS_STATE_KEY: {
                "dtype": "float32",
                "shape": [self.state_dim],
                "names": list(self.state_names),
            }
        }
        for cam, (h, w) in self.cameras.items():
            features[f"{OBS_IMAGES_PREFIX}{cam}"] = {
                "dtype": "image",
                "shape": [h, w, 3],
                "names": ["height", "width", "channels"],
                "info": {"is_depth_map": False},
            }
        return features


def _names(field_name: str, names: Any) -> tuple[str, ...]:
    if isinstance(names, str):
        raise ConfigError(field_name, "expected a sequence of names, got a single string")
    out = tuple(names)
    if not out:
        raise ConfigError(field_name, "must not be empty")
    for n in out:
        if not isinstance(n, str) or not n:
            raise ConfigError(field_name, f"every name must be a non-empty string, got {n!r}")
    if len(set(out)) != len(out):
        raise ConfigError(field_name, f"names must be unique, got {list(out)}")
    return out


@runtime_checkable
class PolicyRunner(Protocol):
    """The contract between the inference loop and a policy.

    `infer` returns float32 ``(spec.chunk_size, spec.action_dim)`` unnormalized actions. Its result
    depends only on its arguments and on earlier calls with the same `client_id` (observation history
    of policies with ``n_obs_steps > 1``); `seed` fixes any sampling noise. `forget` drops a client's
    history. Errors are raised as `PolicyError`.
    """

    spec: PolicySpec

    def warmup(self) -> None: ...

    def infer(
        self,
        client_id: str,
        state: np.ndarray,
        images: dict[str, np.ndarray],
        task: str,
        *,
        seed: int,
    ) -> np.ndarray: ...

    def forget(self, client_id: str) -> None: ...


@dataclass(frozen=True)
class InferenceRequest:
    """One client's observation, as `BatchPolicyRunner.infer_batch` takes it (the arguments of `infer`)."""

    client_id: str
    state: np.ndarray
    images: dict[str, np.ndarray]
    task: str
    seed: int


@dataclass(frozen=True)
class InferenceInfo:
    """A chunk plus what the model exposes about it (`InfoPolicyRunner.infer_with_info`).

    `denoise_updates` is ``(steps, chunk_size, action_dim)`` float32: for each denoising step, in
    order, the change it made to each action (``prev_sample - sample``), in the model's normalized
    action space. Horizon policies (`scheduling.horizon`) read it; ``None`` when there is none.
    """

    actions: np.ndarray
    denoise_updates: np.ndarray | None = None


@runtime_checkable
class InfoPolicyRunner(PolicyRunner, Protocol):
    """A runner that can also report how it produced a chunk (optional; the server checks for it).

    ``infer_with_info(...).actions`` must equal ``infer(...)`` bit for bit for the same arguments and
    history: capturing the information must not change the sample.
    """

    def infer_with_info(
        self,
        client_id: str,
        state: np.ndarray,
        images: dict[str, np.ndarray],
        task: str,
        *,
        seed: int,
    ) -> InferenceInfo: ...


@runtime_checkable
class BatchPolicyRunner(PolicyRunner, Protocol):
    """A runner that can serve several clients in one call (optional; the server checks for it).

    ``infer_batch(requests)[i]`` must equal ``infer(**requests[i])`` within float tolerance, whatever
    else is in the batch: the purity invariant holds per request. One bad request may fail the whole
    call (`PolicyError`); the server then serves the batch one request at a time, so that only the bad
    one fails. Requests in one batch come from distinct clients.
    """

    def infer_batch(self, requests: Sequence[InferenceRequest]) -> list[np.ndarray]: ...


def check_observation(spec: PolicySpec, state: np.ndarray, images: dict[str, np.ndarray]) -> None:
    """Raise `PolicyError` unless `state` and `images` match `spec` exactly."""
    if not isinstance(state, np.ndarray) or state.shape != (spec.state_dim,):
        shape = getattr(state, "shape", type(state).__name__)
        raise PolicyError(f"state must have shape ({spec.state_dim},), got {shape}")
    if state.dtype.kind not in "fiu":
        raise PolicyError(f"state must be numeric, got dtype {state.dtype}")
    if set(images) != set(spec.cameras):
        raise PolicyError(f"expected images for cameras {sorted(spec.cameras)}, got {sorted(images)}")
    for cam, (h, w) in spec.cameras.items():
        img = images[cam]
        if not isinstance(img, np.ndarray) or img.shape != (h, w, 3) or img.dtype != np.uint8:
            shape = getattr(img, "shape", type(img).__name__)
            dtype = getattr(img, "dtype", None)
            raise PolicyError(f"image {cam!r} must be uint8 ({h}, {w}, 3), got {dtype} {shape}")


def dummy_observation(spec: PolicySpec) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A valid observation for `spec` (zero state, mid-grey images), for warm-up."""
    state = np.zeros(spec.state_dim, dtype=np.float32)
    images = {cam: np.full((h, w, 3), 128, dtype=np.uint8) for cam, (h, w) in spec.cameras.items()}
    return state, images


# ---------------------------------------------------------------------------------------------
# Loading LeRobot checkpoints
# ---------------------------------------------------------------------------------------------


def load_policy_runner(pretrained_path: str | Path, device: str = "cpu") -> PolicyRunner:
    """Load a local LeRobot checkpoint folder (ACT or Diffusion) as a `PolicyRunner`.

    The folder must hold what ``policy.save_pretrained`` + ``preprocessor/postprocessor.save_pretrained``
    write (``config.json``, ``model.safetensors``, ``policy_preprocessor.json``,
    ``policy_postprocessor.json`` and their normalizer stats). A hub checkpoint must be downloaded first
    (``hf download REPO --local-dir DIR``). Raises `PolicyError` naming the path on any failure.
    """
    path = Path(pretrained_path)
    if not path.is_dir():
        raise PolicyError(f"{path}: checkpoint folder does not exist (download hub checkpoints first)")
    if not (path / "config.json").is_file():
        raise PolicyError(f"{path}: no config.json; not a LeRobot policy checkpoint")

    try:
        import torch

        from lerobot.configs import PreTrainedConfig
        from lerobot.policies import get_policy_class, make_pre_post_processors
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise PolicyError(f"cannot import torch/lerobot to load {path}: {exc}") from exc

    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PolicyError(f"{path}: invalid device {device!r}: {exc}") from exc

    try:
        config = PreTrainedConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # draccus/json/type errors: all mean "unreadable config"
        raise PolicyError(f"{path}: cannot read policy config: {exc}") from exc
    if config.type not in SUPPORTED_POLICY_TYPES:
        raise PolicyError(
            f"{path}: policy type {config.type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_POLICY_TYPES)})"
        )
    config.device = torch_device.type
    spec = _spec_from_config(path, config)

    try:
        policy_cls = get_policy_class(config.type)
        policy = policy_cls.from_pretrained(path, config=config, local_files_only=True)
        policy.to(torch_device).eval()
        preprocessor, postprocessor = make_pre_post_processors(
            config,
            pretrained_path=str(path),
            preprocessor_overrides={"device_processor": {"device": str(torch_device)}},
        )
    except Exception as exc:  # safetensors/torch/processor errors: the checkpoint is unusable
        raise PolicyError(f"{path}: cannot load {config.type} checkpoint: {exc}") from exc

    runner_cls = _ActRunner if config.type == "act" else _DiffusionRunner
    return runner_cls(spec, policy, preprocessor, postprocessor, torch_device, path)


def _spec_from_config(path: Path, config: Any) -> PolicySpec:
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

    chunk_size = int(config.chunk_size if config.type == "act" else config.n_action_steps)
    try:
        return PolicySpec(
            policy_type=config.type,
            state_names=state_names,
            cameras=cameras,
            action_names=action_names,
            chunk_size=chunk_size,
            fps=fps,
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


# ---------------------------------------------------------------------------------------------
# LeRobot runners
# ---------------------------------------------------------------------------------------------


@dataclass
class _LeRobotRunner:
    """Shared pre/post-processing; subclasses implement `_chunk` (normalized in, normalized out)."""

    spec: PolicySpec
    policy: Any
    preprocessor: Any
    postprocessor: Any
    device: torch.device
    path: Path
    _features: dict[str, dict[str, Any]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._features = self.spec.observation_features()

    def warmup(self) -> None:
        state, images = dummy_observation(self.spec)
        try:
            self.infer(_WARMUP_CLIENT_ID, state, images, "", seed=0)
        finally:
            self.forget(_WARMUP_CLIENT_ID)

    def forget(self, client_id: str) -> None:
        """No per-client state by default."""

    def infer(
        self,
        client_id: str,
        state: np.ndarray,
        images: dict[str, np.ndarray],
        task: str,
        *,
        seed: int,
    ) -> np.ndarray:
        return self._infer_one(client_id, state, images, task, seed, None)

    def _infer_one(self, client_id: str, state: np.ndarray, images: dict[str, np.ndarray], task: str,
                   seed: int, updates: list | None) -> np.ndarray:
        """`infer`; when `updates` is a list, runners that denoise append their per-step updates to it."""
        import torch

        check_observation(self.spec, state, images)
        try:
            with torch.inference_mode():
                batch = self._preprocess(state, images, task)
                chunk = self._chunk(client_id, batch, seed, updates)  # (1, T, action_dim), normalized
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

    def infer_batch(self, requests: Sequence[InferenceRequest]) -> list[np.ndarray]:
        """One request after another: the default for models whose forward pass cannot be shared.

        Diffusion keeps it: each request samples its noise from its own seeded ``torch.Generator``
        (initial noise and every DDPM step) and conditions on its own client's history, and
        ``conditional_sample`` takes one generator for the whole batch, so a true batch would have to
        re-implement the sampling loop with per-row noise. Serving in a loop keeps the results exact.
        """
        return [self.infer(r.client_id, r.state, r.images, r.task, seed=r.seed) for r in requests]

    def _preprocess(self, state: np.ndarray, images: dict[str, np.ndarray], task: str) -> dict[str, Any]:
        """Exactly LeRobot's rollout path: dataset frame -> tensors -> saved preprocessor."""
        from lerobot.policies import prepare_observation_for_inference
        from lerobot.utils.feature_utils import build_dataset_frame

        values: dict[str, Any] = {name: float(state[i]) for i, name in enumerate(self.spec.state_names)}
        for cam, img in images.items():
            # torch.from_numpy needs a writable, contiguous array (decoded frames may be read-only).
            values[cam] = img if img.flags.writeable and img.flags.c_contiguous else np.array(img)
        frame = build_dataset_frame(self._features, values, prefix="observation")
        observation = prepare_observation_for_inference(frame, self.device, task, None)
        return self.preprocessor(observation)

    def _chunk(self, client_id: str, batch: dict[str, Any], seed: int, updates: list | None = None) -> torch.Tensor:
        raise NotImplementedError


class _ActRunner(_LeRobotRunner):
    """ACT: `predict_action_chunk` is a pure function of the batch in eval mode.

    Temporal ensembling (``temporal_ensemble_coeff``) lives in ``select_action`` and is not used: the
    client blends chunks itself.
    """

    def _chunk(self, client_id: str, batch: dict[str, Any], seed: int, updates: list | None = None) -> torch.Tensor:
        return self.policy.predict_action_chunk(batch)

    def infer_batch(self, requests: Sequence[InferenceRequest]) -> list[np.ndarray]:
        """One forward pass for the whole batch: each observation goes through the saved preprocessor
        on its own (exactly as in `infer`), the results are concatenated along the batch dimension,
        and the chunk is unnormalized as a whole, then split. Equal to `infer` per request within
        float tolerance (batched kernels may sum in another order); tested.
        """
        import torch

        if len(requests) <= 1:
            return super().infer_batch(requests)
        for r in requests:
            check_observation(self.spec, r.state, r.images)
        try:
            with torch.inference_mode():
                batch = _concat_batches([self._preprocess(r.state, r.images, r.task) for r in requests])
                actions = self.postprocessor(self.policy.predict_action_chunk(batch))
        except PolicyError:
            raise
        except Exception as exc:  # torch/lerobot runtime failure: report, never return "no actions"
            raise PolicyError(f"{self.path}: batched inference of {len(requests)} failed: {exc}") from exc
        out = actions.detach().to("cpu", torch.float32).numpy()
        expected = (len(requests), self.spec.chunk_size, self.spec.action_dim)
        if out.shape != expected:
            raise PolicyError(f"{self.path}: model returned actions {out.shape}, expected {expected}")
        return [np.ascontiguousarray(chunk) for chunk in out]


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


def _concat_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
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


class _DiffusionRunner(_LeRobotRunner):
    """Diffusion with per-client observation history and per-request noise.

    LeRobot's DiffusionPolicy keeps one observation queue inside the model (filled by
    ``select_action``) and samples from the global RNG. Here each client has its own deque of its last
    ``n_obs_steps`` preprocessed observations (padded by repeating the first, as LeRobot's
    ``populate_queues`` does), and sampling uses a ``torch.Generator`` seeded with the request's `seed`,
    passed to ``DiffusionModel.conditional_sample`` (initial noise and every DDPM step). The policy's own
    queues are never filled, and ``generate_actions`` is re-done here only to pass the generator.
    ``conditional_sample`` re-sets the shared scheduler's timesteps to the same value on every call;
    `_model_lock` keeps concurrent calls from interleaving inside it.

    `infer_with_info` also returns the per-step denoising updates (for the diffusion-confidence
    horizon). They are recorded by wrapping the shared noise scheduler's ``step`` for the duration of
    one ``conditional_sample`` call (under `_model_lock`): LeRobot's own sampling loop runs unchanged,
    and the wrapper only reads ``prev_sample - sample``, so the chunk is bit-for-bit the one `infer`
    returns (tested).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        cfg = self.policy.config
        if cfg.env_state_feature is not None:  # _spec_from_config already rejects it
            raise PolicyError(f"{self.path}: environment-state inputs are not supported")
        self._n_obs_steps = int(cfg.n_obs_steps)
        self._image_keys = list(cfg.image_features)
        self._histories: dict[str, dict[str, deque]] = {}
        self._history_lock = threading.Lock()
        self._model_lock = threading.Lock()

    def forget(self, client_id: str) -> None:
        with self._history_lock:
            self._histories.pop(client_id, None)

    def infer_with_info(
        self,
        client_id: str,
        state: np.ndarray,
        images: dict[str, np.ndarray],
        task: str,
        *,
        seed: int,
    ) -> InferenceInfo:
        import torch

        steps: list[torch.Tensor] = []
        actions = self._infer_one(client_id, state, images, task, seed, steps)
        if not steps:
            raise PolicyError(f"{self.path}: the noise scheduler reported no denoising steps")
        updates = torch.stack(steps).to("cpu", torch.float32).numpy()  # (steps, T, action_dim)
        return InferenceInfo(actions=actions, denoise_updates=updates)

    def _chunk(self, client_id: str, batch: dict[str, Any], seed: int, updates: list | None = None) -> torch.Tensor:
        import torch
        from lerobot.policies.utils import populate_queues

        step = {OBS_STATE_KEY: batch[OBS_STATE_KEY]}
        if self._image_keys:
            # Same stacking as DiffusionPolicy.select_action: (B, n_cameras, C, H, W).
            step["observation.images"] = torch.stack([batch[k] for k in self._image_keys], dim=-4)
        with self._history_lock:
            history = self._histories.get(client_id)
            if history is None:
                history = {k: deque(maxlen=self._n_obs_steps) for k in step}
                self._histories[client_id] = history
            populate_queues(history, step)
            stacked = {k: torch.stack(list(q), dim=1) for k, q in history.items()}

        model = self.policy.diffusion
        generator = torch.Generator(device=self.device).manual_seed(int(seed))
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
