"""The OpenPI front door under costly frames, side by side with its control: the door's memory and an
honest openpi-client's latency.

    python -m benchmarks.studies.openpi_door_faults [--seconds 20] [--connections 8] [--frame-mib 16]
                                                    [--max-frame-mib N]

One synthetic model (2 x 224x224 cameras, 20 ms a batch) served in this process; the front door in a
process of its own (its resident memory is read from /proc every 20 ms); the official openpi-client
(`WebsocketClientPolicy.infer` in .venv-openpi, one request in flight) asks back to back for
`--seconds`: first alone (the control), then beside `--connections` websocket connections sending
`--frame-mib` MiB frames of nested empty lists, then of nested empty maps, at line rate, from
another loopback address, from a process of its own (testbed/fault_kit/tcp.py: `nested_frame`,
`flood_frames`; in the server's process, its churn of connections would slow the model). The door's frame
limit is its default (derived from the model: about 1.6 MB here, so 16 MiB frames are refused from
their headers) unless `--max-frame-mib` sets `max_frame_bytes` (16: the frames are read and screened). Prints a markdown
table: the door's resident memory at idle and its peak during each run, the honest client's
p50/p99 and requests answered, and what the door refused (frames, handshakes) during the run. docs/openpi.md holds a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from testbed.ports import free_port

ROOT = Path(__file__).resolve().parents[2]  # the attacker imports the fault kit from testbed/
DRIVER = ROOT / "testbed" / "openpi_client_driver.py"
CAMERAS = {"front": (224, 224), "wrist": (224, 224)}
MAPPING = {"images": {"observation/image": "front", "observation/wrist_image": "wrist"},
           "state": "observation/state", "prompt": "prompt"}

_ATTACKER = r"""
import json, sys, threading
from testbed.fault_kit import tcp
args = json.loads(sys.argv[1])
stop = threading.Event()
frame = tcp.nested_frame(args["nbytes"], args["kind"])
threading.Thread(target=tcp.flood_frames, args=("127.0.0.1", args["port"], frame, stop),
                 kwargs={"connections": args["connections"]}, daemon=True).start()
print("flooding", flush=True)
sys.stdin.read()  # until the study closes it
stop.set()
"""

_DOOR = r"""
import json, sys
from lerobot_zenoh.openpi.front_door import FrontDoor, FrontDoorConfig
door = FrontDoor(FrontDoorConfig(**json.loads(sys.argv[1]))).start()
print(json.dumps({"port": door.port}), flush=True)
for line in sys.stdin:
    print(json.dumps(door.counters.snapshot()), flush=True)
door.close()
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class PeakRss:
    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mb(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def honest(python: str, port: int, seconds: float, obs_file: str) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, str(DRIVER), json.dumps({"port": port, "mode": "chunks", "seconds": seconds,
                                                           "obs_file": obs_file})],
                         capture_output=True, text=True, env=env, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return [t["client_ms"] for t in json.loads(out.stdout.strip().splitlines()[-1])["timing"]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--frame-mib", type=int, default=16)
    p.add_argument("--max-frame-mib", type=int, default=None, help="the door's max_frame_bytes (unset: derived)")
    args = p.parse_args(argv)

    from lerobot_zenoh.protocol.keys import AppKey
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer

    python = str(Path(os.environ.get("OPENPI_VENV", ROOT / ".venv-openpi")) / "bin" / "python")
    built = subprocess.run([str(ROOT / "scripts" / "openpi-client-venv.sh"), str(Path(python).parents[1])],
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"openpi-client's environment could not be built: {built.stderr[-500:]}")
    zport = free_port()
    app = AppKey(f"bench{uuid.uuid4().hex[:6]}", "faults", "m", "v1", "app")
    manifest = parse_manifest({
        "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{zport}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 50,
                                  "cameras": {k: list(v) for k, v in CAMERAS.items()}, "latency_ms": 20},
                    "fps": 30, "max_batch_size": 8, "accept_unknown_clients": True}]})
    rng = np.random.default_rng(0)
    rows = []
    with PolicyServer(manifest), tempfile.TemporaryDirectory() as tmp:
        obs_file = str(Path(tmp) / "obs.npz")
        np.savez(obs_file, **{"observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
                              "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
                              "observation/state": rng.normal(size=6)})
        config = {"port": 0, "endpoint": f"tcp/127.0.0.1:{zport}", "cluster_uuid": app.cluster,
                  "experiment_tag": app.experiment, "model_id": app.model, "telemetry_period_s": 0,
                  "mapping": MAPPING}
        if args.max_frame_mib:
            config["max_frame_bytes"] = args.max_frame_mib << 20
        door = subprocess.Popen([sys.executable, "-c", _DOOR, json.dumps(config)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])})
        try:
            port = json.loads(door.stdout.readline())["port"]

            def refused() -> int:
                door.stdin.write("counts\n")
                door.stdin.flush()
                return sum(v for k, v in json.loads(door.stdout.readline()).items() if k.startswith("rejected."))

            honest(python, port, 2, obs_file)  # warm-up
            time.sleep(1)
            idle_mb = rss_mb(door.pid)
            for label, kind in (("alone (control)", None), ("beside nested lists", "lists"),
                                ("beside nested maps", "maps")):
                before = refused()
                attacker = None
                if kind is not None:
                    attacker = subprocess.Popen(
                        [sys.executable, "-c", _ATTACKER, json.dumps({"port": port, "kind": kind,
                                                                      "nbytes": args.frame_mib << 20,
                                                                      "connections": args.connections})],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
                    attacker.stdout.readline()
                with PeakRss(door.pid) as peak:
                    times = honest(python, port, args.seconds, obs_file)
                    if attacker is not None:
                        attacker.stdin.close()
                        attacker.wait(30)
                    time.sleep(1)
                rows.append((label, idle_mb, peak.peak, len(times), np.percentile(times, 50),
                             np.percentile(times, 99), refused() - before))
                time.sleep(2)
            door.stdin.write("counts\n")
            door.stdin.flush()
            counts = json.loads(door.stdout.readline())
        finally:
            door.stdin.close()
            door.wait(30)
    control_p99 = rows[0][5]
    limit = f"max_frame_bytes {args.max_frame_mib} MiB" if args.max_frame_mib else "the door's default frame limit"
    print(f"\n{args.connections} connections x {args.frame_mib} MiB frames, {limit}, {args.seconds:g} s a run, "
          f"load {os.getloadavg()[0]:.1f}\n")
    print("| honest openpi-client | door RSS idle | door RSS peak (above idle) | answered | p50 ms | p99 ms "
          "| p99 / control | refusals |")
    print("|---|---|---|---|---|---|---|---|")
    for label, idle, peak, n, p50, p99, refusals in rows:
        print(f"| {label} | {idle:.0f} MB | {peak:.0f} MB (+{peak - idle:.0f}) | {n} | {p50:.1f} | {p99:.1f} | "
              f"{p99 / control_p99:.2f}x | {refusals} |")
    refused = {k: v for k, v in counts.items() if k.startswith("rejected.")}
    print(f"\nrefused by the door: {refused}")


if __name__ == "__main__":
    main()
