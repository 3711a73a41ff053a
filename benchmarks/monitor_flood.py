"""The monitor under telemetry floods: its memory and /metrics, side by side with a quiet control run.

Starts the real `lerobot-zenoh-monitor` (with `--prometheus_port`) against a Zenoh peer on loopback;
an honest server and robot publish telemetry every 0.2 s throughout. Each scenario then floods the
monitor for `--flood_s` seconds, as a peer in plain mode (or a robot with its own certificate) can:

  control          nothing more (the reference)
  huge_names       robots' telemetry with 60 kB figure names (15 per message)
  huge_messages    15 MiB messages on one robot's own metrics key
  heavy_members    8 forged servers, each with 1024 robots x 32 figures per message (~1 MB)
  many_members     20,000 invented robot keys with 64 figures each

and prints, per scenario: the monitor's RSS before the flood, after it and at its peak (VmHWM), the
largest /metrics answer and the slowest scrape of three after the flood, whether the honest
members are still on /metrics, and the monitor's refusals by reason.

    python -m benchmarks.monitor_flood --port=7701 --http_port=7702

`FLOOD_MONITOR` (environment) replaces `-m lerobot_zenoh.cli.monitor` by another command line for the
monitor, e.g. a script that runs an older checkout's, to measure it the same way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import urllib.request

from testbed.ports import free_port

SCENARIOS = ("control", "huge_names", "huge_messages", "heavy_members", "many_members")
PREFIX = "bench/flood/act/v1/app"


def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of `pid` in MB."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                values[line.split(":")[0]] = int(line.split()[1]) / 1024
    return values["VmRSS"], values["VmHWM"]


def _scrape(http_port: int) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=120).read()
    return body, time.perf_counter() - t0


def _honest(stop: threading.Event, session, codec, Telemetry) -> None:
    """An honest server with one robot and that robot, every 0.2 s."""
    server_pub = session.raw.declare_publisher(f"{PREFIX}/server/gpu0/metrics")
    robot_pub = session.raw.declare_publisher(f"{PREFIX}/r1/metrics")
    seq = 0
    while not stop.wait(0.2):
        seq += 1
        server_pub.put(codec.encode(Telemetry("server", "gpu0", seq, seq * 0.2, 0.2, {
            "clients": 1, "inferences": seq * 6, "inference_ms_p50": 20.0, "inference_ms_p99": 31.0,
            "observations_received": seq * 7, "cpu_rss_mb": 410.0},
            {"r1": {"inferences": seq * 6, "observations_received": seq * 7, "queue_ms_p50": 1.0}})))
        robot_pub.put(codec.encode(Telemetry("client", "r1", seq, seq * 0.2, 0.2, {
            "loop_hz": 30.0, "steps": seq * 6, "chunks_received": seq, "rtt_ms_p50": 25.0, "buffer_depth": 20})))


def _flood(scenario: str, session, codec, Telemetry, until_s: float, block) -> int:
    """Publish the scenario's flood until `until_s` with congestion control `block`; returns the
    messages put."""
    put = 0
    if scenario == "huge_names":
        msgs = [codec.encode(Telemetry("client", f"x{i}", 0, 1.0, 1.0,
                                       {f"{chr(97 + j)}{i}_" + "n" * 60_000: 1.0 for j in range(15)}))
                for i in range(8)]
        while time.monotonic() < until_s:
            i = put % len(msgs)
            session.raw.put(f"{PREFIX}/x{i}/metrics", msgs[i], congestion_control=block)
            put += 1
    elif scenario == "huge_messages":
        blob = codec.encode(Telemetry("client", "r1", 0, 1.0, 1.0, {"loop_hz": 30.0}, labels={"pad": "x" * (15 << 20)}))
        while time.monotonic() < until_s:
            session.raw.put(f"{PREFIX}/r1/metrics", blob, congestion_control=block)
            put += 1
    elif scenario == "heavy_members":
        per_client = {f"robot-{i:04d}-{'p' * 20}": {f"f_{j:02d}": float(j) for j in range(32)} for i in range(1024)}
        msgs = [codec.encode(Telemetry("server", f"forged{k}", 0, 1.0, 1.0, {"inferences": 1}, per_client))
                for k in range(8)]
        while time.monotonic() < until_s:
            k = put % 8
            session.raw.put(f"{PREFIX}/server/forged{k}/metrics", msgs[k], congestion_control=block)
            put += 1
    elif scenario == "many_members":
        figures = {f"figure_{j}": float(j) for j in range(64)}
        while time.monotonic() < until_s and put < 20_000:
            session.raw.put(f"{PREFIX}/m{put}/metrics", codec.encode(Telemetry("client", f"m{put}", 0, 1.0, 1.0, figures)),
                            congestion_control=block)
            put += 1
        while time.monotonic() < until_s:
            time.sleep(0.1)
    else:
        while time.monotonic() < until_s:
            time.sleep(0.1)
    return put


def run(scenario: str, port: int, http_port: int, flood_s: float, congestion: str) -> dict:
    import zenoh

    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import Telemetry
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    with ZenohSession(loopback_settings(port)) as hub:
        monitor = subprocess.Popen(
            [sys.executable, *os.environ.get("FLOOD_MONITOR", "-m lerobot_zenoh.cli.monitor").split(), f"--endpoint=tcp/127.0.0.1:{port}",
             "--zenoh.multicast_scouting=false", f"--prometheus_port={http_port}", "--refresh_s=1"],
            stdout=subprocess.DEVNULL, stderr=None if os.environ.get("FLOOD_MONITOR") else subprocess.PIPE)
        stop = threading.Event()
        honest = threading.Thread(target=_honest, args=(stop, hub, codec, Telemetry), daemon=True)
        try:
            deadline = time.monotonic() + 60
            honest.start()
            while True:  # the monitor answers and has heard both honest members
                try:
                    body, _ = _scrape(http_port)
                    if b'server="gpu0"' in body and b'client="r1"' in body:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline or monitor.poll() is not None:
                    raise RuntimeError(f"the monitor did not start: {monitor.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
            time.sleep(2.0)  # a few honest periods at rest
            rss_before, _ = _rss_mb(monitor.pid)
            t0 = time.monotonic()
            put = _flood(scenario, hub, codec, Telemetry, t0 + flood_s, getattr(zenoh.CongestionControl, congestion.upper()))
            rss_after, hwm = _rss_mb(monitor.pid)
            try:
                scrapes = [_scrape(http_port) for _ in range(3)]
            except OSError as exc:  # no answer within the scrape timeout
                print(f"{scenario}: /metrics did not answer: {exc}", flush=True)
                scrapes = [(b"", float("inf"))]
            body = max((b for b, _ in scrapes), key=len)
            honest_seen = b'server="gpu0"' in body and b'client="r1"' in body
            refused = {}
            for line in body.decode().splitlines():
                if line.startswith("lerobot_zenoh_monitor_messages_rejected_total{") and not line.endswith(" 0.0"):
                    refused[line.split('reason="')[1].split('"')[0]] = int(float(line.rsplit(" ", 1)[1]))
            return {"scenario": scenario, "messages": put, "rss_before_mb": rss_before, "rss_after_mb": rss_after,
                    "rss_peak_mb": hwm, "metrics_mb": len(body) / 1e6, "scrape_s": max(s for _, s in scrapes),
                    "honest_seen": honest_seen, "refused": refused}
        finally:
            stop.set()
            honest.join(2)
            monitor.terminate()
            try:
                monitor.wait(10)
            except subprocess.TimeoutExpired:  # (a monitor without these bounds, deep in a flood)
                monitor.kill()
                monitor.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=None, help="Zenoh port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--http_port", type=int, default=None, help="the monitor's /metrics port (default: a free one)")
    parser.add_argument("--flood_s", type=float, default=10.0, help="seconds each flood lasts")
    parser.add_argument("--congestion", choices=("block", "drop"), default="block",
                        help="the flooder's congestion control: block (every message reaches the monitor, the worst "
                             "case) or drop (Zenoh's default for a put)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: " + ", ".join(SCENARIOS))
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (choose from {', '.join(SCENARIOS)})")
    if "control" not in scenarios:
        scenarios.insert(0, "control")  # every flood is read against it
    print(f"monitor under telemetry floods ({args.flood_s:.0f} s each, congestion control {args.congestion}; "
          f"{os.cpu_count()} CPUs); RSS in MB")
    print(f"{'scenario':<15}{'messages':>9}{'RSS before':>11}{'after':>8}{'peak':>8}{'grown':>8}{'vs control':>11}"
          f"{'/metrics MB':>12}{'scrape s':>9}  honest  refused")
    control = None
    for scenario in scenarios:
        r = run(scenario, args.port or free_port(), args.http_port or free_port(), args.flood_s, args.congestion)
        grown = r["rss_peak_mb"] - r["rss_before_mb"]
        if scenario == "control":
            control = grown
        print(f"{scenario:<15}{r['messages']:>9}{r['rss_before_mb']:>11.1f}{r['rss_after_mb']:>8.1f}{r['rss_peak_mb']:>8.1f}"
              f"{grown:>+8.1f}{grown - control:>+11.1f}{r['metrics_mb']:>12.3f}{r['scrape_s']:>9.3f}  "
              f"{'yes' if r['honest_seen'] else 'NO':<6}  {r['refused'] or '-'}", flush=True)
    print("grown: peak RSS during the flood minus RSS before it; vs control: that minus the control run's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
