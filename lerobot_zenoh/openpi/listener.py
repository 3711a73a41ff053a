"""The front door's listening socket: it accepts for as long as the door is open, whatever accept() says.

websockets' `Server.serve_forever()` leaves its loop on the first ``OSError`` from ``accept()`` (an
open-file limit reached, a peer that reset before its TLS socket could be wrapped) and nothing
restarts it. This loop instead counts the error (``rejected.accept_<errno>``), logs one line per
kind per minute, backs off when the error is a shortage (EMFILE, ENFILE, ENOBUFS, ENOMEM: 10 ms,
doubling to 1 s, until an accept succeeds) and goes on.

It also bounds what it holds. At most `max_connections` sockets are open at once (by default
derived from ``RLIMIT_NOFILE``, so the door never reaches its own open-file limit); at the cap a
new connection takes the place of the oldest one still in its handshake (``rejected.evicted``: a
slowloris of half-opened connections holds no door shut), and is closed at once when every held
socket is an established client (``rejected.connection_cap``). The TLS handshake runs on the
connection's own thread under the handshake deadline, never inside ``accept()``.

What the door has received but not yet handled is bounded too (`ReadBudget`): every socket is
handed to the websocket code wrapped (`BudgetedSocket`), and only `readers` connections at a time
may hold more than `allowance` bytes not yet handled; the others stop reading until a place is
free. Large frames then wait in their senders' TCP windows, not in the door's memory: many
connections sending 16 MiB frames at line rate cost a few frames per place, and a client whose
requests are small (under the allowance) never waits.

A connection that has ended still holds its last frames: websockets' connection, protocol and
parser refer to each other (a generator, stored exceptions and their tracebacks), so what they hold
(the frames queued, the last frame parsed, the read buffer) is freed only by Python's cyclic
garbage collector, whose full passes are rare in a process that allocates few objects. A door whose
attackers reconnect after each refusal kept dozens of dead connections' 16 MiB frames (hundreds of
MB) this way. So when a connection that held more than the allowance ends, the budget's collector
thread runs a full collection (at most one every `collect_every_s`, a few ms; never on the
thread of a connection).

`Listener.held()` gives the connection's own record to code running on its thread (the door's
handshake and connection handlers): its peer address as accept() returned it (no system call on a
socket that may be gone) and what became of its handshake, so that every connection that ends
before it is established is counted once, by kind, and never logs a traceback.
"""

from __future__ import annotations

import errno
import gc
import logging
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["BudgetedSocket", "Held", "Listener", "NoiseLog", "ReadBudget", "connection_cap"]

#: accept() errors that mean "out of something": wait before the next try, or the loop spins.
_SHORTAGES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.01, 1.0


def connection_cap(configured: int | None) -> int:
    """The most sockets the door holds: `configured`, never above the open-file limit less a reserve
    (a quarter of it, at least 64: the Zenoh session, logs, the process's own files)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    derived = soft - max(64, soft // 4)
    return max(1, min(configured, derived) if configured else derived)


class NoiseLog:
    """One log line per kind per `period_s` (with how many were not logged), for noise a peer
    can make at line rate: resets, refused handshakes, accept errors."""

    def __init__(self, logger: logging.Logger, period_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self._period_s = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (time logged, not logged since)

    def note(self, kind: str, message: str, level: int = logging.WARNING) -> None:
        now = self._clock()
        with self._lock:
            logged_s, quiet = self._last.get(kind, (float("-inf"), 0))
            if now - logged_s < self._period_s:
                self._last[kind] = (logged_s, quiet + 1)
                return
            self._last[kind] = (now, 0)
        more = f" ({quiet} more since the last such line)" if quiet else ""
        self._log.log(level, "%s%s; logged at most once a minute", message, more)


class ReadBudget:
    """How many connections may hold more than `allowance` unhandled bytes at once (`readers`), and
    the collector of the garbage that ended large connections leave (`ended_large`)."""

    def __init__(self, readers: int, allowance: int, collect_every_s: float = 0.5):
        self.readers = readers
        self.allowance = allowance
        self.free = readers
        self.cond = threading.Condition()
        self.collections = 0
        self._collect_every_s = collect_every_s
        self._ended = threading.Event()
        self._collector: threading.Thread | None = None
        self._collector_lock = threading.Lock()
        self._closed = False

    def ended_large(self) -> None:
        """A connection that held more than the allowance has ended (and its thread dropped it):
        collect its garbage soon, on the collector's thread."""
        with self._collector_lock:
            if self._collector is None and not self._closed:
                self._collector = threading.Thread(target=self._collect, name="openpi:collect", daemon=True)
                self._collector.start()
        self._ended.set()

    def _collect(self) -> None:
        while True:
            self._ended.wait()
            self._ended.clear()
            if self._closed:
                return
            gc.collect()
            self.collections += 1
            time.sleep(self._collect_every_s)

    def close(self) -> None:
        """End the collector's thread."""
        with self._collector_lock:
            self._closed = True
        self._ended.set()


class BudgetedSocket:
    """A connected socket whose `recv` waits, once its connection holds more than the allowance of
    bytes not yet handled, for one of the budget's reader places; the place is given back when the
    connection's frames have been handled (`handled(n)`). Everything else is the socket's own.

    A connection in a place never waits here, so its frame completes, is handled and frees the
    place: no connection can hold a place while waiting for another's.

    Once the door has finished sending (websockets shuts the socket for writing after its close
    frame, in a close handshake or on refusing a frame over the size limit), `recv` reads at most
    `_AFTER_EOF` bytes more (room for the peer's close frame) and then reports the end: the
    connection ends at once instead of reading and discarding what the peer goes on sending (a
    frame claiming 16 MiB) for the close time-out."""

    #: Bytes of websocket framing (headers, control frames) forgiven per handled frame.
    _FRAMING = 64
    #: Bytes read after the door's EOF before the connection counts as ended.
    _AFTER_EOF = 64 << 10

    def __init__(self, sock: socket.socket, budget: ReadBudget):
        self._sock = sock
        self._budget = budget
        self._lock = threading.Lock()  # _held: added to by the reader thread, taken from by the handler's
        self._held = 0
        self._placed = False
        self._closed = False
        self.was_large = False  # it held more than the allowance at some time
        self._done_sending = False
        self._after_eof = 0  # bytes read since

    def recv(self, bufsize: int) -> bytes:
        if self._done_sending:
            if self._after_eof >= self._AFTER_EOF:
                return b""
            data = self._sock.recv(min(bufsize, self._AFTER_EOF - self._after_eof))
            self._after_eof += len(data)
            return data
        b = self._budget
        if self._held > b.allowance and not self._placed:
            with b.cond:
                while b.free == 0 and not self._closed and not self._done_sending and not self._peer_gone():
                    b.cond.wait(0.25)
                if b.free > 0 and not self._closed:
                    b.free -= 1
                    self._placed = True
            self.was_large = True
        data = self._sock.recv(bufsize)
        with self._lock:
            self._held += len(data)
        return data

    def _peer_gone(self) -> bool:
        """Whether the peer closed or reset (then reading goes on: it ends the connection at once)."""
        try:
            return socket.socket.recv(self._sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def handled(self, nbytes: int) -> None:
        with self._lock:
            self._held = max(0, self._held - nbytes - self._FRAMING)
            done = self._held <= self._budget.allowance
        if self._placed and done:
            self._give_back()

    def _give_back(self) -> None:
        with self._budget.cond:
            if self._placed:
                self._placed = False
                self._budget.free += 1
                self._budget.cond.notify()

    def shutdown(self, how: int) -> None:
        if how in (socket.SHUT_WR, socket.SHUT_RDWR):
            self._done_sending = True
        self._sock.shutdown(how)

    def close(self) -> None:
        self._closed = True
        self._give_back()
        self._sock.close()

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


@dataclass
class Held:
    """One accepted socket, from accept() to its close."""

    sock: socket.socket
    peer: tuple
    accepted_s: float
    established: bool = False  # the websocket handshake completed: a client of the door
    answered: bool = False  # the handshake was answered with an HTTP response (health, 401, 503, ...)
    failure: str | None = None  # why its handshake failed, when known
    evicted: bool = False
    thread: int = field(default=0)

    @property
    def host(self) -> str:
        return str(self.peer[0]) if self.peer else "?"


class Listener:
    """`run()` (a thread) accepts on `sock` and serves each connection with `handler(sock, peer)` on
    a thread of its own; `close()` stops it and shuts every socket still in its handshake."""

    def __init__(self, sock: socket.socket, handler: Callable[[socket.socket, tuple], None], *,
                 max_connections: int, handshake_timeout_s: float, count: Callable[[str], None],
                 noise: NoiseLog, tls: ssl.SSLContext | None = None, read_budget: ReadBudget | None = None):
        self.sock = sock
        self.read_budget = read_budget
        self.max_connections = max_connections
        self._handler = handler
        self._handshake_timeout_s = handshake_timeout_s
        self._count = count
        self._noise = noise
        self._tls = tls
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}  # by the thread serving it
        self._stop = threading.Event()
        self._backoff_until_s = 0.0
        self._thread: threading.Thread | None = None

    # -- the state others read --------------------------------------------------------------

    def held(self) -> Held | None:
        """The record of the connection this thread serves (None on any other thread)."""
        with self._lock:
            return self._held.get(threading.get_ident())

    def open_sockets(self) -> int:
        with self._lock:
            return len(self._held)

    def accepting(self) -> str | None:
        """None while a new connection can be accepted and served; otherwise why not."""
        if self._thread is None or not self._thread.is_alive():
            return "the listener is not running"
        if time.monotonic() < self._backoff_until_s:
            return "accept() is failing (out of file descriptors or memory); backing off"
        with self._lock:
            if len(self._held) >= self.max_connections and all(h.established for h in self._held.values()):
                return f"{self.max_connections} connections are open (the connection cap)"
        return None

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> Listener:
        self.sock.setblocking(False)  # a peer gone between select() and accept() must not block the loop
        self._thread = threading.Thread(target=self.run, name="openpi:listen", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        backoff_s = 0.0
        with selectors.DefaultSelector() as poller:
            poller.register(self.sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not poller.select(timeout=0.25):
                    continue
                try:
                    conn, peer = self.sock.accept()
                except BlockingIOError:
                    continue  # another wake-up took it (or the peer left first)
                except OSError as exc:
                    if self._stop.is_set():
                        break
                    kind = f"accept_{errno.errorcode.get(exc.errno, 'error').lower()}"
                    self._count(kind)
                    if exc.errno in _SHORTAGES:
                        backoff_s = min(max(backoff_s * 2, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)
                        self._backoff_until_s = time.monotonic() + backoff_s
                        self._evict_oldest()  # free a descriptor for the clients that finish their handshake
                        self._noise.note(kind, f"accept() failed ({exc}); backing off {backoff_s * 1000:.0f} ms "
                                               "and going on")
                        self._stop.wait(backoff_s)
                    else:
                        self._noise.note(kind, f"accept() failed ({exc}); going on")
                    continue
                backoff_s = 0.0
                self._backoff_until_s = 0.0
                conn.setblocking(True)
                self._admit(conn, peer)

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        with self._lock:
            full = len(self._held) >= self.max_connections
        if full and not self._evict_oldest():
            self._count("connection_cap")
            self._noise.note("connection_cap", f"{self.max_connections} connections open, all established: "
                                               f"a new one from {peer[0] if peer else '?'} closed")
            _close(conn)
            return
        held = Held(conn, peer, time.monotonic())
        try:
            threading.Thread(target=self._serve, args=(held,), name="openpi:conn", daemon=True).start()
        except RuntimeError as exc:  # can't start new thread: out of memory for stacks
            self._count("no_thread")
            self._noise.note("no_thread", f"cannot start a connection thread ({exc}); connection closed")
            _close(conn)

    def _evict_oldest(self) -> bool:
        """Shut the oldest socket still in its handshake (its thread then ends it); False if none."""
        with self._lock:
            waiting = [h for h in self._held.values() if not h.established and not h.evicted]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda h: h.accepted_s)
            oldest.evicted = True
        self._count("evicted")
        self._noise.note("evicted", "connection cap reached: the oldest connection still in its handshake was closed",
                         logging.INFO)
        try:
            socket.socket.shutdown(oldest.sock, socket.SHUT_RDWR)  # the plain socket's: SSLSocket's drops its state
        except OSError:
            pass
        return True

    def _serve(self, held: Held) -> None:
        held.thread = threading.get_ident()
        with self._lock:
            self._held[held.thread] = held
        sock = held.sock
        budgeted = None
        try:
            if self._tls is not None:
                sock.settimeout(self._handshake_timeout_s)
                sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                with self._lock:
                    held.sock = sock
                sock.do_handshake()
                sock.settimeout(None)
            budgeted = None if self.read_budget is None else BudgetedSocket(sock, self.read_budget)
            self._handler(sock if budgeted is None else budgeted, held.peer)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: resets, timeouts, bad handshakes
            held.failure = held.failure or ("tls_failed" if isinstance(exc, ssl.SSLError) else
                                            "handshake_timeout" if isinstance(exc, TimeoutError) else
                                            "handshake_closed")
        finally:
            _close(sock)
            with self._lock:
                self._held.pop(held.thread, None)
            if budgeted is not None and budgeted.was_large:
                budgeted = None  # the last reference this thread holds to the connection's objects
                self.read_budget.ended_large()
            if not held.established and not held.answered:
                reason = "evicted_in_handshake" if held.evicted else held.failure or "handshake_closed"
                if reason != "evicted_in_handshake":  # counted once, as `evicted`, when it was pushed out
                    self._count(reason)
                self._noise.note(reason, f"a connection from {held.host} ended before its websocket handshake "
                                         f"({reason})", logging.INFO)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        _close(self.sock)
        if self.read_budget is not None:
            self.read_budget.close()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        with self._lock:
            waiting = [h.sock for h in self._held.values() if not h.established]
        for sock in waiting:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
