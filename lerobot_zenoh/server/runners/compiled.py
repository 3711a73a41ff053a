"""Compiled inference: a family's chunk function through ``torch.compile``, one graph per batch bucket.

    CompileSettings   the manifest entry's ``compile`` block (or its one-word form ``compile: default``)
    check_compile     refuses a combination the device cannot run, in one line naming the field
    batch_buckets     the batch sizes compiled: powers of two up to the model's largest batch
    CompiledChunk     pads a batch to its bucket, calls the bucket's graph, slices the rows back

What is compiled is the whole ``predict_action_chunk`` of a policy (the granularity that compiles
without graph breaks for pi0, pi0.5 and, with its vision embeddings' position ids made static by
`flow_matching.static_position_ids`, SmolVLA): compiling only a denoise step leaves the prefix pass and the Python
loop eager and gained less. Shapes are static (``dynamic=False``): every call is padded to the
smallest bucket that holds it (a batch larger than the largest bucket runs eager: list only the
buckets where the graphs pay),
and the tokenized task is padded to the tokenizer's fixed length, so that serving reuses the graphs
compiled at start-up and never compiles again. Padding rows repeat the batch's last row: real inputs,
whose outputs are dropped; a row's output does not depend on the others (the purity invariant).

Start-up (`CompiledChunk.warm`, called from the runner's warm-up, before anything is announced) does
the expensive work serving would otherwise do, bucket by bucket: it compiles the bucket through the
runner's own `run` on dummy observations (with RTC on, half of them carry a leftover), records its
CUDA graph with ``cuda_graphs`` (torch records on a graph's second call), and compares a *replay* with
the eager chunk within a tolerance relative to the action scale (`EQUALITY_TOLERANCE`: bfloat16
cannot meet float32's). It logs one line per bucket (seconds, the difference, graph breaks). A
recompile at a bucket's second call, and with CUDA graphs any graph skip or partition (parts of the
chunk that would silently run without CUDA graphs), are counted and refused like a failed compile.
Then it switches to serving: a call that would need a new graph runs eager instead
(``torch.compiler.set_stance("fail_on_recompile")`` detects it) and is counted (`figures`:
``compile.eager_calls``). If any bucket fails, none is used: the model is served eager (``fallback:
eager``) or the server refuses to start (``fallback: refuse``, the default), in one line naming the
model's ``compile`` field. CUDA graphs are recorded and replayed on one thread of the model's own
(torch keeps its graph trees per thread), whichever thread serves the batch.

Inductor keeps what it compiled in its cache folder (``TORCHINDUCTOR_CACHE_DIR``: the manifest's
``compile_cache_dir``, else a private folder; runners/compile_cache.py checks who may write there), so a
restart with the same folder loads the graphs instead of compiling them.

Real-time-chunking guidance runs inside the graphs, for a whole batch of mixed leftovers and delays:
in closed form, its inputs built on the device once per batch (runners/rtc.py, "The closed form"); a
batch without any leftover takes the same graph with all weights zero. Calls that capture refinement
updates (a Python hook per step) stay eager, on the same weights.

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


#: The start-up equality check: the largest |replay - eager| allowed, relative to the action scale
#: (the largest |action| of the eager chunk, robot units). float32: inductor reorders float sums
#: (measured on tiny VLAs: about 1e-6 of the scale). bfloat16: inductor computes fused pointwise ops in
#: float32 where eager rounds each to bfloat16, so a chunk differs by 1e-3 to 1e-1 action units; the bound
#: still catches a replay reading the wrong memory or the wrong rows (an error of the scale itself).
EQUALITY_TOLERANCE = {"float32": 1e-3, "bfloat16": 1e-1}

#: Inductor's counters watched at start-up (torch._dynamo.utils.counters): CUDA-graph skips (a graph
#: that runs without CUDA graphs; logged only to the off-by-default ``cudagraphs`` logger) and graph
#: partitions (ops that must run outside a CUDA graph split one graph into several).
_CUDAGRAPH_COUNTERS = ("cudagraph_skips", "cudagraph_partitions")


class CompiledChunk:
    """A chunk function ``fn(batch, **kwargs) -> Tensor`` compiled once per batch bucket.

    ``batch`` is a dict of tensors whose dim 0 is the batch (other entries are dropped: LeRobot's
    placeholders and the task strings, which the tokenized tensors already carry), and every tensor in
    `kwargs` has the batch on dim 0 too. Call it as `fn`; rows beyond the caller's are padding.

    With CUDA graphs (``cuda_graphs``) every call of the graphs runs on one thread of the model's own
    (`_GraphThread`): torch keeps its CUDA-graph trees in thread-local state, so graphs recorded on
    one thread are recorded again on the first call from another. The start-up warm-up, the batch
    profiling and every served batch, whichever thread asks, replay on that one thread. Each call
    marks a new step (``cudagraph_mark_step_begin``) and returns a copy: a replay's outputs live in
    the graph's memory, which the next replay overwrites.
    """

    def __init__(self, fn: Callable[..., Any], settings: CompileSettings, buckets: Sequence[int], *,
                 device_type: str, name: str, field: str, dtype: str = "float32"):
        import torch

        self.settings = settings
        self.buckets = tuple(buckets)
        self.name = name
        self.field = field
        self.dtype = dtype
        self._eager = fn
        # One graph per bucket; dynamo counts them against one code object's cache, so make room.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets) + 4)
        # A remote cache's entries are unpickled like the local folder's (runners/compile_cache.py): off.
        for flag in ("fx_graph_remote_cache", "autotune_remote_cache", "bundled_autotune_remote_cache"):
            setattr(torch._inductor.config, flag, False)
        self.cuda_graphs = settings.mode == "cuda_graphs"
        self._compiled = torch.compile(fn, mode=_TORCH_MODE[settings.mode, device_type], dynamic=False)
        self._thread = _GraphThread(f"cuda-graphs:{name}") if self.cuda_graphs else None
        self.active = False  # set by `warm` once every bucket has compiled
        self.serving = False  # after `warm`: a call that would compile runs eager instead
        self._checking = False  # during `warm`, after a bucket's first call: a recompile is an error
        self.eager_calls = 0  # calls the graphs did not cover (a recompile was needed), since start-up
        self.compile_s: dict[int, float] = {}
        self.startup: dict[str, int] = {"graph_breaks": 0, "recompiles": 0, "cudagraph_skips": 0,
                                        "cudagraph_partitions": 0}

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
            if self._checking:  # a warm-up call after the bucket's first: it may not compile again
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self._graph(padded, padded_kwargs)[:rows]
            return self._graph(padded, padded_kwargs)[:rows]
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._graph(padded, padded_kwargs)[:rows]
        except RuntimeError as exc:
            if _RECOMPILE not in str(exc):
                raise
            # A guard failed (a shape or a state not seen at start-up): eager instead, counted.
            self.eager_calls += 1
            if self.eager_calls == 1 or self.eager_calls % 1000 == 0:
                log.warning("%s: a batch of %d needed a graph not compiled at start-up; served eager (%d so far): %s",
                            self.name, rows, self.eager_calls, _one_line(exc))
            return self._eager(tensors, **kwargs)

    def _graph(self, padded: dict[str, Any], kwargs: dict[str, Any]) -> Any:
        """The compiled function on the padded batch: here, or on the CUDA-graph thread."""
        if self._thread is None:
            return self._compiled(padded, **kwargs)
        return self._thread.call(_replay, self._compiled, padded, kwargs)

    @contextmanager
    def eager(self):
        """Within the block the runner's calls skip the graphs (the warm-up's reference)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def warm(self, run_bucket: Callable[[int], Any]) -> None:
        """Do at start-up everything serving would otherwise do, bucket by bucket: compile it, record
        its CUDA graph (torch 2.11 records on a graph's *second* call: the first is a warm-up run), and
        compare a *replay* (a call that neither compiles nor records) with the eager chunk, within
        `EQUALITY_TOLERANCE` of the action scale. ``run_bucket(size)`` runs the runner's own path on
        `size` dummy observations and returns its actions, eager or compiled as `active` says.

        Refused (`PolicyError` naming the field; then no bucket is used, and ``fallback`` decides:
        refuse to start or serve eager): a bucket that fails to compile; a later call of a bucket that
        needed a recompile (serving would run it eager); with CUDA graphs, any graph skipped or split
        into partitions (parts that would silently run without CUDA graphs); a replay that is not
        finite or differs from eager beyond the tolerance. Graph breaks are counted and logged (SmolVLA
        keeps a few inside transformers' vision embeddings), not refused."""
        import numpy as np
        from torch._dynamo.utils import counters

        self.active, self.serving = True, False
        total = len(self.buckets)
        calls = 3 if self.cuda_graphs else 2  # compile (+ graph warm-up run), [record,] replay
        size = self.buckets[0]
        try:
            for i, size in enumerate(self.buckets, 1):
                with self.eager():
                    reference = np.asarray(run_bucket(size))
                log.info("%s: compiling batch bucket %d (%d/%d, %s) ...", self.name, size, i, total, self.settings.mode)
                before = _watched(counters)
                t0 = time.perf_counter()
                run_bucket(size)
                self.compile_s[size] = time.perf_counter() - t0
                self._checking = True
                try:
                    for _ in range(calls - 1):
                        out = np.asarray(run_bucket(size))
                except RuntimeError as exc:
                    if _RECOMPILE not in str(exc):
                        raise
                    self.startup["recompiles"] += 1
                    raise PolicyError(f"batch bucket {size} needed a recompile on its second call (serving would "
                                      f"run it eager): {_one_line(exc)}") from None
                finally:
                    self._checking = False
                grown = {k: v - before[k] for k, v in _watched(counters).items()}
                for k in self.startup:
                    self.startup[k] += grown.get(k, 0)
                if self.cuda_graphs and (grown["cudagraph_skips"] or grown["cudagraph_partitions"]):
                    raise PolicyError(
                        f"batch bucket {size}: {grown['cudagraph_skips']} CUDA graph skip(s), "
                        f"{grown['cudagraph_partitions']} graph partition(s): parts of the chunk would run "
                        "without CUDA graphs (TORCH_LOGS=cudagraphs says why)")
                scale = float(np.max(np.abs(reference))) if reference.size else 0.0
                diff = float(np.max(np.abs(out - reference)))
                bound = EQUALITY_TOLERANCE.get(self.dtype, EQUALITY_TOLERANCE["bfloat16"]) * max(scale, 1e-6)
                if not np.isfinite(diff):
                    raise PolicyError(f"the compiled chunk at batch {size} is not finite")
                if diff > bound:
                    raise PolicyError(f"batch bucket {size}: a replay differs from the eager chunk by {diff:.3g} "
                                      f"(allowed {bound:.3g}: {EQUALITY_TOLERANCE.get(self.dtype, 0.1):g} of the "
                                      f"action scale {scale:.3g}, {self.dtype})")
                log.info("%s: batch bucket %d compiled in %.1f s%s; a replay against eager: max |diff| %.1e "
                         "(action scale %.3g, allowed %.1e); graph breaks %d", self.name, size, self.compile_s[size],
                         " and its CUDA graph recorded" if self.cuda_graphs else "", diff, scale, bound,
                         grown["graph_breaks"])
        except Exception as exc:
            self.active = False
            raise PolicyError(f"{self.field}: compiling {self.name} ({self.settings.mode}) failed at batch "
                              f"bucket {size}: {_one_line(exc)}") from exc
        self.serving = True

    def figures(self) -> dict[str, float]:
        """``compile.buckets`` (graphs in use), ``compile.eager_calls`` (served batches the graphs did
        not cover), and what start-up saw: ``compile.graph_breaks``, ``compile.startup_recompiles``,
        ``compile.cudagraph_skips``, ``compile.cudagraph_partitions``."""
        return {"compile.buckets": float(len(self.buckets) if self.active else 0),
                "compile.eager_calls": float(self.eager_calls),
                "compile.graph_breaks": float(self.startup["graph_breaks"]),
                "compile.startup_recompiles": float(self.startup["recompiles"]),
                "compile.cudagraph_skips": float(self.startup["cudagraph_skips"]),
                "compile.cudagraph_partitions": float(self.startup["cudagraph_partitions"])}

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()


def enable_tf32(device: Any, bf16: bool, name: str) -> bool:
    """On CUDA with a bfloat16 model: TF32 for the float32 matmuls and convolutions LeRobot keeps
    (pi0/pi0.5's SigLIP, projector and norms), as LeRobot's own ``compile_model`` does, logged. The
    setting is the process's: a float32 model beside it on the GPU gets TF32 too. True when enabled."""
    if getattr(device, "type", str(device)) != "cuda" or not bf16:
        return False
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log.info("%s: bfloat16 on CUDA: TF32 enabled for the float32 parts (matmul and cuDNN; process-wide)", name)
    return True


def _watched(counters: Any) -> dict[str, int]:
    """The counters `warm` watches, now (``graph_break`` is keyed by reason)."""
    inductor = counters["inductor"]
    return {"graph_breaks": int(sum(counters["graph_break"].values())),
            **{k: int(inductor[k]) for k in _CUDAGRAPH_COUNTERS}}


def _replay(compiled: Callable[..., Any], padded: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """One call of CUDA-graph code (on the graph thread): a new step, and the output copied out of
    the graph's memory before the next replay overwrites it."""
    import torch

    torch.compiler.cudagraph_mark_step_begin()
    return compiled(padded, **kwargs).clone()


class _GraphThread:
    """One thread that runs every call of a model's CUDA-graph code (`CompiledChunk`'s docstring).
    The caller waits for its call (the runner serializes its calls already: no queueing here)."""

    def __init__(self, name: str):
        import queue
        import threading

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        import queue

        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, args, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        import torch

        # Autograd off as on the caller's side (the runner's no_grad is thread-local).
        with torch.no_grad():
            while (job := self._jobs.get()) is not None:
                fn, args, done = job
                try:
                    done.put((True, fn(*args)))
                except BaseException as exc:  # handed to the caller, raised there
                    done.put((False, exc))


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
