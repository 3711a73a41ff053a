"""Benchmark 2: does the 30 Hz control loop keep its rate, with the server up and after it is gone?

    python -m benchmarks.control_loop [--full] [--seconds 20]

Each client runs its own control loop (ours: `RobotClient.run`; LeRobot: `RobotClient.control_loop`)
on the replaying robot, both configured to hand an observation over on every step (ours: a send
trigger buffer time far above the chunk; LeRobot: `chunk_size_threshold=1.0`), against a zero-cost
policy on loopback. After `--seconds` the server process is killed with SIGKILL and the loop goes on
for `--seconds` more. The systems take turns (ours, then LeRobot), each with its own server process.

Reported per phase: how long the hand-over call blocks the loop (ours: `Outbox.put`; LeRobot:
`send_observation`), the loop periods (time between the starts of consecutive iterations), the
achieved rate, and late steps: periods longer than one control period plus 5 ms (a step that
started more than 5 ms after the loop meant it to).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks.harness.workloads import DT_S, MAIN_WORKLOAD, WORKLOADS
from benchmarks.harness.results import fmt, summary
from testbed.ports import free_port
from benchmarks.harness.results import CoreBenchmark, Run, machine
from testbed.netns import LINKS, Network
from benchmarks.harness.worker import Worker

SYSTEMS = ("ours", "lerobot")
LATE_MARGIN_S = 0.005
WARMUP_S = 1.0


def _phase(steps: list[float], handovers: list[tuple[float, float]], t0: float, t1: float) -> dict:
    ts = np.asarray([t for t in steps if t0 <= t < t1])
    periods = np.diff(ts) if ts.size > 1 else np.asarray([])
    blocked = [b for t, b in handovers if t0 <= t < t1]
    return {
        "duration_s": t1 - t0,
        "steps": int(ts.size),
        "rate_hz": float((ts.size - 1) / (ts[-1] - ts[0])) if ts.size > 1 else None,
        "period_ms": summary(periods, 1000),
        "late_steps": int(np.sum(periods > DT_S + LATE_MARGIN_S)),
        "missed_whole_periods": int(np.sum(np.maximum(np.floor(periods / DT_S - 1e-9) - 1, 0))),
        "handovers": len(blocked),
        "handover_us": summary(blocked),
        "handover_s_total": float(np.sum(blocked) / 1e6) if blocked else 0.0,
        "periods_ms": [round(float(p) * 1000, 3) for p in periods],
    }


def run(args, run_dir: Run, net: Network, log=print) -> dict:
    link = LINKS["loopback"]
    prefix = net.prefix("server")
    wl = MAIN_WORKLOAD
    t_start = time.monotonic()
    results = {}
    for s in (getattr(args, "systems", None) or SYSTEMS):
        port = free_port() if not net.in_namespaces else (7457 if s == "ours" else 8090)
        log(f"control loop: {s}: {args.seconds:.0f} s with the server up, then {args.seconds:.0f} s after SIGKILL")
        server = Worker(f"control-server-{s}", prefix, str(run_dir.logs), str(run_dir.work))
        client = Worker(f"control-client-{s}", net.prefix("client", link), str(run_dir.logs), str(run_dir.work))
        try:
            if s == "ours":
                server.create("OursServer", listen=[f"tcp/127.0.0.1:{port}"], models=[{"app": wl, "workload": wl}])
                client.create("OursClient", workload=wl, endpoint=f"tcp/127.0.0.1:{port}")
            else:
                server.create("LeRobotServer", addresses=[f"127.0.0.1:{port}"])
                client.create("LeRobotClient", workload=wl, address=f"127.0.0.1:{port}")
            t_begin = time.monotonic()
            client.send("control_loop", duration_s=WARMUP_S + 2 * args.seconds)
            time.sleep(WARMUP_S + args.seconds)
            t_kill = time.monotonic()
            server.kill()
            r = client.result(timeout_s=WARMUP_S + 2 * args.seconds + 120)
        finally:
            client.close()
            server.close()
        t_end = max(r["steps"]) if r["steps"] else t_kill
        results[s] = {"up": _phase(r["steps"], r["handovers"], t_begin + WARMUP_S, t_kill),
                      "gone": _phase(r["steps"], r["handovers"], t_kill, t_end + 1e-6),
                      "extra": {k: v for k, v in r.items() if k not in ("steps", "handovers")}}
        log(format_system(s, results[s]))
    return {"benchmark": "control_loop", "machine": machine(), "workload": wl, "seconds_per_phase": args.seconds,
            "late_margin_ms": LATE_MARGIN_S * 1000, "elapsed_s": time.monotonic() - t_start, "systems": results}


def format_system(s: str, r: dict) -> str:
    lines = []
    for phase in ("up", "gone"):
        p = r[phase]
        h, per = p["handover_us"], p["period_ms"]
        lines.append(f"  {s:<8} {('server ' + phase):<12} {fmt(h['p50'], 0):>9} {fmt(h['p99'], 0):>9} {fmt(h['max'], 0):>10} "
                     f"{p['handovers']:>6} {fmt(per['p50']):>8} {fmt(per['p99']):>8} {fmt(per['max']):>9} "
                     f"{fmt(p['rate_hz']):>7} {p['late_steps']:>6}")
    return "\n".join(lines)


def table(result: dict) -> str:
    out = [f"Benchmark 2: control-loop health, 30 Hz, {WORKLOADS[result['workload']].label}, a hand-over every step, "
           f"{result['seconds_per_phase']:.0f} s per phase; late = period > {1000 * DT_S:.1f} + {result['late_margin_ms']:.0f} ms",
           f"  {'system':<8} {'phase':<12} {'hand-over us p50':>9} {'p99':>9} {'max':>10} {'count':>6} "
           f"{'period ms p50':>8} {'p99':>8} {'max':>9} {'Hz':>7} {'late':>6}"]
    out += [format_system(s, r) for s, r in result["systems"].items()]
    return "\n".join(out)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"ours": "#1f77b4", "lerobot": "#d62728"}
    for ax, phase in zip(axes, ("up", "gone"), strict=True):
        for s, r in result["systems"].items():
            periods = np.sort(np.asarray(r[phase]["periods_ms"]))
            if periods.size:
                ax.plot(periods, np.linspace(0, 1, periods.size), label=s, color=colors[s])
        ax.axvline(1000 * DT_S, color="grey", ls=":", lw=1)
        ax.axvline(1000 * DT_S + result["late_margin_ms"], color="grey", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("loop period, ms (dotted: 33.3 ms; dashed: late)")
        ax.set_ylabel("fraction of steps")
        ax.set_title(f"server {phase}")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle("30 Hz control loop: distribution of periods")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="per phase (default 20, --full 60)")
    parser.add_argument("--systems", type=lambda s: [x for x in s.split(",") if x in SYSTEMS], default=None,
                        help=f"a subset of {','.join(SYSTEMS)} (default both)")


BENCHMARK = CoreBenchmark("control_loop", __doc__, add_args, run, plot, table, sizes={"seconds": (20.0, 60.0)}, with_link=False)
main = BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())
