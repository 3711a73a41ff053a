"""Rosa's workloads run on the real stack: planned fleet vs shared servers vs dedicated servers, measured.

    PYTHONPATH=. python -m benchmarks.studies.pipelines_run [--workloads P4 Mix2] [--sizes 8 16] [--seeds 3]
        [--scale 2] [--seconds 15] [--json outputs/pipelines_run.jsonl] [--write-docs docs/studies/pipelines.md]
    PYTHONPATH=. python -m benchmarks.studies.pipelines_run --report outputs/pipelines_run.jsonl [--write-docs ...]

For one workload (benchmarks/studies/pipelines_plan.py: P1-P4, Mix2, Mix4 of Rosa's Tables 1-2), a fleet size
and a deployment, every run:

1. builds the factory (8 servers of synthetic GPU-like components) and its deployment with the
   project's own code: `planner.plan` for *planned*; for the baselines a `Plan` assembled here the way
   benchmarks/studies/pipelines_plan.py describes them, then written by the same `deployment.write_deployment`:
     shared     Rosa's baseline 3: the servers split equally across the component kinds (the
                remainder to System 1), System 1 at batch 1, the VLMs at their batching cap, each
                kind's robots dealt evenly over its servers (round robin), no rate cap below the
                zero-latency bound 1 / t_act;
     dedicated  Rosa's baseline 2 (the better dedicated variant in the model; one server per robot
                with its components taking turns is not a deployment the generator writes): one
                server per component of a robot while servers last (robots dealt over the task
                classes in turn), the other robots unserved; no rate cap below 1 / t_act;
     planned-uncapped  (a diagnostic, `--deployments planned-uncapped`) the planner's placement,
                batching and routing with the robots capped at 1 / t_act instead of the planned rate;
2. starts the deployment's router and every server as written (`python -m lerobot_zenoh.cli.router`,
   `python -m lerobot_zenoh.cli.server --manifest=manifests/srvN.yaml`, one process each: what
   servers.sh runs; servers and robots connect to the router in client mode), synthetic components
   sleeping the profile's batch latency (`batch_latency_ms`, linear in the batch size as
   `profiles.ROSA_SERVICE`: System 1 40 + 7 (b - 1) ms, Qwen-VL-7B-like 600 + 6 (b - 1), 3B-like
   150 + 2 (b - 1)), every time (latencies, t_act, SLO deadlines, 1 / rates) multiplied by --scale;
3. runs the robots: the real `PipelineClient` of each robot from plan.json (`load_robot_plan`,
   `configure`, the sim robot), several per process (--robot-procs processes), exactly as clients.sh
   would (`--send.max_in_flight=1`, System 1 capped at the plan's rate);
4. reads each robot's own SLO counters (`PipelineClient.pipeline_figures()`, the figures of its
   telemetry) at the start and end of a --seconds window after --warmup.

**SLO-qualified action throughput** (chunks per second of the fleet, Rosa's action rate): the System 1
chunks of the window whose request met System 1's deadline (`slo.<s1>.met`), counted for a robot only
when each of its other components met its SLO over the window (met / (met + missed) at least the
SLO's percentile; with p99 and a few requests per window: none missed). Printed beside each
measurement: the model's prediction for the same configuration (benchmarks/studies/pipelines_plan.py's
evaluation, on the same scaled profiles).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from testbed.ports import free_port_range  # noqa: E402
from benchmarks.harness.docs_blocks import write_docs_block  # noqa: E402
from benchmarks.harness.processes import stop_processes  # noqa: E402
from benchmarks.studies.pipelines_plan import (  # noqa: E402
    S1,
    TASKS,
    VLM3,
    VLM7,
    WORKLOADS,
    _robot_order,
    dedicated_per_model,
    shared,
)
from lerobot_zenoh.pipelines.descriptor import OBLIGATION_KINDS, Factory, parse_factory  # noqa: E402
from lerobot_zenoh.pipelines.profiles import (  # noqa: E402
    ROSA_SERVICE,
    Profiles,
    ServiceModel,
    stat_of,
    synthetic_profile,
)

KINDS = ("system1", "system2", "safety", "monitor")
MODEL_IDS = {S1: "gr00t", VLM7: "qwen7b", VLM3: "qwen3b"}
#: Rosa's reported ratios of SLO-qualified action throughput (docs/benchmarks.md): planned over shared servers,
#: planned over one dedicated server per robot.
ROSA_SHARED, ROSA_DEDICATED = 2.44, 12.06


# -- the factory, scaled -----------------------------------------------------------------------------

def scaled_profiles(scale: float) -> Profiles:
    """rosa_profiles() with every time multiplied by `scale` (rates divided by it)."""
    return Profiles(hardware="synthetic-H200", models={
        name: synthetic_profile(ServiceModel(svc.base_ms * scale, svc.per_item_ms * scale), sizes, batching)
        for name, (svc, sizes, batching) in ROSA_SERVICE.items()})


def batch_latency_ms(model: str, scale: float) -> dict[int, float]:
    """The synthetic runner's sleep per batch: linear between batch 1 and the largest profiled batch."""
    svc, sizes, _ = ROSA_SERVICE[model]
    top = max(sizes)
    return {1: round(svc.base_ms * scale, 3), top: round(svc.service_ms(top) * scale, 3)}


def factory_doc(workload: str, robots: int, servers: int, scale: float, *, fps: int, port_base: int,
                tag: str, camera: tuple[int, int]) -> dict:
    classes = WORKLOADS[workload]
    tasks = {}
    for t in classes:
        comps = copy.deepcopy(TASKS[t])
        for c in comps.values():
            c["slo"]["deadline_ms"] = c["slo"]["deadline_ms"] * scale
            if isinstance(c["invocation"], dict) and "rate_hz" in c["invocation"]:
                c["invocation"]["rate_hz"] = c["invocation"]["rate_hz"] / scale
        tasks[t] = {"action_period_ms": 200 * scale, "components": comps}
    cams = {"front": list(camera)}
    models = {m: {"model_id": MODEL_IDS[m], "fps": fps,
                  "synthetic": {"batch_latency_ms": batch_latency_ms(m, scale), "chunk_size": 50, "cameras": cams}}
              for m in (S1, VLM7, VLM3)}
    return {"cluster_uuid": "rosa", "experiment_tag": tag,
            "servers": {"count": servers, "hardware": "synthetic-H200", "host": "127.0.0.1", "port_base": port_base,
                        "device": "cpu"},
            "models": models, "tasks": tasks,
            "fleet": [{"task": t, "robots": robots // len(classes), "robot_type": "zenoh_sim"} for t in classes]}


# -- the baselines as plans (written by the deployment code) -----------------------------------------

def _stream(factory: Factory, task: str, cname: str, robots: int, rate_hz: float):
    from lerobot_zenoh.pipelines.planner import Stream

    comp = factory.tasks[task].components[cname]
    return Stream(task, cname, comp.kind, comp.model, robots, rate_hz, stat_of(comp.slo.percentile),
                  comp.slo.deadline_ms)


def _rate(factory: Factory, task: str, cname: str, f: float) -> float:
    comp = factory.tasks[task].components[cname]
    if comp.kind == "system1":
        return f
    if comp.kind == "system2":
        return f / comp.invocation.every_n_chunks
    return comp.invocation.rate_hz


def _baseline_batch(kind: str, profiles: Profiles, model: str) -> int:
    sizes = profiles.get(model).batch_sizes()
    return min(sizes) if kind == "system1" else max(sizes)


def shared_plan(factory: Factory, profiles: Profiles):
    """Baseline 3 as a Plan: servers split equally across kinds, robots dealt evenly, rate 1 / t_act."""
    from lerobot_zenoh.pipelines.planner import Plan, ServerPlan, Share, f_upper, route

    kinds = [k for k in KINDS if any(t.component(k) for t in factory.tasks.values())]
    n = factory.servers.count
    count = {k: n // len(kinds) for k in kinds}
    count["system1"] += n - sum(count.values())
    rates = {c.task: f_upper(factory.tasks[c.task]) for c in factory.fleet}
    servers = []
    for kind in kinds:
        users = [(c, factory.tasks[c.task].component(kind)) for c in factory.fleet if factory.tasks[c.task].component(kind)]
        model = users[0][1][1].model
        group = [ServerPlan(-1, model, "obligation" if kind in OBLIGATION_KINDS else "goal",
                            _baseline_batch(kind, profiles, model), []) for _ in range(count[kind])]
        turn = 0
        for cls_, (cname, _comp) in users:
            per = [0] * len(group)
            for _ in range(cls_.robots):  # round robin over the kind's servers, across classes
                per[turn % len(group)] += 1
                turn += 1
            st = _stream(factory, cls_.task, cname, cls_.robots, _rate(factory, cls_.task, cname, rates[cls_.task]))
            for s, k in zip(group, per):
                if k:
                    s.shares.append(Share(st, k))
        servers += group
    for i, s in enumerate(servers):
        s.index = i
    routing, robot_task = route(factory, servers)
    total = sum(c.robots * rates[c.task] for c in factory.fleet)
    return Plan(servers, rates, routing, robot_task, total, total, 0.0, 0)


def dedicated_plan(factory: Factory, profiles: Profiles):
    """Baseline 2 as a Plan: a server per component of each robot while servers last; rate 1 / t_act."""
    from lerobot_zenoh.pipelines.planner import (
        Plan,
        ServerPlan,
        Share,
        f_upper,
        robot_ids,
    )

    rates = {c.task: f_upper(factory.tasks[c.task]) for c in factory.fleet}
    next_id = {c.task: 0 for c in factory.fleet}
    servers, routing, robot_task = [], {}, {}
    for task in _robot_order(factory):
        if len(task.components) > factory.servers.count - len(servers):
            break
        rid = robot_ids(task.name, next_id[task.name] + 1)[-1]
        next_id[task.name] += 1
        routing[rid], robot_task[rid] = {}, task.name
        for cname, comp in task.components.items():
            st = _stream(factory, task.name, cname, 1, _rate(factory, task.name, cname, rates[task.name]))
            s = ServerPlan(len(servers), comp.model, "obligation" if comp.kind in OBLIGATION_KINDS else "goal",
                           _baseline_batch(comp.kind, profiles, comp.model), [Share(st, 1, [rid])])
            servers.append(s)
            routing[rid][cname] = s.index
    total = sum(rates[t] for t in robot_task.values())
    return Plan(servers, rates, routing, robot_task, total, total, 0.0, 0)


def uncapped(the_plan, factory: Factory):
    """A diagnostic: the planner's placement, batching and routing, its robots capped at 1 / t_act only."""
    from lerobot_zenoh.pipelines.planner import f_upper

    the_plan.rates_hz = {c.task: f_upper(factory.tasks[c.task]) for c in factory.fleet}
    return the_plan


def predicted(deployment: str, factory: Factory, profiles: Profiles) -> float:
    """benchmarks/studies/pipelines_plan.py's evaluation of the same configuration (chunks/s)."""
    from lerobot_zenoh.pipelines.planner import Infeasible, plan

    if deployment.startswith("planned"):
        try:
            return plan(factory, profiles).throughput_hz
        except Infeasible:
            return 0.0
    return shared(factory, profiles) if deployment == "shared" else dedicated_per_model(factory, profiles)


# -- one run -----------------------------------------------------------------------------------------

def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "HF_HUB_OFFLINE": "1"}


def run_one(workload: str, robots: int, deployment: str, *, servers: int = 8, scale: float = 2.0, fps: int = 10,
            warmup_s: float = 6.0, seconds: float = 20.0, robot_procs: int = 2, camera=(24, 32), seed: int = 0,
            workdir: Path | None = None, start_delay_s: float | None = None) -> dict:
    from lerobot_zenoh.pipelines.deployment import write_deployment
    from lerobot_zenoh.pipelines.planner import plan

    random.seed(seed * 7919 + robots)
    tag = f"{workload.lower()}{robots}{deployment[:3]}s{seed}p{os.getpid()}"
    data = factory_doc(workload, robots, servers, scale, fps=fps, port_base=free_port_range(servers), tag=tag,
                       camera=camera)
    factory = parse_factory(data)
    profiles = scaled_profiles(scale)
    the_plan = {"planned": lambda: plan(factory, profiles), "shared": lambda: shared_plan(factory, profiles),
                "dedicated": lambda: dedicated_plan(factory, profiles),
                "planned-uncapped": lambda: uncapped(plan(factory, profiles), factory)}[deployment]()
    tmp = tempfile.TemporaryDirectory(prefix="lz-rosa-") if workdir is None else None
    out = write_deployment(factory, the_plan, Path(tmp.name if tmp else workdir) / tag)
    used = sorted({i for routes in the_plan.routing.values() for i in routes.values()})
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        # The deployment's router first (servers.sh's first line): servers and robots connect to it.
        from lerobot_zenoh.pipelines.deployment import router_command

        log = open(out / "router.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.router", *router_command(factory)[1:]],
                                      stdout=log, stderr=subprocess.STDOUT, env=_env()))
        for i in used:
            log = open(out / f"srv{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.server",
                                           f"--manifest={out / 'manifests' / f'srv{i}.yaml'}"],
                                          stdout=log, stderr=subprocess.STDOUT, env=_env()))
        ids = sorted(the_plan.routing)
        groups = [ids[i::robot_procs] for i in range(robot_procs) if ids[i::robot_procs]]
        results = [out / f"robots{g}.json" for g in range(len(groups))]
        # every robot (LeRobot imported, servers discovered) is ready before the shared clock starts
        start_at = time.time() + (8.0 + 0.25 * len(ids) if start_delay_s is None else start_delay_s)
        robot_procs_ = []
        for g, group in enumerate(groups):
            log = open(out / f"robots{g}.log", "w")
            logs.append(log)
            robot_procs_.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.studies.pipelines_run", "robots", f"--plan={out / 'plan.json'}",
                 f"--robots={','.join(group)}", f"--camera={camera[0]}x{camera[1]}", f"--start_at={start_at}",
                 f"--warmup={warmup_s}", f"--seconds={seconds}", f"--out={results[g]}"],
                stdout=log, stderr=subprocess.STDOUT, env=_env()))
        limit = start_at - time.time() + warmup_s + seconds + 60
        for p in robot_procs_:
            p.wait(timeout=max(limit, 10))
        per_robot = {}
        for g, path in enumerate(results):
            if not path.exists():
                raise RuntimeError(f"robot process {g} wrote no result: {(out / f'robots{g}.log').read_text()[-2000:]}")
            per_robot.update(json.loads(path.read_text()))
    finally:
        stop_processes(procs, 10)
        for log in logs:
            log.close()
        if tmp is not None:
            tmp.cleanup()
    return {"workload": workload, "robots": robots, "deployment": deployment, "seed": seed, "scale": scale,
            "servers_used": len(used), "robots_run": len(per_robot),
            "predicted_hz": predicted(deployment, factory, profiles), **tally(factory, per_robot, seconds),
            "planned_rates_hz": {k: round(v, 4) for k, v in the_plan.rates_hz.items()}}


def tally(factory: Factory, per_robot: dict, seconds: float) -> dict:
    """SLO-qualified chunks/s of the fleet from each robot's window deltas (see the module docstring)."""
    qualified = s1_met = s1_req = s1_missed = 0
    robots_qualified = overruns = 0
    s1_p99 = []
    misses: dict[str, int] = {}
    for r in per_robot.values():
        task = factory.tasks[r["task"]]
        d = r["delta"]
        s1 = task.component("system1")[0]
        ok = True
        for cname, comp in task.components.items():
            met, missed = d[f"slo.{cname}.met"], d[f"slo.{cname}.missed"]
            if missed:
                misses[f"{task.name}.{cname}"] = misses.get(f"{task.name}.{cname}", 0) + missed
            if cname != s1 and met + missed and met / (met + missed) < comp.slo.percentile / 100.0:
                ok = False
        overruns += r["overruns"]
        if r["latency_ms_p99"].get(f"slo.{s1}.latency_ms_p99") is not None:
            s1_p99.append(r["latency_ms_p99"][f"slo.{s1}.latency_ms_p99"])
        s1_met += d[f"slo.{s1}.met"]
        s1_req += d[f"slo.{s1}.requests"]
        s1_missed += d[f"slo.{s1}.missed"]
        if ok:
            qualified += d[f"slo.{s1}.met"]
            robots_qualified += 1
    return {"qualified_hz": qualified / seconds, "s1_met_hz": s1_met / seconds, "s1_requests_hz": s1_req / seconds,
            "s1_missed": s1_missed, "robots_qualified": robots_qualified, "misses": misses,
            "s1_latency_ms_p99_max": round(max(s1_p99), 1) if s1_p99 else None, "loop_overruns": overruns}


# -- the robots' process -----------------------------------------------------------------------------

WINDOW_FIGURES = ("requests", "answered", "met", "missed", "late")


def robots_main(args) -> int:
    import logging

    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
    from lerobot_zenoh.client.pipeline import PipelineClient, configure
    from lerobot_zenoh.pipelines.robot_plan import load_robot_plan
    from lerobot_zenoh.transport.settings import ZenohSettings

    logging.basicConfig(level=logging.WARNING)
    h, w = (int(x) for x in args.camera.split("x"))
    clients = []
    for rid in args.robots.split(","):
        plan = load_robot_plan(args.plan, rid)
        config = RobotClientConfig(robot=SimRobotConfig(cameras={"front": (h, w)}, fps=plan.fps or 30),
                                   client_uuid=rid, zenoh=ZenohSettings(multicast_scouting=False),
                                   telemetry_period_s=0, log_level="WARNING", discovery_timeout_s=60)
        config.send.max_in_flight = 1  # as clients.sh
        config = configure(config, plan)
        client = PipelineClient(config, make_robot_from_config(config.robot), plan)
        clients.append(client)
    for c in clients:
        c.start()
    total = args.warmup + args.seconds
    delay = args.start_at - time.time()
    if delay > 0:
        time.sleep(delay)  # a shared start: every robot of every process runs the same window
    threads = [threading.Thread(target=c.run, kwargs={"duration_s": total + 2.0}, daemon=True) for c in clients]
    for t in threads:
        t.start()

    def snapshot():
        return {c.config.client_uuid: c.pipeline_figures() for c in clients}

    time.sleep(args.warmup)
    before = snapshot()
    time.sleep(args.seconds)
    after = snapshot()
    for c in clients:
        c.stop()
    for t in threads:
        t.join(timeout=10)
    result = {}
    for c in clients:
        rid = c.config.client_uuid
        keys = [k for k in after[rid] if k.startswith("slo.") and k.rsplit(".", 1)[1] in WINDOW_FIGURES]
        result[rid] = {"task": c.plan.task.name, "delta": {k: after[rid][k] - before[rid][k] for k in keys},
                       "latency_ms_p99": {k: v for k, v in after[rid].items() if k.endswith("latency_ms_p99")},
                       "empty_buffer_cycles": c.counters.empty_cycles, "overruns": c.counters.overruns}
    for c in clients:
        c.close()
    Path(args.out).write_text(json.dumps(result))
    return 0


# -- the study ---------------------------------------------------------------------------------------

def spread(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.1f}"
    return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"


def table(rows: list[dict], scale: float) -> str:
    lines = [("| workload | robots | deployment | measured qualified chunks/s (mean ± sd, n) | model | "
             "System 1 met / asked per s | robots whose other components met their SLOs | System 1 p99 ms (worst robot) | "
             "misses (component: count, all runs) |"), "|---|---|---|---|---|---|---|---|---|"]
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        keyed.setdefault((r["workload"], r["robots"], r["deployment"]), []).append(r)
    for (wl, k, dep), rs in keyed.items():
        q = [r["qualified_hz"] for r in rs]
        misses: dict[str, int] = {}
        for r in rs:
            for name, n in r["misses"].items():
                misses[name] = misses.get(name, 0) + n
        miss = ", ".join(f"{n}: {c}" for n, c in sorted(misses.items())) or "none"
        lines.append(f"| {wl} | {k} | {dep} | {spread(q)} (n={len(q)}) | {rs[0]['predicted_hz']:.1f} | "
                     f"{statistics.mean(r['s1_met_hz'] for r in rs):.1f} / "
                     f"{statistics.mean(r['s1_requests_hz'] for r in rs):.1f} | "
                     f"{statistics.mean(r['robots_qualified'] for r in rs):.1f} of {rs[0]['robots_run']} | "
                     f"{max((r['s1_latency_ms_p99_max'] or 0) for r in rs):.0f} | {miss} |")
    lines += ["", ("| workload | robots | planned / shared measured (model) | planned / dedicated measured (model) | "
              "Rosa |"), "|---|---|---|---|---|"]
    for wl, k in dict.fromkeys((r["workload"], r["robots"]) for r in rows):
        def mean(dep, field, wl=wl, k=k):
            rs = keyed.get((wl, k, dep)) or next((v for (w, _, d), v in keyed.items() if w == wl and d == dep), None)
            return statistics.mean(r[field] for r in rs) if rs else None

        p, s, d = (mean(x, "qualified_hz") for x in ("planned", "shared", "dedicated"))
        pm, sm, dm = (mean(x, "predicted_hz") for x in ("planned", "shared", "dedicated"))
        def ratio(a, b):
            return "-" if a is None or b is None else (f"{a / b:.2f}x" if b > 0 else ("inf" if a > 0 else "-"))
        lines.append(f"| {wl} | {k} | {ratio(p, s)} ({ratio(pm, sm)}) | {ratio(p, d)} ({ratio(pm, dm)}) | "
                     f"{ROSA_SHARED}x / {ROSA_DEDICATED}x |")
    lines += ["", ("| workload | peak planned (robots) | peak shared (robots) | peak dedicated | planned / shared, peaks "
              "measured (model) | planned / dedicated, peaks measured (model) | Rosa (planned / shared, / dedicated) |"),
              "|---|---|---|---|---|---|---|"]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        peak = {}
        for dep in ("planned", "shared", "dedicated"):
            pts = [(statistics.mean(r["qualified_hz"] for r in rs), statistics.mean(r["predicted_hz"] for r in rs), k)
                   for (w, k, d), rs in keyed.items() if w == wl and d == dep]
            if pts:
                peak[dep] = (max(pts)[0], max(p[1] for p in pts), max(pts)[2])
        if len(peak) < 3:
            continue
        (p, pm, pk), (s_, sm, sk), (d, dm, _) = peak["planned"], peak["shared"], peak["dedicated"]
        lines.append(f"| {wl} | {p:.1f} ({pk}) | {s_:.1f} ({sk}) | {d:.1f} | {ratio(p, s_)} ({ratio(pm, sm)}) | "
                     f"{ratio(p, d)} ({ratio(pm, dm)}) | {ROSA_SHARED}x, {ROSA_DEDICATED}x |")
    return "\n".join(lines)


BEGIN, END = "<!-- pipelines_run:begin -->", "<!-- pipelines_run:end -->"


def write_block(path: Path, text: str) -> None:
    write_docs_block(path, BEGIN, END, text, heading="Multi-model pipelines: planned fleet vs baselines, measured")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("robots", help="(internal) run some robots of a plan and write their window counters")
    r.add_argument("--plan", required=True)
    r.add_argument("--robots", required=True)
    r.add_argument("--camera", default="24x32")
    r.add_argument("--start_at", type=float, required=True)
    r.add_argument("--warmup", type=float, required=True)
    r.add_argument("--seconds", type=float, required=True)
    r.add_argument("--out", required=True)
    ap.add_argument("--workloads", nargs="+", default=["P4", "Mix2"], choices=list(WORKLOADS))
    ap.add_argument("--sizes", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--deployments", nargs="+", default=["planned", "shared", "dedicated"])
    ap.add_argument("--seeds", type=int, default=3, help="repeated runs per point")
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--scale", type=float, default=2.0, help="every latency, t_act, SLO deadline and period x this")
    ap.add_argument("--fps", type=int, default=10, help="the robots' control rate")
    ap.add_argument("--warmup", type=float, default=6.0)
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    ap.add_argument("--robot-procs", type=int, default=2)
    ap.add_argument("--json", help="append each run's result to this JSON-lines file")
    ap.add_argument("--report", help="print the tables of the runs in this JSON-lines file (no run)")
    ap.add_argument("--write-docs", help="with --report: rewrite the generated block of this markdown file")
    args = ap.parse_args(argv)
    if args.cmd == "robots":
        return robots_main(args)
    if args.report:
        rows = [json.loads(line) for line in Path(args.report).read_text().splitlines() if line.strip()]
        text = table(rows, rows[0]["scale"] if rows else args.scale)
        print(text)
        if args.write_docs:
            write_block(Path(args.write_docs), text)
        return 0
    rows = []
    for wl in args.workloads:
        for k in args.sizes:
            for dep in args.deployments:
                if dep == "dedicated" and k != args.sizes[0]:
                    continue  # dedicated serves the same few robots whatever the fleet size
                for seed in range(args.seeds):
                    t0 = time.time()
                    load = os.getloadavg()[0]
                    row = run_one(wl, k, dep, servers=args.servers, scale=args.scale, fps=args.fps,
                                  warmup_s=args.warmup, seconds=args.seconds, robot_procs=args.robot_procs, seed=seed)
                    row["load_before"] = round(load, 2)
                    row["load_after"] = round(os.getloadavg()[0], 2)
                    row["wall_s"] = round(time.time() - t0, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        with open(args.json, "a") as fh:
                            fh.write(json.dumps(row) + "\n")
    text = table(rows, args.scale)
    print(text)
    if args.write_docs:
        write_block(Path(args.write_docs), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
