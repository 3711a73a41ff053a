"""Re-fetch of stale observations on the real stack (docs/protocol.md §10.7): how old is the
observation a request is served with, with and without re-fetch, at a load where requests queue?

- REAL: the policy server in its own process (`python -m lerobot_zenoh.cli.server`: engine, slots,
  scheduler, the header read on admit that drops late refreshes, reliable chunk publication,
  telemetry), Zenoh on loopback, the codec and observation headers, and on the robot side the
  reference client's own `SendTrigger` (send rule, request time-outs, `refresh_due`/`on_refresh`),
  `ChunkIntake` (capture step of the observation answered, RTT from the request's first send) and
  `ActionBuffer`. Each robot's control step does what `ControlLoop.step` does: a new request when
  the send rule says so, else a refresh of its waiting request when one is due.
- SIMULATED: the robots (a 30 Hz tick that executes the next buffered action or stalls; no camera
  images, so a refresh costs the publish and the server's admit, not a JPEG encode) and the model
  (the synthetic policy sleeps a GPU-like latency: 60 ms a pass at batch 1, 200 ms at 16).

Every robot runs continuously (no tasks), asking for chunks of `--actions-per-chunk` actions; the
load on a batch-1 server is about robots x fps / actions_per_chunk x 60 ms. Control loops are spread
over 10 phases of the period, and each robot starts at a random offset within 1 s (the seed).

Per run, over the measurement window: the capture-to-inference age of every answered observation
(chunk arrival minus the capture of the observation it answers, minus the server's inference time;
it includes the chunk's way back, well under 1 ms on loopback), the RTT (from each request's first
send), stalled steps (% of robot steps with an empty buffer after the first chunk), actions executed
per second, the refreshes published per answered request, and from the server's telemetry the
refreshes it took into a slot and those it dropped as late (its inferences per answered request show
that no refresh costs an inference). The driver's tick lateness is reported (a loaded driver would
distort the figures).

    PYTHONPATH=. python -m benchmarks.studies.refetch --robots 8 --refetch 0 0.1 0.2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.harness.processes import ServerProcess  # noqa: E402
from testbed.ports import free_port  # noqa: E402
from benchmarks.harness.driver import deliver_chunks, driver_ticks, telemetry_metrics  # noqa: E402
from benchmarks.harness.robot import SimulatedRobot  # noqa: E402
from lerobot_zenoh.errors import ProtocolError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig  # noqa: E402
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import loopback_settings  # noqa: E402

FPS = 30
DT_S = 1.0 / FPS
PHASES = 10
CHUNK_SIZE = 50
GPU_PROFILE_MS = {1: 60.0, 2: 66.0, 4: 80.0, 8: 120.0, 16: 200.0}  # as benchmarks/studies/fleet_traces.py
APP = AppKey("refetch", "bench", "synthetic", "v1", "refetch")
SERVER_ID = "refetch-server"
OUT = ROOT / "outputs" / "refetch"


@dataclass(frozen=True)
class RunConfig:
    robots: int = 8
    actions_per_chunk: int = 15
    max_batch: int = 1
    scheduler: str = "fifo"
    refetch_after_s: float = 0.0  # 0: off
    warmup_s: float = 3.0
    measure_s: float = 15.0
    seed: int = 0


def manifest(cfg: RunConfig, port: int) -> dict:
    entry = {"model_id": APP.model, "model_version": APP.version, "application_tag": APP.app, "fps": FPS,
             "synthetic": {"state_dim": 2, "action_dim": 2, "chunk_size": CHUNK_SIZE, "cameras": {},
                           "batch_latency_ms": dict(GPU_PROFILE_MS)},
             "scheduler": cfg.scheduler, "max_batch_size": cfg.max_batch,
             "accept_unknown_clients": True, "max_unknown_clients": 512}
    return {"cluster_uuid": APP.cluster, "experiment_tag": APP.experiment, "server_id": SERVER_ID,
            "telemetry_period_s": 0.5, "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
            "server": [entry]}


@dataclass
class Counters:
    counting: bool = False
    steps: int = 0
    executed: int = 0
    stalled: int = 0
    requests: int = 0
    refreshes: int = 0
    requests_total: int = 0  # the whole run, warm-up included (the server's totals cover it too)
    refreshes_total: int = 0
    answered: int = 0
    answered_by_refresh: int = 0
    ages_s: list = field(default_factory=list)
    rtts_s: list = field(default_factory=list)


class Robot(SimulatedRobot):
    """One robot: the harness's simulated robot (the reference client's send trigger, chunk intake and
    buffer, stepped like `ControlLoop.step`: request if the send rule says so, else a refresh when
    one is due), running continuously from `start_s`."""

    def __init__(self, client_id: str, cfg: RunConfig, publisher, phase: int, start_s: float):
        super().__init__(client_id, dt_s=DT_S, send_rule=SendTriggerConfig(refetch_after_s=cfg.refetch_after_s or None),
                         max_actions=cfg.actions_per_chunk)
        self.publisher, self.phase, self.start_s = publisher, phase, start_s

    def tick(self, now: float, c: Counters) -> None:
        if now < self.start_s:
            return
        capture = self.capture(now)
        if capture is not None:
            if capture.refreshes is None:
                c.requests += c.counting
                c.requests_total += 1
            else:
                c.refreshes += c.counting
                c.refreshes_total += 1
            obs = self.observation(capture, np.array([now - self.start_s, capture.step], np.float32),
                                   task_elapsed_s=now - self.start_s)
            self.publisher.put(codec.encode(obs), attachment=codec.encode_observation_header(obs))
        c.steps += c.counting and self.moving
        moving = self.moving
        if self.act() is not None:
            c.executed += c.counting
        elif moving:
            c.stalled += c.counting

    def on_chunk(self, payload: bytes, arrived_s: float, c: Counters) -> None:
        try:
            chunk = codec.decode_action_chunk(payload)
        except ProtocolError:
            return
        result = self.take(chunk, arrived_s)
        if not result.accepted or not c.counting:
            return
        c.answered += 1
        c.answered_by_refresh += result.request_seq != result.seq_id
        c.ages_s.append(max(result.capture_age_s - chunk.inference_time_ms / 1000, 0.0))
        if result.rtt_s is not None:
            c.rtts_s.append(result.rtt_s)


def run(cfg: RunConfig, out: Path = OUT, verbose: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(cfg.seed)
    port = free_port()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    telemetry: list[tuple[float, bytes]] = []
    with ServerProcess(manifest(cfg, port), out / "server.log") as server, \
            ZenohSession(loopback_settings(connect_ports=(port,))).open() as session:
        server.wait_answering(lambda: session.query(APP.status, 0.5))
        session.subscribe(f"{APP.prefix}/*/action", lambda key, payload: inbox.put((key, payload, time.perf_counter())))
        session.subscribe(APP.server_metrics(SERVER_ID), lambda key, payload: telemetry.append((time.perf_counter(), payload)))
        time.sleep(0.5)  # let the subscriptions reach the server before the first observation
        t0 = time.perf_counter()
        offsets = rng.uniform(0.0, 1.0, size=cfg.robots)
        robots = [Robot(f"r{i:03d}", cfg, session.publisher(APP.client(f"r{i:03d}").obs, OBSERVATION_QOS),
                        phase=int(rng.integers(PHASES)), start_s=t0 + offsets[i]) for i in range(cfg.robots)]
        by_id = {r.client_id: r for r in robots}
        groups = [[r for r in robots if r.phase == p] for p in range(PHASES)]
        c = Counters()
        w0, w1 = t0 + cfg.warmup_s, t0 + cfg.warmup_s + cfg.measure_s
        lateness: list[float] = []
        for i, now, c.counting in driver_ticks(t0, DT_S / PHASES, w0, w1, lateness):
            deliver_chunks(inbox, by_id, c)
            for robot in groups[i % PHASES]:
                robot.tick(now, c)
        time.sleep(0.7)  # one more telemetry period
    figures = telemetry_metrics(telemetry)
    return summarize(cfg, c, lateness, figures, w0, w1, verbose)


def summarize(cfg: RunConfig, c: Counters, lateness, figures, w0, w1, verbose) -> dict:
    def at(t):  # the server's cumulative counters as of time t (its last report before t)
        before = [m for ts, m in figures if ts <= t]
        return before[-1] if before else {}

    start, end = at(w0), at(w1 + 0.6)
    delta = lambda k: end.get(k, 0) - start.get(k, 0)  # noqa: E731
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else float("nan")  # noqa: E731
    r = {
        "config": asdict(cfg),
        "age_p50_ms": pct(c.ages_s, 50), "age_p99_ms": pct(c.ages_s, 99),
        "rtt_p50_ms": pct(c.rtts_s, 50), "rtt_p99_ms": pct(c.rtts_s, 99),
        "stalled_pct": 100.0 * c.stalled / max(c.steps, 1),
        "actions_per_s": c.executed / cfg.measure_s,
        "answered": c.answered,
        "answered_by_refresh_pct": 100.0 * c.answered_by_refresh / max(c.answered, 1),
        "refreshes_per_request": c.refreshes / max(c.requests, 1),
        "server_refreshes": delta("observations_refreshes"),
        "server_refreshes_late": delta("refreshes_late"),
        # Whole run: every request costs at most one inference, a refresh none.
        "inferences_per_request": figures[-1][1].get("inferences", 0) / max(c.requests_total, 1) if figures else float("nan"),
        "refreshes_taken_or_late_per_sent": (figures[-1][1].get("observations_refreshes", 0)
                                             + figures[-1][1].get("refreshes_late", 0)) / c.refreshes_total
                                            if figures and c.refreshes_total else float("nan"),
        "server_queue_ms_p50": end.get("queue_ms_p50", float("nan")),
        "load": cfg.robots * FPS / cfg.actions_per_chunk * GPU_PROFILE_MS[1] / 1000 if cfg.max_batch == 1 else None,
        "driver_lateness_p99_ms": pct(lateness, 99),
    }
    if verbose:
        print(f"  {cfg.scheduler} refetch {cfg.refetch_after_s or 'off'} seed {cfg.seed}: age p50/p99 "
              f"{r['age_p50_ms']:.0f}/{r['age_p99_ms']:.0f} ms, RTT p50 {r['rtt_p50_ms']:.0f} ms, stalled "
              f"{r['stalled_pct']:.1f} %, {r['actions_per_s']:.0f} actions/s, refreshes/request "
              f"{r['refreshes_per_request']:.2f} (server: {r['server_refreshes']} taken, {r['server_refreshes_late']} late; "
              f"{r['inferences_per_request']:.3f} inferences per request), driver lateness p99 "
              f"{r['driver_lateness_p99_ms']:.1f} ms", flush=True)
    return r


def table(results: list[dict]) -> str:
    """Mean ± sd over seeds per (scheduler, threshold)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        cfg = r["config"]
        key = (cfg["scheduler"], cfg["max_batch"], cfg["actions_per_chunk"], cfg["robots"], cfg["refetch_after_s"])
        groups.setdefault(key, []).append(r)

    def pm(rs, key, fmt="{:.0f}"):
        xs = np.array([x[key] for x in rs], dtype=float)
        return f"{fmt.format(xs.mean())} ± {fmt.format(xs.std(ddof=1) if len(xs) > 1 else 0.0)}"

    lines = ["| scheduler, batch, actions per chunk, robots | re-fetch after | age p50 ms | age p99 ms | RTT p50 ms | stalled % | "
             "actions/s | refreshes per request | answered by a refresh % | refreshes late % | "
             "inferences per request | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (sched, batch, per_chunk, robots, after), rs in sorted(groups.items()):
        late = np.mean([x["server_refreshes_late"] / max(x["server_refreshes"] + x["server_refreshes_late"], 1) * 100
                        for x in rs])
        inf = np.mean([x["inferences_per_request"] for x in rs])
        lines.append(f"| {sched}, {batch}, {per_chunk}, {robots} | {f'{after * 1000:.0f} ms' if after else 'off'} | "
                     f"{pm(rs, 'age_p50_ms')} | {pm(rs, 'age_p99_ms')} | {pm(rs, 'rtt_p50_ms')} | "
                     f"{pm(rs, 'stalled_pct', '{:.1f}')} | {pm(rs, 'actions_per_s')} | "
                     f"{pm(rs, 'refreshes_per_request', '{:.2f}')} | {pm(rs, 'answered_by_refresh_pct')} | "
                     f"{late:.0f} | {inf:.3f} | {len(rs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--robots", type=int, default=8)
    p.add_argument("--actions-per-chunk", type=int, default=15)
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--scheduler", nargs="+", default=["fifo"])
    p.add_argument("--refetch", type=float, nargs="+", default=[0.0, 0.1], help="thresholds in s (0 = off)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--measure-s", type=float, default=15.0)
    p.add_argument("--json", type=Path, default=OUT / "results.json", help="where every run's figures go")
    args = p.parse_args(argv)
    base = RunConfig(robots=args.robots, actions_per_chunk=args.actions_per_chunk, max_batch=args.max_batch,
                     warmup_s=args.warmup_s, measure_s=args.measure_s)
    results = []
    for seed in args.seeds:  # seeds outermost: a drift of the machine's load spreads over every setting
        for scheduler in args.scheduler:
            for after in args.refetch:
                results.append(run(replace(base, scheduler=scheduler, refetch_after_s=after, seed=seed)))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
