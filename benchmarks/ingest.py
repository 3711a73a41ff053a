"""Benchmark 3: how many robots one server process takes in.

    python -m benchmarks.ingest [--full] [--clients 10,50,100] [--seconds 5] [--policy-ms 50]

One server process; one publisher process simulating N robots at 30 Hz each, spread evenly over the
period, sending pre-encoded observations of the main workload (two 480x640 JPEG cameras) so that
the publisher spends nothing on encoding. On loopback, without shared memory (robots are on other hosts).

    ours     `PolicyServer` serving a synthetic policy that takes `--policy-ms` per call (a model on a
             GPU: the time is spent waiting, not on this CPU), any client admitted. It keeps the newest
             observation per client and serves one at a time, so most observations are superseded.
             Counted: observations received, superseded, served, msgpack-decoded and JPEG frames
             decoded (by wrapping the codec functions), so it shows whether it ever decodes one it
             does not serve.
    floor    a raw Zenoh subscriber that only counts samples (the cost of getting bytes into Python).
    lerobot  LeRobot's gRPC `PolicyServer` receiving pickled observations through `SendObservations`
             from one channel and thread per robot (it has one observation queue for all clients; it
             unpickles every one). Not escalated past the first N it cannot keep up with.

Per N and system: observations received per second against those offered, and the server's CPU in
cores (process CPU time / wall time).
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.harness.workloads import FPS, MAIN_WORKLOAD, WORKLOADS
from testbed.ports import free_port
from benchmarks.harness.results import CoreBenchmark, Run, machine
from testbed.netns import Network
from benchmarks.harness.worker import Worker

SYSTEMS = ("ours", "floor", "lerobot")
KEEP_UP = 0.95  # received / offered at or above this keeps up
APP = "ingest"


def run(args, run_dir: Run, net: Network, log=print) -> dict:
    wl = MAIN_WORKLOAD
    counts = sorted(args.clients)
    systems = tuple(s for s in SYSTEMS if s in (getattr(args, "systems", None) or SYSTEMS))
    prefix = net.prefix("server")
    ports = {"ours": 7467, "floor": 7468, "lerobot": 8091} if net.in_namespaces else {s: free_port() for s in SYSTEMS}
    t_start = time.monotonic()
    servers = {s: Worker(f"ingest-server-{s}", prefix, str(run_dir.logs), str(run_dir.work)) for s in systems}
    pubs = {s: Worker(f"ingest-publisher-{s}", prefix, str(run_dir.logs), str(run_dir.work)) for s in systems}
    stages = []
    saturated: dict[str, int] = {}
    try:
        if "ours" in servers:
            servers["ours"].create("OursServer", listen=[f"tcp/127.0.0.1:{ports['ours']}"],
                                   models=[{"app": APP, "workload": wl, "latency_ms": args.policy_ms,
                                            "max_unknown_clients": max(counts) + 16}])
        if "floor" in servers:
            servers["floor"].create("FloorServer", listen=[f"tcp/127.0.0.1:{ports['floor']}"])
        if "lerobot" in servers:
            servers["lerobot"].create("LeRobotServer", addresses=[f"127.0.0.1:{ports['lerobot']}"])
        payload = {}
        for s in systems:
            endpoint = f"127.0.0.1:{ports[s]}" if s == "lerobot" else f"tcp/127.0.0.1:{ports[s]}"
            payload[s] = pubs[s].create("IngestPublisher", system=s, endpoint=endpoint, workload=wl,
                                        max_clients=max(counts), app=APP)["payload_bytes"]
        for i, n in enumerate(counts):
            order = systems[i % len(systems):] + systems[: i % len(systems)]
            for s in order:
                if s in saturated:
                    stages.append({"clients": n, "system": s, "skipped": f"did not keep up with {saturated[s]} clients"})
                    continue
                log(f"ingest: {s}: {n} clients x {FPS} Hz for {args.seconds:.0f} s")
                st0, c0, t0 = servers[s].call("stats"), servers[s].cpu_s(), time.monotonic()
                pub = pubs[s].call("publish", n_clients=n, duration_s=args.seconds, timeout_s=args.seconds + 300)
                time.sleep(0.3)  # let the last samples land
                st1, c1, t1 = servers[s].call("stats"), servers[s].cpu_s(), time.monotonic()
                wall = t1 - t0
                delta = {k: st1[k] - st0[k] for k in st1}
                offered = n * FPS
                stage = {
                    "clients": n, "system": s, "offered_per_s": offered,
                    "published_per_s": pub["published"] / pub["elapsed_s"],
                    "received_per_s": delta["received"] / pub["elapsed_s"],
                    "server_cores": (c1 - c0) / wall,
                    "publisher_cores": pub["cpu_s"] / pub["elapsed_s"],
                    "publisher_late": pub.get("late", 0), "publisher_errors": pub.get("errors", 0),
                    "mb_per_s": delta["received"] * payload[s] / pub["elapsed_s"] / 1e6,
                    "counts": delta,
                }
                if s == "ours":
                    d = delta
                    stage["served_per_s"] = d["served"] / pub["elapsed_s"]
                    stage["decoded_not_served"] = d["decoded_observations"] - d["served"] - d["rejected"]
                    stage["jpeg_frames_decoded_per_served"] = d["decoded_jpegs"] / d["served"] if d["served"] else None
                stage["keeps_up"] = stage["received_per_s"] >= KEEP_UP * offered
                if not stage["keeps_up"]:
                    saturated[s] = n
                stages.append(stage)
                log(format_stage(stage))
    finally:
        for w in list(pubs.values()) + list(servers.values()):
            w.close()
    return {"benchmark": "ingest", "machine": machine(), "workload": wl, "seconds": args.seconds,
            "policy_ms": args.policy_ms, "payload_bytes": payload, "elapsed_s": time.monotonic() - t_start,
            "stages": stages}


def format_stage(st: dict) -> str:
    if "skipped" in st:
        return f"  {st['system']:<8} {st['clients']:>7}   not run: {st['skipped']}"
    extra = ""
    if st["system"] == "ours":
        c = st["counts"]
        extra = (f"  served {st['served_per_s']:.0f}/s, superseded {c['superseded']}, msgpack-decoded {c['decoded_observations']} "
                 f"({st['decoded_not_served']} not served), JPEG frames decoded {c['decoded_jpegs']} for {c['served']} served")
    return (f"  {st['system']:<8} {st['clients']:>7} {st['offered_per_s']:>8.0f} {st['published_per_s']:>9.0f} "
            f"{st['received_per_s']:>9.0f} {st['mb_per_s']:>7.0f} {st['server_cores']:>12.2f} {st['publisher_cores']:>14.2f} "
            f"{'yes' if st['keeps_up'] else 'NO':>8}{extra}")


def table(result: dict) -> str:
    out = [f"Benchmark 3: server ingest, {WORKLOADS[result['workload']].label} observations at 30 Hz per client, "
           f"{result['seconds']:.0f} s per stage, policy {result['policy_ms']:.0f} ms per call (ours)",
           f"  {'system':<8} {'clients':>7} {'offered':>8} {'published':>9} {'received':>9} {'MB/s':>7} "
           f"{'server cores':>12} {'publisher cores':>14} {'keeps up':>8}"]
    out += [format_stage(st) for st in result["stages"]]
    return "\n".join(out)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"ours": "#1f77b4", "lerobot": "#d62728", "floor": "#7f7f7f"}
    for s in SYSTEMS:
        st = [x for x in result["stages"] if x["system"] == s and "skipped" not in x]
        if not st:
            continue
        n = [x["clients"] for x in st]
        ax1.plot(n, [x["received_per_s"] for x in st], "o-", color=colors[s], label=s)
        ax2.plot(n, [x["server_cores"] for x in st], "o-", color=colors[s], label=s)
    all_n = sorted({x["clients"] for x in result["stages"]})
    ax1.plot(all_n, [n * FPS for n in all_n], ":", color="black", label="offered")
    ax1.set_xlabel("clients at 30 Hz")
    ax1.set_ylabel("observations received per second")
    ax2.axhline(1.0, color="grey", ls="--", lw=1)
    ax2.set_xlabel("clients at 30 Hz")
    ax2.set_ylabel("server CPU, cores")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("One server process taking in N robots")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", type=lambda s: s.split(","), default=None,
                        help=f"a subset of {','.join(SYSTEMS)} (default all)")
    parser.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="comma-separated N (default 10,50,100; --full adds 200)")
    parser.add_argument("--seconds", type=float, default=None, help="per stage (default 5, --full 15)")
    parser.add_argument("--policy-ms", type=float, default=50.0, help="synthetic policy time per call (ours)")


BENCHMARK = CoreBenchmark("ingest", __doc__, add_args, run, plot, table, sizes={"clients": ([10, 50, 100], [10, 50, 100, 200]), "seconds": (5.0, 15.0)}, with_link=False)
main = BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())
