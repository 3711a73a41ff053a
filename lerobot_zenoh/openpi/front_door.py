"""The OpenPI front door: openpi-client's websocket contract in front of the fleet's Zenoh protocol.

    connect      -> 401 without the token (when one is set), 503 when `max_clients` are connected;
                    otherwise the metadata map (msgpack) is the first frame, as OpenPI's server sends
    GET /healthz -> 200 "OK" (answered before any websocket handshake, never behind an inference)
    binary frame -> msgpack-numpy observation -> mapping -> RobotLink.infer (Zenoh) ->
                    {"actions": (n, action_dim) float32, "server_timing": {...}} as msgpack
    bad request  -> a text frame saying why (openpi-client raises RuntimeError with it); the
                    connection stays open and nothing reaches the fleet; counted as rejected.<reason>
    too large    -> the websocket closes with 1009 (message too big), counted as rejected.too_large

Each connection runs on its own thread (websockets' sync server), so a slow answer to one client
never delays another's frames or a health check. Rejections per connection feed the same cool-down
as the Zenoh path (`server/rate_limit.py`): past `max_rejections` in `rejection_window_s`, requests
are refused unread for `cooldown_s`.
"""

from __future__ import annotations

import hmac
import logging
import ssl
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import CompatibilityError, ConfigError, ProtocolError
from lerobot_zenoh.openpi.bridge import ClientIds, RobotLink
from lerobot_zenoh.openpi.mapping import KeyMapping
from lerobot_zenoh.openpi.wire import OpenPIReason, pack, unpack
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import APP_FIELDS, AppKey, validate_client_id
from lerobot_zenoh.protocol.messages import Status
from lerobot_zenoh.server.rate_limit import RejectionRateLimit
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)

__all__ = ["FrontDoor", "FrontDoorConfig", "LOOPBACK_HOSTS"]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
#: websockets' own log: every health check and refused handshake is an INFO line there; warnings only.
_WEBSOCKETS_LOG = logging.getLogger("lerobot_zenoh.openpi.websockets")
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
        self._limit = RejectionRateLimit(config.max_rejections, config.rejection_window_s, config.cooldown_s)
        self._limit_lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._telemetry = None
        self._jpeg = ThreadPoolExecutor(max_workers=4, thread_name_prefix="openpi:jpeg")
        self._metadata: bytes = b""
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
        if _WEBSOCKETS_LOG.level == logging.NOTSET:
            _WEBSOCKETS_LOG.setLevel(logging.WARNING)
        try:
            self._server = serve(self._handle, cfg.host, cfg.port, process_request=self._process_request,
                                 max_size=cfg.max_message_bytes, compression=None, ssl=tls,
                                 logger=_WEBSOCKETS_LOG)
        except OSError as exc:
            raise ConfigError("port", f"cannot listen on {cfg.host}:{cfg.port}: {exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="openpi:listen", daemon=True)
        self._thread.start()
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
        log.info("OpenPI front door on %s://%s:%d for %s (%s; %s); health: /healthz", scheme, cfg.host, self.port,
                 self.app.prefix, where, auth)
        return self

    @property
    def port(self) -> int:
        return self._server.socket.getsockname()[1] if self._server is not None else self.config.port

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

    # -- websocket ----------------------------------------------------------------------------

    def _process_request(self, connection, request):
        """Before the handshake: /healthz, the token, the connection cap (None: go on)."""
        if request.path.split("?")[0] == "/healthz":
            return connection.respond(HTTPStatus.OK, "OK\n")
        token = self.config.token
        if token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Api-Key {token}".encode()):
                self.counters.reject("unauthorized")
                return connection.respond(HTTPStatus.UNAUTHORIZED, "a valid api_key is required\n")
        if self._ids.in_use() >= self.config.max_clients:
            self.counters.reject("full")
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"the front door serves {self.config.max_clients} clients at once\n")
        return None

    def _handle(self, connection) -> None:
        from websockets.exceptions import ConnectionClosed

        cfg = self.config
        client_id = self._ids.take()
        if client_id is None:
            self.counters.reject("full")
            connection.close(1013, f"the front door serves {cfg.max_clients} clients at once; try again later")
            return
        link = RobotLink(self._session, self.app, client_id, jpeg_quality=cfg.jpeg_quality,
                         resend_after_s=cfg.resend_after_s, timeout_s=cfg.request_timeout_s,
                         control_period_s=1 / cfg.fps if cfg.fps else None, jpeg_pool=self._jpeg,
                         stop=self._closing)
        with self._connections_lock:
            self._connections.add(connection)
        self.counters.add("connections_opened")
        peer = connection.remote_address
        log.info("%s: connected from %s", client_id, peer)
        prev_total_ms: float | None = None
        try:
            link.open()
            connection.send(self._metadata)
            while True:
                frame = connection.recv()
                t0 = time.perf_counter()
                reply = self._serve_one(client_id, link, frame, prev_total_ms)
                connection.send(reply)
                if isinstance(reply, bytes):
                    prev_total_ms = (time.perf_counter() - t0) * 1000
        except ConnectionClosed as exc:
            if exc.sent is not None and exc.sent.code == 1009:
                self.counters.reject(OpenPIReason.TOO_LARGE)
                log.warning("%s: closed: a frame over %d bytes", client_id, cfg.max_message_bytes)
        except Exception as exc:  # the front door's own fault: this connection ends, the others go on
            self.counters.add("internal_errors")
            log.exception("%s: connection ended by an internal error: %s", client_id, exc)
            try:
                connection.close(1011, "internal error of the front door")
            except Exception:
                pass
        finally:
            link.close()
            with self._connections_lock:
                self._connections.discard(connection)
                self._connections_lock.notify_all()
            with self._limit_lock:
                self._limit.forget(client_id)
            self._ids.give_back(client_id)
            self.counters.add("connections_closed")
            log.info("%s: disconnected", client_id)

    def _serve_one(self, client_id: str, link: RobotLink, frame, prev_total_ms: float | None) -> bytes | str:
        """One request -> the reply frame: msgpack bytes, or a text frame saying what was wrong."""
        t0 = time.perf_counter()
        with self._limit_lock:
            blocked = self._limit.blocked(client_id, time.monotonic())
        if blocked:
            self.counters.reject(OpenPIReason.RATE_LIMITED)
            return (f"rate_limited: more than {self.config.max_rejections} refused requests in "
                    f"{self.config.rejection_window_s:g} s; requests are refused for {self.config.cooldown_s:g} s")
        try:
            obs = unpack(frame, self.config.max_message_bytes)
            state, images, task = self.config.mapping.apply(obs, self.status)
            t_mapped = time.perf_counter()
            answer = link.infer(state, images, task)
        except ProtocolError as exc:
            self.counters.reject(exc.reason)
            if exc.reason not in _FLEET_FAULTS:  # the client's own mistakes feed its cool-down, an outage does not
                with self._limit_lock:
                    self._limit.on_rejection(client_id, time.monotonic())
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
        if self._server is not None:
            self._server.shutdown()  # the listening socket only: websockets leaves connections open
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
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
        if self._session is not None and self._own_session:
            self._session.close()

    def __enter__(self) -> FrontDoor:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()
