"""The declarative task descriptor and the factory descriptor (docs/pipelines.md).

A task names its components (System 1, System 2, safety, monitor), the model serving each, how often
each is invoked, its latency SLO and what the robot does when the component misses its SLO or reports
danger. A factory names the servers, the task classes with their robot counts, weights and minimum
throughputs, and how each model is served (the manifest fields of a server entry).

Validated like the server manifest: pydantic, unknown keys refused, and every problem raised as one
ConfigError naming the file, the task, the component and the field. Checks that need the measured
serving profiles (an unknown model, an SLO below the model's measured minimum latency) run in
`check_against_profiles`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lerobot_zenoh.errors import ConfigError, KeyExprError
from lerobot_zenoh.model_source import check_model_source
from lerobot_zenoh.protocol.keys import validate_chunk

#: Component kinds. Goal-coupled kinds set the robot's action rate; obligation kinds run at a set rate
#: and only have to meet their SLO (Rosa 3.4.1).
KINDS = ("system1", "system2", "safety", "monitor")
GOAL_KINDS = ("system1", "system2")
OBLIGATION_KINDS = ("safety", "monitor")
PERCENTILES = (50, 90, 95, 99)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fallback(_Strict):
    """One fallback. Written as a name (`hold`) or a mapping (`{action: retry, max_retries: 3, then: hold}`).

    What the robot does: keep its last command, command zero velocity, move to a safe pose, stop the
    episode, re-send the request up to N times, or (System 2 only) keep the last plan.
    """

    action: Literal["hold", "zero_velocity", "safe_pose", "stop_episode", "retry", "use_last"]
    # safe_pose: the joint positions to move to (one per action dimension).
    pose: list[float] | None = None
    # retry: re-send up to this many times, then do `then`.
    max_retries: int | None = Field(None, ge=1, le=100, strict=True)
    then: Literal["hold", "zero_velocity", "safe_pose", "stop_episode"] | None = None

    @model_validator(mode="after")
    def _settings_fit_action(self):
        if self.action == "safe_pose" and not self.pose:
            raise ValueError("safe_pose needs pose: [<one joint position per action dimension>]")
        if self.action != "safe_pose" and self.pose is not None:
            raise ValueError(f"pose does not apply to fallback {self.action!r}")
        if self.action == "retry" and self.max_retries is None:
            raise ValueError("retry needs max_retries (an integer >= 1)")
        if self.action != "retry" and (self.max_retries is not None or self.then is not None):
            raise ValueError(f"max_retries/then do not apply to fallback {self.action!r}")
        return self


def _fallback(v):
    return {"action": v} if isinstance(v, str) else v


class Invocation(_Strict):
    """When a component runs: every chunk (System 1), once per N chunks (System 2), or at a rate."""

    every_n_chunks: int | None = Field(None, ge=1, le=10_000, strict=True)
    rate_hz: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one(self):
        if (self.every_n_chunks is None) == (self.rate_hz is None):
            raise ValueError("give exactly one of every_n_chunks or rate_hz (per_chunk is every_n_chunks: 1)")
        return self


class Slo(_Strict):
    """The latency SLO: this percentile of the component's latency stays within the deadline."""

    percentile: int = Field(99, strict=True)
    deadline_ms: float = Field(gt=0, le=600_000, allow_inf_nan=False)

    @field_validator("percentile")
    @classmethod
    def _known(cls, v: int) -> int:
        if v not in PERCENTILES:
            raise ValueError(f"{v} is not a profiled percentile; choose one of {', '.join(map(str, PERCENTILES))}")
        return v


class Component(_Strict):
    kind: Literal["system1", "system2", "safety", "monitor"]
    model: str
    prompt: str = ""
    invocation: Invocation
    slo: Slo
    # What the robot does when an answer misses the SLO (or never comes).
    on_slo_miss: Fallback
    # safety: an unsafe verdict; monitor: a `failed` verdict. Other kinds have no danger to report.
    on_danger: Fallback | None = None
    # Components whose output this one consumes (System 1 takes System 2's subtask as its task string).
    inputs: list[str] = Field(default_factory=list)

    @field_validator("invocation", mode="before")
    @classmethod
    def _invocation(cls, v):
        if v == "per_chunk":
            return {"every_n_chunks": 1}
        return v

    _fb1 = field_validator("on_slo_miss", mode="before")(lambda cls, v: _fallback(v))
    _fb2 = field_validator("on_danger", mode="before")(lambda cls, v: _fallback(v))

    @model_validator(mode="after")
    def _fits_kind(self):
        if self.kind in GOAL_KINDS and self.invocation.every_n_chunks is None:
            raise ValueError(f"a {self.kind} component runs per chunk or once per N chunks, not at rate_hz")
        if self.kind == "system1" and self.invocation.every_n_chunks != 1:
            raise ValueError("system1 runs once per chunk (invocation: per_chunk)")
        if self.kind in OBLIGATION_KINDS and self.invocation.rate_hz is None:
            raise ValueError(f"a {self.kind} component runs at a rate (invocation: {{rate_hz: ...}})")
        if self.kind in OBLIGATION_KINDS and self.on_danger is None:
            raise ValueError(f"a {self.kind} component needs on_danger (what the robot does on a bad verdict)")
        if self.kind in GOAL_KINDS and self.on_danger is not None:
            raise ValueError(f"on_danger does not apply to a {self.kind} component")
        if self.on_slo_miss.action == "use_last" and self.kind != "system2":
            raise ValueError("use_last (keep the last plan) applies to system2 only")
        if self.on_danger is not None and self.on_danger.action in ("use_last", "retry"):
            raise ValueError(f"on_danger cannot be {self.on_danger.action!r}: the robot must act on the verdict")
        return self


class TaskRetry(_Strict):
    """Retry the task when the monitor reports it failed; after max_retries do `then`."""

    max_retries: int = Field(3, ge=0, le=100, strict=True)
    then: Literal["hold", "zero_velocity", "safe_pose", "stop_episode"] = "stop_episode"


class Task(_Strict):
    name: str
    # t_act: how long the robot executes one chunk before it asks System 1 for the next (synchronous
    # execution, Rosa 3.4.1).
    action_period_ms: float = Field(gt=0, le=60_000, allow_inf_nan=False)
    retry: TaskRetry = Field(default_factory=TaskRetry)
    components: dict[str, Component] = Field(min_length=1)
    # A model that may serve this task's System 1 and System 2 together from one stream (a pi0.5
    # with a `language` block, profiled with `components: [system1, system2]`) instead of the models
    # the two components name: the planner plans both ways and keeps the better (docs/pipelines.md).
    combined_model: str | None = None

    @field_validator("name")
    @classmethod
    def _chunk(cls, v: str) -> str:
        return _key_chunk("name", v)

    @field_validator("components")
    @classmethod
    def _names(cls, v: dict) -> dict:
        for name in v:
            _key_chunk("components", name)
        return v

    @model_validator(mode="after")
    def _graph(self):
        kinds = [c.kind for c in self.components.values()]
        if kinds.count("system1") != 1:
            raise ValueError(f"a task has exactly one system1 component, this one has {kinds.count('system1')}")
        if kinds.count("system2") > 1:
            raise ValueError("a task has at most one system2 component")
        for name, comp in self.components.items():
            for dep in comp.inputs:
                if dep not in self.components:
                    raise ValueError(f"component {name!r}: inputs names {dep!r}, which is not a component of this task")
                if dep == name:
                    raise ValueError(f"component {name!r}: inputs names itself (a cycle)")
        cycle = _find_cycle({n: c.inputs for n, c in self.components.items()})
        if cycle:
            raise ValueError(f"components form a cycle: {' -> '.join(cycle)}")
        if self.combined_model is not None and kinds.count("system2") != 1:
            raise ValueError("combined_model: serves a task's system1 and system2 together; this task has no system2")
        return self

    def component(self, kind: str) -> tuple[str, Component] | None:
        for name, comp in self.components.items():
            if comp.kind == kind:
                return name, comp
        return None

    @property
    def system2_horizon(self) -> int | None:
        """H: System 1 chunks per System 2 call (None without System 2)."""
        s2 = self.component("system2")
        return None if s2 is None else s2[1].invocation.every_n_chunks


def _find_cycle(edges: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


class ServersEntry(_Strict):
    count: int = Field(ge=1, le=100_000, strict=True)
    # The accelerator type of every server; the serving profiles must have been measured on it.
    hardware: str = "gpu"
    # Accelerator memory of one server (GB); a model whose profile states more does not fit. None:
    # not checked.
    memory_gb: float | None = Field(None, gt=0, allow_inf_nan=False)
    # Where the deployment's router listens (tcp/<host>:<port_base>); servers and robots connect to it.
    host: str = "127.0.0.1"
    port_base: int = Field(7500, ge=1, le=65535, strict=True)
    device: str = "cuda"


class FleetClass(_Strict):
    task: str
    robots: int = Field(ge=1, le=1_000_000, strict=True)
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    # F_c^min: the class's total action rate (actions/s = chunks/s) must reach this.
    min_throughput_hz: float = Field(0.0, ge=0, allow_inf_nan=False)
    # The robots' --robot.type and any further client flags they need (ports, cameras), appended
    # as given to every generated client command of this class.
    robot_type: str = "zenoh_sim"
    client_args: list[str] = Field(default_factory=list)

    @field_validator("client_args")
    @classmethod
    def _flags(cls, v: list[str]) -> list[str]:
        for arg in v:
            if not arg.startswith("--") or "=" not in arg:
                raise ValueError(f"{arg!r} is not a --flag=value")
        return v


class PipelineModel(_Strict):
    """How a model is served: the fields of a server manifest entry (docs/server.md), less the ones the
    planner writes (application_tag, endpoint, clients, max_batch_size)."""

    model_id: str
    model_version: str = "v1"
    pretrained_path: str | None = None
    synthetic: dict | None = None
    # A VLM component (the manifest's `vlm` block, docs/server.md): pretrained_path is its folder. Its
    # `output` may be left out: the deployment sets it from the component kind it serves.
    vlm: dict | None = None
    # A pi0.5 serving a task's System 1 and System 2 from one prefill (the manifest's `language` block,
    # docs/policies.md): pretrained_path is its checkpoint. The deployment adds each task's System 2
    # as the `text` of its pipeline item.
    language: dict | None = None
    # The checkpoint's tokenizer folder when it does not hold one (VLAs; the manifest's field).
    tokenizer_path: str | None = None
    fps: int = Field(30, ge=1, le=1000)
    actions_per_chunk: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _source(self):
        check_model_source(self.pretrained_path, self.synthetic, vlm=self.vlm, language=self.language)
        _key_chunk("model_id", self.model_id)
        _key_chunk("model_version", self.model_version)
        return self


class Factory(_Strict):
    cluster_uuid: str = "factory"
    experiment_tag: str = "plan"
    servers: ServersEntry
    models: dict[str, PipelineModel] = Field(min_length=1)
    tasks: dict[str, Task] = Field(min_length=1)
    fleet: list[FleetClass] = Field(min_length=1)
    source: str = Field("<memory>", exclude=True)

    @field_validator("tasks", mode="before")
    @classmethod
    def _task_names(cls, v):
        # The mapping key is the task's name; a task may also be a path to its own YAML file (read by
        # parse_factory before validation).
        if isinstance(v, dict):
            return {k: ({**t, "name": k} if isinstance(t, dict) and "name" not in t else t) for k, t in v.items()}
        return v

    @model_validator(mode="after")
    def _references(self):
        for i, cls_ in enumerate(self.fleet):
            if cls_.task not in self.tasks:
                raise ValueError(f"fleet.{i}.task: {cls_.task!r} is not a task of this factory "
                                 f"(tasks: {', '.join(sorted(self.tasks))})")
        names = [c.task for c in self.fleet]
        if len(names) != len(set(names)):
            raise ValueError("two fleet classes name the same task")
        for tname, task in self.tasks.items():
            if task.name != tname:
                raise ValueError(f"tasks.{tname}: its name is {task.name!r}")
            for cname, comp in task.components.items():
                if comp.model not in self.models:
                    raise ValueError(f"task {tname!r}, component {cname!r}: unknown model {comp.model!r} "
                                     f"(models: {', '.join(sorted(self.models))})")
            if task.combined_model is not None and task.combined_model not in self.models:
                raise ValueError(f"task {tname!r}: combined_model {task.combined_model!r} is not a model of this "
                                 f"factory (models: {', '.join(sorted(self.models))})")
        return self

    def fleet_class(self, task: str) -> FleetClass:
        return next(c for c in self.fleet if c.task == task)


def _key_chunk(field: str, value: str) -> str:
    try:
        return validate_chunk(field, value)
    except KeyExprError as exc:
        raise ValueError(str(exc)) from None


def _raise_one(exc: ValidationError, source: str) -> None:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-")) or "<top level>"
    message = err["msg"].removeprefix("Value error, ")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    raise ConfigError(field, message + more, source=source) from None


def parse_task(data: dict, source: str = "<memory>") -> Task:
    if not isinstance(data, dict):
        raise ConfigError("<top level>", "a task descriptor must be a mapping", source=source)
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        _raise_one(exc, source)


def parse_factory(data: dict, source: str = "<memory>") -> Factory:
    if not isinstance(data, dict):
        raise ConfigError("<top level>", "a factory descriptor must be a mapping", source=source)
    tasks = data.get("tasks")
    if isinstance(tasks, dict):  # `name: path/to/task.yaml` reads that file (relative to this one)
        tasks = {k: (_read_yaml(_beside(source, v), f"tasks.{k}") if isinstance(v, str) else v) for k, v in tasks.items()}
        data = {**data, "tasks": tasks}
    try:
        return Factory.model_validate({**data, "source": source})
    except ValidationError as exc:
        _raise_one(exc, source)


def load_factory(path: str | Path) -> Factory:
    return parse_factory(_read_yaml(Path(path), "factory"), source=str(path))


def _beside(source: str, value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() or source == "<memory>" else Path(source).parent / path


def _read_yaml(path: Path, field: str):
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror}", source=str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<yaml>", f"not valid YAML: {exc}", source=str(path)) from None
