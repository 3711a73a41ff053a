"""The edge scheduler's view of each engine, and the threads that listen to remote ones.

`EngineState` is what the scheduler knows of one engine (up or down, suspect, incarnation,
measured round trip and bandwidth, its `EngineLoad`, counters). The two threads here do all the
reading of what a remote engine sends, so that nothing an engine sends is parsed on the inference
thread:

- `AnswerInbox`: the answer callback reads only the answer's header in place (its request,
  engine and scheduler process: `dispatch.answer_header`, nothing decoded) and queues an answer
  only when it names a request of this scheduler process outstanding on the engine whose key it
  came on, and no other answer to that request waits to be read: so at most as many answers of an
  engine wait as it has requests in flight, and a flood of made-up answers is dropped, counted by
  reason, before it costs a queue place or a decode. Its thread decodes each queued one, checks it
  again in full, maps its `error` to a bounded set of reasons, and only then hands it to the
  dispatcher's event queue;
- `Prober`: one thread per remote engine queries its status every `probe_period_s` (the probe's
  wait included: a silent engine costs one lost probe per period) and validates what comes back
  (`placement.profile_from_peer_ms`) before handing it over.

Every answer and status is hostile input: a remote peer can send anything on an engine's keys in
plain mode, and an engine's own certificate under TLS.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import dispatch
from lerobot_zenoh.protocol.dispatch import EngineAnswer, EngineKeys, EngineStatus
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.scheduling.engine_load import EngineLoad
from lerobot_zenoh.scheduling.placement import BatchProfile, EngineView, profile_from_peer_ms
from lerobot_zenoh.server.config.manifest import EngineEntry
from lerobot_zenoh.telemetry.publisher import worth_logging

log = logging.getLogger(__name__)

#: Round trip: the smallest of the last RTT_WINDOW probes (a busy host only delays a probe).
RTT_WINDOW = 8
#: Bandwidth: the largest of the last BANDWIDTH_WINDOW samples (noise only lowers a sample).
BANDWIDTH_WINDOW = 32
#: Estimate-vs-actual pairs kept per engine for telemetry.
KEPT_SAMPLES = 256
#: Answers waiting to be decoded, per dispatcher, whatever the engines have in flight: a backstop
#: (each waiting answer names a distinct request in flight); beyond it they are dropped (`answers_dropped_full`).
ANSWER_INBOX = 256
#: An engine's `error` that is not one of the protocol's reasons is counted as this one.
ENGINE_ERROR = Reason.ENGINE_ERROR
#: Characters of an engine's `detail` text that reach the log.
DETAIL_CHARS = 200
_REASONS = frozenset(r.value for r in Reason)


class EngineLinkSession(Protocol):
    """What the dispatcher uses of the transport (`transport.session.ZenohSession` implements it;
    tests hand in an in-memory fake)."""

    def publisher(self, key: str, qos): ...
    def subscribe(self, key: str, handler: Callable[[str, bytes], None]): ...
    def watch_liveliness(self, key: str, on_change: Callable[[str, bool], None]): ...
    def query(self, key: str, timeout_s: float = 1.0) -> list[tuple[str, bytes]]: ...


@dataclass
class EngineState:
    """One engine as the edge scheduler knows it."""

    entry: EngineEntry
    keys: EngineKeys | None  # None for the local engine
    load: EngineLoad | None = None  # with a profile
    up: bool = False
    down_reason: str | None = "not probed yet"
    # A request timed out on it: no placement until a probe sent after `suspect_until_s` answers,
    # then one request at a time until an answer comes back.
    suspect_since_s: float | None = None
    suspect_until_s: float = 0.0
    probation: bool = False
    incarnation: str | None = None
    capacity: int = 1  # the manifest's (`engines[].capacity`)
    rtt_s: float | None = None
    bandwidth_bps: float = math.inf
    lost_probes: int = 0
    rtt_samples: deque = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))
    bandwidth_samples: deque = field(default_factory=lambda: deque(maxlen=BANDWIDTH_WINDOW))
    counts: Counter = field(default_factory=Counter)
    estimates: deque = field(default_factory=lambda: deque(maxlen=KEPT_SAMPLES))  # (estimate s, actual s)
    queueing: deque = field(default_factory=lambda: deque(maxlen=KEPT_SAMPLES))  # admission -> batch start
    publisher: object = None

    def __post_init__(self) -> None:
        self.capacity = self.entry.capacity

    @property
    def engine_id(self) -> str:
        return self.entry.engine_id

    @property
    def tier(self) -> str:
        return self.entry.tier

    @property
    def profile(self) -> BatchProfile | None:
        return self.load.profile if self.load is not None else None

    def set_profile(self, profile: BatchProfile | None) -> None:
        """A new profile (a restarted engine): nothing outstanding is kept."""
        self.load = EngineLoad(profile, self.capacity) if profile is not None else None

    @property
    def busy_until_s(self) -> float:
        return self.load.busy_until_s if self.load is not None else 0.0

    def usable(self) -> bool:
        return self.up and self.load is not None and self.suspect_since_s is None

    @property
    def in_flight_limit(self) -> int:
        if self.probation:
            return 1
        return self.entry.max_in_flight or self.capacity

    def view(self, running: int) -> EngineView:
        return EngineView(engine_id=self.engine_id, tier=self.tier, capacity=min(self.capacity, self.in_flight_limit),
                          running=running, busy_until_s=self.busy_until_s, profile=self.profile,
                          rtt_s=self.rtt_s or 0.0, bandwidth_bps=self.bandwidth_bps,
                          max_in_flight=1 if self.probation else self.entry.max_in_flight)

    def figures(self, in_flight: int, answered_total: int, counted_there: Counter | None = None) -> dict:
        """Telemetry of this engine (docs/telemetry.md, "Engines"); `counted_there`: what the answer
        inbox counted for it (refusals before an answer reached the dispatcher)."""
        pairs = list(self.estimates)
        waits = list(self.queueing)
        counts = self.counts + (counted_there or Counter())
        answered = counts["answered"]

        def mean_ms(values: list[float]) -> float:
            return 1000 * sum(values) / len(values) if values else 0.0

        out = {
            "up": int(self.up),
            "suspect": int(self.suspect_since_s is not None),
            "in_flight": in_flight,
            "dispatched": counts["dispatched"],
            "answered": answered,
            "requeued": counts["requeued"],
            "late": counts["late"],
            "refused": sum(v for k, v in counts.items() if k.startswith("refused.")),
            "answers_dropped_full": counts["answers_dropped_full"],
            "restarts": counts["restarts"],
            "partitions": counts["partitions"],
            "offload_share": answered / answered_total if answered_total else 0.0,
            "estimate_ms_mean": mean_ms([e for e, _ in pairs]),
            "actual_ms_mean": mean_ms([a for _, a in pairs]),
            "queue_estimate_ms_mean": mean_ms([e for e, _ in waits]),
            "queue_actual_ms_mean": mean_ms([a for _, a in waits]),
        }
        if self.keys is not None:
            out["rtt_ms"] = 1000 * self.rtt_s if self.rtt_s is not None else -1.0
            out["bandwidth_mbps"] = self.bandwidth_bps * 8 / 1e6 if math.isfinite(self.bandwidth_bps) else -1.0
        out |= {k: v for k, v in counts.items() if k.startswith(("refused.", "errors.", "requeued."))}
        return out


@dataclass(frozen=True)
class Probe:
    """A status probe's outcome, validated on the probe thread."""

    sent_s: float
    rtt_s: float | None
    status: EngineStatus | None  # None: unanswered
    profile: BatchProfile | None = None  # the status' profile, validated (None: none declared)
    refusal: str | None = None  # why the status is refused (bad_status), in words


def read_status(engine_id: str, replies: list[tuple[str, bytes]], max_bytes: int) -> tuple[EngineStatus | None, BatchProfile | None, str | None]:
    """The status of `engine_id` among a query's replies, its validated profile, or why it is refused."""
    refusal = None
    for _, payload in replies:
        if len(payload) > max_bytes:
            refusal = f"a status of {len(payload)} bytes"
            continue
        try:
            msg = dispatch.decode(payload)
        except ProtocolError as exc:
            refusal = f"an unreadable status ({exc.reason})"
            continue
        if not isinstance(msg, EngineStatus) or msg.engine_id != engine_id:
            continue
        if msg.capacity < 1:
            return None, None, f"capacity {msg.capacity}"
        try:
            profile = profile_from_peer_ms(msg.profile_ms) if msg.profile_ms else None
        except ValueError as exc:
            return None, None, f"profile_ms: {exc}"
        return msg, profile, None
    return None, None, refusal


class Prober:
    """Probes one remote engine's status every `period_s` on its own thread; each outcome goes to
    `on_probe` (the dispatcher's event queue)."""

    def __init__(self, session: EngineLinkSession, state: EngineState, period_s: float, max_bytes: int,
                 on_probe: Callable[[str, Probe], None], clock: Callable[[], float] = time.monotonic):
        self.session, self.state, self.period_s = session, state, period_s
        self.max_bytes, self.on_probe, self.clock = max_bytes, on_probe, clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe:{state.engine_id}", daemon=True)

    def probe(self, timeout_s: float) -> Probe:
        sent = self.clock()
        try:
            replies = self.session.query(self.state.keys.status, timeout_s=timeout_s)
        except Exception:  # a closed session at stop, a transport error: an unanswered probe
            return Probe(sent, None, None)
        rtt = self.clock() - sent
        status, profile, refusal = read_status(self.state.engine_id, replies, self.max_bytes)
        return Probe(sent, rtt if status is not None else None, status, profile, refusal)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # (started)
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        # A probe waits at most one period for its answer, and the next one leaves a period after
        # the last one left: an engine that stops answering loses one probe per period.
        next_s = self.clock() + self.period_s
        while not self._stop.wait(max(0.0, next_s - self.clock())):
            next_s += self.period_s
            result = self.probe(timeout_s=self.period_s)
            if self._stop.is_set():
                return
            self.on_probe(self.state.engine_id, result)
            next_s = max(next_s, self.clock())


@dataclass(frozen=True)
class Answer:
    """An engine answer, decoded and checked on the inbox thread."""

    engine_id: str
    arrived_s: float
    answer: EngineAnswer
    nbytes: int
    error: str | None  # the answer's error, mapped to a protocol reason or `engine_error`


class AnswerInbox:
    """Decodes remote engines' answers on its own thread, from a bounded queue.

    `engine_of(request_id)`: the engine a request of this process is outstanding on, or None (a
    snapshot read, from the Zenoh callback; the dispatcher matches again when it takes the answer);
    `sent(request_id)`: whether this process ever sent that request. An answer is queued only when
    its header names this process (`edge_incarnation`), a request outstanding on the engine whose
    key it came on, and no other answer to that request waits: at most one answer per request in
    flight waits, so a flood of made-up answers never crowds out a real one (an answer naming a
    real request in flight can, which plain mode cannot stop: docs/security.md). Every answer
    dropped is counted per engine by reason."""

    def __init__(self, edge_incarnation: str, max_bytes: int, engine_of: Callable[[int], str | None],
                 sent: Callable[[int], bool], deliver: Callable[[Answer], None],
                 clock: Callable[[], float] = time.monotonic):
        self.edge_incarnation = edge_incarnation
        self.max_bytes = max_bytes
        self.engine_of = engine_of
        self.sent = sent
        self.deliver = deliver
        self.clock = clock
        self.counts: Counter = Counter()  # per engine: answers.<why refused> (read by telemetry)
        self._queue: queue.Queue = queue.Queue(maxsize=ANSWER_INBOX)
        self._waiting: set[int] = set()  # request ids with an answer in the queue
        self._lock = threading.Lock()  # `_waiting` and `counts`, from Zenoh's threads and the inbox thread
        self._thread = threading.Thread(target=self._run, name="engine-answers", daemon=True)
        self._logged: Counter = Counter()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        if self._thread.ident is None:  # (never started)
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout_s)

    def on_answer(self, engine_id: str, payload: bytes) -> None:
        """Zenoh callback: size check, the header read in place, and hand-over only."""
        request_id, why = self._screen(engine_id, payload)
        with self._lock:
            if why is None:
                if request_id in self._waiting:
                    why = "refused.duplicate"  # another answer to it waits to be read
                else:
                    try:
                        self._queue.put_nowait((engine_id, self.clock(), payload, request_id))
                    except queue.Full:
                        why = "answers_dropped_full"
                    else:
                        self._waiting.add(request_id)
                        return
            self.counts[(engine_id, why)] += 1

    def _screen(self, engine_id: str, payload: bytes) -> tuple[int, str | None]:
        """(the request an answer names, None) when it names a request in flight on `engine_id`,
        else (0, why it is dropped unread). Zenoh callback: no decode, a bounded walk of its keys."""
        if len(payload) > self.max_bytes:
            return 0, "refused.too_large"
        header = dispatch.answer_header(payload)
        if header is None:
            return 0, "refused.bad_header"
        if not header.is_answer or header.engine_id != engine_id:
            return 0, f"refused.{Reason.WRONG_TYPE}"
        if header.edge_incarnation != self.edge_incarnation:
            return 0, "refused.stale_incarnation"  # asked by an earlier scheduler process
        on = self.engine_of(header.request_id)
        if on is None:
            return 0, "late" if self.sent(header.request_id) else "refused.unknown_request"
        if on != engine_id:
            return 0, "refused.mismatched"  # another engine's request
        return header.request_id, None

    def take(self, engine_id: str, arrived_s: float, payload: bytes, request_id: int) -> Answer | None:
        """Decode and check one answer queued for `request_id` (the inbox thread)."""
        try:
            answer = dispatch.decode(payload)
        except ProtocolError as exc:
            return self._count(engine_id, f"refused.{exc.reason}")
        if not isinstance(answer, EngineAnswer) or answer.engine_id != engine_id:
            return self._count(engine_id, f"refused.{Reason.WRONG_TYPE}")
        if answer.request_id != request_id:
            return self._count(engine_id, "refused.bad_header")  # its header and its body disagree
        if answer.edge_incarnation != self.edge_incarnation:
            return self._count(engine_id, "refused.stale_incarnation")
        if self.engine_of(answer.request_id) != engine_id:
            return self._count(engine_id, "late")  # answered or re-queued while it waited
        error = answer.error
        if error is not None and error not in _REASONS:
            error = ENGINE_ERROR
            self._logged[engine_id] += 1
            if worth_logging(self._logged[engine_id]):
                log.warning("engine %s answered an error the protocol does not name: %r [%d so far]", engine_id,
                            answer.error[:DETAIL_CHARS], self._logged[engine_id])
        return Answer(engine_id, arrived_s, answer, len(payload), error)

    def drain(self) -> None:
        """Read every queued answer now, on the caller's thread (tests that run no threads)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._read(item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._read(item)

    def _count(self, engine_id: str, why: str) -> None:
        with self._lock:
            self.counts[(engine_id, why)] += 1

    def _read(self, item: tuple[str, float, bytes, int]) -> None:
        try:
            answer = self.take(*item)
        except Exception:  # never let one answer end the thread
            log.exception("engine answer could not be read")
            answer = None
        finally:
            with self._lock:
                self._waiting.discard(item[3])
        if answer is not None:
            self.deliver(answer)
