"""Benchmark 1: latency added between handing an observation over and having its chunk in the buffer.

    python -m benchmarks.latency [--full] [--round-trips 200] [--batch 25] [--base CHECKOUT]

For each case (workload x link) the three systems run in turns of `--batch` round trips, rotating
the order each turn, until each has done its share: a slow phase of the machine hits all three
alike. A round trip starts when the client hands an observation over (ours: `Outbox.put` in the
control loop's own `_step`; LeRobot: `send_observation`; floor: `put`) and ends when the answer is
usable (ours: after `ActionBuffer.merge`; LeRobot: after `_aggregate_action_queues`; floor: the
reply callback). Added latency is that minus the policy's own time for that observation, measured
in the server around the policy call (the synthetic policy averages every pixel; LeRobot's fake
policy returns at once). Per round trip it also reports the bytes on the link (interface counters
of the server's namespace, so headers and acknowledgements included), and the CPU time of the
client and of the server process.

`--base CHECKOUT` adds `base` (and `base_shm` on loopback): the same server and client run from
another checkout of this project (e.g. the commit before a change, `git worktree add ../base REV`),
in the same rotation, so that a change is compared with the code before it on the same machine at
the same moments.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from benchmarks.harness.workloads import MAIN_WORKLOAD, WORKLOADS
from benchmarks.harness.results import fmt, summary
from benchmarks.harness.results import CoreBenchmark, Run, machine
from testbed.netns import LINKS, SERVER_ADDR, Network, link_bytes
from benchmarks.harness.worker import Worker

# ours: the network path (JPEG), what a robot on another machine gets; ours_shm: the same server
# and client on one host with the same-host path (raw frames through /dev/shm, loopback cases
# only: in the link cases client and server are on one host too, but the point there is the link).
SYSTEMS = ("ours", "ours_shm", "lerobot", "floor")
SERVERS = ("ours", "lerobot", "floor")  # ours_shm talks to ours's server
PORTS = {"ours": 7447, "lerobot": 8080, "floor": 7448}


def _server_of(system: str) -> str:
    return system.removesuffix("_shm")


def cases(full: bool, round_trips: int) -> list[tuple[str, str, int]]:
    """(workload, link, round trips). The short run keeps every workload on loopback and Wi-Fi."""
    n = round_trips
    scale = {"cam2_480x640": 1.0, "cam1_224x224": 1.0, "cam3_720x1280": 0.3}
    out = []
    for link in ("loopback", "factory", "wifi"):
        for wl in ("cam2_480x640", "cam1_224x224", "cam3_720x1280"):
            if not full and link == "factory" and wl != MAIN_WORKLOAD:
                continue
            out.append((wl, link, max(10, int(n * scale[wl]))))
    return out


def _client_spec(system: str, workload: str, host: str, port_of: dict) -> tuple[str, dict]:
    if system in ("ours", "ours_shm", "base", "base_shm"):
        return "OursClient", {"workload": workload, "endpoint": f"tcp/{host}:{port_of[_server_of(system)]}",
                              "same_host": system.endswith("_shm")}
    if system == "lerobot":
        return "LeRobotClient", {"workload": workload, "address": f"{host}:{port_of['lerobot']}"}
    return "FloorClient", {"workload": workload, "endpoint": f"tcp/{host}:{port_of['floor']}"}


def run(args, run_dir: Run, net: Network, log=print) -> dict:
    selected = cases(args.full, args.round_trips)
    if getattr(args, "workloads", None):
        selected = [c for c in selected if c[0] in args.workloads]
    if not net.has_link:
        selected = [c for c in selected if c[1] == "loopback"]
    base = getattr(args, "base", None)
    all_systems = SYSTEMS + (("base", "base_shm") if base else ())
    server_names = SERVERS + (("base",) if base else ())
    roots = {"base": base} if base else {}
    port_of = dict(PORTS, base=7449)
    if not net.in_namespaces:  # the host's loopback is shared with everything else: take free ports
        from testbed.ports import free_port

        port_of = {s: free_port() for s in server_names}
    hosts = ["127.0.0.1"] + ([SERVER_ADDR] if net.has_link else [])
    workloads = sorted({wl for wl, _, _ in selected})
    t_start = time.monotonic()
    servers = {s: Worker(f"latency-server-{s}", net.prefix("server"), str(run_dir.logs), str(run_dir.work),
                         **({"root": roots[s]} if s in roots else {})) for s in server_names}
    clients: dict[tuple[str, str], Worker] = {}
    results = []
    try:
        servers["ours"].create("OursServer", listen=[f"tcp/{h}:{port_of['ours']}" for h in hosts],
                               models=[{"app": wl, "workload": wl} for wl in workloads])
        if "lerobot" in (getattr(args, "systems", None) or SYSTEMS):
            servers["lerobot"].create("LeRobotServer", addresses=[f"{h}:{port_of['lerobot']}" for h in hosts])
        servers["floor"].create("FloorServer", listen=[f"tcp/{h}:{port_of['floor']}" for h in hosts])
        if base:
            servers["base"].create("OursServer", listen=[f"tcp/{h}:{port_of['base']}" for h in hosts],
                                   models=[{"app": wl, "workload": wl} for wl in workloads])
        for wl, link_name, n in selected:
            link = LINKS[link_name]
            net.shape(link)
            topo = "loopback" if link_name == "loopback" else "link"
            host = net.server_host(link)
            iface = net.server_iface(link)
            case_id = f"{wl}-{link_name}"
            wanted = set(getattr(args, "systems", None) or SYSTEMS) | ({"base", "base_shm"} if base else set())
            systems = tuple(s for s in all_systems if (s == "floor" or s in wanted)
                            and (link_name == "loopback" or not s.endswith("_shm")))
            log(f"latency: {WORKLOADS[wl].label} on {link.label}: {n} round trips per system")
            for s in systems:
                if (s, topo) not in clients:
                    root = roots.get(_server_of(s))
                    clients[(s, topo)] = Worker(f"latency-client-{s}-{topo}", net.prefix("client", link),
                                                str(run_dir.logs), str(run_dir.work), **({"root": root} if root else {}))
                kind, kwargs = _client_spec(s, wl, host, port_of)
                clients[(s, topo)].create(kind, name=case_id, **kwargs)
            jpeg_raw: dict[str, list] = {}
            for s in systems:  # warm-up: connections, caches, first-RTT effects
                clients[(s, topo)].call("round_trips", target=case_id, n=5)
                servers[_server_of(s)].call("take_policy_ms")
            acc = {s: {"rtt": [], "added": [], "handover": [], "ccpu": 0.0, "scpu": 0.0, "bytes": 0, "n": 0,
                       "lost": 0, "obs_bytes": None, "reply_bytes": None, "bytes_ok": True} for s in systems}
            dl0 = net.delay_line_stats() if link_name != "loopback" else None
            turns = math.ceil(n / args.batch)
            for turn in range(turns):
                # JPEG alone, in the same rotation, so that it sees the same machine as the round trips
                for k, v in clients[("floor", topo)].call("jpeg_costs", target=case_id, frames=4).items():
                    jpeg_raw.setdefault(k, []).extend(v)
                order = systems[turn % len(systems):] + systems[: turn % len(systems)]
                for s in order:
                    batch = min(args.batch, n - turn * args.batch)
                    a = acc[s]
                    # (the host's own loopback carries everyone's traffic: bytes counted in namespaces only)
                    server = servers[_server_of(s)]
                    b0 = link_bytes(server.pid, iface) if net.in_namespaces else None
                    c0 = server.cpu_s()
                    r = clients[(s, topo)].call("round_trips", target=case_id, n=batch)
                    c1 = server.cpu_s()
                    b1 = link_bytes(server.pid, iface) if net.in_namespaces else None
                    policy = server.call("take_policy_ms")
                    a["rtt"] += r["rtt_ms"]
                    keys = r["keys"] or [None] * len(r["rtt_ms"])
                    a["added"] += [x - policy.get(k, 0.0) for x, k in zip(r["rtt_ms"], keys, strict=True)]
                    a["handover"] += r["handover_us"]
                    a["ccpu"] += r["client_cpu_s"]
                    a["scpu"] += c1 - c0
                    if b0 is None or b1 is None:
                        a["bytes_ok"] = False
                    else:
                        a["bytes"] += b1 - b0
                    a["n"] += batch
                    a["lost"] += r["lost"]
                    a["obs_bytes"] = r.get("obs_bytes") or a["obs_bytes"]
                    a["reply_bytes"] = r.get("reply_bytes") or a["reply_bytes"]
            dl1 = net.delay_line_stats() if link_name != "loopback" else None
            for s in systems:
                clients[(s, "loopback" if link_name == "loopback" else "link")].close_target(case_id)
            jpeg = {k: float(np.median(v)) for k, v in jpeg_raw.items() if k != "jpeg_bytes"}
            jpeg["jpeg_kb"] = float(np.mean(jpeg_raw["jpeg_bytes"])) / 1000
            row = {"workload": wl, "link": link_name, "round_trips": n, "jpeg": jpeg, "systems": {}}
            if dl0 and dl1:
                row["delay_line"] = {"packets": dl1["packets"] - dl0["packets"], "dropped": dl1["dropped"] - dl0["dropped"],
                                     "cpu_s": dl1["cpu_s"] - dl0["cpu_s"]}
            for s in systems:
                a = acc[s]
                row["systems"][s] = {
                    "rtt_ms": summary(a["rtt"]),
                    "added_ms": summary(a["added"]),
                    "handover_us": summary(a["handover"]),
                    "client_cpu_ms_per_rt": a["ccpu"] / a["n"] * 1000,
                    "server_cpu_ms_per_rt": a["scpu"] / a["n"] * 1000,
                    "link_kb_per_rt": a["bytes"] / a["n"] / 1000 if a["bytes_ok"] else None,
                    "obs_kb": a["obs_bytes"] / 1000 if a["obs_bytes"] else None,
                    "reply_kb": a["reply_bytes"] / 1000 if a["reply_bytes"] else None,
                    "lost": a["lost"],
                    "samples_added_ms": [round(x, 4) for x in a["added"]],
                }
            results.append(row)
            log(format_case(row))
    finally:
        for w in list(clients.values()) + list(servers.values()):
            w.close()
    return {"benchmark": "latency", "machine": machine(), "network": {"method": net.method, "note": net.reason},
            "batch": args.batch, "elapsed_s": time.monotonic() - t_start, "cases": results}


def format_case(row: dict) -> str:
    wl, link = WORKLOADS[row["workload"]].label, LINKS[row["link"]].label
    lines = [f"  {wl} on {link}",
             f"  {'system':<8} {'added ms p50':>12} {'p90':>7} {'p99':>7} {'hand-over us p50':>16} {'p99':>8} "
             f"{'link KB/RT':>10} {'client CPU ms':>13} {'server CPU ms':>13} {'lost':>5}"]
    for s, r in row["systems"].items():
        a, h = r["added_ms"], r["handover_us"]
        lines.append(f"  {s:<8} {fmt(a['p50']):>12} {fmt(a['p90']):>7} {fmt(a['p99']):>7} {fmt(h['p50'], 0):>16} "
                     f"{fmt(h['p99'], 0):>8} {fmt(r['link_kb_per_rt'], 0):>10} {fmt(r['client_cpu_ms_per_rt']):>13} "
                     f"{fmt(r['server_cpu_ms_per_rt']):>13} {r['lost']:>5}")
    j = row["jpeg"]
    p50 = {s: r["added_ms"]["p50"] for s, r in row["systems"].items()}
    ours, ler = p50.get("ours"), p50.get("lerobot")
    ratio = ler / ours if ours and ler else float("nan")
    lines.append(f"  JPEG alone per observation: encode {j['encode_obs_seq_ms']:.2f} ms one camera after the other, "
                 f"{j['encode_obs_par_ms']:.2f} ms in parallel; decode {j['decode_obs_seq_ms']:.2f} / "
                 f"{j['decode_obs_par_ms']:.2f} ms; {j['jpeg_kb']:.0f} KB per frame")
    floor = p50["floor"]
    lines.append(f"  floor + JPEG alone (median RTT + encode + decode): {floor + j['encode_obs_par_ms'] + j['decode_obs_par_ms']:.2f} ms "
                 f"with cameras in parallel, {floor + j['encode_obs_seq_ms'] + j['decode_obs_seq_ms']:.2f} ms one after the other")
    if ler:
        lines.append(f"  LeRobot / ours, median added latency: {ratio:.1f}x")
    if "ours_shm" in row["systems"]:
        shm = row["systems"]["ours_shm"]["added_ms"]["p50"]
        lines.append(f"  same-host path (ours_shm): {fmt(shm)} ms median added"
                     + (f", LeRobot / ours_shm {ler / shm:.1f}x" if shm and ler else ""))
    for s in ("base", "base_shm"):
        head = p50.get(s.replace("base", "ours"))
        if p50.get(s) and head:
            lines.append(f"  {s.replace('base', 'ours')} / {s} (this checkout / the base checkout), median added: "
                         f"{head / p50[s]:.2f}")
    if row.get("delay_line"):
        d = row["delay_line"]
        lines.append(f"  delay line (all three systems): {d['packets']} packets, {d['dropped']} dropped, "
                     f"{1000 * d['cpu_s'] / (len(row['systems']) * row['round_trips']):.2f} ms CPU per round trip")
    return "\n".join(lines)


def table(result: dict) -> str:
    out = ["Benchmark 1: added latency (hand-over -> chunk in the buffer, minus the policy's time)"]
    out += [format_case(row) for row in result["cases"]]
    return "\n".join(out)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["cases"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 4.8))
    width = 0.2
    colors = {"ours": "#1f77b4", "ours_shm": "#2ca02c", "lerobot": "#d62728", "floor": "#7f7f7f"}
    x = np.arange(len(rows))
    for i, s in enumerate(SYSTEMS):
        got = [r["systems"].get(s, {}).get("added_ms", {}) for r in rows]
        p50 = [g.get("p50") or np.nan for g in got]
        p90 = [g.get("p90") or np.nan for g in got]
        p99 = [g.get("p99") or np.nan for g in got]
        xs = x + (i - 1.5) * width
        ax.bar(xs, p50, width, label=f"{s} (median)", color=colors[s])
        ax.errorbar(xs, p50, yerr=[np.zeros(len(rows)), np.subtract(p99, p50)], fmt="none", ecolor="black",
                    capsize=3, lw=1)
        ax.scatter(xs, p90, marker="_", color="black", s=60, zorder=3)
    floor_jpeg = [r["systems"]["floor"]["added_ms"]["p50"] + r["jpeg"]["encode_obs_par_ms"] + r["jpeg"]["decode_obs_par_ms"]
                  for r in rows]
    ax.scatter(x + 1.5 * width, floor_jpeg, marker="D", color="white", edgecolors="black", s=30, zorder=4,
               label="floor + JPEG encode/decode alone")
    ax.set_xticks(x, [f"{WORKLOADS[r['workload']].label}\n{r['link']}" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("added latency, ms (bar: median, tick: p90, whisker: p99)")
    ax.set_title("Hand-over to chunk in the buffer, minus policy time")
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--round-trips", type=int, default=None, help="per system per case (default 200, --full 500)")
    parser.add_argument("--batch", type=int, default=25, help="round trips per turn before the next system")
    parser.add_argument("--systems", type=lambda s: s.split(","), default=None,
                        help=f"a subset of {','.join(SYSTEMS)} (floor always runs: JPEG alone is timed there)")
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=None,
                        help=f"a subset of {','.join(WORKLOADS)}")
    parser.add_argument("--base", default=None, metavar="CHECKOUT",
                        help="another checkout of this project, run side by side as `base` (module docstring)")


BENCHMARK = CoreBenchmark("latency", __doc__, add_args, run, plot, table, sizes={"round_trips": (200, 500)})
main = BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())
