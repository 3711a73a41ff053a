"""Soak: one server and several robot clients for a long time; memory growth and throughput stability.

    python -m benchmarks.studies.soak --minutes 30 --robots 4                 # synthetic policy (default)
    python -m benchmarks.studies.soak --minutes 30 --robots 2 --manifest manifests/demo.yaml
    python -m benchmarks.studies.soak --minutes 30 --robots 4 --cameras 480x640,480x640 --churn-s 60   # make soak

With `--churn-s` robots come and go: every that many seconds the longest-running robot stops (SIGINT,
and every other time SIGKILL, which leaves its shared-memory file behind) and a robot with another id
starts. On one host the robots use the same-host path, so the run also samples /dev/shm (our files),
the machine's Shmem (memfd rings count there) and the server's open fds and mapped rings.

Runs the real console scripts as separate processes on loopback, samples every process's resident
memory from /proc and every component's telemetry (the same figures `lerobot-zenoh-monitor`
shows) every `--sample-s`, and writes outputs/soak/soak.json plus a summary table: per process the
RSS at the first sample after warm-up, at the end, and the growth per hour; per client the chunks
per minute (mean, min, max over the run) and control-loop overruns; for the server, inferences per
minute. A leak shows as steady RSS growth; a stall as a minute with far fewer chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.harness.processes import stop_processes  # noqa: E402
from lerobot_zenoh.client.config import routing_args  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.transport.session import ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import ZenohSettings  # noqa: E402


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def synthetic_manifest(port: int, robots: int, cameras: dict[str, list[int]]) -> dict:
    return {
        "cluster_uuid": "soak", "experiment_tag": "run", "server_id": "soak-server", "telemetry_period_s": 1.0,
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": "synthetic", "model_version": "v1", "application_tag": "soak", "fps": 30,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 50,
                                  "cameras": cameras, "latency_ms": 30},
                    "clients": [{"client_uuid": f"robot_{i + 1}"} for i in range(robots)]}],
    }


def parse_cameras(text: str) -> dict[str, list[int]]:
    """'96x128,96x128' -> {'front': [96, 128], 'wrist': [96, 128]} (then cam2, cam3, ...)."""
    names = ["front", "wrist"]
    out = {}
    for i, part in enumerate(p for p in text.split(",") if p):
        try:
            h, w = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected HxW per camera, e.g. 480x640,480x640; got {part!r}") from None
        if h <= 0 or w <= 0:
            raise argparse.ArgumentTypeError(f"a camera needs a positive size, got {part!r}")
        out[names[i] if i < len(names) else f"cam{i}"] = [h, w]
    if not out:
        raise argparse.ArgumentTypeError("no camera given")
    return out


def shared_memory_figures(server_pid: int | None) -> dict[str, float]:
    """What the same-host path holds: /dev/shm files of ours, the machine's Shmem (memfd pages count
    there), and the server's open fds and mapped rings."""
    figures: dict[str, float] = {}
    names = [n for n in os.listdir("/dev/shm") if n.startswith("lz-")]
    figures["shm_files"] = len(names)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            figures["machine_shmem_mb"] = int(line.split()[1]) / 1024
    if server_pid is not None:
        try:
            figures["server_fds"] = len(os.listdir(f"/proc/{server_pid}/fd"))
            maps = Path(f"/proc/{server_pid}/maps").read_text().splitlines()
            figures["server_mapped_rings"] = len({m.group(0) for line in maps if (m := re.search(r"memfd:lz-[0-9a-f-]+", line))})
        except OSError:
            pass
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--robots", type=int, default=4, help="robots running at any time")
    parser.add_argument("--manifest", help="a manifest to serve (default: a synthetic policy)")
    parser.add_argument("--cameras", default="96x128,96x128", type=parse_cameras,
                        help="synthetic policy and simulated robot: HxW per camera, comma separated")
    parser.add_argument("--churn-s", type=float, default=0.0,
                        help="every this many seconds the longest-running robot stops and a robot with a new id "
                             "starts (0: the same robots all run long); every other stop is a SIGKILL, which "
                             "leaves the robot's shared memory for the server to clean up")
    parser.add_argument("--port", type=int, default=7460)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=30.0, help="memory baseline taken after this")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "soak"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # With churn the server serves a pool of ids twice the robots (a stopped id comes back later).
    pool = args.robots * (2 if args.churn_s > 0 else 1)

    if args.manifest:
        manifest_path = Path(args.manifest)
        manifest = yaml.safe_load(manifest_path.read_text())
    else:
        manifest = synthetic_manifest(args.port, pool, args.cameras)
        manifest_path = Path(tempfile.mkdtemp()) / "soak.yaml"
        manifest_path.write_text(yaml.safe_dump(manifest))
    entry = manifest["server"][0]
    endpoint = (entry.get("endpoint") or (manifest.get("zenoh", {}).get("listen") or [f"tcp/127.0.0.1:{args.port}"])[0])
    ids = [c["client_uuid"] for c in entry.get("clients", [])][:pool]
    cameras = (entry.get("synthetic") or {}).get("cameras")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bin_dir = Path(sys.executable).parent

    procs: dict[str, subprocess.Popen] = {}
    started_at: dict[str, float] = {}
    logs = []
    log = open(out / "server.log", "w")
    logs.append(log)
    procs["server"] = subprocess.Popen([str(bin_dir / "lerobot-policy-server"), "--manifest", str(manifest_path)],
                                       stdout=log, stderr=subprocess.STDOUT, env=env)
    figures: dict[str, list] = {}
    lock = threading.Lock()

    def on_metrics(key: str, payload: bytes) -> None:
        try:
            msg = codec.decode_telemetry(payload)
        except Exception:
            return
        with lock:
            figures.setdefault(msg.source_id, []).append((time.monotonic(), dict(msg.metrics)))

    session = ZenohSession(ZenohSettings(connect=[endpoint], multicast_scouting=False)).open()
    session.subscribe("**/metrics", on_metrics)
    app = AppKey(manifest["cluster_uuid"], manifest["experiment_tag"], entry["model_id"], entry["model_version"],
                 entry["application_tag"])
    status_key = app.status
    deadline = time.monotonic() + 120
    while not session.query(status_key, 0.5) and time.monotonic() < deadline:
        time.sleep(0.5)

    def start_robot(client_id: str) -> None:
        log = open(out / f"{client_id}.log", "a")
        logs.append(log)
        camera_arg = ([f"--robot.cameras={json.dumps(cameras)}"] if cameras else [])
        procs[client_id] = subprocess.Popen([
            str(bin_dir / "lerobot-robot-client"), "--robot.type=zenoh_sim", *camera_arg,
            *routing_args(app, client_id, endpoint),
            f"--fps={entry.get('fps', 30)}", "--log_level=WARNING",
            f"--summary_path={out / (client_id + '.json')}",
        ], stdout=log, stderr=subprocess.STDOUT, env=env)
        started_at[client_id] = time.monotonic()

    for client_id in ids[: args.robots]:
        start_robot(client_id)
    waiting = list(ids[args.robots:])
    churn = {"stops": 0, "kills": 0, "starts": len(ids[: args.robots])}

    t0 = time.monotonic()
    next_churn = t0 + args.churn_s if args.churn_s > 0 else float("inf")
    memory: dict[str, list] = {name: [] for name in procs}
    shared: list[tuple[float, dict]] = []
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(min(args.sample_s, max(0.05, next_churn - time.monotonic()))) \
            and time.monotonic() - t0 < args.minutes * 60:
        if time.monotonic() >= next_churn:
            next_churn += args.churn_s
            running = sorted((started_at[n], n) for n in procs if n != "server" and procs[n].poll() is None)
            if running:
                oldest = running[0][1]
                kill = churn["stops"] % 2 == 1
                stop_processes([procs[oldest]], 30, signal.SIGKILL if kill else signal.SIGINT)
                churn["stops"] += 1
                churn["kills"] += kill
                del procs[oldest]
                waiting.append(oldest)
                start_robot(waiting.pop(0))
                churn["starts"] += 1
            continue
        for name, proc in procs.items():
            value = rss_mb(proc.pid)
            if value is not None:
                memory.setdefault(name, []).append((time.monotonic() - t0, value))
        shared.append((time.monotonic() - t0, shared_memory_figures(procs["server"].pid)))
        print(f"[{(time.monotonic() - t0) / 60:5.1f} min] "
              + "  ".join(f"{n}={memory[n][-1][1]:.0f}MB" for n in procs if memory.get(n))
              + "  " + "  ".join(f"{k}={v:.0f}" for k, v in shared[-1][1].items()), flush=True)

    stop_processes(list(reversed(procs.values())), 30)  # robots first, the server last
    session.close()
    for log in logs:
        log.close()
    after_stop = shared_memory_figures(None)

    report = {"minutes": args.minutes, "robots": args.robots, "ids": len(ids), "cameras": cameras,
              "churn_s": args.churn_s, "churn": churn, "processes": {}, "shared_memory": {}, "throughput": {}}
    for name, samples in memory.items():
        after = [v for t, v in samples if t >= args.warmup_s] or [v for _, v in samples]
        if not after or name != "server" and args.churn_s > 0:
            continue  # with churn a robot's RSS samples span several processes
        span_h = max((samples[-1][0] - next(t for t, _ in samples if t >= min(args.warmup_s, samples[-1][0]))) / 3600, 1e-9)
        report["processes"][name] = {"rss_mb_after_warmup": round(after[0], 1), "rss_mb_end": round(after[-1], 1),
                                     "rss_mb_max": round(max(after), 1),
                                     "growth_mb_per_hour": round((after[-1] - after[0]) / span_h, 1)}
    kept = [f for t, f in shared if t >= args.warmup_s] or [f for _, f in shared]
    for key in sorted({k for f in kept for k in f}):
        values = [f[key] for f in kept if key in f]
        report["shared_memory"][key] = {"after_warmup": round(values[0], 1), "end": round(values[-1], 1),
                                        "min": round(min(values), 1), "max": round(max(values), 1)}
    report["shared_memory"]["after_stop"] = after_stop
    for source, series in figures.items():
        key = "inferences" if source == manifest.get("server_id") else "chunks_received"
        per_min = []
        start = series[0][0]
        minute_marks = {}
        for t, m in series:
            if key in m:
                minute_marks.setdefault(int((t - start) // 60), m[key])
        marks = [minute_marks[k] for k in sorted(minute_marks)]
        per_min = [b - a for a, b in zip(marks, marks[1:]) if b >= a]  # a fall: a new process took the id
        last = series[-1][1]
        report["throughput"][source] = {
            f"{key}_per_min_mean": round(sum(per_min) / len(per_min), 1) if per_min else None,
            f"{key}_per_min_min": min(per_min) if per_min else None,
            f"{key}_per_min_max": max(per_min) if per_min else None,
            "loop_overruns": last.get("loop_overruns"), "empty_buffer_cycles": last.get("empty_buffer_cycles"),
            "observations_same_host": last.get("observations_same_host"),
        }
        if key == "inferences":
            report["throughput"][source].update({k: last.get(k) for k in sorted(last)
                                                 if k.startswith(("shm_", "rejected", "sessions"))})
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
