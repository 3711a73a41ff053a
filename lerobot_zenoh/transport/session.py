"""The one module that talks to Zenoh: session, publishers with explicit QoS, subscriptions,
the status queryable, queries and liveliness. Zenoh's errors become `TransportError`.

Callbacks given to `subscribe` and `watch_liveliness` run on Zenoh's threads: they must only
hand data over (to a lock-protected slot or a queue) and return. An exception raised by one is
counted on its `Subscription` and logged (rate-limited); the next sample is delivered as usual.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zenoh

from lerobot_zenoh.errors import ConfigError, TlsRefusedError, TransportError
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QoS:
    reliable: bool
    block_when_congested: bool
    priority: zenoh.Priority
    express: bool
    #: 0: `put` calls Zenoh on the caller's thread. N > 0: `put` never waits on the network; the
    #: message waits in this publisher's queue of N (when full, the oldest is dropped and counted)
    #: and the publisher's own thread hands it to Zenoh.
    queue_depth: int = 0


#: Observations: a newer one replaces a lost one, never wait for the network (docs/protocol.md §3).
OBSERVATION_QOS = QoS(reliable=False, block_when_congested=False, priority=zenoh.Priority.DATA, express=True)
#: Action chunks: reliable on the link, but never waited for (congestion control DROP). A robot whose
#: link stalls must not hold up the thread that serves every robot, nor a router that forwards to
#: everyone (BLOCK did both, by up to 5 s: tests/test_faults.py, docs/reliability.md); a chunk its
#: link cannot take now is stale by the time it could. Each client's chunks also go through their own
#: bounded queue and thread, so the caller never waits on Zenoh at all (with DROP the queue only
#: fills when that thread gets no CPU: a burst of 32 to one client is kept). Zenoh drops silently;
#: the client counts what never came back (`requests_unanswered` in its telemetry).
ACTION_QOS = QoS(reliable=True, block_when_congested=False, priority=zenoh.Priority.INTERACTIVE_HIGH, express=True,
                 queue_depth=32)
#: Telemetry: useful, never worth delaying anything else for.
METRICS_QOS = QoS(reliable=False, block_when_congested=False, priority=zenoh.Priority.DATA_LOW, express=False)

class Publisher:
    """A declared publisher with fixed QoS. `put` never raises zenoh errors, only TransportError.

    Counters (read them from any thread): `sent` (handed to Zenoh; with congestion control DROP, Zenoh
    may still drop it on a congested link, silently), `dropped` (never handed to Zenoh: the
    publisher's queue was full; only with `QoS.queue_depth`), `errors` (Zenoh refused the put;
    queued publishers only, a direct `put` raises instead), `withheld` (its `valid` said no when
    it was about to be handed to Zenoh).
    """

    def __init__(self, publisher: zenoh.Publisher, key: str):
        self._publisher = publisher
        self.key = key
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self.withheld = 0

    def put(self, payload: bytes, attachment: bytes | None = None, *, valid: Callable[[], bool] | None = None) -> None:
        """Publish `payload`; `attachment`: bytes carried beside it (Zenoh attachment), e.g. an
        observation's header (docs/protocol.md §5.1.1). `valid`: asked just before the bytes are
        handed to Zenoh (on the sending thread of a queued publisher); False withholds them (an
        answer gone stale while it waited, e.g. a server woken from a freeze)."""
        if valid is not None and not valid():
            self.withheld += 1
            return
        self._send(payload, attachment)

    def _send(self, payload: bytes, attachment: bytes | None = None) -> None:
        try:
            self._publisher.put(payload, attachment=attachment)
        except zenoh.ZError as exc:
            raise TransportError(f"put on {self.key} failed: {exc}") from exc
        self.sent += 1

    @property
    def pending(self) -> int:
        return 0

    def close(self) -> None:
        try:
            self._publisher.undeclare()
        except zenoh.ZError:
            pass


class QueuedPublisher(Publisher):
    """A publisher whose `put` only queues (bounded, oldest dropped) for its own sending thread.

    A slow or stalled link then costs the caller nothing: its messages wait here, the oldest are
    dropped (counted in `dropped`), and the other keys' publishers are untouched.
    """

    def __init__(self, publisher: zenoh.Publisher, key: str, depth: int):
        super().__init__(publisher, key)
        self._queue: collections.deque[tuple[bytes, bytes | None, Callable[[], bool] | None]] = collections.deque()
        self._depth = depth
        self._ready = threading.Condition()
        self._closed = False
        self._last_log_s = 0.0
        self._thread = threading.Thread(target=self._run, name=f"publisher:{key}", daemon=True)
        self._thread.start()

    def put(self, payload: bytes, attachment: bytes | None = None, *, valid: Callable[[], bool] | None = None) -> None:
        with self._ready:
            if self._closed:
                raise TransportError(f"put on {self.key}: the publisher is closed")
            if len(self._queue) >= self._depth:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((payload, attachment, valid))
            self._ready.notify()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:  # closed and drained
                    return
                payload, attachment, valid = self._queue.popleft()
            if valid is not None and not valid():
                self.withheld += 1
                continue
            try:
                self._send(payload, attachment)
            except TransportError as exc:
                self.errors += 1
                now = time.monotonic()
                if now - self._last_log_s > 5.0:
                    self._last_log_s = now
                    log.warning("%s (%d so far)", exc, self.errors)

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout=2.0)
        if self.dropped or self.errors:
            log.info("%s: sent %d, dropped %d (queue full), errors %d", self.key, self.sent, self.dropped, self.errors)
        super().close()


class Subscription:
    """A subscriber whose handler's failures are counted, not propagated."""

    def __init__(self, key: str, handler: Callable, unpack: Callable[[zenoh.Sample], tuple]):
        self.key = key
        self._handler = handler
        self._unpack = unpack
        self.received = 0
        self.handler_errors = 0
        self._last_log_s = 0.0
        self._subscriber: zenoh.Subscriber | None = None

    def _on_sample(self, sample: zenoh.Sample) -> None:
        self.received += 1
        try:
            self._handler(*self._unpack(sample))
        except Exception as exc:  # a bad message must never stop the next one
            self.handler_errors += 1
            now = time.monotonic()
            if now - self._last_log_s > 5.0:
                self._last_log_s = now
                log.warning("handler for %s failed (%d so far): %s", self.key, self.handler_errors, exc)

    def close(self) -> None:
        if self._subscriber is not None:
            try:
                self._subscriber.undeclare()
            except zenoh.ZError:
                pass
            self._subscriber = None


class ChannelSubscription:
    """A subscriber whose samples wait in a bounded Zenoh FIFO channel, taken by a thread of the
    owner's with `recv`. Zenoh's threads push into the channel without taking Python's lock, and
    a full channel holds the link back (congestion control applies upstream) instead of growing:
    what it holds is bounded by `capacity` times the session's `max_message_bytes`. (A Python
    callback, by contrast, waits for the lock while the owner's threads run Python, and Zenoh keeps
    what arrives meanwhile.)"""

    def __init__(self, key: str, subscriber: zenoh.Subscriber):
        self.key = key
        self._subscriber: zenoh.Subscriber | None = subscriber
        # The channel's receiving end, apart from the subscriber: a thread blocked in its recv does
        # not hold the subscriber, which `close` undeclares from another thread.
        self._receiver = subscriber.handler

    def recv(self) -> tuple[str, Payload] | None:
        """The next (key, payload), waiting for it; None once the subscription or its session closed."""
        try:
            sample = self._receiver.recv()
        except zenoh.ZError:
            return None
        return str(sample.key_expr), Payload(sample.payload)

    def close(self) -> None:
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is not None:
            try:
                subscriber.undeclare()
            except zenoh.ZError:
                pass


class Responder:
    """Answers queries on one key with bytes from `make_reply` (None: no answer), on a thread of its own.

    The Zenoh callback only puts each query in a bounded queue (no Zenoh call inside a Zenoh
    callback); the thread blocks on that queue, so an idle responder costs nothing.
    """

    def __init__(self, key: str, make_reply: Callable[..., bytes | None], capacity: int = 64, *,
                 with_parameters: bool = False):
        self.key = key
        self._make_reply = make_reply
        self._with_parameters = with_parameters  # make_reply(parameters: dict[str, str]) instead of make_reply()
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._queryable: zenoh.Queryable | None = None
        self.answered = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"responder:{key}", daemon=True)

    def _on_query(self, query: zenoh.Query) -> None:
        try:
            self._queue.put_nowait(query)
        except queue.Full:  # a query flood: the asker times out, nothing else is delayed
            self.dropped += 1

    def _run(self) -> None:
        while (query := self._queue.get()) is not None:
            try:
                if self._with_parameters:
                    try:
                        parameters = dict(query.parameters)
                    except Exception:  # noqa: BLE001 - malformed parameters from a remote party: ignore them
                        parameters = {}
                    reply = self._make_reply(parameters)
                else:
                    reply = self._make_reply()
                if reply is not None:  # None: stay silent (e.g. a standby that is not serving)
                    query.reply(self.key, reply)
                    self.answered += 1
            except Exception as exc:
                log.warning("could not answer query on %s: %s", self.key, exc)
            finally:
                query.drop()

    def close(self) -> None:
        if self._queryable is not None:
            try:
                self._queryable.undeclare()
            except zenoh.ZError:
                pass
            self._queryable = None
        while True:  # make room for the stop sentinel even if the queue is full
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:
                try:
                    self._queue.get_nowait().drop()
                except (queue.Empty, AttributeError):
                    pass
        self._thread.join(timeout=2.0)


def memory_lock_available() -> bool:
    """Whether this process may lock memory without limit (CAP_IPC_LOCK, or an unlimited
    RLIMIT_MEMLOCK). Zenoh's shared memory needs it: eclipse-zenoh 1.10 delivers the first shared-
    memory message of a same-host peer to a process without it and then silently loses the rest."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return True
    try:
        with open("/proc/self/status") as status:
            cap_eff = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(cap_eff & (1 << 14))  # CAP_IPC_LOCK


class ZenohSession:
    """Owns one zenoh.Session. Construct with settings (no I/O), then `open()` or use `with`.

    `shared_memory_fallback` is True when `settings.shared_memory` asked for shared memory and this
    process cannot lock memory (`memory_lock_available`): the session then runs without it (a
    warning says so) rather than lose messages silently.
    """

    def __init__(self, settings: ZenohSettings, config_file: str | None = None):
        """`config_file`: a complete Zenoh JSON5 config to start from instead of the typed
        settings (e.g. a router file written by lerobot-zenoh-secure); then only
        `settings.json5_overrides` apply on top of it."""
        self.settings = settings
        self.config_file = config_file
        self._session: zenoh.Session | None = None
        self._closed = False
        self._owned: list = []
        self.shared_memory_fallback = False
        self.effective_settings = settings  # what the session was opened with (after the fallback)

    # -- lifetime -----------------------------------------------------------------------------

    def open(self) -> ZenohSession:
        if self._closed:
            raise TransportError("this session was closed; create a new ZenohSession")
        if self._session is None:
            config = self._config()
            try:
                self._session = zenoh.open(config)
            except zenoh.ZError as exc:
                for endpoint in self.settings.connect if self.settings.tls_enabled else ():
                    why = tls_refusal(self.settings, endpoint)
                    if why is not None:  # something answers there, but not with a certificate we accept
                        raise TlsRefusedError(why) from exc
                raise TransportError(f"could not open a Zenoh session ({self.settings.effective_mode}, "
                                     f"listen={self.settings.listen}, connect={self.settings.connect}): {exc}") from exc
        return self

    def _config(self) -> zenoh.Config:
        if self.config_file is None:
            settings = self.settings
            if settings.shared_memory and not memory_lock_available():
                log.warning("zenoh.shared_memory is on but this process cannot lock memory (no CAP_IPC_LOCK, "
                            "RLIMIT_MEMLOCK not unlimited): Zenoh would lose same-host messages silently; "
                            "running without shared memory (docs/security.md)")
                self.shared_memory_fallback = True
                settings = settings.replace(shared_memory=False)
            self.effective_settings = settings
            return settings.to_zenoh_config()
        try:
            config = zenoh.Config.from_file(self.config_file)
        except Exception as exc:  # zenoh.ZError, or a file that is not JSON5
            raise ConfigError("config_file", f"{self.config_file}: {exc}") from exc
        for path, literal in self.settings.json5_overrides.items():
            try:
                config.insert_json5(path, literal)
            except Exception as exc:
                raise ConfigError(f"zenoh.{path}", f"Zenoh rejected {literal[:200]!r}: {exc}") from exc
        return config

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for entity in reversed(self._owned):
            try:
                entity.close() if hasattr(entity, "close") else entity.undeclare()
            except Exception:
                pass
        self._owned.clear()
        if self._session is not None:
            try:
                self._session.close()
            except zenoh.ZError:
                pass
            self._session = None

    def release(self, entity) -> None:
        """Undeclare one entity this session declared (publisher, subscription, token, responder) and
        forget it: for a long-lived session whose entities come and go with its users (the OpenPI front
        door declares three per websocket connection). Never raises."""
        try:
            self._owned.remove(entity)
        except ValueError:
            pass
        try:
            entity.close() if hasattr(entity, "close") else entity.undeclare()
        except Exception:
            pass

    def __enter__(self) -> ZenohSession:
        return self.open()

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def raw(self) -> zenoh.Session:
        if self._session is None:
            raise TransportError("session is not open")
        return self._session

    @property
    def zid(self) -> str:
        return str(self.raw.info.zid())

    # -- pub/sub ------------------------------------------------------------------------------

    def publisher(self, key: str, qos: QoS) -> Publisher:
        try:
            raw = self.raw.declare_publisher(
                key,
                congestion_control=zenoh.CongestionControl.BLOCK if qos.block_when_congested else zenoh.CongestionControl.DROP,
                priority=qos.priority,
                express=qos.express,
                reliability=zenoh.Reliability.RELIABLE if qos.reliable else zenoh.Reliability.BEST_EFFORT,
            )
        except zenoh.ZError as exc:
            raise TransportError(f"could not declare a publisher on {key}: {exc}") from exc
        pub = QueuedPublisher(raw, key, qos.queue_depth) if qos.queue_depth > 0 else Publisher(raw, key)
        self._owned.append(pub)
        return pub

    def subscribe(self, key: str, handler: Callable[..., None], *, with_attachment: bool = False,
                  copy: bool = True) -> Subscription:
        """`handler(key, payload)`, or `handler(key, payload, attachment)` (bytes or None) with `with_attachment`.

        `copy=False`: `payload` is a `Payload`, Zenoh's own buffer kept without copying; `bytes(payload)`
        copies it out once, when (and if) it is read, so a sample dropped or superseded unread is never
        copied."""
        sub = Subscription(key, handler, _UNPACKERS[(with_attachment, copy)])
        try:
            sub._subscriber = self.raw.declare_subscriber(key, sub._on_sample)
        except zenoh.ZError as exc:
            raise TransportError(f"could not subscribe to {key}: {exc}") from exc
        self._owned.append(sub)
        return sub

    def subscribe_channel(self, key: str, capacity: int) -> ChannelSubscription:
        """Samples of `key` in a bounded FIFO channel of `capacity` (see ChannelSubscription)."""
        try:
            sub = ChannelSubscription(key, self.raw.declare_subscriber(key, zenoh.handlers.FifoChannel(capacity)))
        except zenoh.ZError as exc:
            raise TransportError(f"could not subscribe to {key}: {exc}") from exc
        self._owned.append(sub)
        return sub

    # -- queries ------------------------------------------------------------------------------

    def serve(self, key: str, make_reply: Callable[..., bytes | None], *, with_parameters: bool = False) -> Responder:
        """Answer queries on `key`; `with_parameters`: `make_reply` gets the selector parameters as a dict."""
        responder = Responder(key, make_reply, with_parameters=with_parameters)
        try:
            responder._queryable = self.raw.declare_queryable(key, responder._on_query, complete=True)
        except zenoh.ZError as exc:
            raise TransportError(f"could not declare a queryable on {key}: {exc}") from exc
        responder._thread.start()
        self._owned.append(responder)
        return responder

    def query(self, key: str, timeout_s: float = 1.0, parameters: str | None = None) -> list[tuple[str, bytes]]:
        """All successful replies to a `get` on `key` within `timeout_s`, as (key, payload).

        `parameters`: selector parameters, e.g. ``"client=robot_1"`` (the queryable reads them).
        """
        try:
            # ALL, not BEST_MATCHING: with a hot standby two servers hold the status queryable and
            # only the serving one answers; zenoh must not pick the silent one for us. Consolidation
            # NONE: replies on one key are otherwise merged to one (Zenoh's default for a plain
            # selector), so any other peer's reply on the key could hide the server's.
            selector = zenoh.Selector(key, parameters) if parameters else key
            replies = self.raw.get(selector, target=zenoh.QueryTarget.ALL, consolidation=zenoh.ConsolidationMode.NONE,
                                   timeout=timeout_s)
            out = []
            for reply in replies:
                sample = reply.ok
                if sample is not None:
                    out.append((str(sample.key_expr), sample.payload.to_bytes()))
            return out
        except zenoh.ZError as exc:
            raise TransportError(f"query on {key} failed: {exc}") from exc

    # -- liveliness ---------------------------------------------------------------------------

    def declare_token(self, key: str):
        try:
            token = self.raw.liveliness().declare_token(key)
        except zenoh.ZError as exc:
            raise TransportError(f"could not declare liveliness token {key}: {exc}") from exc
        self._owned.append(token)
        return token

    def watch_liveliness(self, key: str, on_change: Callable[[str, bool], None]) -> Subscription:
        """`on_change(key, alive)` for every token matching `key`, present ones included."""
        sub = Subscription(key, on_change, _key_and_presence)
        try:
            sub._subscriber = self.raw.liveliness().declare_subscriber(key, sub._on_sample, history=True)
        except zenoh.ZError as exc:
            raise TransportError(f"could not watch liveliness of {key}: {exc}") from exc
        self._owned.append(sub)
        return sub

    def alive(self, key: str, timeout_s: float = 1.0) -> list[str]:
        """Keys of the liveliness tokens matching `key` now."""
        try:
            return [str(r.ok.key_expr) for r in self.raw.liveliness().get(key, timeout=timeout_s) if r.ok is not None]
        except zenoh.ZError as exc:
            raise TransportError(f"liveliness query on {key} failed: {exc}") from exc



def tls_refusal(settings: ZenohSettings, endpoint: str, timeout_s: float = 2.0) -> str | None:
    """Why a TLS handshake with `endpoint` fails, in words; None when it succeeds, when nothing
    answers there, or for an endpoint that is not `tls/`.

    Zenoh reports a refused certificate as a session that does not open (client mode) or a link
    that never comes (peer mode), as it reports an address where nothing listens. This probe
    repeats the handshake Zenoh makes (the same CA, certificate and name check) with Python's
    `ssl`, so that a robot can say which of the two it met.
    """
    if not endpoint.startswith("tls/"):
        return None
    address = endpoint[len("tls/"):].split("?", 1)[0].split("#", 1)[0]
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(settings.tls_root_ca)
        context.check_hostname = settings.tls_verify_name
        if settings.tls_certificate:
            context.load_cert_chain(settings.tls_certificate, settings.tls_private_key)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return None  # nothing listens (or the files cannot be read: validate() names those)
    try:
        with context.wrap_socket(sock, server_hostname=host) as tls:
            # TLS 1.3: a listener that refuses our certificate says so after the handshake.
            tls.settimeout(0.3)
            try:
                tls.recv(1)
            except (TimeoutError, socket.timeout):
                pass
        return None
    except ssl.SSLCertVerificationError as exc:
        return (f"{endpoint} answers, but its TLS certificate is refused: {exc.verify_message} (is it the "
                "server's certificate, issued by the CA in tls_root_ca for the host dialled? docs/security.md)")
    except ssl.SSLError as exc:
        return (f"{endpoint} answers, but the TLS handshake failed: {exc.reason or exc} (the listener may refuse "
                "this node's certificate: is it issued by the deployment's CA? docs/security.md)")
    except OSError:
        return None
    finally:
        sock.close()


def _key_and_payload(sample: zenoh.Sample) -> tuple[str, bytes]:
    return str(sample.key_expr), sample.payload.to_bytes()


class Payload:
    """A received payload still in Zenoh's buffer (a `ZBytes`, which owns a reference to it: the
    buffer lives as long as this object, so keeping it in a slot is safe). eclipse-zenoh 1.10.2's
    `ZBytes` exposes no buffer protocol, so no memoryview of it can be taken: `bytes(payload)` is
    the one copy, made by whoever reads it."""

    __slots__ = ("_zbytes",)

    def __init__(self, zbytes: zenoh.ZBytes):
        self._zbytes = zbytes

    def __len__(self) -> int:
        return len(self._zbytes)

    def __bytes__(self) -> bytes:
        return self._zbytes.to_bytes()


def _key_and_kept_payload(sample: zenoh.Sample) -> tuple[str, Payload]:
    return str(sample.key_expr), Payload(sample.payload)


def _key_payload_and_attachment(sample: zenoh.Sample) -> tuple[str, bytes, bytes | None]:
    attachment = sample.attachment
    return str(sample.key_expr), sample.payload.to_bytes(), attachment.to_bytes() if attachment is not None else None


def _key_kept_payload_and_attachment(sample: zenoh.Sample) -> tuple[str, Payload, bytes | None]:
    attachment = sample.attachment
    return str(sample.key_expr), Payload(sample.payload), attachment.to_bytes() if attachment is not None else None


# (with_attachment, copy) -> how a sample is handed to the handler
_UNPACKERS = {
    (False, True): _key_and_payload,
    (False, False): _key_and_kept_payload,
    (True, True): _key_payload_and_attachment,
    (True, False): _key_kept_payload_and_attachment,
}


def _key_and_presence(sample: zenoh.Sample) -> tuple[str, bool]:
    return str(sample.key_expr), sample.kind == zenoh.SampleKind.PUT
