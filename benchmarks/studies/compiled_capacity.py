"""Compiled inference in robots: one server's capacity serving a tiny pi0 eager, then compiled.

The fleet benchmark over the real stack (`benchmarks/studies/fleet_zenoh.py`: its virtual robots,
driver, metrics and stall budget, and the capacity search `fleet.largest_fleet`) against a real
``lerobot-policy-server`` serving a real tiny pi0 checkpoint (random weights, built offline with the
project's builder: lerobot-zenoh-build-checkpoint's defaults, 2 cameras 96x128, 6-D state, chunk 50),
once with ``compile: off`` and once with ``compile: default`` (one graph per batch bucket up to the
server's max batch, from a kept ``compile_cache_dir``). Same traces, seeds, scheduler, max batch and
torch threads for both.

What differs from the fleet benchmark: each robot sends what the reference client sends a VLA, its
6-D state, two 96x128 JPEG cameras (quality 90, the client's default) and its task's instruction,
and the server runs the model. Frames are encoded once at start-up and cycled (a real robot encodes
on its own machine; here the driver shares the CPU with the server). One server per mode serves
every fleet size of its search, each run on a fresh driver session with new client sessions; the
server is not restarted between runs (a compiled start-up takes minutes).

Capacity: the largest fleet, to one robot, whose control steps stalled counted from arrival stay
within 1 % above a robot alone on the eager server (the fleet benchmark's budget: a dedicated eager
server per robot is what a shared server replaces); the same budget for both. Beside it, at that
fleet: chunks/s served (the server's count), actions/s executed, the robots' chunk latency (an
observation's send to its chunk's arrival, p50 and p99, mean over seeds), and the machine's 1-minute
load average around the runs (the machine may be shared).

    python -m benchmarks.studies.compiled_capacity [--quick] [--seeds 2] [--max-batch 8] [--threads 1]

A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.harness.processes import ServerProcess
from benchmarks.harness.driver import telemetry_metrics
from benchmarks.harness.robot import Capture
from benchmarks.studies import fleet as model
from benchmarks.studies import fleet_traces
from benchmarks.studies.compiled import CAMERAS, TASKS
from benchmarks.studies.fleet_zenoh import (
    PHASES,
    REAL_HEADER,
    RunConfig,
    VirtualRobot,
    aggregate,
    drive,
    free_port,
    pm,
    real_row,
    wait_for_server,
)
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "outputs" / "compiled_capacity"
APP = AppKey("fleet", "bench", "pi0", "v1", "fleet")
SERVER_ID = "capacity-server"
STATE_DIM = 6
MODES = ("eager", "compiled")


# ------------------------------------------------------------------------------------ robots


def camera_frames(count: int, seed: int = 0) -> tuple[dict[str, bytes], ...]:
    """`count` observations' JPEG cameras (`CAMERAS`), encoded as the client encodes them: smooth
    blocks with a little noise, closer to a camera's picture (and its JPEG size) than pure noise."""
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(count):
        frame = {}
        for name, (h, w) in CAMERAS.items():
            coarse = rng.integers(0, 256, (h // 8, w // 8, 3)).repeat(8, axis=0).repeat(8, axis=1)
            image = np.clip(coarse + rng.normal(0, 6, (h, w, 3)), 0, 255).astype(np.uint8)
            frame[name] = codec.encode_jpeg(image, 90)
        frames.append(frame)
    return tuple(frames)


class CameraRobot(VirtualRobot):
    """A fleet benchmark robot that sends a VLA what the reference client sends it: the 6-D state, the
    cameras' JPEG frames (cycled from `frames`) and the task's instruction (one per task)."""

    def __init__(self, client_id: str, cfg: RunConfig, publisher, phase: int, *, frames: tuple[dict[str, bytes], ...]):
        super().__init__(client_id, cfg, publisher, phase)
        self.frames = frames

    def observation_of(self, capture: Capture, now: float) -> Observation:
        obs = super().observation_of(capture, now)
        state = np.sin(self.progress / 30.0 + np.arange(STATE_DIM, dtype=np.float32)).astype(np.float32)
        return replace(obs, state=state, images=self.frames[(self.seq + self.phase) % len(self.frames)],
                       task=TASKS[(self.episode + self.phase) % len(TASKS)])


# ------------------------------------------------------------------------------------ server


def manifest(mode: str, port: int, checkpoint: Path, cache_dir: Path, max_batch: int) -> dict:
    entry = {"model_id": APP.model, "model_version": APP.version, "application_tag": APP.app,
             "fps": fleet_traces.FPS, "pretrained_path": str(checkpoint), "scheduler": "fifo",
             "max_batch_size": max_batch, "accept_unknown_clients": True, "max_unknown_clients": 512,
             # compiled: the default buckets, 1, 2, 4, ... up to the max batch (every batch has its graph)
             "compile": "default" if mode == "compiled" else "off"}
    return {"cluster_uuid": APP.cluster, "experiment_tag": APP.experiment, "server_id": SERVER_ID,
            "telemetry_period_s": 1.0, "compile_cache_dir": str(cache_dir),
            # a fleet's robots are on other machines: JPEG over the network, not the same-host path
            "same_host": False,
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "server": [entry]}


def build_checkpoint(folder: Path) -> None:
    """The tiny pi0 of `benchmarks/studies/compiled.py` (the builder's defaults), once."""
    if (folder / "config.json").is_file():
        return
    names = ",".join(f"joint_{i}" for i in range(STATE_DIM))
    cameras = ",".join(f"{name}:{h}x{w}" for name, (h, w) in CAMERAS.items())
    subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.build_checkpoint", "--policy_type=pi0",
                    f"--output={folder}", f"--state_names={names}", f"--cameras={cameras}", "--chunk_size=50",
                    f"--fps={fleet_traces.FPS}"], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def latest_figures(port: int, timeout_s: float = 3.0) -> dict:
    """The server's latest telemetry figures (one period's wait at most `timeout_s`)."""
    seen: list[tuple[float, bytes]] = []
    with ZenohSession(loopback_settings(connect_ports=(port,))).open() as session:
        session.subscribe(APP.server_metrics(SERVER_ID), lambda key, payload: seen.append((time.perf_counter(), payload)))
        deadline = time.monotonic() + timeout_s
        while not seen and time.monotonic() < deadline:
            time.sleep(0.1)
    figures = telemetry_metrics(seen)
    return figures[-1][1] if figures else {}


# ------------------------------------------------------------------------------------ study


def serve_and_search(mode: str, args, tasks, frames, budget: float | None, guess: int | None) -> dict:
    """Start the server in `mode`, measure a robot alone, search the capacity within `budget` (the
    eager run sets it from its own robot alone), and stop the server; returns every point."""
    port = args.port or free_port()
    log_path = Path(args.out) / f"server-{mode}.log"
    points: dict[int, SimpleNamespace] = {}
    base = RunConfig(scheduler="fifo", max_batch=str(args.max_batch), warmup_s=args.warmup_s,
                     measure_s=args.measure_s)
    robot = functools.partial(CameraRobot, frames=frames)
    t0 = time.perf_counter()
    with ServerProcess(manifest(mode, port, Path(args.out) / "pi0", Path(args.cache_dir), args.max_batch), log_path,
                       env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        with ZenohSession(loopback_settings(connect_ports=(port,))).open() as session:
            wait_for_server(session, APP, server, timeout_s=args.startup_timeout_s)
        startup_s = time.perf_counter() - t0
        print(f"== {mode}: server up in {startup_s:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)

        def at(n: int) -> SimpleNamespace:
            if n not in points:
                runs = []
                for seed in range(args.seeds):
                    load_before = os.getloadavg()[0]
                    with ZenohSession(loopback_settings(connect_ports=(port,))).open() as session:
                        result = drive(replace(base, robots=n, seed=seed), tasks, session, app=APP,
                                       server_id=SERVER_ID, robot=robot)
                    result["load"] = (load_before + os.getloadavg()[0]) / 2
                    runs.append(result)
                    time.sleep(args.pause_s)  # what the last run left queued is served before the next starts
                points[n] = aggregate(runs)
                points[n].load = statistics.fmean(r["load"] for r in runs)
            return points[n]

        alone = at(1)
        if budget is None:
            budget = alone.stalled_arrival_pct + 1.0
        capacity = model.largest_fleet(at, "stalled_arrival_pct", budget, args.max_fleet, start=guess)
        figures = latest_figures(port)
    return {"mode": mode, "startup_s": startup_s, "budget": budget, "capacity": capacity,
            "n": max(1, int(capacity.removeprefix(">= "))), "points": points,
            "eager_calls": figures.get("compile.eager_calls"), "inferences": figures.get("inferences")}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b and not (math.isnan(a) or math.isnan(b)) else "-"


def report(found: dict[str, dict], args) -> str:
    out = []
    say = out.append
    eager, compiled = found["eager"], found["compiled"]
    say(f"Budget: {eager['budget']:.2f} % of control steps stalled counted from arrival (1 % above a robot alone "
        f"on the eager server, {eager['points'][1].stalled_arrival_pct:.2f} %; alone on the compiled server "
        f"{compiled['points'][1].stalled_arrival_pct:.2f} %). FIFO, max batch {args.max_batch}, "
        f"{args.threads} torch thread(s); {args.seeds} seed(s) of {args.measure_s:g} s measured after "
        f"{args.warmup_s:g} s warm-up per point; mean ± sample sd over seeds.\n")
    say("| server | robots within the budget | chunks/s | actions/s | chunk latency p50 / p99 ms | stalled % from "
        "arrival | batch mean | driver late p99 ms | load (1 min) | start-up s |\n|---|---|---|---|---|---|---|---|---|---|")
    for name in MODES:
        f = found[name]
        r = f["points"][f["n"]]
        say(f"| {name} | {f['capacity']} | {pm(r, 'served_per_s', '.1f')} | {pm(r, 'actions_per_s', '.0f')} | "
            f"{r.rtt_p50_ms:.0f} / {r.rtt_p99_ms:.0f} | {pm(r, 'stalled_arrival_pct')} | {r.server_batch_mean:.1f} | "
            f"{r.driver_lateness_p99_ms:.1f} | {r.load:.1f} | {f['startup_s']:.0f} |")
    e, c = eager["points"][eager["n"]], compiled["points"][compiled["n"]]
    say(f"| compiled / eager | {ratio(compiled['n'], eager['n'])} | {ratio(c.served_per_s, e.served_per_s)} | "
        f"{ratio(c.actions_per_s, e.actions_per_s)} | {ratio(c.rtt_p50_ms, e.rtt_p50_ms)} / "
        f"{ratio(c.rtt_p99_ms, e.rtt_p99_ms)} | | | | | |")
    say("")
    calls, served = compiled["eager_calls"], compiled["inferences"]
    say(f"Calls the compiled server ran eager (a batch without its graph): "
        f"{'?' if calls is None else int(calls)} of {'?' if served is None else int(served)} chunks served.\n")
    say("Every point of both searches (load: the 1-minute load average around the point's runs):\n")
    header, rule = REAL_HEADER.split("\n")
    say(f"{header} load |\n{rule}---|")
    for name in MODES:
        for n, r in sorted(found[name]["points"].items()):
            say(f"{real_row(f'{name} / {n}', r)} {r.load:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: max batch 2, one seed, 3 s + 6 s per point, fleets up to 3 (~3 min with "
                        "the cache warm)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=6.0)
    p.add_argument("--measure-s", type=float, default=15.0)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1,
                   help="the server's torch threads (OMP_NUM_THREADS); the driver uses the machine's other core")
    p.add_argument("--max-fleet", type=int, default=48, help="the capacity searches stop here")
    p.add_argument("--eager-guess", type=int, default=16,
                   help="where the eager search starts (a guess: it only saves points); the compiled search "
                        "starts from 1.5 times the eager capacity")
    p.add_argument("--pause-s", type=float, default=2.0, help="between two runs on the same server")
    p.add_argument("--startup-timeout-s", type=float, default=1800.0, help="a cold compile of every bucket")
    p.add_argument("--port", type=int, default=None, help="the server's port (default: a free one)")
    p.add_argument("--out", default=str(OUT), help="the checkpoint, the servers' logs and the results")
    p.add_argument("--cache-dir", default=None,
                   help="inductor's cache (compile_cache_dir), kept between runs; default: <out>/inductor-<threads>t "
                        "(one per thread count: graphs compiled with another count can run slower than eager)")
    args = p.parse_args(argv)
    if args.quick:
        args.max_batch, args.seeds, args.warmup_s, args.measure_s, args.max_fleet = 2, 1, 3.0, 6.0, 3
        args.eager_guess = 2
    args.out = str(Path(args.out).resolve())  # the server process runs from the repository root
    args.cache_dir = str(Path(args.cache_dir or Path(args.out) / f"inductor-{args.threads}t").resolve())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    build_checkpoint(Path(args.out) / "pi0")
    tasks = fleet_traces.generate_traces(fleet_traces.TASKS, fleet_traces.TRACE_SEED)
    frames = camera_frames(2 * PHASES)
    t0 = time.perf_counter()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} load {os.getloadavg()[0]:.1f}; {fleet_traces.describe(tasks)}",
          flush=True)
    found: dict[str, dict] = {}
    found["eager"] = serve_and_search("eager", args, tasks, frames, None, args.eager_guess)
    found["compiled"] = serve_and_search("compiled", args, tasks, frames, found["eager"]["budget"],
                                         round(1.5 * found["eager"]["n"]))
    body = report(found, args)
    print(body)
    (Path(args.out) / "result.json").write_text(json.dumps(
        {mode: {**{k: v for k, v in f.items() if k != "points"},
                "points": {n: r.runs for n, r in sorted(f["points"].items())}} for mode, f in found.items()},
        indent=1, default=float))
    print(f"({(time.perf_counter() - t0) / 60:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
