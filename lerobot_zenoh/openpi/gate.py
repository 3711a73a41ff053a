"""What an OpenPI connection meets before its websocket handshake, and the door's health.

`Gate.process_request` answers `GET /healthz` (200 only while a new client can be served: a client
slot free, the listener accepting, a server of the model alive on Zenoh; 503 with the reasons),
refuses a missing or wrong token (401), a peer address in its rejection cool-down (429) and a door
whose client slots are all taken (503), and turns a header it cannot read into a counted 400, never
websockets' 500. The cool-down table (`blocked`, `on_rejection`) is keyed by the peer's address, so
reconnecting does not evade it, and bounded (`max_peers`, least recently refused forgotten first).
Imports nothing of the door's but its bridge's client ids and the listener it asks.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from lerobot_zenoh.openpi.wire import OpenPIReason
from lerobot_zenoh.server.session_table.rate_limit import RejectionRateLimit

if TYPE_CHECKING:
    from lerobot_zenoh.openpi.bridge import ClientIds
    from lerobot_zenoh.openpi.listener import Listener, NoiseLog


class Gate:
    def __init__(self, config: Any, counters: Any, ids: ClientIds, noise: NoiseLog,
                 listener: Callable[[], Listener | None], app: Callable[[], Any]):
        self.config = config
        self._counters = counters
        self._ids = ids
        self._noise = noise
        self._listener = listener
        self._app = app
        self._limit = RejectionRateLimit(config.max_rejections, config.rejection_window_s, config.cooldown_s)
        self._peers: OrderedDict[str, None] = OrderedDict()  # refused peers, least recent first
        self._limit_lock = threading.Lock()
        self._servers: set[str] = set()  # live server tokens of the model: the fleet is reachable
        self._servers_lock = threading.Lock()

    # -- health -------------------------------------------------------------------------------

    def on_server(self, key: str, alive: bool) -> None:
        """Zenoh callback (liveliness of the model's servers): a set, under its lock."""
        with self._servers_lock:
            (self._servers.add if alive else self._servers.discard)(key)

    def unhealthy(self) -> list[str]:
        """Why a new client could not be served now (empty: it could)."""
        why = []
        if self._ids.in_use() >= self.config.max_clients:
            why.append(f"all {self.config.max_clients} client slots are taken")
        listener = self._listener()
        if listener is None or (listening := listener.accepting()) is not None:
            why.append(listening if listener is not None else "not started")
        with self._servers_lock:
            if not self._servers:
                app = self._app()
                why.append(f"no server of {app.prefix if app else 'the model'} is alive on Zenoh")
        return why

    # -- the cool-down by peer address ----------------------------------------------------------

    def blocked(self, host: str) -> bool:
        with self._limit_lock:
            return self._limit.blocked(host, time.monotonic())

    def on_rejection(self, host: str) -> None:
        with self._limit_lock:
            self._limit.on_rejection(host, time.monotonic())
            self._peers[host] = None
            self._peers.move_to_end(host)
            while len(self._peers) > self.config.max_peers:
                self._limit.forget(self._peers.popitem(last=False)[0])

    # -- before the handshake -------------------------------------------------------------------

    def process_request(self, connection, request):
        """websockets' `process_request`: a response that ends the connection, or None to go on to the
        handshake. Never raises: a header it cannot read is a counted 400."""
        listener = self._listener()
        held = listener.held() if listener is not None else None
        if held is not None:
            held.answered = True  # unless it goes on to the handshake (below)
        try:
            response = self._screen(connection, request, held.host if held is not None else "?")
        except Exception as exc:  # e.g. a header of bytes that are not text
            self._counters.reject("bad_header")
            self._noise.note("bad_header", f"a handshake with an unreadable request was refused (400): "
                                           f"{type(exc).__name__}", logging.INFO)
            response = connection.respond(HTTPStatus.BAD_REQUEST, "the request's headers could not be read\n")
        if response is None and held is not None:
            held.answered = False
        return response

    def _screen(self, connection, request, host: str):
        if request.path.split("?")[0] == "/healthz":
            why = self.unhealthy()
            if why:
                return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "unavailable: " + "; ".join(why) + "\n")
            return connection.respond(HTTPStatus.OK, "OK\n")
        token = self.config.token
        if token is not None:
            given = request.headers.get("Authorization", "")
            # websockets keeps bytes that are not ASCII as surrogates: they compare unequal, never raise.
            if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Api-Key {token}".encode()):
                self._counters.reject("unauthorized")
                return connection.respond(HTTPStatus.UNAUTHORIZED, "a valid api_key is required\n")
        if self.blocked(host):
            self._counters.reject(OpenPIReason.RATE_LIMITED)
            return connection.respond(HTTPStatus.TOO_MANY_REQUESTS,
                                      f"rate_limited: too many refused requests from {host}; retry in "
                                      f"{self.config.cooldown_s:g} s\n")
        if self._ids.in_use() >= self.config.max_clients:
            self._counters.reject("full")
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"the front door serves {self.config.max_clients} clients at once\n")
        return None
