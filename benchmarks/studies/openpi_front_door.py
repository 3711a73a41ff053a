"""The OpenPI front door against a Zenoh robot on the same model, and robots served at once through it.

    python -m benchmarks.studies.openpi_front_door [--requests 200] [--clients 1 4 8 16] [--seconds 15]

1. Added latency: the same observation (realistic frames, 6-D state) asked again and again, one
   request in flight, by (a) a Zenoh robot's request path (JPEG encode, put, wait for the chunk:
   the front door's own `RobotLink` on a session of its own, as `lerobot-robot-client` sends) and
   (b) the official openpi-client (`WebsocketClientPolicy.infer`, in .venv-openpi) through the front
   door; loopback, a synthetic model of a set latency, 2x224x224 and 2x480x640 cameras.
2. Robots at once: N openpi-clients (one process each, one request in flight each) on one model
   whose batch of 16 costs 1.5x a batch of 1: requests answered per second, per client, and the
   server's mean batch size.

The server, the front door and the Zenoh robot share this process; the openpi-clients are
processes of their own (their environment: scripts/openpi-client-venv.sh). Prints a markdown
table; docs/benchmarks.md holds a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from testbed.ports import free_port
from benchmarks.harness.workloads import make_frames
from benchmarks.harness.results import summary
from benchmarks.harness.workloads import Workload

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "testbed" / "openpi_client_driver.py"
WORKLOADS = (Workload("cam2_224", "2 x 224x224", (("front", 224, 224), ("wrist", 224, 224))),
             Workload("cam2_480x640", "2 x 480x640", (("front", 480, 640), ("wrist", 480, 640))))
MAPPING = {"images": {"observation/image": "front", "observation/wrist_image": "wrist"},
           "state": "observation/state", "prompt": "prompt"}


def manifest(port: int, app, cameras: dict, latency_ms: float, batch_latency_ms: dict, max_batch: int):
    from lerobot_zenoh.server.config.manifest import parse_manifest

    return parse_manifest({
        "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 50, "cameras": cameras,
                                  "latency_ms": latency_ms, "batch_latency_ms": batch_latency_ms},
                    "fps": 30, "max_batch_size": max_batch, "accept_unknown_clients": True}],
    })


def drive(python: str, port: int, **args) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([python, str(DRIVER), json.dumps({"port": port, **args})], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(err[-2000:])
    return json.loads(out.strip().splitlines()[-1])


def fleet(workload: Workload, latency_ms: float, batch_latency_ms: dict, max_batch: int):
    from lerobot_zenoh.openpi.front_door import FrontDoor, FrontDoorConfig
    from lerobot_zenoh.protocol.keys import AppKey
    from lerobot_zenoh.server.shell.policy_server import PolicyServer

    port = free_port()
    app = AppKey("bench", uuid.uuid4().hex[:8], "m", "v1", "app")
    server = PolicyServer(manifest(port, app, workload.camera_shapes, latency_ms, batch_latency_ms, max_batch))
    server.start()
    door = FrontDoor(FrontDoorConfig(port=0, endpoint=f"tcp/127.0.0.1:{port}", cluster_uuid=app.cluster,
                                     experiment_tag=app.experiment, model_id=app.model, telemetry_period_s=0,
                                     max_clients=64, mapping=MAPPING)).start()
    return server, door, port, app


def observation_file(workload: Workload, folder: str) -> tuple[str, dict]:
    frames = make_frames(workload, 1, seed=3)
    obs = {"observation/image": frames["front"][0], "observation/wrist_image": frames["wrist"][0],
           "observation/state": np.linspace(-1, 1, 6)}
    path = os.path.join(folder, f"{workload.key}.npz")
    np.savez(path, **obs)
    return path, obs


def added_latency(python: str, workload: Workload, requests: int, latency_ms: float, folder: str) -> dict:
    from lerobot_zenoh.openpi.bridge import RobotLink
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    server, door, port, app = fleet(workload, latency_ms, {1: latency_ms}, 1)
    try:
        path, obs = observation_file(workload, folder)
        images = {"front": obs["observation/image"], "wrist": obs["observation/wrist_image"]}
        state = obs["observation/state"].astype(np.float32)
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
            link = RobotLink(session, app, "zenoh-robot", jpeg_quality=90, resend_after_s=2.0, timeout_s=30,
                             control_period_s=None).open()
            zenoh_ms = []
            for i in range(requests + 5):
                t0 = time.perf_counter()
                link.infer(state, images, "pick up the cube")
                if i >= 5:
                    zenoh_ms.append((time.perf_counter() - t0) * 1000)
            link.close()
        out = result(drive(python, door.port, mode="chunks", repeat=requests + 5, obs_file=path))
        timing = out["timing"][5:]
        jpeg_bytes = sum(len(codec.encode_jpeg(i, 90)) for i in images.values())
        raw_bytes = sum(i.nbytes for i in images.values())
        return {"workload": workload.label, "zenoh": summary(zenoh_ms),
                "openpi": summary([t["client_ms"] for t in timing]),
                "door": summary([t["front_door_ms"] for t in timing]),
                "encode": summary([t["encode_ms"] for t in timing]),
                "raw_kb": raw_bytes / 1024, "jpeg_kb": jpeg_bytes / 1024}
    finally:
        door.close()
        server.stop()


def robots_at_once(python: str, clients: list[int], seconds: float, folder: str) -> list[dict]:
    workload = WORKLOADS[0]
    rows = []
    for n in clients:
        server, door, _, _ = fleet(workload, 100.0, {1: 100.0, 16: 150.0}, 16)
        try:
            path, _ = observation_file(workload, folder)
            procs = [drive(python, door.port, mode="chunks", repeat=3, seconds=seconds, obs_file=path) for _ in range(n)]
            outs = [result(p) for p in procs]
            sizes = server.models[0].session_table.batch_sizes
            per_client = [len(o["timing"][3:]) / max(sum(t["client_ms"] for t in o["timing"][3:]) / 1000, 1e-9)
                          for o in outs]
            rows.append({"clients": n, "rate": sum(per_client), "per_client": float(np.mean(per_client)),
                         "client_ms": summary([t["client_ms"] for o in outs for t in o["timing"][3:]]),
                         "batch_mean": float(np.mean(list(sizes)[-200:])) if sizes else 0.0,
                         "batch_max": max(sizes) if sizes else 0})
        finally:
            door.close()
            server.stop()
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--venv", default=str(ROOT / ".venv-openpi"))
    args = p.parse_args(argv)
    built = subprocess.run([str(ROOT / "scripts" / "openpi-client-venv.sh"), args.venv])
    if built.returncode != 0:
        raise SystemExit("openpi-client's environment could not be built")
    python = str(Path(args.venv) / "bin" / "python")
    with tempfile.TemporaryDirectory() as folder:
        print(f"## Added latency (loopback, synthetic model of {args.latency_ms:g} ms, {args.requests} requests, "
              "one in flight; ms)\n")
        print("| cameras | Zenoh robot p50 / p99 | openpi-client via front door p50 / p99 | added p50 | "
              "front door's own p50 (of which JPEG) | frame raw / JPEG KB |")
        print("|---|---|---|---|---|---|")
        for workload in WORKLOADS:
            r = added_latency(python, workload, args.requests, args.latency_ms, folder)
            z, o = r["zenoh"], r["openpi"]
            print(f"| {r['workload']} | {z['p50']:.2f} / {z['p99']:.2f} | {o['p50']:.2f} / {o['p99']:.2f} | "
                  f"{o['p50'] - z['p50']:+.2f} ({o['p50'] / z['p50']:.2f}x) | {r['door']['p50']:.2f} "
                  f"({r['encode']['p50']:.2f}) | {r['raw_kb']:.0f} / {r['jpeg_kb']:.0f} |", flush=True)
        print(f"\n## Robots at once through the front door (2 x 224x224, model 100 ms at batch 1, 150 ms at 16; "
              f"{args.seconds:g} s each, one request in flight per client)\n")
        print("| openpi clients | requests/s (all) | per client /s | client round trip p50 / p99 ms | "
              "server batch mean / max |")
        print("|---|---|---|---|---|")
        for row in robots_at_once(python, args.clients, args.seconds, folder):
            c = row["client_ms"]
            print(f"| {row['clients']} | {row['rate']:.1f} | {row['per_client']:.2f} | {c['p50']:.0f} / {c['p99']:.0f} | "
                  f"{row['batch_mean']:.2f} / {row['batch_max']} |", flush=True)


if __name__ == "__main__":
    main()
