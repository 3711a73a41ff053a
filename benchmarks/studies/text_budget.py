"""Text never starves actions, over Zenoh against a real server: an honest robot beside 16 robots that
ask a combined pi0.5 for actions and text, against the same fleet without text (docs/security.md,
"Text beside actions, measured").

Each run starts `lerobot-policy-server` in its own process (`python -m lerobot_zenoh.cli.server`) on a
manifest serving the builder's tiny pi0.5 (random weights, one 96x128 camera, chunks of 50 at 30 Hz;
built offline as benchmarks/studies/language.py builds it) with a `language` block and one pipeline
item (task `talk`: actions on bit 0, text on bit 1), and drives it over Zenoh on loopback:

- 16 robots, in a driver process: each is fleet_zenoh's `VirtualRobot` (the reference client's
  `ActionBuffer`, `SendTrigger` and `ChunkIntake`, one action per 30 Hz tick, control loops spread
  over 10 phases of the period) publishing each observation (one JPEG, 6-D state, a task of ~190
  tokens, with its header) on the task's stream, asking actions and text (mask 0b11) or actions only
  (0b01);
- one honest robot in this process: the reference `RobotClient` on the simulated arm (JPEG over the
  wire, no same-host frames), on the model's own app key, asking actions for a short task. Its empty
  ticks are its client's own count (`empty_cycles`), as benchmarks/studies/ingest_floods.py reads them.

Three conditions run one after the other, each on a fresh server with identical settings, in rounds
(no-text, text, text-slo, no-text, ...) so that the machine's background load falls on all three alike:

  no-text   the fleet asks actions only (the control);
  text      the fleet asks actions and text (`--tokens` tokens per answer);
  text-slo  the same with `language.action_slo_ms` (`--slo-ms`; `auto`: 1.25 x the p99 action latency
            of every robot in the first no-text run, rounded up to 10 ms: what the fleet achieves
            without text plus a quarter, so the SLO is one the actions can keep and text is left a
            frame of 0.9 x SLO - the slowest call to fit into).

In turn rather than side by side: on 2 cores, servers running at once would slow each other, and the
text servers' decoding would slow the no-text one, so the control would carry the cost it is the
control for.

Printed per run: the honest robot's empty ticks of its ticks in the window and its p99 latency
(observation out to chunk in), every robot's action latency p50/p99, the text robots' empty ticks,
text tokens/s (the server's `language.tokens` over the window, from its telemetry), the final texts and
their latency (ask to final text), the frames the budget cut short, chunks served per second, the
server's own p99s over the run (an observation's wait in its slot, every robot's and the honest one's,
and the call), what a decode step and a generation's prompt pass cost, the driver's tick lateness and
the load average; then each condition over the rounds, and whether the budget held.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.text_budget [--quick] [--rounds 3]
        [--seconds 40] [--warmup 8] [--slo-ms auto] [--port-base 17940] [--server-threads 1]

About 10 minutes on 2 cores with the defaults (a server start of ~15 s per run); `--quick`: one round
of 6 s windows, a smoke run of about 2 minutes. The server runs torch on one thread by default, so
that the robots' processes keep the other core. Results and each server's log go to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.harness.workloads import SceneCamera  # noqa: E402
from benchmarks.harness.processes import ServerProcess  # noqa: E402
from benchmarks.harness.driver import deliver, deliver_chunks, driver_ticks, telemetry_metrics  # noqa: E402
from benchmarks.harness.robot import Capture  # noqa: E402
from benchmarks.studies import language  # noqa: E402
from benchmarks.studies.fleet_traces import CHUNK_SIZE, FPS, Task  # noqa: E402
from benchmarks.studies.fleet_zenoh import DT_S, PHASES, Counters, RunConfig, VirtualRobot  # noqa: E402
from lerobot_zenoh.errors import ProtocolError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey, pipeline_app  # noqa: E402
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import ZenohSettings  # noqa: E402

TASK = "talk"  # the pipeline task: its System 1 (bit 0) and System 2 (bit 1) from one pi0.5
ACTIONS, TEXT = 0b01, 0b11
HONEST = "honest"
SERVER_ID = "text-budget"
CONDITIONS = ("no-text", "text", "text-slo")
OUT = ROOT / "outputs" / "text_budget"
#: A trace that never ends: the fleet's robots run one task for the whole run.
ENDLESS = Task(static_h=CHUNK_SIZE, length=10**9, rounds=(CHUNK_SIZE,))


def pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def client_settings(port: int, wait_s: float | None = None) -> ZenohSettings:
    """A Zenoh client of the server on `port` (client mode: it listens nowhere)."""
    return ZenohSettings(connect=[f"tcp/127.0.0.1:{port}"], multicast_scouting=False, connect_timeout_s=wait_s)


def manifest(app: AppKey, port: int, checkpoint: Path, args, slo_ms: float | None) -> dict:
    lang = {"max_new_tokens": args.tokens, "tokens_per_frame": args.per_frame, "max_requests": 32}
    if slo_ms is not None:
        lang["action_slo_ms"] = slo_ms
    entry = {"model_id": app.model, "model_version": app.version, "application_tag": app.app,
             "pretrained_path": str(checkpoint), "fps": FPS, "max_batch_size": args.max_batch,
             "accept_unknown_clients": True, "language": lang,
             "pipeline": [{"task": TASK, "component": "act", "bit": 0,
                           "text": {"component": "plan", "bit": 1, "max_new_tokens": args.tokens}}]}
    return {"cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": SERVER_ID,
            "telemetry_period_s": 1.0, "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
            "server": [entry]}


# ------------------------------------------------------------------------------------ the fleet driver


class TextRobot(VirtualRobot):
    """One robot of the fleet: fleet_zenoh's robot (the reference client's buffer, send trigger and
    chunk intake) sending a camera frame, its state and a long task on the task's stream, asking
    `mask`; its own counters (`c`), and the latency of each final text it asked for."""

    def __init__(self, client_id: str, publisher, phase: int, mask: int, frames: list[bytes]):
        super().__init__(client_id, RunConfig(), publisher, phase)
        self.mask, self.frames = mask, frames
        self.c = Counters()
        self.sent_s: dict[int, float] = {}
        self.text_s: list[float] = []
        self.state = np.linspace(-1, 1, 6, dtype=np.float32)

    def publish(self, capture: Capture, now: float) -> None:
        self.sent_s[capture.seq] = now
        obs = self.observation(capture, self.state, {"front": self.frames[capture.seq % len(self.frames)]},
                               language.LONG_TASK, task_elapsed_s=now - self.task_start_s, component_mask=self.mask)
        self.publisher.put(codec.encode(obs), codec.encode_observation_header(obs))

    def on_chunk(self, payload: bytes, arrived_s: float, _shared) -> None:
        super().on_chunk(payload, arrived_s, self.c)

    def on_text(self, payload: bytes, arrived_s: float) -> None:
        try:
            text = codec.decode_text_result(payload)
        except ProtocolError:
            return
        asked = self.sent_s.get(text.response_to_seq_id)
        if not text.partial and asked is not None and self.c.counting:
            self.text_s.append(arrived_s - asked)


def drive(spec: dict) -> None:
    """The fleet driver process: robots ready, "ready" on stdout; on a line of stdin, `warmup_s` +
    `seconds` of driving; then their figures as one JSON line."""
    app = AppKey(*spec["app"])
    stream = pipeline_app(app.cluster, app.experiment, TASK)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    texts: queue.SimpleQueue = queue.SimpleQueue()
    lateness: list[float] = []
    with ZenohSession(client_settings(spec["port"], 60.0)).open() as session:
        # Zenoh callbacks hand over, nothing else; the driver's thread decodes.
        session.subscribe(f"{app.prefix}/*/action", lambda key, payload: inbox.put((key, payload, time.perf_counter())))
        session.subscribe(f"{app.prefix}/*/text", lambda key, payload: texts.put((key, payload, time.perf_counter())))
        robots = []
        for i in range(spec["robots"]):
            client = f"r{i:02d}"
            camera = SceneCamera(96, 128, seed=i)
            frames = [codec.encode_jpeg(camera.frame(k), 90) for k in range(8)]
            robots.append(TextRobot(client, session.publisher(stream.client(client).obs_for(spec["mask"]), OBSERVATION_QOS),
                                    i % PHASES, spec["mask"], frames))
        by_id = {r.client_id: r for r in robots}
        groups = [[r for r in robots if r.phase == p] for p in range(PHASES)]
        rng = np.random.default_rng(0)
        starts = sorted(zip(rng.uniform(0, 1.0, size=len(robots)), range(len(robots))), reverse=True)
        time.sleep(0.5)  # the subscriptions reach the server before the first observation
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.perf_counter()
        w0 = t0 + spec["warmup_s"]
        w1 = w0 + spec["seconds"]
        for i, now, counting in driver_ticks(t0, DT_S / PHASES, w0, w1, lateness):
            deliver_chunks(inbox, by_id, None)
            deliver(texts, by_id, lambda robot, payload, arrived: robot.on_text(payload, arrived))
            while starts and now >= t0 + starts[-1][0]:  # first tasks staggered over the first second
                robots[starts.pop()[1]].start_task(ENDLESS, now, False)
            for robot in groups[i % PHASES]:
                robot.c.counting = counting
                robot.tick(now, robot.c)
    print(json.dumps({"robots": {r.client_id: {
        "empty": r.c.stalled + r.c.first_wait, "ticks": r.c.executed + r.c.stalled + r.c.first_wait,
        "sent": r.c.sent, "chunks": r.c.received, "rtt_ms": [x * 1000 for x in r.c.rtts_s],
        "text_s": r.text_s} for r in robots},
        "lateness_p99_ms": pct(lateness, 99) * 1000}), flush=True)


# ------------------------------------------------------------------------------------ one run


def window_rate(figures: list[tuple[float, dict]], name: str, w0: float, w1: float) -> tuple[float, float]:
    """(increase of the counter `name`, per second) between the first and last telemetry inside the window."""
    inside = [(t, m) for t, m in figures if w0 <= t <= w1]
    if len(inside) < 2:
        return math.nan, math.nan
    (ta, a), (tb, b) = inside[0], inside[-1]
    d = float(b.get(name, 0)) - float(a.get(name, 0))
    return d, d / (tb - ta)


def run_one(condition: str, slo_ms: float | None, port: int, checkpoint: Path, args, logs: Path) -> dict:
    """One condition on a fresh server: the fleet and the honest robot for `warmup` + `seconds`."""
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.client import RobotClient
    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig

    app = AppKey("textbudget", uuid.uuid4().hex[:8], "pi05", "v1", "talk-srv")
    load_before = os.getloadavg()
    telemetry: list[tuple[float, bytes]] = []
    server = ServerProcess(manifest(app, port, checkpoint, args, slo_ms), logs / f"{condition}_{port}.log",
                           env={"OMP_NUM_THREADS": str(args.server_threads)})
    driver = client = None
    with server:
        watcher = ZenohSession(client_settings(port, 300.0)).open()
        try:
            deadline = time.monotonic() + 300
            while not watcher.query(app.status, 1.0):
                if server.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not come up; see {server.log_path}")
                time.sleep(0.3)
            watcher.subscribe(app.server_metrics(SERVER_ID), lambda key, payload: telemetry.append((time.perf_counter(), payload)))
            spec = {"app": [app.cluster, app.experiment, app.model, app.version, app.app], "port": port,
                    "robots": args.robots, "mask": ACTIONS if condition == "no-text" else TEXT,
                    "warmup_s": args.warmup, "seconds": args.seconds}
            driver = subprocess.Popen([sys.executable, "-m", "benchmarks.studies.text_budget", "--driver", json.dumps(spec)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
            if driver.stdout.readline().strip() != "ready":
                raise RuntimeError("the fleet driver did not start")
            cfg = RobotClientConfig(robot=SimRobotConfig(cameras=dict(language.CAMERAS), fps=FPS), client_uuid=HONEST,
                                    cluster_uuid=app.cluster, experiment_tag=app.experiment, model_id=app.model,
                                    model_version=app.version, application_tag=app.app, task=language.TASKS[0],
                                    endpoint=f"tcp/127.0.0.1:{port}", zenoh=ZenohSettings(multicast_scouting=False),
                                    fps=FPS, same_host=False)
            client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
            thread = threading.Thread(target=client.run, args=(args.warmup + args.seconds,))
            driver.stdin.write("go\n")
            driver.stdin.flush()
            thread.start()
            time.sleep(args.warmup)  # (a study: the robots run on their own deadlines meanwhile)
            c = client.counters
            w0, mark = time.perf_counter(), (c.steps, c.empty_cycles, len(c.rtt_ms))
            thread.join()
            w1 = time.perf_counter()
            honest = {"empty": c.empty_cycles - mark[1], "ticks": c.steps - mark[0],
                      "rtt_ms": list(c.rtt_ms)[mark[2]:]}
            fleet = json.loads(driver.stdout.readline() or "{}")
            time.sleep(1.5)  # the window's last telemetry
        finally:
            if client is not None:
                client.close()
            if driver is not None and driver.poll() is None:
                driver.kill()
                driver.wait()
            watcher.close()
    figures = telemetry_metrics(telemetry)
    # The server's side of the latency (slot to batch start, and the call), over the run: the last
    # telemetry of the window, every robot's and the honest robot's own.
    last = next((m for t, m in reversed(figures) if t <= w1 + 1.0), {})
    honest_server = {}
    for t, payload in reversed(telemetry):
        if t <= w1 + 1.0:
            try:
                honest_server = dict(codec.decode_telemetry(payload).per_client.get(HONEST, {}))
            except ProtocolError:
                continue
            break
    tokens, tokens_s = window_rate(figures, "language.tokens", w0, w1 + 1.0)
    texts, _ = window_rate(figures, "answers.text", w0, w1 + 1.0)
    shrunk, _ = window_rate(figures, "language.budget_shrunk", w0, w1 + 1.0)
    served, served_s = window_rate(figures, "inferences", w0, w1 + 1.0)
    # What text cost the inference thread: a decode step, and a prompt pass per generation admitted.
    decode_ms, _ = window_rate(figures, "language.decode_ms", w0, w1 + 1.0)
    step_ms, _ = window_rate(figures, "language.step_ms", w0, w1 + 1.0)
    steps, _ = window_rate(figures, "language.decode_steps", w0, w1 + 1.0)
    started, _ = window_rate(figures, "language.started", w0, w1 + 1.0)
    robots = fleet.get("robots", {})
    every = honest["rtt_ms"] + [x for r in robots.values() for x in r["rtt_ms"]]
    text_s = [x for r in robots.values() for x in r["text_s"]]
    return {"condition": condition, "slo_ms": slo_ms, "port": port, "load_avg": load_before,
            "honest_empty": honest["empty"], "honest_ticks": honest["ticks"], "honest_p99_ms": pct(honest["rtt_ms"], 99),
            "honest_rtt_ms": honest["rtt_ms"],
            "fleet_empty": sum(r["empty"] for r in robots.values()), "fleet_ticks": sum(r["ticks"] for r in robots.values()),
            "all_p50_ms": pct(every, 50), "all_p99_ms": pct(every, 99), "all_rtt_ms": every,
            "per_robot": {HONEST: {"p50_ms": pct(honest["rtt_ms"], 50), "p99_ms": pct(honest["rtt_ms"], 99)},
                          **{cid: {"p50_ms": pct(r["rtt_ms"], 50), "p99_ms": pct(r["rtt_ms"], 99), "empty": r["empty"]}
                             for cid, r in robots.items()}},
            "tokens": tokens, "tokens_s": tokens_s, "texts": texts, "text_p50_s": pct(text_s, 50),
            "budget_shrunk": shrunk, "served": served, "served_s": served_s,
            "queue_p99_ms": last.get("queue_ms_p99", math.nan), "call_p99_ms": last.get("inference_ms_p99", math.nan),
            "honest_queue_p99_ms": honest_server.get("queue_ms_p99", math.nan),
            "step_ms": step_ms / steps if steps else math.nan,
            "prompt_ms_per_text": (decode_ms - step_ms) / started if started else math.nan,
            "driver_late_p99_ms": fleet.get("lateness_p99_ms", math.nan)}


# ------------------------------------------------------------------------------------ the study


def fmt(x, digits: int = 0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


ROW = (f"{'round':>5} {'condition':24} {'honest empty':>14} {'honest p99':>10} {'all p50':>8} {'all p99':>8} "
       f"{'fleet empty':>13} {'tokens/s':>8} {'texts':>5} {'text p50 s':>10} {'shrunk':>6} {'chunks/s':>8} "
       f"{'queue p99':>9} {'honest':>6} {'call p99':>8} {'step ms':>7} {'prompt ms':>9} {'late p99':>8} {'load':>14}")


def print_row(k: int, r: dict) -> None:
    name = r["condition"] + (f" ({r['slo_ms']:.0f} ms)" if r["slo_ms"] else "")
    print(f"{k:5d} {name:24} {r['honest_empty']:5d} of {r['honest_ticks']:5d} {fmt(r['honest_p99_ms']):>10} "
          f"{fmt(r['all_p50_ms']):>8} {fmt(r['all_p99_ms']):>8} {r['fleet_empty']:5d} of {r['fleet_ticks']:5d} "
          f"{fmt(r['tokens_s'], 1):>8} {fmt(r['texts']):>5} {fmt(r['text_p50_s'], 2):>10} {fmt(r['budget_shrunk']):>6} "
          f"{fmt(r['served_s'], 1):>8} {fmt(r['queue_p99_ms']):>9} {fmt(r['honest_queue_p99_ms']):>6} "
          f"{fmt(r['call_p99_ms']):>8} {fmt(r['step_ms'], 1):>7} {fmt(r['prompt_ms_per_text'], 1):>9} "
          f"{fmt(r['driver_late_p99_ms'], 1):>8} "
          f"{' '.join(f'{x:.1f}' for x in r['load_avg']):>14}", flush=True)


def summarize(rows: list[dict]) -> dict:
    """Each condition over the rounds, and the acceptance checks: every round's text runs within 2
    empty ticks of its own no-text run, and the SLO run's p99 (every robot) within its SLO."""
    out = {}
    for cond in CONDITIONS:
        rs = [r for r in rows if r["condition"] == cond]
        if not rs:
            continue
        honest = [x for r in rs for x in r["honest_rtt_ms"]]
        every = [x for r in rs for x in r["all_rtt_ms"]]
        out[cond] = {"honest_empty": [r["honest_empty"] for r in rs], "honest_ticks": [r["honest_ticks"] for r in rs],
                     "honest_p99_ms": pct(honest, 99), "all_p50_ms": pct(every, 50), "all_p99_ms": pct(every, 99),
                     "tokens_s": [r["tokens_s"] for r in rs], "slo_ms": rs[0]["slo_ms"]}
    base = [r for r in rows if r["condition"] == "no-text"]
    checks = {}
    for cond in ("text", "text-slo"):
        rs = [r for r in rows if r["condition"] == cond]
        if rs and len(rs) == len(base):
            checks[f"{cond}: honest empty within 2 of no-text, every round"] = all(
                r["honest_empty"] - b["honest_empty"] <= 2 for r, b in zip(rs, base, strict=True))
    if "text-slo" in out:
        checks["text-slo: p99 of every robot within action_slo_ms"] = out["text-slo"]["all_p99_ms"] <= out["text-slo"]["slo_ms"]
    return {"conditions": out, "checks": checks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of 6 s windows after 4 s (a smoke run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help=f"of {', '.join(CONDITIONS)}, run in this order")
    ap.add_argument("--seconds", type=float, default=40.0, help="the measured window of each run")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds of running before the window")
    ap.add_argument("--robots", type=int, default=16, help="the fleet asking text (besides the honest robot)")
    ap.add_argument("--tokens", type=int, default=20, help="tokens per text answer")
    ap.add_argument("--per-frame", type=int, default=4, help="language.tokens_per_frame")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's max_batch_size")
    ap.add_argument("--slo-ms", default="auto", help="language.action_slo_ms of text-slo, or auto (module docstring)")
    ap.add_argument("--server-threads", type=int, default=1, help="the server's torch threads (OMP_NUM_THREADS)")
    ap.add_argument("--port-base", type=int, default=17940, help="the k-th run's server listens on port_base + k")
    ap.add_argument("--out", type=Path, default=OUT, help="the checkpoint, the servers' logs and result.json")
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.driver:
        drive(json.loads(args.driver))
        return 0
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 6.0, 4.0
    conditions = args.conditions.split(",")
    if unknown := set(conditions) - set(CONDITIONS):
        ap.error(f"unknown conditions {sorted(unknown)}")
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    checkpoint = language.build(args.out, "tiny")
    slo_ms = None if args.slo_ms == "auto" else float(args.slo_ms)
    print(f"text budget over Zenoh: {args.robots} robots asking text ({args.tokens} tokens, tasks of "
          f"~190 tokens) + 1 honest robot, {FPS} Hz, chunks of {CHUNK_SIZE}, max batch {args.max_batch}, "
          f"tokens_per_frame {args.per_frame}, server torch threads {args.server_threads}; {args.rounds} round(s) "
          f"of {', '.join(conditions)}, {args.seconds:.0f} s windows after {args.warmup:.0f} s; load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(ROW, flush=True)
    rows: list[dict] = []
    port = args.port_base
    for k in range(args.rounds):
        for cond in conditions:
            if cond == "text-slo" and slo_ms is None:
                base = next((r for r in rows if r["condition"] == "no-text"), None)
                if base is None:
                    ap.error("--slo-ms auto needs a no-text run before the first text-slo run")
                slo_ms = math.ceil(1.25 * base["all_p99_ms"] / 10) * 10
            r = run_one(cond, slo_ms if cond == "text-slo" else None, port, checkpoint, args, logs)
            port += 1
            rows.append(r)
            print_row(k, r)
    summary = summarize(rows)
    print(f"\n{'condition':24} {'honest empty (per round)':>30} {'honest p99':>10} {'all p50':>8} {'all p99':>8} "
          f"{'tokens/s (per round)':>24}")
    for cond, s in summary["conditions"].items():
        name = cond + (f" ({s['slo_ms']:.0f} ms)" if s["slo_ms"] else "")
        empty = ", ".join(f"{e} of {t}" for e, t in zip(s["honest_empty"], s["honest_ticks"], strict=True))
        print(f"{name:24} {empty:>30} {fmt(s['honest_p99_ms']):>10} {fmt(s['all_p50_ms']):>8} {fmt(s['all_p99_ms']):>8} "
              f"{', '.join(fmt(x, 1) for x in s['tokens_s']):>24}")
    for check, ok in summary["checks"].items():
        print(f"{'holds' if ok else 'FAILS'}: {check}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    (args.out / "result.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                      "rows": rows, "summary": summary}, indent=1, default=float))
    print(f"written to {args.out / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
