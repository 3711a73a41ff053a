"""What the session table holds, as plain data: a session, its newest-only slot, its counters, and
what the table hands out (`Ranking`, `Batch`, `SessionTableSnapshot`). The decisions on them live in
`server/session_table/table.py` (admission, scheduling), `server/session_table/rules.py` (which observation a
session accepts) and `server/session_table/roster.py` (which sessions exist)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation, ObservationHeader
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.telemetry.histogram import LatencyHistogram


@dataclass(frozen=True)
class SessionTableConfig:
    listed: frozenset[str]  # client ids named in the manifest: always admitted
    accept_unknown: bool = False  # whether other ids are served (from a bounded pool)
    max_unknown_clients: int = 64
    idle_timeout_s: float = 60.0
    liveliness_grace_s: float = 3.0
    max_message_bytes: int = 64 * 2**20
    max_batch_size: int = 1


@dataclass
class Slot:
    """The newest unserved observation of one session: its raw bytes and the verdict of admission.

    `header` (or `error`) is what admission read of it (`server/engine/admission.py`); an observation sent
    without a header gets `observation` (or `error`) from the runner adapter's decode, before the scheduler
    hears of it when it ranks by `ExecutionInfo`, else once picked. `known` is what the session
    rules and the scheduler read; `judged`, whether the rules have judged it."""

    payload: bytes
    arrival_s: float
    header: ObservationHeader | None = None  # read at admission (protocol.md §5.1.1)
    error: ProtocolError | None = None  # why its header or body could not be read: rejected by `schedule`
    observation: Observation | None = None  # the runner adapter's decode (header-less on arrival, else when served)
    announced: bool = False  # the scheduler has been told (`on_arrival`)
    judged: bool = False  # judged by the session rules (when announced; a header-less one maybe once picked)
    # A refresh that replaced its request before the scheduler heard of it carries the request's
    # first arrival (and its ExecutionInfo), so that the request keeps its place in line.
    first_arrival: tuple[float, ExecutionInfo | None] | None = None
    # The multi-model task whose stream it came on (`server/model/routing.py`); None: the model's own app.
    # Each observation carries its own, so a robot that moves to another task is served as that task.
    task: str | None = None

    @property
    def known(self) -> Observation | ObservationHeader | None:
        """What is known of the observation (seq_id, nonce, episode, execution): its header, else its decode."""
        return self.header if self.header is not None else self.observation

    @property
    def request_seq(self) -> int | None:
        """The request this observation stands for: the one it refreshes, else its own seq_id (None: not read yet)."""
        known = self.known
        if known is None:
            return None
        refreshes = known.refreshes_seq_id
        return known.seq_id if refreshes is None else refreshes


#: Latency samples kept per session for its percentiles.
LATENCY_WINDOW = 256


@dataclass
class SessionStats:
    """One session's counters (or, in `SessionTableSnapshot.closed`, those of every session since closed)."""

    received: int = 0
    superseded: int = 0
    served: int = 0
    refreshes: int = 0  # re-fetch refreshes that took the slot (their request still waited); also in `received`
    refreshes_late: int = 0  # refreshes dropped on arrival: their request no longer waited
    rejected: Counter = field(default_factory=Counter)  # reason -> count ("replayed" included)
    dropped: Counter = field(default_factory=Counter)  # dropped before a slot: rate_limited (not a rejection)
    inference_ms: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    queue_ms: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    # Every latency since the session opened, in bins (Prometheus histograms; telemetry/histogram.py).
    inference_hist: LatencyHistogram = field(default_factory=LatencyHistogram)
    queue_hist: LatencyHistogram = field(default_factory=LatencyHistogram)

    def copy(self) -> SessionStats:
        return SessionStats(self.received, self.superseded, self.served, self.refreshes, self.refreshes_late,
                            Counter(self.rejected), Counter(self.dropped),
                            deque(self.inference_ms, maxlen=LATENCY_WINDOW), deque(self.queue_ms, maxlen=LATENCY_WINDOW),
                            self.inference_hist.copy(), self.queue_hist.copy())

    def count_served(self, inference_ms: float, queue_ms: float, window: bool = True) -> None:
        """One chunk served: counted, its latencies in the histograms (and the windows, unless `window`
        is False: the totals of closed sessions keep none)."""
        self.served += 1
        if window:
            self.inference_ms.append(inference_ms)
            self.queue_ms.append(queue_ms)
        self.inference_hist.observe_ms(inference_ms)
        self.queue_hist.observe_ms(queue_ms)

    def add_counts(self, other: SessionStats) -> None:
        """Fold `other`'s counts and histograms into these (latency windows are per session: not folded)."""
        self.received += other.received
        self.superseded += other.superseded
        self.served += other.served
        self.refreshes += other.refreshes
        self.refreshes_late += other.refreshes_late
        self.rejected.update(other.rejected)
        self.dropped.update(other.dropped)
        self.inference_hist.merge(other.inference_hist)
        self.queue_hist.merge(other.queue_hist)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


@dataclass(frozen=True)
class SessionSnapshot:
    listed: bool
    stats: SessionStats  # a copy


@dataclass(frozen=True)
class SessionTableSnapshot:
    """A copy of every counter of one session table (`SessionTable.snapshot`); percentiles are the caller's."""

    sessions: dict[str, SessionSnapshot]  # the open sessions
    closed: SessionStats  # the counts of every session since closed (served: chunks of sessions closed meanwhile too)
    dropped: dict[str, int]  # observations dropped before any session: unknown_client, too_many_clients
    unknown_open: int  # open sessions of ids not in the manifest
    sessions_opened: int
    sessions_closed: dict[str, int]  # reason -> count
    batch_sizes: list[int]  # of the last passes
    headers_read: int  # observations whose header told the scheduler what they are
    decoded_on_arrival: int  # header-less observations decoded before the scheduler heard of them
    scheduler: dict[str, float | int]  # the request scheduler's own figures

    @property
    def unknown_refused(self) -> int:
        return self.dropped.get(Reason.UNKNOWN_CLIENT, 0)

    def total(self) -> SessionStats:
        """The counts of every session, open and closed (no latency windows)."""
        out = self.closed.copy()
        for s in self.sessions.values():
            out.add_counts(s.stats)
        return out


@dataclass
class Session:
    client_id: str
    listed: bool
    last_seen_s: float
    nonce: int | None = None  # the client process's session_nonce, once one was seen
    episode_id: str | None = None
    last_served_seq: int | None = None
    last_served_s: float | None = None  # when last_served_seq was served (bounds how far seq_ids may jump)
    past_nonces: dict = field(default_factory=dict)  # nonce -> (last_served_seq, last_served_s) of earlier processes
    token_seen: bool = False  # its liveliness token was seen while this session was open (or just before)
    token_gone_since_served: bool = False  # the token vanished after the last serve (a nonce-less restart)
    # (session_nonce, seq_id) of the newest observation picked for inference: a refresh of a request
    # at or below it is late (set when picked, from the header; for a header-less one when served).
    last_picked: tuple[int | None, int] | None = None
    # (session_nonce, seq_id) of the request being computed for it now (picked, not finished or
    # re-queued yet): a resend of it is refused (`replayed`), not computed twice.
    computing: tuple[int | None, int] | None = None
    token_lost_s: float | None = None  # when its liveliness token vanished, or (unknown ids) since when it is awaited
    needs_reset: bool = False  # per-episode state to drop in the runner before its next inference
    closed_reason: str | None = None  # liveliness | no_token | idle | delisted | server_stop, once closed
    slot: Slot | None = None
    stats: SessionStats = field(default_factory=SessionStats)
    # Refusals (protocol 1.5, docs/protocol.md §5.7): whether the client's observations say it reads
    # them, the request last read of it (what a refusal answers) and when it was last sent one.
    reads_refusals: bool = False
    last_request_seq: int | None = None
    refusal_sent_s: float | None = None

    def put(self, payload: bytes, now_s: float, header: ObservationHeader | None,
            error: ProtocolError | None, task: str | None) -> None:
        """Keep an observation in the slot (newest only). A refresh of the request still waiting
        there, not announced yet, keeps that request's first arrival (its place in line)."""
        self.stats.received += 1
        old = self.slot
        first = None
        if old is not None:
            self.stats.superseded += 1
            if (not old.announced and header is not None and header.refreshes_seq_id is not None
                    and old.request_seq == header.refreshes_seq_id):
                first = old.first_arrival or (old.arrival_s, old.known.execution)
        self.slot = Slot(payload, now_s, header=header, error=error, first_arrival=first, task=task)


@dataclass(frozen=True)
class Ranking:
    """What `SessionTable.rank` returns: the ready clients in the scheduler's order, each one's
    payload size (for placement), and the observations rejected while announcing."""

    order: list[str]
    sizes: dict[str, int]
    rejected: list[tuple[Session, Slot, str, str]]


@dataclass
class Batch:
    """What `schedule` hands to the executor: sessions picked for one forward pass with their slots,
    and slots rejected before taking a seat (undecodable, replayed)."""

    items: list[tuple[Session, Slot]]
    rejected: list[tuple[Session, Slot, str, str]]  # (session, slot, reason, detail)
