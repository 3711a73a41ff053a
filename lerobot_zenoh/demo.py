"""`make demo`: one policy server and several simulated robots on loopback, then a summary.

Runs the real console scripts as separate processes, as a user would: `lerobot-policy-server`
with manifests/demo.yaml, and one `lerobot-robot-client --robot.type=zenoh_sim` per robot. After
`--seconds` every process gets SIGINT, and the per-robot JSON summaries are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One task string per robot (a VLA reads it; ACT ignores it).
TASKS = ("pick the cube", "open the drawer", "fold the towel", "push the block to the left")


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _wait_ready(port: int, app_status: str, timeout_s: float, server: subprocess.Popen) -> bool:
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    deadline = time.monotonic() + timeout_s
    with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                return False
            if session.query(app_status, timeout_s=0.5):
                return True
            time.sleep(0.2)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lerobot_zenoh.demo", description=__doc__)
    parser.add_argument("--manifest", default=str(ROOT / "manifests" / "demo.yaml"))
    parser.add_argument("--checkpoint", default=None, help="(informational) checkpoint the manifest points at")
    parser.add_argument("--robots", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "demo"))
    parser.add_argument("--record", action="store_true", help="robot_1 also records a LeRobotDataset")
    args = parser.parse_args(argv)

    from lerobot_zenoh.client.config import routing_args
    from lerobot_zenoh.server.manifest import load_manifest

    manifest = load_manifest(args.manifest)
    entry = manifest.server[0]
    clients = [c.client_uuid for c in entry.clients][: args.robots]
    if len(clients) < args.robots:
        print(f"the manifest lists only {len(clients)} clients", file=sys.stderr)
        return 2
    port = int(entry.listen_endpoints[0].rsplit(":", 1)[1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    print(f"== starting policy server ({args.manifest}), pre-warming {entry.model_id} ...", flush=True)
    server_log = open(out / "server.log", "w")
    server = subprocess.Popen([_bin("lerobot-policy-server"), "--manifest", args.manifest],
                              stdout=server_log, stderr=subprocess.STDOUT, env=env)
    robots: list[subprocess.Popen] = []
    try:
        app_status = manifest.app_key(entry).status
        if not _wait_ready(port, app_status, 120, server):
            print(f"server did not come up; see {out / 'server.log'}", file=sys.stderr)
            return 1
        print(f"== server ready; starting {len(clients)} simulated robots for {args.seconds:.0f} s", flush=True)
        for i, client_id in enumerate(clients):
            cmd = [
                _bin("lerobot-robot-client"), "--robot.type=zenoh_sim", f"--robot.id={client_id}",
                f"--robot.seed={i}", *routing_args(manifest.app_key(entry), client_id, f"tcp/127.0.0.1:{port}"),
                f"--fps={entry.fps}",
                f"--episode_time_s={args.seconds}", f"--task={TASKS[i % len(TASKS)]}",
                f"--summary_path={out / (client_id + '.json')}",
            ]
            if args.record and i == 0:
                cmd += [f"--dataset_repo_id=local/demo_{client_id}", f"--dataset_root={out / 'dataset'}"]
            log = open(out / f"{client_id}.log", "w")
            robots.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + args.seconds + 60
        for proc in robots:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        for proc in robots:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in robots:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    return print_summary(out, clients, [p.returncode for p in robots], server.returncode)


def print_summary(out: Path, clients: list[str], codes: list[int | None], server_code: int | None) -> int:
    cols = [("robot", 10), ("exit", 5), ("steps", 6), ("actions", 8), ("chunks", 7), ("rtt p50", 8),
            ("rtt p99", 8), ("infer p50", 10), ("period p99", 11), ("empty", 6), ("trimmed", 8), ("overruns", 9)]
    print()
    print("  ".join(name.rjust(width) for name, width in cols))
    ok = server_code == 0
    for client_id, code in zip(clients, codes):
        path = out / f"{client_id}.json"
        s = json.loads(path.read_text()) if path.exists() else {}
        ok &= code == 0 and bool(s) and s.get("chunks_received", 0) > 0
        ms = lambda v: "-" if v is None else f"{v:.1f}ms"  # noqa: E731
        row = [client_id, str(code), str(s.get("steps", "-")), str(s.get("actions_executed", "-")),
               str(s.get("chunks_received", "-")), ms(s.get("rtt_ms_p50")), ms(s.get("rtt_ms_p99")),
               ms(s.get("inference_ms_p50")), ms(s.get("control_period_ms_p99")),
               str(s.get("empty_buffer_cycles", "-")), str(s.get("trimmed_steps", "-")), str(s.get("loop_overruns", "-"))]
        print("  ".join(v.rjust(width) for v, (_, width) in zip(row, cols)))
    print(f"\nserver exit code {server_code}; logs and JSON summaries in {out}")
    print("demo OK" if ok else "demo FAILED: see the logs above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
