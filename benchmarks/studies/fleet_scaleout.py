"""Scale-out on one site over real Zenoh: robots carried by n GPUs behind one scheduler, against n
independent servers with a static assignment of robots.

Issue's metric: the largest fleet (robots doing tasks back to back) kept within the stall budget,
stalled control steps counted from each task's arrival (the wait for its first chunk included), for
1, 2 and 4 GPUs in two layouts:

- ``pooled``: one edge scheduler (`lerobot-policy-server` with `engines`: wait-ratio order, Kairos
  placement) and n engine processes of the edge tier (`role: engine`, one per GPU), each fed a batch
  of up to its capacity whenever it is (about to be) free (docs/server.md, "Engines");
- ``static``: n independent `lerobot-policy-server` processes, robot i talking to server i mod n
  only (its own Zenoh client session), as a site without a shared scheduler assigns robots.

What is real: every server and engine process, Zenoh on loopback (no shaped link: the robots' 2.5 ms
Wi-Fi would cost a user-space delay line's CPU on a shared machine), the codec, and on the robot
side the reference client's `ActionBuffer`, `SendTrigger` (p90 RTT + 1 control period) and
`ChunkIntake` (`benchmarks/studies/fleet_zenoh.py`'s `VirtualRobot`, ticking at 30 Hz over 10 phases).
What is simulated: the GPUs (a synthetic policy that SLEEPS its profile's latency for the batch
size: no compute, so the shared CPU is spent on the stack, not on models) and the tasks (every task
`--task-steps` actions (300: 10 s), chunks kept `--horizon` rows at a time (30), no images).

Profile: `--profile-ms` (default: `benchmarks/studies/hybrid.py`'s A6000-like edge profile times
`--slowdown` 2, i.e. 160 / 172 / 200 / 270 ms at batch 1 / 2 / 4 / 8, capacity 4: a GPU then carries
a handful of robots, which keeps the driver light on a shared machine).

Budget: a robot alone is measured first (one server, one robot); the budget is its stalled share
from arrival + `--budget-pct` (1 %), as "Fleet scheduling" in docs/benchmarks.md defines it (even a
robot alone stalls while its task's first chunk is computed). The search per (layout, n) starts at
`--start` robots per GPU, gallops and bisects to one robot (`benchmarks/studies/fleet.py::largest_fleet`),
each point one run of `--warmup-s` + `--measure-s`; the servers of a layout stay up through its
search (each run uses new client ids).

With `--grid` (what `make bench-hybrid-scaleout` runs) there is no search: every fleet size of the
grid (robots per GPU) runs on every seed of `--seeds`, the budget is the mean of a robot alone's
seeds + `--budget-pct`, and a layout carries the largest size whose mean stalled share is within
it, every smaller size within too. One run per point, as the search does, lands on either side of
a budget that a flat stall curve sits next to (docs/benchmarks.md, "Scale-out on one site").

    python -m benchmarks.studies.fleet_scaleout --engines 1 2 4      # needs nothing but loopback
    python -m benchmarks.studies.fleet_scaleout --engines 1 2 4 --grid 2 3 4 5 --seeds 0 1 2 --measure-s 20
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.harness.driver import deliver_chunks, driver_ticks  # noqa: E402
from benchmarks.harness.processes import stop_processes  # noqa: E402
from benchmarks.studies import fleet, fleet_zenoh, hybrid  # noqa: E402
from benchmarks.studies.fleet_traces import CHUNK_SIZE, Task  # noqa: E402

APP = fleet_zenoh.APP
SCHEDULER_PORT = 8080  # this benchmark's ports: 8080 (scheduler), 8081.. (engines), 8090.. (static servers)
ENGINE_PORT, STATIC_PORT = 8081, 8090
CAPACITY = hybrid.EDGE_CAPACITY
LAYOUTS = ("pooled", "static")


def profile_ms(slowdown: float) -> dict[int, float]:
    return {b: ms * slowdown for b, ms in hybrid.EDGE_PROFILE_MS.items()}


def _entry(profile: dict) -> dict:
    cfg = fleet_zenoh.RunConfig(scheduler="wait_ratio", max_batch=str(CAPACITY))
    base = fleet_zenoh.manifest(cfg, 0)
    entry = base["server"][0]
    entry["synthetic"]["batch_latency_ms"] = {int(b): float(ms) for b, ms in profile.items()}
    return entry


def manifests(layout: str, n: int, profile: dict) -> list[tuple[str, dict]]:
    """(name, manifest) of every process of a layout, engines before their scheduler."""
    common = {"cluster_uuid": APP.cluster, "experiment_tag": APP.experiment, "telemetry_period_s": 0,
              "sessions": {"idle_timeout_s": 5, "liveliness_grace_s": 1}}
    zenoh = lambda port: {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}  # noqa: E731
    if layout == "static":
        return [(f"server{i}", {**common, "server_id": f"server{i}", "zenoh": zenoh(STATIC_PORT + i),
                                "server": [_entry(profile)]}) for i in range(n)]
    out = [(f"gpu{i}", {**common, "role": "engine", "engine_id": f"gpu{i}", "zenoh": zenoh(ENGINE_PORT + i),
                        "server": [_entry(profile)]}) for i in range(n)]
    engines = [{"engine_id": f"gpu{i}", "tier": "edge", "capacity": CAPACITY,
                "endpoint": f"tcp/127.0.0.1:{ENGINE_PORT + i}", "profile": dict(profile)} for i in range(n)]
    out.append(("scheduler", {**common, "server_id": "scheduler", "zenoh": zenoh(SCHEDULER_PORT),
                              "server": [{**_entry(profile), "engines": engines,
                                          "dispatch": {"start_timeout_s": 60}}]}))
    return out


def endpoints(layout: str, n: int) -> list[str]:
    if layout == "static":
        return [f"tcp/127.0.0.1:{STATIC_PORT + i}" for i in range(n)]
    return [f"tcp/127.0.0.1:{SCHEDULER_PORT}"]


class Site:
    """The processes of one layout, up for its whole search."""

    def __init__(self, layout: str, n: int, profile: dict, work: Path):
        self.layout, self.n, self.profile, self.work = layout, n, profile, work
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Site:
        import yaml

        env = hybrid._env()
        for name, data in manifests(self.layout, self.n, self.profile):
            path = self.work / f"{self.layout}{self.n}-{name}.yaml"
            path.write_text(yaml.safe_dump(data))
            log = open(self.work / f"{self.layout}{self.n}-{name}.log", "w")  # noqa: SIM115 - the process owns it
            self.procs.append(subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.server", f"--manifest={path}",
                                                "--log_level=WARNING"], stdout=log, stderr=subprocess.STDOUT, env=env,
                                               cwd=ROOT))
            if name == f"gpu{self.n - 1}":
                time.sleep(2.0)  # the engines answer their status before the scheduler checks them
        return self

    def __exit__(self, *exc) -> None:
        stop_processes(self.procs, sig=signal.SIGTERM)


def drive(eps: list[str], robots: int, tag: str, warmup_s: float, measure_s: float, task: Task, seed: int,
          trigger: str = "rtt") -> dict:
    """`robots` robots doing `task` back to back, robot i on endpoint i mod len(eps); the stalled
    share over the measurement window (from arrival and mid-task), actions/s and the tick lateness."""
    import numpy as np

    from lerobot_zenoh.errors import TransportError
    from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings

    rng = np.random.default_rng(seed)
    sessions = []
    deadline = time.monotonic() + 120
    for ep in eps:
        while True:
            try:
                session = ZenohSession(ZenohSettings(mode="client", connect=[ep], multicast_scouting=False,
                                                     connect_timeout_s=5)).open()
                break
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        while not session.query(APP.status, timeout_s=1.0):
            if time.monotonic() > deadline:
                raise SystemExit(f"{ep} never answered its status")
        sessions.append(session)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    for session in sessions:
        session.subscribe(f"{APP.prefix}/*/action", lambda key, payload: inbox.put((key, payload, time.perf_counter())))
    cfg = fleet_zenoh.RunConfig(trigger=trigger, horizon="static")
    fleet_robots = []
    for i in range(robots):
        cid = f"{tag}-{i:03d}"
        fleet_robots.append(fleet_zenoh.VirtualRobot(cid, cfg, sessions[i % len(sessions)].publisher(
            APP.client(cid).obs, OBSERVATION_QOS), phase=i % fleet_zenoh.PHASES))
    by_id = {r.client_id: r for r in fleet_robots}
    groups = [[r for r in fleet_robots if r.phase == p] for p in range(fleet_zenoh.PHASES)]
    c = fleet_zenoh.Counters()
    time.sleep(0.5)  # the subscriptions reach the servers before the first observation
    t0 = time.perf_counter()
    w0, w1 = t0 + warmup_s, t0 + warmup_s + measure_s
    pending = sorted(zip(rng.uniform(0, 1.0, size=robots), range(robots)), reverse=True)
    period = fleet_zenoh.DT_S / fleet_zenoh.PHASES
    lateness: list[float] = []
    for i, now, c.counting in driver_ticks(t0, period, w0, w1, lateness):
        deliver_chunks(inbox, by_id, c)
        while pending and now >= t0 + pending[-1][0]:
            fleet_robots[pending.pop()[1]].start_task(task, now, c.counting)
        for robot in groups[i % fleet_zenoh.PHASES]:
            if robot.tick(now, c):
                robot.start_task(task, now + fleet_zenoh.DT_S, c.counting)
    for session in sessions:
        session.close()
    total = c.executed + c.stalled + c.first_wait
    lateness.sort()
    return {"robots": robots, "actions_per_s": c.executed / measure_s,
            "stalled_arrival_pct": 100 * (c.stalled + c.first_wait) / total if total else 100.0,
            "stalled_pct": 100 * c.stalled / (c.executed + c.stalled) if c.executed + c.stalled else 100.0,
            "rtt_ms_p50": 1000 * statistics.median(c.rtts_s) if c.rtts_s else None,
            "tasks": len(c.latencies_s), "tick_late_ms_p99": 1000 * lateness[int(0.99 * (len(lateness) - 1))] if lateness else None}


def search(site_eps: list[str], n: int, budget: float, args, task: Task, log) -> tuple[str, dict]:
    """The largest fleet within `budget` % stalled from arrival, to one robot; every point run."""
    points: dict[int, dict] = {}

    class _R:  # `fleet.largest_fleet` reads one attribute of a result
        def __init__(self, row):
            self.stalled_arrival_pct = row["stalled_arrival_pct"]

    def at(robots: int):
        for attempt in range(2):  # a point measured while the driver itself was starved is taken again, once
            if robots in points:
                break
            row = drive(site_eps, robots, f"n{n}r{robots}t{int(time.time()) % 100000}a{attempt}", args.warmup_s,
                        args.measure_s, task, args.seed, args.trigger)
            log(json.dumps({"engines": n, **row}))
            if attempt or (row["tick_late_ms_p99"] or 0.0) <= args.max_late_ms:
                points[robots] = row
        return _R(points[robots])

    found = fleet.largest_fleet(at, "stalled_arrival_pct", budget, limit=args.max_robots, start=args.start * n)
    return found, points


def grid(args, profile: dict, task: Task, work: Path, log) -> int:
    """Every fleet size of `args.grid` (per GPU) on every seed, both layouts: the stalled share's
    mean and spread per size, so that the boundary is read off a curve rather than one noisy run."""

    def run(eps: list[str], robots: int, seed: int, tag: str) -> dict:
        row = drive(eps, robots, f"{tag}t{int(time.time()) % 100000}", args.warmup_s, args.measure_s, task, seed,
                    args.trigger)
        log(json.dumps({"seed": seed, **row}))
        return row

    with Site("static", 1, profile, work):
        alone = [run(endpoints("static", 1), 1, seed, f"alone{seed}") for seed in args.seeds]
    alone_pct = statistics.mean(r["stalled_arrival_pct"] for r in alone)
    budget = alone_pct + args.budget_pct
    rows = []
    for n in args.engines:
        for layout in args.layouts:
            with Site(layout, n, profile, work):
                for per_gpu in args.grid:
                    runs = [run(endpoints(layout, n), per_gpu * n, seed, f"{layout[0]}{n}r{per_gpu * n}s{seed}")
                            for seed in args.seeds]
                    pcts = [r["stalled_arrival_pct"] for r in runs]
                    rows.append({"engines": n, "layout": layout, "robots": per_gpu * n, "runs": runs,
                                 "mean": statistics.mean(pcts), "sd": statistics.stdev(pcts) if len(pcts) > 1 else 0.0,
                                 "rtt_ms_p50": statistics.median(r["rtt_ms_p50"] for r in runs if r["rtt_ms_p50"]),
                                 "actions_per_s": statistics.mean(r["actions_per_s"] for r in runs)})
    (work / "scaleout_grid.json").write_text(json.dumps(
        {"args": vars(args), "profile_ms": profile, "alone": alone, "budget_pct": budget, "rows": rows},
        indent=1, default=str))
    print(f"Profile (ms by batch size) {profile}, capacity {CAPACITY} per GPU; send rule {args.trigger}; tasks of "
          f"{args.task_steps} actions, {args.horizon} kept per chunk; seeds {args.seeds}, each point one run of "
          f"{args.measure_s:g} s after {args.warmup_s:g} s. A robot alone stalls {alone_pct:.2f} % from arrival "
          f"(mean of the seeds), so the budget is {budget:.2f} %.\n")
    print("| GPUs | layout | robots | stalled % from arrival, mean ± sd | per seed | actions/s | RTT p50 ms |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        per_seed = " / ".join(f"{x['stalled_arrival_pct']:.2f}" for x in r["runs"])
        mark = "**" if r["mean"] > budget else ""
        print(f"| {r['engines']} | {r['layout']} | {r['robots']} | {mark}{r['mean']:.2f} ± {r['sd']:.2f}{mark} | "
              f"{per_seed} | {r['actions_per_s']:.0f} | {r['rtt_ms_p50']:.0f} |")
    print("\n| GPUs | layout | robots carried (largest size within the budget, every smaller one within too) |\n|---|---|---|")
    for n in args.engines:
        for layout in args.layouts:
            carried = 0
            for r in sorted((r for r in rows if r["engines"] == n and r["layout"] == layout), key=lambda r: r["robots"]):
                if r["mean"] > budget:
                    break
                carried = r["robots"]
            print(f"| {n} | {layout} | {carried if carried else '< ' + str(min(args.grid) * n)} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4], help="GPUs per site")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--slowdown", type=float, default=2.0, help="the edge profile's times multiplied by this")
    p.add_argument("--profile-ms", type=json.loads, help='instead: {batch size: ms}, e.g. \'{"1": 160, "4": 200}\'')
    p.add_argument("--task-steps", type=int, default=300, help="actions per task (30 Hz)")
    p.add_argument("--horizon", type=int, default=30, help="actions kept from each chunk")
    p.add_argument("--trigger", default="rtt",
                   help="the robots' send rule: rtt (the reference client's p90 RTT + 1 period) or rtt:Q (quantile Q)")
    p.add_argument("--budget-pct", type=float, default=1.0, help="stalled share allowed above a robot alone")
    p.add_argument("--start", type=int, default=6, help="the search's first guess, robots per GPU")
    p.add_argument("--max-robots", type=int, default=64)
    p.add_argument("--max-late-ms", type=float, default=33.3,
                   help="a point whose driver ticks were later than this at p99 is run again, once")
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--measure-s", type=float, default=12.0)
    p.add_argument("--seed", type=int, default=0, help="robots' start offsets")
    p.add_argument("--grid", type=int, nargs="+",
                   help="instead of the search: run these fleet sizes (robots per GPU, times the GPUs) for every seed "
                        "of --seeds, and carry the largest size whose mean stalled share is within the budget")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="with --grid: the seeds of each point")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "lz_scaleout"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the site's processes on the way out
    profile = ({int(b): float(v) for b, v in args.profile_ms.items()} if args.profile_ms else profile_ms(args.slowdown))
    task = Task(static_h=args.horizon, length=args.task_steps,
                rounds=(args.horizon,) * math.ceil(args.task_steps / args.horizon))
    if args.horizon > CHUNK_SIZE:
        p.error(f"--horizon must be <= the chunk size {CHUNK_SIZE}")
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.grid:
        return grid(args, profile, task, work, log)
    with Site("static", 1, profile, work) as site:
        alone = drive(endpoints("static", 1), 1, f"alone{int(time.time()) % 100000}", args.warmup_s,
                      args.measure_s, task, args.seed, args.trigger)
        log(json.dumps({"alone": alone}))
        del site
    budget = alone["stalled_arrival_pct"] + args.budget_pct
    rows = []
    for n in args.engines:
        for layout in args.layouts:
            with Site(layout, n, profile, work):
                found, points = search(endpoints(layout, n), n, budget, args, task, log)
            best = points.get(int(found.removeprefix(">= ")), {})
            rows.append({"engines": n, "layout": layout, "robots": found, "at": best, "points": points})
    result = {"args": vars(args), "profile_ms": profile, "alone": alone, "budget_pct": budget, "rows": rows}
    (work / "scaleout.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"Profile (ms by batch size) {profile}, capacity {CAPACITY} per GPU; send rule {args.trigger}; tasks of {args.task_steps} actions, "
          f"{args.horizon} kept per chunk; a robot alone stalls {alone['stalled_arrival_pct']:.2f} % from arrival, so "
          f"the budget is {budget:.2f} %; each point one run of {args.measure_s:g} s after {args.warmup_s:g} s.\n")
    print("| GPUs | layout | robots carried | stalled % from arrival there | actions/s | RTT p50 ms | driver tick late p99 ms |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        a = r["at"]
        print(f"| {r['engines']} | {r['layout']} | {r['robots']} | {a.get('stalled_arrival_pct', float('nan')):.2f} | "
              f"{a.get('actions_per_s', 0):.0f} | {a.get('rtt_ms_p50') or float('nan'):.0f} | "
              f"{a.get('tick_late_ms_p99') or float('nan'):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
