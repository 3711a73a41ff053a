"""Measured serving profiles: latency against batch size and request rate, per model (docs/pipelines.md).

    hardware: H200
    models:
      gr00t:
        batching: discrete          # or continuous (autoregressive VLMs: requests join a running batch)
        memory_gb: 12               # optional; checked against the server's memory
        points:                     # one row per (batch size, offered request rate) measured
          - {batch_size: 1, rate_hz: 2.5, mean_ms: 41.0, p50_ms: 40.5, p90_ms: 43.0, p99_ms: 47.0}
          ...

`batch_size` is the most requests served in one forward pass (the manifest's `max_batch_size`); for a
continuous-batching model it is the concurrency cap.

A model that serves a task's System 1 *and* System 2 from one stream (pi0.5 with language from the
shared prefill, docs/policies.md) says so with ``components: [system1, system2]``; its latencies are
the actions' (measured while text streams) and every point also has `text_mean_ms`, the mean time from
an observation asking for text to its final text. The planner then serves both components of a task
naming it on the same servers, as one stream (docs/pipelines.md). Between two measured rates the latency is
interpolated linearly; below the lowest it is the lowest's; above the highest measured rate the
configuration is taken as saturated (infinite latency): a planner never extrapolates.

`synthetic_profile` builds a GPU-like profile from a documented queueing model, for tests and the
planning benchmark (docs/benchmarks.md); it is a model, not a measurement.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lerobot_zenoh.errors import ConfigError

STATS = ("mean", "p50", "p90", "p95", "p99")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProfilePoint(_Strict):
    batch_size: int = Field(ge=1, le=4096, strict=True)
    rate_hz: float = Field(gt=0, allow_inf_nan=False)
    mean_ms: float = Field(gt=0, allow_inf_nan=False)
    p50_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    p90_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    p95_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    p99_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    # A two-component model only: mean observation-to-final-text time at this load (what the planner
    # uses), and the decode cost behind it (for the reader; lerobot-zenoh-profile measures them from
    # the server's telemetry): time per token (prompt passes included), per batched decode step, and
    # the mean rows a step decoded.
    text_mean_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    decode_ms_per_token: float | None = Field(None, ge=0, allow_inf_nan=False)
    decode_step_ms: float | None = Field(None, ge=0, allow_inf_nan=False)
    decode_batch_mean: float | None = Field(None, ge=0, allow_inf_nan=False)


#: What a two-component model serves from one stream (`ModelProfile.components`).
TWO_COMPONENTS = ("system1", "system2")


class ModelProfile(_Strict):
    batching: Literal["discrete", "continuous"] = "discrete"
    memory_gb: float | None = Field(None, gt=0, allow_inf_nan=False)
    # Empty: one component per stream. [system1, system2]: both from one stream (one prefill).
    components: list[Literal["system1", "system2"]] = Field(default_factory=list)
    points: list[ProfilePoint] = Field(min_length=1)

    @property
    def serves_both(self) -> bool:
        return set(self.components) == set(TWO_COMPONENTS)

    @model_validator(mode="after")
    def _consistent(self):
        if self.components and not self.serves_both:
            raise ValueError(f"components: {self.components} (a two-component model lists system1 and system2)")
        if self.serves_both and any(p.text_mean_ms is None for p in self.points):
            raise ValueError("points: a model serving system1 and system2 needs text_mean_ms in every point")
        seen = set()
        for p in self.points:
            if (p.batch_size, p.rate_hz) in seen:
                raise ValueError(f"two points for batch_size {p.batch_size} at rate_hz {p.rate_hz}")
            seen.add((p.batch_size, p.rate_hz))
        return self

    def batch_sizes(self) -> list[int]:
        return sorted({p.batch_size for p in self.points})

    def _curve(self, batch: int, stat: str) -> tuple[list[float], list[float]]:
        rows = sorted((p for p in self.points if p.batch_size == batch), key=lambda p: p.rate_hz)
        values = [getattr(p, f"{stat}_ms") for p in rows]
        if not rows or any(v is None for v in values):
            return [], []
        return [p.rate_hz for p in rows], values

    def has_stat(self, stat: str) -> bool:
        return all(getattr(p, f"{stat}_ms") is not None for p in self.points)

    def latency_ms(self, batch: int, rate_hz: float, stat: str = "p99") -> float:
        """The `stat` latency of this model served with `batch` under `rate_hz` aggregate load."""
        rates, values = self._curve(batch, stat)
        if not rates or rate_hz > rates[-1] * (1 + 1e-9):
            return math.inf
        if rate_hz <= rates[0]:
            return values[0]
        i = bisect.bisect_left(rates, rate_hz)
        r0, r1, v0, v1 = rates[i - 1], rates[i], values[i - 1], values[i]
        return v0 + (v1 - v0) * (rate_hz - r0) / (r1 - r0)

    def min_latency_ms(self, stat: str) -> float:
        return min(getattr(p, f"{stat}_ms") for p in self.points if getattr(p, f"{stat}_ms") is not None)


class Profiles(_Strict):
    hardware: str = "gpu"
    models: dict[str, ModelProfile] = Field(min_length=1)
    source: str = Field("<memory>", exclude=True)

    def get(self, model: str) -> ModelProfile:
        return self.models[model]


def stat_of(percentile: int) -> str:
    return f"p{percentile}"


def parse_profiles(data: dict, source: str = "<memory>") -> Profiles:
    if not isinstance(data, dict):
        raise ConfigError("<top level>", "a profile file must be a mapping", source=source)
    try:
        return Profiles.model_validate({**data, "source": source})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<top level>"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ConfigError(field, err["msg"].removeprefix("Value error, ") + more, source=source) from None


def load_profiles(path: str | Path) -> Profiles:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError("profiles", f"cannot read {path}: {exc.strerror}", source=str(path)) from None
    except yaml.YAMLError as exc:
        raise ConfigError("<yaml>", f"not valid YAML: {exc}", source=str(path)) from None
    return parse_profiles(data, source=str(path))


def dump_profiles(profiles: Profiles) -> str:
    return yaml.safe_dump(profiles.model_dump(exclude_none=True), sort_keys=False)


# -- a synthetic GPU-like profile (a model, documented in docs/pipelines.md) --------------------------

@dataclass(frozen=True)
class ServiceModel:
    """One forward pass of `b` requests takes ``base_ms + per_item_ms * (b - 1)``.

    The server batches what is queued, up to `batch` (it does not wait to fill a batch). At aggregate
    rate λ the batch it runs settles at ``b_eff = clamp(λ s(b_eff), 1, batch)``; utilisation is
    ``ρ = λ s(batch) / batch``. Latency = service of the running batch + the residual of the batch in
    progress + an M/D/1-like queueing term ``s(batch) ρ² / (2 (1 - ρ))``; the p99 multiplies the
    queueing term by ln(100) (an exponential tail) and counts a full residual.
    """

    base_ms: float
    per_item_ms: float

    def service_ms(self, b: float) -> float:
        return self.base_ms + self.per_item_ms * (b - 1)

    def max_rate_hz(self, batch: int) -> float:
        return batch / self.service_ms(batch) * 1000.0

    def stats_ms(self, batch: int, rate_hz: float) -> dict[str, float]:
        lam = rate_hz / 1000.0  # per ms
        b = 1.0
        for _ in range(50):
            b = min(float(batch), max(1.0, lam * self.service_ms(b)))
        s = self.service_ms(b)
        rho = lam * self.service_ms(batch) / batch
        if rho >= 1:
            return {k: math.inf for k in STATS}
        busy = min(1.0, lam * s)
        queue = self.service_ms(batch) * rho * rho / (2 * (1 - rho))
        mean = s + 0.5 * busy * s + queue
        p99 = s + busy * s + math.log(100) * queue
        return {"mean": mean, "p50": s + 0.5 * busy * s + math.log(2) * queue,
                "p90": s + 0.9 * busy * s + math.log(10) * queue,
                "p95": s + 0.95 * busy * s + math.log(20) * queue, "p99": p99}


def synthetic_profile(service: ServiceModel, batch_sizes: list[int], batching: str = "discrete",
                      memory_gb: float | None = None, fractions: tuple[float, ...] = (
                          0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97)) -> ModelProfile:
    """Rosa's profiling grid: for each batch size, rates at 10%..~100% of its maximum throughput."""
    points = []
    for b in batch_sizes:
        for frac in fractions:
            rate = service.max_rate_hz(b) * frac
            st = service.stats_ms(b, rate)
            points.append(ProfilePoint(batch_size=b, rate_hz=round(rate, 6),
                                       **{f"{k}_ms": round(v, 6) for k, v in st.items()}))
    return ModelProfile(batching=batching, memory_gb=memory_gb, points=points)


#: GPU-like service models for Rosa's components on one H200-class GPU (as the Rosa paper reports: GR00T at
#: batch 16 is ~3.5x the throughput of batch 1; Qwen-VL-7B for System 2 and the monitor, 3B for safety).
#: Chosen to be plausible, not measured: see docs/pipelines.md.
ROSA_SERVICE = {
    "gr00t-n1.6-3b": (ServiceModel(base_ms=40.0, per_item_ms=7.0), [1, 2, 4, 8, 16], "discrete"),
    "qwen2.5-vl-7b": (ServiceModel(base_ms=600.0, per_item_ms=6.0), [32], "continuous"),
    "qwen2.5-vl-3b": (ServiceModel(base_ms=150.0, per_item_ms=2.0), [32], "continuous"),
}


def rosa_profiles() -> Profiles:
    return Profiles(hardware="synthetic-H200", models={
        name: synthetic_profile(svc, sizes, batching) for name, (svc, sizes, batching) in ROSA_SERVICE.items()})


def check_against_profiles(factory, profiles: Profiles) -> None:
    """Refuse a factory whose tasks name a model without a profile, an SLO percentile the profile does
    not hold, or a deadline below the model's measured minimum latency (naming task and component);
    profiles measured on another hardware than the factory's servers; a model that does not fit in a
    server's memory (each server hosts one model)."""
    if profiles.hardware != factory.servers.hardware:
        raise ConfigError("servers.hardware", f"the factory's servers are {factory.servers.hardware!r} but the "
                          f"profiles ({profiles.source}) were measured on {profiles.hardware!r}: profile the "
                          "models on the servers' hardware", source=factory.source)
    for tname, task in factory.tasks.items():
        if task.combined_model is not None:
            prof = profiles.models.get(task.combined_model)
            if prof is None or not prof.serves_both:
                raise ConfigError(f"tasks.{tname}.combined_model", f"task {tname!r}: {task.combined_model!r} has "
                                  + ("no serving profile" if prof is None else "a profile of one component") +
                                  " (a combined model is profiled with components: [system1, system2], "
                                  "lerobot-zenoh-profile --task)", source=factory.source)
            if factory.models[task.combined_model].language is None:
                raise ConfigError(f"models.{task.combined_model}.language", f"task {tname!r}: combined_model "
                                  f"{task.combined_model!r} is served without a language block (a pi05 checkpoint "
                                  "with `language:`, docs/policies.md)", source=factory.source)
        for cname, comp in task.components.items():
            where = f"tasks.{tname}.components.{cname}"
            if comp.model not in profiles.models:
                raise ConfigError(f"{where}.model", f"task {tname!r}, component {cname!r}: no serving profile for "
                                  f"model {comp.model!r} (profiled: {', '.join(sorted(profiles.models))})",
                                  source=factory.source)
            prof = profiles.models[comp.model]
            capacity = factory.servers.memory_gb
            if capacity is not None and prof.memory_gb is not None and prof.memory_gb > capacity:
                raise ConfigError(f"{where}.model", f"task {tname!r}, component {cname!r}: model {comp.model!r} "
                                  f"needs {prof.memory_gb:g} GB, a server has {capacity:g} GB (servers.memory_gb)",
                                  source=factory.source)
            stat = stat_of(comp.slo.percentile)
            if prof.serves_both and comp.kind in ("system1", "system2"):
                _check_two_components(factory, tname, task, cname, comp, where)
            if comp.kind == "system2" and prof.serves_both:  # its text's latency, not the actions'
                floor = prof.min_latency_ms("text_mean")
                if comp.slo.deadline_ms < floor:
                    raise ConfigError(f"{where}.slo.deadline_ms", f"task {tname!r}, component {cname!r}: impossible "
                                      f"SLO: {comp.slo.deadline_ms:g} ms is below {comp.model!r}'s measured minimum "
                                      f"mean text latency {floor:.1f} ms", source=factory.source)
                continue
            if not prof.has_stat(stat):
                raise ConfigError(f"{where}.slo.percentile", f"task {tname!r}, component {cname!r}: the profile "
                                  f"of {comp.model!r} has no {stat}_ms", source=factory.source)
            floor = prof.min_latency_ms(stat)
            if comp.slo.deadline_ms < floor:
                raise ConfigError(f"{where}.slo.deadline_ms", f"task {tname!r}, component {cname!r}: impossible SLO: "
                                  f"{stat} {comp.slo.deadline_ms:g} ms is below {comp.model!r}'s measured minimum "
                                  f"{stat} latency {floor:.1f} ms", source=factory.source)


def _check_two_components(factory, tname: str, task, cname: str, comp, where: str) -> None:
    """A two-component model serves a task's System 2 from its System 1's stream: both must name it,
    and the factory must serve it with its `language` block (a pi0.5 answering text)."""
    s1, s2 = task.component("system1"), task.component("system2")
    if comp.kind == "system2" and s1[1].model != comp.model:
        raise ConfigError(f"{where}.model", f"task {tname!r}, component {cname!r}: {comp.model!r} serves system2 "
                          f"from the prefill of its own system1 stream, but system1 ({s1[0]}) names "
                          f"{s1[1].model!r}: name {comp.model!r} for both (or profile it as a text model)",
                          source=factory.source)
    if s2 is not None and s2[1].model == s1[1].model and factory.models[comp.model].language is None:
        raise ConfigError(f"models.{comp.model}.language", f"{comp.model!r} serves system1 and system2 of task "
                          f"{tname!r} from one stream (its profile), but the factory serves it without a language "
                          "block (a pi05 checkpoint with `language:`, docs/policies.md)", source=factory.source)
