"""pi0-FAST decoding across robots: one at a time vs static batching vs continuous batching.

    python -m benchmarks.studies.autoregressive [--shapes tiny,small] [--robots 1,2,4,8,16] [--requests 32]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--slots 8] [--threads N] [--json OUT]

For each shape (checkpoints built offline by the project's builder under ``--checkpoints``, reused
when present) and each fleet size, `R` robots each ask for a chunk, wait for it, then think for an
exponential time (mean ``--think`` x the one-request service time, so arrivals are Poisson between
answers), until ``--requests`` chunks are served; every mode sees the same observations in the same
per-robot order. Modes:

- ``one``: one request at a time (a one-slot engine: exactly LeRobot's KV-cache decode of one request);
- ``static``: today's batching: the waiting requests (up to ``--slots``) start together and the batch
  runs until its *slowest* request ends;
- ``continuous``: iteration-level batching, a waiting request joins at the next token boundary
  after a separate prefill forward; ``packed``: the same, with the joiners' prefill packed into the
  running rows' decode forward (ActionFlow).

The wait-ratio scheduler picks who joins when more wait than slots are free. Printed per mode:
chunks/s, per-request latency p50/p99 (arrival -> tokens done; the image encoding and
preprocessing, the same in every mode, are timed separately), the ratio to ``one``, and whether every
request's tokens equal those of the request decoded alone. Then prefill / decode-step / per-token /
per-chunk times by batch size. Time spent with nothing to do (all robots thinking) is skipped
(virtual clock), so runs stay short.

Needs only lerobot, torch, transformers, tokenizers and numpy (no zenoh): the lead can run it on a GPU
machine with ``--device cuda --dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

MODES = ("one", "static", "continuous", "packed")


def build(shape: str, folder: Path) -> Path:
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    if (folder / "config.json").is_file():
        return folder
    print(f"building the {shape} pi0_fast checkpoint in {folder} ...", file=sys.stderr)
    return build_checkpoint(folder, policy_type="pi0_fast", state_names=[f"joint_{i}" for i in range(6)],
                            action_names=[f"joint_{i}" for i in range(6)], cameras={"front": (96, 128)},
                            chunk_size=50, fps=30, architecture=shape, force=True)


def observations(runner, n: int, seed: int = 0):
    from lerobot_zenoh.server.runners.base import InferenceRequest

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        state = rng.normal(0, 0.5, runner.spec.state_dim).astype(np.float32)
        images = {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in runner.spec.cameras.items()}
        out.append(InferenceRequest(f"obs{i}", state, images, "pick up the cube and place it in the bowl", 0))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def engine_for(runner, mode: str, slots: int, clock, scheduler=None):
    from lerobot_zenoh.server.runners.decode_batch import BatchDecoder

    kwargs = {"one": {"n_slots": 1}, "static": {"n_slots": slots, "admit": "idle"},
              "continuous": {"n_slots": slots}, "packed": {"n_slots": slots, "join": "packed"}}[mode]
    return BatchDecoder(runner.policy.model, end_token=runner._end, max_new_tokens=runner.max_new_tokens,
                        max_prefix_len=runner.prefix_len(), scheduler=scheduler, clock=clock, **kwargs)


def simulate(runner, prefixes, reference, mode: str, robots: int, requests: int, think_s: float, slots: int,
             seed: int, device: str) -> dict:
    """Serve `requests` chunks to `robots` closed-loop robots; virtual clock (idle time skipped)."""
    from lerobot_zenoh.scheduling.wait_ratio import WaitRatioScheduler
    from lerobot_zenoh.server.runners.decode_batch import DecodeRequest

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    skipped = [0.0]

    def now() -> float:
        return time.perf_counter() - t0 + skipped[0]

    engine = engine_for(runner, mode, slots, now, WaitRatioScheduler())
    next_at = {r: float(rng.exponential(think_s)) for r in range(robots)}
    issued = {r: 0 for r in range(robots)}
    arrived: dict[int, float] = {}
    which: dict[int, int] = {}
    latencies: list[float] = []
    mismatches = 0
    total = 0
    started = 0
    while total < requests:
        t = now()
        for r in range(robots):
            if r not in arrived and started < requests and next_at[r] <= t:
                k = (r * 7 + issued[r]) % len(prefixes)
                issued[r] += 1
                started += 1
                p = prefixes[k]
                arrived[r] = next_at[r]
                which[r] = k
                engine.submit(DecodeRequest(f"robot{r}", p.embs, p.pad, p.att, arrived_s=next_at[r]))
        if not engine.busy:
            pending = [next_at[r] for r in range(robots) if r not in arrived]
            skipped[0] += max(0.0, min(pending) - now())
            continue
        done = engine.step()
        sync(device)
        t = now()
        for res in done:
            r = int(str(res.key).removeprefix("robot"))
            latencies.append(t - arrived.pop(r))
            mismatches += res.tokens != reference[which[r]]
            next_at[r] = t + float(rng.exponential(think_s))
            total += 1
    elapsed = now()
    lat = np.array(latencies) * 1e3
    return {"mode": mode, "robots": robots, "chunks": total, "chunks_per_s": total / elapsed,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "mismatches": int(mismatches), "kv_evictions": engine.kv.evictions}


def per_batch(runner, prefixes, batch_sizes, tokens_per_chunk: float, device: str, steps: int = 8) -> list[dict]:
    """Prefill and decode-step times at each batch size (every row decodes `steps` tokens)."""
    from lerobot_zenoh.server.runners.decode_batch import BatchDecoder, DecodeRequest

    rows = []
    for b in batch_sizes:
        best = None
        for _ in range(2):
            engine = BatchDecoder(runner.policy.model, end_token=-1, max_new_tokens=steps + 1, n_slots=b,
                                  max_prefix_len=runner.prefix_len())
            reqs = [DecodeRequest(i, prefixes[i % len(prefixes)].embs, prefixes[i % len(prefixes)].pad,
                                  prefixes[i % len(prefixes)].att) for i in range(b)]
            for r in reqs:
                engine.submit(r)
            sync(device)
            t = time.perf_counter()
            engine.step()  # the prefill of all b
            sync(device)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(device)
            step = (time.perf_counter() - t) / steps
            if best is None or prefill + step < best[0] + best[1]:
                best = (prefill, step)
        prefill, step = best
        rows.append({"batch": b, "prefill_ms": prefill * 1e3, "step_ms": step * 1e3, "per_token_ms": step * 1e3 / b,
                     "per_chunk_ms": (prefill + tokens_per_chunk * step) * 1e3 / b})
    return rows


def run_shape(shape: str, args) -> dict:
    import torch

    from lerobot_zenoh.server.runners import LoadOptions, load_policy_runner
    from lerobot_zenoh.server.runners.decode_batch import BatchDecoder

    path = build(shape, Path(args.checkpoints) / f"pi0_fast_{shape}")
    runner = load_policy_runner(path, options=LoadOptions(device=args.device, dtype=args.dtype))
    obs = observations(runner, args.pool)
    t = time.perf_counter()
    prefixes = [runner.prefix(o, i) for i, o in enumerate(obs)]
    sync(args.device)
    embed_ms = (time.perf_counter() - t) / len(obs) * 1e3
    # Reference: each observation decoded alone.
    reference, lengths, alone_s = [], [], []
    for p in prefixes:
        engine = BatchDecoder(runner.policy.model, end_token=runner._end, max_new_tokens=runner.max_new_tokens,
                              n_slots=1, max_prefix_len=runner.prefix_len())
        t = time.perf_counter()
        (res,) = engine.run_all([p])
        sync(args.device)
        alone_s.append(time.perf_counter() - t)
        reference.append(res.tokens)
        lengths.append(len(res.tokens))
    service_s = statistics.median(alone_s)
    print(f"\n## {shape}: {runner.prefix_len()} prompt tokens, {statistics.mean(lengths):.1f} tokens per chunk "
          f"(min {min(lengths)}, max {max(lengths)}), one request alone {service_s * 1e3:.0f} ms, image encoding "
          f"+ preprocessing {embed_ms:.0f} ms per request (not in the latencies)", flush=True)
    print("| robots | mode | chunks/s | x one | p50 ms | p99 ms | identical |")
    print("|---:|---|---:|---:|---:|---:|---|")
    table = []
    for robots in args.robots:
        base = None
        for mode in args.modes:
            row = simulate(runner, prefixes, reference, mode, robots, args.requests, args.think * service_s,
                           args.slots, seed=robots, device=args.device)
            base = row["chunks_per_s"] if mode == "one" else base
            ratio = row["chunks_per_s"] / base if base else float("nan")
            row["x_one"] = ratio
            table.append(row)
            same = "yes" if row["mismatches"] == 0 else f"NO ({row['mismatches']} differ)"
            print(f"| {robots} | {mode} | {row['chunks_per_s']:.2f} | {ratio:.2f} | {row['p50_ms']:.0f} | "
                  f"{row['p99_ms']:.0f} | {same} |", flush=True)
    sizes = [b for b in (1, 2, 4, 8, 16) if b <= max(args.robots)]
    batches = per_batch(runner, prefixes, sizes, statistics.mean(lengths), args.device)
    print("\n| batch | prefill ms | decode step ms | per token ms | per chunk ms |")
    print("|---:|---:|---:|---:|---:|")
    for b in batches:
        print(f"| {b['batch']} | {b['prefill_ms']:.1f} | {b['step_ms']:.1f} | {b['per_token_ms']:.2f} | "
              f"{b['per_chunk_ms']:.1f} |", flush=True)
    del torch
    return {"shape": shape, "prompt_tokens": runner.prefix_len(), "tokens_per_chunk": statistics.mean(lengths),
            "alone_ms": service_s * 1e3, "embed_ms": embed_ms, "modes": table, "batches": batches}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--robots", default="1,2,4,8,16")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--requests", type=int, default=32, help="chunks served per (robots, mode)")
    parser.add_argument("--think", type=float, default=2.0, help="mean think time, in one-request service times")
    parser.add_argument("--slots", type=int, default=8, help="largest batch (KV slots)")
    parser.add_argument("--pool", type=int, default=16, help="distinct observations")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--checkpoints", default="outputs/bench_autoregressive")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.robots = [int(x) for x in args.robots.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    if args.modes[0] != "one" or any(m not in MODES for m in args.modes):
        parser.error(f"--modes: a comma list of {', '.join(MODES)} starting with 'one'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# pi0-FAST decoding across robots ({args.device}, {args.dtype}, {torch.get_num_threads()} CPU threads, "
          f"{args.slots} slots, {args.requests} chunks per cell, think {args.think} x service)")
    results = [run_shape(s, args) for s in args.shapes.split(",") if s]
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "shapes": results},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
