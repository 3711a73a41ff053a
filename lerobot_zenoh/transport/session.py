"""The one module that talks to Zenoh: session, publishers with explicit QoS, subscriptions,
the status queryable, queries and liveliness. Zenoh's errors become `TransportError`.

Callbacks given to `subscribe` and `watch_liveliness` run on Zenoh's threads: they must only
hand data over (to a lock-protected slot or a queue) and return. An exception raised by one is
counted on its `Subscription` and logged (rate-limited); the next sample is delivered as usual.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zenoh

from lerobot_zenoh.errors import ConfigError, TransportError
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QoS:
    reliable: bool
    block_when_congested: bool
    priority: zenoh.Priority
    express: bool


#: Seed 002 section 6.2. Observations: a newer one replaces a lost one, never wait for the network.
OBSERVATION_QOS = QoS(reliable=False, block_when_congested=False, priority=zenoh.Priority.DATA, express=True)
#: Action chunks: every chunk must arrive; losing one starves the robot.
ACTION_QOS = QoS(reliable=True, block_when_congested=True, priority=zenoh.Priority.INTERACTIVE_HIGH, express=True)
#: Telemetry: useful, never worth delaying anything else for.
METRICS_QOS = QoS(reliable=False, block_when_congested=False, priority=zenoh.Priority.DATA_LOW, express=False)


class Publisher:
    """A declared publisher with fixed QoS. `put` never raises zenoh errors, only TransportError."""

    def __init__(self, publisher: zenoh.Publisher, key: str):
        self._publisher = publisher
        self.key = key

    def put(self, payload: bytes) -> None:
        try:
            self._publisher.put(payload)
        except zenoh.ZError as exc:
            raise TransportError(f"put on {self.key} failed: {exc}") from exc

    def close(self) -> None:
        try:
            self._publisher.undeclare()
        except zenoh.ZError:
            pass


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


class ZenohSession:
    """Owns one zenoh.Session. Construct with settings (no I/O), then `open()` or use `with`."""

    def __init__(self, settings: ZenohSettings, config_file: str | None = None):
        """`config_file`: a complete Zenoh JSON5 config to start from instead of the typed
        settings (e.g. a router file written by lerobot-zenoh-secure); then only
        `settings.json5_overrides` apply on top of it."""
        self.settings = settings
        self.config_file = config_file
        self._session: zenoh.Session | None = None
        self._closed = False
        self._owned: list = []

    # -- lifetime -----------------------------------------------------------------------------

    def open(self) -> ZenohSession:
        if self._closed:
            raise TransportError("this session was closed; create a new ZenohSession")
        if self._session is None:
            config = self._config()
            try:
                self._session = zenoh.open(config)
            except zenoh.ZError as exc:
                raise TransportError(f"could not open a Zenoh session ({self.settings.effective_mode}, "
                                     f"listen={self.settings.listen}, connect={self.settings.connect}): {exc}") from exc
        return self

    def _config(self) -> zenoh.Config:
        if self.config_file is None:
            return self.settings.to_zenoh_config()
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
        pub = Publisher(raw, key)
        self._owned.append(pub)
        return pub

    def subscribe(self, key: str, handler: Callable[[str, bytes], None]) -> Subscription:
        sub = Subscription(key, handler, _key_and_payload)
        try:
            sub._subscriber = self.raw.declare_subscriber(key, sub._on_sample)
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
            # only the serving one answers; zenoh must not pick the silent one for us.
            selector = zenoh.Selector(key, parameters) if parameters else key
            replies = self.raw.get(selector, target=zenoh.QueryTarget.ALL, timeout=timeout_s)
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



def _key_and_payload(sample: zenoh.Sample) -> tuple[str, bytes]:
    return str(sample.key_expr), sample.payload.to_bytes()


def _key_and_presence(sample: zenoh.Sample) -> tuple[str, bool]:
    return str(sample.key_expr), sample.kind == zenoh.SampleKind.PUT
