"""`lerobot-zenoh-monitor`: a live table of every server and robot, from Zenoh telemetry.

    lerobot-zenoh-monitor --connect tcp/127.0.0.1:7447               # everything it can see
    lerobot-zenoh-monitor --cluster jupiter --experiment fabio2      # narrowed
    lerobot-zenoh-monitor --json                                     # one JSON line per message
    lerobot-zenoh-monitor --prometheus-port 9464                     # also serve /metrics
    lerobot-zenoh-monitor --connect tls/gpu-host:7447 \
        --tls-ca pki/ca.pem --tls-cert pki/monitor.pem --tls-key pki/monitor.key   # mutual TLS

With --connect the monitor is a connect-only Zenoh client (no listener, no scouting); the
--zenoh.* options are the same settings as the robot client's (transport/settings.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections import defaultdict

from lerobot_zenoh.transport.settings import add_arguments, settings_from_arguments


def selector_prefix(args) -> str:
    """cluster/experiment/model/version/app with `*` for what was not narrowed."""
    parts = [args.cluster, args.experiment, args.model, args.version, args.app]
    if not any(parts):
        return "**"
    return "/".join(p or "*" for p in parts)


def serve_prometheus(fleet, port: int, host: str = "127.0.0.1"):
    """Serve the fleet's figures at http://host:port/metrics. Returns the HTTP server."""
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY, GaugeMetricFamily

    class FleetCollector:
        def collect(self):
            grouped: dict[str, list] = defaultdict(list)
            for name, labels, value in fleet.samples():
                grouped[_metric_name(name)].append((labels, value))
            for name, samples in sorted(grouped.items()):
                label_names = sorted({k for labels, _ in samples for k in labels})
                family = GaugeMetricFamily(name, f"lerobot-zenoh telemetry figure {name}", labels=label_names)
                for labels, value in samples:
                    family.add_metric([labels.get(k, "") for k in label_names], value)
                yield family

    collector = FleetCollector()
    REGISTRY.register(collector)
    server, thread = start_http_server(port, addr=host)
    return server, collector


def _metric_name(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lerobot-zenoh-monitor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("cluster", "experiment", "model", "version", "app"):
        parser.add_argument(f"--{name}", help=f"only this {name}")
    # Zenoh: the fields of transport/settings.py (the client's --zenoh.*), older spellings kept.
    # Defaults: connect-only Zenoh client with scouting off when --connect is given; never a listener.
    add_arguments(parser, ("connect", "mode", "multicast_scouting", "tls_root_ca", "tls_certificate",
                           "tls_private_key", "json5_overrides"),
                  aliases={"connect": ["--connect"], "mode": ["--mode"], "tls_root_ca": ["--tls-ca"],
                           "tls_certificate": ["--tls-cert"], "tls_private_key": ["--tls-key"]})
    parser.add_argument("--no-scouting", dest="zenoh_multicast_scouting", action="store_false", default=None,
                        help="same as --zenoh.multicast_scouting=false")
    parser.add_argument("--json", action="store_true", help="print one JSON line per telemetry message")
    parser.add_argument("--prometheus-port", type=int, help="serve figures at http://127.0.0.1:PORT/metrics")
    parser.add_argument("--prometheus-host", default="127.0.0.1")
    parser.add_argument("--refresh-s", type=float, default=1.0)
    parser.add_argument("--stale-periods", type=float, default=3.0, help="silent after this many missed periods")
    parser.add_argument("--duration-s", type=float, help="exit after this long (scripts, tests)")
    args = parser.parse_args(argv)

    from lerobot_zenoh.errors import LeRobotZenohError, ProtocolError
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.telemetry.fleet import FleetView, format_table
    from lerobot_zenoh.transport.session import ZenohSession

    prefix = selector_prefix(args)
    fleet = FleetView(stale_periods=args.stale_periods)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    out_lock = threading.Lock()

    def on_metrics(key: str, payload: bytes) -> None:
        try:
            msg = codec.decode_telemetry(payload)
        except ProtocolError:
            fleet.rejected += 1
            return
        fleet.on_telemetry(key, msg, time.monotonic())
        if args.json:
            line = json.dumps({"key": key, "source": msg.source, "source_id": msg.source_id, "seq": msg.seq,
                               "uptime_s": msg.uptime_s, "metrics": msg.metrics, "per_client": msg.per_client,
                               "labels": msg.labels})
            with out_lock:
                print(line, flush=True)

    try:
        session = ZenohSession(settings_from_arguments(args)).open()
        session.subscribe(f"{prefix}/**/metrics" if prefix != "**" else "**/metrics", on_metrics)
        session.watch_liveliness(f"{prefix}/**" if prefix != "**" else "**",
                                 lambda key, alive: fleet.on_liveliness(key, alive, time.monotonic()))
    except LeRobotZenohError as exc:
        print(f"lerobot-zenoh-monitor: {exc}", file=sys.stderr)
        return 2
    http = None
    if args.prometheus_port:
        http, _ = serve_prometheus(fleet, args.prometheus_port, args.prometheus_host)
    t_end = None if args.duration_s is None else time.monotonic() + args.duration_s
    try:
        while not stop.wait(args.refresh_s):
            if not args.json:
                table = format_table(fleet.rows(time.monotonic()))
                with out_lock:
                    print("\033[2J\033[H" + f"lerobot-zenoh fleet ({prefix})  {time.strftime('%H:%M:%S')}\n\n" + table,
                          flush=True)
            if t_end is not None and time.monotonic() >= t_end:
                break
    finally:
        if http is not None:
            http.shutdown()
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
