"""The robot client's link to the network: the one seam between its parts and Zenoh.

Every part of the client that touches the network does it through a :class:`ClientSession`, the
few calls below, and nothing else (as httpx's transports: one narrow interface, the real one behind
it in production, a wrapper or a small fake in a test). The real session is
``transport.session.ZenohSession``; :func:`open_session` opens it the way the client needs.

    publisher(key, qos)             -> an object with ``put(payload, attachment=None)``
    subscribe(key, handler)         handler(key, payload) on Zenoh's thread: hand over and return
    watch_liveliness(key, on_change) on_change(key, alive) when a token appears or vanishes
    declare_token(key)              this client's liveliness token
    query(key, timeout_s=, parameters=) -> [(key, payload), ...]   (status queries)
    close()                         undeclare everything, close the session
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from lerobot_zenoh.client.discovery import wait_connected
from lerobot_zenoh.errors import CompatibilityError, TlsRefusedError, TransportError
from lerobot_zenoh.transport.session import ZenohSession, tls_refusal
from lerobot_zenoh.transport.settings import QUICK_CONNECT_WAIT_S, ZenohSettings

__all__ = ["CONNECT_WAIT_S", "ClientSession", "open_session", "opening_wait_s"]

#: How long start-up waits for a Zenoh link to the endpoint before saying it cannot connect.
CONNECT_WAIT_S = QUICK_CONNECT_WAIT_S


class ClientSession(Protocol):
    """What the client's parts call on a session (see the module docstring)."""

    def publisher(self, key: str, qos): ...

    def subscribe(self, key: str, handler: Callable[[str, bytes], None]): ...

    def watch_liveliness(self, key: str, on_change: Callable[[str, bool], None]): ...

    def declare_token(self, key: str): ...

    def query(self, key: str, timeout_s: float = 1.0, parameters: str | None = None) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...


def opening_wait_s(settings: ZenohSettings, discovery_timeout_s: float) -> float:
    """How long a client-mode robot waits for its endpoint: CONNECT_WAIT_S unless
    --zenoh.connect_timeout_s was given (any value, 30 included), never past discovery_timeout_s."""
    return min(settings.connect_wait_s(CONNECT_WAIT_S), discovery_timeout_s)


def open_session(settings: ZenohSettings, discovery_timeout_s: float) -> ZenohSession:
    """Open the client's Zenoh session; CompatibilityError, in one line, when nothing answers at the endpoint."""
    endpoints = ", ".join(settings.connect)
    waits = settings.connect_timeout_s is not None  # the user asked to wait (a server that is still starting)
    if settings.effective_mode == "client":
        # Opening waits for an endpoint. A dead one is reported within CONNECT_WAIT_S unless
        # --zenoh.connect_timeout_s asks to wait longer (say, for a server that is still starting).
        settings = settings.replace(connect_timeout_s=opening_wait_s(settings, discovery_timeout_s))
    unreachable = (f"cannot connect to {endpoints}: nothing answers there (is the server or router running, and is "
                   "the address right?)")
    if settings.connect and not waits and all(_refused(e) for e in settings.connect):
        raise CompatibilityError(unreachable)  # at once: Zenoh would retry until its timeout
    try:
        session = ZenohSession(settings).open()
    except TransportError as exc:
        if not settings.connect:
            raise
        if isinstance(exc, TlsRefusedError):  # something answers, with a certificate we refuse (or it refuses ours)
            raise CompatibilityError(f"cannot connect to {endpoints}: {exc}") from exc
        raise CompatibilityError(unreachable) from exc
    if not wait_connected(session, settings.connect, timeout_s=CONNECT_WAIT_S):  # peer mode
        session.close()
        for endpoint in settings.connect if settings.tls_enabled else ():
            why = tls_refusal(settings, endpoint)
            if why is not None:  # a link that never came because a certificate was refused
                raise CompatibilityError(f"cannot connect to {endpoints}: {why}")
        raise CompatibilityError(unreachable)
    return session


def _refused(endpoint: str, timeout_s: float = 0.5) -> bool:
    """True when a TCP endpoint (tcp/ or tls/HOST:PORT) refuses a connection: nothing listens there.
    False for anything else (it answers, it is slow to answer, another protocol): Zenoh decides."""
    import re
    import socket

    m = re.match(r"^(?:tcp|tls)/(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:/\[\]]+)):(?P<port>\d+)$", endpoint.split("#")[0])
    if m is None:
        return False
    try:
        with socket.create_connection((m.group("v6") or m.group("host"), int(m.group("port"))), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # unreachable, timed out, a name that does not resolve: let Zenoh say
        return False
