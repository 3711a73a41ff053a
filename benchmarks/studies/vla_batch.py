"""Server-side chunk latency of tiny SmolVLA, tiny pi0 and ACT at batch 1, 2, 4, 8 (random weights).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.vla_batch [--out DIR] [--reps 5] [--types smolvla,pi0,act]

Builds each checkpoint offline (lerobot-zenoh-build-checkpoint defaults: 2 cameras 96x128, 6-D
state, chunk 50), loads it through the server's loader, and times `runner.run` on B requests from
distinct sessions with different task strings: median and min of `--reps` calls after one untimed
call. It prints one row per (type, batch): ms per call and ms per request. A benchmark, not a test.

`--share` also times the server's whole path for a batch as the inference thread runs it (the
executor: check + JPEG decode of every observation, `runner.run`, cutting and encoding each chunk)
and, inside it, the model's own `predict_action_chunk`; the middleware's share is the rest (frame
building, LeRobot's pre/post-processors, noise, JPEG, MessagePack) over the whole.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

TASKS = ("pick up the red cube", "open the drawer", "fold the towel on the table", "push the block left")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--types", default="smolvla,pi0,act")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--share", action="store_true", help="also the middleware's share of a batched pass")
    args = parser.parse_args()

    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.runners import InferenceRequest, load_policy_runner

    root = Path(args.out or tempfile.mkdtemp(prefix="vla_batch_"))
    cameras = {"front": (96, 128), "wrist": (96, 128)}
    names = [f"joint_{i}" for i in range(6)]
    rng = np.random.default_rng(0)
    print(f"{'type':8} {'batch':>5} {'median ms':>10} {'min ms':>8} {'ms/request':>10}")
    for policy_type in args.types.split(","):
        folder = root / policy_type
        if not (folder / "config.json").is_file():
            build_checkpoint(folder, policy_type=policy_type, state_names=names, action_names=names,
                             cameras=cameras, chunk_size=50, fps=30)
        runner = load_policy_runner(folder)
        for batch in (int(b) for b in args.batches.split(",")):
            requests = [InferenceRequest(
                f"robot{i}", rng.normal(size=6).astype(np.float32),
                {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in cameras.items()},
                TASKS[i % len(TASKS)], seed=i) for i in range(batch)]
            runner.run(requests)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                runner.run(requests)
                times.append((time.perf_counter() - t0) * 1000)
            med = statistics.median(times)
            print(f"{policy_type:8} {batch:5d} {med:10.1f} {min(times):8.1f} {med / batch:10.1f}", flush=True)
            if args.share:
                share(runner, requests, args.reps, policy_type, batch)


def share(runner, requests, reps: int, policy_type: str, batch: int) -> None:
    """The server's path for one batch (executor), and the model's forward pass inside it."""
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import Observation
    from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter

    executor = RunnerAdapter(policy_type, runner, actions_per_chunk=runner.spec.chunk_size, server_id="bench")
    observations = [Observation(i + 1, r.session_id, r.state, {c: codec.encode_jpeg(img, 90) for c, img in r.images.items()},
                                r.task) for i, r in enumerate(requests)]
    model = runner.policy
    forward = model.predict_action_chunk
    spent = []

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        spent.append(time.perf_counter() - t0)
        return out

    model.predict_action_chunk = timed
    try:
        whole, inner = [], []
        for k in range(reps + 1):
            spent.clear()
            t0 = time.perf_counter()
            prepared = [executor.prepare(o.client_uuid, o) for o in observations]
            results = executor.infer(prepared)
            for o, result in zip(observations, results, strict=True):
                executor.chunk(o, result, 0.0, 0.0)
            if k:  # the first is untimed
                whole.append(time.perf_counter() - t0)
                inner.append(sum(spent))
    finally:
        del model.predict_action_chunk  # the class's own again
        executor.close()
    w, m = statistics.median(whole) * 1000, statistics.median(inner) * 1000
    print(f"{policy_type:8} {batch:5d}   server path {w:7.1f} ms, model forward {m:7.1f} ms, "
          f"middleware {w - m:6.1f} ms = {100 * (w - m) / w:4.1f} %", flush=True)


if __name__ == "__main__":
    main()
