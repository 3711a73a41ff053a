"""`make bench`: the three benchmarks side by side, a table, JSON and one PNG per benchmark.

    python -m benchmarks.run_all [--full] [--out outputs/bench] [--only latency,control_loop,ingest]
                                 [--write-readme README.md]

Short by default (a few minutes on 2 cores): 200 round trips per system and case, 20 s control-loop
phases, 5 s ingest stages. `--full`: 500 round trips and every workload on every link, 60 s phases,
15 s stages and 200 clients. Writes `<out>/{latency,control_loop,ingest}.{json,png}`,
`<out>/summary.json` and worker logs under `<out>/logs/`; `--write-readme` rewrites the README's results
table from this run (`benchmarks/results_table.py`, what `make bench` does). docs/benchmarks.md explains
every column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


from benchmarks import control_loop, ingest, latency, results_table
from benchmarks.harness.results import Run, add_common_args, fmt, machine
from benchmarks.harness.workloads import MAIN_WORKLOAD
from testbed.netns import Network

BENCHMARKS = (latency.BENCHMARK, control_loop.BENCHMARK, ingest.BENCHMARK)


def targets(results: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, reference, met) for the issue's targets; not assertions."""
    rows = []
    cl = results.get("control_loop")
    if cl:
        ours = cl["systems"]["ours"]
        p99 = max(ours[p]["handover_us"]["p99"] or 0 for p in ("up", "gone"))
        rows.append(("hand-over blocks <= 50 us at p99", f"{p99:.0f} us (server up: {fmt(ours['up']['handover_us']['p99'], 0)})",
                     f"LeRobot {fmt(cl['systems']['lerobot']['up']['handover_us']['p99'] / 1000, 1)} ms", p99 <= 50))
        late = ours["up"]["late_steps"] + ours["gone"]["late_steps"]
        ler = cl["systems"]["lerobot"]
        rows.append(("zero missed deadlines, server up or gone", f"{ours['up']['late_steps']} up, {ours['gone']['late_steps']} gone",
                     f"LeRobot {ler['up']['late_steps']} up, {ler['gone']['late_steps']} gone", late == 0))
    lat = results.get("latency")
    if lat:
        for row in lat["cases"]:
            if row["workload"] != MAIN_WORKLOAD:
                continue
            s = row["systems"]
            ours, ler, floor = (s[k]["added_ms"]["p50"] for k in ("ours", "lerobot", "floor"))
            if row["link"] == "loopback":
                rows.append(("added RTT <= 3 ms median on loopback", f"{ours:.2f} ms",
                             f"floor {floor:.2f} ms, LeRobot {ler:.2f} ms", ours <= 3.0))
            if row["link"] == "wifi":
                rows.append((">= 5x lower than LeRobot on the Wi-Fi-like link", f"{ler / ours:.1f}x ({ours:.2f} vs {ler:.2f} ms)",
                             f"floor {floor:.2f} ms", ler / ours >= 5.0))
        for row in lat["cases"]:  # the network path against floor + JPEG, main workload, every link
            if row["workload"] != MAIN_WORKLOAD or "jpeg" not in row:
                continue
            s = row["systems"]
            floor_jpeg = s["floor"]["added_ms"]["p50"] + row["jpeg"]["encode_obs_par_ms"] + row["jpeg"]["decode_obs_par_ms"]
            ours = s["ours"]["added_ms"]["p50"]
            rows.append((f"network path within 0.5 ms of floor + JPEG, {row['link']}", f"{ours:.2f} ms (+{ours - floor_jpeg:.2f})",
                         f"floor + JPEG {floor_jpeg:.2f} ms", ours - floor_jpeg <= 0.5))
        def added(row, system):
            return row["systems"].get(system, {}).get("added_ms", {}).get("p50")

        # ours as a robot gets it: on loopback (one host) the client picks the same-host path by itself
        ratios = [(added(row, "lerobot") / ours, f"{row['workload']}/{row['link']}")
                  for row in lat["cases"]
                  if added(row, "lerobot") and (ours := added(row, "ours_shm") or added(row, "ours"))]
        network = [(added(row, "lerobot") / added(row, "ours"), f"{row['workload']}/{row['link']}")
                   for row in lat["cases"] if added(row, "lerobot") and added(row, "ours")]
        if ratios:
            worst, worst_net = min(ratios), min(network)
            rows.append((">= 5x under LeRobot, every workload and link", f"worst {worst[0]:.1f}x ({worst[1]})",
                         f"JPEG path only: worst {worst_net[0]:.1f}x ({worst_net[1]})", worst[0] >= 5.0))
        for row in lat["cases"]:  # the same-host path (docs/protocol.md §7.1), loopback cases only
            shm = row["systems"].get("ours_shm")
            limit_ms = {"cam2_480x640": 1.0, "cam3_720x1280": 3.0}.get(row["workload"])
            if shm is None or limit_ms is None or shm["added_ms"]["p50"] is None:
                continue
            added, net_path = shm["added_ms"]["p50"], row["systems"]["ours"]["added_ms"]["p50"]
            rows.append((f"same-host path <= {limit_ms:g} ms added, {row['workload']}", f"{added:.2f} ms",
                         f"network path {net_path:.2f} ms", added <= limit_ms))
    ing = results.get("ingest")
    if ing:
        st = [x for x in ing["stages"] if x["system"] == "ours" and x["clients"] == 100 and "skipped" not in x]
        if st:
            x = st[0]
            rows.append(("100 clients x 30 Hz on < 1 core", f"{x['server_cores']:.2f} cores, {x['received_per_s']:.0f}/s received",
                         "offered 3000/s", x["server_cores"] < 1.0 and x["keeps_up"]))
            floor = [f for f in ing["stages"] if f["system"] == "floor" and f["clients"] == 100 and "skipped" not in f]
            if floor and floor[0]["server_cores"]:
                ratio = x["server_cores"] / floor[0]["server_cores"]
                rows.append(("ingest at 100 clients <= 1.2x the floor's cores", f"{ratio:.2f}x",
                             f"floor {floor[0]['server_cores']:.2f} cores", ratio <= 1.2))
    return rows


def targets_table(rows) -> str:
    out = ["Targets (reported, not asserted)", f"  {'target':<56} {'measured':<36} {'for comparison':<34} met"]
    for t, m, ref, ok in rows:
        out.append(f"  {t:<56} {m:<36} {ref:<34} {'yes' if ok else 'NO'}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--only", type=lambda s: s.split(","), default=[b.name for b in BENCHMARKS])
    parser.add_argument("--write-readme", type=Path, default=None,
                        help="rewrite the results table of this file (README.md) from this run (refused when the "
                             "load average was above the core count, unless --allow-loaded)")
    parser.add_argument("--allow-loaded", action="store_true",
                        help="with --write-readme: write the table of a loaded run too, marked as such")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    if args.write_readme and not args.allow_loaded and load_before[0] > (os.cpu_count() or 1):
        print(f"warning: load average {load_before[0]:.1f} on {os.cpu_count()} cores before the run: its figures will "
              f"not be written to {args.write_readme} (rerun on a quiet machine)", flush=True)
    if args.write_readme and results_table.BEGIN not in (args.write_readme.read_text() if args.write_readme.exists() else ""):
        parser.error(f"--write-readme: {args.write_readme} has no results block ({results_table.BEGIN})")
    run_dir = Run(args.out)
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {msg}" if not msg.startswith("  ") else msg, flush=True)

    # Each benchmark with its own defaults, short or full, as `python -m benchmarks.<name>` takes them.
    shared = ["--out", str(args.out)] + ["--full"] * args.full + ["--no-netns"] * args.no_netns
    results: dict = {}
    with Network(str(run_dir.logs), use_namespaces=not args.no_netns) as net:
        log(f"network: {net.method}{' (' + net.reason + ')' if net.reason else ''}")
        for bench in BENCHMARKS:
            if bench.name in args.only:
                results[bench.name] = bench.run(bench.parse(shared), run_dir, net, log)
                bench.write(run_dir, results[bench.name])
    network = {"method": net.method, "note": net.reason}
    print()
    for bench in BENCHMARKS:
        if bench.name in results:
            print(bench.table(results[bench.name]))
            print()
    rows = targets(results)
    print(targets_table(rows))
    summary = {"machine": {**machine(), "load_avg_before": list(load_before)}, "network": network, "full": args.full, "elapsed_s": time.monotonic() - t0,
               "targets": [{"target": t, "measured": m, "comparison": r, "met": ok} for t, m, r, ok in rows]}
    (run_dir.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {run_dir.out}/{{latency,control_loop,ingest}}.{{json,png}} and summary.json "
          f"in {time.monotonic() - t0:.0f} s")
    if args.write_readme:
        given = list(argv if argv is not None else sys.argv[1:])
        # What was measured, not where it was written: --out and --write-readme are left out.
        rest = [a for i, a in enumerate(given) if not a.startswith(("--write-readme", "--out"))
                and not (i and given[i - 1] in ("--write-readme", "--out"))]
        command = "make bench" + (f" BENCH_ARGS='{' '.join(rest)}'" if rest else "")
        refused = results_table.write_checked(args.write_readme, results_table.block(results, summary["machine"], command),
                                              summary["machine"], args.allow_loaded)
        if refused:
            print(refused, file=sys.stderr)
            return 1
        print(f"rewrote the results table of {args.write_readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
