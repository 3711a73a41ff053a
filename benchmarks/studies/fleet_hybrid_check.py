"""The fleet model beside the real hybrid runs: the same settings and seeds, point by point.

`benchmarks/studies/hybrid.py study` (`make bench-hybrid`) runs edge-only, cloud-only and hybrid serving
over real Zenoh and shaped links and writes its rows to ``<out>/hybrid.json``. This script runs the
fleet model (`benchmarks/studies/fleet.py`) at exactly those settings, read from that file and from
`benchmarks/studies/hybrid.py`'s constants (so they cannot drift apart):

- the tasks: ``--rounds`` rounds of ``--steps`` actions, synchronous robots (``trigger fixed:0``:
  send, wait for the chunk, execute it, send again), continuous time;
- the profiles (`PROFILES[--profile]`) and capacities (`EDGE_CAPACITY`, `CLOUD_CAPACITY`), the robots' link (2.5 ms one way) and the WAN (``--wan-ms`` one way,
  ``--wan-mbit``), the observation's bytes (one camera JPEG as the driver encodes it);
- cloud-only as the real run has it: the edge scheduler relaying to a cloud engine that holds at
  most its capacity in flight (``cloud_site=engine``, ``cloud_in_flight=capacity``);
- the same arrivals: seed k draws the same Poisson arrival times in both
  (`benchmarks/studies/hybrid.py::arrival_times`), arrivals for ``--duration-s``, tasks followed to the end,
  those arriving before ``--warmup-s`` not counted.

Then, per point (rate, mode): the real and the model's mean task latency (mean over seeds) and the
model's difference, paired by seed (mean ± sample sd of each seed's model / real - 1), and the real
robots' resends (an observation or chunk lost on the way costs its task `--resend-s`: the model
loses nothing, so a point with resends is slower in the real run by that much; the column "model +
resend waits" adds them to the model), and how far the model's own mean moves when every pass is
5 % slower: a stable point hardly moves, an overloaded one moves by several times that, which is
how much a few ms of host overhead per pass decide there.

The model's missing costs can be given (``--edge-overhead-ms``: per request on the robot <->
scheduler path, e.g. codec and Zenoh; ``--engine-overhead-ms``: per batch on the remote engine), or
fitted on ONE point (``--calibrate``: the lightest edge-only point, where nothing queues, sets the
edge overhead to the real round's excess over the model's) and then checked on all the others.

    python -m benchmarks.studies.hybrid study --wan-ms 50 --rates 2,6,10 --seeds 3 --duration-s 12 --warmup-s 3 --out /tmp/lzh
    python -m benchmarks.studies.fleet_hybrid_check /tmp/lzh/hybrid.json [--calibrate]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


from benchmarks.studies import fleet, hybrid  # noqa: E402

#: The model's simulated time after the last arrival, for the tasks to finish (the real driver waits
#: for them too); tasks still running then are not counted, in either.
DRAIN_S = 60.0
TOLERANCE = 0.10  # the "within 10 %"


def observation_bytes() -> int:
    """One observation as the real driver encodes it (a 96x128 noise JPEG, 6 floats, its header)."""
    import numpy as np

    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation

    rng = np.random.default_rng(0)
    jpeg = codec.encode_jpeg(rng.integers(0, 255, (*hybrid.CAMERA, 3), dtype=np.uint8))
    obs = Observation(1, "hybrid-0-0", np.zeros(6, np.float32), {"front": jpeg}, "task",
                      execution=ExecutionInfo(0.0, 0, 1 / 30), episode_id="e")
    return len(codec.encode(obs))


def model_config(mode: str, rate: float, seed: int, settings: dict, edge_overhead_s: float = 0.0,
                 engine_overhead_s: float = 0.0, scale: float = 1.0, pass_jitter: float = 0.0) -> fleet.Config:
    """The model's configuration of one real point (`settings`: the real run's args); `scale`
    multiplies the cloud profile's times (the sensitivity check)."""
    return fleet.Config(
        mode="online", scheduler="wait_ratio", tiers=mode, rate_per_s=rate, seed=seed,
        arrivals_s=settings["duration_s"], duration_s=settings["duration_s"] + DRAIN_S, warmup_s=settings["warmup_s"],
        trigger="fixed:0", max_batch=hybrid.EDGE_CAPACITY, cloud_max_batch=hybrid.CLOUD_CAPACITY,
        cloud_profile_ms={b: ms * scale for b, ms in hybrid.PROFILES[settings["profile"]][1].items()}, cloud_site="engine", cloud_in_flight="capacity",
        cloud_max_in_flight=settings["cloud_in_flight"],
        one_way_s=hybrid.ROBOT_EDGE[2] / 1000, wan_one_way_s=settings["wan_ms"] / 1000,
        wan_bandwidth_bps=settings["wan_mbit"] * 1e6 / 8, payload_bytes=settings["payload_bytes"],
        edge_overhead_s=edge_overhead_s, engine_overhead_s=engine_overhead_s, pass_jitter=pass_jitter)


def run_model(real: dict, edge_overhead_s: float = 0.0, engine_overhead_s: float = 0.0,
              scale: float = 1.0, pass_jitter: float = 0.0) -> list[dict]:
    """The model's row for every real row (same mode, rate and seed); `scale` multiplies every pass
    time of both tiers (1.05: the GPUs 5 % slower)."""
    settings = real_settings(real)
    traces = [[settings["steps"]] * settings["rounds"]]
    latency_s = fleet.latency_of({b: ms * scale for b, ms in hybrid.PROFILES[settings["profile"]][0].items()})
    out = []
    for row in real["rows"]:
        cfg = model_config(row["mode"], row["rate"], row["seed"], settings, edge_overhead_s, engine_overhead_s, scale,
                           pass_jitter)
        r = fleet.FleetSim(cfg, traces, latency_s).run()
        out.append({"mode": row["mode"], "rate": row["rate"], "seed": row["seed"], "mean_s": r.latency_mean_s,
                    "p25_s": r.latency_p25_s, "p95_s": r.latency_p95_s, "tasks": r.tasks_done,
                    "offload_share": r.offload_pct / 100})
    return out


def real_settings(real: dict) -> dict:
    """The settings of a real run (`hybrid.json`), with what older files lack filled in."""
    args = real["args"]
    return {"duration_s": args["duration_s"], "warmup_s": args["warmup_s"], "rounds": args["rounds"],
            "steps": args["steps"], "wan_ms": args.get("wan_ms", 50.0), "wan_mbit": args.get("wan_mbit", 1000.0),
            "profile": args.get("profile", "gpu"), "cloud_in_flight": args.get("cloud_in_flight", 0),
            "payload_bytes": real.get("payload_bytes") or observation_bytes()}


def _lightest(real: dict, mode: str) -> dict | None:
    """The real run's rows of `mode` at its lowest rate, as a run of their own."""
    rates = [r["rate"] for r in real["rows"] if r["mode"] == mode and r["mean_s"]]
    if not rates:
        return None
    return {"args": real["args"], "payload_bytes": real.get("payload_bytes"),
            "rows": [r for r in real["rows"] if r["mode"] == mode and r["rate"] == min(rates) and r["mean_s"]]}


def calibrate(real: dict, iterations: int = 3) -> tuple[float, float]:
    """(edge overhead s per request, engine overhead s per batch) fitted on two points only: the edge
    overhead makes the model's mean task latency equal the real one at the lightest edge-only point,
    then the engine overhead does so at the lightest cloud-only point (each spread over the task's
    rounds, a few fixed-point steps). Every other point is then a check, not a fit."""
    rounds = real["args"]["rounds"]

    def fit(light: dict | None, run) -> float:
        if light is None:
            return 0.0
        target, x = statistics.fmean(r["mean_s"] for r in light["rows"]), 0.0
        for _ in range(iterations):
            x = max(0.0, x + (target - statistics.fmean(r["mean_s"] for r in run(light, x))) / rounds)
        return x

    edge = fit(_lightest(real, "edge"), lambda light, x: run_model(light, x))
    engine = fit(_lightest(real, "cloud"), lambda light, x: run_model(light, edge, x))
    return edge, engine


def compare(real: dict, model: list[dict], slower: list[dict] | None = None) -> list[dict]:
    """Per (rate, mode): real and model means over seeds, the paired per-seed difference, the model
    with the real robots' resend waits added (each resend cost its task `resend_s` of waiting: the
    model loses nothing), and how far the model's mean moves with every pass 5 % slower (`slower`)."""
    by_key = {(m["mode"], m["rate"], m["seed"]): m for m in model}
    slower_by = {(m["mode"], m["rate"], m["seed"]): m for m in slower or []}
    resend_s = real["args"].get("resend_s", hybrid.RESEND_S)
    points = []
    for rate in sorted({r["rate"] for r in real["rows"]}):
        for mode in hybrid.MODES:
            pairs = [(r, by_key[(mode, rate, r["seed"])]) for r in real["rows"]
                     if r["mode"] == mode and r["rate"] == rate and r["mean_s"]]
            if not pairs:
                continue
            diffs = [100 * (m["mean_s"] / r["mean_s"] - 1) for r, m in pairs]
            real_mean = statistics.fmean(r["mean_s"] for r, _ in pairs)
            model_mean = statistics.fmean(m["mean_s"] for _, m in pairs)
            waits = statistics.fmean(m["mean_s"] + r.get("resends", 0) * resend_s / max(1, r.get("tasks") or 1) for r, m in pairs)
            moved = (100 * (statistics.fmean(slower_by[(mode, rate, r["seed"])]["mean_s"] for r, _ in pairs)
                            / model_mean - 1) if slower_by else None)
            points.append({"rate": rate, "mode": mode, "real_s": real_mean, "model_s": model_mean,
                           "diff_pct": 100 * (model_mean / real_mean - 1), "paired_pct": statistics.fmean(diffs),
                           "paired_sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
                           "real_offload": statistics.fmean(r["offload_share"] for r, _ in pairs),
                           "model_offload": statistics.fmean(m["offload_share"] for _, m in pairs),
                           "resends": sum(r.get("resends", 0) for r, _ in pairs), "seeds": len(pairs),
                           "with_resends_pct": 100 * (waits / real_mean - 1), "slower_moves_pct": moved})
    return points


def table(points: list[dict]) -> str:
    out = ["| tasks/s | mode | real mean (s) | model mean (s) | model vs real | per seed | offloaded real / model | "
           "real resends | model + resend waits vs real | model, passes 5 % slower | within 10 % |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        moved = "" if p["slower_moves_pct"] is None else f"{p['slower_moves_pct']:+.1f} %"
        out.append(f"| {p['rate']:g} | {p['mode']} | {p['real_s']:.2f} | {p['model_s']:.2f} | {p['diff_pct']:+.1f} % | "
                   f"{p['paired_pct']:+.1f} ± {p['paired_sd']:.1f} % | {100 * p['real_offload']:.0f} / "
                   f"{100 * p['model_offload']:.0f} % | {p['resends']} | {p['with_resends_pct']:+.1f} % | {moved} | "
                   f"{'yes' if abs(p['diff_pct']) <= 100 * TOLERANCE else '**no**'} |")
    inside = sum(abs(p["diff_pct"]) <= 100 * TOLERANCE for p in points)
    with_waits = sum(abs(p["with_resends_pct"]) <= 100 * TOLERANCE for p in points)
    out.append(f"\n{inside} of {len(points)} points within 10 % ({with_waits} with the resend waits added); largest "
               f"difference {max((abs(p['diff_pct']) for p in points), default=0.0):.1f} %.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("real", help="the hybrid.json a `benchmarks/studies/hybrid.py study` run wrote")
    p.add_argument("--edge-overhead-ms", type=float, default=0.0,
                   help="per request on the robot <-> scheduler path (fleet.Config.edge_overhead_s)")
    p.add_argument("--engine-overhead-ms", type=float, default=0.0,
                   help="per batch on a remote engine (fleet.Config.engine_overhead_s)")
    p.add_argument("--pass-jitter", type=float, default=0.0,
                   help="each modelled pass x U(1 - J, 1 + J) (fleet.Config.pass_jitter); 0: exactly its profile")
    p.add_argument("--calibrate", action="store_true",
                   help="fit --edge-overhead-ms on the lightest edge-only point, then compare every point")
    args = p.parse_args(argv)
    real = json.loads(Path(args.real).read_text())
    settings = real_settings(real)
    if args.calibrate:
        edge_overhead_s, engine_overhead_s = calibrate(real)
    else:
        edge_overhead_s, engine_overhead_s = args.edge_overhead_ms / 1000, args.engine_overhead_ms / 1000
    fitted = " (fitted on the lightest edge-only and cloud-only points)" if args.calibrate else ""
    print(f"Settings of the real run: {settings}; model: edge overhead {1000 * edge_overhead_s:.1f} ms per request, "
          f"engine overhead {1000 * engine_overhead_s:.1f} ms per batch{fitted}; pass jitter {args.pass_jitter:g}.\n")
    model = run_model(real, edge_overhead_s, engine_overhead_s, pass_jitter=args.pass_jitter)
    slower = run_model(real, edge_overhead_s, engine_overhead_s, scale=1.05, pass_jitter=args.pass_jitter)
    print(table(compare(real, model, slower)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
