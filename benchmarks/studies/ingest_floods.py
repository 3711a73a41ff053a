"""Floods of a policy server's Zenoh callbacks from client ids a peer invents (docs/security.md,
"Resource limits against a hostile client"), with a control run beside each.

Two policy servers run side by side, each in its own process (`lerobot-policy-server`), on the same
manifest: plain mode, one listed robot, `accept_unknown_clients: true`. Each serves an honest robot
(the reference `RobotClient` on the simulated robot; both robots run in this process). After
`--warmup` seconds an attacker process (no certificate: plain mode lets it put on any key) floods
ONE of the two servers; the other is the control, under the same machine load at the same time.

Scenarios:
- `long_ids`: every observation on a fresh client id of 60 kB (so a 60 kB key), synthetic policy.
- `long_tasks`: every observation from a fresh short id, valid for the model, with a task of 64 kB;
  a tiny SmolVLA (built with `lerobot-zenoh-build-checkpoint`), whose check of a task tokenizes it.

Printed per arm: the robot's control ticks with nothing to execute (empty) out of its ticks since
the attack began, the chunks it received, the server process's resident memory when the attack
began and at the end, its CPU seconds (all threads) while the robots ran after the attack began,
and what the server refused (its telemetry's `rejected.*` counts).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.ingest_floods --scenario long_ids \\
        [--seconds 40] [--warmup 8] [--port_base 7600] [--server_source DIR]

`--server_source` runs both servers from another checkout (e.g. `git archive` of an older commit)
while the robots and the attacker run this one's: a before/after pair on the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.protocol.messages import Observation  # noqa: E402

CAMS = {"front": (48, 64)}
ROBOT = "robot"
FPS = 15
CHUNK = 30
SCENARIOS = {
    "long_ids": "observations on fresh client ids of 60 kB each, synthetic policy (10 ms a pass)",
    "long_tasks": "observations from fresh short ids with a 64 kB task each, tiny SmolVLA",
}
#: Attack rates (puts per second): each is an observation that costs the attacker one put.
RATES = {"long_ids": 400.0, "long_tasks": 40.0}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (Zenoh's included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def manifest(app: AppKey, port: int, scenario: str, checkpoint: Path | None) -> dict:
    entry = {"model_id": app.model, "model_version": app.version, "application_tag": app.app, "fps": FPS,
             "clients": [{"client_uuid": ROBOT}], "accept_unknown_clients": True}
    if scenario == "long_tasks":
        entry["pretrained_path"] = str(checkpoint)
    else:
        entry["synthetic"] = {"state_dim": 6, "action_dim": 6, "chunk_size": CHUNK, "cameras": CAMS, "latency_ms": 10}
    return {"cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0",
            "telemetry_period_s": 1.0,
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "server": [entry]}


# ----------------------------------------------------------------------------- the attacker process


def attack(scenario: str, prefix: str, port: int, rate_hz: float) -> None:
    """Wait for "go" on stdin, then flood until stdin closes; print how many puts were made."""
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    jpegs = {n: codec.encode_jpeg(np.zeros((*hw, 3), np.uint8), 80) for n, hw in CAMS.items()}
    stop = threading.Event()
    sys.stdin.readline()  # "go"
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    sent, i, t0 = 0, 0, time.monotonic()
    while not stop.is_set():
        i += 1
        if scenario == "long_ids":
            client = f"{i:08d}" + "x" * 60_000
            task = "pick"
        else:
            client = f"u{uuid.uuid4().hex[:12]}"
            task = ("pick up the red cube " * 3100)[:64_000]
        obs = Observation(1, client, np.zeros(6, np.float32), jpegs, task, episode_id="e", session_nonce=i)
        session.raw.put(f"{prefix}/{client}/obs", codec.encode(obs), attachment=codec.encode_observation_header(obs))
        sent += 1
        wait = t0 + sent / rate_hz - time.monotonic()
        if wait > 0:
            stop.wait(wait)
    print(json.dumps({"sent": sent, "seconds": time.monotonic() - t0}), flush=True)
    session.close()


# ----------------------------------------------------------------------------- the study


def run(scenario: str, seconds: float, warmup_s: float, port_base: int, server_source: Path, log_dir: Path,
        checkpoint: Path | None) -> list[dict]:
    from lerobot.robots import make_robot_from_config

    from benchmarks.harness.processes import ServerProcess
    from lerobot_zenoh.client.client import RobotClient
    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings, loopback_settings

    arms = {"control": port_base, "attacked": port_base + 1}
    apps = {arm: AppKey("flood", uuid.uuid4().hex[:8], "m", "v1", "app") for arm in arms}
    watcher = ZenohSession(loopback_settings(None, listen=False, connect_ports=tuple(arms.values()))).open()
    figures: dict[str, dict] = {}

    def on_metrics(key, payload, arm):
        try:
            t = codec.decode_telemetry(bytes(payload))
        except Exception:  # noqa: BLE001 - a study: a figure missed is a figure missed
            return
        figures[arm] = dict(t.metrics)

    for arm, app in apps.items():
        watcher.subscribe(f"{app.prefix}/server/*/metrics", lambda k, p, a=arm: on_metrics(k, p, a))

    def ready(app: AppKey):
        return lambda: bool(watcher.query(app.status, timeout_s=1.0))

    servers = [ServerProcess(manifest(apps[arm], port, scenario, checkpoint), log_dir / f"{scenario}_{arm}.log",
                             ready=ready(apps[arm]), ready_timeout_s=300.0, source=server_source)
               for arm, port in arms.items()]
    attacker = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.studies.ingest_floods", "--attacker", scenario,
         "--attacker_prefix", apps["attacked"].prefix, "--attacker_port", str(arms["attacked"]),
         "--attacker_rate", str(RATES[scenario])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    clients = {}
    try:
        for s in servers:
            s.__enter__()
        for arm, app in apps.items():
            cfg = RobotClientConfig(robot=SimRobotConfig(cameras=dict(CAMS), fps=FPS), client_uuid=ROBOT,
                                    cluster_uuid=app.cluster, experiment_tag=app.experiment, model_id=app.model,
                                    model_version=app.version, application_tag=app.app, task="pick up the red cube",
                                    endpoint=f"tcp/127.0.0.1:{arms[arm]}",
                                    zenoh=ZenohSettings(multicast_scouting=False), fps=FPS)
            clients[arm] = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
        marks: dict[str, tuple] = {}
        threads = [threading.Thread(target=clients[arm].run, args=(warmup_s + seconds,)) for arm in arms]
        for t in threads:
            t.start()
        time.sleep(warmup_s)  # (a study: the robots run on their own deadlines meanwhile)
        for arm, s in zip(arms, servers):
            c = clients[arm].counters
            marks[arm] = (c.steps, c.empty_cycles, c.chunks_received, rss_mb(s.proc.pid), dict(figures.get(arm, {})),
                          cpu_s(s.proc.pid))
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        for t in threads:
            t.join()
        cpu_end = {arm: cpu_s(s.proc.pid) for arm, s in zip(arms, servers)}
        attacker.stdin.close()
        attack_report = json.loads(attacker.stdout.readline() or "{}")
        time.sleep(1.5)  # the last telemetry of each server
        rows = []
        for arm, s in zip(arms, servers):
            c = clients[arm].counters
            steps0, empty0, chunks0, rss0, fig0, cpu0 = marks[arm]
            fig = figures.get(arm, {})
            refused = {k.removeprefix("rejected."): int(v - fig0.get(k, 0)) for k, v in fig.items()
                       if k.startswith("rejected.") and v - fig0.get(k, 0)}
            rows.append({"arm": arm, "ticks": c.steps - steps0, "empty": c.empty_cycles - empty0,
                         "chunks": c.chunks_received - chunks0, "rss_before_mb": rss0, "rss_after_mb": rss_mb(s.proc.pid),
                         "refused": refused, "server_cpu_s": cpu_end[arm] - cpu0, "sessions_opened": int(fig.get("sessions_opened", 0)),
                         "attacker": attack_report if arm == "attacked" else None})
        return rows
    finally:
        for c in clients.values():
            c.close()
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        for s in servers:
            s.__exit__(None, None, None)
        watcher.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="long_ids")
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the robots run after the attack begins")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds of normal running before the attack")
    ap.add_argument("--port_base", type=int, default=7600, help="the control server listens here, the attacked one +1")
    ap.add_argument("--server_source", type=Path, default=ROOT, help="the checkout both servers run")
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/lz-ingest-floods/smolvla"),
                    help="long_tasks: a tiny SmolVLA (built here if missing)")
    ap.add_argument("--log_dir", type=Path, default=Path("/tmp/lz-ingest-floods"))
    ap.add_argument("--attacker", choices=sorted(SCENARIOS), help=argparse.SUPPRESS)
    ap.add_argument("--attacker_prefix", help=argparse.SUPPRESS)
    ap.add_argument("--attacker_port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--attacker_rate", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.attacker:
        attack(args.attacker, args.attacker_prefix, args.attacker_port, args.attacker_rate)
        return 0
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.scenario == "long_tasks" and not (args.checkpoint / "config.json").exists():
        subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.build_checkpoint", "--policy_type=smolvla",
                        f"--output={args.checkpoint}", "--state_dim=6", "--cameras=front:48x64",
                        f"--chunk_size={CHUNK}", f"--fps={FPS}"], check=True, cwd=ROOT)
    rows = run(args.scenario, args.seconds, args.warmup, args.port_base, args.server_source.resolve(), args.log_dir,
               args.checkpoint)
    print(f"{args.scenario}: {SCENARIOS[args.scenario]}; servers from {args.server_source}")
    print(f"{'arm':9s} {'empty ticks':>16s} {'chunks':>7s} {'server CPU s':>13s} {'server RSS MB':>22s}  "
          "refused (attack window)")
    for r in rows:
        print(f"{r['arm']:9s} {r['empty']:>6d} of {r['ticks']:<6d} {r['chunks']:>7d} {r['server_cpu_s']:>13.1f} "
              f"{r['rss_before_mb']:>8.0f} -> {r['rss_after_mb']:<6.0f} ({r['rss_after_mb'] - r['rss_before_mb']:+.0f})  "
              f"{r['refused'] or '-'}{'; attacker ' + json.dumps(r['attacker']) if r['attacker'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
