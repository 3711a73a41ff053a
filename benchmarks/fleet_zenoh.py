"""Fleet benchmark over the real stack: N virtual robots, real Zenoh, a real policy server.

One process drives every robot of the fleet; the server is `lerobot-policy-server` in its own
process, serving the synthetic policy with a GPU-like latency-vs-batch profile (60 ms at batch 1
rising sublinearly to 200 ms at 16). What is real and what is simulated:

- REAL: the server (manifest, slots, scheduler, cross-client batching with `max_batch_size: auto`
  profiled at start-up, the `diffusion_confidence` horizon policy, reliable chunk publication,
  telemetry), Zenoh on loopback, the codec, and on the robot side the reference client's own
  `ActionBuffer` (chunks merged by absolute control step, stale rows dropped, overlaps blended),
  `SendTrigger` (RTT bookkeeping, send rule, request time-outs) and `ChunkIntake` (seq_id -> step at
  capture, horizon cut, stale trim, merge). Each robot publishes Observation
  messages with `ExecutionInfo` on its own key and receives ActionChunks on its own key.
- SIMULATED: the robots (a 30 Hz tick per robot that executes the next buffered action, or stalls),
  the model (the synthetic policy sleeps the profile's latency; no camera images are sent, so the
  benchmark measures scheduling, not JPEG), and the tasks (`benchmarks/fleet_traces.py`).

Control loops are staggered over 10 phases of the 33 ms period, like robots that were not started
together. A robot in a task sends its next observation when its `SendTrigger` says so and its
buffer does not already cover the rest of the task (a replayed trace issues no request past its
end, as in Kairos 5.1), and keeps from each chunk at most its execution horizon:

- static horizon: the task's ``static_h`` (the client's `actions_per_chunk`); the server sends none;
- dynamic horizon: the server's `diffusion_confidence` policy reads the synthetic model's denoising
  updates, which the robot drives through the observation (``state[0]`` = how many actions the
  trace says the model can vouch for at this point of the task: `Task.trusted_actions`), and sends
  ``H`` in the chunk; the robot keeps ``H`` rows.

Send rules: ``fixed``: LeRobot's async-inference client (``chunk_size_threshold`` 0.5: ask when
half of the chunk's executed part is left, i.e. ``buffer_time_s = 0.5 * static_h * dt``); ``rtt``:
the reference client's default, ``p90(RTT) + 1 dt`` (queueing included, since RTT is measured).

Metrics over the measurement window (after a warm-up): actions/s; stalled %, the share of control
steps of robots in a task (after its first action) whose buffer was empty; task latency (first
request to last action executed; tasks that start in the window, followed until they end or the
drain limit); RTT; the server's mean batch size and queueing (from its telemetry); the driver's own
tick lateness (a loaded driver would distort the results, so it is reported).

Modes: ``fleet``: N robots doing tasks back to back (Kairos' offline setting); ``online``: tasks
arrive by a Poisson process and each takes an idle robot of a pool (Kairos' online setting).

    python benchmarks/fleet_zenoh.py run --robots 20 --scheduler fifo --max-batch auto --trigger rtt
    python benchmarks/fleet_zenoh.py study --write-docs docs/benchmarks.md     # make bench-fleet

The study caches every run's result in ``outputs/fleet_zenoh/runs/``, keyed by the run's configuration
and the code version (a hash of the package's and these benchmarks' sources), so a change to the
server, client or scheduler never reuses a result measured on older code (``--fresh`` re-runs all).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fleet_traces import (  # noqa: E402
    CHUNK_SIZE,
    FPS,
    GPU_PROFILE_MS,
    Task,
    describe,
    generate_traces,
    load_traces,
    write_traces,
)
from benchmarks.harness import write_docs_block  # noqa: E402
from lerobot_zenoh.errors import ProtocolError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation  # noqa: E402
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer  # noqa: E402
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake  # noqa: E402
from lerobot_zenoh.scheduling.send_trigger import RttTracker, SendTrigger, SendTriggerConfig  # noqa: E402
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import loopback_settings  # noqa: E402

DT_S = 1.0 / FPS
PHASES = 10  # control loops are spread over this many offsets within one period
APP = AppKey("fleet", "bench", "synthetic", "v1", "fleet")
SERVER_ID = "fleet-server"
OUT = ROOT / "outputs" / "fleet_zenoh"


@dataclass(frozen=True)
class RunConfig:
    scheduler: str = "fifo"  # fifo | round_robin | wait_ratio
    buckets: int = 10
    aging: int = 1
    first_request: str = "highest"
    max_batch: str = "1"  # an integer or "auto" (profiled by the server at start-up)
    trigger: str = "rtt"  # rtt (p90 RTT + 1 dt) | rtt:Q (quantile Q instead of 0.9) | fixed
    horizon: str = "static"  # static | dynamic
    threshold: float = 0.4  # Kairos' t for the dynamic horizon
    mode: str = "fleet"  # fleet | online
    robots: int = 10  # fleet mode: the fleet; online mode: the pool of robots tasks can take
    rate_per_s: float = 1.0  # online mode
    warmup_s: float = 8.0
    measure_s: float = 30.0
    drain_s: float = 0.0  # after the window: follow the tasks that started in it for up to this long
    seed: int = 0

    def label(self) -> str:
        sched = self.scheduler if self.scheduler != "wait_ratio" else f"wait_ratio(B={self.buckets},A={self.aging})"
        return f"{sched}, batch {self.max_batch}, {self.trigger} trigger, {self.horizon} horizon"

    def key(self) -> str:
        """The cache key: this configuration on this version of the code."""
        text = json.dumps({"config": asdict(self), "code": code_version()}, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:16]


def code_version() -> str:
    """A hash of every Python source of the package and of the benchmarks (what a run's figures depend on)."""
    if not _CODE_VERSION:
        root = Path(__file__).resolve().parents[1]
        digest = hashlib.sha1()
        for path in sorted([*(root / "lerobot_zenoh").rglob("*.py"), *(root / "benchmarks").glob("*.py")]):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _CODE_VERSION.append(digest.hexdigest()[:16])
    return _CODE_VERSION[0]


_CODE_VERSION: list[str] = []


# ------------------------------------------------------------------------------------ server


def manifest(cfg: RunConfig, port: int) -> dict:
    scheduler: str | dict = cfg.scheduler
    if cfg.scheduler == "wait_ratio":
        scheduler = {"type": "wait_ratio", "buckets": cfg.buckets, "aging": cfg.aging,
                     "first_request": cfg.first_request}
    synthetic = {"state_dim": 2, "action_dim": 2, "chunk_size": CHUNK_SIZE, "cameras": {},
                 "batch_latency_ms": dict(GPU_PROFILE_MS)}
    entry = {"model_id": APP.model, "model_version": APP.version, "application_tag": APP.app, "fps": FPS,
             "synthetic": synthetic, "scheduler": scheduler,
             "max_batch_size": cfg.max_batch if cfg.max_batch == "auto" else int(cfg.max_batch),
             "accept_unknown_clients": True, "max_unknown_clients": 512}
    if cfg.horizon == "dynamic":
        synthetic["confidence_from_state"] = 0
        entry["horizon"] = {"type": "diffusion_confidence", "threshold": cfg.threshold, "h_min": 1}
    return {"cluster_uuid": APP.cluster, "experiment_tag": APP.experiment, "server_id": SERVER_ID,
            "telemetry_period_s": 1.0, "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
            "server": [entry]}


class ServerProcess:
    """`lerobot-policy-server` on a generated manifest, in its own process."""

    def __init__(self, cfg: RunConfig, port: int, log_path: Path):
        self.cfg, self.port, self.log_path = cfg, port, log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._folder = Path(tempfile.mkdtemp(prefix="fleet-"))
        path = self._folder / "manifest.yaml"
        path.write_text(yaml.safe_dump(manifest(self.cfg, self.port)))
        exe = Path(sys.executable).parent / "lerobot-policy-server"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(exe), "--manifest", str(path)], stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        return self

    def __exit__(self, *exc_info) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self._folder, ignore_errors=True)


# ------------------------------------------------------------------------------------ robots


@dataclass
class Counters:
    counting: bool = False  # inside the measurement window (set by the driver every iteration)
    executed: int = 0
    stalled: int = 0
    sent: int = 0
    received: int = 0
    rejected: int = 0
    horizon_sum: int = 0  # rows kept per chunk, summed (mean execution horizon)
    rtts_s: list = field(default_factory=list)
    latencies_s: list = field(default_factory=list)


class VirtualRobot:
    """One robot: the reference client's buffer, send trigger and chunk intake around a task trace.

    Only the driver thread touches it (chunks reach it through the driver's inbox).
    """

    def __init__(self, client_id: str, cfg: RunConfig, publisher, phase: int):
        self.client_id = client_id
        self.cfg = cfg
        self.publisher = publisher
        self.phase = phase
        self.rtt = RttTracker(window=100)  # kept across tasks: the robot's link does not change
        self.buffer = ActionBuffer()
        self.trigger = SendTrigger(dt_s=DT_S, rtt=self.rtt)
        self.intake = ChunkIntake(self.trigger, DT_S)
        self.session_nonce = secrets.randbits(63)  # one per robot, like one per reference client
        self.seq = 0
        self.episode = 0
        self.task: Task | None = None
        self.progress = 0
        self.task_start_s = 0.0
        self.first_request_s: float | None = None
        self.moving = False
        self.measured = False  # the task started inside the measurement window

    def start_task(self, task: Task, now: float, measured: bool) -> None:
        self.task, self.progress, self.moving = task, 0, False
        self.episode += 1
        self.task_start_s, self.first_request_s, self.measured = now, None, measured
        self.buffer.clear()
        trigger = self.cfg.trigger
        if trigger == "fixed":
            config = SendTriggerConfig(buffer_time_s=0.5 * task.static_h * DT_S)
        else:  # "rtt" (the client's default, p90) or "rtt:Q" (another RTT quantile)
            config = SendTriggerConfig(rtt_quantile=float(trigger.split(":", 1)[1]) if ":" in trigger else 0.9)
        self.trigger = SendTrigger(config, dt_s=DT_S, rtt=self.rtt)
        # Static horizon: the task's H is the client's actions_per_chunk. Dynamic: the chunk's
        # execution_horizon cuts it. A new intake remembers no capture step of the last task.
        max_actions = task.static_h if self.cfg.horizon == "static" else None
        self.intake = ChunkIntake(self.trigger, DT_S, max_actions=max_actions)

    def tick(self, now: float, c: Counters) -> bool:
        """One control period. Returns True when the task has just finished."""
        task = self.task
        if task is None:
            return False
        depth = self.buffer.depth
        if self.progress + depth < task.length and self.trigger.should_send(depth, now):
            self._send(now, c)
        if self.buffer.pop() is not None:
            self.moving = True
            self.progress += 1
            c.executed += c.counting
            if self.progress >= task.length:
                if self.measured and self.first_request_s is not None:
                    c.latencies_s.append(now + DT_S - self.first_request_s)
                self.task = None
                self.intake.clear()  # answers still in flight are for a finished task: measured, not merged
                return True
        elif self.moving:
            c.stalled += c.counting
        return False

    def _send(self, now: float, c: Counters) -> None:
        self.seq += 1
        if self.first_request_s is None:
            self.first_request_s = now
        trusted = self.task.trusted_actions(self.progress) if self.cfg.horizon == "dynamic" else 0
        state = np.array([trusted, self.progress], dtype=np.float32)
        info = ExecutionInfo(task_elapsed_s=now - self.task_start_s, actions_buffered=self.buffer.depth,
                             control_period_s=DT_S)
        self.intake.on_send(self.seq, self.buffer.next_step, now)
        self.publisher.put(codec.encode(Observation(self.seq, self.client_id, state, {}, "", info,
                                                    episode_id=str(self.episode), session_nonce=self.session_nonce)))
        c.sent += c.counting

    def on_chunk(self, payload: bytes, arrived_s: float, c: Counters) -> None:
        try:
            chunk = codec.decode_action_chunk(payload)
        except ProtocolError:
            c.rejected += 1
            return
        result = self.intake.on_chunk(chunk.response_to_seq_id, chunk.actions, arrived_s, self.buffer,
                                      execution_horizon=chunk.execution_horizon)
        if not result.accepted:
            c.rejected += result.reason != "unknown_seq"  # unknown: an answer for a finished task
            return
        if c.counting:
            c.received += 1
            c.horizon_sum += result.kept
            if result.rtt_s is not None:
                c.rtts_s.append(result.rtt_s)


# ------------------------------------------------------------------------------------ one run


def run(cfg: RunConfig, tasks: list[Task], out: Path = OUT, port: int = 7521, verbose: bool = True) -> dict:
    """One measured run; returns its figures (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(cfg.seed)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    telemetry: list[tuple[float, bytes]] = []  # (arrival, payload), decoded after the run
    started = time.perf_counter()
    with ServerProcess(cfg, port, out / "server.log") as server, \
            ZenohSession(loopback_settings(connect_ports=(port,))).open() as session:
        deadline = time.monotonic() + 60
        while not session.query(APP.status, 0.5):
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up; see {out / 'server.log'}")
            time.sleep(0.3)
        session.subscribe(f"{APP.prefix}/*/action", lambda key, payload: inbox.put((key, payload, time.perf_counter())))

        session.subscribe(APP.server_metrics(SERVER_ID),
                          lambda key, payload: telemetry.append((time.perf_counter(), payload)))
        robots = [VirtualRobot(f"r{i:03d}", cfg, session.publisher(APP.client(f"r{i:03d}").obs, OBSERVATION_QOS),
                               phase=i % PHASES) for i in range(cfg.robots)]
        by_id = {r.client_id: r for r in robots}
        groups = [[r for r in robots if r.phase == p] for p in range(PHASES)]
        c = Counters()
        time.sleep(0.5)  # let the subscriptions reach the server before the first observation

        t0 = time.perf_counter()
        w0, w1 = t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.measure_s
        hard_end = w1 + cfg.drain_s
        next_task = lambda: tasks[int(rng.integers(len(tasks)))]  # noqa: E731
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
        period = DT_S / PHASES
        i = 0
        while True:
            due = t0 + i * period
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
                now = time.perf_counter()
            c.counting = w0 <= now < w1
            if c.counting:
                lateness.append(now - due)
            while True:
                try:
                    key, payload, arrived = inbox.get_nowait()
                except queue.Empty:
                    break
                robot = by_id.get(key.rsplit("/", 2)[-2])
                if robot is not None:
                    robot.on_chunk(payload, arrived, c)
            if cfg.mode == "fleet":
                while pending and now >= t0 + pending[-1][0]:
                    robots[pending.pop()[1]].start_task(next_task(), now, c.counting)
            else:
                while arrivals and arrivals[-1] <= now:
                    backlog.append(arrivals.pop())
                while backlog and idle:
                    backlog.pop(0)
                    idle.pop().start_task(next_task(), now, c.counting)
            for robot in groups[i % PHASES]:
                if robot.tick(now, c):
                    if cfg.mode == "fleet" and now < hard_end:
                        robot.start_task(next_task(), now + DT_S, c.counting)
                    elif cfg.mode == "online":
                        idle.append(robot)
            i += 1
            if now >= w1 and (now >= hard_end or not any(r.task is not None and r.measured for r in robots)):
                break
        elapsed = time.perf_counter() - started
        unfinished = sum(1 for r in robots if r.task is not None and r.measured)
        time.sleep(1.2)  # one more telemetry period
    server_figures = []
    for t, payload in telemetry:
        try:
            server_figures.append((t, dict(codec.decode_telemetry(payload).metrics)))
        except ProtocolError:
            pass
    return summarize(cfg, c, lateness, server_figures, w0, w1, unfinished, len(backlog), elapsed, verbose)


def summarize(cfg: RunConfig, c: Counters, lateness, server_figures, w0, w1, unfinished, backlog, elapsed, verbose) -> dict:
    def stat(values, fn, *args) -> float:  # NaN (not a warning) when nothing was measured
        return float(fn(np.asarray(values, dtype=np.float64), *args)) if len(values) else math.nan

    lat, rtt = c.latencies_s, [x * 1000 for x in c.rtts_s]
    steps = c.executed + c.stalled
    inside = [m for t, m in server_figures if w0 <= t <= w1 + 1.5]
    first = next((m for t, m in server_figures if t >= w0), {})
    last = inside[-1] if inside else (server_figures[-1][1] if server_figures else {})
    result = {
        "config": asdict(cfg),
        "label": cfg.label(),
        "actions_per_s": c.executed / cfg.measure_s,
        "stalled_pct": 100.0 * c.stalled / steps if steps else 0.0,
        "requests_per_s": c.sent / cfg.measure_s if cfg.measure_s else 0.0,
        "chunks": c.received,
        "chunks_rejected": c.rejected,
        "mean_kept_rows": c.horizon_sum / c.received if c.received else 0.0,
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
        "driver_lateness_p99_ms": stat(lateness, np.percentile, 99) * 1000,
        "wall_s": elapsed,
    }
    if verbose:
        print(f"{cfg.label():60s} {cfg.mode} n={cfg.robots} rate={cfg.rate_per_s:g}: "
              f"{result['actions_per_s']:.0f} act/s, stalled {result['stalled_pct']:.2f} %, "
              f"lat {result['latency_mean_s']:.2f}/{result['latency_p25_s']:.2f}/{result['latency_p95_s']:.2f} s "
              f"({result['tasks_measured']} tasks, {unfinished} unfinished), rtt p50 {result['rtt_p50_ms']:.0f} ms, "
              f"batch {result['server_batch_mean']:.1f}, {result['requests_per_s']:.1f} req/s, "
              f"driver late p99 {result['driver_lateness_p99_ms']:.1f} ms", flush=True)
    return result


# ------------------------------------------------------------------------------------ study


class Study:
    """Runs (cached by configuration) and the search for the largest fleet within the stall budget."""

    def __init__(self, tasks: list[Task], out: Path, fresh: bool, stall_budget_pct: float = 1.0):
        self.tasks, self.out, self.fresh, self.budget = tasks, out, fresh, stall_budget_pct
        (out / "runs").mkdir(parents=True, exist_ok=True)

    def run(self, cfg: RunConfig) -> dict:
        path = self.out / "runs" / f"{cfg.key()}.json"
        if path.exists() and not self.fresh:
            result = json.loads(path.read_text())
            print(f"(cached) {cfg.label()} {cfg.mode} n={cfg.robots} rate={cfg.rate_per_s:g}: "
                  f"stalled {result['stalled_pct']:.2f} %", flush=True)
            return result
        result = run(cfg, self.tasks, self.out)
        path.write_text(json.dumps(result, indent=1))
        return result

    def largest_fleet(self, cfg: RunConfig, guess: int, limit: int = 160) -> tuple[int, list[dict]]:
        """The largest N with stalled % <= budget: grow or shrink by 1.25x from `guess`, then bisect."""
        results: dict[int, dict] = {}

        def ok(n: int) -> bool:
            if n not in results:
                results[n] = self.run(replace(cfg, robots=n))
            return results[n]["stalled_pct"] <= self.budget

        good, bad = 0, None
        n = guess
        if ok(n):
            good = n
            while bad is None and n < limit:
                n = min(limit, max(n + 1, round(n * 1.25)))
                if ok(n):
                    good = n
                else:
                    bad = n
        else:
            bad = n
            while good == 0 and n > 1:
                n = max(1, min(n - 1, round(n / 1.25)))
                if ok(n):
                    good = n
                else:
                    bad = n
        while bad is not None and bad - good > max(1, round(0.08 * good)):
            mid = (good + bad) // 2
            if ok(mid):
                good = mid
            else:
                bad = mid
        return good, [results[k] for k in sorted(results)]


LADDER = [
    ("LeRobot's send rule on this server: FIFO, one at a time, fixed threshold (LeRobot's own server serves one robot)", dict(scheduler="fifo", max_batch="1", trigger="fixed")),
    ("+ cross-client batching", dict(scheduler="fifo", max_batch="auto", trigger="fixed")),
    ("+ send trigger from measured RTT", dict(scheduler="fifo", max_batch="auto", trigger="rtt")),
    ("+ wait-ratio scheduler", dict(scheduler="wait_ratio", max_batch="auto", trigger="rtt")),
    ("+ dynamic execution horizon", dict(scheduler="wait_ratio", max_batch="auto", trigger="rtt", horizon="dynamic")),
]
#: Not a lever of the issue's ladder: the full system with the send trigger at p99 RTT instead of p90
#: (a 1 % stall budget is tighter than the 10 % RTT tail the default rule covers).
EXTRA_RUNGS = [
    ("(extra) 5 with the send trigger at p99 RTT",
     dict(scheduler="wait_ratio", max_batch="auto", trigger="rtt:0.99", horizon="dynamic")),
]
SCHEDULERS = ("fifo", "round_robin", "wait_ratio")


def fmt_row(r: dict, first: str) -> str:
    cfg = r["config"]
    served = r["server_inferences"] / cfg["measure_s"] if r.get("server_inferences") is not None else math.nan
    if cfg["drain_s"] > 0:
        latency = (f"{r['latency_mean_s']:.2f} | {r['latency_p25_s']:.2f} | {r['latency_p95_s']:.2f} | "
                   f"{r['tasks_measured']} ({r['tasks_unfinished']})")
    else:  # tasks not followed past the window: a latency would favour the short ones
        latency = "- | - | - | -"
    return (f"| {first} | {r['actions_per_s']:.0f} | {r['stalled_pct']:.2f} | {r['requests_per_s']:.1f} | {served:.1f} | "
            f"{r['mean_kept_rows']:.1f} | {r['server_batch_mean']:.1f} | {r['rtt_p50_ms']:.0f} | {r['rtt_p99_ms']:.0f} | "
            f"{latency} | {r['driver_lateness_p99_ms']:.1f} |")


HEADER = ("| {first} | actions/s | stalled % | sent/s | served/s | rows kept per chunk | batch | RTT p50 ms | "
          "RTT p99 ms | task mean s | task p25 s | task p95 s | tasks (unfinished) | driver late p99 ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def study(args) -> tuple[str, dict]:
    tasks = load_traces(args.traces) if args.traces else generate_traces(args.tasks, args.trace_seed)
    st = Study(tasks, Path(args.out), args.fresh)
    base = RunConfig(warmup_s=args.warmup_s, measure_s=args.measure_s)
    out, data = [], {"ladder": [], "online": {}, "sensitivity": []}
    say = out.append
    say(f"Profile (ms per forward pass): {GPU_PROFILE_MS}: {1000 / GPU_PROFILE_MS[1]:.1f} req/s at batch 1, "
        f"{16000 / GPU_PROFILE_MS[16]:.1f} at 16 (4.8x). Traces: {describe(tasks)}. Fleet runs: {args.warmup_s:g} s "
        f"warm-up, {args.measure_s:g} s measured; latency runs follow the tasks that start in the window to their end.\n")
    say("Columns: *sent/s* observations the robots published, *served/s* chunks the server computed (a robot "
        "whose request timed out sends again, and a newer observation replaces an unserved one in its slot); "
        "*rows kept per chunk* the execution horizon a robot took from each chunk (its rows for steps already "
        "executed are then dropped); *batch* the server's mean batch size over its last 256 passes; latency "
        "columns only for runs that followed their tasks to the end.\n")

    if "ladder" in args.parts:
        fleets = args.fixed_fleet
        say("### Ablation ladder\n")
        say(f"Each rung adds one lever to the one before. Largest fleet: the most robots (doing tasks back to back) "
            f"with at most 1 % of control steps stalled, searched by runs of {args.measure_s:g} s. Task latency: "
            f"mean / P25 / P95 (stalled %) with {' and '.join(map(str, fleets))} robots on every rung.\n")
        say("| rung | largest fleet at <= 1 % stalled | vs first rung | " +
            " | ".join(f"task latency s @ {n} robots" for n in fleets) + " |")
        say("|---|---|---|" + "---|" * len(fleets))
        searches, fixed = [], []
        first_n = None
        for rung, ((name, levers), guess) in enumerate(zip(LADDER + EXTRA_RUNGS, args.guesses), 1):
            cfg = replace(base, **levers)
            n, points = st.largest_fleet(cfg, guess, limit=args.max_fleet)
            at_fixed = [st.run(replace(cfg, robots=k, drain_s=args.drain_s)) for k in fleets]
            searches.append(points)
            fixed.append(at_fixed)
            first_n = first_n or max(n, 1)
            cells = [f"{r['latency_mean_s']:.2f} / {r['latency_p25_s']:.2f} / {r['latency_p95_s']:.2f} "
                     f"({r['stalled_pct']:.1f} %)" for r in at_fixed]
            say(f"| {rung}. {name} | {n} | {n / first_n:.1f}x | " + " | ".join(cells) + " |")
            data["ladder"].append({"name": name, "largest_fleet": n, "points": points, "fixed": at_fixed})
        say("")
        say("Every run of the searches:\n")
        say(HEADER.format(first="rung / robots"))
        for i, points in enumerate(searches):
            for p in points:
                say(fmt_row(p, f"{i + 1} / {p['config']['robots']}"))
        say("")
        for j, k in enumerate(fleets):
            say(f"With {k} robots:\n")
            say(HEADER.format(first="rung"))
            for i, runs in enumerate(fixed):
                say(fmt_row(runs[j], str(i + 1)))
            say("")
        if args.scale_fleet:
            say(f"The full system (rung 5) with {args.scale_fleet} robots, past what one server sustains: the driver "
                "keeps its 30 Hz ticks (lateness in the last column) and the server its throughput.\n")
            say(HEADER.format(first="robots"))
            big = st.run(replace(base, **LADDER[-1][1], robots=args.scale_fleet, drain_s=args.drain_s))
            say(fmt_row(big, str(args.scale_fleet)))
            say("")
            data["scale"] = big

    if "online" in args.parts:
        say("### Schedulers across arrival rates (online, Poisson task arrivals)\n")
        say(f"Send trigger from RTT, static horizon; a pool of {args.pool} robots takes the arriving tasks; "
            f"{args.warmup_s:g} s warm-up, tasks arriving in the next {args.online_measure_s:g} s followed to their end "
            f"(at most {args.drain_s:g} s more).\n")
        for batch, rates in (("1", args.rates_b1), ("auto", args.rates_bn)):
            say(f"Max batch {batch}:\n")
            say(HEADER.format(first="tasks/s / scheduler"))
            rows = data["online"][batch] = []
            for rate in rates:
                for sched in SCHEDULERS:
                    r = st.run(replace(base, scheduler=sched, max_batch=batch, mode="online", robots=args.pool,
                                       rate_per_s=rate, measure_s=args.online_measure_s, drain_s=args.drain_s))
                    rows.append(r)
                    say(fmt_row(r, f"{rate:g} / {sched}"))
            say("")

    if "sensitivity" in args.parts:
        rate = args.sensitivity_rate
        say(f"### wait_ratio settings at {rate:g} tasks/s, max batch auto\n")
        say("Defaults B=10, A=1, first request ranked highest; one setting varies per row.\n")
        say(HEADER.format(first="setting"))
        online = replace(base, mode="online", robots=args.pool, rate_per_s=rate, max_batch="auto",
                         measure_s=args.online_measure_s, drain_s=args.drain_s)
        variants = [("fifo (reference)", dict(scheduler="fifo"))]
        variants += [(f"B={b}", dict(scheduler="wait_ratio", buckets=b)) for b in args.sweep_buckets]
        variants += [(f"A={a}", dict(scheduler="wait_ratio", aging=a)) for a in args.sweep_aging if a != 1]
        variants += [(f"first request {f}", dict(scheduler="wait_ratio", first_request=f)) for f in ("mean", "lowest")]
        for name, kw in variants:
            r = st.run(replace(online, **kw))
            data["sensitivity"].append({"name": name, **r})
            say(fmt_row(r, name))
        say("")
    return "\n".join(out), data


def plots(data: dict, folder: Path) -> list[str]:
    """PNG figures of the study; returns the written files' names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if data.get("ladder"):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        names = [s["name"].replace(": ", ":\n").replace(" (LeRobot's own", "\n(LeRobot's own") for s in data["ladder"]]
        values = [s["largest_fleet"] for s in data["ladder"]]
        ax.barh(range(len(values)), values, color="#4c72b0")
        ax.set_yticks(range(len(values)), names, fontsize=8)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v}", va="center", fontsize=8)
        ax.set_xlabel("largest fleet with <= 1 % of control steps stalled (robots)")
        ax.set_title("Ablation ladder: one server, real Zenoh, GPU-like batch profile", fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / "fleet_ladder.png", dpi=110)
        plt.close(fig)
        written.append("fleet_ladder.png")
    if data.get("online"):
        fig, axes = plt.subplots(1, len(data["online"]), figsize=(10, 3.6), squeeze=False)
        for ax, (batch, rows) in zip(axes[0], data["online"].items()):
            for sched, color in zip(SCHEDULERS, ("#4c72b0", "#55a868", "#c44e52")):
                pts = sorted((r["config"]["rate_per_s"], r["latency_mean_s"], r["latency_p95_s"])
                             for r in rows if r["config"]["scheduler"] == sched)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{sched} mean")
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color, alpha=0.6, label=f"{sched} P95")
            ax.set_title(f"max batch {batch}", fontsize=9)
            ax.set_xlabel("task arrivals per second")
            ax.set_ylabel("task latency (s)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "fleet_online.png", dpi=110)
        plt.close(fig)
        written.append("fleet_online.png")
    return written


BEGIN, END = "<!-- fleet-zenoh:begin (generated by benchmarks/fleet_zenoh.py) -->", "<!-- fleet-zenoh:end -->"


def write_docs(path: Path, body: str, command: str, images: list[str]) -> None:
    """Replace the generated block of the "Fleet over real Zenoh" section."""
    pictures = "".join(f"![{name}](img/{name})\n\n" for name in images)
    write_docs_block(path, BEGIN, END, "Fleet over real Zenoh", f"Command: `{command}`\n\n{pictures}{body}")


# ------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "study"):
        s = sub.add_parser(name)
        s.add_argument("--tasks", type=int, default=300, help="generated traces")
        s.add_argument("--trace-seed", type=int, default=1)
        s.add_argument("--traces", help="a JSON trace file (benchmarks/fleet_traces.py) instead of generated ones")
        s.add_argument("--out", default=str(OUT))
        s.add_argument("--warmup-s", type=float, default=8.0)
        s.add_argument("--measure-s", type=float, default=30.0)
    r = sub.choices["run"]
    for f in ("scheduler", "first_request", "trigger", "horizon", "mode", "max_batch"):
        r.add_argument("--" + f.replace("_", "-"), default=getattr(RunConfig, f))
    r.add_argument("--buckets", type=int, default=RunConfig.buckets)
    r.add_argument("--aging", type=int, default=RunConfig.aging)
    r.add_argument("--robots", type=int, default=RunConfig.robots)
    r.add_argument("--rate-per-s", type=float, default=RunConfig.rate_per_s)
    r.add_argument("--drain-s", type=float, default=0.0)
    r.add_argument("--port", type=int, default=7521)
    r.add_argument("--json", help="write the result here")
    s = sub.choices["study"]
    s.add_argument("--parts", nargs="+", default=["ladder", "online", "sensitivity"])
    s.add_argument("--guesses", type=int, nargs="+", default=[6, 20, 40, 40, 60, 60], help="first fleet tried per rung")
    s.add_argument("--fixed-fleet", type=int, nargs="+", default=[20, 45], help="fleets every rung's latency is measured at")
    s.add_argument("--max-fleet", type=int, default=160, help="the capacity search stops here")
    s.add_argument("--scale-fleet", type=int, default=100, help="one run of the full system with this many robots")
    s.add_argument("--pool", type=int, default=160)
    s.add_argument("--online-measure-s", type=float, default=40.0)
    s.add_argument("--drain-s", type=float, default=30.0)
    s.add_argument("--rates-b1", type=float, nargs="+", default=[0.8, 1.0, 1.2, 1.6])
    s.add_argument("--rates-bn", type=float, nargs="+", default=[4.0, 5.0, 6.0, 8.0])
    s.add_argument("--sensitivity-rate", type=float, default=5.0, help="tasks/s (max batch auto)")
    s.add_argument("--sweep-buckets", type=int, nargs="+", default=[1, 10, 100])
    s.add_argument("--sweep-aging", type=int, nargs="+", default=[1, 4, 1000])
    s.add_argument("--fresh", action="store_true", help="re-run configurations that have a cached result")
    s.add_argument("--write-docs", help="rewrite the generated block of this markdown file and its img/ figures")
    w = sub.add_parser("traces", help="write the generated traces to a JSON file")
    w.add_argument("path")
    w.add_argument("--tasks", type=int, default=300)
    w.add_argument("--trace-seed", type=int, default=1)
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
                        horizon=args.horizon, mode=args.mode, robots=args.robots, rate_per_s=args.rate_per_s,
                        warmup_s=args.warmup_s, measure_s=args.measure_s, drain_s=args.drain_s)
        result = run(cfg, tasks, Path(args.out), port=args.port)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    t0 = time.perf_counter()
    body, data = study(args)
    print(body)
    print(f"({(time.perf_counter() - t0) / 60:.1f} min)", file=sys.stderr)
    if args.write_docs:
        docs = Path(args.write_docs)
        images = plots(data, docs.parent / "img")
        command = "python benchmarks/fleet_zenoh.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_docs(docs, body, command.strip(), images)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
