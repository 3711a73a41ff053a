"""The server manifest (docs/server.md, "Manifest reference").

    cluster_uuid: jupiter
    experiment_tag: fabio2
    server_id: gpu0                       # optional; default <hostname>-<pid>
    zenoh: {mode: peer, listen: [tcp/127.0.0.1:7447], multicast_scouting: false}
    sessions: {liveliness_grace_s: 3, idle_timeout_s: 60}
    server:
      - model_id: act
        model_version: v1
        pretrained_path: checkpoints/demo_act     # or a hub id (lerobot/smolvla_base[@rev]; server/runners/hub.py),
                                                  # or `synthetic: {...}` for a torch-free fake
        application_tag: cookie
        device: cpu
        fps: 30
        endpoint: tcp/127.0.0.1:7447              # merged into zenoh.listen
        actions_per_chunk: 50
        scheduler: round_robin                    # or fifo, wait_ratio (docs/scheduling.md), or a mapping:
                                                  # {type: wait_ratio, buckets: 10, aging: 1, first_request: literal}
        horizon: {type: diffusion_confidence, threshold: 0.4, h_min: 5}   # or none (default), static
        rtc: {enabled: false, execution_horizon: 10, max_guidance_weight: 10.0, prefix_attention_schedule: linear}
                                                  # real-time chunking (smolvla, pi0, pi05; docs/policies.md)
        compile: off                              # or default, max-autotune, cuda_graphs (CUDA), or
                                                  # {mode: default, buckets: [1, 4, 8], fallback: eager}
        max_batch_size: 1                         # clients per forward pass, or auto (profiled)
        accept_unknown_clients: false
        max_unknown_clients: 64                   # places shared by unlisted clients (when accepted)
        clients:
          - client_uuid: cookie-worker-4269
        pipeline:                                 # optional: serve components of multi-model tasks
          - {task: assemble_kit, component: safety, bit: 2, prompt: "is the workcell safe?", labels: [safe, unsafe]}

Validated at start-up; any problem raises ConfigError naming the file, the field and the issue. The
blocks that configure a runner or a scheduler are that code's own config classes (`synthetic` is
`SyntheticPolicyConfig`, `vlm` `VlmSettings`, `language` `LanguageSettings`, `rtc` `RtcSettings`,
`scheduler` the registered type's `SchedulerConfig`), declared and validated once (lerobot_zenoh/config.py).
A relative `pretrained_path` is resolved against the manifest file's folder (falling back to the
current directory when only that one exists); when neither exists and it reads as a hub id
(`user/repo[@revision]`), the runner loader fetches it or takes it from the Hugging Face cache.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from lerobot_zenoh.config import Settings, TypedBlock, YamlBoolWord, config_error, verdict_labels
from lerobot_zenoh.errors import ConfigError, KeyExprError
from lerobot_zenoh.model_source import check_model_source
from lerobot_zenoh.protocol.keys import AppKey, pipeline_app, validate_chunk, validate_client_id
from lerobot_zenoh.protocol.messages import MAX_COMPONENTS
from lerobot_zenoh.protocol.reasons import OutputKind
from lerobot_zenoh.scheduling.horizon import HORIZON_CONFIGS, HorizonPolicy
from lerobot_zenoh.scheduling.request_schedulers import RequestScheduler, scheduler_type
from lerobot_zenoh.scheduling.scheduler_interface import scheduler_configs
from lerobot_zenoh.server.runners.compiled import CompileSettings, parse_compile
from lerobot_zenoh.server.runners.lerobot import RtcSettings
from lerobot_zenoh.server.runners.pi05_language import LanguageSettings
from lerobot_zenoh.server.runners.pi0_fast import DecodeSettings
from lerobot_zenoh.server.runners.synthetic import SyntheticPolicyConfig
from lerobot_zenoh.server.runners.vlm import VlmSettings
from lerobot_zenoh.transport.settings import ZenohSettings


class ClientEntry(Settings):
    client_uuid: str

    @field_validator("client_uuid")
    @classmethod
    def _chunk(cls, v: str) -> str:
        return _key_chunk(validate_client_id, "client_uuid", v)


class HorizonEntry(TypedBlock):
    """The execution-horizon policy of one model (Kairos 3.1; docs/scheduling.md), written like a
    scheduler: ``none`` (no horizon is sent: the client uses the whole chunk), ``{type: static, h}``,
    or ``{type: diffusion_confidence, threshold, h_min}``; the settings are the policy's own config
    class (scheduling/horizon.py). A runner that does not expose its refinement updates gets ``H`` =
    the whole chunk; without ``threshold``, the default for the model's kind of refinement steps
    (`horizon.DEFAULT_THRESHOLDS`).
    """

    kind = "horizon"
    default_type = "none"

    @classmethod
    def types(cls):
        return HORIZON_CONFIGS

    def build(self, refinement_kind: str = "denoising") -> HorizonPolicy | None:
        """The policy; `refinement_kind` (the runner's ``capabilities.refinement_kind``) picks the
        default threshold when none is set."""
        return self.settings.build(refinement_kind)


class SchedulerEntry(TypedBlock):
    """The request scheduler of one model and its settings (docs/server.md, "Schedulers and their settings").

    Written as a name (`scheduler: wait_ratio`, the scheduler's defaults) or a mapping
    (`scheduler: {type: wait_ratio, buckets: 10, aging: 1, first_request: literal}`). The type is
    looked up in the scheduler registry (`scheduling.scheduler_interface.SCHEDULERS`, open to
    plugins) and the other keys are validated by that type's own config class.
    """

    kind = "scheduler"
    default_type = "round_robin"

    @classmethod
    def types(cls):
        return scheduler_configs()

    def build(self, field: str = "scheduler") -> RequestScheduler:
        return scheduler_type(self.type, field).build(self.settings)


class SessionsEntry(Settings):
    """When the server closes a client's session (docs/server.md, "Sessions").

    A session closes `liveliness_grace_s` after the client's liveliness token vanished (the client
    stopped, crashed or lost its link), or after `idle_timeout_s` without an observation (clients
    that declare no token, invented ids). Closing drops the client's observation history and
    scheduler state and frees its place.
    """

    liveliness_grace_s: float = Field(3.0, ge=0, le=3600, allow_inf_nan=False)
    idle_timeout_s: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False)


class PipelineText(Settings):
    """The System 2 component a pi0.5 language entry (`ModelEntry.language`) serves from the same
    prefill as the item's System 1 (docs/policies.md, "pi0.5: actions and language from one prefill"):
    an observation whose mask has `bit` starts (or continues) the robot's text, published on this
    app's ``.../<robot>/text`` as it grows."""

    component: str
    bit: int = Field(ge=0, lt=MAX_COMPONENTS, strict=True)
    prompt: str = ""
    max_new_tokens: int | None = Field(None, ge=1, strict=True)

    @field_validator("component")
    @classmethod
    def _chunk(cls, v: str, info) -> str:
        return _key_chunk(validate_chunk, info.field_name, v)


class PipelineEntry(Settings):
    """One multi-model task whose observation stream this entry serves (docs/pipelines.md).

    The server subscribes to the task's stream ``<cluster>/<experiment>/_pipeline/1/<task>/*/obs``
    (and its robots' liveliness tokens there) besides its own app's ``*/obs``, serves the observations
    whose `component_mask` has bit `bit` set (or no mask), and answers on its own app key. `prompt` and
    `labels` are what the task descriptor asks of this component; a runner that reads them (the VLM,
    the synthetic verdict default) prefers them to its own."""

    task: str
    component: str
    bit: int = Field(ge=0, lt=MAX_COMPONENTS, strict=True)
    prompt: str = ""
    labels: list[str] = Field(default_factory=list)  # distinct verdict labels
    # A second component of the same task served from the same prefill (a `language` entry only).
    text: PipelineText | None = None

    @field_validator("task", "component")
    @classmethod
    def _chunks(cls, v: str, info) -> str:
        return _key_chunk(validate_chunk, info.field_name, v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str]) -> list[str]:
        return verdict_labels(v)


class EngineEntry(Settings):
    """One engine the model's edge scheduler dispatches batches to (docs/server.md, "Engines").

    `local: true` is the scheduler's own inference loop (at most one); any other entry is a
    `lerobot-policy-server` process started with `role: engine` and this `engine_id`, loading the same
    checkpoint, reached on its keys ``<app>/engine/<engine_id>/...`` (through `endpoint`, a Zenoh
    locator added to the session's `connect` list, or through the routers already configured).
    `capacity` is the most requests in flight on it (one batch); `profile` its latency per batch size
    in milliseconds ({1: 60, 4: 75}), or `measured`: the local engine's start-up profile
    (`max_batch_size: auto`), or the one a remote engine measured at its start-up and reports.
    `max_in_flight` (cloud engines; 0: `capacity`, Kairos' rule) lets a cloud engine hold more than
    one batch: the next one waits in its inbox instead of the engine idling for a round trip."""

    engine_id: str
    tier: Literal["edge", "cloud"]
    capacity: int = Field(ge=1, strict=True)
    local: bool = Field(False, strict=True)
    endpoint: str | None = None
    profile: dict[int, Annotated[float, Field(gt=0, allow_inf_nan=False)]] | Literal["measured"] | None = None
    max_in_flight: int = Field(0, ge=0, strict=True)

    @field_validator("engine_id")
    @classmethod
    def _chunk(cls, v: str) -> str:
        return _key_chunk(validate_chunk, "engine_id", v)

    @field_validator("profile")
    @classmethod
    def _profile(cls, v):
        if isinstance(v, dict):
            if not v:
                raise ValueError("an empty profile; give {batch size: ms, ...} or measured")
            for b in v:
                if b < 1:
                    raise ValueError(f"batch size {b} < 1")
        return v

    @model_validator(mode="after")
    def _has_profile(self):
        if self.profile is None:
            raise ValueError(f"engine {self.engine_id!r} (tier {self.tier}) has no profile: give "
                             "{batch size: ms, ...} or measured")
        if self.local and self.endpoint is not None:
            raise ValueError("the local engine is this process: it has no endpoint")
        if self.max_in_flight and self.tier != "cloud":
            raise ValueError(f"engine {self.engine_id!r}: max_in_flight is for cloud engines (edge engines are "
                             "fed one batch at a time)")
        if 0 < self.max_in_flight < self.capacity:
            raise ValueError(f"engine {self.engine_id!r}: max_in_flight {self.max_in_flight} is below its capacity "
                             f"{self.capacity} (0: the capacity)")
        return self


class DispatchEntry(Settings):
    """How the edge scheduler treats its engines (docs/server.md, "Engines")."""

    # A dispatched request with no answer after this long goes back to the edge's queue (counted).
    answer_timeout_s: float = Field(2.0, gt=0, le=600, allow_inf_nan=False)
    # How often each remote engine's status is queried: its round trip (RTT) and whether it is there.
    probe_period_s: float = Field(0.5, gt=0, le=60, allow_inf_nan=False)
    # Probes unanswered in a row before an engine counts as partitioned (no more dispatches to it).
    probes_lost: int = Field(2, ge=1, le=100, strict=True)
    # How long start-up waits for each remote engine's first status answer.
    start_timeout_s: float = Field(10.0, gt=0, le=600, allow_inf_nan=False)


class ModelEntry(Settings):
    model_id: str
    model_version: str
    application_tag: str
    pretrained_path: str | None = None
    # A torch-free policy with a set latency, for tests, benchmarks and dry runs (runners/synthetic.py).
    synthetic: SyntheticPolicyConfig | None = None
    # A VLM task component (runners/vlm.py): `pretrained_path` is then a transformers VLM folder.
    vlm: VlmSettings | None = None
    # A pi0.5 checkpoint answering text too, from the prefill of its actions (runners/pi05_language.py).
    language: LanguageSettings | None = None
    # A pi0-FAST checkpoint's continuous batching: KV slots and how requests join (runners/pi0_fast.py).
    decode: DecodeSettings | None = None
    device: str = "cpu"
    # Weights and activations: float32 (fp32) or bfloat16 (bf16; VLAs only, refused at start-up by
    # families that cannot serve it).
    dtype: Literal["float32", "fp32", "bfloat16", "bf16"] = "float32"
    # CUDA only: decode the JPEG frames of each batch on the device (nvJPEG) and copy the others there
    # as uint8 through pinned memory (runners/device_images.py); not measured on a GPU yet.
    images_on_device: bool = False
    # Local folders for assets a checkpoint names but does not hold (VLAs; docs/policies.md): its
    # tokenizer, and SmolVLA's VLM config + processor. Resolved like pretrained_path.
    tokenizer_path: str | None = None
    vlm_path: str | None = None
    fps: int = Field(30, ge=1, le=1000)
    endpoint: str | None = None
    endpoints: list[str] = Field(default_factory=list)
    actions_per_chunk: int | None = Field(None, ge=1)
    # Whom to serve next: a name, or a mapping with the scheduler's settings (SchedulerEntry).
    scheduler: SchedulerEntry = Field(default_factory=SchedulerEntry)
    # Most clients served in one forward pass (1 = no cross-client batching): a number, or `auto` to
    # measure the latency-vs-batch profile on the serving hardware at start-up (sizes 1, 2, 4, ... up
    # to `profile_max_batch`, within `profile_budget_s`) and take its saturation point
    # (docs/scheduling.md). A runner never gets more than its `capabilities.max_batch` either way.
    max_batch_size: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = 1
    profile_max_batch: int = Field(16, ge=1, le=256)
    profile_budget_s: float = Field(10.0, gt=0)
    # Execution horizon sent with each chunk (none = not sent; docs/scheduling.md).
    horizon: HorizonEntry = Field(default_factory=HorizonEntry)
    # Real-time chunking (runners/lerobot.py): off by default.
    rtc: RtcSettings = Field(default_factory=RtcSettings)
    # Compiled inference (runners/compiled.py): off (default), default, max-autotune, cuda_graphs, or a
    # block {mode, buckets, fallback}; every batch bucket is compiled at start-up.
    compile: CompileSettings = Field(default_factory=CompileSettings)
    accept_unknown_clients: bool = False
    # Sessions of clients not listed in `clients` (when accepted) share this many places; listed
    # clients always have their own. A place is freed when its session closes (see `sessions`).
    max_unknown_clients: int = Field(64, ge=1)
    clients: list[ClientEntry] = Field(default_factory=list)
    # Serve components of multi-model tasks from their observation streams too (PipelineEntry), besides
    # this app's own `*/obs`; a mapping is a list of one. Answers go to this app's client keys.
    pipeline: list[PipelineEntry] = Field(default_factory=list)
    # Engines this model's scheduler dispatches to (EngineEntry); empty: the inference loop alone.
    engines: list[EngineEntry] = Field(default_factory=list)
    dispatch: DispatchEntry = Field(default_factory=DispatchEntry)

    @field_validator("pipeline", mode="before")
    @classmethod
    def _pipeline(cls, v):
        return [v] if isinstance(v, dict) else v

    @field_validator("compile", mode="before")
    @classmethod
    def _compile(cls, v):
        return parse_compile(v)

    @field_validator("model_id", "model_version", "application_tag")
    @classmethod
    def _chunks(cls, v: str, info) -> str:
        return _key_chunk(validate_chunk, info.field_name, v)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not (v == "cpu" or v == "mps" or v == "cuda" or v.startswith("cuda:")):
            raise ValueError(f"{v!r} is not a torch device (cpu, cuda, cuda:N, mps)")
        return v

    @model_validator(mode="after")
    def _policy_source(self):
        check_model_source(self.pretrained_path, self.synthetic, vlm=self.vlm, language=self.language,
                           decode=self.decode, images_on_device=self.images_on_device)
        if self.images_on_device and not self.device.startswith("cuda"):
            raise ValueError(f"images_on_device needs a CUDA device, the model is on {self.device!r}")
        for p in self.pipeline:
            if p.text is not None and self.language is None:
                raise ValueError(f"pipeline: task {p.task!r}: text ({p.text.component}) needs this entry's "
                                 "language block (a pi05 checkpoint answering text)")
            if p.text is not None and p.text.bit == p.bit:
                raise ValueError(f"pipeline: task {p.task!r}: text.bit {p.bit} is the item's own bit")
            if (p.text is not None and p.text.max_new_tokens is not None
                    and p.text.max_new_tokens > self.language.max_new_tokens):
                raise ValueError(f"pipeline: task {p.task!r}: text.max_new_tokens {p.text.max_new_tokens} is over "
                                 f"language.max_new_tokens {self.language.max_new_tokens}: every request would be refused")
        if (self.vlm is not None and self.vlm.output == OutputKind.VERDICT and not self.vlm.labels
                and (not self.pipeline or any(not p.labels for p in self.pipeline))):
            raise ValueError("vlm.labels: a verdict VLM needs labels (here, or on every pipeline item)")
        if not self.clients and not self.accept_unknown_clients:
            raise ValueError("no clients listed and accept_unknown_clients is false: nobody could be served")
        ids = [c.client_uuid for c in self.clients]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate client_uuid in clients: {sorted({i for i in ids if ids.count(i) > 1})}")
        engine_ids = [e.engine_id for e in self.engines]
        for engine_id in engine_ids:
            if engine_ids.count(engine_id) > 1:
                raise ValueError(f"engines: duplicate engine_id {engine_id!r}")
        if sum(e.local for e in self.engines) > 1:
            raise ValueError("engines: more than one local engine (the local engine is this process's loop)")
        if self.engines and self.pipeline:
            raise ValueError("engines: a component of multi-model tasks (pipeline) is served by its own loop only")
        tasks = [p.task for p in self.pipeline]
        if len(tasks) != len(set(tasks)):
            raise ValueError(f"pipeline: task {next(t for t in tasks if tasks.count(t) > 1)!r} is listed twice "
                             "(one entry serves one component per task)")
        return self

    @property
    def listen_endpoints(self) -> list[str]:
        return ([self.endpoint] if self.endpoint else []) + list(self.endpoints)


class Manifest(Settings):
    cluster_uuid: str
    experiment_tag: str
    server_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # The same block as the client's --zenoh.* (transport/settings.py); relative file paths are
    # resolved like pretrained_path.
    zenoh: ZenohSettings = Field(default_factory=ZenohSettings)
    server: list[ModelEntry] = Field(min_length=1)
    # Hot standby: the server_id of the primary this server stands in for (docs/reliability.md).
    standby_for: str | None = None
    # A primary starting while other servers of its app are up waits this long before serving.
    handover_grace_s: float = Field(0.5, ge=0, le=30)
    # Period of the telemetry published on .../<app>/server/<server_id>/metrics; 0 turns it off.
    telemetry_period_s: float = Field(1.0, ge=0)
    sessions: SessionsEntry = Field(default_factory=SessionsEntry)
    # Offer the same-host path (raw frames through /dev/shm, no JPEG) to clients on this machine
    # that run as the same user (docs/protocol.md, "The same-host path"); off: every client sends JPEG.
    same_host: bool = Field(True, strict=True)
    # `server`: serve robots (and dispatch to `engines`); `engine`: run only what an edge scheduler
    # dispatches on this process's keys <app>/engine/<engine_id>/... (docs/server.md, "Engines").
    role: Literal["server", "engine"] = "server"
    engine_id: str | None = None
    # Where inductor keeps what it compiled (compiled models, `compile`): a restart with the same folder
    # loads the graphs instead of compiling them again. Inductor loads what it holds as code, so the
    # folder must be writable by the server's user alone (runners/compile_cache.py; docs/security.md).
    # Default: a private folder, $XDG_CACHE_HOME/lerobot-zenoh/inductor or ~/.cache/lerobot-zenoh/inductor.
    compile_cache_dir: str | None = None
    source: str = Field("<memory>", exclude=True)

    @field_validator("cluster_uuid", "experiment_tag", "server_id")
    @classmethod
    def _chunks(cls, v: str, info) -> str:
        return _key_chunk(validate_chunk, info.field_name, v)

    @model_validator(mode="after")
    def _standby(self):
        if self.standby_for is not None:
            _key_chunk(validate_chunk, "standby_for", self.standby_for)
            if self.standby_for == self.server_id:
                raise ValueError("standby_for names this server itself")
        return self

    @model_validator(mode="after")
    def _engine_role(self):
        if self.role == "engine":
            if self.engine_id is None:
                raise ValueError("role engine needs engine_id (the id the edge's manifest lists)")
            _key_chunk(validate_chunk, "engine_id", self.engine_id)
            if self.standby_for is not None:
                raise ValueError("role engine: standby_for does not apply (an edge re-queues what an engine drops)")
            if any(m.engines for m in self.server):
                raise ValueError("role engine: an engine does not dispatch to engines of its own")
        elif self.engine_id is not None:
            raise ValueError("engine_id applies to role engine only")
        return self

    @model_validator(mode="after")
    def _unique_apps(self):
        apps = [(m.model_id, m.model_version, m.application_tag) for m in self.server]
        if len(apps) != len(set(apps)):
            raise ValueError("two entries serve the same model_id/model_version/application_tag")
        return self

    def app_key(self, entry: ModelEntry) -> AppKey:
        return AppKey(self.cluster_uuid, self.experiment_tag, entry.model_id, entry.model_version, entry.application_tag)

    def pipeline_key(self, item: PipelineEntry) -> AppKey:
        """The observation stream of a multi-model task (`keys.pipeline_app`)."""
        return pipeline_app(self.cluster_uuid, self.experiment_tag, item.task)

    def zenoh_settings(self) -> ZenohSettings:
        """The session settings: the `zenoh` block, each entry's endpoints added to its listen list."""
        listen = list(self.zenoh.listen)
        connect = list(self.zenoh.connect)
        for entry in self.server:
            listen += [e for e in entry.listen_endpoints if e not in listen]
            connect += [e.endpoint for e in entry.engines if e.endpoint and e.endpoint not in connect]
        return self.zenoh.replace(listen=listen, connect=connect,
                                  json5_overrides=dict(self.zenoh.json5_overrides)
                                  ).with_files_resolved(lambda v: str(self._resolve(v)))

    def resolve_path(self, entry: ModelEntry) -> Path:
        return self._resolve(entry.pretrained_path or "")

    def resolve_asset(self, value: str | None) -> Path | None:
        return None if not value else self._resolve(value)

    def _resolve(self, value: str) -> Path:
        path = Path(value)
        if path.is_absolute() or self.source == "<memory>":
            return path
        beside = Path(self.source).parent / path
        return path if (not beside.exists() and path.exists()) else beside


def _key_chunk(check, field: str, value: str) -> str:
    try:
        return check(field, value)
    except KeyExprError as exc:
        raise ValueError(str(exc)) from None


def parse_manifest(data: dict, source: str = "<memory>") -> Manifest:
    if not isinstance(data, dict):
        raise ConfigError("<top level>", "a manifest must be a mapping", source=source)
    try:
        manifest = Manifest.model_validate({**data, "source": source})
    except ValidationError as exc:
        raise config_error(exc, source=source) from None
    try:  # the zenoh block's own checks (its files are checked once resolved, at start-up)
        manifest.zenoh_settings().validate("zenoh", check_files=False)
    except ConfigError as exc:
        raise ConfigError(exc.field, str(exc).split(": ", 1)[1], source=source) from None
    return manifest


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false (any case) are booleans,
    so `compile: off`, `mode: on` or `answer: no` stay the words written. (PyYAML implements YAML
    1.1, where yes/no/on/off are booleans too: they arrive as `config.YamlBoolWord`s, so a field
    that takes only true or false still reads them as such.)"""


_YAML11_WORDS = "tag:lerobot-zenoh,2026:yaml11-bool-word"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_Yaml12Loader.add_implicit_resolver(_YAML11_WORDS, re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$"),
                                    list("yYnNoO"))
_Yaml12Loader.add_constructor(_YAML11_WORDS, lambda loader, node: YamlBoolWord(loader.construct_scalar(node)))


def read_yaml(text: str):
    """A manifest's YAML text as Python data (YAML 1.2 booleans: `_Yaml12Loader`)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


def load_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError("manifest", f"cannot read {path}: {exc.strerror}", source=str(path)) from None
    try:
        data = read_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<yaml>", f"not valid YAML: {exc}", source=str(path)) from None
    return parse_manifest(data, source=str(path))


#: What a running server takes from a re-read manifest (`PolicyServer.reload`, SIGHUP): each entry's
#: client list, the batch size the planner derives from it (an integer on both sides) and its task
#: streams (`pipeline`: placement-preserving admission may give a model a robot of another task).
RELOADABLE = ("clients", "max_batch_size", "pipeline")


def reload_refusal(old: Manifest, new: Manifest) -> str | None:
    """Why a running server cannot take `new` in place of `old` (the first other field that changed,
    named like a start-up error), or None when only what is `RELOADABLE` differs."""
    for name in Manifest.model_fields:
        if name not in ("server", "source") and getattr(old, name) != getattr(new, name):
            return f"{name} changed"
    if len(old.server) != len(new.server):
        return f"server: {len(old.server)} entries became {len(new.server)}"
    for i, (a, b) in enumerate(zip(old.server, new.server)):
        for name in ModelEntry.model_fields:
            if name not in RELOADABLE and getattr(a, name) != getattr(b, name):
                return f"server.{i}.{name} changed"
        if a.max_batch_size != b.max_batch_size and "auto" in (a.max_batch_size, b.max_batch_size):
            return f"server.{i}.max_batch_size: 'auto' is measured at start-up ({a.max_batch_size} -> {b.max_batch_size})"
    return None
