"""The session table of one model: sessions, newest-only slots, and whom to serve next (with its
request scheduler). Not an engine: engines (`server/dispatch.py`) run what this table picks.

Pure decisions: no Zenoh, no torch, no decoding and no clock (every call takes `now_s`, seconds
of one process's monotonic clock), and no calls back into the shell. The shell (`server/server.py`,
through `server/admission.py`) calls it from two threads:

    Zenoh callback thread    admit(client, payload, now, header, header_error) -> None (kept) or why it was dropped
                             on_token(client, alive, now)        (the client's liveliness token)
    inference thread         expire(now) -> closed sessions      (the shell forgets their runner state)
                             unread() -> slots                   (header-less observations the scheduler must rank:
                                                                  the shell has the executor decode them)
                             schedule(now) -> Batch              (session rules, whom to serve in one forward pass)
                             judge(session, slot)                (session rules of a picked header-less one, decoded)
                             take_reset / finish / requeue       (bookkeeping after the pass)
    telemetry thread         snapshot() -> SessionTableSnapshot        (a typed copy of the counters; no percentiles)

What an observation is (its `seq_id`, `session_nonce`, `episode_id`, `ExecutionInfo`) is read once:
from its header, by the shell at admission (`server/admission.py`), and kept in the slot with the
payload. The session rules (`_judge`, one function) judge it when the scheduler first hears of it,
in `schedule`, and the verdict stays in the slot (`judged`). An observation sent without a header is
decoded by the executor: before the scheduler hears of it when the scheduler ranks by
`ExecutionInfo` (`unread`), so it is judged like the others; else only if it is picked, and judged
then (`judge`), so that a superseded one never costs a decode.

One lock guards all of it and is held only for dictionary work: never across decoding, inference,
publishing or percentile computation.

Re-fetch (docs/protocol.md §10.7): an observation whose header says it refreshes request `s` (a
fresh capture the client publishes while `s` waits) goes into the slot only while `s` still waits:
it replaces `s` (or an earlier refresh of it) and keeps its place in line, since the scheduler
hears it as one more newer observation of a client it already counts as waiting. A refresh that
arrives once `s` or a later observation of the client was picked, or while a newer request waits,
is dropped at once and counted (`refreshes_late`): it never costs an inference. A refresh of a
request the server never received (lost on the way, or sent to a server that has since failed
over to this one) stands in for it. A refresh sent without a header is indistinguishable from an
ordinary observation on arrival and is served as one.

Sessions (docs/architecture.md, "Sessions"; the rules: docs/protocol.md §10.5): one per client
id, opened by its first admitted observation, closed when the client's liveliness token has been
gone for `liveliness_grace_s`, after `idle_timeout_s` without an *accepted* observation (one that
passed the session rules or was served: rejected ones keep nothing alive), or at `close_all()`.
Clients listed in the manifest always get a session; unknown clients (when accepted) share a pool
of `max_unknown_clients` places that is freed as their sessions close; once the pool is full and
another unknown id asks for a place, the sessions of unknown ids whose liveliness token was not
seen within `liveliness_grace_s` close (`no_token`), so no number of invented ids can lock out a
listed robot, nor hold the pool for longer than the grace.

What a forged observation on a client's key can do to its session (docs/security.md, "Sessions
against a forger"): a session follows one client process, named by its `session_nonce`. An
observation without a nonce never joins a session that has one (`nonce_required`, at once, nothing
changed); one whose `seq_id` runs further ahead of the last served than a client could have counted
since (`MAX_SEQ_STEP` + `MAX_SEQ_RATE_HZ` per second) is refused (`seq_jump`); a new nonce starts
the count afresh, so a forger who does not know the robot's nonce costs it at most a reset.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation, ObservationHeader
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.scheduling.request_schedulers import RequestScheduler
from lerobot_zenoh.server.rate_limit import RejectionRateLimit

#: How many distinct refused unknown ids are counted one by one (hostile peers can invent many).
MAX_TRACKED_UNKNOWN = 256

# Drop reasons of `admit` (docs/protocol.md, "Rejections").
UNKNOWN_CLIENT = Reason.UNKNOWN_CLIENT
TOO_MANY_CLIENTS = Reason.TOO_MANY_CLIENTS
RATE_LIMITED = Reason.RATE_LIMITED
TOO_LARGE = Reason.TOO_LARGE
REPLAYED = Reason.REPLAYED
REFRESH_LATE = "refreshes_late"  # a re-fetch refresh whose request no longer waits (counted, not a rejection)
# Session rules (`_session_rules`; docs/protocol.md §10.5).
NONCE_REQUIRED = Reason.NONCE_REQUIRED  # no session_nonce, in a session that follows a nonce-ful client process
SEQ_JUMP = Reason.SEQ_JUMP  # seq_id further ahead of the last served one than a client can count

#: How far a seq_id may run ahead of the session's last served one: this many, plus `MAX_SEQ_RATE_HZ`
#: per second since that one was served. A client that sends 1000 observations a second, none of
#: them served, stays inside it; a forged 2**64-1 does not.
MAX_SEQ_STEP = 1024
MAX_SEQ_RATE_HZ = 1000.0
#: A client without a session_nonce cannot say it restarted: its seq_ids going back are a restart
#: (served, state reset) once its liveliness token went since the last serve, or once nothing was
#: served for this long; a replay otherwise.
NONCELESS_REPLAY_WINDOW_S = 5.0
#: Other nonces a session remembers the count of (the oldest kept: a forger's made-up nonces churn
#: among the newest places and cannot push out the robot's own).
MAX_PAST_NONCES = 8
#: Liveliness tokens remembered for ids that have no session yet (a client declares its token
#: before its first observation); the oldest are forgotten first.
MAX_TRACKED_TOKENS = 4096
#: Session openings kept for the log between two expiry passes (a flood of new ids logs this many).
OPENED_KEPT = 64


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

    `header` (or `error`) is what admission read of it (`server/admission.py`); an observation sent
    without a header gets `observation` (or `error`) from the executor's decode, before the scheduler
    hears of it when it ranks by `ExecutionInfo`, else once picked. `known` is what the session
    rules and the scheduler read; `judged`, whether the rules have judged it."""

    payload: bytes
    arrival_s: float
    header: ObservationHeader | None = None  # read at admission (protocol.md §5.1.1)
    error: ProtocolError | None = None  # why its header or body could not be read: rejected by `schedule`
    observation: Observation | None = None  # the executor's decode (header-less on arrival, else when served)
    announced: bool = False  # the scheduler has been told (`on_arrival`)
    judged: bool = False  # judged by the session rules (when announced; a header-less one maybe once picked)
    # A refresh that replaced its request before the scheduler heard of it carries the request's
    # first arrival (and its ExecutionInfo), so that the request keeps its place in line.
    first_arrival: tuple[float, ExecutionInfo | None] | None = None
    # The multi-model task whose stream it came on (`server/routing.py`); None: the model's own app.
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

    def copy(self) -> SessionStats:
        return SessionStats(self.received, self.superseded, self.served, self.refreshes, self.refreshes_late,
                            Counter(self.rejected), Counter(self.dropped),
                            deque(self.inference_ms, maxlen=LATENCY_WINDOW), deque(self.queue_ms, maxlen=LATENCY_WINDOW))

    def add_counts(self, other: SessionStats) -> None:
        """Fold `other`'s counts into these (latency windows are per session: not folded)."""
        self.received += other.received
        self.superseded += other.superseded
        self.served += other.served
        self.refreshes += other.refreshes
        self.refreshes_late += other.refreshes_late
        self.rejected.update(other.rejected)
        self.dropped.update(other.dropped)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


@dataclass(frozen=True)
class SessionSnapshot:
    listed: bool
    stats: SessionStats  # a copy


@dataclass(frozen=True)
class SessionTableSnapshot:
    """A copy of every counter of one engine (`SessionTable.snapshot`); percentiles are the caller's."""

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
        return self.dropped.get(UNKNOWN_CLIENT, 0)

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


@dataclass(frozen=True)
class _Accepted:
    """What the session rules change in a session for an observation they accept (`_accept`)."""

    switched: bool  # another session_nonce than the session follows: another client process
    restarted: bool  # a new process, or a nonce-less client's restart: the count starts afresh
    last: int | None  # the last served seq_id the session counts from then (restarted)
    last_s: float | None
    reset: bool  # per-episode state to drop (a new episode or a restarted client)


class SessionTable:
    def __init__(self, config: SessionTableConfig, scheduler: RequestScheduler,
                 rate_limit: RejectionRateLimit | None = None):
        self.config = config
        self.scheduler = scheduler
        self.rate_limit = rate_limit or RejectionRateLimit()
        # A scheduler that ranks by ExecutionInfo hears of a header-less observation only once the
        # executor decoded it (`unread`); others when it lands, and it is decoded only if served.
        # (The declared scheduler interface makes this an attribute every scheduler has.)
        self.needs_execution_info: bool = scheduler.needs_execution_info
        self.sessions: dict[str, Session] = {}
        self._unknown_open = 0  # sessions of clients not in the manifest
        self._lock = threading.Lock()
        # Counts that outlive sessions (a closed session's are folded in here).
        self.closed = SessionStats()
        self.unknown_refused: Counter = Counter()  # refused ids, bounded
        self.dropped: Counter = Counter()  # observations dropped before any session: reason -> count
        self.batch_sizes: deque = deque(maxlen=256)
        self.sessions_opened = 0
        self._opened: deque = deque(maxlen=OPENED_KEPT)  # sessions opened, not yet logged
        self.sessions_closed: Counter = Counter()  # reason -> count
        self.decoded_on_arrival = 0  # header-less observations decoded before the scheduler heard of them
        self.headers_read = 0  # observations whose header told the scheduler instead
        self._delisted: list[Session] = []  # closed by update_clients; handed out by the next expire()
        self._tokens: dict[str, None] = {}  # ids whose liveliness token is present and that have no session (bounded)
        self._pool_wanted = False  # an unknown id found the pool full since the last expire()
        self._maybe_unread = False  # an observation nothing is known of was admitted since the last unread()

    # -- Zenoh callback thread ----------------------------------------------------------------

    def admit(self, client_id: str, payload: bytes, now_s: float, header: ObservationHeader | None = None,
              header_error: ProtocolError | None = None, task: str | None = None) -> str | None:
        """Put an observation in its session's slot; None if kept, else why it was dropped (counted).

        `header` is what admission read of it (`server/admission.py`; None: sent without one, or
        in a version this server does not read), so that a late re-fetch refresh is dropped before
        it takes a slot; `header_error`: its header is malformed (kept with the slot and rejected,
        with its reason, by `schedule`); `task`: the multi-model task whose stream it came on, kept
        with it in the slot.
        """
        listed = client_id in self.config.listed
        with self._lock:
            session = self.sessions.get(client_id)
            if session is None:
                if not listed and not self.config.accept_unknown:
                    self.dropped[UNKNOWN_CLIENT] += 1
                    if client_id in self.unknown_refused or len(self.unknown_refused) < MAX_TRACKED_UNKNOWN:
                        self.unknown_refused[client_id] += 1
                    return UNKNOWN_CLIENT
                if not listed and self._unknown_open >= self.config.max_unknown_clients:
                    self.dropped[TOO_MANY_CLIENTS] += 1
                    self._pool_wanted = True  # the next expire() frees the places of ids without a token
                    return TOO_MANY_CLIENTS
                session = self._open(client_id, listed, now_s)
            stats = session.stats
            if self.rate_limit.blocked(client_id, now_s):
                stats.dropped[RATE_LIMITED] += 1  # not a rejection: the cool-down ends on time
                return RATE_LIMITED
            # `last_seen_s` moves only once the observation passes the session rules (`schedule`) or is
            # served: what is rejected keeps no session alive.
            if len(payload) > self.config.max_message_bytes:  # before it takes a slot
                self._count_rejection(session, TOO_LARGE, now_s)
                return TOO_LARGE
            if header is not None and header.refreshes_seq_id is not None:
                if self._refresh_is_late(session, header):
                    stats.refreshes_late += 1
                    return REFRESH_LATE
                stats.refreshes += 1
            stats.received += 1
            old = session.slot
            first = None
            if old is not None:
                stats.superseded += 1
                if (not old.announced and header is not None and header.refreshes_seq_id is not None
                        and old.request_seq == header.refreshes_seq_id):
                    first = old.first_arrival or (old.arrival_s, old.known.execution)
            session.slot = Slot(payload, now_s, header=header, error=header_error, first_arrival=first, task=task)
            if header is None and header_error is None:
                self._maybe_unread = True
        return None

    def on_token(self, client_id: str, alive: bool, now_s: float) -> None:
        """The client's liveliness token appeared or vanished.

        A session notes it; for an id without a session it is remembered (boundedly) so that the
        session it opens next knows its token is already there.
        """
        with self._lock:
            session = self.sessions.get(client_id)
            if session is not None:
                session.token_lost_s = None if alive else now_s
                session.token_seen = True  # (a token that vanished was there)
                if not alive:
                    session.token_gone_since_served = True
            elif alive:
                self._tokens.pop(client_id, None)
                if len(self._tokens) >= MAX_TRACKED_TOKENS:
                    del self._tokens[next(iter(self._tokens))]
                self._tokens[client_id] = None
            else:
                self._tokens.pop(client_id, None)

    # -- inference thread ---------------------------------------------------------------------

    def expire(self, now_s: float) -> list[Session]:
        """Close sessions whose token has been gone `liveliness_grace_s` or that had no accepted
        observation for `idle_timeout_s`; and, while the unknown pool is full and another id was
        refused a place, those of unknown ids whose token was not seen within `liveliness_grace_s`
        of their first observation (`no_token`). Without that pressure a client that declares no
        token (a benchmark's fake robot, a 1.0 client) keeps its session until it is idle."""
        cfg = self.config
        with self._lock:
            due = []
            pool_wanted, self._pool_wanted = self._pool_wanted, False
            for s in self.sessions.values():
                if s.token_lost_s is not None and now_s - s.token_lost_s >= cfg.liveliness_grace_s and s.token_seen:
                    due.append((s, "liveliness"))
                elif s.token_lost_s is not None and now_s - s.token_lost_s >= cfg.liveliness_grace_s and pool_wanted:
                    due.append((s, "no_token"))  # an unknown id without a token, while another id wants its place
                elif now_s - max(s.last_seen_s, s.slot.arrival_s if s.slot is not None else s.last_seen_s) \
                        >= cfg.idle_timeout_s:  # an observation still waiting to be judged counts
                    due.append((s, "idle"))
            for session, reason in due:
                self._close(session, reason)
            delisted, self._delisted = self._delisted, []
        return delisted + [s for s, _ in due]

    # -- any thread -----------------------------------------------------------------------------

    def update_clients(self, listed: frozenset[str], max_batch_size: int | None = None,
                       close: Collection[str] = ()) -> list[str]:
        """Take a new list of clients (a manifest reload; docs/server.md, "Reloading the client list").

        A newly listed client that has an unknown session keeps it, now on a reserved place; the
        session of a client no longer listed, or named in `close` (a robot of a task stream the server
        no longer hears), closes (reason `delisted`) and is handed to the shell by the next `expire()`,
        on the inference thread, like an expired one. Returns the ids closed.
        """
        listed = frozenset(listed)
        with self._lock:
            self.config = replace(self.config, listed=listed, max_batch_size=max_batch_size or self.config.max_batch_size)
            closing = []
            for session in list(self.sessions.values()):
                if session.client_id in close or (session.listed and session.client_id not in listed):
                    closing.append(session)
                elif session.client_id in listed and not session.listed:
                    session.listed = True
                    self._unknown_open -= 1
            for session in closing:
                self._close(session, "delisted")
            self._delisted += closing
        return [s.client_id for s in closing]

    def close_all(self) -> list[Session]:
        with self._lock:
            closing = list(self.sessions.values())
            for session in closing:
                self._close(session, "server_stop")
        return closing

    def drop_slots(self) -> None:
        """Forget every waiting observation (a standby stepping back)."""
        with self._lock:
            for session in self.sessions.values():
                session.slot = None

    def unread(self) -> list[Slot]:
        """For a scheduler that ranks by `ExecutionInfo`: the new observations nothing is known of yet
        (sent without a header, or with one of a version this server does not read). The shell has
        the executor decode each into its slot (`observation`, or `error`) before the next
        `schedule`, which announces them only then. Other schedulers: none (never decoded early)."""
        if not (self.needs_execution_info and self._maybe_unread):  # (the usual case: no lock, no scan)
            return []
        with self._lock:
            self._maybe_unread = False
            return [s.slot for s in self.sessions.values()
                    if s.slot is not None and not s.slot.announced and s.slot.known is None and s.slot.error is None]

    def schedule(self, now_s: float, *, exclude: Collection[str] = ()) -> Batch | None:
        """Announce new observations to the scheduler and let it pick up to `max_batch_size` sessions.

        Each new observation known here (from its header, or the executor's decode of a header-less
        one, `unread`) is judged, once, by the session rules: a refused one never reaches the
        scheduler and comes back in `Batch.rejected`, as does one whose header or body could not be
        read. The scheduler hears each accepted one with its `ExecutionInfo`. A header-less one not
        decoded yet waits in its slot for the next call when the scheduler ranks by `ExecutionInfo`,
        else is announced without it and judged once picked and decoded (`judge`). Clients in
        `exclude` (a request of theirs is still being computed) wait in their slot.
        """
        rejected: list[tuple[Session, Slot, str, str]] = []
        with self._lock:
            ready = self._announce(rejected, exclude)
            chosen = self.scheduler.pick(ready, now_s, self.config.max_batch_size) if ready else []
            items = self._take_slots(chosen)
        if not items and not rejected:
            return None
        return Batch(items, rejected)

    def rank(self, now_s: float, *, exclude: Collection[str] = ()) -> Ranking:
        """Rank, then take (an edge scheduler placing across engines, `server/dispatch.py`): announce
        and judge as `schedule` does, and return every ready client in the scheduler's order with its
        payload's size, and what was rejected. Nothing is taken: the caller places the order outside
        this table's lock and hands back what it dispatches (`take`)."""
        rejected: list[tuple[Session, Slot, str, str]] = []
        with self._lock:
            ready = self._announce(rejected, exclude)
            rank = getattr(self.scheduler, "rank", None)
            if not ready:
                order = []
            elif rank is not None:
                order = list(rank(ready, now_s))
            else:  # a scheduler with `pick` only: its whole order, taken as one decision
                order = list(self.scheduler.pick(ready, now_s, len(ready)))
            sizes = {c: len(self.sessions[c].slot.payload) for c in order}
        return Ranking(order, sizes, rejected)

    def take(self, chosen: Sequence[str], ranking: Ranking, now_s: float) -> Batch | None:
        """Take the slots of `chosen` (a subset of `ranking.order`, in order) and tell the scheduler
        what was taken of its order (`took`: the others were skipped). A client whose slot emptied
        meanwhile, or now holds a newer observation not yet judged, is left out (that one is
        announced and judged at the next round)."""
        with self._lock:
            took = getattr(self.scheduler, "took", None)
            if took is not None and ranking.order:
                took(list(chosen), ranking.order, now_s)
            items = self._take_slots(chosen)
        return Batch(items, []) if items else None  # (the ranking's rejections are the ranking's)

    def _announce(self, rejected: list, exclude: Collection[str]) -> list[str]:
        """Judge and announce the new observations (lock held); the ready clients not in `exclude`."""
        for session in self.sessions.values():
            slot = session.slot
            if slot is None or slot.announced:
                continue
            if slot.error is not None:
                rejected.append((session, slot, slot.error.reason, str(slot.error)))
                session.slot = None
                continue
            known = slot.known
            if known is None and self.needs_execution_info:
                continue  # not read yet: the next round's `unread`
            slot.announced = True
            if known is not None:
                if slot.header is not None:
                    self.headers_read += 1
                else:
                    self.decoded_on_arrival += 1
                why = None if slot.judged else self._judge(session, slot)  # (judged: a re-queued request)
                if why is not None:
                    rejected.append((session, slot, why, _rule_detail(session, known, why)))
                    session.slot = None
                    continue
            if slot.first_arrival is not None:  # a refresh: its request arrived first
                self.scheduler.on_arrival(session.client_id, *slot.first_arrival)
            self.scheduler.on_arrival(session.client_id, slot.arrival_s, known.execution if known else None)
        return [cid for cid, s in self.sessions.items() if s.slot is not None and s.slot.announced and cid not in exclude]

    def _take_slots(self, chosen: Sequence[str]) -> list[tuple[Session, Slot]]:
        items: list[tuple[Session, Slot]] = []
        for cid in dict.fromkeys(chosen):
            session = self.sessions.get(cid)
            if session is not None and session.slot is not None and session.slot.announced:
                items.append((session, session.slot))
                known = session.slot.known
                if known is not None:  # (a header-less one: once it is judged)
                    self._picked(session, known.session_nonce, known.seq_id)
                    session.computing = (known.session_nonce, known.seq_id)
                session.slot = None
        return items

    def requeue(self, session: Session, slot: Slot) -> bool:
        """Put a picked request back in its session's slot (an engine did not answer it in time, or
        answered what cannot be served): announced again to the scheduler by the next `schedule`,
        from its first arrival. False when the session closed or a newer observation already waits
        (that one stands for the client's request now)."""
        with self._lock:
            session.computing = None  # computed no longer, whether it goes back or a newer one stands for it
            if self.sessions.get(session.client_id) is not session or session.slot is not None:
                return False
            slot.announced = False
            session.slot = slot
            return True

    def judge(self, session: Session, slot: Slot) -> tuple[str, str] | None:
        """The session rules for a picked observation sent without a header, once the executor decoded
        it (`slot.observation`; a scheduler that does not rank by `ExecutionInfo` never needs it
        earlier): None to serve it, else (reason, detail): `replayed`, `nonce_required` or `seq_jump`.
        Every other observation was judged when the scheduler heard of it (`slot.judged`)."""
        with self._lock:
            if slot.judged:
                return None
            why = self._judge(session, slot)
            if why is not None:
                return why, _rule_detail(session, slot.known, why)
            self._picked(session, slot.known.session_nonce, slot.known.seq_id)
            session.computing = (slot.known.session_nonce, slot.known.seq_id)
            return None

    def take_reset(self, session: Session) -> bool:
        """Whether the runner must drop this session's per-episode state before serving it (once)."""
        with self._lock:
            reset, session.needs_reset = session.needs_reset, False
            return reset

    def reject(self, session: Session, reason: str, now_s: float, *, cool_down: bool = True) -> int:
        """Count a rejection of one of this session's observations; returns the session's total.
        `cool_down=False`: not the client's fault (an engine's error), never towards its cool-down."""
        with self._lock:
            return self._count_rejection(session, reason, now_s, cool_down)

    def release(self, session: Session) -> None:
        """The request picked for this session ends without being computed (refused once picked: its
        body unreadable, its task not served here): a resend of it is served, not `replayed`. (A
        computed one is released by `finish`, a re-queued one by `requeue`.)"""
        with self._lock:
            session.computing = None

    def finish(self, served: Sequence[tuple[Session, int, float, float]], picked: Sequence[str],
               now_s: float, duration_s: float) -> None:
        """After a forward pass: `served` = (session, seq_id, inference_ms, queue_ms) per chunk sent."""
        with self._lock:
            self.scheduler.on_served(list(picked), now_s, duration_s)
            if picked:
                self.batch_sizes.append(len(picked))
            for client_id in picked:  # served or failed: computed no longer (a resend of a failed one is served)
                session = self.sessions.get(client_id)
                if session is not None:
                    session.computing = None
            for session, seq_id, inference_ms, queue_ms in served:
                if self.sessions.get(session.client_id) is not session:
                    self.closed.served += 1  # closed meanwhile: only the total counts
                    continue
                stats = session.stats
                stats.served += 1
                # The served observation passed the session rules when it was announced: its seq_id
                # is within the bound of the stream `session.nonce` names.
                if session.last_served_seq is None or seq_id > session.last_served_seq:
                    session.last_served_seq = seq_id
                session.last_served_s = now_s
                session.last_seen_s = max(session.last_seen_s, now_s)
                session.token_gone_since_served = False
                self._picked(session, session.nonce, seq_id)  # (a header-less observation: now)
                stats.inference_ms.append(inference_ms)
                stats.queue_ms.append(queue_ms)

    # -- telemetry thread ---------------------------------------------------------------------

    def take_opened(self) -> list[tuple[str, bool]]:
        """(client id, listed) of the sessions opened since the last call (the newest `OPENED_KEPT`)."""
        with self._lock:
            out = list(self._opened)
            self._opened.clear()
            return out

    def snapshot(self) -> SessionTableSnapshot:
        """A copy of every counter (per session and of closed ones); the caller computes percentiles."""
        with self._lock:
            return SessionTableSnapshot(
                sessions={cid: SessionSnapshot(s.listed, s.stats.copy()) for cid, s in self.sessions.items()},
                closed=self.closed.copy(),
                dropped=dict(self.dropped),
                unknown_open=self._unknown_open,
                sessions_opened=self.sessions_opened,
                sessions_closed=dict(self.sessions_closed),
                batch_sizes=list(self.batch_sizes),
                headers_read=self.headers_read,
                decoded_on_arrival=self.decoded_on_arrival,
                scheduler=self.scheduler.stats(),
            )

    # -- internals (caller holds the lock) ----------------------------------------------------

    def _open(self, client_id: str, listed: bool, now_s: float) -> Session:
        session = self.sessions[client_id] = Session(client_id, listed, now_s)
        session.token_seen = client_id in self._tokens
        self._tokens.pop(client_id, None)
        if not listed and not session.token_seen:
            session.token_lost_s = now_s  # awaited: closed as `no_token` unless it shows within the grace
        if not listed:
            self._unknown_open += 1
        self.sessions_opened += 1
        self._opened.append((client_id, listed))  # logged by the inference thread (`take_opened`)
        return session

    def _close(self, session: Session, reason: str) -> None:
        if self.sessions.pop(session.client_id, None) is not session:
            return
        if not session.listed:
            self._unknown_open -= 1
        self.closed.add_counts(session.stats)
        self.sessions_closed[reason] += 1
        session.closed_reason = reason
        self.scheduler.forget(session.client_id)
        self.rate_limit.forget(session.client_id)
        session.slot = None

    @staticmethod
    def _picked(session: Session, nonce: int | None, seq_id: int) -> None:
        last = session.last_picked
        if last is None or last[0] != nonce or seq_id > last[1]:
            session.last_picked = (nonce, seq_id)

    @staticmethod
    def _refresh_is_late(session: Session, header: ObservationHeader) -> bool:
        """Whether a refresh's request no longer waits: it (or a later observation of this client
        process) was picked, or a newer request of this process waits in the slot."""
        request = header.refreshes_seq_id
        last = session.last_picked
        if last is not None and last[0] == header.session_nonce and request <= last[1]:
            return True
        waiting = session.slot
        return (waiting is not None and waiting.request_seq is not None
                and waiting.known.session_nonce == header.session_nonce and waiting.request_seq > request)

    def _judge(self, session: Session, slot: Slot) -> str | None:
        """The session rules (docs/protocol.md §10.5) for the slot's observation: None when it is
        accepted (and the session follows it from then on), else why it is refused (nothing changed)."""
        obs = slot.known
        verdict = _session_rules(session, obs, slot.arrival_s)
        slot.judged = True
        if isinstance(verdict, str):
            return verdict
        self._accept(session, obs, slot.arrival_s, verdict)
        return None

    def _accept(self, session: Session, obs: Observation | ObservationHeader, arrival_s: float,
                accepted: _Accepted) -> None:
        """What an accepted observation changes: the process and episode the session follows, the
        count its seq_ids are judged by, and (a new episode or process) its per-episode state."""
        if accepted.switched:
            if session.last_served_seq is not None:
                past = session.past_nonces
                if len(past) >= MAX_PAST_NONCES:  # the newest goes first: the oldest are the robot's own
                    past.pop(next(reversed(past)))
                past[session.nonce] = (session.last_served_seq, session.last_served_s)
            session.past_nonces.pop(obs.session_nonce, None)
        if accepted.restarted:
            session.last_served_seq, session.last_served_s = accepted.last, accepted.last_s
            session.last_picked = None
        session.nonce = obs.session_nonce
        session.episode_id = obs.episode_id
        session.last_seen_s = max(session.last_seen_s, arrival_s)
        if accepted.reset:
            session.needs_reset = True
            self.scheduler.forget(session.client_id)  # its task starts again (wait ratio: a new task)

    def _count_rejection(self, session: Session, reason: str, now_s: float, cool_down: bool = True) -> int:
        session.stats.rejected[reason] += 1
        # Neither a failed publish nor a session-rule refusal is the client's bad input: a duplicate
        # costs one MessagePack decode (a header read, with a header), a client restarting after one
        # must not find itself cooled down, and a forger must not be able to cool a robot down by
        # sending what the session rules refuse on its key.
        if cool_down and reason not in (Reason.PUBLISH_ERROR, REPLAYED, NONCE_REQUIRED, SEQ_JUMP):
            self.rate_limit.on_rejection(session.client_id, now_s)
        return sum(session.stats.rejected.values())


def _session_rules(session: Session, obs: Observation | ObservationHeader, arrival_s: float) -> str | _Accepted:
    """The session rules (docs/protocol.md §10.5), pure: why `obs` is refused, or what accepting it changes."""
    nonce = obs.session_nonce
    if nonce is None and session.nonce is not None:
        return NONCE_REQUIRED  # a nonce-less sender cannot take over, or advance, a nonce-ful process's session
    # A new nonce is a new client process: its seq_ids start afresh. A nonce this session followed
    # before picks up its own count again, so that switching to a made-up nonce and back cannot
    # lift the bound on the real one.
    switched = nonce != session.nonce
    if not switched and session.computing == (nonce, obs.seq_id):
        return REPLAYED  # the request itself is being computed (on an engine): a resend of it is not a second request
    last, last_s = session.past_nonces.get(nonce, (None, None)) if switched else (
        session.last_served_seq, session.last_served_s)
    restarted = switched
    if last is not None:
        if obs.seq_id <= last:
            if nonce is not None or not (session.token_gone_since_served
                                         or arrival_s - last_s >= NONCELESS_REPLAY_WINDOW_S):
                return REPLAYED
            restarted, last, last_s = True, None, None  # a nonce-less client's restart
        elif obs.seq_id - last > MAX_SEQ_STEP + MAX_SEQ_RATE_HZ * max(0.0, arrival_s - last_s):
            return SEQ_JUMP
    reset = (restarted and (session.nonce is not None or session.last_served_seq is not None)) or (
        obs.episode_id != session.episode_id and session.episode_id is not None)
    return _Accepted(switched, restarted, last, last_s, reset)


def _rule_detail(session: Session, obs: Observation | ObservationHeader, reason: str) -> str:
    """The detail logged with a rejection by the session rules."""
    if reason == NONCE_REQUIRED:
        return f"seq_id {obs.seq_id} carries no session_nonce; this client's session follows nonce {session.nonce}"
    if reason == SEQ_JUMP:
        return (f"seq_id {obs.seq_id} runs further ahead of the last one served for session_nonce "
                f"{obs.session_nonce} than a client can count")
    if session.computing == (obs.session_nonce, obs.seq_id):
        return f"seq_id {obs.seq_id} is being computed already (a resend of the request)"
    return f"seq_id {obs.seq_id} already served"
