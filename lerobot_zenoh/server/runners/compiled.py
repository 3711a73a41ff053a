"""Compiled inference: a family's chunk function through ``torch.compile``, one graph per batch bucket.

    CompileSettings   the manifest entry's ``compile`` block (or its one-word form ``compile: default``)
    check_compile     refuses a combination the device cannot run, in one line naming the field
    batch_buckets     the batch sizes compiled: powers of two up to the model's largest batch
    CompiledChunk     pads a batch to its bucket, calls the bucket's graph, slices the rows back

What is compiled is the whole ``predict_action_chunk`` of a policy (the granularity that compiles
without graph breaks for pi0 and pi0.5; SmolVLA keeps a few breaks inside transformers' vision
embeddings and still gains): compiling only a denoise step leaves the prefix pass and the Python
loop eager and gained less. Shapes are static (``dynamic=False``): every call is padded to the
smallest bucket that holds it (a batch larger than the largest bucket runs eager: list only the
buckets where the graphs pay),
and the tokenized task is padded to the tokenizer's fixed length, so that serving reuses the graphs
compiled at start-up and never compiles again. Padding rows repeat the batch's last row: real inputs,
whose outputs are dropped; a row's output does not depend on the others (the purity invariant).

Start-up (`CompiledChunk.warm`, called from the runner's warm-up, before anything is announced)
compiles every bucket in turn through the runner's own `run` on dummy observations, logs one line per
bucket (seconds, and the largest difference from the eager chunk), and then switches to serving:
a call that would need a new graph runs eager instead (``torch.compiler.set_stance("fail_on_recompile")``
detects it) and is counted (`figures`: ``compile.eager_calls``). If any bucket fails to compile,
none is used: the model is served eager (``fallback: eager``) or the server refuses to start
(``fallback: refuse``, the default), in one line naming the model's ``compile`` field.

Inductor keeps what it compiled in its cache folder (``TORCHINDUCTOR_CACHE_DIR``; the manifest's
``compile_cache_dir``), so a restart with the same folder loads the graphs instead of compiling them.

Calls that the graphs do not cover stay eager, on the same weights: real-time-chunking guidance (per-row
delays and autograd in the loop) and calls that capture refinement updates (a Python hook per step).

The settings are torch-free (the manifest imports them); torch is imported on use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from pydantic import field_validator

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import ConfigError, PolicyError

log = logging.getLogger(__name__)

#: The ``torch.compile`` mode of each manifest mode on a CPU and on a CUDA device (a pair not here is refused).
_TORCH_MODE = {
    ("default", "cpu"): "default",
    ("max-autotune", "cpu"): "max-autotune-no-cudagraphs",
    ("default", "cuda"): "default",
    ("max-autotune", "cuda"): "max-autotune-no-cudagraphs",
    ("cuda_graphs", "cuda"): "reduce-overhead",  # inductor + CUDA graph trees: one replay per bucket
}


#: What ``torch.compiler.set_stance("fail_on_recompile")`` raises (a RuntimeError) says.
_RECOMPILE = "Detected recompile"


class CompileSettings(Settings):
    """Compiled inference of one model (the manifest entry's ``compile`` block; docs/policies.md,
    "Compiled inference"). ``compile: default`` is short for ``compile: {mode: default}``.

    `mode`: ``off`` (eager, the default), ``default`` or ``max-autotune`` (inductor; CPU or CUDA),
    ``cuda_graphs`` (inductor with CUDA graphs; a CUDA device only). `buckets`: the batch sizes
    compiled (default: 1, 2, 4, ... up to the model's largest batch); each takes one compilation at
    start-up. `fallback`: what a compile failure at start-up does: ``refuse`` (the server does not
    start) or ``eager`` (the model is served uncompiled, with a warning).
    """

    config_prefix = "compile"

    mode: Literal["off", "default", "max-autotune", "cuda_graphs"] = "off"
    buckets: tuple[int, ...] | None = None
    fallback: Literal["refuse", "eager"] = "refuse"

    @field_validator("buckets")
    @classmethod
    def _buckets(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return v
        if not v or any(isinstance(b, bool) or b < 1 or b > 256 for b in v):
            raise ValueError(f"must be batch sizes in 1..256, got {list(v)}")
        if list(v) != sorted(set(v)):
            raise ValueError(f"must be increasing without repeats, got {list(v)}")
        return v

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def parse_compile(value: Any) -> Any:
    """The manifest's one-word form (``compile: default``) as the block it stands for."""
    return {"mode": value} if isinstance(value, str) else value


def check_compile(settings: CompileSettings, device: str, field: str) -> None:
    """`ConfigError` naming `field` for a mode the device cannot run (``cuda_graphs`` off CUDA, any
    compilation on MPS). Torch-free: called before a model loads."""
    if not settings.enabled:
        return
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(field, f"{settings.mode} compiles for cpu or cuda devices, not {device!r}; use off")
    if (settings.mode, kind) not in _TORCH_MODE:
        raise ConfigError(field, f"{settings.mode} needs a CUDA device (device is {device!r}); "
                                 "on a CPU use default or max-autotune")


def batch_buckets(settings: CompileSettings, largest: int) -> tuple[int, ...]:
    """The batch sizes to compile: the settings' own, else 1, 2, 4, ... and `largest` itself."""
    if settings.buckets is not None:
        return settings.buckets
    out, b = [], 1
    while b < largest:
        out.append(b)
        b *= 2
    return (*out, largest)


class CompiledChunk:
    """A chunk function ``fn(batch, **kwargs) -> Tensor`` compiled once per batch bucket.

    ``batch`` is a dict of tensors whose dim 0 is the batch (other entries are dropped: LeRobot's
    placeholders and the task strings, which the tokenized tensors already carry), and every tensor in
    `kwargs` has the batch on dim 0 too. Call it as `fn`; rows beyond the caller's are padding.
    """

    def __init__(self, fn: Callable[..., Any], settings: CompileSettings, buckets: Sequence[int], *,
                 device_type: str, name: str, field: str):
        import torch

        self.settings = settings
        self.buckets = tuple(buckets)
        self.name = name
        self.field = field
        self._eager = fn
        # One graph per bucket; dynamo counts them against one code object's cache, so make room.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets) + 4)
        self._compiled = torch.compile(fn, mode=_TORCH_MODE[settings.mode, device_type], dynamic=False)
        self.active = False  # set by `warm` once every bucket has compiled
        self.serving = False  # after `warm`: a call that would compile runs eager instead
        self.eager_calls = 0  # calls the graphs did not cover (a recompile was needed), since start-up
        self.compile_s: dict[int, float] = {}

    def bucket(self, rows: int) -> int:
        """The smallest bucket holding `rows` (`rows` is at most the largest bucket)."""
        return next(b for b in self.buckets if b >= rows)

    def __call__(self, batch: dict[str, Any], **kwargs: Any) -> Any:
        import torch

        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        rows = next(iter(tensors.values())).shape[0]
        if rows > self.buckets[-1]:  # larger than every bucket: eager, as the buckets listed ask
            return self._eager(tensors, **kwargs)
        size = self.bucket(rows)
        padded, padded_kwargs = _pad(tensors, size), _pad(kwargs, size)
        if not self.serving:
            return self._compiled(padded, **padded_kwargs)[:rows]
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._compiled(padded, **padded_kwargs)[:rows]
        except RuntimeError as exc:
            if _RECOMPILE not in str(exc):
                raise
            # A guard failed (a shape or a state not seen at start-up): eager instead, counted.
            self.eager_calls += 1
            if self.eager_calls == 1 or self.eager_calls % 1000 == 0:
                log.warning("%s: a batch of %d needed a graph not compiled at start-up; served eager (%d so far): %s",
                            self.name, rows, self.eager_calls, _one_line(exc))
            return self._eager(tensors, **kwargs)

    @contextmanager
    def eager(self):
        """Within the block the runner's calls skip the graphs (the warm-up's reference)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def warm(self, run_bucket: Callable[[int], Any]) -> None:
        """Compile every bucket: ``run_bucket(size)`` runs the runner's own path on `size` dummy
        observations and returns its actions, eager or compiled as `active` says. Raises `PolicyError`
        naming the field when a bucket fails (then no bucket is used)."""
        import numpy as np

        self.active, self.serving = True, False
        total = len(self.buckets)
        try:
            for i, size in enumerate(self.buckets, 1):
                with self.eager():
                    reference = run_bucket(size)
                log.info("%s: compiling batch bucket %d (%d/%d, %s) ...", self.name, size, i, total, self.settings.mode)
                t0 = time.perf_counter()
                out = run_bucket(size)
                self.compile_s[size] = time.perf_counter() - t0
                diff = float(np.max(np.abs(np.asarray(out) - np.asarray(reference))))
                if not np.isfinite(diff):
                    raise PolicyError(f"the compiled chunk at batch {size} is not finite")
                log.info("%s: batch bucket %d compiled in %.1f s (max |compiled - eager| %.1e)",
                         self.name, size, self.compile_s[size], diff)
        except Exception as exc:
            self.active = False
            raise PolicyError(f"{self.field}: compiling {self.name} ({self.settings.mode}) failed at batch "
                              f"bucket {size}: {_one_line(exc)}") from exc
        self.serving = True

    def figures(self) -> dict[str, float]:
        return {"compile.buckets": float(len(self.buckets) if self.active else 0),
                "compile.eager_calls": float(self.eager_calls)}


def _pad(tensors: dict[str, Any], size: int) -> dict[str, Any]:
    """Each tensor with `size` rows on dim 0: its own, then copies of its last row."""
    import torch

    out = {}
    for k, v in tensors.items():
        if isinstance(v, torch.Tensor) and v.shape[0] < size:
            v = torch.cat([v, v[-1:].expand(size - v.shape[0], *v.shape[1:])])
        out[k] = v
    return out


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
