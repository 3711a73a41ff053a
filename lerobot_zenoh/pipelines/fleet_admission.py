"""Placement-preserving admission control (Rosa 3.4.4): can one more robot join a running fleet?

The placement (which model each server hosts) stays as planned. The robot is admitted when each of its
task's components can be routed to a server already hosting that component's model in the same role
(goal or obligation), such that every SLO on that server still holds at the new aggregate rate (the
server may change its batch size). Goal-coupled classes whose servers slow down get their action rate
lowered to the closed-loop bound `1 / (t_act + l_S1 + l_S2 / H)`, as long as their minimum throughput
still holds. Otherwise the robot is refused with the reason; a full re-plan is the planner's job. A
task whose System 1 and System 2 one model serves from one stream (`planner.joint_text_component`)
adds one System 1 request stream that carries System 2, routed for both to the same server.

Pure: the plan given is not modified; an admitted robot comes with the updated plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from lerobot_zenoh.pipelines.descriptor import GOAL_KINDS, Factory, Task
from lerobot_zenoh.pipelines.planner import (
    Plan,
    ServerPlan,
    Share,
    Stream,
    closed_loop_hz,
    evaluate_server,
    f_upper,
    joint_text_component,
)
from lerobot_zenoh.pipelines.profiles import Profiles, stat_of


@dataclass(frozen=True)
class Admission:
    admitted: bool
    reason: str                    # why refused, or what changed when admitted
    robot: str
    routes: dict[str, int]         # component -> server index (empty when refused)
    rate_hz: float                 # the robot's System 1 rate (0 when refused)
    plan: Plan | None              # the updated plan when admitted


def _stream(task: Task, cname: str, rate_f: float) -> Stream:
    comp = task.components[cname]
    if comp.kind == "system1":
        rate = rate_f
    elif comp.kind == "system2":
        rate = rate_f / comp.invocation.every_n_chunks
    else:
        rate = comp.invocation.rate_hz
    return Stream(task.name, cname, comp.kind, comp.model, 1, rate, stat_of(comp.slo.percentile), comp.slo.deadline_ms)


def _with_robot(server: ServerPlan, stream: Stream) -> list[Share]:
    shares = [Share(s.stream, s.robots, list(s.robot_ids)) for s in server.shares]
    for s in shares:
        if s.stream.label == stream.label:
            s.robots += 1
            return shares
    return shares + [Share(stream, 1)]


def _apply_rates(factory: Factory, profiles: Profiles, servers: list[ServerPlan], rates: dict[str, float]) -> None:
    """Give every share the rate of its class (a class lowered to its closed-loop bound included), and
    evaluate again each server whose load changed, so that a server's rate is the sum of what the
    robots routed to it send and its batch size and latencies are those of that load. The bound was
    taken at the higher load, so the lower one keeps every SLO (a server that would find none keeps
    its evaluation)."""
    for server in servers:
        changed = False
        for share in server.shares:
            st = share.stream
            if st.task not in rates:
                continue
            rate = _stream(factory.tasks[st.task], st.component, rates[st.task]).rate_hz
            if rate != st.rate_hz:
                share.stream, changed = replace(st, rate_hz=rate), True
        if changed:
            found = evaluate_server(profiles.get(server.model), server.shares)
            if found is not None:
                server.batch_size, server.mean_ms, server.slo_ms = found


def admit(factory: Factory, profiles: Profiles, plan: Plan, task_name: str, robot: str | None = None) -> Admission:
    if task_name not in factory.tasks:
        return Admission(False, f"unknown task {task_name!r} (tasks: {', '.join(sorted(factory.tasks))})",
                         robot or "", {}, 0.0, None)
    task = factory.tasks[task_name]
    existing = sum(1 for t in plan.robot_task.values() if t == task_name)
    robot = robot or f"{task_name}-r{existing}"
    if robot in plan.routing:
        return Admission(False, f"robot {robot!r} is already in the fleet", robot, {}, 0.0, None)
    # A planned class joins at its rate; a new class at the highest rate that fits (binary search).
    if task_name in plan.rates_hz:
        return _try(factory, profiles, plan, task, robot, plan.rates_hz[task_name])
    lo_ok, hi = None, f_upper(task)
    lo = hi * 1e-3
    for _ in range(30):
        f = lo if lo_ok is None else (lo + hi) / 2
        result = _try(factory, profiles, plan, task, robot, f)
        if result.admitted:
            lo_ok, lo = result, f
        elif lo_ok is None:
            return result
        else:
            hi = f
        if lo_ok is not None and hi - lo < 1e-3 * hi:
            break
    return lo_ok


def _try(factory: Factory, profiles: Profiles, plan: Plan, task: Task, robot: str, f: float) -> Admission:
    servers = copy.deepcopy(plan.servers)
    routes: dict[str, int] = {}
    # A System 2 served from System 1's stream (one prefill) is no stream of its own: it goes where
    # System 1 goes, and System 1's stream carries it (as the planner placed it).
    joint = joint_text_component(task, profiles)
    for cname, comp in task.components.items():
        if cname == joint:
            continue
        stream = _stream(task, cname, f)
        if comp.kind == "system1" and joint is not None:
            stream = replace(stream, text_component=joint)
        role = "goal" if comp.kind in GOAL_KINDS else "obligation"
        hosts = [s for s in servers if s.model == comp.model and s.role == role]
        if not hosts:
            return Admission(False, f"component {cname!r}: no server hosts {comp.model!r} as a {role} model "
                                    f"(placement-preserving admission cannot place it; re-plan)", robot, {}, 0.0, None)
        why = None
        for s in sorted(hosts, key=lambda s: s.rate_hz):  # most headroom first
            shares = _with_robot(s, stream)
            found = evaluate_server(profiles.get(s.model), shares)
            if found is None:
                if why is None:
                    total = sum(sh.rate_hz for sh in shares)
                    why = (f"component {cname!r}: server {s.index} ({s.model}) would carry {total:.3g} requests/s, "
                           f"which breaks an SLO it serves at every batch size")
                continue
            for sh in shares:
                if sh.stream.label == stream.label and robot not in sh.robot_ids:
                    sh.robot_ids.append(robot)
            s.shares, (s.batch_size, s.mean_ms, s.slo_ms) = shares, found
            routes[cname] = s.index
            if stream.text_component:
                routes[stream.text_component] = s.index
            break
        else:
            return Admission(False, why, robot, {}, 0.0, None)
    # Closed loop: classes whose goal servers slowed down run at their new bound, above their minimum.
    rates = dict(plan.rates_hz)
    rates.setdefault(task.name, f)
    changed = []
    for cls_name in list(rates):
        bound = closed_loop_hz(profiles, servers, factory.tasks[cls_name])
        if rates[cls_name] > bound * (1 + 1e-9):
            robots = sum(1 for t in plan.robot_task.values() if t == cls_name) + (cls_name == task.name)
            fc = factory.fleet_class(cls_name) if any(c.task == cls_name for c in factory.fleet) else None
            floor = (fc.min_throughput_hz if fc else 0.0)
            if bound * robots < floor - 1e-9:
                return Admission(False, f"min_throughput_hz: task {cls_name!r} would drop to {bound * robots:.3g} "
                                        f"actions/s, below its minimum {floor:g}", robot, {}, 0.0, None)
            if f"{rates[cls_name]:.3f}" != f"{bound:.3f}":  # told only where it shows (the plan keeps it exact)
                changed.append(f"{cls_name} {rates[cls_name]:.3f} -> {bound:.3f} Hz")
            rates[cls_name] = bound
    _apply_rates(factory, profiles, servers, rates)
    routes = {c: routes[c] for c in task.components}
    routing = {**copy.deepcopy(plan.routing), robot: routes}
    robot_task = {**plan.robot_task, robot: task.name}
    weights = {c.task: c.weight for c in factory.fleet}
    counts: dict[str, int] = {}
    for t in robot_task.values():
        counts[t] = counts.get(t, 0) + 1
    new = Plan(servers, rates, routing, robot_task,
               objective=sum(weights.get(c, 1.0) * counts.get(c, 0) * r for c, r in rates.items()),
               throughput_hz=sum(counts.get(c, 0) * r for c, r in rates.items()),
               solve_s=plan.solve_s, search_steps=plan.search_steps)
    note = "admitted on servers " + ", ".join(f"{c}: {i}" for c, i in routes.items())
    if changed:
        note += "; rates lowered to the closed-loop bound: " + ", ".join(changed)
    return Admission(True, note, robot, routes, rates[task.name], new)
