"""The runner seam: what the server hands a policy, what it gets back, and what a runner can do.

Every runner implements `PolicyRunner`: ``run(requests)`` takes one observation per client session
(state vector, RGB uint8 images, task, seed) and returns one `InferenceResult` per request, in order.
What a result carries is the runner's declared `RunnerCapabilities.output`: ``actions`` (a float32
``(chunk_size, action_dim)`` chunk of *unnormalized* actions; every policy), ``text`` (a System 2
component's next subtask) or ``verdict`` (a safety / monitor component's label and score). One
runner instance serves every session, so a result may depend only on its request and on the earlier
requests of *that* session (``session_id``), never on who was served before or in the same call:
this is the purity invariant the whole system relies on.

What a runner can do is declared on its spec (`RunnerCapabilities`) and read by the server; nothing
is probed with ``getattr``.

No torch here: the synthetic policy and the server's pure parts import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.protocol.reasons import OutputKind

OBS_STATE_KEY = "observation.state"
OBS_IMAGES_PREFIX = "observation.images."

#: `InferenceRequest.extras` key of a request's real-time-chunking inputs, present only when the runner
#: declares `capabilities.rtc` and the observation carried them: a `protocol.messages.RtcInputs` whose
#: ``prefix`` is float32 ``(n, action_dim)`` in robot (unnormalized) units (row k: the action the robot
#: executes at capture step + k, i.e. row k of the chunk to compute; ``n`` may be 0, n <= the chunk
#: sent) and whose ``delay_steps`` (0..n) is the number of leading rows executed from the prefix
#: anyway. A runner may report the delay it actually assumed as ``InferenceResult.extras[RTC_EXTRA_DELAY]``
#: (int); the server echoes it (else the request's) as the chunk's ``rtc_delay_steps``.
RTC_EXTRA = "rtc"
RTC_EXTRA_DELAY = "rtc_delay_steps"

#: `InferenceRequest.extras` key of the component query of a request that came through a multi-model
#: task's observation stream (docs/pipelines.md): a `ComponentQuery` with the prompt and the label set
#: the task descriptor gives this component. Present only for a server entry with a `pipeline` block
#: that says them; a runner then prefers them to its own defaults.
COMPONENT_EXTRA = "component"

#: What a runner answers an observation with (`RunnerCapabilities.output`, `Status.output`).
OUTPUTS = tuple(OutputKind)

#: What a runner's refinement steps can be (`RunnerCapabilities.refinement_kind`).
REFINEMENT_KINDS = ("denoising", "flow_matching")

# Session id under which `BaseRunner.warmup` runs; forgotten right after.
_WARMUP_SESSION_ID = "\x00warmup"


@dataclass(frozen=True)
class RunnerCapabilities:
    """What a runner can do; the server decides from this, never by probing the runner.

    - `max_batch`: requests one `run` call may take (``None``: any number; 1: one at a time). A
      runner that can take several need not share a forward pass (Diffusion loops); it must only give
      each request what it would get alone.
    - `history_length`: consecutive observations of a session the policy conditions on
      (``n_obs_steps``); 1 for a policy without history.
    - `refinement_updates`: `run(..., capture_updates=True)` reports per-step refinement (denoising)
      updates (`InferenceResult.refinement_updates`).
    - `refinement_kind`: what those steps are, which sets the horizon policy's default threshold
      (`scheduling.horizon.DEFAULT_THRESHOLDS`): ``"denoising"`` (a noise schedule that shrinks the
      last steps: Diffusion) or ``"flow_matching"`` (equal Euler steps along a near-straight path:
      SmolVLA, pi0, pi0.5).
    - `rtc`: accepts real-time-chunking inputs, ``extras[RTC_EXTRA]`` of a request (see `RTC_EXTRA`);
      the server then advertises `rtc` in its status.
    - `reads_task`: the task string conditions the model (language-conditioned policies).
    - `output`: what each result carries, and so which message the server publishes on which topic:
      ``actions`` (`InferenceResult.actions`, an ActionChunk on ``.../<client>/action``), ``text``
      (`InferenceResult.text`, a TextResult on ``.../text``) or ``verdict`` (`InferenceResult.label`
      and `score`, a Verdict on ``.../verdict``).
    - `iteration_level`: the runner decodes step by step and can take requests into a running batch
      and answer each the step it finishes (``stream(first, join, emit)``, as `pi0_fast.Pi0FastRunner`);
      the server then serves it through `RunnerAdapter.stream` instead of one `run` per batch.
    - `streams_text`: besides its answers, it writes text across frames from the same prefill (a
      pi0.5 with a `language` block): the status says so, and the server advances it between batches.
    - `settings_blocks`: the manifest blocks that configure this family and the method that takes
      each validated block (``{"decode": "configure_decode"}`` for pi0-FAST); a block given to a
      runner that does not declare it is refused at start-up naming the field.
    - `image_device`: the CUDA device (``"cuda:0"``) the runner takes its images on, when it is
      served with ``images_on_device`` (runners/device_images.py): the server then decodes JPEG
      frames there, and a request's images may be uint8 (H, W, 3) torch tensors on that device as
      well as numpy arrays. None: numpy arrays only.
    """

    max_batch: int | None = 1
    history_length: int = 1
    refinement_updates: bool = False
    refinement_kind: str = "denoising"
    rtc: bool = False
    reads_task: bool = False
    output: str = OutputKind.ACTIONS
    iteration_level: bool = False
    streams_text: bool = False
    settings_blocks: tuple[tuple[str, str], ...] = ()  # (manifest block, method taking it)
    image_device: str | None = None

    def __post_init__(self) -> None:
        if self.max_batch is not None and (not isinstance(self.max_batch, int) or self.max_batch < 1):
            raise ConfigError("capabilities.max_batch", f"must be a positive integer or None, got {self.max_batch!r}")
        if self.refinement_kind not in REFINEMENT_KINDS:
            raise ConfigError("capabilities.refinement_kind",
                              f"must be one of {', '.join(REFINEMENT_KINDS)}, got {self.refinement_kind!r}")
        if not isinstance(self.history_length, int) or self.history_length < 1:
            raise ConfigError("capabilities.history_length",
                              f"must be a positive integer, got {self.history_length!r}")
        if self.output not in OUTPUTS:
            raise ConfigError("capabilities.output", f"must be one of {', '.join(OUTPUTS)}, got {self.output!r}")


@dataclass(frozen=True)
class PolicySpec:
    """What a policy consumes and produces, in the robot's vocabulary, and what its runner can do.

    `cameras` maps the robot-side camera name (``"front"``, not ``"observation.images.front"``) to its
    (height, width); images are RGB uint8 ``(H, W, 3)``. Dict order is the order the model sees them.
    """

    policy_type: str
    state_names: tuple[str, ...]
    cameras: dict[str, tuple[int, int]]
    action_names: tuple[str, ...]
    chunk_size: int
    fps: int | None = None
    capabilities: RunnerCapabilities = RunnerCapabilities()

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
        if not isinstance(self.capabilities, RunnerCapabilities):
            raise ConfigError("capabilities", f"must be RunnerCapabilities, got {type(self.capabilities).__name__}")

    @property
    def action_dim(self) -> int:
        return len(self.action_names)

    @property
    def state_dim(self) -> int:
        return len(self.state_names)

    def status_fields(self) -> dict[str, Any]:
        """What `protocol.messages.Status` advertises about the model beyond shapes (docs/protocol.md §5.3):
        ``Status(..., **spec.status_fields())``."""
        caps = self.capabilities
        return {"chunk_size": self.chunk_size, "reads_task": caps.reads_task,
                "history_length": caps.history_length, "output": caps.output}

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


@dataclass(frozen=True)
class InferenceRequest:
    """One session's decoded observation, as `PolicyRunner.run` takes it.

    `session_id` is the client id whose session this is (history is kept per session); `seed` fixes
    any sampling noise; `episode_id` is the client's episode, when it sends one; `extras` holds inputs
    a family needs beyond the observation (e.g. a real-time-chunking prefix), keyed by name;
    `history` the client's previous frames, when it sends them. `images`: RGB uint8 (H, W, 3) numpy
    arrays, or torch tensors on the runner's device when its spec declares one (`image_device`).
    """

    session_id: str
    state: np.ndarray
    images: dict[str, np.ndarray]
    task: str
    seed: int
    episode_id: str | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    # The robot's own frames of the steps just before this one, oldest first, 1/fps apart, as
    # (state, images) in this request's form: what a model with history_length n > 1 conditions on
    # instead of the observations served earlier in the session. At most n - 1; empty when the
    # client sent none.
    history: tuple[tuple[np.ndarray, dict[str, np.ndarray]], ...] = ()


@dataclass(frozen=True)
class ComponentQuery:
    """What a multi-model task asks of this component (`COMPONENT_EXTRA`): the task descriptor's prompt
    for it (empty: the runner's own) and, for a verdict, the labels it may answer (empty: the runner's)."""

    task: str
    component: str
    prompt: str = ""
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class InferenceResult:
    """One request's answer, plus what the model exposes about it.

    Which fields are set is the runner's `capabilities.output`:

    - ``actions``: `actions` is float32 ``(chunk_size, action_dim)``, unnormalized. `refinement_updates`
      is ``(steps, chunk_size, action_dim)`` float32 when the call captured them: for each refinement
      (denoising) step, in order, the change it made to each action (``prev_sample - sample``), in the
      model's normalized action space; horizon policies (`scheduling.horizon`) read it. ``None``
      otherwise.
    - ``text``: `text`, the next subtask in words (`InferenceResult.of_text`).
    - ``verdict``: `label` (one of `protocol.messages.VERDICT_LABELS`) and optionally `score`, the
      model's confidence in it, 0..1 (`InferenceResult.of_verdict`).

    `silent`: the runner withholds this answer (nothing is published; the server counts it). Only a
    fault-injection runner sets it (the synthetic one's `silent_after`), so that a client's fallback
    for a component that stops answering can be tested. `extras`: other per-request outputs a family
    reports, keyed by name.
    """

    actions: np.ndarray | None = None
    refinement_updates: np.ndarray | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    text: str | None = None
    label: str | None = None
    score: float | None = None
    silent: bool = False

    @classmethod
    def of_text(cls, text: str) -> InferenceResult:
        return cls(text=text)

    @classmethod
    def of_verdict(cls, label: str, score: float | None = None) -> InferenceResult:
        return cls(label=label, score=score)


@runtime_checkable
class PolicyRunner(Protocol):
    """The contract between the server and a policy.

    `run` returns one `InferenceResult` per request, in the same order. The server guarantees
    ``len(requests) <= spec.capabilities.max_batch`` (when not None) and that the requests come from
    distinct sessions. ``run(requests)[i]`` must equal ``run([requests[i]])[0]`` (within float
    tolerance for a shared forward pass), whatever else is in the call: the purity invariant holds per
    request. One bad request may fail the whole call with `PolicyError`; the server then runs the
    requests again one at a time, so that only the bad one fails. `capture_updates` is only set when
    ``spec.capabilities.refinement_updates``; the captured updates must not change the sample (the
    actions equal those of a call without capture bit for bit); a runner without the capability
    ignores it. `forget` drops a session's per-episode state (observation history).
    `check_request` refuses, before any batching, a request this model cannot take although it has
    the spec's shapes (e.g. a task longer than the tokenizer reads), with a `ProtocolError` whose
    `reason` the server counts; it runs on the inference thread and must be cheap.
    `figures` returns the runner's own counters for telemetry (docs/telemetry.md, "Runner figures"):
    flat names with a dot-separated prefix of the runner's kind (``decode.tokens``), numbers only;
    it is called from the telemetry thread, so it copies, never blocks on inference.
    """

    spec: PolicySpec

    def warmup(self) -> None: ...

    def check_request(self, request: InferenceRequest) -> None: ...

    def run(
        self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False
    ) -> list[InferenceResult]: ...

    def forget(self, session_id: str) -> None: ...

    def figures(self) -> Mapping[str, float]: ...


class BaseRunner:
    """What every runner shares: warm-up on a dummy observation, `forget` with nothing to forget, and
    `infer`, a one-request convenience for tests and tools (the server calls `run`).

    Subclasses set `spec` and implement `run`.
    """

    spec: PolicySpec

    def run(
        self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False
    ) -> list[InferenceResult]:
        raise NotImplementedError

    def warmup(self) -> None:
        """One dummy inference (zero state, grey images) under a private session, then forget it."""
        state, images = dummy_observation(self.spec)
        try:
            self.run([InferenceRequest(_WARMUP_SESSION_ID, state, images, "", 0)])
        finally:
            self.forget(_WARMUP_SESSION_ID)

    def forget(self, session_id: str) -> None:
        """No per-session state by default."""

    def check_request(self, request: InferenceRequest) -> None:
        """Every request with the spec's shapes is accepted by default."""

    def figures(self) -> Mapping[str, float]:
        """No counters of its own by default."""
        return {}

    def infer(
        self,
        session_id: str,
        state: np.ndarray,
        images: dict[str, np.ndarray],
        task: str,
        *,
        seed: int,
    ) -> np.ndarray:
        """The chunk of `run` on this one observation."""
        return self.run([InferenceRequest(session_id, state, images, task, seed)])[0].actions


def check_observation(spec: PolicySpec, state: np.ndarray, images: dict[str, np.ndarray]) -> None:
    """Raise `PolicyError` unless `state` and `images` match `spec` exactly."""
    if not isinstance(state, np.ndarray) or state.shape != (spec.state_dim,):
        shape = getattr(state, "shape", type(state).__name__)
        raise PolicyError(f"state must have shape ({spec.state_dim},), got {shape}")
    if state.dtype.kind not in "fiu":
        raise PolicyError(f"state must be numeric, got dtype {state.dtype}")
    if set(images) != set(spec.cameras):
        raise PolicyError(f"expected images for cameras {sorted(spec.cameras)}, got {sorted(images)}")
    device = spec.capabilities.image_device
    for cam, (h, w) in spec.cameras.items():
        img = images[cam]
        if isinstance(img, np.ndarray):
            ok = img.shape == (h, w, 3) and img.dtype == np.uint8
        else:  # a frame decoded on the runner's device, when it takes them (no torch import here)
            ok = (device is not None and str(getattr(img, "device", "")) == device
                  and tuple(getattr(img, "shape", ())) == (h, w, 3) and str(getattr(img, "dtype", "")) == "torch.uint8")
        if not ok:
            shape = getattr(img, "shape", type(img).__name__)
            dtype = getattr(img, "dtype", None)
            raise PolicyError(f"image {cam!r} must be uint8 ({h}, {w}, 3), got {dtype} {shape}")


def dummy_observation(spec: PolicySpec) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A valid observation for `spec` (zero state, mid-grey images), for warm-up and profiling."""
    state = np.zeros(spec.state_dim, dtype=np.float32)
    images = {cam: np.full((h, w, 3), 128, dtype=np.uint8) for cam, (h, w) in spec.cameras.items()}
    return state, images
