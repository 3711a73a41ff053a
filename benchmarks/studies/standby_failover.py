"""A hot standby taking over a primary killed with SIGKILL or frozen with SIGSTOP: how long the
robot goes without a chunk, side by side (docs/reliability.md, "Hot standby").

The primary and the standby are `lerobot-policy-server` processes on loopback (synthetic policy,
20 ms a pass, chunks of 30 at 30 Hz; the standby `standby_for` the primary and connected to it).
One reference `RobotClient` (the honest robot) on the simulated robot at 30 Hz is given both
endpoints. After `--warmup` seconds the primary gets the signal; the run goes on `--after` seconds.
A frozen primary keeps its liveliness token until the Zenoh lease expires (10 s by default); the
standby takes it over by its heartbeat of served work instead (server/model/failover.py).

Reported per signal: signal -> first chunk of the standby, the longest time without a chunk, the
control ticks with an empty buffer after the signal out of the ticks run, the chunks after it.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.standby_failover [--signals stop kill] \\
        [--warmup 3] [--after 8]
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import yaml

from benchmarks.common import free_port
from benchmarks.studies.router_failover import CAMS, NotingTask, _python, _wait
from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings

FPS = 30


def _manifest(app: AppKey, port: int, server_id: str, standby_for: str | None, connect: list[str]) -> dict:
    return {
        "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": server_id,
        "standby_for": standby_for, "telemetry_period_s": 0,
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "connect": connect, "multicast_scouting": False},
        "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30,
                                  "cameras": {k: list(v) for k, v in CAMS.items()}, "latency_ms": 20},
                    "fps": FPS, "accept_unknown_clients": True}],
    }


def run(sig: int, warmup_s: float, after_s: float, work: Path) -> dict:
    app = AppKey("bench", f"standby{uuid.uuid4().hex[:6]}", "syn", "v1", "sf")
    p1, p2 = free_port(), free_port()
    ep1, ep2 = f"tcp/127.0.0.1:{p1}", f"tcp/127.0.0.1:{p2}"
    (work / "primary.yaml").write_text(yaml.safe_dump(_manifest(app, p1, "gpu0", None, [])))
    (work / "standby.yaml").write_text(yaml.safe_dump(_manifest(app, p2, "gpu1", "gpu0", [ep1])))
    procs = {"primary": _python("-m", "lerobot_zenoh.cli.server", f"--manifest={work / 'primary.yaml'}",
                                log=work / "primary.log")}
    client = thread = None
    try:
        _wait(lambda: "ready" in (work / "primary.log").read_text(), 120, "the primary")
        procs["standby"] = _python("-m", "lerobot_zenoh.cli.server", f"--manifest={work / 'standby.yaml'}",
                                   log=work / "standby.log")
        _wait(lambda: "ready" in (work / "standby.log").read_text(), 120, "the standby")
        task = NotingTask()
        servers: list[tuple[float, str]] = []  # (arrival, server_id) of each chunk
        cfg = RobotClientConfig(robot=SimRobotConfig(cameras=dict(CAMS), fps=FPS), client_uuid="honest",
                                cluster_uuid=app.cluster, experiment_tag=app.experiment, model_id=app.model,
                                model_version=app.version, application_tag=app.app, endpoint=ep1,
                                zenoh=ZenohSettings(connect=[ep2], multicast_scouting=False), fps=FPS,
                                discovery_timeout_s=30, watchdog_timeout_s=0.5)
        from lerobot.robots import make_robot_from_config

        from lerobot_zenoh.protocol import codec

        mon = ZenohSession(ZenohSettings(connect=[ep2], multicast_scouting=False)).open()
        mon.subscribe(app.client("honest").action, lambda k, b: servers.append(
            (time.perf_counter(), codec.decode_action_chunk(b).server_id)))
        client = RobotClient(cfg, make_robot_from_config(cfg.robot), task=task).start()
        thread = threading.Thread(target=client.run, daemon=True)
        thread.start()
        _wait(lambda: len(task.arrivals) >= 3, 60, "the robot's first chunks")
        time.sleep(warmup_s)  # steady running before the signal
        empty0, steps0 = client.counters.empty_cycles, client.counters.steps
        t_sig = time.perf_counter()
        procs["primary"].send_signal(sig)
        time.sleep(after_s)
        empty, ticks = client.counters.empty_cycles - empty0, client.counters.steps - steps0
        mon.close()
        arrivals = np.array(task.arrivals)
        before, after = arrivals[arrivals < t_sig], arrivals[arrivals >= t_sig]
        gap = float(np.max(np.diff(np.concatenate([before[-1:], after])))) if len(after) else float("inf")
        first_standby = min((t for t, s in servers if s == "gpu1" and t >= t_sig), default=float("inf"))
        standby_log = (work / "standby.log").read_text()
        how = ("served work" if "stalled" in standby_log else "liveliness" if "is gone" in standby_log else "none")
        return {"takeover_s": first_standby - t_sig, "longest_gap_s": gap, "empty": empty,
                "ticks": ticks, "after": int(len(after)), "how": how}
    finally:
        if client is not None:
            client.stop()
            thread.join(10)
            client.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(20)
            except Exception:
                proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--signals", nargs="+", choices=("stop", "kill"), default=["stop", "kill"])
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of steady running before the signal")
    ap.add_argument("--after", type=float, default=8.0, help="seconds of running after it")
    args = ap.parse_args(argv)
    rows = []
    for name in args.signals:
        with tempfile.TemporaryDirectory(prefix="standby_failover_") as tmp:
            rows.append((name, run(signal.SIGSTOP if name == "stop" else signal.SIGKILL, args.warmup, args.after,
                                   Path(tmp))))
    print(f"\nprimary + hot standby on loopback, synthetic 20 ms policy, chunks of 30 at {FPS} Hz, one robot; "
          f"{args.after:.0f} s after the signal")
    print(f"{'signal':8} {'taken over by':14} {'signal -> standby chunk s':>26} {'longest gap s':>14} "
          f"{'empty ticks':>12} {'chunks after':>13}")
    for name, r in rows:
        print(f"{'SIGSTOP' if name == 'stop' else 'SIGKILL':8} {r['how']:14} {r['takeover_s']:26.3f} "
              f"{r['longest_gap_s']:14.3f} {r['empty']:5d} of {r['ticks']:4d} {r['after']:13d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
