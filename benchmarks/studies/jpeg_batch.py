"""JPEG decode of a whole batch on the CPU, side by side in one run: decoders and thread layouts.

    PYTHONPATH=. python -m benchmarks.studies.jpeg_batch [--reps 15] [--workers N] [--json FILE]

What the server pays before a batch's forward pass: every camera of every request of the batch
decoded from its JPEG to an RGB uint8 (H, W, 3) array (`lerobot_zenoh.protocol.codec.decode_jpeg`'s
result). Frames are `benchmarks.harness.workloads.SceneCamera` views encoded as the client encodes them
(`codec.encode_jpeg`, OpenCV, quality 90), for 2 and 3 cameras at 96x128, 224x224 and 480x640, batches
of 1 and 8 requests. Candidates:

- ``per request`` (what the executor did before the batch decoder): per request, the first camera on
  the calling thread and the others at the same time on a pool of cameras - 1 threads, each through
  `codec.decode_jpeg` (the frame header checked, then simplejpeg's libjpeg-turbo);
- ``simplejpeg, serial``: every frame in turn on one thread (the decode alone, no header check, as
  for every candidate below but the server's);
- ``simplejpeg, batch on N threads``: every frame of the batch at once, the calling thread and N - 1
  pool threads each taking the next frame (libjpeg-turbo releases the GIL);
- the same three layouts (serial, batch on N threads) with OpenCV (``cv2.imdecode`` + BGR->RGB),
  torchvision's CPU decoder (``torchvision.io.decode_jpeg``, per frame and its list form, CHW
  tensors made HWC-contiguous as the runners take them) and Pillow;
- ``server's JpegBatchDecoder``: `lerobot_zenoh.server.model.jpeg_batch.JpegBatchDecoder` as the executor
  makes it (as many threads as cameras, at most the cores), its frame header checks included.

Each row's candidates run in turn, in a new random order each round, `--reps` rounds, so that a busy
machine (and whichever candidate ran just before) slows all of them alike; the median per batch is
printed with its ratio to ``per request``, and whether every frame is bit for bit the codec's. A
benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import simplejpeg

from benchmarks.harness.workloads import SceneCamera
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.server.model.jpeg_batch import JpegBatchDecoder

SIZES = ((96, 128), (224, 224), (480, 640))
CAMERAS = (2, 3)
BATCHES = (1, 8)
BASELINE = "per request (codec.decode_jpeg)"

Frame = bytes
Decode = Callable[[Frame], np.ndarray]


def codec_decode(shape: tuple[int, int]) -> Decode:
    return lambda data: codec.decode_jpeg(data, shape)


def simplejpeg_decode(data: Frame) -> np.ndarray:
    return simplejpeg.decode_jpeg(data, "RGB", fastdct=False, fastupsample=False)


def cv2_decode(data: Frame) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def pil_decode(data: Frame) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def torchvision_decode(data: Frame) -> np.ndarray:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    chw = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return np.ascontiguousarray(chw.permute(1, 2, 0).numpy())


def torchvision_list(frames: list[Frame]) -> list[np.ndarray]:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in frames]
    return [np.ascontiguousarray(t.permute(1, 2, 0).numpy()) for t in decode_jpeg(tensors, mode=ImageReadMode.RGB)]


def serial(decode: Decode) -> Callable[[list[list[Frame]]], list[np.ndarray]]:
    return lambda batch: [decode(f) for request in batch for f in request]


def per_request(decode: Decode, pool: ThreadPoolExecutor) -> Callable[[list[list[Frame]]], list[np.ndarray]]:
    """The executor's layout before the batch decoder: cameras of one request in parallel, requests in turn."""
    def run(batch: list[list[Frame]]) -> list[np.ndarray]:
        out = []
        for request in batch:
            others = [pool.submit(decode, f) for f in request[1:]]
            out.append(decode(request[0]))
            out.extend(o.result() for o in others)
        return out
    return run


def whole_batch(decode: Decode, pool: ThreadPoolExecutor, threads: int) -> Callable[[list[list[Frame]]], list[np.ndarray]]:
    """Every frame of the batch at once: this thread and `threads` - 1 pool threads, each taking the next."""
    def run(batch: list[list[Frame]]) -> list[np.ndarray]:
        frames = [f for request in batch for f in request]
        out: list[np.ndarray | None] = [None] * len(frames)
        nxt = iter(range(len(frames)))

        def worker() -> None:
            for i in nxt:  # a shared iterator: next() on it is atomic under the GIL
                out[i] = decode(frames[i])
        helpers = [pool.submit(worker) for _ in range(min(threads, len(frames)) - 1)]
        worker()
        for h in helpers:
            h.result()
        return out
    return run


def candidates(cameras: int, workers: int, pools: dict[int, ThreadPoolExecutor],
               server: JpegBatchDecoder, spec: dict[str, tuple[int, int]]) -> dict[str, Callable]:
    batch_pool = pools[workers]
    out = {
        BASELINE: per_request(codec_decode(next(iter(spec.values()))), pools[cameras - 1]),
        "simplejpeg, serial": serial(simplejpeg_decode),
        f"simplejpeg, batch on {workers} threads": whole_batch(simplejpeg_decode, batch_pool, workers),
        "cv2, serial": serial(cv2_decode),
        f"cv2, batch on {workers} threads": whole_batch(cv2_decode, batch_pool, workers),
        "torchvision cpu, serial": serial(torchvision_decode),
        "torchvision cpu, list form": lambda batch: torchvision_list([f for r in batch for f in r]),
        f"torchvision cpu, batch on {workers} threads": whole_batch(torchvision_decode, batch_pool, workers),
        "PIL, serial": serial(pil_decode),
        f"PIL, batch on {workers} threads": whole_batch(pil_decode, batch_pool, workers),
    }

    def through_server(batch: list[list[Frame]]) -> list[np.ndarray]:
        results = server.decode([dict(zip(spec, request, strict=True)) for request in batch], spec)
        return [img for r in results for img in r.values()]
    out[f"server's JpegBatchDecoder ({server.threads} threads)"] = through_server
    return out


def measure(reps: int, workers: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)  # torchvision's CPU decoder is one thread per frame anyway
    pools = {n: ThreadPoolExecutor(max_workers=max(1, n)) for n in {1, 2, workers}}
    rng = random.Random(0)
    rows = []
    try:
        for h, w in SIZES:
            scenes = [SceneCamera(h, w, seed) for seed in range(3)]
            for cameras in CAMERAS:
                spec = {f"cam{c}": (h, w) for c in range(cameras)}
                server = JpegBatchDecoder(threads=cameras)
                for batch_size in BATCHES:
                    batch = [[codec.encode_jpeg(scenes[c].frame(k)) for c in range(cameras)] for k in range(batch_size)]
                    expected = [codec.decode_jpeg(f) for request in batch for f in request]
                    runs = candidates(cameras, workers, pools, server, spec)
                    times: dict[str, list[float]] = {name: [] for name in runs}
                    equal: dict[str, bool] = {}
                    for name, run in runs.items():  # untimed first call, and the equality check
                        got = run(batch)
                        equal[name] = len(got) == len(expected) and all(
                            g.shape == e.shape and np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
                    order = list(runs.items())
                    for _ in range(reps):
                        rng.shuffle(order)
                        for name, run in order:
                            t0 = time.perf_counter()
                            run(batch)
                            times[name].append(time.perf_counter() - t0)
                    base = statistics.median(times[BASELINE])
                    for name, ts in times.items():
                        ms = statistics.median(ts) * 1e3
                        rows.append({"size": f"{h}x{w}", "cameras": cameras, "batch": batch_size, "candidate": name,
                                     "ms": ms, "ratio": ms / (base * 1e3), "equal": equal[name]})
                        print(f"{h}x{w:<4} {cameras:>4} {batch_size:>5}  {name:42s} {ms:8.2f} {ms / (base * 1e3):6.2f}  "
                              f"{'yes' if equal[name] else 'NO'}", flush=True)
                server.close()
    finally:
        for pool in pools.values():
            pool.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15, help="rounds of every candidate per row")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="threads of the batch layouts (default: this machine's cores)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.cpu_count()} cores, batch layouts on {args.workers} threads, "
          f"{args.reps} rounds, load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}", flush=True)
    print(f"{'size':8} {'cams':>4} {'batch':>5}  {'candidate':42s} {'ms':>8} {'ratio':>6}  bit-equal", flush=True)
    rows = measure(args.reps, args.workers)
    print(f"# load at the end {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
