"""`lerobot-zenoh-monitor`: a live table of every server and robot, from Zenoh telemetry.

    lerobot-zenoh-monitor --endpoint=tcp/127.0.0.1:7447                 # everything it can see there
    lerobot-zenoh-monitor --cluster_uuid=jupiter --experiment_tag=fabio2 # narrowed
    lerobot-zenoh-monitor --json                                         # one JSON line per message
    lerobot-zenoh-monitor --prometheus_port=9464                         # also serve /metrics
    lerobot-zenoh-monitor --zenoh.mode=client --endpoint=tls/gpu-host:7447 \\
        --zenoh.tls_root_ca=pki/ca.pem --zenoh.tls_certificate=pki/ops.pem --zenoh.tls_private_key=pki/ops.key

When nothing answers at the endpoint (a server or router not started yet), the monitor logs it
once and keeps trying, waiting twice as long each time up to MAX_RETRY_S, so that it can run as a
service started before the fleet; `--exit_when_unreachable` exits with 3 instead.

Exit codes (docs/client.md, "Command lines"): 0 when stopped (Ctrl-C, SIGTERM, --duration_s), 2 for
a configuration mistake (one line naming the flag: a bad value, an unknown flag, a Prometheus port
already in use, a TLS certificate refused), 3 when nothing answers and --exit_when_unreachable is set.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from lerobot_zenoh.errors import TransportError
from lerobot_zenoh.transport.settings import QUICK_CONNECT_WAIT_S, ZenohSettings

PROG = "lerobot-zenoh-monitor"

#: Longest wait between two tries to reach an endpoint where nothing answers yet.
MAX_RETRY_S = 30.0
FIRST_RETRY_S = 1.0

log = logging.getLogger(PROG)

@dataclass
class MonitorConfig:
    # (one string, not a multi-line docstring: draccus prints a docstring's lines as written in --help)
    ("The monitor's flags. --json and "
     "--exit_when_unreachable may be given without a value (=true); --zenoh.connect once per endpoint; "
     "--log-level is the older spelling of --log_level.")

    # Where a policy server or Zenoh router listens, e.g. tcp/192.168.1.50:7447. Unset: find them by
    # multicast scouting on the local network, or through --zenoh.connect.
    endpoint: str | None = None
    # The Zenoh session (mode, endpoints, scouting, TLS), as the robot client's --zenoh.*.
    zenoh: ZenohSettings = field(default_factory=ZenohSettings)
    # Show only this cluster (a server manifest's cluster_uuid). Unset: every cluster.
    cluster_uuid: str | None = None
    # Show only this experiment (experiment_tag). Unset: every experiment.
    experiment_tag: str | None = None
    # Show only this model (model_id). Unset: every model.
    model_id: str | None = None
    # Show only this model version (model_version). Unset: every version.
    model_version: str | None = None
    # Show only this application (application_tag). Unset: every application.
    application_tag: str | None = None
    # Print one JSON line per telemetry message instead of the live table.
    json: bool = False
    # Also serve every figure at http://<prometheus_host>:<port>/metrics for Prometheus to scrape.
    prometheus_port: int | None = None
    # The address the /metrics endpoint listens on (0.0.0.0: every interface).
    prometheus_host: str = "127.0.0.1"
    # Seconds between redraws of the table.
    refresh_s: float = 1.0
    # A server or robot is shown SILENT after this many telemetry periods without a message.
    stale_periods: float = 3.0
    # Forget a server or robot (its row and its /metrics series) once it has been GONE or SILENT this long.
    forget_after_s: float = 60.0
    # Exit after this many seconds (scripts, tests). Unset: run until Ctrl-C or SIGTERM.
    duration_s: float | None = None
    # When nothing answers at the endpoint: exit with 3 at once (true), or keep trying with a back-off
    # up to 30 s, logging it once (false: a monitor run as a service, started before the fleet).
    exit_when_unreachable: bool = False
    # Logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        from lerobot_zenoh.command_line import check_log_level
        from lerobot_zenoh.errors import ConfigError

        if self.prometheus_port is not None and not 1 <= self.prometheus_port <= 65535:
            raise ConfigError("prometheus_port", f"must be in 1..65535, got {self.prometheus_port}")
        if self.refresh_s <= 0:
            raise ConfigError("refresh_s", f"must be positive, got {self.refresh_s}")
        if self.stale_periods <= 0:
            raise ConfigError("stale_periods", f"must be positive, got {self.stale_periods}")
        if self.forget_after_s <= 0:
            raise ConfigError("forget_after_s", f"must be positive, got {self.forget_after_s}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError("duration_s", f"must be positive, got {self.duration_s}")
        check_log_level(self.log_level)
        if self.endpoint is not None and "/" not in self.endpoint:
            raise ConfigError("endpoint", f"{self.endpoint!r} is not an endpoint like tcp/127.0.0.1:7447")
        if self.endpoint is not None and "," in self.endpoint:
            raise ConfigError("endpoint", f"{self.endpoint!r}: one endpoint here; give several routers with "
                                          "--zenoh.connect (once per endpoint, or as a list)")
        self.zenoh.validate("zenoh")

    def zenoh_settings(self) -> ZenohSettings:
        from lerobot_zenoh.telemetry.fleet import MAX_MESSAGE_BYTES

        settings = self.zenoh.with_connect(self.endpoint)
        if settings.max_message_bytes == ZenohSettings().max_message_bytes:
            # --zenoh.max_message_bytes unset: the monitor only takes telemetry, so a link of its
            # session reassembles no message larger than one (Zenoh drops a larger one as it arrives).
            settings = settings.replace(max_message_bytes=MAX_MESSAGE_BYTES + (64 << 10))
        # --zenoh.connect_timeout_s unset: a dead endpoint is reported soon, as the robot client does
        return settings.replace(connect_timeout_s=settings.connect_wait_s(QUICK_CONNECT_WAIT_S))

    def selector_prefix(self) -> str:
        """cluster/experiment/model/version/app with `*` for what was not narrowed."""
        parts = [self.cluster_uuid, self.experiment_tag, self.model_id, self.model_version, self.application_tag]
        if not any(parts):
            return "**"
        return "/".join(p or "*" for p in parts)


#: Telemetry messages Zenoh may hold for the monitor before the link is held back (each at most
#: MAX_MESSAGE_BYTES, telemetry/fleet.py).
INTAKE_CHANNEL = 8

#: Most bytes of fleet series one /metrics answer carries (the monitor's own figures first, then
#: members' own, those with a live token and the longest known first, then servers' per-robot ones;
#: what does not fit is left out and counted, docs/telemetry.md).
MAX_METRICS_BYTES = 2 << 20


class Unreachable(TransportError):
    """Nothing answers at the monitor's endpoints (exit 3 with --exit_when_unreachable)."""


def spellings():
    """The monitor's other spellings: --zenoh.connect once per endpoint, and the switches written
    without a value (``--json`` for ``--json=true``)."""
    from lerobot_zenoh.command_line import CONNECT_SPELLINGS, Spellings

    return Spellings(switches={"--json": "--json=true", "--exit_when_unreachable": "--exit_when_unreachable=true"},
                     aliases={"--log-level": "--log_level"}, repeatable=CONNECT_SPELLINGS.repeatable)


def open_session(settings, stop: threading.Event, exit_when_unreachable: bool, deadline_s: float | None):
    """The Zenoh session of `settings`, tried again while nothing answers at its endpoints (logged
    once, then waits doubling up to MAX_RETRY_S) unless `exit_when_unreachable`; None when stopped
    or past `deadline_s` (monotonic) first. Raises Unreachable when nothing answers and
    `exit_when_unreachable`, LeRobotZenohError for anything else (a refused certificate, a bad setting)."""
    from lerobot_zenoh.errors import LeRobotZenohError, TlsRefusedError
    from lerobot_zenoh.transport.session import ZenohSession

    delay = FIRST_RETRY_S
    logged = False
    while True:
        try:
            return ZenohSession(settings).open()
        except LeRobotZenohError as exc:
            if not settings.connect or settings.effective_mode != "client":
                raise
            if isinstance(exc, TlsRefusedError):  # something answers, with a certificate one side refuses
                raise LeRobotZenohError(f"cannot connect to {', '.join(settings.connect)}: {exc}") from exc
            where = ", ".join(settings.connect)
            if exit_when_unreachable:
                raise Unreachable(f"cannot connect to {where}: nothing answers there (is the server or "
                                    "router running, and is the address right?)") from exc
            if not logged:
                log.warning("nothing answers at %s yet: trying again (every %.0f s at most) until it does; "
                            "--exit_when_unreachable exits with 3 instead", where, MAX_RETRY_S)
                logged = True
        wait_s = delay if deadline_s is None else min(delay, max(0.0, deadline_s - time.monotonic()))
        if stop.wait(wait_s) or (deadline_s is not None and time.monotonic() >= deadline_s):
            return None
        delay = min(2 * delay, MAX_RETRY_S)


#: Connections the /metrics server holds at once (a scraper needs one); at the cap a new one replaces
#: the oldest, so connections that never finish their request (slowloris) cannot keep a scrape out.
MAX_SCRAPE_CONNECTIONS = 64
#: Seconds a /metrics connection may stay silent.
SCRAPE_TIMEOUT_S = 10.0


def _scrape_server_class():
    """http.server's threading server, bounded (built on first use: http.server is imported late)."""
    import errno
    import socket
    from http.server import ThreadingHTTPServer

    shortages = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

    class ScrapeServer(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # socketserver's backlog of 5 drops SYNs under a burst: scrapes then wait 1 s

        def __init__(self, *args, **kwargs):
            self._open: dict = {}  # socket -> accepted at (monotonic)
            self._open_lock = threading.Lock()
            super().__init__(*args, **kwargs)

        def get_request(self):
            try:
                return super().get_request()
            except OSError as exc:
                if exc.errno in shortages:  # out of descriptors: free the oldest, and do not spin on select()
                    self._evict_oldest()
                    time.sleep(0.05)
                raise  # socketserver skips this one and goes on

        def _evict_oldest(self) -> None:
            with self._open_lock:
                if not self._open:
                    return
                oldest = min(self._open, key=self._open.get)
                self._open.pop(oldest)
            try:
                oldest.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def process_request(self, request, client_address):
            with self._open_lock:
                full = len(self._open) >= MAX_SCRAPE_CONNECTIONS
            if full:
                self._evict_oldest()
            with self._open_lock:
                self._open[request] = time.monotonic()
            super().process_request(request, client_address)

        def shutdown_request(self, request):
            with self._open_lock:
                self._open.pop(request, None)
            super().shutdown_request(request)

        def handle_error(self, request, client_address):
            if isinstance(sys.exc_info()[1], OSError):  # a scraper gone or too slow: not the monitor's fault
                return
            super().handle_error(request, client_address)

    return ScrapeServer


def serve_prometheus(fleet, port: int, host: str = "127.0.0.1", max_bytes: int = MAX_METRICS_BYTES):
    """Serve the fleet's figures at http://host:port/metrics (with the client library's process
    metrics), on a thread of its own. Returns the HTTP server (`shutdown()` stops it).

    Raises OSError when the port cannot be bound (in use, or a privileged port).
    """
    from http.server import BaseHTTPRequestHandler

    from prometheus_client import REGISTRY, generate_latest

    from lerobot_zenoh.telemetry.prometheus import families, render

    class Handler(BaseHTTPRequestHandler):
        timeout = SCRAPE_TIMEOUT_S  # a socket silent this long is dropped (http.server's own setting)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            fams, taken = families(fleet.samples(), max_bytes)
            text, cut = render(fams, max_bytes)  # (the estimate above is close: this rarely cuts)
            fleet.series_dropped += max(0, fleet.series_count() - taken) + cut
            body = text.encode() + generate_latest(REGISTRY)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # no line per scrape on stderr
            pass

    server = _scrape_server_class()((host, port), Handler)  # binds now: a busy port raises here
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="metrics-http",
                     daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import EXIT_CONFIG, EXIT_NO_SERVER, explain, fail, parse, warn_old_spellings
    from lerobot_zenoh.cli.stopping import begin_stop

    args = sys.argv[1:] if argv is None else list(argv)
    warn_old_spellings(PROG, args, {"--log-level": "--log_level"})
    config = parse(MonitorConfig, args, PROG, spellings())
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from lerobot_zenoh.errors import LeRobotZenohError, ProtocolError
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.schema import CodecLimits
    from lerobot_zenoh.telemetry.fleet import MAX_MESSAGE_BYTES, FleetView, TelemetryInbox, format_table

    prefix = config.selector_prefix()
    fleet = FleetView(stale_periods=config.stale_periods, forget_after_s=config.forget_after_s)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    out_lock = threading.Lock()
    # Telemetry waits in a bounded Zenoh channel (INTAKE_CHANNEL messages of at most MAX_MESSAGE_BYTES:
    # Zenoh's threads never wait for Python's lock, a full channel holds the link back); the intake
    # thread checks each message's size and hands it to the inbox (copied once accepted); this thread
    # decodes it. A message over MAX_MESSAGE_BYTES, or over the inbox's byte budget or intake rate, is
    # refused and counted, never decoded.
    inbox = TelemetryInbox()
    fleet.inbox_bytes = inbox.bytes
    # Decoding limits: no string of a telemetry message (figure name, id, label) is longer than 1 KiB.
    limits = CodecLimits(max_message_bytes=MAX_MESSAGE_BYTES, max_str_bytes=1024)

    def intake(channel) -> None:
        while (sample := channel.recv()) is not None:
            refused = inbox.offer(*sample, time.monotonic())
            if refused is not None:
                fleet.reject(refused)

    def handle(key: str, payload: bytes, arrived_s: float) -> None:
        try:
            msg = codec.decode_telemetry(payload, limits)
        except ProtocolError:
            fleet.reject("undecodable")
            return
        fleet.on_telemetry(key, msg, arrived_s)
        if config.json:
            line = json.dumps({"key": key, "source": msg.source, "source_id": msg.source_id, "seq": msg.seq,
                               "uptime_s": msg.uptime_s, "metrics": msg.metrics, "per_client": msg.per_client,
                               "labels": msg.labels})
            with out_lock:
                print(line, flush=True)

    # The HTTP port first: a port in use is a configuration mistake reported before anything else
    # runs (with a Zenoh session already open, an exception here used to leave the process hanging).
    http = None
    if config.prometheus_port:
        try:
            http = serve_prometheus(fleet, config.prometheus_port, config.prometheus_host)
        except OSError as exc:
            fail(PROG, f"--prometheus_port: cannot listen on {config.prometheus_host}:{config.prometheus_port}: "
                       f"{exc.strerror or exc} (another monitor or exporter? pick another port)")
    session = intake_thread = None
    settings = config.zenoh_settings()
    t_end = None if config.duration_s is None else time.monotonic() + config.duration_s
    try:
        session = open_session(settings, stop, config.exit_when_unreachable, t_end)
        if session is None:  # stopped (or --duration_s over) before anything answered
            if http is not None:
                http.shutdown()
            return 0
        channel = session.subscribe_channel(f"{prefix}/**/metrics" if prefix != "**" else "**/metrics", INTAKE_CHANNEL)
        intake_thread = threading.Thread(target=intake, args=(channel,), name="telemetry-intake", daemon=True)
        intake_thread.start()
        session.watch_liveliness(f"{prefix}/**" if prefix != "**" else "**",
                                 lambda key, alive: fleet.on_liveliness(key, alive, time.monotonic()))
    except LeRobotZenohError as exc:
        if http is not None:
            http.shutdown()
        if session is not None:
            session.close()
        if intake_thread is not None:  # (as below: never left inside Zenoh's recv at exit)
            intake_thread.join(timeout=2.0)
        fail(PROG, explain(exc), EXIT_NO_SERVER if isinstance(exc, Unreachable) else EXIT_CONFIG)
    next_draw = next_forget = time.monotonic()
    try:
        # Wake at least every 0.2 s whatever --refresh_s is, so that a signal ends the monitor at once.
        while not stop.is_set():
            try:
                handle(*inbox.take(0.2))
                for _ in range(1000):  # bounded: a flood must not keep the table and the signals waiting
                    handle(*inbox.take())
            except queue.Empty:
                pass
            now = time.monotonic()
            if now >= next_forget:
                next_forget = now + 1.0
                fleet.forget(now)  # members gone or silent for --forget_after_s, and their series
            if not config.json and now >= next_draw:
                next_draw = now + config.refresh_s
                table = format_table(fleet.rows(now)) + "\n\n" + fleet.status_line()
                with out_lock:
                    print("\033[2J\033[H" + f"lerobot-zenoh fleet ({prefix})  {time.strftime('%H:%M:%S')}\n\n" + table,
                          flush=True)
            if t_end is not None and now >= t_end:
                break
    finally:
        if stop.is_set():
            begin_stop(None)
        if http is not None:
            threading.Thread(target=http.shutdown, daemon=True).start()  # up to 0.5 s poll: not waited for
        session.close()
        # The closed channel ends the intake thread's recv; wait for it, since a thread still inside
        # Zenoh's recv when the interpreter finalizes aborts the process ("exception not rethrown").
        if intake_thread is not None:
            intake_thread.join(timeout=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
