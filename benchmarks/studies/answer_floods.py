"""Floods of an edge scheduler's engine answer key (docs/security.md, "Engine answer floods"), with a
control beside it.

Two edge schedulers run side by side, each in its own process (`lerobot-policy-server`) with one
remote engine process of its own (`role: engine`, synthetic policy, 10 ms a pass): plain mode, so
any peer can put on an engine's answer key. Each scheduler serves an honest robot (the reference
`RobotClient` on the simulated robot; both robots run in this process) whose every request goes to
its engine and back through that key. After `--warmup` seconds an attacker process (no
certificate) puts `--answers` made-up engine answers at `--rate` per second on the answer key of
ONE scheduler's engine; the other is the control, under the same machine load at the same time.

The attacker first reads one request on the engine's dispatch key (plain mode lets it), so its
answers carry the scheduler process's real `edge_incarnation` and engine id, with request ids the
scheduler never sent (`--forge stale`: a made-up incarnation instead). What plain mode still cannot
stop, an answer naming a request really in flight, is not measured here (docs/security.md).

Printed per arm: the robot's control ticks with nothing to execute (empty) out of its ticks since the
attack began, the chunks it received, its round trip p50/p99 over the attack window, the
scheduler's CPU seconds, and what the scheduler counted for the flooded engine (`engine.*.refused.*`,
`late`, `answers_dropped_full`).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.answer_floods [--answers 100000] \\
        [--rate 10000] [--seconds 20] [--warmup 8] [--port_base 7620] [--server_source DIR]

`--server_source` runs the four servers from another checkout (e.g. `git archive` of an older commit)
while the robots and the attacker run this one's: a before/after pair on the same script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.studies.ingest_floods import cpu_s  # noqa: E402
from lerobot_zenoh.protocol import dispatch  # noqa: E402
from lerobot_zenoh.protocol.dispatch import EngineAnswer, EngineKeys  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402

CAMS = {"front": (48, 64)}
ROBOT = "robot"
FPS = 15
CHUNK = 30
#: Actions the robot gets per chunk: a request every 0.4 s at 15 fps, so a run has round trips to count.
ACTIONS_PER_CHUNK = 6
ENGINE = "cloud0"


def manifests(app: AppKey, port: int, engine_port: int) -> tuple[dict, dict]:
    """(the scheduler's, its engine's)."""
    def entry(**extra) -> dict:
        return {"model_id": app.model, "model_version": app.version, "application_tag": app.app, "fps": FPS,
                "clients": [{"client_uuid": ROBOT}],
                "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": CHUNK, "cameras": CAMS, "latency_ms": 10},
                "actions_per_chunk": ACTIONS_PER_CHUNK, **extra}

    def top(server_id: str, listen: int, **extra) -> dict:
        return {"cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": server_id,
                "telemetry_period_s": 1.0, "zenoh": {"listen": [f"tcp/127.0.0.1:{listen}"], "multicast_scouting": False},
                **extra}

    edge = top("edge0", port, server=[entry(engines=[
        {"engine_id": ENGINE, "tier": "edge", "capacity": 2, "endpoint": f"tcp/127.0.0.1:{engine_port}",
         "profile": "measured"}])])
    engine = top("engine0", engine_port, role="engine", engine_id=ENGINE, server=[entry()])
    return edge, engine


# ----------------------------------------------------------------------------- the attacker process


def attack(prefix_json: str, port: int, answers: int, rate_hz: float, forge: str) -> None:
    """Learn the scheduler's incarnation from one dispatch, wait for "go" on stdin, then put `answers`
    made-up answers at `rate_hz`; print how many were put and how long it took."""
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    app = AppKey(**json.loads(prefix_json))
    keys = EngineKeys(app, ENGINE)
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    seen: list[str] = []
    session.subscribe(keys.dispatch, lambda key, payload: seen.append(dispatch.decode(bytes(payload)).edge_incarnation)
                      if not seen else None)
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    incarnation = seen[0] if (seen and forge == "incarnation") else "made-up"
    actions = np.zeros((CHUNK, 6), np.float32)
    put = session.raw.put
    sys.stdin.readline()  # "go"
    t0 = time.monotonic()
    sent = 0
    while sent < answers:
        payload = dispatch.encode(EngineAnswer(10**9 + sent, ENGINE, "forged", app.model, app.version, incarnation,
                                               ROBOT, sent, actions=actions, inference_ms=1.0))
        put(keys.answer, payload)
        sent += 1
        wait = t0 + sent / rate_hz - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    print(json.dumps({"sent": sent, "seconds": round(time.monotonic() - t0, 2), "learned_incarnation": bool(seen)}),
          flush=True)
    session.close()


# ----------------------------------------------------------------------------- the study


def run(answers: int, rate_hz: float, seconds: float, warmup_s: float, port_base: int, server_source: Path,
        log_dir: Path, forge: str) -> list[dict]:
    from lerobot.robots import make_robot_from_config

    from benchmarks.harness.processes import ServerProcess
    from lerobot_zenoh.client.client import RobotClient
    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings, loopback_settings

    arms = {"control": port_base, "attacked": port_base + 2}  # scheduler port; its engine's is +1
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
        watcher.subscribe(app.server_metrics("edge0"), lambda k, p, a=arm: on_metrics(k, p, a))

    def ready(app: AppKey):
        return lambda: bool(watcher.query(app.status, timeout_s=1.0))

    servers = []
    for arm, port in arms.items():
        edge, engine = manifests(apps[arm], port, port + 1)
        servers.append(ServerProcess(engine, log_dir / f"{arm}_engine.log", source=server_source))
        servers.append(ServerProcess(edge, log_dir / f"{arm}_edge.log", ready=ready(apps[arm]), ready_timeout_s=120.0,
                                     source=server_source))
    edges = {"control": servers[1], "attacked": servers[3]}
    a = apps["attacked"]
    attacker = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.studies.answer_floods", "--attacker",
         json.dumps({"cluster": a.cluster, "experiment": a.experiment, "model": a.model, "version": a.version,
                     "app": a.app}),
         "--attacker_port", str(arms["attacked"]), "--answers", str(answers), "--rate", str(rate_hz), "--forge", forge],
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
        threads = [threading.Thread(target=clients[arm].run, args=(warmup_s + seconds,)) for arm in arms]
        for t in threads:
            t.start()
        time.sleep(warmup_s)  # (a study: the robots run on their own deadlines meanwhile)
        marks = {}
        for arm in arms:
            c = clients[arm].counters
            marks[arm] = (c.steps, c.empty_cycles, c.chunks_received, dict(figures.get(arm, {})),
                          cpu_s(edges[arm].proc.pid))
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        for t in threads:
            t.join()
        cpu_end = {arm: cpu_s(edges[arm].proc.pid) for arm in arms}
        attack_report = json.loads(attacker.stdout.readline() or "{}")
        time.sleep(2.5)  # the last telemetry of each scheduler
        rows = []
        for arm in arms:
            c = clients[arm].counters
            steps0, empty0, chunks0, fig0, cpu0 = marks[arm]
            fig = figures.get(arm, {})
            prefix = f"engine.{ENGINE}."
            counted = {k.removeprefix(prefix): int(v - fig0.get(k, 0)) for k, v in fig.items()
                       if k.startswith(prefix) and (".refused." in k or k.endswith((".late", ".answers_dropped_full")))
                       and v - fig0.get(k, 0)}
            chunks = c.chunks_received - chunks0
            rtts = sorted(list(c.rtt_ms)[-chunks:]) if chunks > 0 else []
            rows.append({"arm": arm, "ticks": c.steps - steps0, "empty": c.empty_cycles - empty0, "chunks": chunks,
                         "rtt_ms_p50": float(np.percentile(rtts, 50)) if rtts else None,
                         "rtt_ms_p99": float(np.percentile(rtts, 99)) if rtts else None,
                         "answered": int(fig.get(prefix + "answered", 0) - fig0.get(prefix + "answered", 0)),
                         "server_cpu_s": cpu_end[arm] - cpu0, "counted": counted,
                         "attacker": attack_report if arm == "attacked" else None})
        return rows
    finally:
        for c in clients.values():
            c.close()
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        for s in reversed(servers):
            s.__exit__(None, None, None)
        watcher.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=100_000, help="made-up answers the attacker puts")
    ap.add_argument("--rate", type=float, default=10_000.0, help="answers per second")
    ap.add_argument("--forge", choices=("incarnation", "stale"), default="incarnation",
                    help="incarnation: the scheduler's own (read on the dispatch key); stale: a made-up one")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the robots run after the attack begins")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds of normal running before the attack")
    ap.add_argument("--port_base", type=int, default=7620, help="control scheduler here (+1 its engine), attacked +2, +3")
    ap.add_argument("--server_source", type=Path, default=ROOT, help="the checkout the four servers run")
    ap.add_argument("--log_dir", type=Path, default=Path("/tmp/lz-answer-floods"))
    ap.add_argument("--attacker", help=argparse.SUPPRESS)
    ap.add_argument("--attacker_port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.attacker:
        attack(args.attacker, args.attacker_port, args.answers, args.rate, args.forge)
        return 0
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows = run(args.answers, args.rate, args.seconds, args.warmup, args.port_base, args.server_source.resolve(),
               args.log_dir, args.forge)
    print(f"engine answer floods: {args.answers} made-up answers at {args.rate:g}/s ({args.forge}); "
          f"servers from {args.server_source}")
    print(f"{'arm':9s} {'empty ticks':>16s} {'chunks':>7s} {'rtt p50/p99 ms':>15s} {'sched. CPU s':>13s}  counted (attack window)")
    for r in rows:
        rtt = "-" if r["rtt_ms_p99"] is None else f"{r['rtt_ms_p50']:.0f} / {r['rtt_ms_p99']:.0f}"
        print(f"{r['arm']:9s} {r['empty']:>6d} of {r['ticks']:<6d} {r['chunks']:>7d} {rtt:>15s} {r['server_cpu_s']:>13.1f}  "
              f"{r['counted'] or '-'}{'; attacker ' + json.dumps(r['attacker']) if r['attacker'] else ''}")
    control, attacked = rows
    if control["rtt_ms_p99"] and attacked["rtt_ms_p99"]:
        print(f"attacked / control: empty ticks {attacked['empty']} vs {control['empty']}, chunks "
              f"{attacked['chunks'] / max(control['chunks'], 1):.3f}, rtt p99 {attacked['rtt_ms_p99'] / control['rtt_ms_p99']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
