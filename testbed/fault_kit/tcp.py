"""Faults on a TCP surface (an HTTP endpoint, a websocket server), run beside an honest client.

Every fault is a plain function of (host, port, ...) that runs until its count is spent or `stop`
is set, and returns what it did (a `Done`: sent, errors). `beside(honest, fault, ...)` runs the
honest client in a loop on a thread for as long as the fault runs (and `settle_s` after) and returns
its `Service`: how many calls were served, their p50/p99 in ms, and the errors by kind. The honest
client is any callable that raises when it was not served.

The websocket pieces speak just enough RFC 6455 to reach each stage of a handshake and to send
frames no well-behaved client would (a minimal, masked client; `ws_handshake`, `ws_frame`).
Loopback only: every function refuses a host that is not a loopback address.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import resource
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

__all__ = ["STAGES", "Done", "Honest", "Service", "beside", "close_at_stage", "flood_frames", "http_flood",
           "hold_idle", "nested_frame", "nofile_limit", "oversized", "resets", "slowloris", "storm", "ws_frame",
           "ws_handshake"]

#: The stages at which `close_at_stage` gives up a websocket connection.
STAGES = ("tcp", "mid_upgrade", "after_upgrade", "after_metadata", "mid_frame")


# -- measuring the honest client --------------------------------------------------------------------


@dataclass
class Service:
    """What an honest client got while a fault ran."""

    served: int = 0
    errors: Counter = field(default_factory=Counter)
    latencies_ms: list = field(default_factory=list, repr=False)

    @property
    def p50_ms(self) -> float:
        return _percentile(self.latencies_ms, 50)

    @property
    def p99_ms(self) -> float:
        return _percentile(self.latencies_ms, 99)

    def line(self) -> str:
        errors = ", ".join(f"{k} {n}" for k, n in self.errors.most_common()) or "none"
        return f"served {self.served}, p50 {self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms, errors: {errors}"


def _percentile(values: list, q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Honest:
    """Calls `call()` in a loop on a thread (every `period_s` at most) until `stop()`; measures it."""

    def __init__(self, call: Callable[[], object], period_s: float = 0.0):
        self.call = call
        self.period_s = period_s
        self.service = Service()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="honest", daemon=True)

    def start(self) -> Honest:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.call()
            except Exception as exc:  # any failure to be served counts, by kind
                self.service.errors[type(exc).__name__] += 1
            else:
                self.service.served += 1
                self.service.latencies_ms.append((time.perf_counter() - t0) * 1000)
            self._stop.wait(max(0.0, self.period_s - (time.perf_counter() - t0)))

    def stop(self, timeout_s: float = 30.0) -> Service:
        self._stop.set()
        self._thread.join(timeout_s)
        return self.service


@dataclass
class Done:
    """What a fault did."""

    sent: int = 0  # connections opened, frames or requests sent
    errors: Counter = field(default_factory=Counter)  # its own failures (refused, reset, ...), by kind


def beside(honest: Callable[[], object], fault: Callable[[threading.Event], Done], seconds: float, *,
           period_s: float = 0.0, settle_s: float = 0.0) -> tuple[Service, Done]:
    """Run `fault(stop)` for `seconds` (it may end sooner) beside `honest` called in a loop."""
    stop = threading.Event()
    client = Honest(honest, period_s).start()
    out: list[Done] = []
    runner = threading.Thread(target=lambda: out.append(fault(stop)), name="fault", daemon=True)
    runner.start()
    runner.join(seconds)
    stop.set()
    runner.join(60)
    if settle_s:
        time.sleep(settle_s)
    return client.stop(), (out[0] if out else Done())


# -- sockets ----------------------------------------------------------------------------------------


def _loopback(host: str) -> str:
    if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        raise ValueError(f"the fault kit attacks loopback only, not {host}")
    return host


def _connect(host: str, port: int, timeout_s: float = 5.0, tls: ssl.SSLContext | None = None,
             source: str | None = None) -> socket.socket:
    """`source`: another loopback address to connect from (127.0.0.2, ...), so that a server keying
    its cool-down by address tells the attacker from the honest client on one host."""
    sock = socket.create_connection((_loopback(host), port), timeout=timeout_s,
                                    source_address=(_loopback(source), 0) if source else None)
    if tls is not None:
        sock = tls.wrap_socket(sock, server_hostname=host)
    return sock


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN (SO_LINGER on, 0 s)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def insecure_tls() -> ssl.SSLContext:
    """A client TLS context that trusts anything (the faults do not care who answers)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def storm(host: str, port: int, count: int, stop: threading.Event | None = None, *, reset: bool = False) -> Done:
    """`count` TCP connections opened and closed (or reset) as fast as they go."""
    done = Done()
    for _ in range(count):
        if stop is not None and stop.is_set():
            break
        try:
            sock = _connect(host, port)
        except OSError as exc:
            done.errors[type(exc).__name__] += 1
            continue
        done.sent += 1
        _reset(sock) if reset else sock.close()
    return done


def resets(host: str, port: int, count: int, stop: threading.Event | None = None) -> Done:
    """`count` TCP connections reset right after connect (a TLS listener must survive each)."""
    return storm(host, port, count, stop, reset=True)


def hold_idle(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections opened and left idle (close them yourself); fewer if refused."""
    held = []
    for _ in range(count):
        try:
            held.append(_connect(host, port))
        except OSError:
            break
    return held


def slowloris(host: str, port: int, connections: int, stop: threading.Event, *, byte_every_s: float = 1.0,
              payload: bytes = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-a: b\r\n" * 1000) -> Done:
    """`connections` sockets each sending `payload` one byte per `byte_every_s`, until `stop`."""
    done = Done()
    socks = hold_idle(host, port, connections)
    done.sent = len(socks)
    i = 0
    while socks and not stop.wait(byte_every_s):
        for sock in list(socks):
            try:
                sock.send(payload[i % len(payload):i % len(payload) + 1])
            except OSError as exc:
                done.errors[type(exc).__name__] += 1
                socks.remove(sock)
                sock.close()
        i += 1
    for sock in socks:
        sock.close()
    return done


def nofile_limit(limit: int) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child runs under an open-file limit of `limit`
    (as `prlimit --nofile=limit` would set it)."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


# -- HTTP -------------------------------------------------------------------------------------------


def http_get(host: str, port: int, path: str = "/", timeout_s: float = 5.0) -> tuple[int, bytes]:
    """One GET on a fresh connection -> (status, body)."""
    with _connect(host, port, timeout_s) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def http_flood(host: str, port: int, stop: threading.Event, *, path: str = "/", connections: int = 4,
               read: bool = False) -> Done:
    """GET requests at line rate on `connections` threads, each on a fresh connection; with
    `read=False` the answer is never read (the server's writes then wait on a full socket)."""
    done = Done()
    lock = threading.Lock()

    def one() -> None:
        while not stop.is_set():
            try:
                sock = _connect(host, port)
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                if read:
                    sock.recv(65536)
                _reset(sock)
                with lock:
                    done.sent += 1
            except OSError as exc:
                with lock:
                    done.errors[type(exc).__name__] += 1

    threads = [threading.Thread(target=one, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


# -- websocket --------------------------------------------------------------------------------------


def ws_frame(payload: bytes, opcode: int = 0x2, *, fin: bool = True, length: int | None = None) -> bytes:
    """A masked client frame; `length` may claim more than `payload` holds (a frame cut short)."""
    n = len(payload) if length is None else length
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack(">H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack(">Q", n)
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if len(payload) < 4096 else _mask(payload, mask)
    return head + mask + body


def _mask(payload: bytes, mask: bytes) -> bytes:
    import numpy as np

    data = np.frombuffer(payload, np.uint8)
    key = np.resize(np.frombuffer(mask, np.uint8), data.size)
    return (data ^ key).tobytes()


def upgrade_request(host: str, port: int, path: str = "/", headers: dict | None = None) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def ws_handshake(host: str, port: int, *, headers: dict | None = None, tls: ssl.SSLContext | None = None,
                 timeout_s: float = 5.0, source: str | None = None) -> tuple[socket.socket, int]:
    """A socket after the upgrade -> (socket, HTTP status); 101 when it is a websocket. The response
    is read a byte at a time up to its blank line: the server's first frame may follow it in the same
    segment, and it stays on the socket for `ws_read_frame` (read in blocks, it was lost, and
    waiting for it timed out now and then)."""
    sock = _connect(host, port, timeout_s, tls, source)
    sock.sendall(upgrade_request(host, port, headers=headers))
    data = b""
    while not data.endswith(b"\r\n\r\n") and len(data) < 65536:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return sock, status


def ws_read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """One server frame (unmasked) -> (opcode, payload)."""
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError("closed")
            out += chunk
        return out

    b0, b1 = exact(2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack(">H", exact(2))[0]
    elif n == 127:
        n = struct.unpack(">Q", exact(8))[0]
    return b0 & 0x0F, exact(n)


def close_at_stage(host: str, port: int, stage: str, count: int, stop: threading.Event | None = None, *,
                   headers: dict | None = None, tls: ssl.SSLContext | None = None, reset: bool = False) -> Done:
    """`count` websocket connections, each given up at `stage` (one of `STAGES`): `tcp` (connect,
    close), `mid_upgrade` (half the upgrade request), `after_upgrade` (the 101 read), `after_metadata`
    (the server's first frame read), `mid_frame` (a frame header and part of its payload)."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} is not one of {STAGES}")
    done = Done()
    for _ in range(count):
        if stop is not None and stop.is_set():
            break
        try:
            if stage == "tcp":
                sock = _connect(host, port)
            elif stage == "mid_upgrade":
                sock = _connect(host, port, tls=tls)
                request = upgrade_request(host, port, headers=headers)
                sock.sendall(request[:len(request) // 2])
            else:
                sock, status = ws_handshake(host, port, headers=headers, tls=tls)
                if status != 101:
                    done.errors[f"http_{status}"] += 1
                elif stage == "after_metadata":
                    ws_read_frame(sock)
                elif stage == "mid_frame":
                    sock.sendall(ws_frame(b"\x81\xa1x" + b"\0" * 100, length=4096))
            done.sent += 1
            _reset(sock) if reset else sock.close()
        except (OSError, EOFError) as exc:
            done.errors[type(exc).__name__] += 1
    return done


def oversized(host: str, port: int, count: int, stop: threading.Event | None = None, *, claim: int = 1 << 30,
              source: str | None = "127.0.0.2") -> Done:
    """`count` websocket connections, each sending the header of a frame claiming `claim` bytes and
    then whatever fits until the server closes it (a server must refuse by the header, unread)."""
    done = Done()
    for _ in range(count):
        if stop is not None and stop.is_set():
            break
        try:
            sock, status = ws_handshake(host, port, source=source)
            if status != 101:
                done.errors[f"http_{status}"] += 1
                sock.close()
                continue
            ws_read_frame(sock)
            sock.sendall(ws_frame(b"\0" * 65536, length=claim))
            sock.settimeout(5)
            while ws_read_frame(sock)[0] != 0x8:  # until the server's close frame (1009, message too big)
                pass
            done.sent += 1
            sock.close()
        except (OSError, EOFError) as exc:
            done.errors[type(exc).__name__] += 1
    return done


def nested_frame(nbytes: int, kind: str = "maps") -> bytes:
    """About `nbytes` of msgpack that costs far more than its bytes to decode: `maps` ({"k": {}, ...}
    in maps of 4,096), `lists` ([[], [], ...] in lists of 4,096), `deep` (maps nested 100 deep, repeated)."""
    if kind == "deep":
        one = msgpack.packb(_deep(100))
        return msgpack.packb({"x": [msgpack.unpackb(one)] * max(1, min(4096, nbytes // len(one)))})
    leaf = {} if kind == "maps" else []
    per = 4096
    inner = msgpack.packb([leaf] * per) if kind == "lists" else msgpack.packb({str(i): leaf for i in range(per)})
    outer_n = max(1, min(4096, nbytes // len(inner)))
    # The outer container is written by hand: packing it from Python objects would cost what it tests.
    if kind == "lists":
        head = b"\xdd" + struct.pack(">I", outer_n)
        return b"\x81\xa1x" + head + inner * outer_n
    head = b"\xdf" + struct.pack(">I", outer_n)
    return b"\x81\xa1x" + head + b"".join(msgpack.packb(f"k{i}") + inner for i in range(outer_n))


def _deep(depth: int) -> dict:
    node: dict = {}
    for _ in range(depth):
        node = {"a": node}
    return node


def flood_frames(host: str, port: int, frame: bytes, stop: threading.Event, *, connections: int = 1,
                 headers: dict | None = None, read_metadata: bool = True, tls: ssl.SSLContext | None = None,
                 reconnect: bool = True, source: str | None = "127.0.0.2") -> Done:
    """`frame` (a msgpack payload) sent as binary websocket frames at line rate on `connections`
    connections until `stop`; the server's replies are read and dropped on a thread of their own.
    A connection the server closes is opened again (`reconnect`). From `source` (127.0.0.2 unless
    told otherwise): an address of its own, as an attacker has."""
    done = Done()
    lock = threading.Lock()
    wire = ws_frame(frame)

    def drain(sock: socket.socket) -> None:
        try:
            while sock.recv(1 << 20):
                pass
        except OSError:
            pass

    def one() -> None:
        while not stop.is_set():
            try:
                sock, status = ws_handshake(host, port, headers=headers, tls=tls, source=source)
            except OSError as exc:
                with lock:
                    done.errors[type(exc).__name__] += 1
                if stop.wait(0.05) or not reconnect:
                    return
                continue
            if status != 101:
                with lock:
                    done.errors[f"http_{status}"] += 1
                sock.close()
                if stop.wait(0.05) or not reconnect:
                    return
                continue
            if read_metadata:
                try:
                    ws_read_frame(sock)
                except (OSError, EOFError):
                    pass
            threading.Thread(target=drain, args=(sock,), daemon=True).start()
            try:
                while not stop.is_set():
                    sock.sendall(wire)
                    with lock:
                        done.sent += 1
            except OSError as exc:
                with lock:
                    done.errors[type(exc).__name__] += 1
            finally:
                _reset(sock)
            if not reconnect:
                return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done
