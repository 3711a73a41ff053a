"""Compiled inference against eager, side by side: chunk latency by batch for tiny pi0, pi0.5,
SmolVLA and ACT checkpoints (random weights), through the server's own runner.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.compiled [--types pi0,pi05] [--batches 1,8]
        [--reps 7] [--mode default] [--rtc] [--freezing] [--threads N] [--restart] [--out DIR]

For each type, in a process of its own (inductor compiles one target per process best): builds the
checkpoint offline (lerobot-zenoh-build-checkpoint's defaults: 2 cameras 96x128, 6-D state, chunk 50),
loads it twice through the server's loader (`load_runner`, the manifest's ``compile`` field: off, and
`--mode` with one batch bucket per `--batches`), warms the compiled one (compiling every bucket, as
start-up does), then for each batch size times `runner.run` on B requests from distinct sessions with
different tasks: one untimed call each, then `--reps` calls alternating eager and compiled in the
same process, so that a busy machine slows both alike. It prints per (type, batch) the median ms of
each, the ratio, and the largest difference between the two chunks (robot units), then the compile
time per bucket. For the flow-matching types it also times one request with a real-time-chunking
prefix (eager: guidance is not compiled) with the served, frozen parameters against the same model
left trainable as LeRobot loads it, alternately, and says whether the chunks are equal.

`--rtc`: real-time chunking on in both runners (the flow-matching types), and every request carries
a leftover but one in four (different lengths and delays: a mixed batch; batch 1 has one): compiled RTC
(the closed-form guidance inside the graph) against eager RTC (LeRobot's autograd guidance), side by
side, with the largest difference between the two chunks.

`--freezing`: inductor's weight freezing in the measuring process (a study of the CPU path; the server
does not set it).

`--restart`: runs each type a second time with the same inductor cache folder (`--cache-dir`, a new
temporary one by default, so that the first run is cold), and prints the start-up compile time of
both runs: what a server restart with ``compile_cache_dir`` kept pays.

A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASKS = ("pick up the red cube", "open the drawer", "fold the towel on the table", "push the block left")
CAMERAS = {"front": (96, 128), "wrist": (96, 128)}
NAMES = [f"joint_{i}" for i in range(6)]


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="pi0,pi05")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--mode", default="default", choices=("default", "max-autotune"))
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--cache-dir", default=None, help="inductor cache folder (default: a new temporary one)")
    parser.add_argument("--restart", action="store_true", help="run each type again on the same cache")
    parser.add_argument("--rtc", action="store_true", help="RTC on, requests with mixed leftovers")
    parser.add_argument("--freezing", action="store_true",
                        help="torch._inductor.config.freezing: weights folded as constants (a study; not a server setting)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: a shared machine's other load cannot stall a parallel region)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one type
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        if args.freezing:
            torch._inductor.config.freezing = True
        measure(args.one, Path(args.out), [int(b) for b in args.batches.split(",")], args.reps, args.mode,
                Path(args.cache_dir), rtc=args.rtc)
        return

    root = Path(args.out or tempfile.mkdtemp(prefix="compiled_"))
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="inductor_"))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} mode {args.mode}, {args.reps} alternating calls per row, "
          f"{args.threads} torch thread(s), {'RTC on (mixed leftovers), ' if args.rtc else ''}"
          f"{'inductor freezing, ' if args.freezing else ''}inductor cache {cache}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'type':12} {'batch':>5} {'eager ms':>9} {'compiled ms':>11} {'speed-up':>8} {'max |diff|':>10}", flush=True)
    starts: dict[str, list[float]] = {}
    for policy_type in args.types.split(","):
        for run in range(2 if args.restart else 1):
            rows = child(policy_type, root, args, cache, timed=run == 0)
            starts.setdefault(policy_type, []).append(rows["compile_s"])
    print(f"# load average at the end: {os.getloadavg()[0]:.1f}", flush=True)
    for policy_type, runs in starts.items():
        if len(runs) > 1:
            print(f"{policy_type}: restart with the cache kept: {runs[1]:.1f} s against {runs[0]:.1f} s "
                  f"({runs[0] / runs[1]:.1f}x faster)", flush=True)


def child(policy_type: str, root: Path, args: argparse.Namespace, cache: Path, *, timed: bool) -> dict:
    """Run one type in its own process; print its rows; return its summary."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    reps = args.reps if timed else 1
    cmd = [sys.executable, "-m", "benchmarks.studies.compiled", "--one", policy_type, "--out", str(root),
           "--batches", args.batches, "--reps", str(reps), "--mode", args.mode, "--threads", str(args.threads),
           "--cache-dir", str(cache), *(["--rtc"] if args.rtc else []), *(["--freezing"] if args.freezing else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    summary = None
    for line in out.stdout.splitlines():
        record = json.loads(line) if line.startswith("{") else None
        if record is None:
            continue
        if "batch" in record and timed:
            label = f"{policy_type}{' RTC' if record.get('rtc') else ''}"
            print(f"{label:12} {record['batch']:5d} {record['eager_ms']:9.1f} {record['compiled_ms']:11.1f} "
                  f"{record['eager_ms'] / record['compiled_ms']:7.2f}x {record['max_diff']:10.1e}", flush=True)
        elif "rtc_frozen_ms" in record and timed:
            print(f"{policy_type:8} RTC batch 1 (eager): frozen parameters {record['rtc_frozen_ms']:.1f} ms, trainable "
                  f"{record['rtc_trainable_ms']:.1f} ms ({record['rtc_trainable_ms'] / record['rtc_frozen_ms']:.2f}x), "
                  f"chunks {'bit for bit equal' if record['rtc_equal'] else 'DIFFERENT'}", flush=True)
        elif "compile_s" in record:
            summary = record
            print(f"{policy_type:8} start-up ({'first run' if timed else 'again, same cache'}): buckets "
                  f"{args.batches} compiled and warmed in {record['compile_s']:.1f} s "
                  f"(per bucket: {', '.join(f'{k}: {v:.1f} s' for k, v in record['buckets'].items())}); "
                  f"compile.eager_calls while timing: {record['eager_calls']:.0f}", flush=True)
    if summary is None:
        raise SystemExit(f"{policy_type}: the measuring process failed:\n{out.stderr[-3000:]}")
    return summary


def measure(policy_type: str, root: Path, batches: list[int], reps: int, mode: str, cache: Path, *,
            rtc: bool) -> None:
    import logging

    import numpy as np

    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.config.runner_loading import load_runner
    from lerobot_zenoh.server.runners import InferenceRequest

    logging.basicConfig(level=logging.WARNING)
    folder = root / policy_type
    if not (folder / "config.json").is_file():
        build_checkpoint(folder, policy_type=policy_type, state_names=NAMES, action_names=NAMES,
                         cameras=CAMERAS, chunk_size=50, fps=30)

    rtc = rtc and policy_type != "act"
    guided = {"rtc": {"enabled": True, "execution_horizon": 10}} if rtc else {}

    def runner(compile_block, **kw):
        entry = {"model_id": policy_type, "model_version": "v", "application_tag": "a", "pretrained_path": str(folder),
                 "accept_unknown_clients": True, "max_batch_size": max(batches), "compile": compile_block, **kw}
        manifest = parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "compile_cache_dir": str(cache),
                                   "server": [entry]})
        return load_runner(manifest, manifest.server[0])

    eager = runner("off", **guided)
    compiled = runner({"mode": mode, "buckets": sorted(batches)}, **guided)
    t0 = time.perf_counter()
    compiled.warmup()
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    for batch in batches:
        requests = [InferenceRequest(
            f"robot{i}", rng.normal(size=len(NAMES)).astype(np.float32),
            {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in CAMERAS.items()},
            TASKS[i % len(TASKS)], seed=i, extras=leftover(rng, i) if rtc else {}) for i in range(batch)]
        a, b = eager.run(requests), compiled.run(requests)  # untimed
        diff = max(float(np.abs(x.actions - y.actions).max()) for x, y in zip(a, b, strict=True))
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(reps):
            for name, r in (("eager", eager), ("compiled", compiled)):
                t = time.perf_counter()
                r.run(requests)
                times[name].append((time.perf_counter() - t) * 1000)
        print(json.dumps({"batch": batch, "rtc": rtc, "eager_ms": statistics.median(times["eager"]),
                          "compiled_ms": statistics.median(times["compiled"]), "max_diff": diff}), flush=True)
    if policy_type != "act" and not rtc:
        frozen_rtc(runner("off", rtc={"enabled": True}), reps)
    print(json.dumps({"compile_s": compile_s, "buckets": {str(k): v for k, v in compiled._compiled.compile_s.items()},
                      "eager_calls": compiled.figures().get("compile.eager_calls")}), flush=True)


def leftover(rng, i: int) -> dict:
    """Request `i`'s RTC inputs: none for one in four, else a leftover of 8 to 40 actions and a delay
    of 1 to 6 steps (a mixed batch: lengths and delays differ row by row)."""
    import numpy as np

    from lerobot_zenoh.protocol.messages import RtcInputs
    from lerobot_zenoh.server.runners.base import RTC_EXTRA

    if i % 4 == 3:
        return {}
    rows = 8 + (i * 11) % 33
    return {RTC_EXTRA: RtcInputs(rng.normal(size=(rows, len(NAMES))).astype(np.float32), 1 + i % 6)}


def frozen_rtc(runner, reps: int) -> None:
    """One request with an RTC prefix (eager: guidance is not compiled), the served frozen parameters
    against the same model trainable (as LeRobot loads it), alternately."""
    import numpy as np

    from lerobot_zenoh.protocol.messages import RtcInputs
    from lerobot_zenoh.server.runners import InferenceRequest
    from lerobot_zenoh.server.runners.base import RTC_EXTRA

    rng = np.random.default_rng(1)
    prefix = rng.normal(size=(20, len(NAMES))).astype(np.float32)
    request = InferenceRequest("robot0", rng.normal(size=len(NAMES)).astype(np.float32),
                               {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in CAMERAS.items()},
                               TASKS[0], seed=0, extras={RTC_EXTRA: RtcInputs(prefix, 3)})
    times: dict[bool, list[float]] = {True: [], False: []}
    out = {}
    for _ in range(reps + 1):
        for frozen in (True, False):
            runner.policy.requires_grad_(not frozen)
            t = time.perf_counter()
            out[frozen] = runner.run([request])[0].actions
            times[frozen].append((time.perf_counter() - t) * 1000)
    runner.policy.requires_grad_(False)
    print(json.dumps({"rtc_frozen_ms": statistics.median(times[True][1:]),
                      "rtc_trainable_ms": statistics.median(times[False][1:]),
                      "rtc_equal": bool(np.array_equal(out[True], out[False]))}), flush=True)


if __name__ == "__main__":
    main()
