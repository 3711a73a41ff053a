"""The OpenPI front door: openpi-client's websocket contract in front of the fleet's Zenoh protocol.

    connect      -> 401 without the token (when one is set), 400 for a header it cannot read, 429 for
                    a peer address in its rejection cool-down, 503 when `max_clients` are connected;
                    otherwise the metadata map (msgpack) is the first frame, as OpenPI's server sends
    GET /healthz -> 200 "OK" only while a new client can be served (a client slot free, the listener
                    accepting, a server of the model alive); 503 with the reasons otherwise
    binary frame -> msgpack-numpy observation -> mapping -> RobotLink.infer (Zenoh) ->
                    {"actions": (n, action_dim) float32, "server_timing": {...}} as msgpack
    bad request  -> a text frame saying why (openpi-client raises RuntimeError with it); the
                    connection stays open and nothing reaches the fleet; counted as rejected.<reason>
    too large    -> over the frame limit: the websocket closes with 1009 (message too big) before the
                    frame is read, counted as rejected.too_large
    idle         -> no frame for `idle_timeout_s`: closed (1000), counted as rejected.idle_timeout

The listening socket is the door's own loop (`listener.py`: it survives accept() errors and bounds
the sockets held). Each connection runs on its own thread (websockets' sync server), so a slow
answer to one client never delays another's frames or a health check; frames are decoded on a
pool of `decode_workers` threads within a budget of items screened from their headers before
msgpack allocates anything (`wire.py`), so a costly frame costs its sender's turn, not another
client's memory. A frame is at most `frame_limit` bytes: unless set (`max_frame_bytes`), twice the
largest request the model's cameras, state and prompt make, plus 1 MiB; a larger one is refused
from its header, never read. Rejections feed the same cool-down as the Zenoh path
(`server/session_table/rate_limit.py`), keyed by the peer's address so that reconnecting does not evade it: past
`max_rejections` in `rejection_window_s`, requests are refused unread for `cooldown_s`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import CompatibilityError, ConfigError, ProtocolError
from lerobot_zenoh.openpi.bridge import ClientIds, RobotLink
from lerobot_zenoh.openpi.gate import Gate
from lerobot_zenoh.openpi.listener import Listener, NoiseLog, ReadBudget, connection_cap
from lerobot_zenoh.openpi.mapping import KeyMapping
from lerobot_zenoh.openpi.wire import MAX_FRAME_ITEMS, OpenPIReason, pack, unpack
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import APP_FIELDS, AppKey, validate_client_id
from lerobot_zenoh.protocol.messages import Status
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)

__all__ = ["FrontDoor", "FrontDoorConfig", "LOOPBACK_HOSTS"]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
#: websockets' own log: every health check and refused handshake is an INFO line there; warnings only.
_WEBSOCKETS_LOG = logging.getLogger("lerobot_zenoh.openpi.websockets")
#: How long a closing connection waits for its peer's close frame (websockets' default, 10 s, would
#: let a peer that ignores it hold its client slot that long after each refusal that closes it).
_CLOSE_TIMEOUT_S = 2.0
#: Unhandled bytes a connection may always hold (a request of a few camera frames): it never waits.
_READ_ALLOWANCE = 1 << 20
#: Refusals that are the fleet's doing, not the client's: they do not count towards its cool-down.
_FLEET_FAULTS = frozenset({OpenPIReason.UNANSWERED, OpenPIReason.SERVER_ERROR})


class FrontDoorConfig(Settings):
    """The front door's settings (a YAML/JSON file for `lerobot-zenoh-openpi --config`, or flags)."""

    config_prefix = ""

    # -- the websocket side
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = Field(8000, ge=0, le=65535)
    token: str | None = Field(None, min_length=16)  # clients send it as openpi-client's api_key
    tls_certificate: str | None = None  # PEM; with tls_private_key, the front door speaks wss://
    tls_private_key: str | None = None
    max_clients: int = Field(16, ge=1, le=1024)
    client_prefix: str = "openpi"
    # The Zenoh path's limits: the codec's message size and the server's rejection cool-down.
    max_message_bytes: int = Field(codec.DEFAULT_LIMITS.max_message_bytes, ge=1024)
    max_rejections: int = Field(20, ge=1)
    rejection_window_s: float = Field(1.0, gt=0)
    cooldown_s: float = Field(5.0, ge=0)
    # -- what one peer can hold (docs/openpi.md, "Limits")
    max_connections: int | None = Field(None, ge=1, description=(
        "Sockets the door holds at once, in a handshake or open (unset: the open-file limit less a quarter of it; "
        "never more). At the cap a new connection replaces the oldest one still in its handshake."))
    handshake_timeout_s: float = Field(5.0, gt=0, description=(
        "A connection must finish its TLS and websocket handshakes within this, or it is closed"))
    idle_timeout_s: float = Field(300.0, gt=0, description=(
        "A connection that sends no frame for this long is closed (1000); openpi-client reconnects"))
    decode_workers: int = Field(2, ge=1, le=64, description=(
        "Threads that decode request frames (at most this many frames are decoded at once, whatever the connections)"))
    max_frame_bytes: int | None = Field(None, ge=64 << 10, description=(
        "The largest request frame (never over max_message_bytes); a larger one closes its connection with 1009 "
        "before it is read. Unset: twice the model's cameras (raw uint8), state and longest prompt, plus 1 MiB"))
    max_frame_items: int = Field(MAX_FRAME_ITEMS, ge=64, description=(
        "Map and array entries one request frame may hold, counted from its headers before it is decoded "
        "(refused as too_many_items)"))
    max_unhandled_bytes: int = Field(16 << 20, ge=1 << 20, description=(
        "Bytes of large frames the door reads at once: max_unhandled_bytes / the frame limit connections may "
        "hold more than 1 MiB not yet handled, the others wait (the door's memory under floods of large frames)"))
    max_peers: int = Field(4096, ge=16, description=(
        "Peer addresses whose rejections the cool-down remembers (least recently refused forgotten first)"))
    # -- the fleet side (docs/protocol.md)
    endpoint: str = "tcp/127.0.0.1:7447"
    cluster_uuid: str | None = None  # unset: taken from what the endpoint serves, as the robot client does
    experiment_tag: str | None = None
    model_id: str | None = None
    model_version: str | None = None
    application_tag: str | None = None
    zenoh: dict[str, Any] = Field(default_factory=dict)  # more ZenohSettings fields (TLS, mode, ...)
    discovery_timeout_s: float = Field(10.0, gt=0)
    jpeg_quality: int = Field(90, ge=1, le=100)
    resend_after_s: float = Field(2.0, gt=0)  # an unanswered (best-effort) observation is sent again
    request_timeout_s: float = Field(30.0, gt=0)
    fps: float | None = Field(None, gt=0)  # the robots' control rate, told to an execution-aware scheduler
    telemetry_period_s: float = Field(1.0, ge=0)
    mapping: KeyMapping = Field(default_factory=KeyMapping)

    @field_validator("client_prefix")
    @classmethod
    def _prefix_is_a_key_chunk(cls, value: str) -> str:
        validate_client_id("client_prefix", f"{value}-0")
        return value

    def zenoh_settings(self) -> ZenohSettings:
        fields = {"mode": "client", "connect": [self.endpoint], "multicast_scouting": False, **self.zenoh}
        try:
            return ZenohSettings(**fields)
        except (TypeError, ValueError) as exc:
            raise ConfigError("zenoh", str(exc)) from None

    def given_app(self) -> dict[str, str]:
        return {n: v for n in APP_FIELDS if (v := getattr(self, n)) is not None}


class FrontDoorCounters:
    """What the front door counts (read from any thread; written under one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter = Counter()
        self.rejected: Counter = Counter()
        self.added_ms: deque = deque(maxlen=512)  # front door's own time per answered request

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[str(reason)] += 1

    def answered(self, added_ms: float, resent: int) -> None:
        with self._lock:
            self.counts["requests_answered"] += 1
            self.counts["observations_resent"] += resent
            self.added_ms.append(added_ms)

    def snapshot(self) -> dict[str, float | int]:
        with self._lock:
            out: dict[str, float | int] = dict(self.counts)
            out.update({f"rejected.{r}": n for r, n in self.rejected.items()})
            if self.added_ms:
                out["front_door_ms_p50"] = float(np.percentile(self.added_ms, 50))
                out["front_door_ms_p99"] = float(np.percentile(self.added_ms, 99))
        return out


class FrontDoor:
    """Construct with a config (no I/O); `start()` opens Zenoh, checks the model and listens; `close()`."""

    def __init__(self, config: FrontDoorConfig, *, session=None):
        self.config = config
        self.counters = FrontDoorCounters()
        self.status: Status | None = None
        self.app: AppKey | None = None
        self._session = session
        self._own_session = session is None
        self._ids = ClientIds(config.client_prefix, config.max_clients)
        self._server = None
        self._listener: Listener | None = None
        self._port = config.port
        self._noise = NoiseLog(log)
        self.gate = Gate(config, self.counters, self._ids, self._noise, lambda: self._listener, lambda: self.app)
        self._telemetry = None
        self._jpeg = ThreadPoolExecutor(max_workers=4, thread_name_prefix="openpi:jpeg")
        self._decode = ThreadPoolExecutor(max_workers=config.decode_workers, thread_name_prefix="openpi:decode")
        self._metadata: bytes = b""
        self.frame_limit = config.max_message_bytes  # the largest request frame: set at start-up from the model
        self._closing = threading.Event()
        self._connections: set = set()
        self._connections_lock = threading.Condition()

    # -- start-up ----------------------------------------------------------------------------

    def start(self) -> FrontDoor:
        from websockets.sync.server import serve

        from lerobot_zenoh.client.discovery import find_app, query_status
        from lerobot_zenoh.client.link import open_session

        cfg = self.config
        if self._session is None:
            self._session = open_session(cfg.zenoh_settings(), cfg.discovery_timeout_s)
        served = find_app(self._session, cfg.given_app(), cfg.discovery_timeout_s)
        self.app = served.app
        status = query_status(self._session, self.app, client_uuid=f"{cfg.client_prefix}-0") or served.status
        if status.client_admitted is False:
            raise CompatibilityError(f"the server does not serve client {cfg.client_prefix}-0: list "
                                     f"{cfg.client_prefix}-0 .. {cfg.client_prefix}-{cfg.max_clients - 1} under the "
                                     "model's `clients` in its manifest, or set accept_unknown_clients")
        cfg.mapping.check(status)
        self.status = status
        self.frame_limit = min(cfg.max_message_bytes,
                               cfg.max_frame_bytes or 2 * cfg.mapping.largest_request(status) + (1 << 20))
        self._metadata = pack(self._metadata_map(status))
        tls = None
        if cfg.tls_certificate or cfg.tls_private_key:
            if not (cfg.tls_certificate and cfg.tls_private_key):
                raise ConfigError("tls_certificate", "TLS needs both tls_certificate and tls_private_key")
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                tls.load_cert_chain(cfg.tls_certificate, cfg.tls_private_key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError("tls_certificate", f"cannot load the certificate and key: {exc}") from None
        _large_frees_return_to_the_os()
        cap = connection_cap(cfg.max_connections)
        if cap < cfg.max_clients + 8:
            raise ConfigError("max_connections", f"{cap} sockets (the open-file limit allows {connection_cap(None)}) "
                              f"leave no room for max_clients={cfg.max_clients} and their handshakes: raise the "
                              "limit (ulimit -n) or lower max_clients")
        self._servers_watch = self._session.watch_liveliness(self.app.all_servers, self.gate.on_server)
        if _WEBSOCKETS_LOG.level == logging.NOTSET:
            _WEBSOCKETS_LOG.setLevel(logging.WARNING)
        try:
            sock = socket.create_server((cfg.host, cfg.port), backlog=128)
        except OSError as exc:
            raise ConfigError("port", f"cannot listen on {cfg.host}:{cfg.port}: {exc}") from None
        self._port = sock.getsockname()[1]
        # websockets' server object gives the per-connection handler (its handshake, then `_handle`);
        # its serve_forever() is never run: the listener accepts (TLS included) and survives accept() errors.
        # max_size: a larger frame is refused from its header, before its payload is read.
        # max_queue=1: at most one frame waits behind the one being served (memory per connection).
        self._server = serve(self._handle, sock=sock, process_request=self.gate.process_request,
                             max_size=self.frame_limit, compression=None, max_queue=1,
                             open_timeout=cfg.handshake_timeout_s, close_timeout=_CLOSE_TIMEOUT_S,
                             logger=_WebsocketsLog(self))
        self._listener = Listener(sock, self._server.handler, max_connections=cap,
                                  handshake_timeout_s=cfg.handshake_timeout_s, count=self.counters.reject,
                                  noise=self._noise, tls=tls,
                                  read_budget=ReadBudget(max(1, cfg.max_unhandled_bytes // self.frame_limit),
                                                          _READ_ALLOWANCE)).start()
        if cfg.telemetry_period_s > 0:
            from lerobot_zenoh.telemetry.publisher import TelemetryPublisher

            door_id = f"{cfg.client_prefix}-door"
            self._telemetry = TelemetryPublisher(
                self._session, self.app.client(door_id).metrics, "client", door_id,
                lambda: (self.counters.snapshot() | {"connections": self._ids.in_use()}, {}),
                cfg.telemetry_period_s, labels={"role": "openpi_front_door"}).start()
        scheme = "wss" if tls else "ws"
        where = ("loopback only: other machines cannot connect (--host 0.0.0.0 to accept them)"
                 if cfg.host in LOOPBACK_HOSTS else "reachable from other machines")
        auth = "a token is required" if cfg.token else "no token required"
        log.info("OpenPI front door on %s://%s:%d for %s (%s; %s; frames up to %d bytes); health: /healthz", scheme,
                 cfg.host, self.port, self.app.prefix, where, auth, self.frame_limit)
        return self

    @property
    def port(self) -> int:
        return self._port

    def _metadata_map(self, status: Status) -> dict:
        """The first frame of every connection (openpi-client's `get_server_metadata()`)."""
        return {
            "server": "lerobot-zenoh OpenPI front door",
            "model_id": status.model_id, "model_version": status.model_version,
            "policy_type": status.policy_type, "action_dim": status.action_dim,
            "action_horizon": status.max_actions_per_chunk, "action_names": list(status.action_names),
            "state_dim": status.state_dim, "fps": status.fps,
            "cameras": {k: list(v) for k, v in status.expected_cameras.items()},
            "keys": {"images": dict(self.config.mapping.images), "state": self.config.mapping.state,
                     "prompt": self.config.mapping.prompt},
        }

    def unhealthy(self) -> list[str]:
        """Why a new client could not be served now (empty: it could): what /healthz answers."""
        return self.gate.unhealthy()

    # -- websocket ----------------------------------------------------------------------------

    def _websockets_noise(self, level: int) -> bool:
        """Called for each line websockets logs (from inside its `except` blocks): True when it is
        noise this door counts instead (a failed handshake, a peer gone), never a traceback."""
        if level < logging.WARNING:
            return False
        held = self._listener.held() if self._listener is not None else None
        exc = sys.exception()
        if held is not None and not held.established:
            held.failure = held.failure or _handshake_failure(exc)
            return True
        if isinstance(exc, (EOFError, OSError)):  # a peer gone mid-frame (websockets' reader thread)
            self.counters.reject("connection_reset")
            self._noise.note("connection_reset", f"a connection was lost ({type(exc).__name__}: {exc})",
                             logging.INFO)
            return True
        return False

    def _handle(self, connection) -> None:
        """One connection, after its handshake: every path out of here gives its client slot back."""
        from websockets.exceptions import ConnectionClosed

        cfg = self.config
        held = self._listener.held() if self._listener is not None else None
        if held is not None:
            held.established = True
        host = held.host if held is not None else "?"
        client_id = self._ids.take()
        if client_id is None:
            self.counters.reject("full")
            connection.close(1013, f"the front door serves {cfg.max_clients} clients at once; try again later")
            return
        link = None
        try:
            with self._connections_lock:
                self._connections.add(connection)
            self.counters.add("connections_opened")
            log.info("%s: connected from %s", client_id, host)
            link = RobotLink(self._session, self.app, client_id, jpeg_quality=cfg.jpeg_quality,
                             resend_after_s=cfg.resend_after_s, timeout_s=cfg.request_timeout_s,
                             control_period_s=1 / cfg.fps if cfg.fps else None, jpeg_pool=self._jpeg,
                             stop=self._closing)  # declared on the fleet at its first decoded request
            connection.send(self._metadata)
            prev_total_ms: float | None = None
            while True:
                try:
                    frame = connection.recv(timeout=cfg.idle_timeout_s)
                except TimeoutError:
                    self.counters.reject("idle_timeout")
                    connection.close(1000, f"no request for {cfg.idle_timeout_s:g} s")
                    return
                budgeted = getattr(connection.socket, "handled", None)
                size = len(frame)
                request = [frame]  # handed over: no reference left here once it is decoded
                del frame
                t0 = time.perf_counter()
                if self.gate.blocked(host):
                    # Refused unread, and the connection closed: a flood in cool-down would otherwise go
                    # on costing its bytes at line rate (reconnecting is refused with 429 meanwhile).
                    self.counters.reject(OpenPIReason.RATE_LIMITED)
                    connection.send(f"rate_limited: more than {cfg.max_rejections} refused requests in "
                                    f"{cfg.rejection_window_s:g} s; requests are refused for {cfg.cooldown_s:g} s")
                    connection.close(1008, "rate_limited")
                    return
                reply = self._serve_one(client_id, link, request, prev_total_ms, host,
                                        (lambda n=size: budgeted(n)) if budgeted is not None else None)
                connection.send(reply)
                if isinstance(reply, bytes):
                    prev_total_ms = (time.perf_counter() - t0) * 1000
        except ConnectionClosed as exc:
            if exc.sent is not None and exc.sent.code == 1009:
                self.counters.reject(OpenPIReason.TOO_LARGE)
                self.gate.on_rejection(host)
                self._noise.note("too_large", f"{client_id}: closed: a frame over {self.frame_limit} bytes")
        except (OSError, EOFError) as exc:  # the peer reset or vanished: noise, counted, one line a minute
            self.counters.reject("connection_reset")
            self._noise.note("connection_reset", f"{client_id}: connection from {host} lost ({type(exc).__name__})",
                             logging.INFO)
        except Exception as exc:  # the front door's own fault: this connection ends, the others go on
            self.counters.add("internal_errors")
            log.exception("%s: connection ended by an internal error: %s", client_id, exc)
            try:
                connection.close(1011, "internal error of the front door")
            except Exception:
                pass
        finally:
            if link is not None:
                link.close()
            with self._connections_lock:
                self._connections.discard(connection)
                self._connections_lock.notify_all()
            self._ids.give_back(client_id)
            self.counters.add("connections_closed")
            log.info("%s: disconnected", client_id)

    def _decode_frame(self, frame) -> tuple[np.ndarray, dict[str, np.ndarray], str]:
        """On a decode worker: bytes -> (state, cameras, task), or ProtocolError."""
        obs = unpack(frame, self.frame_limit, self.config.max_frame_items)
        return self.config.mapping.apply(obs, self.status)

    def _serve_one(self, client_id: str, link: RobotLink, request: list, prev_total_ms: float | None,
                   host: str, decoded: Callable[[], None] | None) -> bytes | str:
        """One request (`request`: a list holding the frame, emptied here) -> the reply frame: msgpack
        bytes, or a text frame saying what was wrong. `decoded()` once the frame is decoded or refused:
        its bytes are no longer the door's to hold (the read budget, `listener.py`)."""
        t0 = time.perf_counter()
        try:
            try:
                state, images, task = self._decode.submit(self._decode_frame, request.pop()).result()
            finally:
                if decoded is not None:
                    decoded()
            t_mapped = time.perf_counter()
            answer = link.infer(state, images, task)
        except ProtocolError as exc:
            self.counters.reject(exc.reason)
            if exc.reason not in _FLEET_FAULTS:  # the client's own mistakes feed its cool-down, an outage does not
                self.gate.on_rejection(host)
            return f"{exc}"
        chunk = answer.chunk
        t_reply = time.perf_counter()
        total_ms = (t_reply - t0) * 1000
        fleet_ms = answer.round_trip_ms
        added_ms = total_ms - fleet_ms
        timing = {"infer_ms": float(chunk.inference_time_ms), "queue_ms": float(chunk.queue_time_ms or 0.0),
                  "fleet_ms": fleet_ms, "decode_ms": (t_mapped - t0) * 1000, "encode_ms": answer.encode_ms,
                  "front_door_ms": added_ms}
        if prev_total_ms is not None:
            timing["prev_total_ms"] = prev_total_ms
        self.counters.answered(added_ms, answer.sends - 1)
        return pack({"actions": np.asarray(chunk.actions, dtype=np.float32), "server_timing": timing})

    # -- shutdown -----------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, close every connection (1001, going away), then leave the fleet."""
        self._closing.set()
        if self._listener is not None:
            self._listener.close(timeout_s)  # the listening socket and handshakes: connections stay open
        with self._connections_lock:
            open_now = list(self._connections)
        for connection in open_now:
            try:
                connection.close(1001, "the front door is closing")
            except Exception as exc:
                log.debug("closing a connection: %s", exc)
        with self._connections_lock:
            self._connections_lock.wait_for(lambda: not self._connections, timeout=timeout_s)
        if self._telemetry is not None:
            self._telemetry.close()
        self._jpeg.shutdown(wait=False)
        self._decode.shutdown(wait=False)
        if self._session is not None and self._own_session:
            self._session.close()

    def __enter__(self) -> FrontDoor:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()


class _WebsocketsLog(logging.LoggerAdapter):
    """websockets' logger for one door: its noise is counted by the door (`_websockets_noise`)."""

    def __init__(self, door: FrontDoor):
        super().__init__(_WEBSOCKETS_LOG, {})
        self._door = door

    def log(self, level, msg, *args, **kwargs) -> None:
        if not self._door._websockets_noise(level):
            super().log(level, msg, *args, **kwargs)


def _handshake_failure(exc: BaseException | None) -> str:
    """The counted kind of a failed websocket handshake (websockets logs it with a traceback)."""
    if isinstance(exc, TimeoutError):
        return "handshake_timeout"
    if exc is None or isinstance(exc, (EOFError, ConnectionError)) or isinstance(exc.__cause__, EOFError):
        return "handshake_closed"
    return "bad_handshake"


def _large_frees_return_to_the_os() -> None:
    """Fix glibc's mmap threshold at 1 MiB (process-wide). By default it rises to the largest block
    freed (up to 32 MiB), after which every 16 MiB frame buffer comes from per-thread heaps that
    keep it: a burst of large frames on many connections would leave the door hundreds of MB larger."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return
    if mallopt is not None:
        mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
