"""Fleet benchmark over the real stack: N virtual robots, real Zenoh, a real policy server.

The real-time counterpart of the discrete-event model `benchmarks/studies/fleet.py`: the same traces
(`benchmarks/studies/fleet_traces.py`), latency profile, send rule, wait-ratio settings, rungs
(`fleet.RUNGS`), metrics and capacity search (`fleet.largest_fleet`), run on the real server over
real Zenoh, and set beside the model run at the same scale. What is real and what is simulated:

- REAL: the server (`benchmarks/studies/fleet_server.py`: `lerobot-policy-server` with the benchmarks'
  "FIFO, running tasks before new ones" scheduler registered; manifest, slots, the scheduler under
  test, cross-client batching, reliable chunk publication, telemetry), Zenoh on loopback, the codec,
  and on the robot side the reference client's own `ActionBuffer` (chunks merged by absolute control
  step, stale rows dropped, overlaps blended), `SendTrigger` (RTT bookkeeping, send rule, request
  time-outs) and `ChunkIntake` (seq_id -> step at capture, horizon cut, stale trim, merge). Each
  robot publishes Observation messages with `ExecutionInfo` on its own key and receives ActionChunks
  on its own key.
- SIMULATED: the robots (a 30 Hz tick per robot that executes the next buffered action, or stands
  still), the model (the synthetic policy sleeps the profile's latency; no camera images are sent, so
  the benchmark measures scheduling, not JPEG), and the tasks.

One process drives every robot; control loops are staggered over 10 phases of the 33 ms period, and
robots start their first task at uniform offsets within the first second, as in the model. A robot
in a task sends its next observation when its `SendTrigger` says so and its buffer does not already
cover the rest of the task (a replayed trace issues no request past its end, as in Kairos 5.1), and
keeps from each chunk at most its execution horizon:

- static horizon: the task's ``static_h`` (the client's `actions_per_chunk`); the server sends none;
- dynamic horizon: the server's `diffusion_confidence` policy reads the synthetic model's denoising
  updates, which the robot drives through the observation (``state[0]`` = how many actions the
  trace says the model can vouch for at this point of the task: `Task.trusted_actions`), and sends
  ``H`` in the chunk; the robot keeps ``H`` rows.

Send rules: ``rtt``: the reference client's default, ``p90(RTT) + 1 dt`` (the model's default);
``rtt:Q``: another RTT quantile; ``fixed``: LeRobot's async-inference client (``chunk_size_threshold``
0.5: ask when half of the chunk's executed part is left).

Metrics over the measurement window (after a warm-up), the model's definitions:

- actions/s executed by the fleet;
- stalled %: control steps of robots in a task with nothing to execute, counted from the task's
  arrival (the wait for its first chunk included; ``stalled_arrival_pct``) and, the old definition,
  only after its first action (``stalled_pct``);
- task latency mean / P25 / P95: a task's arrival (its first request leaves on the robot's next
  tick) to its last action executed, for tasks that start in the window and end before it closes
  (``--drain-s`` follows them past it instead);
- RTT, requests/s, chunks served/s, rows kept and rows new per chunk, the server's mean batch size
  (its telemetry), and the driver's own tick lateness: a loaded driver would distort everything
  else, so it is reported beside every figure.

Modes: ``fleet``: N robots doing tasks back to back (Kairos' offline setting; what the study runs);
``online``: tasks arrive by a Poisson process and each takes an idle robot of a pool.

    python -m benchmarks.studies.fleet_zenoh run --robots 20 --scheduler fifo --max-batch 16
    python -m benchmarks.studies.fleet_zenoh study --write-docs docs/studies/fleet.md     # make bench-fleet

The study caches every run's result in ``outputs/fleet_zenoh/runs/``, keyed by the run's
configuration and the code version (`code_version`: a hash of the package's sources, the shared
traces and model modules, the server launcher and the driver's own source), so a change to the
server, client, scheduler or driver never reuses a result measured on older code, and an interrupted
study resumes (``--fresh`` re-runs all). Each result also records ``git describe --dirty``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import inspect
import json
import math
import queue
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.harness.processes import ServerProcess  # noqa: E402
from testbed.ports import free_port  # noqa: E402
from benchmarks.harness.driver import deliver_chunks, driver_ticks, telemetry_metrics  # noqa: E402
from benchmarks.harness.docs_blocks import write_docs_block  # noqa: E402
from benchmarks.harness.robot import Capture, SimulatedRobot  # noqa: E402
from benchmarks.studies import fleet as model  # noqa: E402
from benchmarks.studies import fleet_traces  # noqa: E402
from benchmarks.studies.fleet_traces import (  # noqa: E402
    CHUNK_SIZE,
    FPS,
    Task,
    describe,
    generate_traces,
    load_traces,
    write_traces,
)
from lerobot_zenoh.errors import ProtocolError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.protocol.messages import Observation  # noqa: E402
from lerobot_zenoh.scheduling.batch_profile import profile_batch_sizes, saturation_batch_size  # noqa: E402
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig  # noqa: E402
from lerobot_zenoh.scheduling.wait_ratio import WaitRatioScheduler  # noqa: E402
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import loopback_settings  # noqa: E402

DT_S = 1.0 / FPS
PHASES = 10  # control loops are spread over this many offsets within one period
APP = AppKey("fleet", "bench", "synthetic", "v1", "fleet")
SERVER_ID = "fleet-server"
OUT = ROOT / "outputs" / "fleet_zenoh"
_LITERAL = WaitRatioScheduler()  # the package's wait-ratio defaults, as the model takes them


@dataclass(frozen=True)
class RunConfig:
    scheduler: str = "fifo"  # fifo | fifo_running_first | round_robin | wait_ratio
    buckets: int = _LITERAL.buckets
    aging: int = _LITERAL.aging
    first_request: str = _LITERAL.first_request
    max_batch: str = "1"  # an integer or "auto" (profiled by the server at start-up)
    trigger: str = "rtt"  # rtt (p90 RTT + 1 dt) | rtt:Q (quantile Q instead of 0.9) | fixed
    horizon: str = "static"  # static | dynamic
    threshold: float = 0.4  # Kairos' t for the dynamic horizon
    profile: str = "gpu"  # a latency profile of fleet.PROFILES
    mode: str = "fleet"  # fleet | online
    robots: int = 10  # fleet mode: the fleet; online mode: the pool of robots tasks can take
    rate_per_s: float = 1.0  # online mode
    warmup_s: float = 8.0
    measure_s: float = 20.0
    drain_s: float = 0.0  # after the window: follow the tasks that started in it for up to this long
    seed: int = 0

    def label(self) -> str:
        sched = self.scheduler if self.scheduler != "wait_ratio" else \
            f"wait_ratio(B={self.buckets},A={self.aging},{self.first_request})"
        return f"{sched}, batch {self.max_batch}, {self.trigger} trigger, {self.horizon} horizon"

    def key(self) -> str:
        """The cache key: this configuration on this version of the code."""
        text = json.dumps({"config": asdict(self), "code": code_version()}, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------ server


def manifest(cfg: RunConfig, port: int, zenoh_overrides: dict[str, str] | None = None) -> dict:
    scheduler: str | dict = cfg.scheduler
    if cfg.scheduler == "wait_ratio":
        scheduler = {"type": "wait_ratio", "buckets": cfg.buckets, "aging": cfg.aging,
                     "first_request": cfg.first_request}
    synthetic = {"state_dim": 2, "action_dim": 2, "chunk_size": CHUNK_SIZE, "cameras": {},
                 "batch_latency_ms": dict(model.PROFILES[cfg.profile])}
    entry = {"model_id": APP.model, "model_version": APP.version, "application_tag": APP.app, "fps": FPS,
             "synthetic": synthetic, "scheduler": scheduler,
             "max_batch_size": cfg.max_batch if cfg.max_batch == "auto" else int(cfg.max_batch),
             "accept_unknown_clients": True, "max_unknown_clients": 512}
    if cfg.horizon == "dynamic":
        synthetic["confidence_from_state"] = 0
        entry["horizon"] = {"type": "diffusion_confidence", "threshold": cfg.threshold, "h_min": 1}
    return {"cluster_uuid": APP.cluster, "experiment_tag": APP.experiment, "server_id": SERVER_ID,
            "telemetry_period_s": 1.0, "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False,
                                                 **({"json5_overrides": zenoh_overrides} if zenoh_overrides else {})},
            "server": [entry]}


# ------------------------------------------------------------------------------------ robots


@dataclass
class Counters:
    counting: bool = False  # inside the measurement window (set by the driver every iteration)
    executed: int = 0
    stalled: int = 0  # mid-task: after the task's first action (the old definition)
    first_wait: int = 0  # from a task's arrival to its first action (stalled, counted from arrival)
    sent: int = 0
    received: int = 0
    rejected: int = 0
    horizon_sum: int = 0  # rows kept per chunk, summed (mean execution horizon)
    appended_sum: int = 0  # rows per chunk for steps not yet buffered, summed (new actions per request)
    rtts_s: list = field(default_factory=list)
    latencies_s: list = field(default_factory=list)


class VirtualRobot(SimulatedRobot):
    """One robot: the harness's simulated robot (the reference client's buffer, send trigger and chunk
    intake) around a task trace.

    Only the driver thread touches it (chunks reach it through the driver's inbox).
    """

    def __init__(self, client_id: str, cfg: RunConfig, publisher, phase: int):
        super().__init__(client_id, dt_s=DT_S)  # the RTT estimate is kept across tasks
        self.cfg = cfg
        self.publisher = publisher
        self.phase = phase
        self.task: Task | None = None
        self.progress = 0
        self.task_start_s = 0.0
        self.measured = False  # the task started inside the measurement window

    def start_task(self, task: Task, now: float, measured: bool) -> None:
        self.task, self.progress = task, 0
        self.task_start_s, self.measured = now, measured
        trigger = self.cfg.trigger
        if trigger == "fixed":
            rule = SendTriggerConfig(buffer_time_s=0.5 * task.static_h * DT_S)
        else:  # "rtt" (the client's default) or "rtt:Q" (another RTT quantile)
            rule = SendTriggerConfig(rtt_quantile=float(trigger.split(":", 1)[1])) if ":" in trigger else None
        # Static horizon: the task's H is the client's actions_per_chunk. Dynamic: the chunk's
        # execution_horizon cuts it.
        self.new_task(send_rule=rule, max_actions=task.static_h if self.cfg.horizon == "static" else None)

    def tick(self, now: float, c: Counters) -> bool:
        """One control period. Returns True when the task has just finished."""
        task = self.task
        if task is None:
            return False
        capture = self.capture(now, allowed=self.progress + self.buffer.depth < task.length)
        if capture is not None:
            self.publish(capture, now)
            c.sent += c.counting
        moving = self.moving
        if self.act() is not None:
            self.progress += 1
            c.executed += c.counting
            if self.progress >= task.length:
                if self.measured:  # arrival to the end of the last action, as in the model
                    c.latencies_s.append(now + DT_S - self.task_start_s)
                self.task = None
                self.end_task()
                return True
        elif moving:
            c.stalled += c.counting
        else:
            c.first_wait += c.counting
        return False

    def publish(self, capture: Capture, now: float) -> None:
        self.publisher.put(codec.encode(self.observation_of(capture, now)))

    def observation_of(self, capture: Capture, now: float) -> Observation:
        """What this robot sends for `capture`: the synthetic model's state (what it reads for the
        dynamic horizon), no cameras, no task. A robot for a real model sends what its model reads
        instead (`benchmarks/studies/compiled_capacity.py`)."""
        trusted = self.task.trusted_actions(self.progress) if self.cfg.horizon == "dynamic" else 0
        state = np.array([trusted, self.progress], dtype=np.float32)
        return self.observation(capture, state, task_elapsed_s=now - self.task_start_s)

    def on_chunk(self, payload: bytes, arrived_s: float, c: Counters) -> None:
        try:
            chunk = codec.decode_action_chunk(payload)
        except ProtocolError:
            c.rejected += 1
            return
        result = self.take(chunk, arrived_s)
        if not result.accepted:
            c.rejected += result.reason != "unknown_seq"  # unknown: an answer for a finished task
            return
        if c.counting:
            c.received += 1
            c.horizon_sum += result.kept
            c.appended_sum += result.merge.appended if result.merge is not None else 0
            if result.rtt_s is not None:
                c.rtts_s.append(result.rtt_s)


# ------------------------------------------------------------------------------------ one run


def run(cfg: RunConfig, tasks: list[Task], out: Path = OUT, port: int | None = None, verbose: bool = True,
        zenoh_overrides: dict[str, str] | None = None) -> dict:
    """One measured run on a server of its own (the synthetic model); returns its figures (see the
    module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    driver_settings = loopback_settings(connect_ports=(port,))
    if zenoh_overrides:
        driver_settings = driver_settings.replace(json5_overrides=dict(zenoh_overrides))
    with ServerProcess(manifest(cfg, port, zenoh_overrides), out / "server.log",
                       launcher=("-m", "benchmarks.studies.fleet_server")) as server, \
            ZenohSession(driver_settings).open() as session:
        wait_for_server(session, APP, server, timeout_s=60)
        return drive(cfg, tasks, session, verbose=verbose)


def wait_for_server(session: ZenohSession, app: AppKey, server: ServerProcess, timeout_s: float) -> None:
    """Until the server answers `app`'s status query (it does once its models are warm)."""
    server.wait_answering(lambda: session.query(app.status, 0.5), timeout_s)


def drive(cfg: RunConfig, tasks: list[Task], session: ZenohSession, *, app: AppKey = APP, server_id: str = SERVER_ID,
          robot: Callable[..., VirtualRobot] = VirtualRobot, verbose: bool = True) -> dict:
    """One measured run of `cfg.robots` robots (`robot(client_id, cfg, publisher, phase)`) against the
    server of `app` that `session` reaches; returns its figures (see the module docstring). The server
    may have served other runs before: chunks lost are counted from its `inferences` at the start."""
    rng = np.random.default_rng(cfg.seed)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    telemetry: list[tuple[float, bytes]] = []  # (arrival, payload), decoded after the run
    started = time.perf_counter()
    chunks_in = [0]  # every chunk that reached this process (the whole run; compared with what was served)

    def on_action(key: str, payload: bytes) -> None:
        chunks_in[0] += 1
        inbox.put((key, payload, time.perf_counter()))

    session.subscribe(f"{app.prefix}/*/action", on_action)

    session.subscribe(app.server_metrics(server_id),
                      lambda key, payload: telemetry.append((time.perf_counter(), payload)))
    robots = [robot(f"r{i:03d}", cfg, session.publisher(app.client(f"r{i:03d}").obs, OBSERVATION_QOS), phase=i % PHASES)
              for i in range(cfg.robots)]
    by_id = {r.client_id: r for r in robots}
    groups = [[r for r in robots if r.phase == p] for p in range(PHASES)]
    c = Counters()
    time.sleep(0.5)  # let the subscriptions reach the server before the first observation
    settle = time.monotonic() + 2.5  # what the server served before this run: its first telemetry's count
    while not telemetry and time.monotonic() < settle:
        time.sleep(0.05)
    served_before = _served(telemetry) or 0

    t0 = time.perf_counter()
    w0, w1 = t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.measure_s
    hard_end = w1 + cfg.drain_s
    order = [int(rng.integers(len(tasks)))]  # as the model: one random start, then the traces in order

    def next_task() -> Task:
        order[0] += 1
        return tasks[(order[0] - 1) % len(tasks)]

    backlog: list[float] = []  # online: arrivals waiting for an idle robot
    arrivals: list[float] = []
    if cfg.mode == "online":
        t = t0
        while t < hard_end:
            t += rng.exponential(1.0 / cfg.rate_per_s)
            arrivals.append(t)
        arrivals.reverse()  # pop() from the end = the earliest
    pending = sorted(zip(rng.uniform(0, 1.0, size=len(robots)), range(len(robots)))) if cfg.mode == "fleet" else []
    pending.reverse()  # fleet mode: staggered first tasks, earliest at the end
    idle = list(reversed(robots)) if cfg.mode == "online" else []
    lateness: list[float] = []

    def done(now: float) -> bool:  # the window is over and no measured task still runs (or the hard end)
        return now >= w1 and (now >= hard_end or not any(r.task is not None and r.measured for r in robots))

    for i, now, c.counting in driver_ticks(t0, DT_S / PHASES, w0, w1, lateness, stop=done):
        deliver_chunks(inbox, by_id, c)
        if cfg.mode == "fleet":
            while pending and now >= t0 + pending[-1][0]:
                robots[pending.pop()[1]].start_task(next_task(), now, c.counting)
        else:
            while arrivals and arrivals[-1] <= now:
                backlog.append(arrivals.pop())
            while backlog and idle:
                backlog.pop(0)
                idle.pop().start_task(next_task(), now, c.counting)
        for r in groups[i % PHASES]:
            if r.tick(now, c):
                if cfg.mode == "fleet" and now < hard_end:
                    r.start_task(next_task(), now + DT_S, c.counting)
                elif cfg.mode == "online":
                    idle.append(r)
    elapsed = time.perf_counter() - started
    unfinished = sum(1 for r in robots if r.task is not None and r.measured)
    # Chunks lost on the way (Zenoh drops under congestion control DROP, silently): wait for a
    # telemetry period whose served count the arrivals have caught up with, at most 3 s.
    settle = time.monotonic() + 3.0
    time.sleep(1.2)  # one more telemetry period
    while time.monotonic() < settle and (_served(telemetry) or 0) - served_before != chunks_in[0]:
        time.sleep(0.2)
    lost = (_served(telemetry) or 0) - served_before - chunks_in[0]
    server_figures = telemetry_metrics(telemetry)
    result = summarize(cfg, c, lateness, server_figures, w0, w1, unfinished, len(backlog), elapsed, verbose)
    result["chunks_lost"] = lost  # served by the server, never reached the robots (whole run)
    result["chunks_arrived"] = chunks_in[0]
    if verbose:
        print(f"  chunks served {chunks_in[0] + lost}, lost on the way {lost}", flush=True)
    return result


def _served(telemetry: list[tuple[float, bytes]]) -> int | None:
    """The server's `inferences` (one chunk each) in its latest telemetry."""
    for _, payload in reversed(telemetry):
        try:
            return int(codec.decode_telemetry(payload).metrics.get("inferences", 0))
        except ProtocolError:
            continue
    return None


def summarize(cfg: RunConfig, c: Counters, lateness, server_figures, w0, w1, unfinished, backlog, elapsed, verbose) -> dict:
    def stat(values, fn, *args) -> float:  # NaN (not a warning) when nothing was measured
        return float(fn(np.asarray(values, dtype=np.float64), *args)) if len(values) else math.nan

    lat, rtt = c.latencies_s, [x * 1000 for x in c.rtts_s]
    steps = c.executed + c.stalled
    arrival_steps = steps + c.first_wait
    inside = [m for t, m in server_figures if w0 <= t <= w1 + 1.5]
    first = next((m for t, m in server_figures if t >= w0), {})
    last = inside[-1] if inside else (server_figures[-1][1] if server_figures else {})
    result = {
        "config": asdict(cfg),
        "label": cfg.label(),
        "actions_per_s": c.executed / cfg.measure_s,
        "stalled_pct": 100.0 * c.stalled / steps if steps else 0.0,
        "stalled_arrival_pct": 100.0 * (c.stalled + c.first_wait) / arrival_steps if arrival_steps else 0.0,
        "requests_per_s": c.sent / cfg.measure_s if cfg.measure_s else 0.0,
        "chunks": c.received,
        "chunks_rejected": c.rejected,
        "mean_kept_rows": c.horizon_sum / c.received if c.received else 0.0,
        "mean_new_rows": c.appended_sum / c.received if c.received else 0.0,
        "tasks_measured": len(lat),
        "tasks_unfinished": unfinished,
        "online_backlog_at_end": backlog,
        "latency_mean_s": stat(lat, np.mean),
        "latency_p25_s": stat(lat, np.percentile, 25),
        "latency_p95_s": stat(lat, np.percentile, 95),
        "rtt_p50_ms": stat(rtt, np.percentile, 50),
        "rtt_p99_ms": stat(rtt, np.percentile, 99),
        "server_batch_mean": float(last.get("batch_size_mean", math.nan)),
        "server_max_batch": last.get("max_batch_size"),
        "server_queue_p50_ms": float(last.get("queue_ms_p50", math.nan) or math.nan),
        "server_queue_p99_ms": float(last.get("queue_ms_p99", math.nan) or math.nan),
        "server_inferences": (last.get("inferences", 0) - first.get("inferences", 0)) if first else None,
        "served_per_s": ((last.get("inferences", 0) - first.get("inferences", 0)) / cfg.measure_s
                         if first and cfg.measure_s else math.nan),
        "driver_lateness_mean_ms": stat(lateness, np.mean) * 1000,
        "driver_lateness_p99_ms": stat(lateness, np.percentile, 99) * 1000,
        "wall_s": elapsed,
    }
    if verbose:
        print(f"{cfg.label():60s} {cfg.mode} n={cfg.robots} rate={cfg.rate_per_s:g}: "
              f"{result['actions_per_s']:.0f} act/s, stalled {result['stalled_arrival_pct']:.2f} % from arrival "
              f"({result['stalled_pct']:.2f} % mid-task), "
              f"lat {result['latency_mean_s']:.2f}/{result['latency_p25_s']:.2f}/{result['latency_p95_s']:.2f} s "
              f"({result['tasks_measured']} tasks, {unfinished} unfinished), rtt p50 {result['rtt_p50_ms']:.0f} ms, "
              f"batch {result['server_batch_mean']:.1f}, {result['requests_per_s']:.1f} req/s, "
              f"driver late p99 {result['driver_lateness_p99_ms']:.1f} ms", flush=True)
    return result


# ------------------------------------------------------------------------------------ code version


#: What a run's figures depend on besides the package: these objects' source (the driver; the study
#: and report code below can change without invalidating a measured run).
DRIVER = (RunConfig, manifest, ServerProcess, Counters, VirtualRobot, free_port, run, wait_for_server, drive,
          summarize, model.FifoRunningFirst)
#: ... and these files (the shared traces, the server launcher).
DRIVER_FILES = ("benchmarks/studies/fleet_traces.py", "benchmarks/studies/fleet_server.py", "benchmarks/harness/robot.py")


def code_version() -> str:
    """A hash of every Python source of the package, of `DRIVER_FILES` and of the `DRIVER` objects."""
    if not _CODE_VERSION:
        digest = hashlib.sha1()
        for path in sorted([*(ROOT / "lerobot_zenoh").rglob("*.py"), *(ROOT / f for f in DRIVER_FILES)]):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
        for obj in DRIVER:
            digest.update(inspect.getsource(obj).encode() + b"\0")
        _CODE_VERSION.append(digest.hexdigest()[:16])
    return _CODE_VERSION[0]


_CODE_VERSION: list[str] = []


def git_describe() -> str:
    """``git describe --always --dirty`` of the checkout, recorded beside each result (not part of the key)."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ------------------------------------------------------------------------------------ study


#: Aggregated over seeds (mean and sample sd), the model's names where the model has the metric.
METRICS = ("actions_per_s", "stalled_pct", "stalled_arrival_pct", "latency_mean_s", "latency_p25_s", "latency_p95_s",
           "requests_per_s", "served_per_s", "mean_kept_rows", "mean_new_rows", "server_batch_mean", "rtt_p50_ms",
           "rtt_p99_ms", "driver_lateness_mean_ms", "driver_lateness_p99_ms")


def aggregate(runs: list[dict]) -> SimpleNamespace:
    """Mean and sample sd over seeds of every metric (NaN-free seeds only), as `fleet.simulate` does:
    attributes are the means, ``sd`` the spreads, ``runs`` the seeds' results; `fleet.pm` prints it."""
    mean, sd = {}, {}
    for k in METRICS:
        values = [r[k] for r in runs if r.get(k) is not None and not math.isnan(r[k])]
        mean[k] = statistics.fmean(values) if values else math.nan
        sd[k] = statistics.stdev(values) if len(values) > 1 else 0.0
    return SimpleNamespace(**mean, sd=sd, runs=runs, robots=runs[0]["config"]["robots"],
                           tasks_measured=sum(r["tasks_measured"] for r in runs))


class NotCached(Exception):
    """A point the study would have to run, with ``--cached-only``."""


class Study:
    """Runs, cached by configuration and code version; points (a configuration over seeds), each taken
    under the bench lock when one is given, so that other benchmarks of the machine wait for it."""

    def __init__(self, tasks: list[Task], out: Path, fresh: bool, lock: str | None = None, cached_only: bool = False):
        self.tasks, self.out, self.fresh, self.lock, self.cached_only = tasks, out, fresh, lock, cached_only
        self._held = None  # the lock file while it is held
        self._sticky = False  # inside `turn`: a lock taken is kept to the turn's end
        self.results: list[dict] = []  # every run's result the report reads (cached or not)
        (out / "runs").mkdir(parents=True, exist_ok=True)

    def cached(self, cfg: RunConfig) -> dict | None:
        path = self.out / "runs" / f"{cfg.key()}.json"
        return None if self.fresh or not path.exists() else json.loads(path.read_text())

    def run(self, cfg: RunConfig) -> dict:
        result = self.cached(cfg)
        if result is not None:
            print(f"(cached) {cfg.label()} n={cfg.robots} seed {cfg.seed}: "
                  f"stalled {result['stalled_arrival_pct']:.2f} % from arrival", flush=True)
        else:
            result = run(cfg, self.tasks, self.out)
            result.update(code_version=code_version(), git=git_describe())
            (self.out / "runs" / f"{cfg.key()}.json").write_text(json.dumps(result, indent=1))
        self.results.append(result)
        return result

    def point(self, cfg: RunConfig, seeds: list[int]) -> SimpleNamespace:
        cfgs = [replace(cfg, seed=s) for s in seeds]
        if self.cached_only and any(self.cached(c) is None for c in cfgs):
            raise NotCached(cfg.label())
        if self.lock and self._held is None and any(self.cached(c) is None for c in cfgs):
            self._held = open(self.lock, "a")
            fcntl.flock(self._held, fcntl.LOCK_EX)  # released when the file closes
        try:
            return aggregate([self.run(c) for c in cfgs])
        finally:
            if not self._sticky:
                self._release()

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    @contextlib.contextmanager
    def turn(self):
        """Inside, a bench lock taken for a point is kept until the end: one rung's search (a few
        minutes) in one turn, instead of queueing again behind other benchmarks for every point."""
        self._sticky = True
        try:
            yield
        finally:
            self._sticky = False
            self._release()


def pm(r, key: str, fmt: str = ".2f") -> str:
    return model.pm(r, key, fmt)


def ratio(real: float, sim: float) -> str:
    return f"{real / sim:.2f}" if sim and not (math.isnan(real) or math.isnan(sim)) else "-"


REAL_HEADER = ("| rung / robots | stalled % from arrival | stalled % mid-task (old) | actions/s | task mean s | task p25 s | "
               "task p95 s | tasks | requests/s | served/s | rows kept / new per chunk | batch | RTT p50 / p99 ms | "
               "driver late mean / p99 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def real_row(first: str, r) -> str:
    return (f"| {first} | {pm(r, 'stalled_arrival_pct')} | {pm(r, 'stalled_pct')} | {pm(r, 'actions_per_s', '.0f')} | "
            f"{pm(r, 'latency_mean_s')} | {r.latency_p25_s:.2f} | {pm(r, 'latency_p95_s')} | {r.tasks_measured} | "
            f"{r.requests_per_s:.1f} | {r.served_per_s:.1f} | {r.mean_kept_rows:.1f} / {r.mean_new_rows:.1f} | "
            f"{r.server_batch_mean:.1f} | {r.rtt_p50_ms:.0f} / {r.rtt_p99_ms:.0f} | "
            f"{r.driver_lateness_mean_ms:.1f} / {r.driver_lateness_p99_ms:.1f} |")


def study(args) -> tuple[str, dict]:
    tasks = load_traces(args.traces) if args.traces else generate_traces(args.tasks, args.trace_seed)
    rounds = [t.executed_rounds(False) for t in tasks]  # what the model replays: static horizons
    seeds = list(range(args.seeds))
    latency_s = model.gpu_latency(args.profile)
    sat = saturation_batch_size({b: latency_s(b) for b in profile_batch_sizes(16)})
    st = Study(tasks, Path(args.out), args.fresh, args.lock, getattr(args, "cached_only", False))
    base = RunConfig(warmup_s=args.warmup_s, measure_s=args.measure_s, profile=args.profile)
    sim_base = model.Config(duration_s=args.warmup_s + args.measure_s, warmup_s=args.warmup_s, buckets=base.buckets,
                            aging=base.aging, first_request=base.first_request, trigger=base.trigger)
    sims: dict = {}

    def real_at(n: int, scheduler: str, max_batch: int):
        return st.point(replace(base, robots=n, scheduler=scheduler, max_batch=str(max_batch)), seeds)

    def sim_at(n: int, scheduler: str, max_batch: int, chunk_start: str = "after_buffer",
               ticks: int = 0) -> model.Result:
        key = (n, scheduler, max_batch, chunk_start, ticks)
        if key not in sims:
            sims[key] = model.simulate(replace(sim_base, robots=n, scheduler=scheduler, max_batch=max_batch,
                                               chunk_start=chunk_start, tick_phases=ticks), rounds, latency_s, seeds)
        return sims[key]

    out, data = [], {"rungs": []}
    say = out.append
    say(f"Profile `{args.profile}` (ms per forward pass by batch size): {model.PROFILES[args.profile]}; max batch of "
        f"the batched rungs {sat} (its saturation batch size, as in the model). Traces: {describe(tasks)}; static "
        f"horizons. Wait ratio: B = {base.buckets}, A = {base.aging}, first request `{base.first_request}` (the "
        f"package's defaults). Send rule `{base.trigger}`. Every figure is the mean ± sample sd over {args.seeds} "
        f"seeds (robot start offsets, task order) of {args.measure_s:g} s measured after {args.warmup_s:g} s "
        f"warm-up; the model (`benchmarks/studies/fleet.py`) runs the same traces, settings, window and seeds, with the "
        f"chunk alignment of `make bench-fleet-sim` (*model*: a chunk starts after the buffered actions) and with "
        f"the reference client's (*model, capture-aligned*: `chunk_start=capture`, a chunk starts at the step its "
        f"observation was captured at), and capture-aligned *on ticks* (`tick_phases={PHASES}`: each robot "
        f"sends and starts a chunk only on its 30 Hz tick, the ticks spread over {PHASES} phases of the period, "
        f"as the driver's robots do). Task latency over the tasks that start in the window and end before it "
        f"closes, in all four.\n")

    alone = real_at(1, "fifo", 1)
    alone_sim = sim_at(1, "fifo", 1)
    alone_cap, alone_tick = sim_at(1, "fifo", 1, "capture"), sim_at(1, "fifo", 1, "capture", PHASES)
    budget, budget_sim = alone.stalled_arrival_pct + 1.0, alone_sim.stalled_arrival_pct + 1.0
    say(f"Capacity: the largest fleet (tasks back to back) with at most {budget:.2f} % of control steps stalled "
        f"counted from arrival: 1 % above a robot alone on a dedicated server ({alone.stalled_arrival_pct:.2f} % "
        f"real; {alone_sim.stalled_arrival_pct:.2f} % in the model, whose budget is {budget_sim:.2f} %), searched to "
        f"one robot (the real search gallops from the capture-aligned model's answer, or the previous rung's real one "
        f"at the same max batch, then bisects). A dedicated "
        f"server per robot (LeRobot's policy server serves one robot) carries one robot, so a shared server's fleet "
        f"is the number of dedicated servers it replaces. The old stall definition (mid-task only) is reported "
        f"beside, not searched.\n")
    rows, answers, missing = [], {}, []  # answers: max batch -> the last real capacity found with it
    for name, kw in model.RUNGS:
        sched, mb = kw["scheduler"], kw["max_batch"] or sat
        n_sim = model.largest_fleet(lambda n: sim_at(n, sched, mb), "stalled_arrival_pct", budget_sim, args.max_fleet)
        n_cap = model.largest_fleet(lambda n: sim_at(n, sched, mb, "capture"), "stalled_arrival_pct", budget_sim,
                                    args.max_fleet)
        n_tick = model.largest_fleet(lambda n: sim_at(n, sched, mb, "capture", PHASES), "stalled_arrival_pct",
                                     alone_tick.stalled_arrival_pct + 1.0, args.max_fleet)
        points: dict[int, SimpleNamespace] = {}

        def at(n: int):
            if n not in points:
                points[n] = real_at(n, sched, mb)
            return points[n]

        # The search starts from the previous rung's real answer at the same max batch (the model finds the
        # orders within a robot of each other), else from the capture-aligned model's: a guess only saves points.
        guess = answers.get(mb, max(1, int(n_cap.removeprefix(">= "))))
        try:
            with st.turn():  # one rung's search in one turn of the bench lock
                n_real = model.largest_fleet(at, "stalled_arrival_pct", budget, args.max_fleet, start=guess)
        except NotCached:  # --cached-only: this rung's search is not finished
            fit = [k for k, v in points.items() if v.stalled_arrival_pct <= budget]
            missing.append((name, points, f">= {max(fit)}" if fit else "?"))
            continue
        n = answers[mb] = max(1, int(n_real.removeprefix(">= ")))
        rows.append((name, n_real, (n_sim, n_cap, n_tick), at(n),
                     (sim_at(n, sched, mb), sim_at(n, sched, mb, "capture"), sim_at(n, sched, mb, "capture", PHASES)),
                     points))
        data["rungs"].append({"name": name, "real": n_real, "model": n_sim, "model_capture": n_cap,
                              "model_capture_ticks": n_tick, "points": {k: v.runs for k, v in sorted(points.items())}})

    say("#### Real stack: capacity and figures at it\n")
    say("| rung | robots | dedicated servers for the same fleet | actions/s | task mean s | task p25 s | "
        "task p95 s | stalled % mid-task (old) | driver late p99 ms |\n|---|---|---|---|---|---|---|---|---|")
    say(f"| dedicated server per robot (1 robot) | 1 | 1 | {pm(alone, 'actions_per_s', '.0f')} | "
        f"{pm(alone, 'latency_mean_s')} | {alone.latency_p25_s:.2f} | {pm(alone, 'latency_p95_s')} | "
        f"{pm(alone, 'stalled_pct')} | {alone.driver_lateness_p99_ms:.1f} |")
    for name, n_real, _, r, *_ in rows:
        say(f"| {name} | {n_real} | {n_real} | {pm(r, 'actions_per_s', '.0f')} | {pm(r, 'latency_mean_s')} | "
            f"{r.latency_p25_s:.2f} | {pm(r, 'latency_p95_s')} | {pm(r, 'stalled_pct')} | "
            f"{r.driver_lateness_p99_ms:.1f} |")
    say("")

    def cols(key: str, r, models, fmt: str = ".2f") -> str:
        a, others = getattr(r, key), [getattr(m, key) for m in models]
        return (f"{a:{fmt}} / " + " / ".join(f"{b:{fmt}}" for b in others)
                + " (" + ", ".join(ratio(a, b) for b in others) + ")")

    def requests(m) -> SimpleNamespace:  # the model counts served requests; per second of window
        return SimpleNamespace(requests_per_s=m.requests / args.seeds / args.measure_s)

    say("#### Real against the model, same traces, settings, window and seeds\n")
    say("Capacity by each one's own search and budget. The other columns at the real capacity N: real / model / "
        "model, capture-aligned / model, capture-aligned on ticks (real ÷ each model).\n")
    say("| rung | capacity real / model / capture-aligned / on ticks (ratios) | N | actions/s | task mean s | "
        "task p95 s | stalled % from arrival | requests/s |\n|---|---|---|---|---|---|---|---|")
    alone_models = (alone_sim, alone_cap, alone_tick)
    say(f"| dedicated server per robot | 1 / 1 / 1 / 1 | 1 | {cols('actions_per_s', alone, alone_models, '.0f')} | "
        f"{cols('latency_mean_s', alone, alone_models)} | {cols('latency_p95_s', alone, alone_models)} | "
        f"{cols('stalled_arrival_pct', alone, alone_models)} | "
        f"{cols('requests_per_s', alone, [requests(m) for m in alone_models], '.1f')} |")
    for name, n_real, caps, r, models, _ in rows:
        real_n, *model_n = (float(x.removeprefix(">= ")) for x in (n_real, *caps))
        say(f"| {name} | {n_real} / {' / '.join(caps)} ({', '.join(ratio(real_n, m) for m in model_n)}) | "
            f"{r.robots} | {cols('actions_per_s', r, models, '.0f')} | {cols('latency_mean_s', r, models)} | "
            f"{cols('latency_p95_s', r, models)} | {cols('stalled_arrival_pct', r, models)} | "
            f"{cols('requests_per_s', r, [requests(m) for m in models], '.1f')} |")
    say("")

    if missing:
        say("Searches not finished (cut short; a `--cached-only` report), with the largest fleet measured within "
            "the budget so far: " + "; ".join(f"{name}: {low}" for name, _, low in missing) + ".\n")
    say("#### Every point of the real searches\n")
    say(REAL_HEADER)
    say(real_row("dedicated / 1", alone))
    for name, points in [(row[0], row[-1]) for row in rows] + [(name, points) for name, points, _ in missing]:
        for n, r in sorted(points.items()):
            say(real_row(f"{name} / {n}", r))
    say("")
    counted = [r for r in st.results if r.get("chunks_lost") is not None]
    if counted:
        lost = sum(max(0, r["chunks_lost"]) for r in counted)
        served = sum(r["chunks_arrived"] + r["chunks_lost"] for r in counted)
        say(f"Chunks the server served that never reached the robots (the driver's count against the server's "
            f"`inferences`, whole runs): {lost} of {served} over {len(counted)} runs "
            f"(worst run: {max(max(0, r['chunks_lost']) for r in counted)}).\n")
    return "\n".join(out), data


BEGIN, END = "<!-- fleet-zenoh:begin (generated by benchmarks/studies/fleet_zenoh.py) -->", "<!-- fleet-zenoh:end -->"


def write_docs(path: Path, body: str, command: str) -> None:
    """Replace the generated block of the "Fleet over real Zenoh" section."""
    write_docs_block(path, BEGIN, END, f"\nCommand: `{command}`\n\n{body}", heading="Fleet over real Zenoh")


# ------------------------------------------------------------------------------------ CLI


def zenoh_entry(text: str) -> tuple[str, str]:
    """``PATH=JSON5`` -> (path, literal), for argparse (a mistake is a one-line usage error)."""
    path, sep, literal = text.partition("=")
    if not sep or not path or not literal:
        raise argparse.ArgumentTypeError(f"expected PATH=JSON5, e.g. transport/link/tx/queue/size/interactive_high=2, "
                                         f"got {text!r}")
    return path, literal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "study"):
        s = sub.add_parser(name)
        s.add_argument("--tasks", type=int, default=fleet_traces.TASKS, help="generated traces")
        s.add_argument("--trace-seed", type=int, default=fleet_traces.TRACE_SEED)
        s.add_argument("--traces", help="a JSON trace file (benchmarks/studies/fleet_traces.py) instead of generated ones")
        s.add_argument("--out", default=str(OUT))
        s.add_argument("--warmup-s", type=float, default=RunConfig.warmup_s)
        s.add_argument("--measure-s", type=float, default=RunConfig.measure_s)
        s.add_argument("--profile", choices=sorted(model.PROFILES), default=RunConfig.profile)
    r = sub.choices["run"]
    for f in ("scheduler", "first_request", "trigger", "horizon", "mode", "max_batch"):
        r.add_argument("--" + f.replace("_", "-"), default=getattr(RunConfig, f))
    r.add_argument("--buckets", type=int, default=RunConfig.buckets)
    r.add_argument("--aging", type=int, default=RunConfig.aging)
    r.add_argument("--robots", type=int, default=RunConfig.robots)
    r.add_argument("--rate-per-s", type=float, default=RunConfig.rate_per_s)
    r.add_argument("--drain-s", type=float, default=0.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--port", type=int, default=None, help="the server's port (default: a free one)")
    r.add_argument("--json", help="write the result here")
    r.add_argument("--zenoh-set", action="append", default=[], metavar="PATH=JSON5", type=zenoh_entry,
                   help="a Zenoh config entry for the server and the driver (repeatable), e.g. "
                        "transport/link/tx/queue/size/interactive_high=2 (Zenoh's default)")
    s = sub.choices["study"]
    s.add_argument("--seeds", type=int, default=3)
    s.add_argument("--max-fleet", type=int, default=64, help="the capacity searches stop here")
    s.add_argument("--lock", help="take this file's lock (flock) for each point that needs runs, e.g. "
                                  "/work/notes/bench.lock, so that other benchmarks of the machine do not overlap")
    s.add_argument("--fresh", action="store_true", help="re-run configurations that have a cached result")
    s.add_argument("--cached-only", action="store_true",
                   help="run nothing: report the rungs whose searches the cache completes, list the others")
    s.add_argument("--write-docs", help="rewrite the generated block of this markdown file")
    w = sub.add_parser("traces", help="write the generated traces to a JSON file")
    w.add_argument("path")
    w.add_argument("--tasks", type=int, default=fleet_traces.TASKS)
    w.add_argument("--trace-seed", type=int, default=fleet_traces.TRACE_SEED)
    args = p.parse_args(argv)

    if args.command == "traces":
        tasks = generate_traces(args.tasks, args.trace_seed)
        write_traces(args.path, tasks)
        print(describe(tasks))
        return 0
    if args.command == "run":
        tasks = load_traces(args.traces) if args.traces else generate_traces(args.tasks, args.trace_seed)
        cfg = RunConfig(scheduler=args.scheduler, buckets=args.buckets, aging=args.aging,
                        first_request=args.first_request, max_batch=str(args.max_batch), trigger=args.trigger,
                        horizon=args.horizon, profile=args.profile, mode=args.mode, robots=args.robots,
                        rate_per_s=args.rate_per_s, warmup_s=args.warmup_s, measure_s=args.measure_s,
                        drain_s=args.drain_s, seed=args.seed)
        overrides = dict(args.zenoh_set)
        result = run(cfg, tasks, Path(args.out), port=args.port, zenoh_overrides=overrides or None)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    # SIGTERM unwinds like Ctrl-C: the server process of the run in progress is stopped, not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t0 = time.perf_counter()
    body, _ = study(args)
    print(body)
    print(f"({(time.perf_counter() - t0) / 60:.1f} min)", file=sys.stderr)
    if args.write_docs:
        command = "python -m benchmarks.studies.fleet_zenoh " + " ".join(argv if argv is not None else sys.argv[1:])
        write_docs(Path(args.write_docs), body, command.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
