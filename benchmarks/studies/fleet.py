"""Fleet scheduling benchmark: a discrete-event simulation of N robots sharing one policy server.

The model counterpart of `benchmarks/studies/fleet_zenoh.py` (the same traces over real Zenoh and a real
server, in real time): it runs minutes of fleet time in seconds, so it can afford many seeds and
wide sweeps of the schedulers' settings.

What is real and what is simulated:

- REAL: the request schedulers (`RoundRobinScheduler`, `FifoScheduler`, `WaitRatioScheduler`, built
  by `make_scheduler` as the server builds them), driven through the exact calls the server makes
  (`on_arrival` with the `ExecutionInfo` a robot sends, `pick(ready, now, max_batch)`, `on_served`,
  and `forget` when a robot's request carries a new episode, as the server's session does, or the
  robot leaves); the batch-latency model (`SyntheticPolicy.latency_s`, a GPU-like profile: 60 ms at
  batch 1 rising sublinearly to 200 ms at 16, a 4.8x peak-to-single throughput ratio); each robot's
  `SendTrigger` (its RTT bookkeeping and send rule: send when the buffered actions last less than
  ``buffer_time_s()``, by default ``p90(RTT) + 1 dt`` and 0.5 s before the first reply) and its
  `ChunkIntake` (seq_id -> step at capture, RTT, horizon cut, stale trim), as in the reference client.
- SIMULATED: time (a virtual clock, so a 100-robot fleet runs for minutes of robot time in seconds),
  the network (a fixed one-way delay) and the robots. There is no Zenoh, no codec and no inference:
  the server is busy for ``latency_s(batch size)`` per dispatch and idle otherwise, exactly like the
  real loop with the synthetic policy, minus decoding and transport overheads.

Workload (as in the Kairos paper, sections 2.2 and 5.1): a robot runs tasks back to back (``fleet`` mode,
N robots) or tasks arrive by a Poisson process, each on its own robot (``online`` mode). A task is a
trace of rounds; round j executes ``H_j`` actions at 30 Hz from chunk j (the execution horizon), and
the request for round j+1 leaves while round j executes, when the send rule says so; its chunk is
meant for the step after round j (so the intake's stale trim finds nothing executed past it), and the
intake keeps its first ``H_{j+1}`` rows (the chunk's execution horizon). That alignment is the
model's idealisation: the reference client aligns a chunk to the step its observation was captured
at, so a request sent L actions ahead buys only H - L new ones; ``--chunk-start capture`` models
that (rounds then repeat until the task's length is executed), and it is what matches the real
stack (docs/benchmarks.md, "Fleet over real Zenoh"). If chunk j+1 is
not there when round j's last action is done, the robot stands still: those control steps are
*stalled* (the wait for a task's first chunk is not: the robot has not started moving; it counts in
the task's latency). Traces come from `benchmarks/studies/fleet_traces.py` (documented there; ``--horizon`` picks each
task's static or dynamic horizons) or a JSON file.

Metrics, over the measurement window (after a warm-up), each the mean ± sample sd over seeds:

- actions/s: actions executed by the whole fleet per second of robot time (throughput);
- stalled %: control steps a robot in a task had no action, counted from the task's arrival (the
  wait for its first chunk included) or, the old definition, only after its first chunk (mid-task);
- wait mean / p99: per request, from its arrival at the server to the start of its inference;
- capture-to-inference age p50 / p99 of the served observations (with ``refresh_s``, the
  client-side re-fetch of protocol.md §10.7: a waiting robot publishes a fresh capture every
  ``refresh_s``, kept only while its request still waits);
- task latency mean / p25 / p95: first request to last action executed, for tasks that start after
  the warm-up and finish before the end; against FIFO as the paired change on the same seed;
- largest fleet (tasks back to back) within the stall budget, to one robot (doubling, then bisection).

Sites and tiers (``Config.tiers``, ``--hybrid``): by default one server with one GPU, as above. The
model also runs several edge GPUs behind one scheduler (``edge_engines``), independent servers with a
static robot assignment (``servers``), a server at a cloud site behind a WAN (``tiers=cloud``) and an
edge scheduler that places each request on its edge GPUs or a cloud engine with the real
`lerobot_zenoh/scheduling/placement.place` (``tiers=hybrid``); each request carries payload and
history bytes and the tier that served it is recorded. Cloud-only can also be the edge relaying to
a cloud engine (``cloud_site=engine``, as `benchmarks/studies/hybrid.py` runs it); a cloud engine holds at
most its batch in flight, as the product's dispatcher does (``cloud_in_flight``). WAN delays
(``wan_one_way_s``, ``--wan-ms``) are ONE WAY, as Kairos' "base latency" and `benchmarks/studies/hybrid.py
--wan-ms`. `benchmarks/studies/fleet_hybrid_check.py` sets the model beside a real hybrid run. ``make bench-hybrid-sim`` runs Kairos Fig. 13
and 17, scale-out and the wait-ratio re-measure (docs/benchmarks.md, "Edge and cloud in the model").

Run ``python -m benchmarks.studies.fleet --help``; ``make bench-fleet-sim`` runs the full study and rewrites the
generated part of the "Fleet scheduling" section of docs/benchmarks.md; ``--refetch`` prints the
re-fetch table of protocol.md §10.7.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


from benchmarks.studies import fleet_traces  # noqa: E402
from benchmarks.harness.docs_blocks import write_docs_block  # noqa: E402
from benchmarks.harness.robot import SimulatedRobot  # noqa: E402
from lerobot_zenoh.protocol.messages import ExecutionInfo  # noqa: E402
from lerobot_zenoh.scheduling.batch_profile import profile_batch_sizes, saturation_batch_size  # noqa: E402
from lerobot_zenoh.scheduling.engine_load import EngineLoad  # noqa: E402
from lerobot_zenoh.scheduling.placement import (  # noqa: E402
    CLOUD,
    EDGE,
    BatchProfile,
    EngineView,
    RequestView,
    place,
)
from lerobot_zenoh.scheduling.request_schedulers import RequestScheduler, make_scheduler  # noqa: E402
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig  # noqa: E402
from lerobot_zenoh.scheduling.wait_ratio import WaitRatioScheduler  # noqa: E402
from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig  # noqa: E402

FPS = fleet_traces.FPS
DT_S = 1.0 / FPS
GPU_PROFILE_MS = fleet_traces.GPU_PROFILE_MS
#: A VLA-shaped profile: the tiny SmolVLA's measured CPU medians by batch size (docs/benchmarks.md,
#: "VLAs: chunk latency by batch size": 42.5, 46.0, 51.8, 80.5 ms at 1, 2, 4, 8) scaled so that
#: batch 1 takes 60 ms like the GPU-like profile; 16 extrapolated on the 4 -> 8 slope (7.2 ms per row).
VLA_PROFILE_MS = {b: round(60.0 * ms / 42.5, 1)
                  for b, ms in {1: 42.5, 2: 46.0, 4: 51.8, 8: 80.5, 16: 80.5 + 8 * (80.5 - 51.8) / 4}.items()}
PROFILES = {"gpu": GPU_PROFILE_MS, "vla": VLA_PROFILE_MS}
ONE_WAY_S = 0.0025  # Kairos' Wi-Fi 7 base latency robot <-> edge server
#: The cloud GPU against the edge GPU, as an A100 (80 GB) against an RTX A6000 (Kairos' testbed):
#: NVIDIA's data sheets give 312 against 155 dense BF16 tensor TFLOPS (2.0x) and 2,039 against
#: 768 GB/s of memory bandwidth (2.7x); a batch of a diffusion/flow policy is compute-bound at the
#: batch sizes that matter, so the cloud runs the same profile in half the time.
CLOUD_SCALE = 0.5
TIER_MODES = ("edge", "cloud", "hybrid")


# ------------------------------------------------------------------------------------ simulation


@dataclass
class Config:
    scheduler: str = "fifo"  # fifo | fifo_running_first | round_robin | wait_ratio
    max_batch: int = 1
    buckets: int = 10
    aging: int = 1
    first_request: str = WaitRatioScheduler().first_request
    mode: str = "fleet"  # fleet: N robots, tasks back to back; online: Poisson task arrivals
    robots: int = 20
    rate_per_s: float = 1.0  # online mode
    arrivals_s: float = 0.0  # online mode: > 0, tasks arrive until then only (the window then drains to duration_s)
    duration_s: float = 240.0
    warmup_s: float = 30.0
    one_way_s: float = ONE_WAY_S
    trigger: str = "rtt"  # rtt: p90(RTT) + 1 dt (reference client); fixed:K: when K actions remain
    refresh_s: float = 0.0  # > 0: a robot whose request waits this long publishes a fresh capture (re-fetch)
    # after_buffer: a round's chunk starts at the step after the buffered actions (nothing is lost by
    # asking ahead); capture: at the step the robot was about to execute when it sent, as the reference
    # client aligns it (the rows for steps executed meanwhile are dropped, the overlap with the buffer
    # blended: a request buys H minus the actions buffered at its send), rounds repeat until the task's
    # length is executed (`benchmarks/studies/fleet_zenoh.py` sets the model so beside the real stack).
    chunk_start: str = "after_buffer"
    # 0: robots act in continuous time (a send the instant the trigger fires, a chunk used the instant
    # it arrives). N > 0: as the real driver (`benchmarks/studies/fleet_zenoh.py`), each robot acts only on its
    # 30 Hz tick, the ticks spread over N phases of the period: a send waits for the robot's next tick
    # after the trigger fires, a chunk's first action for its next tick after arrival.
    tick_phases: int = 0
    # Sites and tiers (docs/benchmarks.md, "Edge and cloud in the model"). The defaults are the one-GPU
    # server above. tiers: edge (every engine on the robots' site), cloud (one server at a cloud site:
    # the robots reach it through the edge gateway and the WAN, each request and chunk crossing it) or
    # hybrid (an edge scheduler placing each request on its edge engines or the cloud's by
    # `scheduling/placement.place`).
    tiers: str = "edge"
    servers: int = 1  # independent servers, each its own scheduler; robot i is assigned to server i % servers
    edge_engines: int = 1  # engines behind each server's one scheduler, on its site, each `max_batch` wide
    cloud_engines: int = 1  # tiers=hybrid: engines at the cloud site
    cloud_scale: float = 0.5  # a cloud batch takes the edge's latency x this (CLOUD_SCALE)
    cloud_profile_ms: dict | None = None  # instead of cloud_scale: the cloud's own {batch size: ms}
    cloud_max_batch: int = 0  # 0: max_batch
    # Most requests in flight on a cloud engine: "capacity" (its batch width, as the product's
    # dispatcher, `server/dispatch/dispatcher.py`, limits it: the engine idles for a round trip between batches
    # when saturated) or "cover" (`cloud_in_flight`: enough to keep it busy through the round trip);
    # `cloud_max_in_flight` > 0 sets a number instead.
    cloud_in_flight: str = "capacity"
    cloud_max_in_flight: int = 0
    # tiers=cloud: "server" (a whole server at the cloud site: the robots' link crosses the WAN) or
    # "engine" (as `benchmarks/studies/hybrid.py` runs it: the edge scheduler dispatches every request to a
    # cloud engine process and relays its chunk, the cloud engine's in-flight limit included).
    cloud_site: str = "server"
    # Per request, costs the real stack adds to the synthetic GPU's sleep (docs/benchmarks.md, "The model
    # against the real runs"): `edge_overhead_s` on the robot <-> scheduler path (codec, Zenoh hops, the
    # scheduler's loop; not holding a GPU) and `engine_overhead_s` per batch on a remote engine (the
    # dispatch hop's encode / decode and its extra Zenoh hop, holding that engine).
    edge_overhead_s: float = 0.0
    engine_overhead_s: float = 0.0
    # Each pass takes its profile's time x a factor drawn uniformly in [1 - pass_jitter, 1 + pass_jitter]
    # (its own random stream: the arrivals stay those of `seed`). 0: every pass exactly its profile.
    # A real GPU, host and link never repeat a time exactly; with none, an overloaded point can lock
    # into one rhythm of batches that a 1 % change of the profile turns into another.
    pass_jitter: float = 0.0
    wan_one_way_s: float = 0.1  # edge <-> cloud, ONE WAY (each direction); a round trip is twice it
    wan_bandwidth_bps: float = 125e6  # bytes/s (1 Gbit/s)
    payload_bytes: int = 133_000  # one observation on the wire (2 x 480x640 JPEG, docs/benchmarks.md)
    history_bytes: int = 0  # per request, for a stateful policy whose history travels with it
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tiers not in TIER_MODES:
            raise ValueError(f"tiers must be one of {TIER_MODES}, got {self.tiers!r}")
        if self.servers < 1 or self.edge_engines < 1 or self.cloud_engines < 0:
            raise ValueError("servers and edge_engines must be >= 1, cloud_engines >= 0")
        if self.cloud_in_flight not in ("capacity", "cover"):
            raise ValueError(f"cloud_in_flight must be 'capacity' or 'cover', got {self.cloud_in_flight!r}")
        if not 0.0 <= self.pass_jitter < 1.0:
            raise ValueError(f"pass_jitter must be in [0, 1), got {self.pass_jitter}")
        if self.cloud_site not in ("server", "engine"):
            raise ValueError(f"cloud_site must be 'server' or 'engine', got {self.cloud_site!r}")

    def label(self) -> str:
        if self.scheduler != "wait_ratio":
            return self.scheduler
        return f"wait_ratio(B={self.buckets},A={self.aging},{self.first_request})"


class FifoRunningFirst:
    """A model-only rung: FIFO, but requests of running tasks (served before in this episode) go
    before the first request of a new task. What ordering alone buys, without wait ratios."""

    name = "fifo_running_first"
    needs_execution_info = False

    def __init__(self) -> None:
        self._fifo = make_scheduler("fifo")
        self._running: set[str] = set()

    def on_arrival(self, client_id, now_s, execution=None):
        self._fifo.on_arrival(client_id, now_s, execution)

    def rank(self, ready, now_s):
        return sorted(self._fifo.rank(ready, now_s), key=lambda c: c not in self._running)  # stable: FIFO inside

    def took(self, chosen, ranked, now_s):
        pass

    def pick(self, ready, now_s, max_batch=1):
        return self.rank(ready, now_s)[:max_batch]

    def on_served(self, client_ids, now_s, duration_s):
        self._fifo.on_served(client_ids, now_s, duration_s)
        self._running.update(client_ids)

    def forget(self, client_id):
        self._fifo.forget(client_id)
        self._running.discard(client_id)

    def stats(self):
        return self._fifo.stats()


def scheduler_for(cfg: Config) -> RequestScheduler:
    """The scheduler the server would build from a manifest naming these settings."""
    if cfg.scheduler == FifoRunningFirst.name:
        return FifoRunningFirst()
    settings = {}
    if cfg.scheduler == "wait_ratio":
        settings = dict(buckets=cfg.buckets, aging=cfg.aging, first_request=cfg.first_request)
    return make_scheduler(cfg.scheduler, "scheduler", **settings)


def send_rule(trigger: str) -> SendTriggerConfig:
    """``rtt``: the reference client's default; ``fixed:K``: send when K actions remain."""
    if trigger == "rtt":
        return SendTriggerConfig()
    if trigger.startswith("fixed:"):
        # fixed:0 is synchronous inference: send when the buffer is empty (the rule wants a time > 0)
        return SendTriggerConfig(buffer_time_s=max(int(trigger.split(":", 1)[1]) * DT_S, 1e-9))
    raise SystemExit(f"unknown trigger {trigger!r}")


@dataclass
class _Robot:
    client_id: str
    # The harness's simulated robot (the client's SendTrigger and ChunkIntake): its send rule and intake,
    # kept across tasks (the robot's link does not change); its buffer is this model's (the fields below).
    sim: SimulatedRobot
    trace: list[int] = field(default_factory=list)
    episode: int = 0
    round: int = 0  # index of the round whose chunk is requested / next delivered
    task_start_s: float = 0.0
    free_at_s: float = 0.0  # when the robot runs out of actions
    exec_start_s: float = 0.0  # start of the execution phase in progress
    end_step: int = 0  # the robot's step count when its buffered actions are done (at free_at_s)
    seq: int = 0
    answered: int = 0  # the seq whose chunk arrived last
    buffered_total: int = 0  # chunk_start=capture: actions of the task put in the buffer so far
    phase_s: float | None = None  # Config.tick_phases: the robot's tick offset in the period (None: no ticks)

    def tick(self, t: float) -> float:
        """The robot's first tick at or after `t` (`t` itself without ticks)."""
        if self.phase_s is None:
            return t
        return self.phase_s + math.ceil((t - self.phase_s) / DT_S - 1e-9) * DT_S

    def next_step(self, t: float) -> int:
        """The step the robot executes next at `t` (the buffer's ``next_step``)."""
        left = math.ceil((self.free_at_s - t) / DT_S - 1e-9) if t < self.free_at_s else 0
        return self.end_step - left


@dataclass
class Result:
    cfg: Config
    actions_per_s: float
    stalled_pct: float  # mid-task only (the old definition)
    stalled_arrival_pct: float  # counted from the task's arrival: the wait for its first chunk too
    wait_mean_ms: float
    wait_p99_ms: float
    latency_mean_s: float
    latency_p25_s: float
    latency_p95_s: float
    tasks_done: int
    batch_mean: float
    requests: int
    age_p50_ms: float = 0.0  # capture-to-inference age of served observations
    age_p99_ms: float = 0.0
    refreshes_per_request: float = 0.0  # re-fetch: fresh captures published per served request
    offload_pct: float = 0.0  # served requests that ran on a cloud engine (tiers=hybrid; 100 for tiers=cloud)
    sd: dict[str, float] = field(default_factory=dict)  # sample standard deviation over seeds
    runs: list[Result] = field(default_factory=list, repr=False)  # one per seed

    @property
    def slo_pct(self) -> float:
        return 100.0 - self.stalled_pct


@dataclass(eq=False)
class _Engine:
    """One GPU behind a scheduler: the scheduler's bookkeeping of it (`running`, `busy_until_s`, its
    `EngineView`) and what it really does (`queue`, `gpu_busy`)."""

    engine_id: str
    tier: str
    capacity: int
    latency_s: Callable[[int], float]
    profile: BatchProfile
    one_way_s: float = 0.0  # scheduler <-> engine, each direction
    bandwidth_bps: float = math.inf
    max_in_flight: int = 0
    overhead_s: float = 0.0  # per batch, beyond the profile (a remote engine's dispatch hop: Config.engine_overhead_s)
    running: int = 0  # dispatched and not answered (the scheduler's count)
    # The scheduler's bookkeeping of what it sent and what came back: the server's own code
    # (`scheduling.engine_load.EngineLoad`, as `server/dispatch/dispatcher.py` keeps it per engine).
    load: EngineLoad | None = None
    queue: list = field(default_factory=list)  # dispatched groups that reached it: (ids, dispatched at)
    gpu_busy: bool = False

    def __post_init__(self) -> None:
        self.load = EngineLoad(self.profile, self.capacity)

    @property
    def busy_until_s(self) -> float:
        return self.load.busy_until_s

    def view(self) -> EngineView:
        return EngineView(self.engine_id, self.tier, self.capacity, self.running, self.busy_until_s, self.profile,
                          rtt_s=2 * self.one_way_s, bandwidth_bps=self.bandwidth_bps, max_in_flight=self.max_in_flight)


@dataclass(eq=False)
class _Server:
    """One scheduler and the engines it feeds; `ready` / `captured` are its clients' slots."""

    scheduler: RequestScheduler
    engines: list[_Engine]
    ready: dict[str, float] = field(default_factory=dict)  # client -> first arrival of its waiting request
    captured: dict[str, float] = field(default_factory=dict)  # client -> capture time of the observation in its slot

    @property
    def one_loop(self) -> bool:
        """One local engine and no other: the server's own inference loop (`pick` up to its batch)."""
        return len(self.engines) == 1 and self.engines[0].one_way_s == 0


def cloud_in_flight(width: int, batch_s: float, rtt_s: float) -> int:
    """Requests a cloud engine may have in flight: enough full batches to keep its GPU busy through a
    round trip (``ceil(rtt / batch latency)``), the running one, and one queued behind it."""
    return width * (2 + math.ceil(rtt_s / batch_s))


def profile_of(latency_s: Callable[[int], float], largest: int = 64) -> BatchProfile:
    """The latency model as a placement profile: its value at every batch size up to `largest`
    (both interpolate linearly between sizes and extrapolate on the last slope, so they agree)."""
    return BatchProfile({b: latency_s(b) for b in range(1, largest + 1)})


class FleetSim:
    """One run: the event loop of the robots, the network and the servers (by default one, one GPU)."""

    def __init__(self, cfg: Config, traces: Sequence[list[int]], latency_s: Callable[[int], float]):
        self.cfg = cfg
        self.traces = traces
        self.latency_s = latency_s
        self.servers = [self._server(i) for i in range(cfg.servers)]
        self.send_rule = send_rule(cfg.trigger)
        self.rng = np.random.default_rng(cfg.seed)
        self._jitter_rng = np.random.default_rng((cfg.seed, 1))  # its own stream: the arrivals are `seed`'s
        self._events: list = []
        self._tie = itertools.count()
        self.robots: dict[str, _Robot] = {}
        self.episodes: dict[str, int] = {}  # the servers' view: client -> episode of its last request
        # robot <-> its server, each direction: the robot's link, and for tiers=cloud the WAN and the
        # observation's transfer across it too
        self.one_way_s = cfg.one_way_s + cfg.edge_overhead_s / 2
        if cfg.tiers == "cloud" and cfg.cloud_site == "server":
            self.one_way_s += cfg.wan_one_way_s + cfg.payload_bytes / cfg.wan_bandwidth_bps
        self.served_tier: list[tuple[str, int, str]] = []  # (client, seq, tier) of each request served in the window
        self.ages: list[float] = []  # capture-to-inference age of each served observation
        self.refreshes = 0  # fresh captures published by waiting robots
        self.refreshes_late = 0  # of those, landing after their request was dispatched (dropped)
        self._next_trace = int(self.rng.integers(len(traces)))
        self.w0, self.w1 = cfg.warmup_s, cfg.duration_s
        self.executed = 0.0
        self.stalled = 0.0
        self.first_wait = 0.0  # control steps between a task's arrival and its first action
        self.waits: list[float] = []
        self.latencies: list[float] = []
        self.batches: list[int] = []

    # -- event plumbing ----------------------------------------------------------------------

    def _at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._tie), fn, args))

    def run(self) -> Result:
        cfg = self.cfg
        if cfg.mode == "fleet":
            for i in range(cfg.robots):
                robot = self.robots[f"r{i}"] = self._robot(f"r{i}")
                self._at(self.rng.uniform(0, 1.0), self._start_task, robot)  # staggered start
        else:
            self._at(self.rng.exponential(1 / cfg.rate_per_s), self._online_arrival, 0)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            if t > self.w1:
                break
            fn(t, *args)
        return self._result()

    def _count(self, start: float, end: float) -> float:
        """Control steps of [start, end] inside the measurement window."""
        return max(0.0, min(end, self.w1) - max(start, self.w0)) / DT_S

    # -- robots ------------------------------------------------------------------------------

    def _robot(self, client_id: str) -> _Robot:
        robot = _Robot(client_id, SimulatedRobot(client_id, dt_s=DT_S, send_rule=self.send_rule))
        if self.cfg.tick_phases:  # as the driver: robot i ticks in phase i % N of the period
            robot.phase_s = (int(client_id[1:]) % self.cfg.tick_phases) * DT_S / self.cfg.tick_phases
        return robot

    def _online_arrival(self, t: float, n: int) -> None:
        robot = self.robots[f"t{n}"] = self._robot(f"t{n}")
        self._start_task(t, robot)
        nxt = t + self.rng.exponential(1 / self.cfg.rate_per_s)
        if not self.cfg.arrivals_s or nxt < self.cfg.arrivals_s:
            self._at(nxt, self._online_arrival, n + 1)

    def _start_task(self, t: float, robot: _Robot) -> None:
        robot.trace = self.traces[self._next_trace % len(self.traces)]
        self._next_trace += 1
        robot.episode += 1
        robot.round = 0
        robot.buffered_total = 0
        robot.task_start_s = t
        robot.free_at_s = t  # nothing buffered: the robot waits from now on
        robot.exec_start_s = t
        if robot.phase_s is not None and robot.tick(t) > t:
            self._at(robot.tick(t), self._send, robot)  # the first request leaves on the robot's next tick
        else:
            self._send(t, robot)

    def _send(self, t: float, robot: _Robot) -> None:
        robot.seq += 1
        # The chunk is for the step after the buffered actions (round j+1 follows round j), or for the
        # step about to be executed now (chunk_start=capture, the reference client's alignment).
        capture = self.cfg.chunk_start == "capture"
        robot.sim.record_send(robot.seq, robot.next_step(t) if capture else robot.end_step, t)
        buffered = max(0, round((robot.free_at_s - t) / DT_S))
        info = ExecutionInfo(task_elapsed_s=t - robot.task_start_s, actions_buffered=buffered, control_period_s=DT_S)
        self._at(t + self.one_way_s, self._arrive, robot.client_id, robot.episode, info, t)
        if self.cfg.refresh_s > 0:
            self._at(t + self.cfg.refresh_s, self._refresh, robot, robot.seq)

    def _refresh(self, t: float, robot: _Robot, seq: int) -> None:
        """Re-fetch, client side: a request still unanswered after `refresh_s` is published again
        with a fresh capture, every `refresh_s`, until its chunk arrives. The server keeps it only
        while the request still waits (it carries the request's seq_id); later it is dropped."""
        if robot.seq != seq or robot.client_id not in self.robots or robot.answered == seq:
            return
        if t >= self.w0:
            self.refreshes += 1
        buffered = max(0, round((robot.free_at_s - t) / DT_S))
        info = ExecutionInfo(task_elapsed_s=t - robot.task_start_s, actions_buffered=buffered, control_period_s=DT_S)
        self._at(t + self.one_way_s, self._arrive_refresh, robot.client_id, info, t)
        self._at(t + self.cfg.refresh_s, self._refresh, robot, seq)

    def _arrive_refresh(self, t: float, client_id: str, info: ExecutionInfo, captured_s: float) -> None:
        server = self.server_of(client_id)
        if client_id not in server.ready:  # dispatched meanwhile (or gone): the refresh is dropped
            if t >= self.w0:
                self.refreshes_late += 1
            return
        server.scheduler.on_arrival(client_id, t, info)  # a newer observation in the slot, as on the server
        server.captured[client_id] = captured_s

    def _deliver(self, t: float, robot: _Robot, seq: int) -> None:
        robot.answered = seq
        if self.cfg.chunk_start == "capture":
            self._deliver_at_capture(t, robot, seq)
            return
        taken = robot.sim.plan(seq, fleet_traces.CHUNK_SIZE, t, robot.next_step(t), execution_horizon=robot.trace[robot.round])
        usable = robot.tick(t)  # the chunk's first action can run on the robot's next tick
        if usable > robot.free_at_s and robot.round > 0:  # ran dry mid-task
            self.stalled += self._count(robot.free_at_s, usable)
        elif robot.round == 0:  # the wait for a task's first chunk: a stall counted from arrival
            self.first_wait += self._count(robot.task_start_s, usable)
        start = max(usable, robot.free_at_s)
        end = start + taken.rows * DT_S
        self.executed += self._count(start, end)
        robot.exec_start_s, robot.free_at_s = start, end
        robot.end_step += taken.rows
        robot.round += 1
        if robot.round < len(robot.trace):
            # The send rule inverted for an event clock: the instant the buffered actions fall to
            # the trigger's buffer_time_s (the client checks it once per control period).
            self._at(robot.tick(max(t, end - robot.sim.buffer_time_s())), self._send, robot)
        else:
            if robot.task_start_s >= self.w0 and end <= self.w1:
                self.latencies.append(end - robot.task_start_s)
            if self.cfg.mode == "fleet":
                self._at(end, self._start_task, robot)
            else:
                self._at(end, self._leave, robot)

    def _deliver_at_capture(self, t: float, robot: _Robot, seq: int) -> None:
        """chunk_start=capture: the chunk's rows are for the steps from the capture on; the intake trims
        the expired ones, the buffer drops those executed meanwhile and blends those still buffered, so
        only the rows past the buffer's end are new. Round j keeps the trace's H_j rows (the rounds past
        the trace's, needed because each buys fewer new actions, its last uncut H)."""
        trace = robot.trace
        h = trace[min(robot.round, max(0, len(trace) - 2))] if robot.round >= len(trace) - 1 else trace[robot.round]
        taken = robot.sim.plan(seq, fleet_traces.CHUNK_SIZE, t, robot.next_step(t), execution_horizon=h)
        new = max(0, taken.first_step + taken.rows - robot.end_step) if taken.accepted and taken.rows else 0
        new = min(new, sum(trace) - robot.buffered_total)  # past the task's end: never executed
        usable = robot.tick(t)
        if usable > robot.free_at_s and robot.round > 0:  # ran dry mid-task
            self.stalled += self._count(robot.free_at_s, usable)
        elif robot.round == 0:
            self.first_wait += self._count(robot.task_start_s, usable)
        start = max(usable, robot.free_at_s)
        end = start + new * DT_S
        self.executed += self._count(start, end)
        if new:
            robot.exec_start_s, robot.free_at_s = start, end
        robot.end_step += new
        robot.buffered_total += new
        robot.round += 1
        if robot.buffered_total < sum(trace):
            self._at(robot.tick(max(t, robot.free_at_s - robot.sim.buffer_time_s())), self._send, robot)
        else:
            if robot.task_start_s >= self.w0 and end <= self.w1:
                self.latencies.append(end - robot.task_start_s)
            self._at(end, self._start_task if self.cfg.mode == "fleet" else self._leave, robot)

    def _leave(self, t: float, robot: _Robot) -> None:
        self.server_of(robot.client_id).scheduler.forget(robot.client_id)
        self.episodes.pop(robot.client_id, None)
        del self.robots[robot.client_id]

    # -- server ------------------------------------------------------------------------------

    def _server(self, index: int) -> _Server:
        """Server `index` as `Config` describes it: its scheduler, its edge engines (`max_batch` wide, the
        latency model's profile) and, with tiers=hybrid, the cloud's engines behind the WAN."""
        cfg = self.cfg
        lat = self.latency_s
        cloud_lat = _scaled(self.latency_s, cfg.cloud_scale)
        if cfg.cloud_profile_ms:
            cloud_lat = BatchProfile.from_ms(cfg.cloud_profile_ms).latency_s
        cloud_server = cfg.tiers == "cloud" and cfg.cloud_site == "server"
        if cloud_server:  # a faster GPU; the WAN is in the robots' link (self.one_way_s)
            lat = cloud_lat
        width = (cfg.cloud_max_batch or cfg.max_batch) if cloud_server else cfg.max_batch
        engines = [] if cfg.tiers == "cloud" and not cloud_server else [
            _Engine(f"s{index}.edge{i}", EDGE, width, lat, profile_of(lat)) for i in range(cfg.edge_engines)]
        if cfg.tiers == "hybrid" or not cloud_server and cfg.tiers == "cloud":
            width = cfg.cloud_max_batch or cfg.max_batch
            in_flight = cfg.cloud_max_in_flight or (
                width if cfg.cloud_in_flight == "capacity"
                else cloud_in_flight(width, cloud_lat(width), 2 * cfg.wan_one_way_s))
            engines += [_Engine(f"s{index}.cloud{i}", CLOUD, width, cloud_lat, profile_of(cloud_lat),
                                one_way_s=cfg.wan_one_way_s, bandwidth_bps=cfg.wan_bandwidth_bps,
                                max_in_flight=in_flight, overhead_s=cfg.engine_overhead_s)
                        for i in range(cfg.cloud_engines)]
        return _Server(scheduler_for(cfg), engines)

    def server_of(self, client_id: str) -> _Server:
        """Static assignment: robot / task number i is served by server i % servers."""
        return self.servers[int(client_id[1:]) % len(self.servers)]

    def _arrive(self, t: float, client_id: str, episode: int, info: ExecutionInfo, captured_s: float) -> None:
        server = self.server_of(client_id)
        if self.episodes.get(client_id) != episode:  # the server's session: a new episode resets the task
            self.episodes[client_id] = episode
            server.scheduler.forget(client_id)
        server.scheduler.on_arrival(client_id, t, info)
        server.ready.setdefault(client_id, t)
        server.captured[client_id] = captured_s
        self._dispatch(t, server)

    def _dispatch(self, t: float, server: _Server) -> None:
        if not server.ready:
            return
        if server.one_loop:  # the server's own loop: serve up to a batch whenever the GPU is free
            engine = server.engines[0]
            if engine.running:
                return
            chosen = server.scheduler.pick(list(server.ready), t, engine.capacity)
            if chosen:
                self._send_batch(t, server, engine, chosen)
            return
        if not any((e.running == 0) if e.tier == EDGE else (e.running < e.view().in_flight_limit)
                   for e in server.engines):
            return  # every engine busy or full: nothing can go before one answers
        ready = list(server.ready)
        order = server.scheduler.rank(ready, t)  # rank, then take: as the edge scheduler does
        requests = [RequestView(c, self.cfg.payload_bytes, self.cfg.history_bytes) for c in order]
        placement = place(requests, [e.view() for e in server.engines], t)
        if not placement.assigned:
            return  # a decision that sends nothing is no round: no request counts as skipped
        staying = set(placement.waiting)
        chosen = [c for c in order if c not in staying]
        server.scheduler.took(chosen, order, t)
        by_id = {e.engine_id: e for e in server.engines}
        for engine_id, ids in placement.assigned.items():
            self._send_batch(t, server, by_id[engine_id], ids)

    def _send_batch(self, t: float, server: _Server, engine: _Engine, chosen: list[str]) -> None:
        for client_id in chosen:
            arrival = server.ready.pop(client_id)
            captured = server.captured.pop(client_id)
            if t >= self.w0:
                self.waits.append(t - arrival)
                self.ages.append(t - captured)
                self.served_tier.append((client_id, self.robots[client_id].seq,
                                         CLOUD if self.cfg.tiers == "cloud" else engine.tier))
        if server.one_loop:  # as the server's loop: busy for latency(batch), then answers
            if t >= self.w0:
                self.batches.append(len(chosen))
            duration = engine.latency_s(len(chosen)) * self._jitter()
            engine.running = len(chosen)
            self._at(t + duration, self._done, server, chosen, duration)
            return
        bytes_ = len(chosen) * (self.cfg.payload_bytes + self.cfg.history_bytes)
        there = t + engine.one_way_s + bytes_ / engine.bandwidth_bps
        engine.running += len(chosen)
        engine.load.dispatched([(c, t) for c in chosen], t, there)
        self._at(there, self._engine_receive, server, engine, chosen, t)

    def _done(self, t: float, server: _Server, chosen: list[str], duration: float) -> None:
        server.scheduler.on_served(chosen, t, duration)
        server.engines[0].running = 0
        for client_id in chosen:
            robot = self.robots[client_id]
            self._at(t + self.one_way_s, self._deliver, robot, robot.seq)
        self._dispatch(t, server)

    # -- engines behind a placing scheduler (edge_engines > 1 or tiers=hybrid) --------------------

    def _engine_receive(self, t: float, server: _Server, engine: _Engine, ids: list[str], sent_s: float) -> None:
        engine.queue.append((ids, sent_s))
        if not engine.gpu_busy:
            self._engine_run(t, server, engine)

    def _engine_run(self, t: float, server: _Server, engine: _Engine) -> None:
        """The engine's GPU takes what reached it, whole dispatched groups up to its batch width."""
        groups, n = [], 0
        while engine.queue and (not groups or n + len(engine.queue[0][0]) <= engine.capacity):
            groups.append(engine.queue.pop(0))
            n += len(groups[-1][0])
        if t >= self.w0:
            self.batches.append(n)
        engine.gpu_busy = True
        self._at(t + engine.latency_s(n) * self._jitter() + engine.overhead_s, self._engine_done, server, engine, groups)

    def _jitter(self) -> float:
        j = self.cfg.pass_jitter
        return 1.0 + j * self._jitter_rng.uniform(-1.0, 1.0) if j else 1.0

    def _engine_done(self, t: float, server: _Server, engine: _Engine, groups: list) -> None:
        engine.gpu_busy = False
        for ids, sent_s in groups:
            self._at(t + engine.one_way_s, self._answered, server, engine, ids, sent_s)
        if engine.queue:
            self._engine_run(t, server, engine)

    def _answered(self, t: float, server: _Server, engine: _Engine, ids: list[str], sent_s: float) -> None:
        """The answers are back at the scheduler: its generation interval ends (from dispatch, the WAN
        included), the chunks go on to the robots (relayed by the edge), and it decides again."""
        server.scheduler.on_served(ids, t, t - sent_s)
        engine.running -= len(ids)
        for client_id in ids:  # the server's own correction: each answer tells when the engine was free
            engine.load.answered((client_id, sent_s), t - engine.one_way_s)
        for client_id in ids:
            robot = self.robots[client_id]
            self._at(t + self.one_way_s, self._deliver, robot, robot.seq)
        self._dispatch(t, server)

    def _result(self) -> Result:
        window = self.w1 - self.w0
        total = self.executed + self.stalled
        waits = np.array(self.waits or [0.0]) * 1000
        lat = np.array(self.latencies or [math.nan])
        ages = np.array(self.ages or [0.0]) * 1000
        return Result(
            cfg=self.cfg,
            actions_per_s=self.executed / window,
            stalled_pct=100.0 * self.stalled / total if total else 0.0,
            stalled_arrival_pct=(100.0 * (self.stalled + self.first_wait) / (total + self.first_wait)
                                 if total + self.first_wait else 0.0),
            wait_mean_ms=float(waits.mean()),
            wait_p99_ms=float(np.percentile(waits, 99)),
            latency_mean_s=float(np.mean(lat)),
            latency_p25_s=float(np.percentile(lat, 25)),
            latency_p95_s=float(np.percentile(lat, 95)),
            tasks_done=len(self.latencies),
            batch_mean=float(np.mean(self.batches)) if self.batches else 0.0,
            requests=len(self.waits),
            age_p50_ms=float(np.percentile(ages, 50)),
            age_p99_ms=float(np.percentile(ages, 99)),
            refreshes_per_request=self.refreshes / max(1, len(self.waits)),
            offload_pct=100.0 * sum(tier == CLOUD for _, _, tier in self.served_tier) / max(1, len(self.served_tier)),
        )


def _scaled(latency_s: Callable[[int], float], factor: float) -> Callable[[int], float]:
    return lambda b: latency_s(b) * factor


def gpu_latency(profile: str = "gpu") -> Callable[[int], float]:
    """The synthetic policy's batch-latency model with a profile of PROFILES (default GPU-like)."""
    return latency_of(PROFILES[profile])


def latency_of(profile_ms: dict) -> Callable[[int], float]:
    """The synthetic policy's batch-latency model with this {batch size: ms} profile (as a server runs it)."""
    policy = SyntheticPolicy(SyntheticPolicyConfig(state_dim=1, cameras={}, action_dim=1, chunk_size=1,
                                                   batch_latency_ms=dict(profile_ms)))
    return policy.latency_s


METRICS = ("actions_per_s", "stalled_pct", "stalled_arrival_pct", "wait_mean_ms", "wait_p99_ms", "latency_mean_s",
           "latency_p25_s", "latency_p95_s", "batch_mean", "age_p50_ms", "age_p99_ms", "refreshes_per_request",
           "offload_pct")


def simulate(cfg: Config, traces, latency_s, seeds: Sequence[int]) -> Result:
    """Mean (and sample sd) of the metrics over `seeds` (each seed: other robot start times and task order)."""
    runs = [FleetSim(Config(**{**cfg.__dict__, "seed": s}), traces, latency_s).run() for s in seeds]
    mean = {k: statistics.fmean(getattr(r, k) for r in runs) for k in METRICS}
    sd = {k: float(np.std([getattr(r, k) for r in runs], ddof=1)) if len(runs) > 1 else 0.0 for k in METRICS}
    return Result(cfg=cfg, tasks_done=sum(r.tasks_done for r in runs), requests=sum(r.requests for r in runs),
                  sd=sd, runs=runs, **mean)


# ------------------------------------------------------------------------------------ study


SCHEDULERS = [("fifo", {}), ("fifo_running_first", {}), ("round_robin", {}), ("wait_ratio", {})]


def pm(r: Result, key: str, fmt: str = ".2f") -> str:
    return f"{getattr(r, key):{fmt}} ± {r.sd.get(key, 0.0):{fmt}}"


def row(r: Result, first: str, ref: Result | None = None) -> str:
    def delta(key: str) -> str:
        """Relative to the reference run of the same seed (paired): mean ± sd over seeds."""
        if ref is None or r is ref:
            return ""
        d = [100 * (getattr(a, key) / getattr(b, key) - 1) for a, b in zip(r.runs, ref.runs)]
        return f"{np.mean(d):+.1f} ± {np.std(d, ddof=1) if len(d) > 1 else 0.0:.1f} %"

    return (f"| {first} | {pm(r, 'latency_mean_s')} | {delta('latency_mean_s')} | {r.latency_p25_s:.2f} | "
            f"{pm(r, 'latency_p95_s')} | {delta('latency_p95_s')} | {pm(r, 'stalled_arrival_pct')} | "
            f"{r.stalled_pct:.2f} | {r.actions_per_s:.0f} | {r.wait_p99_ms:.0f} | {r.batch_mean:.1f} |")


HEADER = ("| {first} | task mean s | vs FIFO, same seed | task p25 s | task p95 s | vs FIFO, same seed | stalled % from arrival | "
          "stalled % mid-task (old) | actions/s | wait p99 ms | batch |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def rate_for_load(load: float, latency_s, max_batch: int, traces, requests_per_task: float | None = None) -> float:
    """Task arrivals per second that ask for `load` x the server's throughput at `max_batch`
    (``max_batch / latency(max_batch)`` requests/s), each task asking one request per round, or
    `requests_per_task` (e.g. `requests_per_task_alone`)."""
    per_task = requests_per_task or statistics.fmean(len(t) for t in traces)
    return load * max_batch / latency_s(max_batch) / per_task


ALONE_WINDOW_S = 3000.0


def requests_per_task_alone(cfg: Config, traces, latency_s, seeds: Sequence[int]) -> float:
    """Requests a task asks of a server that serves its robot alone (tasks back to back): one per round
    with chunks started after the buffer, more with the client's alignment (a request sent L actions
    ahead buys H - L new ones). At load, longer RTTs make it more still. Over a long window
    (`ALONE_WINDOW_S`): requests of tasks cut by the window's edges are counted, their tasks are not,
    which biases a short window upwards (8.7 instead of 8.1 per task at 210 s for 8.03 rounds)."""
    runs = [FleetSim(Config(**{**cfg.__dict__, "mode": "fleet", "robots": 1, "scheduler": "fifo", "max_batch": 1,
                                "seed": s, "duration_s": cfg.warmup_s + ALONE_WINDOW_S}), traces, latency_s).run()
            for s in seeds]
    return sum(r.requests for r in runs) / max(1, sum(r.tasks_done for r in runs))


def largest_fleet(run: Callable[[int], Result], key: str, budget_pct: float = 1.0, limit: int = 256,
                  start: int | None = None) -> str:
    """The largest N with `key` (a stall %) <= budget, to one robot (assumes stalls grow with N).

    Without `start`: double up from 1, then bisect. With `start` (a guess, e.g. the model's answer
    for a real run): gallop from it by 1, 2, 4, ... robots up or down until the budget is crossed,
    then bisect, so a good guess costs two or three points. ">= limit" when the search reached its
    limit, "0" when even one robot is over the budget."""
    def ok(n: int) -> bool:
        return getattr(run(n), key) <= budget_pct

    good, bad = 0, None
    if start is None:
        n = 1
        while n <= limit:
            if ok(n):
                good, n = n, n * 2
            else:
                bad = n
                break
    elif ok(n := max(1, min(start, limit))):
        good, step = n, 1
        while bad is None and good < limit:
            n = min(limit, good + step)
            if ok(n):
                good, step = n, step * 2
            else:
                bad = n
    else:
        bad, step = n, 1
        while good == 0 and bad > 1:
            n = max(1, bad - step)
            if ok(n):
                good = n
            else:
                bad, step = n, step * 2
    if bad is None:
        return f">= {good}"
    while bad - good > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return str(good)


RUNGS = [
    ("FIFO, one at a time", dict(scheduler="fifo", max_batch=1)),
    ("FIFO, running tasks before new ones, one at a time", dict(scheduler="fifo_running_first", max_batch=1)),
    ("wait ratio, one at a time", dict(scheduler="wait_ratio", max_batch=1)),
    ("FIFO, batched", dict(scheduler="fifo", max_batch=None)),
    ("FIFO, running tasks before new ones, batched", dict(scheduler="fifo_running_first", max_batch=None)),
    ("wait ratio, batched", dict(scheduler="wait_ratio", max_batch=None)),
]


def study(args) -> str:
    traces = load_traces(args)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    base = Config(duration_s=args.duration_s, warmup_s=args.warmup_s, buckets=args.buckets, aging=args.aging,
                  first_request=args.first_request, trigger=args.trigger, chunk_start=args.chunk_start,
                  tick_phases=args.tick_phases)
    out = []
    say = out.append
    mean_h = statistics.fmean(h for t in traces for h in t)
    say(f"Traces: {len(traces)} tasks, {sum(map(len, traces))} rounds ({statistics.fmean(map(len, traces)):.1f} "
        f"per task), mean H = {mean_h:.1f} actions ({mean_h * DT_S:.2f} s); one-way network {ONE_WAY_S * 1000:.1f} ms; "
        f"every figure is the mean ± sample sd over {args.seeds} seeds (robot start times, task order) of "
        f"{args.duration_s - args.warmup_s:.0f} s measured after {args.warmup_s:.0f} s warm-up. \"stalled % from "
        f"arrival\" counts the wait for a task's first chunk as stalled steps; \"mid-task (old)\" does not.\n")

    def cfg(**kw) -> Config:
        return Config(**{**base.__dict__, **kw})

    for profile in args.profiles:
        latency_s = gpu_latency(profile)
        sat = saturation_batch_size({b: latency_s(b) for b in profile_batch_sizes(16)})
        per_task = requests_per_task_alone(base, traces, latency_s, seeds) if getattr(args, "load_basis", "rounds") == "alone" else None
        if per_task is not None:
            say(f"Loads from the requests a task asks of a server serving its robot alone: {per_task:.2f} per task "
                f"(`--load-basis alone`; the traces have {statistics.fmean(map(len, traces)):.2f} rounds).\n")
        say(f"### Profile `{profile}`\n")
        say(f"ms per dispatch by batch size: {PROFILES[profile]}; throughput at 1 = {1 / latency_s(1):.1f} req/s, "
            f"at 16 = {16 / latency_s(16):.1f} req/s; saturation batch size (within 10 % of peak) = {sat}.\n")

        # 1. order where it matters: online arrivals at the highest stable load and just past it
        for b in (1, sat):
            for load in args.loads:
                rate = rate_for_load(load, latency_s, b, traces, per_task)
                say(f"#### Online, load {load:g} at max batch {b} ({rate:.2f} tasks/s)\n")
                say(HEADER.format(first="scheduler / setting"))

                def run(**kw) -> Result:
                    return simulate(cfg(mode="online", rate_per_s=rate, max_batch=b,
                                        **{"scheduler": "wait_ratio", **kw}), traces, latency_s, seeds)

                fifo = run(scheduler="fifo")
                say(row(fifo, "fifo", fifo))
                say(row(run(scheduler="fifo_running_first"), "fifo, running tasks first", fifo))
                say(row(run(scheduler="round_robin"), "round_robin", fifo))
                say(row(run(), f"wait_ratio defaults (B={base.buckets}, A={base.aging}, {base.first_request})", fifo))
                if profile == args.profiles[0]:  # the settings sweep, one setting varies per row
                    for v in args.sweep_aging:
                        say(row(run(aging=v), f"A={v}", fifo))
                    for v in args.sweep_buckets:
                        say(row(run(buckets=v), f"B={v}", fifo))
                    for rule in ("literal", "lowest", "mean", "highest"):
                        say(row(run(first_request=rule), f"first_request={rule}", fifo))
                say("")

        # 2. capacity: robots running tasks back to back, largest fleet within a 1 % stall budget
        say(f"#### Largest fleet, tasks back to back, at most 1 % of control steps stalled ({profile})\n")
        alone = simulate(cfg(scheduler="fifo", max_batch=1, robots=1), traces, latency_s, seeds)
        budget_arrival = alone.stalled_arrival_pct + 1.0
        say("A dedicated server per robot (what a LeRobot user runs today: LeRobot's policy server serves one "
            "robot) carries 1 robot per server by construction, so \"dedicated servers for the same fleet\" is "
            "the shared server's fleet size. Counted from arrival, even a robot alone stalls "
            f"{alone.stalled_arrival_pct:.2f} % of its steps (each task waits one inference for its first chunk), "
            f"so that budget is 1 % above it ({budget_arrival:.2f} %); the old definition keeps 1 %. Task latency "
            "and actions/s at the from-arrival fleet size.\n")
        say("| rung | robots (stalls from arrival) | robots (mid-task stalls, old) | dedicated servers for the "
            "same fleet | actions/s | task mean s | task p25 s | task p95 s |\n|---|---|---|---|---|---|---|---|")
        say(f"| dedicated server per robot (1 robot) | 1 | 1 | 1 | {alone.actions_per_s:.0f} | "
            f"{pm(alone, 'latency_mean_s')} | {alone.latency_p25_s:.2f} | {pm(alone, 'latency_p95_s')} |")
        for name, kw in RUNGS:
            kw = {**kw, "max_batch": kw["max_batch"] or sat}
            cache: dict[int, Result] = {}

            def at(n: int) -> Result:
                if n not in cache:
                    cache[n] = simulate(cfg(robots=n, **kw), traces, latency_s, seeds)
                return cache[n]

            n_new = largest_fleet(at, "stalled_arrival_pct", budget_arrival)
            n_old = largest_fleet(at, "stalled_pct")
            r = at(max(1, int(n_new.removeprefix(">= "))))
            say(f"| {name} | {n_new} | {n_old} | {n_new} | {r.actions_per_s:.0f} | {pm(r, 'latency_mean_s')} | "
                f"{r.latency_p25_s:.2f} | {pm(r, 'latency_p95_s')} |")
        say("")
    return "\n".join(out)


def refetch_study(args) -> str:
    """Capture-to-inference age of served observations with and without the client-side re-fetch."""
    traces = load_traces(args)
    latency_s = gpu_latency(args.profiles[0])
    sat = saturation_batch_size({b: latency_s(b) for b in profile_batch_sizes(16)})
    out = [f"Re-fetch: online, profile `{args.profiles[0]}`, mean ± sd over {args.seeds} seeds.\n",
           "| max batch / load / scheduler | re-fetch after | age p50 ms | age p99 ms | fresh captures per served "
           "request | task mean s |\n|---|---|---|---|---|---|"]
    for b in (1, sat):
        for load in args.loads:
            rate = rate_for_load(load, latency_s, b, traces)
            for name in ("fifo", "wait_ratio"):
                for refresh in args.refresh_s:
                    r = simulate(Config(scheduler=name, max_batch=b, mode="online", rate_per_s=rate, refresh_s=refresh,
                                        duration_s=args.duration_s, warmup_s=args.warmup_s, buckets=args.buckets,
                                        aging=args.aging, first_request=args.first_request, trigger=args.trigger),
                                 traces, latency_s, list(range(args.seeds)))
                    out.append(f"| {b} / {load:g} / {name} | {f'{refresh * 1000:.0f} ms' if refresh else 'off'} | "
                               f"{pm(r, 'age_p50_ms', '.0f')} | {pm(r, 'age_p99_ms', '.0f')} | "
                               f"{r.refreshes_per_request:.2f} | {pm(r, 'latency_mean_s')} |")
    return "\n".join(out)


# ------------------------------------------------------------------------ edge and cloud (tiers)

TIER_NAMES = {"edge": "edge-only", "cloud": "cloud-only", "hybrid": "hybrid"}


def paired(r: Result, ref: Result, key: str = "latency_mean_s") -> tuple[float, float]:
    """Each seed's change of `key` against `ref` on the same seed, %: mean and sample sd over seeds."""
    d = [100 * (getattr(a, key) / getattr(b, key) - 1) for a, b in zip(r.runs, ref.runs, strict=True)]
    return float(np.mean(d)), float(np.std(d, ddof=1)) if len(d) > 1 else 0.0


def stable(r: Result, light: Result, tolerance: float = 0.10) -> bool:
    """A load the tier carries without its queue taking over: mean task latency (over seeds) within
    `tolerance` of its own at the lightest load of the sweep. Past that, the queue's wait is a visible
    share of every task and, nearer saturation, grows through the window (the figure then depends on
    the window's length): "overload" in the tables."""
    return r.latency_mean_s <= (1 + tolerance) * light.latency_mean_s


def hybrid_study(args) -> str:
    """Kairos Fig. 13 (edge-only / cloud-only / hybrid against the task arrival rate) and Fig. 17 (the
    WAN's base latency and bandwidth) in the model, then scale-out on one site."""
    traces = load_traces(args)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    base = Config(mode="online", scheduler=args.hybrid_scheduler, duration_s=args.duration_s, warmup_s=args.warmup_s,
                  trigger=args.trigger, chunk_start=args.chunk_start, tick_phases=args.tick_phases,
                  wan_one_way_s=args.wan_ms / 1000, wan_bandwidth_bps=args.wan_mbit * 1e6 / 8,
                  payload_bytes=args.payload_bytes, history_bytes=args.history_bytes, cloud_scale=args.cloud_scale,
                  cloud_profile_ms=args.cloud_profile_ms, cloud_max_batch=args.cloud_batch or 0,
                  arrivals_s=args.arrivals_s, cloud_in_flight=args.cloud_in_flight, cloud_site=args.cloud_site,
                  edge_overhead_s=args.edge_overhead_ms / 1000, engine_overhead_s=args.engine_overhead_ms / 1000)
    out = []

    def say(line: str) -> None:
        out.append(line)
        print(line, file=sys.stderr, flush=True)  # progress: the study takes a while

    say(f"Traces: {len(traces)} tasks ({statistics.fmean(map(len, traces)):.1f} rounds per task, static horizons); "
        f"scheduler `{base.label()}`; robot <-> edge {ONE_WAY_S * 1000:.1f} ms one way; edge <-> cloud "
        f"{args.wan_ms:g} ms one way ({2 * args.wan_ms:g} ms RTT), {args.wan_mbit:g} Mbit/s; {args.payload_bytes:,} "
        f"bytes per observation{f' + {args.history_bytes:,} of history' if args.history_bytes else ''}; cloud GPU "
        f"{1 / args.cloud_scale:g}x the edge's speed; send trigger `{args.trigger}`. Every figure: mean ± sample sd "
        f"over seeds {seeds[0]}–{seeds[-1]} ({len(seeds)}) of {args.duration_s - args.warmup_s:.0f} s after "
        f"{args.warmup_s:.0f} s warm-up; \"vs\" columns: each seed's change against the other tier on the same "
        f"arrivals. Load = offered requests / the edge GPU's throughput at its batch (1 = the edge saturates; the "
        f"cloud alone saturates at {1 / args.cloud_scale:g}, edge + cloud at {1 + 1 / args.cloud_scale:g}). "
        f"*Stable*: mean task latency within 10 % of the tier's own at the lightest load; otherwise **overload** "
        f"(the queue's wait is a visible share of every task and, nearer saturation, grows through the window).\n")

    def cfg(**kw) -> Config:
        return Config(**{**base.__dict__, **kw})

    for profile in args.profiles if "fig13" in args.parts else ():
        latency_s = gpu_latency(profile)
        sat = args.edge_batch or saturation_batch_size({b: latency_s(b) for b in profile_batch_sizes(16)})
        say(f"### Fig. 13 in the model, profile `{profile}`\n")
        cloud = (f"cloud {args.cloud_profile_ms} (max batch {args.cloud_batch or sat})" if args.cloud_profile_ms
                 else f"cloud x{args.cloud_scale:g}")
        say(f"Edge ms by batch size {PROFILES[profile]} (max batch {sat}); {cloud}.\n")
        say("| load (tasks/s) | tier | task mean s | p25 s | p95 s | stalled % from arrival | offload % | "
            "hybrid vs this tier (mean) | state |\n|---|---|---|---|---|---|---|---|---|")
        light: dict[str, Result] = {}
        highest_stable: dict[str, float] = {}
        overloaded: set[str] = set()
        last: dict[str, Result] = {}
        for load in args.hybrid_rates or args.hybrid_loads:
            rate = load if args.hybrid_rates else rate_for_load(load, latency_s, sat, traces)
            res = {t: simulate(cfg(tiers=t, rate_per_s=rate, max_batch=sat), traces, latency_s, seeds) for t in TIER_NAMES}
            for t, r in res.items():
                light.setdefault(t, r)
                ok = stable(r, light[t])
                if ok and t not in overloaded:
                    highest_stable[t] = load
                if not ok:
                    overloaded.add(t)
                vs = "" if t == "hybrid" else "{:+.1f} ± {:.1f} %".format(*paired(res["hybrid"], r))
                say(f"| {load:g} ({rate:.2f}) | {TIER_NAMES[t]} | {pm(r, 'latency_mean_s')} | {r.latency_p25_s:.2f} | "
                    f"{pm(r, 'latency_p95_s')} | {pm(r, 'stalled_arrival_pct', '.1f')} | {r.offload_pct:.1f} | {vs} | "
                    f"{'stable' if ok else '**overload**'} |")
            last = res
        say("")
        top = (args.hybrid_rates or args.hybrid_loads)[-1]
        say("Highest stable load: " + ", ".join(f"{TIER_NAMES[t]} {highest_stable.get(t, 'none')}" for t in TIER_NAMES)
            + f". At the highest load ({top:g}): hybrid against edge-only "
            + "{:+.1f} ± {:.1f} %".format(*paired(last["hybrid"], last["edge"]))
            + ", against cloud-only " + "{:+.1f} ± {:.1f} %".format(*paired(last["hybrid"], last["cloud"]))
            + " mean task latency (P25 " + "{:+.1f} / {:+.1f} %".format(paired(last["hybrid"], last["edge"], "latency_p25_s")[0],
                                                                       paired(last["hybrid"], last["cloud"], "latency_p25_s")[0])
            + ", P95 " + "{:+.1f} / {:+.1f} %".format(paired(last["hybrid"], last["edge"], "latency_p95_s")[0],
                                                     paired(last["hybrid"], last["cloud"], "latency_p95_s")[0]) + ").\n")

    if "fig17" in args.parts:
        say(wan_sweep(args, traces, seeds, cfg))
    if "scale" in args.parts:
        say(scale_out(args, traces, seeds))
    return "\n".join(out)


def wan_sweep(args, traces, seeds, cfg) -> str:
    """Kairos Fig. 17: the WAN's one-way base latency and bandwidth, at one load past the edge's saturation."""
    out = []
    say = out.append
    latency_s = gpu_latency(args.profiles[0])
    sat = args.edge_batch or saturation_batch_size({b: latency_s(b) for b in profile_batch_sizes(16)})
    rate = rate_for_load(args.wan_load, latency_s, sat, traces)
    say(f"### Fig. 17 in the model: the WAN (profile `{args.profiles[0]}`, load {args.wan_load:g}, {rate:.2f} tasks/s, "
        f"hybrid)\n")
    say("| WAN one way ms | Mbit/s | offload % | task mean s | p95 s | stalled % from arrival | vs edge-only (mean) |\n"
        "|---|---|---|---|---|---|---|")
    edge_only = simulate(cfg(tiers="edge", rate_per_s=rate, max_batch=sat), traces, latency_s, seeds)
    points = [(ms, args.wan_mbit) for ms in args.sweep_wan_ms] + [(args.wan_ms, mb) for mb in args.sweep_wan_mbit]
    for ms, mbit in points:
        r = simulate(cfg(tiers="hybrid", rate_per_s=rate, max_batch=sat, wan_one_way_s=ms / 1000,
                         wan_bandwidth_bps=mbit * 1e6 / 8), traces, latency_s, seeds)
        say(f"| {ms:g} | {mbit:g} | {pm(r, 'offload_pct', '.1f')} | {pm(r, 'latency_mean_s')} | {pm(r, 'latency_p95_s')} | "
            f"{pm(r, 'stalled_arrival_pct', '.1f')} | " + "{:+.1f} ± {:.1f} %".format(*paired(r, edge_only)) + " |")
    say(f"\nEdge-only at this load: {pm(edge_only, 'latency_mean_s')} s mean, "
        f"{pm(edge_only, 'stalled_arrival_pct', '.1f')} % stalled from arrival.\n")
    return "\n".join(out)


def scale_out(args, traces, seeds) -> str:
    """1, 2 and 4 edge GPUs on one site: behind one scheduler (placement fills whichever engine is
    idle) against as many independent servers with robots statically assigned (robot i to server
    i % k). Tasks back to back; the largest fleet within the stall budget."""
    latency_s = gpu_latency(args.profiles[0])
    sat = saturation_batch_size({b: latency_s(b) for b in profile_batch_sizes(16)})
    base = Config(mode="fleet", duration_s=args.duration_s, warmup_s=args.warmup_s, trigger=args.trigger,
                  chunk_start=args.chunk_start, tick_phases=args.tick_phases, max_batch=sat)
    alone = simulate(Config(**{**base.__dict__, "robots": 1, "scheduler": "fifo"}), traces, latency_s, seeds)
    budget = alone.stalled_arrival_pct + 1.0
    out = [f"### Scale-out on one site (profile `{args.profiles[0]}`, tasks back to back, max batch {sat})\n",
           f"Robots carried with stalls from a task's arrival within 1 % above a robot alone ({alone.stalled_arrival_pct:.2f} "
           f"%, so {budget:.2f} %), seeds {seeds[0]}–{seeds[-1]}; actions/s and task mean at that fleet.\n",
           "| GPUs | scheduler | one scheduler, k engines: robots | actions/s | task mean s | k servers, static: robots | "
           "actions/s | task mean s |\n|---|---|---|---|---|---|---|---|"]
    for k in args.scale_engines:
        for name in args.scale_schedulers:
            cells = []
            for kw in (dict(edge_engines=k, servers=1), dict(edge_engines=1, servers=k)):
                cache: dict[int, Result] = {}

                def at(n: int, kw=kw, cache=cache) -> Result:
                    if n not in cache:
                        cache[n] = simulate(Config(**{**base.__dict__, "robots": n, "scheduler": name, **kw}),
                                            traces, latency_s, seeds)
                    return cache[n]

                n = largest_fleet(at, "stalled_arrival_pct", budget, start=args.scale_start * k)
                r = at(max(1, int(n.removeprefix(">= "))))
                cells += [n, f"{r.actions_per_s:.0f}", pm(r, "latency_mean_s")]
            out.append(f"| {k} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def order_study(args) -> str:
    """Wait ratio against FIFO, one request at a time, over loads from stable to overload, on the seeds
    given: the paired change of mean and P95 task latency, and whether FIFO's queue is stable there."""
    traces = load_traces(args)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    latency_s = gpu_latency(args.profiles[0])
    base = Config(mode="online", duration_s=args.duration_s, warmup_s=args.warmup_s, trigger=args.trigger,
                  chunk_start=args.chunk_start, tick_phases=args.tick_phases)
    def say(line: str) -> None:
        out.append(line)
        print(line, file=sys.stderr, flush=True)  # progress

    out = [f"Wait ratio (defaults) against FIFO, profile `{args.profiles[0]}`, online, seeds {seeds[0]}–{seeds[-1]} "
           f"({len(seeds)}), {args.duration_s - args.warmup_s:.0f} s after {args.warmup_s:.0f} s warm-up; change of each "
           "seed's task latency against FIFO on the same seed, mean ± sample sd. *Stable*: FIFO's mean task latency "
           "within 10 % of its own at the lightest load.\n",
           "| max batch | load (tasks/s) | FIFO task mean s | FIFO stalled % from arrival | wait ratio task mean s | "
           "mean vs FIFO | P95 vs FIFO | seeds better | state |\n|---|---|---|---|---|---|---|---|---|"]
    sat = saturation_batch_size({b: latency_s(b) for b in profile_batch_sizes(16)})
    for b in args.order_batches or (1, sat):
        light = None
        for load in args.loads:
            rate = rate_for_load(load, latency_s, b, traces)
            fifo = simulate(Config(**{**base.__dict__, "scheduler": "fifo", "rate_per_s": rate, "max_batch": b}),
                            traces, latency_s, seeds)
            wr = simulate(Config(**{**base.__dict__, "scheduler": "wait_ratio", "rate_per_s": rate, "max_batch": b}),
                          traces, latency_s, seeds)
            light = light or fifo
            better = sum(a.latency_mean_s < f.latency_mean_s for a, f in zip(wr.runs, fifo.runs, strict=True))
            say(f"| {b} | {load:g} ({rate:.2f}) | {pm(fifo, 'latency_mean_s')} | "
                       f"{pm(fifo, 'stalled_arrival_pct', '.1f')} | {pm(wr, 'latency_mean_s')} | "
                       + "{:+.1f} ± {:.1f} %".format(*paired(wr, fifo)) + " | "
                       + "{:+.1f} ± {:.1f} %".format(*paired(wr, fifo, "latency_p95_s"))
                       + f" | {better} of {len(seeds)} | {'stable' if stable(fifo, light) else '**overload**'} |")
    return "\n".join(out) + "\n"


def load_traces(args) -> list[list[int]]:
    """Each task as the horizons of its rounds, static or dynamic (`benchmarks/studies/fleet_traces.py`), or
    `--uniform-tasks ROUNDS STEPS`."""
    if getattr(args, "uniform_tasks", None):
        rounds, steps = args.uniform_tasks
        return [[steps] * rounds]
    tasks = fleet_traces.load_traces(args.traces) if args.traces else fleet_traces.generate_traces(args.tasks, args.trace_seed)
    return [t.executed_rounds(args.horizon == "dynamic") for t in tasks]


BEGIN, END = "<!-- fleet:begin (generated by benchmarks/studies/fleet.py) -->", "<!-- fleet:end -->"
HYBRID_BEGIN, HYBRID_END = "<!-- fleet-hybrid:begin (generated by benchmarks/studies/fleet.py --hybrid) -->", "<!-- fleet-hybrid:end -->"
ORDER_BEGIN, ORDER_END = "<!-- fleet-order:begin (generated by benchmarks/studies/fleet.py --order) -->", "<!-- fleet-order:end -->"


def write_section(path: Path, body: str, command: str) -> None:
    """Replace the generated block of the "Fleet scheduling" section."""
    write_docs_block(path, BEGIN, END, f"\nCommand: `{command}`\n\n{body}", heading="Fleet scheduling")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a mistake is a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--duration-s", type=float, default=240.0)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--tasks", type=int, default=fleet_traces.TASKS, help="generated traces")
    p.add_argument("--trace-seed", type=int, default=fleet_traces.TRACE_SEED)
    p.add_argument("--traces", help="a JSON trace file (benchmarks/studies/fleet_traces.py) instead of generated traces")
    p.add_argument("--horizon", choices=("static", "dynamic"), default="static",
                   help="run each task at its static horizon or at the trace's dynamic one")
    p.add_argument("--buckets", type=int, default=WaitRatioScheduler().buckets)
    p.add_argument("--aging", type=int, default=WaitRatioScheduler().aging)
    p.add_argument("--first-request", default=WaitRatioScheduler().first_request)
    p.add_argument("--trigger", default="rtt", help="rtt (reference client) or fixed:K")
    p.add_argument("--chunk-start", choices=("after_buffer", "capture"), default="after_buffer",
                   help="where a round's chunk starts: after the buffered actions, or at its capture step as the "
                        "reference client aligns it (Config.chunk_start)")
    p.add_argument("--tick-phases", type=non_negative_int, default=0,
                   help="robots act only on their 30 Hz tick, spread over this many phases (the real driver: 10; "
                        "0: continuous time, Config.tick_phases)")
    p.add_argument("--load-basis", choices=("rounds", "alone"), default="rounds",
                   help="online loads from one request per round of the traces, or from the requests a task asks "
                        "of a server serving its robot alone (more with --chunk-start capture)")
    p.add_argument("--profiles", nargs="+", choices=sorted(PROFILES), default=["gpu", "vla"])
    p.add_argument("--loads", type=float, nargs="+", default=[0.95, 1.0],
                   help="online loads (offered requests / throughput at the max batch) for the settings sweep")
    p.add_argument("--sweep-buckets", type=int, nargs="+", default=[2, 5, 10, 20])
    p.add_argument("--sweep-aging", type=int, nargs="+", default=[1, 2, 4, 1000])
    p.add_argument("--refetch", action="store_true",
                   help="only the re-fetch table (capture-to-inference age with and without), printed")
    p.add_argument("--refresh-s", type=float, nargs="+", default=[0.0, 0.1, 0.2],
                   help="re-fetch thresholds for --refetch (0 = off)")
    p.add_argument("--first-seed", type=non_negative_int, default=0, help="seeds are first-seed .. first-seed + seeds - 1")
    p.add_argument("--order", action="store_true",
                   help="only wait ratio against FIFO over --loads (its own docs block, 'Wait ratio against FIFO')")
    p.add_argument("--order-batches", type=int, nargs="+", help="--order: max batch sizes (default 1 and saturation)")
    p.add_argument("--hybrid", action="store_true",
                   help="only edge-only / cloud-only / hybrid (Kairos Fig. 13 and 17) and scale-out (its own docs block)")
    p.add_argument("--hybrid-loads", type=float, nargs="+", default=[0.5, 0.9, 1.2, 1.6, 2.0, 2.4],
                   help="--hybrid: loads, as offered requests / the edge's throughput at its batch")
    p.add_argument("--hybrid-scheduler", default="wait_ratio")
    p.add_argument("--wan-ms", type=float, default=100.0,
                   help="edge <-> cloud ONE-WAY delay, ms (each direction; Kairos' 100 ms base latency; a round trip "
                        "is twice it; benchmarks/studies/hybrid.py --wan-ms means the same)")
    p.add_argument("--cloud-in-flight", choices=("capacity", "cover"), default="capacity",
                   help="--hybrid: most requests in flight on a cloud engine: its batch width, as the product's "
                        "dispatcher (default), or enough batches to cover the round trip (Config.cloud_in_flight)")
    p.add_argument("--cloud-site", choices=("server", "engine"), default="server",
                   help="--hybrid: cloud-only as a server at the cloud site (robots cross the WAN), or as "
                        "benchmarks/studies/hybrid.py runs it: the edge scheduler relaying to a cloud engine")
    p.add_argument("--edge-overhead-ms", type=float, default=0.0,
                   help="--hybrid: per request, the real stack's costs on the robot <-> scheduler path beyond the "
                        "network (codec, Zenoh, the loop), not holding a GPU")
    p.add_argument("--engine-overhead-ms", type=float, default=0.0,
                   help="--hybrid: per batch on a remote engine, the dispatch hop's costs beyond the network")
    p.add_argument("--wan-mbit", type=float, default=1000.0, help="edge <-> cloud bandwidth, Mbit/s")
    p.add_argument("--wan-load", type=float, default=1.6, help="--hybrid: the load of the WAN sweep")
    p.add_argument("--sweep-wan-ms", type=float, nargs="+", default=[25, 50, 100, 150, 200])
    p.add_argument("--sweep-wan-mbit", type=float, nargs="+", default=[100, 200, 500, 1000])
    p.add_argument("--payload-bytes", type=non_negative_int, default=Config.payload_bytes)
    p.add_argument("--history-bytes", type=non_negative_int, default=0)
    p.add_argument("--cloud-scale", type=float, default=CLOUD_SCALE, help="cloud batch latency / edge batch latency")
    p.add_argument("--edge-profile-ms", type=json.loads, help='--hybrid: the edge\'s own profile, e.g. \'{"1": 80, "8": 135}\'')
    p.add_argument("--cloud-profile-ms", type=json.loads, help="--hybrid: the cloud's own profile (instead of --cloud-scale)")
    p.add_argument("--edge-batch", type=int, help="--hybrid: the edge's max batch (default: its saturation point)")
    p.add_argument("--cloud-batch", type=int, help="--hybrid: the cloud's max batch (default: the edge's)")
    p.add_argument("--arrivals-s", type=float, default=0.0,
                   help="--hybrid: tasks arrive until then only, and are followed to the end (--duration-s must cover them)")
    p.add_argument("--hybrid-rates", type=float, nargs="+", help="--hybrid: task arrival rates, tasks/s, instead of loads")
    p.add_argument("--uniform-tasks", type=int, nargs=2, metavar=("ROUNDS", "STEPS"),
                   help="every task ROUNDS rounds of STEPS actions (benchmarks/studies/hybrid.py's tasks) instead of the traces")
    p.add_argument("--parts", nargs="+", choices=("fig13", "fig17", "scale"), default=["fig13", "fig17", "scale"],
                   help="--hybrid: which tables (Fig. 13 per profile, the WAN sweep, scale-out)")
    p.add_argument("--scale-engines", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--scale-schedulers", nargs="+", default=["fifo", "wait_ratio"])
    p.add_argument("--scale-start", type=int, default=30, help="scale-out search: first guess, robots per GPU")
    p.add_argument("--write-docs", help="rewrite the generated block of this markdown file (docs/benchmarks.md)")
    args = p.parse_args(argv)
    if args.edge_profile_ms:
        PROFILES["custom"] = {int(b): float(ms) for b, ms in args.edge_profile_ms.items()}
        args.profiles = ["custom"]
    if args.cloud_profile_ms:
        args.cloud_profile_ms = {int(b): float(ms) for b, ms in args.cloud_profile_ms.items()}
    t0 = time.perf_counter()
    if args.refetch:
        print(refetch_study(args))
        return 0
    if args.hybrid:
        body, block = hybrid_study(args), (HYBRID_BEGIN, HYBRID_END, "Edge and cloud in the model")
    elif args.order:
        body, block = order_study(args), (ORDER_BEGIN, ORDER_END, "Wait ratio against FIFO, re-measured")
    else:
        body, block = study(args), None
    print(body)
    print(f"({time.perf_counter() - t0:.0f} s of computer time)", file=sys.stderr)
    if args.write_docs:
        command = ("python -m benchmarks.studies.fleet " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
        if block is None:
            write_section(Path(args.write_docs), body, command)
        else:
            write_docs_block(Path(args.write_docs), block[0], block[1], f"\nCommand: `{command}`\n\n{body}",
                             heading=block[2])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
