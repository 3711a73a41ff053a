"""Rosa's workloads (its Tables 1-2, as docs/benchmarks.md lists them) planned on synthetic GPU-like profiles: a *model*, not a run.

    python -m benchmarks.studies.pipelines_plan [--write-docs docs/studies/pipelines.md]

For P1-P4, Mix2 and Mix4 at several fleet sizes on 8 servers, the SLO-qualified action throughput
(chunks/s of the whole fleet) of
  planned      lerobot-zenoh-plan's deployment (obligations first, rate search, ILP packing, rate cap);
  shared       shared servers without the planner (Rosa's baseline 3): servers split equally across the
               component kinds, System 1 at batch 1, VLMs at their continuous-batching cap, robots
               round robin over a kind's servers, no rate cap (each robot asks again as soon as it has
               executed its chunk);
  ded/model    one server per component of each robot (baseline 2): floor(8 / components) robots;
  ded/robot    one server per robot running all its components on one inference thread, taking turns
               (baseline 1): min(8, K) robots;
and the planner's solve time as the fleet grows (Mix4, 12 -> 1,000 robots, a server per 4 robots).

The evaluation model (pipelines/profiles.py profiles, docs/pipelines.md): a server's latency at an
aggregate rate is read from the profile; an uncapped fleet settles where each robot's rate is
1 / (t_act + l_S1 + l_S2 / H) (a damped fixed point; above the profile's highest rate the latency
grows steeply, standing for saturation). A class's actions count only when every server it uses
meets that component's SLO percentile at the operating point (all or nothing per class). No robots,
GPUs or Zenoh are involved: these figures test the planner's decisions, not the serving stack.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path


from benchmarks.harness.docs_blocks import write_docs_block
from lerobot_zenoh.pipelines.descriptor import OBLIGATION_KINDS, Factory, parse_factory
from lerobot_zenoh.pipelines.planner import Infeasible, plan
from lerobot_zenoh.pipelines.profiles import ModelProfile, Profiles, rosa_profiles, stat_of

S1, VLM7, VLM3 = "gr00t-n1.6-3b", "qwen2.5-vl-7b", "qwen2.5-vl-3b"


def _comp(kind, model, slo_ms, **inv):
    fallback = {"system1": "hold", "system2": "use_last", "safety": "zero_velocity", "monitor": "hold"}[kind]
    c = {"kind": kind, "model": model, "slo": {"percentile": 99, "deadline_ms": slo_ms}, "on_slo_miss": fallback,
         "invocation": inv or "per_chunk"}
    if kind in OBLIGATION_KINDS:
        c["on_danger"] = "stop_episode"
    return c


#: Table 1 (all SLOs p99; t_act 200 ms).
TASKS = {
    "P1": {"s1": _comp("system1", S1, 200)},
    "P2": {"s1": _comp("system1", S1, 200), "mon": _comp("monitor", VLM7, 2000, rate_hz=0.5)},
    "P3": {"s1": _comp("system1", S1, 200), "safe": _comp("safety", VLM3, 500, rate_hz=2),
           "mon": _comp("monitor", VLM7, 2000, rate_hz=0.5)},
    "P4": {"s1": {**_comp("system1", S1, 200), "inputs": ["s2"]},
           "s2": _comp("system2", VLM7, 2000, every_n_chunks=10),
           "safe": _comp("safety", VLM3, 500, rate_hz=2), "mon": _comp("monitor", VLM7, 2000, rate_hz=0.5)},
}
#: Table 2.
WORKLOADS = {"P1": ["P1"], "P2": ["P2"], "P3": ["P3"], "P4": ["P4"],
             "Mix2": ["P2", "P4"], "Mix4": ["P1", "P2", "P3", "P4"]}


def make_factory(workload: str, robots: int, servers: int) -> Factory:
    classes = WORKLOADS[workload]
    per = robots // len(classes)
    return parse_factory({
        "servers": {"count": servers, "hardware": "synthetic-H200"},
        "models": {m: {"model_id": m.split("-")[0].replace(".", ""), "synthetic": {}} for m in (S1, VLM7, VLM3)},
        "tasks": {t: {"action_period_ms": 200, "components": copy.deepcopy(TASKS[t])} for t in classes},
        "fleet": [{"task": t, "robots": per} for t in classes]})


# -- the evaluation model ----------------------------------------------------------------------------

def _max_rate(prof: ModelProfile, b: int) -> float:
    return max(p.rate_hz for p in prof.points if p.batch_size == b)


def _lat(prof: ModelProfile, b: int, rate: float, stat: str) -> float:
    top = _max_rate(prof, b)
    if rate <= top:
        return prof.latency_ms(b, rate, stat)
    return prof.latency_ms(b, top, stat) * (rate / top) ** 4  # saturated: grows steeply


def _service_ms(prof: ModelProfile) -> float:
    b = min(prof.batch_sizes())
    return min(p.mean_ms for p in prof.points if p.batch_size == b)


def batch(kind: str, prof: ModelProfile) -> int:
    """The baselines' batching: System 1 one request at a time, VLMs at their continuous-batching cap."""
    return min(prof.batch_sizes()) if kind == "system1" else max(prof.batch_sizes())


def shared(factory: Factory, profiles: Profiles) -> float:
    """Baseline 3: equal split across component kinds, batch 1 for System 1, uncapped closed loop."""
    kinds = sorted({c.kind for t in factory.tasks.values() for c in t.components.values()},
                   key=["system1", "system2", "safety", "monitor"].index)
    n = factory.servers.count
    if n < len(kinds):
        return 0.0
    share = {k: n // len(kinds) for k in kinds}
    share["system1"] += n - sum(share.values())
    classes = [(factory.tasks[c.task], c.robots) for c in factory.fleet]

    def model_of(kind):
        return next(c.model for t, _ in classes for c in t.components.values() if c.kind == kind)

    lat = {"system1": 0.0, "system2": 0.0}
    f = {}
    for _ in range(400):  # damped fixed point of rates and goal latencies
        for t, _k in classes:
            h = t.system2_horizon
            f[t.name] = 1000.0 / (t.action_period_ms + lat["system1"] + (lat["system2"] / h if h else 0))
        for kind in ("system1", "system2"):
            if kind not in share:
                continue
            prof = profiles.get(model_of(kind))
            rate = sum(k * f[t.name] / (1 if kind == "system1" else t.system2_horizon)
                       for t, k in classes if t.component(kind)) / share[kind]
            new = _lat(prof, batch(kind, prof), rate, "mean")
            lat[kind] = 0.8 * lat[kind] + 0.2 * min(new, 1e6)
    total = 0.0
    for t, k in classes:
        ok = True
        for comp in t.components.values():
            prof = profiles.get(comp.model)
            users = [(u, ku) for u, ku in classes if u.component(comp.kind)]
            if comp.kind in OBLIGATION_KINDS:
                rate = sum(ku * u.component(comp.kind)[1].invocation.rate_hz for u, ku in users)
            elif comp.kind == "system1":
                rate = sum(ku * f[u.name] for u, ku in users)
            else:
                rate = sum(ku * f[u.name] / u.system2_horizon for u, ku in users)
            latency = _lat(prof, batch(comp.kind, prof), rate / share[comp.kind], stat_of(comp.slo.percentile))
            if latency > comp.slo.deadline_ms:
                ok = False
        total += k * f[t.name] if ok else 0.0
    return total


def _robot_order(factory: Factory) -> list:
    order = []
    left = {c.task: c.robots for c in factory.fleet}
    while any(left.values()):
        for c in factory.fleet:
            if left[c.task]:
                order.append(factory.tasks[c.task])
                left[c.task] -= 1
    return order


def dedicated_per_model(factory: Factory, profiles: Profiles) -> float:
    """Baseline 2: a server per component of each robot, while servers last."""
    total, free = 0.0, factory.servers.count
    for t in _robot_order(factory):
        if len(t.components) > free:
            break
        free -= len(t.components)
        l1 = l2 = 0.0
        for _ in range(200):
            h = t.system2_horizon
            fr = 1000.0 / (t.action_period_ms + l1 + (l2 / h if h else 0))
            s1 = t.component("system1")[1]
            l1 = _lat(profiles.get(s1.model), batch("system1", profiles.get(s1.model)), fr, "mean")
            if h:
                s2 = t.component("system2")[1]
                l2 = _lat(profiles.get(s2.model), batch("system2", profiles.get(s2.model)), fr / h, "mean")
        def rate_of(c, fr=fr, t=t):
            if c.kind == "system1":
                return fr
            return fr / t.system2_horizon if c.kind == "system2" else c.invocation.rate_hz

        ok = all(_lat(profiles.get(c.model), batch(c.kind, profiles.get(c.model)), rate_of(c),
                      stat_of(c.slo.percentile)) <= c.slo.deadline_ms for c in t.components.values())
        total += fr if ok else 0.0
    return total


def dedicated_per_robot(factory: Factory, profiles: Profiles) -> float:
    """Baseline 1: one server per robot, its components taking turns on one inference thread
    (non-preemptive: a component's p99 includes the longest other component busy more than 1 %)."""
    total = 0.0
    for t in _robot_order(factory)[: factory.servers.count]:
        svc = {n: _service_ms(profiles.get(c.model)) for n, c in t.components.items()}
        s1name = t.component("system1")[0]
        fr = 1000.0 / (t.action_period_ms + svc[s1name])
        for _ in range(100):
            rates = {n: (fr if c.kind == "system1" else fr / c.invocation.every_n_chunks if c.kind == "system2"
                         else c.invocation.rate_hz) for n, c in t.components.items()}
            rho = {n: rates[n] * svc[n] / 1000.0 for n in svc}
            mean = {n: svc[n] + sum(rho[m] * svc[m] / 2 for m in svc if m != n) for n in svc}
            h = t.system2_horizon
            s2 = t.component("system2")
            fr = 1000.0 / (t.action_period_ms + mean[s1name] + (mean[s2[0]] / h if s2 else 0))
        if sum(rho.values()) >= 1:
            continue
        ok = all(svc[n] + max([svc[m] for m in svc if m != n and rho[m] > 0.01], default=0.0) <= c.slo.deadline_ms
                 for n, c in t.components.items())
        total += fr if ok else 0.0
    return total


def planned(factory: Factory, profiles: Profiles) -> tuple[float, float]:
    try:
        p = plan(factory, profiles)
    except Infeasible:
        return 0.0, math.nan
    return p.throughput_hz, p.solve_s


def run(sizes=(8, 16, 32, 64), servers=8) -> str:
    profiles = rosa_profiles()
    from ortools.sat.python import cp_model  # noqa: F401  (imported once, outside the timed solves)

    peaks: dict[str, list[float]] = {}
    lines = [("| workload | robots | planned | shared (equal split) | ded/model | ded/robot | planned / shared "
              "| planned / best dedicated | plan solve (s) |"), "|---|---|---|---|---|---|---|---|---|"]
    for wl, classes in WORKLOADS.items():
        for k in sizes:
            if k % len(classes):
                continue
            f = make_factory(wl, k, servers)
            tp, solve = planned(f, profiles)
            sh, dm, dr = shared(f, profiles), dedicated_per_model(f, profiles), dedicated_per_robot(f, profiles)
            peak = peaks.setdefault(wl, [0.0, 0.0, 0.0])
            peak[0], peak[1], peak[2] = max(peak[0], tp), max(peak[1], sh), max(peak[2], dm, dr)
            def ratio(a, b):
                return f"{a / b:.2f}x" if b > 0 else ("inf" if a > 0 else "-")
            lines.append(f"| {wl} | {k} | {tp:.1f} | {sh:.1f} | {dm:.1f} | {dr:.1f} | {ratio(tp, sh)} | "
                         f"{ratio(tp, max(dm, dr))} | {solve:.2f} |")
    lines += ["", "| workload | peak planned | peak shared | peak dedicated | planned / shared (peaks) | planned / dedicated (peaks) |",
              "|---|---|---|---|---|---|"]
    for wl, (tp, sh, de) in peaks.items():
        lines.append(f"| {wl} | {tp:.1f} | {sh:.1f} | {de:.1f} | {tp / sh:.2f}x | {tp / de:.2f}x |")
    lines += ["", "| Mix4 robots | servers | planned throughput | solve time (s) | search steps |", "|---|---|---|---|---|"]
    for k in (12, 100, 400, 1000):
        n = max(8, k // 4)
        f = make_factory("Mix4", k - k % 4, n)
        t0 = time.perf_counter()
        p = plan(f, profiles)
        lines.append(f"| {k - k % 4} | {n} | {p.throughput_hz:.1f} | {time.perf_counter() - t0:.2f} | {p.search_steps} |")
    return "\n".join(lines)


BEGIN, END = "<!-- pipelines_plan:begin -->", "<!-- pipelines_plan:end -->"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-docs", help="rewrite the generated block of this markdown file")
    args = ap.parse_args()
    table = run()
    print(table)
    if args.write_docs:
        write_docs_block(Path(args.write_docs), BEGIN, END, table,
                         heading="Multi-model pipelines: planned fleet vs baselines, in the model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
