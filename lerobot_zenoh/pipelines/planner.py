"""The fleet planner (Rosa 3.4): placement, batching, routing and request rates for a factory.

    provision_obligations   safety and monitor models on the fewest servers that meet their SLOs
    plan                    then the highest weighted action rate for System 1 / System 2:
                              one task class: binary search on its rate f
                              several: adaptive frontier search on the rate vector (f_1..f_C)
                            each candidate is checked by packing goal servers with an ILP (OR-Tools
                            CP-SAT) over single-stream configurations (isolated packing), greedy
                            compaction across classes when over budget, and the closed-loop bound
                            f_c <= 1 / (t_act + l_S1 + l_S2 / H)

A task with a `combined_model` is planned both ways (its System 1 and System 2 from one stream of
that two-component model, or as its components name them) and the better plan kept, with the reason
(`Plan.choices`); `resolved_factory` is the factory as the plan serves it.

A *stream* is one component of one task class: K_c robots each sending at a rate (System 1: f_c,
System 2: f_c / H, safety and monitor: their configured rate). A server hosts one model (Rosa 3.4.1:
no colocation) and serves one or more streams of it, with one batch size; it is feasible when, at its
aggregate rate, every stream's SLO percentile stays within that stream's deadline (the profile, never
extrapolated). Pure: no I/O; `time_budget_s` bounds the search with an injected clock.

Infeasible inputs raise `Infeasible` whose message names the constraint that binds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lerobot_zenoh.errors import ConfigError, LeRobotZenohError
from lerobot_zenoh.pipelines.descriptor import OBLIGATION_KINDS, Factory, Task
from lerobot_zenoh.pipelines.profiles import ModelProfile, Profiles, check_against_profiles, stat_of


class Infeasible(LeRobotZenohError):
    """No plan meets every constraint; the message says which one binds."""


@dataclass(frozen=True)
class Stream:
    task: str
    component: str
    kind: str
    model: str
    robots: int
    rate_hz: float           # per robot
    stat: str                # p99, ...
    deadline_ms: float
    # System 2 served from this System 1 stream by a two-component model (one prefill per observation).
    text_component: str | None = None

    @property
    def label(self) -> str:
        return f"{self.task}.{self.component}"


@dataclass
class Share:
    """The part of one stream a server serves: `robots` of its robots (ids filled in by routing)."""

    stream: Stream
    robots: int
    robot_ids: list[str] = field(default_factory=list)

    @property
    def rate_hz(self) -> float:
        return self.robots * self.stream.rate_hz


@dataclass
class ServerPlan:
    index: int
    model: str
    role: str                # "obligation" or "goal"
    batch_size: int
    shares: list[Share]
    mean_ms: float = 0.0     # at the planned load
    slo_ms: dict[str, float] = field(default_factory=dict)   # stream label -> its percentile's latency

    @property
    def rate_hz(self) -> float:
        return sum(s.rate_hz for s in self.shares)


@dataclass
class Plan:
    servers: list[ServerPlan]
    rates_hz: dict[str, float]               # task class -> action rate f_c per robot (chunks/s)
    routing: dict[str, dict[str, int]]       # robot id -> component -> server index
    robot_task: dict[str, str]               # robot id -> task class
    objective: float                         # sum v_c K_c f_c
    throughput_hz: float                     # sum K_c f_c: the fleet's action rate
    solve_s: float
    search_steps: int
    # Tasks with a `combined_model`: whether the plan serves their System 1 and System 2 from one
    # stream of it (True) or as the components name them (False), and why (`plan`).
    combined: dict[str, bool] = field(default_factory=dict)
    choices: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict:
        extra = {"choices": dict(self.choices)} if self.choices else {}
        return {**extra, "objective": round(self.objective, 4), "throughput_hz": round(self.throughput_hz, 4),
                "rates_hz": {k: round(v, 4) for k, v in self.rates_hz.items()},
                "servers": [{"index": s.index, "model": s.model, "role": s.role, "batch_size": s.batch_size,
                             "rate_hz": round(s.rate_hz, 4), "mean_ms": round(s.mean_ms, 2),
                             # a System 2 riding on System 1's stream shows as `task.act+plan`
                             "shares": {sh.stream.label + (f"+{sh.stream.text_component}" if sh.stream.text_component
                                                           else ""): sh.robots for sh in s.shares}}
                            for s in self.servers],
                "solve_s": round(self.solve_s, 4), "search_steps": self.search_steps}


# -- one server --------------------------------------------------------------------------------------

def evaluate_server(profile: ModelProfile, shares: list[Share]) -> tuple[int, float, dict[str, float]] | None:
    """The batch size with the lowest mean latency at which every share meets its SLO, with that mean
    and each stream's percentile latency; None when no batch size does."""
    total = sum(s.rate_hz for s in shares)
    best = None
    for b in profile.batch_sizes():
        lat = {}
        for s in shares:
            v = profile.latency_ms(b, total, s.stream.stat)
            if v > s.stream.deadline_ms:
                break
            lat[s.stream.label] = v
        else:
            mean = profile.latency_ms(b, total, "mean")
            if math.isfinite(mean) and (best is None or mean < best[1]):
                best = (b, mean, lat)
    return best


def _robots_per_server(profile: ModelProfile, stream: Stream) -> dict[int, tuple[int, float]]:
    """k -> (batch size, mean latency) for every k robots of `stream` one server can serve."""
    out = {}
    k = 1
    while k <= stream.robots:
        found = evaluate_server(profile, [Share(stream, k)])
        if found is None:
            break
        out[k] = (found[0], found[1])
        k += 1
    return out


# -- obligations -------------------------------------------------------------------------------------

def obligation_streams(factory: Factory) -> list[Stream]:
    out = []
    for cls_ in factory.fleet:
        task = factory.tasks[cls_.task]
        for cname, comp in task.components.items():
            if comp.kind in OBLIGATION_KINDS:
                out.append(Stream(cls_.task, cname, comp.kind, comp.model, cls_.robots, comp.invocation.rate_hz,
                                  stat_of(comp.slo.percentile), comp.slo.deadline_ms))
    return out


def _spread(streams: list[Stream], n: int) -> list[list[Share]]:
    """Robots of each stream dealt as evenly as possible over n servers."""
    servers: list[list[Share]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for st in sorted(streams, key=lambda s: -s.rate_hz):
        counts = [0] * n
        for _ in range(st.robots):  # each robot to the least-loaded server
            i = min(range(n), key=lambda j: loads[j])
            counts[i] += 1
            loads[i] += st.rate_hz
        for i, c in enumerate(counts):
            if c:
                servers[i].append(Share(st, c))
    return servers


def provision_obligations(factory: Factory, profiles: Profiles, budget: int) -> list[ServerPlan]:
    """The fewest servers per obligation model (streams of one model share servers) meeting every SLO."""
    by_model: dict[str, list[Stream]] = {}
    for st in obligation_streams(factory):
        by_model.setdefault(st.model, []).append(st)
    plans: list[ServerPlan] = []
    for model, streams in sorted(by_model.items()):
        prof = profiles.get(model)
        for st in streams:
            if evaluate_server(prof, [Share(st, 1)]) is None:
                raise Infeasible(f"task {st.task!r}, component {st.component!r}: one robot at {st.rate_hz:g} Hz "
                                 f"already breaks the {st.stat} {st.deadline_ms:g} ms SLO of {model!r} on one server")
        total_robots = sum(s.robots for s in streams)
        for n in range(1, total_robots + 1):
            groups = _spread(streams, n)
            found = [evaluate_server(prof, g) for g in groups]
            if all(found):
                break
        else:  # pragma: no cover - one robot per server was checked feasible above
            raise Infeasible(f"obligation model {model!r} cannot meet its SLOs")
        for g, (b, mean, lat) in zip(groups, found):
            plans.append(ServerPlan(-1, model, "obligation", b, g, mean, lat))
    if len(plans) > budget:
        counts = {}
        for p in plans:
            counts[p.model] = counts.get(p.model, 0) + 1
        raise Infeasible(f"server count: the obligation models alone need {len(plans)} servers "
                         f"({', '.join(f'{m}: {c}' for m, c in counts.items())}) and the factory has {budget}")
    return plans


# -- goal-coupled packing ----------------------------------------------------------------------------

def joint_text_component(task: Task, profiles: Profiles | None) -> str | None:
    """The task's System 2 component when one model serves its System 1 and System 2 from one stream
    (both name it and its profile `serves_both`): System 2 then rides on System 1's observations."""
    s1, s2 = task.component("system1"), task.component("system2")
    if s1 is None or s2 is None or s1[1].model != s2[1].model or profiles is None:
        return None
    prof = profiles.models.get(s1[1].model)
    return s2[0] if prof is not None and prof.serves_both else None


def goal_streams(factory: Factory, rates: dict[str, float], profiles: Profiles | None = None) -> list[Stream]:
    """The goal-coupled request streams at `rates`. A task whose System 1 and System 2 name one model
    whose profile serves both (`joint_text_component`) has one stream: System 1's, carrying System 2."""
    out = []
    for cls_ in factory.fleet:
        task = factory.tasks[cls_.task]
        f = rates[cls_.task]
        joint = joint_text_component(task, profiles)
        for cname, comp in task.components.items():
            if comp.kind == "system1":
                out.append(Stream(cls_.task, cname, "system1", comp.model, cls_.robots, f,
                                  stat_of(comp.slo.percentile), comp.slo.deadline_ms, text_component=joint))
            elif comp.kind == "system2" and joint is None:
                out.append(Stream(cls_.task, cname, "system2", comp.model, cls_.robots,
                                  f / comp.invocation.every_n_chunks, stat_of(comp.slo.percentile), comp.slo.deadline_ms))
    return out


def loop_latencies_ms(profiles: Profiles, servers: list[ServerPlan], task: Task) -> tuple[float, float]:
    """(l_S1, l_S2): the mean latencies of `task`'s System 1 and System 2 on `servers` at their load. A
    System 2 served from System 1's stream takes its text's mean latency on those servers."""
    shares = [(s, sh) for s in servers for sh in s.shares if sh.stream.task == task.name]
    l1 = max((s.mean_ms for s, sh in shares if sh.stream.kind == "system1"), default=0.0)
    l2 = max([0.0, *(s.mean_ms for s, sh in shares if sh.stream.kind == "system2"),
              *(profiles.get(s.model).latency_ms(s.batch_size, s.rate_hz, "text_mean") for s, sh in shares
                if sh.stream.text_component)])
    return l1, l2


def closed_loop_hz(profiles: Profiles, servers: list[ServerPlan], task: Task) -> float:
    """The closed-loop bound ``1 / (t_act + l_S1 + l_S2 / H)`` of `task` on `servers`: a robot waits
    for its chunk, executes it, and amortises System 2 over H chunks."""
    l1, l2 = loop_latencies_ms(profiles, servers, task)
    h = task.system2_horizon
    return 1000.0 / (task.action_period_ms + l1 + (l2 / h if h else 0.0))


def _pack_ilp(options: list[dict[int, tuple[int, float]]], streams: list[Stream],
              budget: int | None) -> list[list[tuple[int, int]]] | None:
    """CP-SAT: y[s][k] servers of stream s serving k robots each; every robot covered exactly once.

    With `budget`: at most that many servers, minimising the total robot latency (spare servers lower
    latency, which raises the closed-loop bound). Without: the fewest servers, latency as tie-break.
    Returns, per stream, [(k, count)], or None when infeasible.
    """
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    y = []
    servers = []
    latency = []
    for opts, st in zip(options, streams):
        ys = {k: m.NewIntVar(0, st.robots // k, f"y_{st.label}_{k}") for k in opts}
        m.Add(sum(k * v for k, v in ys.items()) == st.robots)
        y.append(ys)
        servers += list(ys.values())
        latency += [v * k * round(opts[k][1] * 10) for k, v in ys.items()]
    n_servers = sum(servers)
    if budget is not None:
        m.Add(n_servers <= budget)
        m.Minimize(sum(latency) * 1000 + n_servers)
    else:
        m.Minimize(n_servers * 10**9 + sum(latency))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 10.0
    solver.parameters.num_workers = 1
    # Proving the latency tie-break optimal took ~5x the time at 1,000 robots for the same plans.
    solver.parameters.relative_gap_limit = 1e-4
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [[(k, solver.Value(v)) for k, v in ys.items() if solver.Value(v)] for ys in y]


def _compact(servers: list[ServerPlan], profiles: Profiles, budget: int) -> list[ServerPlan]:
    """Merge low-load servers into servers of the same model with headroom (Rosa 3.4.3), while over budget."""
    servers = list(servers)
    merged = True
    while len(servers) > budget and merged:
        merged = False
        for src in sorted(servers, key=lambda s: s.rate_hz):
            targets = sorted((t for t in servers if t is not src and t.model == src.model), key=lambda t: t.rate_hz)
            for dst in targets:
                shares = _merge_shares(dst.shares + src.shares)
                found = evaluate_server(profiles.get(dst.model), shares)
                if found is not None:
                    dst.shares, (dst.batch_size, dst.mean_ms, dst.slo_ms) = shares, found
                    servers.remove(src)
                    merged = True
                    break
            if merged:
                break
    return servers


def _merge_shares(shares: list[Share]) -> list[Share]:
    out: dict[str, Share] = {}
    for s in shares:
        if s.stream.label in out:
            out[s.stream.label] = Share(s.stream, out[s.stream.label].robots + s.robots)
        else:
            out[s.stream.label] = Share(s.stream, s.robots)
    return list(out.values())


@dataclass
class Check:
    ok: bool
    reason: str = ""
    servers: list[ServerPlan] = field(default_factory=list)


def pack_goal(factory: Factory, profiles: Profiles, rates: dict[str, float], budget: int) -> Check:
    """Is the rate vector feasible on `budget` goal servers? Isolated ILP packing, compaction, closed loop."""
    streams = goal_streams(factory, rates, profiles)
    options = []
    for st in streams:
        opts = _robots_per_server(profiles.get(st.model), st)
        if not opts:
            return Check(False, f"task {st.task!r}, component {st.component!r}: one robot at {st.rate_hz:.3g} Hz "
                                f"breaks the {st.stat} {st.deadline_ms:g} ms SLO of {st.model!r} on a server of its own")
        options.append(opts)
    models = sorted({st.model for st in streams})
    if len(models) > budget:
        return Check(False, f"server count: {len(models)} goal models ({', '.join(models)}) need at least one "
                            f"server each, {budget} left after the obligation models")
    packed = _pack_ilp(options, streams, budget)
    if packed is None:
        packed = _pack_ilp(options, streams, None)
    servers = []
    for st, opts, chosen in zip(streams, options, packed):
        for k, count in chosen:
            for _ in range(count):
                found = evaluate_server(profiles.get(st.model), [Share(st, k)])
                servers.append(ServerPlan(-1, st.model, "goal", found[0], [Share(st, k)], found[1], found[2]))
    if len(servers) > budget:
        needed = len(servers)
        servers = _compact(servers, profiles, budget)
        if len(servers) > budget:
            return Check(False, f"server count: the goal streams need {len(servers)} servers after compaction "
                                f"({needed} isolated), {budget} left after the obligation models")
    # Closed loop: a robot waits for System 1, executes t_act, and amortises System 2 over H chunks.
    for cls_ in factory.fleet:
        f_loop = closed_loop_hz(profiles, servers, factory.tasks[cls_.task])
        if rates[cls_.task] > f_loop * (1 + 1e-9):
            l1, l2 = loop_latencies_ms(profiles, servers, factory.tasks[cls_.task])
            return Check(False, f"closed loop: task {cls_.task!r} at {rates[cls_.task]:.3f} Hz exceeds "
                                f"1/(t_act + l_S1 + l_S2/H) = {f_loop:.3f} Hz (l_S1 {l1:.1f} ms, l_S2 {l2:.1f} ms)")
    return Check(True, servers=servers)


# -- the search --------------------------------------------------------------------------------------

def f_upper(task: Task) -> float:
    """The action rate with zero inference latency: one chunk per action period."""
    return 1000.0 / task.action_period_ms


def with_choices(factory: Factory, combined: dict[str, bool]) -> Factory:
    """`factory` with each task's `combined_model` decided: True, its System 1 and System 2 both name
    that model (one stream); False, they keep their models. Tasks not named keep theirs as written."""
    tasks = dict(factory.tasks)
    for name, one in combined.items():
        task = tasks[name]
        comps = dict(task.components)
        if one:
            for kind in ("system1", "system2"):
                cname, comp = task.component(kind)
                comps[cname] = comp.model_copy(update={"model": task.combined_model})
        tasks[name] = task.model_copy(update={"components": comps, "combined_model": None})
    return factory.model_copy(update={"tasks": tasks})


def resolved_factory(factory: Factory, plan: Plan) -> Factory:
    """The factory as `plan` serves it (every `combined_model` decided): what a deployment is written from."""
    return with_choices(factory, plan.combined)


#: Variants tried for tasks with a `combined_model`: every combination up to this many such tasks;
#: beyond, all combined and all apart.
MAX_COMBINATIONS_TASKS = 3


def plan(factory: Factory, profiles: Profiles, *, rel_tol: float = 1e-3, time_budget_s: float = 60.0,
         clock: Callable[[], float] = time.perf_counter) -> Plan:
    """The plan of `factory` (module docstring). Tasks with a `combined_model` are planned both ways
    (their System 1 and System 2 from one stream of that model, or as the components name them) and
    the better plan is kept: the higher objective (by more than `rel_tol`), then fewer servers, then
    the shorter closed loop of the robots; `Plan.choices` says which and why."""
    optional = sorted(c.task for c in factory.fleet if factory.tasks[c.task].combined_model is not None)
    if not optional:
        return _plan(factory, profiles, rel_tol=rel_tol, time_budget_s=time_budget_s, clock=clock)
    check_against_profiles(factory, profiles)
    if len(optional) <= MAX_COMBINATIONS_TASKS:
        variants = [dict(zip(optional, (bool(i >> j & 1) for j in range(len(optional)))))
                    for i in range(2 ** len(optional))]
    else:
        variants = [dict.fromkeys(optional, True), dict.fromkeys(optional, False)]
    t0 = clock()
    results: list[tuple[dict[str, bool], Plan | None, str]] = []
    for i, variant in enumerate(variants):
        left = max(time_budget_s - (clock() - t0), 0.0) / (len(variants) - i)
        try:
            results.append((variant, _plan(with_choices(factory, variant), profiles, rel_tol=rel_tol,
                                           time_budget_s=left, clock=clock), ""))
        except (Infeasible, ConfigError) as exc:  # ConfigError: an SLO below the combined model's minimum
            results.append((variant, None, str(exc)))
    feasible = [(v, p) for v, p, _ in results if p is not None]
    if not feasible:
        raise Infeasible(f"{results[0][2]} (and the same fleet with every task's system1 and system2 from its "
                         f"combined_model: {results[-1][2]})" if len(results) > 1 else results[0][2])
    best_v, best = feasible[0]
    for v, p in feasible[1:]:
        if _compare(factory, profiles, p, best, rel_tol)[0] > 0:
            best_v, best = v, p
    best.combined = dict(best_v)
    best.choices = {t: _why(factory, profiles, t, best_v, best, results, rel_tol) for t in optional}
    best.solve_s = clock() - t0
    return best


def _compare(factory: Factory, profiles: Profiles, p: Plan, q: Plan, rel_tol: float) -> tuple[int, str]:
    """(> 0: `p` is better, < 0: `q`, 0: a tie; why): the higher objective (by more than `rel_tol`),
    then fewer servers, then the shorter closed loop of the robots (sum over classes of 1/bound)."""
    if abs(p.objective - q.objective) > rel_tol * max(abs(p.objective), abs(q.objective)):
        return (1 if p.objective > q.objective else -1), "a higher objective"
    if len(p.servers) != len(q.servers):
        return (1 if len(p.servers) < len(q.servers) else -1), "the same objective on fewer servers"

    def loop(plan_: Plan) -> float:
        return sum(1.0 / closed_loop_hz(profiles, plan_.servers, factory.tasks[c.task])
                   for c in factory.fleet if c.task in plan_.rates_hz)

    lp, lq = loop(p), loop(q)
    if lp != lq:
        return (1 if lp < lq else -1), "the same objective and servers, a shorter closed loop"
    return 0, "a tie (the first tried kept)"


def _why(factory: Factory, profiles: Profiles, task: str, chosen: dict[str, bool], best: Plan,
         results: list[tuple[dict[str, bool], Plan | None, str]], rel_tol: float) -> str:
    """One line: how `task`'s System 1 and System 2 are served, and why not the other way."""
    t = factory.tasks[task]
    (n1, c1), (n2, c2) = t.component("system1"), t.component("system2")
    one = f"{n1}+{n2} from one stream of {t.combined_model}"
    apart = f"{n1} on {c1.model}, {n2} on {c2.model}"
    other = next(((p, why) for v, p, why in results if v == {**chosen, task: not chosen[task]}), None)
    mine, theirs = (one, apart) if chosen[task] else (apart, one)
    if other is None:  # more optional tasks than MAX_COMBINATIONS_TASKS: all one way or the other
        return f"{mine} (every task with a combined_model served the same way: the better of the two)"
    if other[0] is None:
        return f"{mine}: {theirs} is infeasible ({other[1]})"
    o = other[0]

    def said(p: Plan) -> str:
        return f"objective {p.objective:.4g}, {len(p.servers)} servers, {task} at {p.rates_hz[task]:.4g} Hz"

    reason = _compare(factory, profiles, best, o, rel_tol)[1]
    return f"{mine} ({said(best)}) rather than {theirs} ({said(o)}): {reason}"


def _plan(factory: Factory, profiles: Profiles, *, rel_tol: float = 1e-3, time_budget_s: float = 60.0,
          clock: Callable[[], float] = time.perf_counter) -> Plan:
    t0 = clock()
    check_against_profiles(factory, profiles)
    budget = factory.servers.count
    obligations = provision_obligations(factory, profiles, budget)
    goal_budget = budget - len(obligations)
    classes = [c.task for c in factory.fleet]
    weights = {c.task: c.weight * c.robots for c in factory.fleet}
    hi = {c: f_upper(factory.tasks[c]) for c in classes}
    lo = {}
    for c in factory.fleet:
        f_min = c.min_throughput_hz / c.robots
        if f_min > hi[c.task]:
            raise Infeasible(f"min_throughput_hz: task {c.task!r} asks {c.min_throughput_hz:g} actions/s from "
                             f"{c.robots} robots, above {hi[c.task] * c.robots:.3g} even with zero latency")
        lo[c.task] = max(f_min, hi[c.task] * 1e-3)
    first = pack_goal(factory, profiles, lo, goal_budget)
    if not first.ok:
        wanted = ", ".join(f"{c}: {lo[c] * factory.fleet_class(c).robots:.3g} actions/s" for c in classes)
        raise Infeasible(f"{first.reason} (at the minimum throughputs {wanted})")
    best, best_rates, steps = first, dict(lo), 1
    # One class: binary search on f. Several: the adaptive frontier search (move the dimension with the
    # largest possible weighted gain halfway to its bound; an infeasible point prunes that bound, valid
    # because the other dimensions only grow). With one class the two coincide.
    while clock() - t0 < time_budget_s:
        open_dims = {c: weights[c] * (hi[c] - best_rates[c]) for c in classes
                     if hi[c] - best_rates[c] > rel_tol * hi[c]}
        if not open_dims:
            break
        c = max(open_dims, key=open_dims.get)
        cand = dict(best_rates)
        cand[c] = (best_rates[c] + hi[c]) / 2
        result = pack_goal(factory, profiles, cand, goal_budget)
        steps += 1
        if result.ok:
            best, best_rates = result, cand
        else:
            hi[c] = cand[c]
    servers = obligations + best.servers
    for i, s in enumerate(servers):
        s.index = i
    routing, robot_task = route(factory, servers)
    objective = sum(weights[c] * best_rates[c] for c in classes)
    throughput = sum(factory.fleet_class(c).robots * best_rates[c] for c in classes)
    return Plan(servers, best_rates, routing, robot_task, objective, throughput, clock() - t0, steps)


def robot_ids(task: str, robots: int) -> list[str]:
    return [f"{task}-r{i}" for i in range(robots)]


def route(factory: Factory, servers: list[ServerPlan]) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Deal each stream's robots to the servers holding its shares, in order; returns routing and classes."""
    routing: dict[str, dict[str, int]] = {}
    robot_task: dict[str, str] = {}
    cursor: dict[str, int] = {}
    for cls_ in factory.fleet:
        for rid in robot_ids(cls_.task, cls_.robots):
            routing[rid] = {}
            robot_task[rid] = cls_.task
    for s in servers:
        for sh in s.shares:
            ids = robot_ids(sh.stream.task, sh.stream.robots)
            start = cursor.get(sh.stream.label, 0)
            sh.robot_ids = ids[start:start + sh.robots]
            cursor[sh.stream.label] = start + sh.robots
            for rid in sh.robot_ids:
                routing[rid][sh.stream.component] = s.index
                if sh.stream.text_component:  # the same server answers its System 2
                    routing[rid][sh.stream.text_component] = s.index
    return routing, robot_task
