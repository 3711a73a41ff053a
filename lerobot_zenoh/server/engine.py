"""The serving engine of one model: sessions, newest-only slots, and whom to serve next.

Pure decisions: no Zenoh, no torch, no decoding of its own and no clock (every call takes `now_s`,
seconds of one process's monotonic clock). The shell (`server/server.py`) calls it from two threads:

    Zenoh callback thread    admit(client, payload, now, attachment, read_header) -> None (kept) or why it was dropped
                             on_token(client, alive, now)        (the client's liveliness token)
    inference thread         expire(now) -> closed sessions      (the shell forgets their runner state)
                             schedule(now, peek, read_header) -> Batch  (whom to serve in one forward pass)
                             check(session, observation, now)    (session rules once an observation is decoded)
                             finish(batch, outcomes, ...)        (bookkeeping after the pass)
    telemetry thread         snapshot()                          (a copy of the counters; no percentiles)

One lock guards all of it and is held only for dictionary work: never across decoding (`admit`
reads the observation's header and `schedule` calls `peek` outside it), inference, publishing or
percentile computation.

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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation, ObservationHeader
from lerobot_zenoh.scheduling.request_schedulers import RequestScheduler
from lerobot_zenoh.server.rate_limit import RejectionRateLimit

#: How many distinct refused unknown ids are counted one by one (hostile peers can invent many).
MAX_TRACKED_UNKNOWN = 256

# Drop reasons of `admit` (docs/protocol.md, "Rejections").
UNKNOWN_CLIENT = "unknown_client"
TOO_MANY_CLIENTS = "too_many_clients"
RATE_LIMITED = "rate_limited"
TOO_LARGE = "too_large"
REPLAYED = "replayed"
REFRESH_LATE = "refreshes_late"  # a re-fetch refresh whose request no longer waits (counted, not a rejection)
# Session rules (`_check`; docs/protocol.md §10.5).
NONCE_REQUIRED = "nonce_required"  # no session_nonce, in a session that follows a nonce-ful client process
SEQ_JUMP = "seq_jump"  # seq_id further ahead of the last served one than a client can count

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


@dataclass(frozen=True)
class EngineConfig:
    listed: frozenset[str]  # client ids named in the manifest: always admitted
    accept_unknown: bool = False  # whether other ids are served (from a bounded pool)
    max_unknown_clients: int = 64
    idle_timeout_s: float = 60.0
    liveliness_grace_s: float = 3.0
    max_message_bytes: int = 64 * 2**20
    max_batch_size: int = 1


@dataclass
class Slot:
    """The newest unserved observation of one session (raw bytes until the inference thread decodes it)."""

    payload: bytes
    arrival_s: float
    attachment: bytes | None = None  # the observation's header (protocol.md §5.1.1), still bytes
    announced: bool = False  # the scheduler has been told (`on_arrival`)
    header: ObservationHeader | None = None  # set once read (by `admit` when given `read_header`)
    observation: Observation | None = None  # set on the inference thread once decoded
    error: Exception | None = None  # the decoding error, when it could not be decoded
    # A refresh that replaced its request before the scheduler heard of it carries the request's
    # first arrival (and its ExecutionInfo), so that the request keeps its place in line.
    first_arrival: tuple[float, ExecutionInfo | None] | None = None

    @property
    def request_seq(self) -> int | None:
        """The request this observation stands for: the one it refreshes, else its own seq_id (None: no header read)."""
        if self.header is None:
            return None
        refreshes = self.header.refreshes_seq_id
        return self.header.seq_id if refreshes is None else refreshes


@dataclass
class SessionStats:
    received: int = 0
    superseded: int = 0
    served: int = 0
    refreshes: int = 0  # re-fetch refreshes that took the slot (their request still waited); also in `received`
    refreshes_late: int = 0  # refreshes dropped on arrival: their request no longer waited
    rejected: Counter = field(default_factory=Counter)  # reason -> count ("replayed" included)
    dropped: Counter = field(default_factory=Counter)  # dropped before a slot: rate_limited (not a rejection)
    inference_ms: deque = field(default_factory=lambda: deque(maxlen=256))
    queue_ms: deque = field(default_factory=lambda: deque(maxlen=256))


@dataclass
class Session:
    client_id: str
    listed: bool
    opened_s: float
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
    token_lost_s: float | None = None  # when its liveliness token vanished, or (unknown ids) since when it is awaited
    needs_reset: bool = False  # per-episode state to drop in the runner before its next inference
    closed_reason: str | None = None  # liveliness | no_token | idle | delisted | server_stop, once closed
    slot: Slot | None = None
    stats: SessionStats = field(default_factory=SessionStats)


@dataclass
class Batch:
    """What `schedule` hands to the executor: sessions picked for one forward pass with their slots,
    and slots rejected before taking a seat (undecodable, replayed)."""

    items: list[tuple[Session, Slot]]
    rejected: list[tuple[Session, Slot, str, str]]  # (session, slot, reason, detail)


Peek = Callable[[bytes], Observation]  # decode an observation (raises on bad bytes)
ReadHeader = Callable[[bytes], ObservationHeader | None]  # None: a header version this server does not read


class Engine:
    def __init__(self, config: EngineConfig, scheduler: RequestScheduler,
                 rate_limit: RejectionRateLimit | None = None):
        self.config = config
        self.scheduler = scheduler
        self.rate_limit = rate_limit or RejectionRateLimit()
        self.needs_execution_info = bool(getattr(scheduler, "needs_execution_info", False))
        self.sessions: dict[str, Session] = {}
        self._unknown_open = 0  # sessions of clients not in the manifest
        self._lock = threading.Lock()
        # Totals that outlive sessions (a closed session's counts are folded in here).
        self.totals: Counter = Counter()
        self.unknown_refused: Counter = Counter()  # refused ids, bounded
        self.dropped: Counter = Counter()  # observations dropped before any session: reason -> count
        self.batch_sizes: deque = deque(maxlen=256)
        self.sessions_opened = 0
        self.sessions_closed: Counter = Counter()  # reason -> count
        self.decoded_on_arrival = 0  # observations `peek`-decoded to read their ExecutionInfo
        self.headers_read = 0  # observations whose header told it instead
        self._delisted: list[Session] = []  # closed by update_clients; handed out by the next expire()
        self._tokens: dict[str, None] = {}  # ids whose liveliness token is present and that have no session (bounded)
        self._pool_wanted = False  # an unknown id found the pool full since the last expire()

    # -- Zenoh callback thread ----------------------------------------------------------------

    def admit(self, client_id: str, payload: bytes, now_s: float, attachment: bytes | None = None,
              read_header: ReadHeader | None = None) -> str | None:
        """Put an observation in its session's slot; None if kept, else why it was dropped (counted).

        With `read_header`, the header (`attachment`, 44 or 56 bytes and the episode id: a struct
        unpack, no decode) is read here, outside the lock, so that a late re-fetch refresh is dropped
        before it takes a slot; a malformed header is kept with the slot and rejected by `schedule`.
        """
        listed = client_id in self.config.listed
        header: ObservationHeader | None = None
        header_error: Exception | None = None
        if attachment is not None and read_header is not None:
            try:
                header = read_header(attachment)
            except Exception as exc:  # a ProtocolError: rejected with its reason by `schedule`
                header_error = exc
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
            # `last_seen_s` moves only once the observation passes the session rules (`_check`) or is
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
                    first = old.first_arrival or (old.arrival_s, old.header.execution)
            session.slot = Slot(payload, now_s, attachment, header=header, error=header_error, first_arrival=first)
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

    def schedule(self, now_s: float, peek: Peek | None = None, read_header: ReadHeader | None = None, *,
                 choose: Callable[[list[str], dict[str, Slot]], list[str]] | None = None,
                 exclude: Collection[str] = ()) -> Batch | None:
        """Announce new observations to the scheduler and let it pick up to `max_batch_size` sessions.

        Schedulers that rank by the robot's execution phase (`needs_execution_info`) need each new
        observation's `ExecutionInfo` on arrival: `read_header` reads it from the observation's
        header (its Zenoh attachment, 44 bytes and the episode id), or, for an observation sent
        without one (or with a header version this server does not read), `peek` decodes the
        observation; both outside the lock, and the session rules (`check`) are applied then. Other
        schedulers never cost a decode for an observation that is superseded before it is served.

        With `choose` (an edge scheduler placing across engines, `server/dispatch.py`), the scheduler
        orders every ready session and `choose(order, slots)` picks those to dispatch now, any number;
        clients in `exclude` (a request of theirs is still running on an engine) wait in their slot.
        """
        with self._lock:
            fresh = [s for s in self.sessions.values() if s.slot is not None and not s.slot.announced]
            for session in fresh:
                session.slot.announced = True
            fresh_slots = [(s, s.slot) for s in fresh]
        if self.needs_execution_info and peek is not None:
            for _, slot in fresh_slots:
                if slot.error is not None:
                    continue  # a malformed header, found by `admit`: rejected below
                try:
                    if slot.header is None and slot.attachment is not None and read_header is not None:
                        slot.header = read_header(slot.attachment)
                    if slot.header is not None:
                        self.headers_read += 1
                    else:
                        slot.observation = peek(slot.payload)
                        self.decoded_on_arrival += 1
                except Exception as exc:  # a ProtocolError, counted by the executor with its reason
                    slot.error = exc
        rejected: list[tuple[Session, Slot, str, str]] = []
        with self._lock:
            for session, slot in fresh_slots:
                if session.slot is not slot or self.sessions.get(session.client_id) is not session:
                    continue  # superseded or closed meanwhile
                if slot.error is not None:
                    rejected.append((session, session.slot, getattr(slot.error, "reason", "bad_message"), str(slot.error)))
                    session.slot = None
                    continue
                execution: ExecutionInfo | None = None
                known = slot.observation or slot.header  # both carry seq_id, episode_id, session_nonce
                if known is not None:
                    why = self._check(session, known, slot.arrival_s)
                    if why is not None:
                        rejected.append((session, slot, why, self.rule_detail(session, known, why)))
                        session.slot = None
                        continue
                    execution = known.execution
                if slot.first_arrival is not None:  # a refresh: its request arrived first
                    self.scheduler.on_arrival(session.client_id, *slot.first_arrival)
                self.scheduler.on_arrival(session.client_id, slot.arrival_s, execution)
            ready = [cid for cid, s in self.sessions.items()
                     if s.slot is not None and s.slot.announced and cid not in exclude]
            if choose is None:
                chosen = self.scheduler.pick(ready, now_s, self.config.max_batch_size) if ready else []
            else:
                chosen = self.scheduler.pick(ready, now_s, len(ready), choose=lambda order: choose(
                    order, {c: self.sessions[c].slot for c in order})) if ready else []
            items: list[tuple[Session, Slot]] = []
            for cid in dict.fromkeys(chosen):
                session = self.sessions.get(cid)
                if session is not None and session.slot is not None:
                    items.append((session, session.slot))
                    if session.slot.header is not None:
                        self._picked(session, session.slot.header.session_nonce, session.slot.header.seq_id)
                    session.slot = None
        if not items and not rejected:
            return None
        return Batch(items, rejected)

    def requeue(self, session: Session, slot: Slot) -> bool:
        """Put a picked request back in its session's slot (an engine did not answer it in time, or
        answered what cannot be served): announced again to the scheduler by the next `schedule`,
        from its first arrival. False when the session closed or a newer observation already waits
        (that one stands for the client's request now)."""
        with self._lock:
            if self.sessions.get(session.client_id) is not session or session.slot is not None:
                return False
            slot.announced = False
            session.slot = slot
            return True

    def check(self, session: Session, observation: Observation, arrival_s: float | None = None) -> str | None:
        """Apply the session rules to a decoded observation that arrived at `arrival_s` (default: the
        session's last accepted one): None to serve it, else `replayed`, `nonce_required` or `seq_jump`."""
        with self._lock:
            return self._check(session, observation, arrival_s)

    @staticmethod
    def rule_detail(session: Session, obs: Observation | ObservationHeader, reason: str) -> str:
        """The detail logged with a rejection by the session rules."""
        if reason == NONCE_REQUIRED:
            return f"seq_id {obs.seq_id} carries no session_nonce; this client's session follows nonce {session.nonce}"
        if reason == SEQ_JUMP:
            return (f"seq_id {obs.seq_id} runs further ahead of the last one served for session_nonce "
                    f"{obs.session_nonce} than a client can count")
        return f"seq_id {obs.seq_id} already served"

    def take_reset(self, session: Session) -> bool:
        """Whether the runner must drop this session's per-episode state before serving it (once)."""
        with self._lock:
            reset, session.needs_reset = session.needs_reset, False
            return reset

    def reject(self, session: Session, reason: str, now_s: float) -> int:
        """Count a rejection of one of this session's observations; returns the session's total."""
        with self._lock:
            return self._count_rejection(session, reason, now_s)

    def finish(self, served: Sequence[tuple[Session, int, float, float]], picked: Sequence[str],
               now_s: float, duration_s: float) -> None:
        """After a forward pass: `served` = (session, seq_id, inference_ms, queue_ms) per chunk sent."""
        with self._lock:
            self.scheduler.on_served(list(picked), now_s, duration_s)
            if picked:
                self.batch_sizes.append(len(picked))
            for session, seq_id, inference_ms, queue_ms in served:
                self.totals["served"] += 1
                if self.sessions.get(session.client_id) is not session:
                    continue  # closed meanwhile: only the total counts
                stats = session.stats
                stats.served += 1
                # The served observation passed `_check` on this thread just before (nothing else was
                # checked for this session since): its seq_id is within the bound of the stream
                # `session.nonce` names.
                if session.last_served_seq is None or seq_id > session.last_served_seq:
                    session.last_served_seq = seq_id
                session.last_served_s = now_s
                session.last_seen_s = max(session.last_seen_s, now_s)
                session.token_gone_since_served = False
                self._picked(session, session.nonce, seq_id)  # (a header-less observation: now)
                stats.inference_ms.append(inference_ms)
                stats.queue_ms.append(queue_ms)

    # -- telemetry thread ---------------------------------------------------------------------

    def snapshot(self) -> dict:
        """A copy of every counter (per session and totals); the caller computes percentiles."""
        with self._lock:
            return {
                "sessions": {
                    cid: {
                        "listed": s.listed,
                        "received": s.stats.received,
                        "superseded": s.stats.superseded,
                        "served": s.stats.served,
                        "refreshes": s.stats.refreshes,
                        "refreshes_late": s.stats.refreshes_late,
                        "rejected": dict(s.stats.rejected),
                        "dropped": dict(s.stats.dropped),
                        "inference_ms": list(s.stats.inference_ms),
                        "queue_ms": list(s.stats.queue_ms),
                    }
                    for cid, s in self.sessions.items()
                },
                "totals": dict(self.totals),
                "dropped": dict(self.dropped),
                "unknown_refused": self.dropped[UNKNOWN_CLIENT],
                "unknown_open": self._unknown_open,
                "sessions_opened": self.sessions_opened,
                "sessions_closed": dict(self.sessions_closed),
                "batch_sizes": list(self.batch_sizes),
                "decoded_on_arrival": self.decoded_on_arrival,
                "headers_read": self.headers_read,
                "scheduler": self.scheduler.stats(),
            }

    # -- internals (caller holds the lock) ----------------------------------------------------

    def _open(self, client_id: str, listed: bool, now_s: float) -> Session:
        session = self.sessions[client_id] = Session(client_id, listed, now_s, now_s)
        session.token_seen = client_id in self._tokens
        self._tokens.pop(client_id, None)
        if not listed and not session.token_seen:
            session.token_lost_s = now_s  # awaited: closed as `no_token` unless it shows within the grace
        if not listed:
            self._unknown_open += 1
        self.sessions_opened += 1
        return session

    def _close(self, session: Session, reason: str) -> None:
        if self.sessions.pop(session.client_id, None) is not session:
            return
        if not session.listed:
            self._unknown_open -= 1
        st = session.stats
        self.totals.update(received=st.received, superseded=st.superseded, refreshes=st.refreshes,
                           refreshes_late=st.refreshes_late)
        self.totals.update({f"rejected.{k}": v for k, v in st.rejected.items()})
        self.totals.update({f"dropped.{k}": v for k, v in st.dropped.items()})
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
        return (waiting is not None and waiting.header is not None and waiting.request_seq is not None
                and waiting.header.session_nonce == header.session_nonce and waiting.request_seq > request)

    def _check(self, session: Session, obs: Observation | ObservationHeader, arrival_s: float | None) -> str | None:
        """The session rules (docs/protocol.md §10.5). Every refusal comes before any change: an
        observation that is refused resets, advances and keeps alive nothing."""
        nonce = obs.session_nonce
        if nonce is None and session.nonce is not None:
            return NONCE_REQUIRED  # a nonce-less sender cannot take over, or advance, a nonce-ful process's session
        arrival_s = session.last_seen_s if arrival_s is None else arrival_s
        # A new nonce is a new client process: its seq_ids start afresh. A nonce this session
        # followed before picks up its own count again, so that switching to a made-up nonce and
        # back cannot lift the bound on the real one.
        switched = nonce != session.nonce
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
        if switched:
            if session.last_served_seq is not None:
                past = session.past_nonces
                if len(past) >= MAX_PAST_NONCES:  # the newest goes first: the oldest are the robot's own
                    past.pop(next(reversed(past)))
                past[session.nonce] = (session.last_served_seq, session.last_served_s)
            session.past_nonces.pop(nonce, None)
        if restarted:
            session.last_served_seq, session.last_served_s = last, last_s
            session.last_picked = None
        session.nonce = nonce
        session.episode_id = obs.episode_id
        session.last_seen_s = max(session.last_seen_s, arrival_s)
        if reset:
            session.needs_reset = True
            self.scheduler.forget(session.client_id)  # its task starts again (wait ratio: a new task)
        return None

    def _count_rejection(self, session: Session, reason: str, now_s: float) -> int:
        session.stats.rejected[reason] += 1
        # Neither a failed publish nor a session-rule refusal is the client's bad input: a duplicate
        # costs one MessagePack decode (a header read, with a header), a client restarting after one
        # must not find itself cooled down, and a forger must not be able to cool a robot down by
        # sending what the session rules refuse on its key.
        if reason not in ("publish_error", REPLAYED, NONCE_REQUIRED, SEQ_JUMP):
            self.rate_limit.on_rejection(session.client_id, now_s)
        return sum(session.stats.rejected.values())
