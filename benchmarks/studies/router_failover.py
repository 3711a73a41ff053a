"""Two Zenoh routers meshed, one killed with SIGKILL (or frozen with SIGSTOP): how long each robot goes
without a chunk (docs/reliability.md, "Several routers").

Two `lerobot-zenoh-router` processes on loopback, each connected to the other (a mesh of two). A
`lerobot-policy-server` process (synthetic policy, 20 ms a pass, chunks of 30 at 30 Hz) in Zenoh
client mode is given both routers (`zenoh.connect: [B, A]`: it holds a link to B). Robots, the
reference `RobotClient` on the simulated robot at 30 Hz, are given both routers too, half of them
router A first, half B first (`--zenoh.connect=[A, B]` or `[B, A]`): each holds one link, to the
first that answers, and moves to the other when it drops. After `--warmup` seconds one router is
killed with SIGKILL (`--signal stop`: frozen with SIGSTOP, found dead only when the Zenoh lease
expires, `--lease_ms`, Zenoh's default 10 s):

- `robots` kills A: the half of the robots on A move to B, the server (on B) stays;
- `server` kills B: the server and the other half of the robots move to A.

Reported per robot: the chunk period before the kill (median time between chunks), the longest
time without a chunk across the kill (from the last chunk before it to the last of the run), that
gap less one period (what the kill cost), the control ticks with an empty buffer after the kill
(the robot held position), and the chunks received after it.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.router_failover [--robots 4] [--kill robots server] \
        [--signal kill|stop] [--lease_ms 1000]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]

from testbed.ports import free_port  # noqa: E402
from lerobot_zenoh.client.client import RobotClient  # noqa: E402
from lerobot_zenoh.client.config import RobotClientConfig  # noqa: E402
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig  # noqa: E402
from lerobot_zenoh.client.task import Task  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.transport.session import ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import ZenohSettings  # noqa: E402

CAMS = {"front": (48, 64)}


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _python(*args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


class NotingTask(Task):
    """The plain task, noting when each accepted chunk arrived (perf_counter seconds)."""

    def __init__(self):
        super().__init__()
        self.arrivals: list[float] = []

    def on_chunk(self, seq_id, arrived_s):
        self.arrivals.append(arrived_s)


def run(kill: str, n_robots: int, warmup_s: float, after_s: float, overrides: dict[str, str], work: Path,
        sig: int = signal.SIGKILL) -> list[dict]:
    app = AppKey("bench", f"routers{uuid.uuid4().hex[:6]}", "syn", "v1", "rf")
    ports = {"A": free_port(), "B": free_port()}
    ep = {name: f"tcp/127.0.0.1:{port}" for name, port in ports.items()}
    lease = [f"--zenoh.json5_overrides={path}={value}" for path, value in overrides.items()]
    procs: dict[str, subprocess.Popen] = {}
    clients: list[tuple[RobotClient, threading.Thread, NotingTask, str]] = []
    try:
        for name, other in (("A", "B"), ("B", "A")):  # a mesh of two: each router connects to the other
            procs[name] = _python("-m", "lerobot_zenoh.cli.router", f"--zenoh.listen={ep[name]}",
                                  f"--zenoh.connect={ep[other]}", "--zenoh.multicast_scouting=false", *lease,
                                  "--log_level=WARNING", log=work / f"router_{name}.log")
        _wait(lambda: all(_port_open(p) for p in ports.values()), 60, "the routers")
        manifest = {
            "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0", "telemetry_period_s": 0,
            "zenoh": {"mode": "client", "connect": [ep["B"], ep["A"]], "multicast_scouting": False,
                      "json5_overrides": dict(overrides)},
            "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app,
                        "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30,
                                      "cameras": {k: list(v) for k, v in CAMS.items()}, "latency_ms": 20},
                        "fps": 30, "accept_unknown_clients": True}],
        }
        (work / "server.yaml").write_text(yaml.safe_dump(manifest))
        procs["server"] = _python("-m", "lerobot_zenoh.cli.server", f"--manifest={work / 'server.yaml'}",
                                  "--log_level=WARNING", log=work / "server.log")
        with ZenohSession(ZenohSettings(connect=[ep["A"]], multicast_scouting=False)) as probe:
            _wait(lambda: probe.query(app.status, 0.3), 120, "the server's status through router A")
        for i in range(n_robots):
            first, second = ("A", "B") if i % 2 == 0 else ("B", "A")
            task = NotingTask()
            zenoh = ZenohSettings(mode="client", connect=[ep[first], ep[second]], multicast_scouting=False,
                                  json5_overrides=dict(overrides))
            cfg = RobotClientConfig(robot=SimRobotConfig(cameras=dict(CAMS), fps=30), client_uuid=f"robot_{i}",
                                    cluster_uuid=app.cluster, experiment_tag=app.experiment, model_id=app.model,
                                    model_version=app.version, application_tag=app.app, zenoh=zenoh, fps=30,
                                    discovery_timeout_s=30)
            from lerobot.robots import make_robot_from_config

            client = RobotClient(cfg, make_robot_from_config(cfg.robot), task=task).start()
            thread = threading.Thread(target=client.run, daemon=True)
            thread.start()
            clients.append((client, thread, task, first))
        _wait(lambda: all(len(t.arrivals) >= 3 for _, _, t, _ in clients), 60, "every robot's first chunks")
        time.sleep(warmup_s)  # steady running before the kill: the chunk period is measured there
        victim = "A" if kill == "robots" else "B"
        empty_before = [c.counters.empty_cycles for c, _, _, _ in clients]
        t_kill = time.perf_counter()
        procs[victim].send_signal(sig)
        if sig == signal.SIGKILL:
            procs[victim].wait(10)
        time.sleep(after_s)
        rows = []
        for (client, _, task, first), empty0 in zip(clients, empty_before):
            arrivals = np.array(task.arrivals)
            before = arrivals[arrivals < t_kill]
            period = float(np.median(np.diff(before[-30:]))) if len(before) > 2 else float("nan")
            window = arrivals[arrivals >= t_kill - period]
            after = window[window >= t_kill]
            gap = float(np.max(np.diff(np.concatenate([before[-1:], after])))) if len(after) else float("inf")
            rows.append({"robot": client.config.client_uuid, "router": first, "on_killed": first == victim,
                         "period_s": period, "longest_gap_s": gap, "cost_s": gap - period,
                         "after_kill": int(len(after)), "empty_after": client.counters.empty_cycles - empty0})
        return rows
    finally:
        for client, thread, _, _ in clients:
            client.stop()
            thread.join(10)
            client.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a frozen router first
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--robots", type=int, default=4)
    ap.add_argument("--kill", nargs="+", choices=("robots", "server"), default=["robots", "server"],
                    help="robots: kill the router half the robots hold (not the server's); server: the server's")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of steady running before the kill")
    ap.add_argument("--after", type=float, default=8.0, help="seconds of running after the kill")
    ap.add_argument("--signal", choices=("kill", "stop"), default="kill", help="SIGKILL the router, or SIGSTOP it")
    ap.add_argument("--lease_ms", type=int, default=None, help="transport/link/tx/lease for every node (Zenoh: 10000)")
    ap.add_argument("--open_timeout_ms", type=int, default=None,
                    help="transport/unicast/open_timeout for every node: how long opening a link may take (Zenoh: 10000)")
    args = ap.parse_args(argv)
    for kill in args.kill:
        with tempfile.TemporaryDirectory(prefix="router_failover_") as tmp:
            overrides = {path: str(value) for path, value in (("transport/link/tx/lease", args.lease_ms),
                                                              ("transport/unicast/open_timeout", args.open_timeout_ms))
                         if value}
            rows = run(kill, args.robots, args.warmup, args.after, overrides, Path(tmp),
                       signal.SIGKILL if args.signal == "kill" else signal.SIGSTOP)
        victim = "A" if kill == "robots" else "B (the server's)"
        what = "kill -9" if args.signal == "kill" else "SIGSTOP"
        print(f"\n{what} of router {victim}; {args.robots} robots, half on A, half on B; the server on B; "
              f"lease {args.lease_ms or 10000} ms, open timeout {args.open_timeout_ms or 10000} ms")
        print(f"{'robot':10} {'router':6} {'period s':>9} {'longest gap s':>14} {'gap - period s':>15} "
              f"{'gap / period':>13} {'empty ticks':>12} {'chunks after':>13}")
        for r in rows:
            print(f"{r['robot']:10} {r['router'] + (' *' if r['on_killed'] else ''):6} {r['period_s']:9.3f} "
                  f"{r['longest_gap_s']:14.3f} {r['cost_s']:15.3f} {r['longest_gap_s'] / r['period_s']:13.2f} "
                  f"{r['empty_after']:12d} {r['after_kill']:13d}")
        print("(* the robot held a link to the killed router)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
