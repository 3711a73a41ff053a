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

Sessions (docs/architecture.md, "Sessions"): one per client id, opened by its first accepted
observation, closed when the client's liveliness token has been gone for `liveliness_grace_s`,
after `idle_timeout_s` without an observation, or at `close_all()`. Clients listed in the manifest
always get a session; unknown clients (when accepted) share a pool of `max_unknown_clients`
places that is freed as their sessions close, so no number of invented ids can lock out a listed
robot, and every id a remote party makes up expires.
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
REFRESH_LATE = "refresh_late"  # a re-fetch refresh whose request no longer waits (counted, not a rejection)


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
    # (session_nonce, seq_id) of the newest observation picked for inference: a refresh of a request
    # at or below it is late (set when picked, from the header; for a header-less one when served).
    last_picked: tuple[int | None, int] | None = None
    token_lost_s: float | None = None  # when its liveliness token vanished (None: present or never seen)
    needs_reset: bool = False  # per-episode state to drop in the runner before its next inference
    closed_reason: str | None = None  # liveliness | idle | server_stop, once closed
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
                    return TOO_MANY_CLIENTS
                session = self._open(client_id, listed, now_s)
            stats = session.stats
            if self.rate_limit.blocked(client_id, now_s):
                stats.dropped[RATE_LIMITED] += 1  # not a rejection: the cool-down ends on time
                return RATE_LIMITED
            session.last_seen_s = now_s
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
        """The client's liveliness token appeared or vanished (only known sessions are affected)."""
        with self._lock:
            session = self.sessions.get(client_id)
            if session is not None:
                session.token_lost_s = None if alive else now_s

    # -- inference thread ---------------------------------------------------------------------

    def expire(self, now_s: float) -> list[Session]:
        """Close sessions whose token has been gone `liveliness_grace_s` or that were idle `idle_timeout_s`."""
        cfg = self.config
        with self._lock:
            due = [(s, "liveliness" if s.token_lost_s is not None and now_s - s.token_lost_s >= cfg.liveliness_grace_s
                    else "idle")
                   for s in self.sessions.values()
                   if (s.token_lost_s is not None and now_s - s.token_lost_s >= cfg.liveliness_grace_s)
                   or now_s - s.last_seen_s >= cfg.idle_timeout_s]
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
                    why = self._check(session, known)
                    if why is not None:
                        rejected.append((session, slot, why, f"seq_id {known.seq_id} already served"))
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

    def check(self, session: Session, observation: Observation) -> str | None:
        """Apply the session rules to a decoded observation: None to serve it, or `replayed`."""
        with self._lock:
            return self._check(session, observation)

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
                if session.last_served_seq is None or seq_id > session.last_served_seq:
                    session.last_served_seq = seq_id
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

    def _check(self, session: Session, obs: Observation | ObservationHeader) -> str | None:
        # The replay check comes first: an old observation of this process must not reset anything.
        restarted = obs.session_nonce is not None and session.nonce is not None and obs.session_nonce != session.nonce
        if not restarted and session.last_served_seq is not None and obs.seq_id <= session.last_served_seq:
            return REPLAYED
        reset = restarted or (obs.episode_id != session.episode_id and session.episode_id is not None)
        if restarted:  # a restarted client: its seq_ids start again
            session.last_served_seq = None
        if obs.session_nonce is not None:
            session.nonce = obs.session_nonce
        session.episode_id = obs.episode_id
        if reset:
            session.needs_reset = True
            self.scheduler.forget(session.client_id)  # its task starts again (wait ratio: a new task)
        return None

    def _count_rejection(self, session: Session, reason: str, now_s: float) -> int:
        session.stats.rejected[reason] += 1
        # Neither a failed publish nor a replay is the client's bad input: a duplicate costs one
        # MessagePack decode, and a client restarting after one must not find itself cooled down.
        if reason not in ("publish_error", REPLAYED):
            self.rate_limit.on_rejection(session.client_id, now_s)
        return sum(session.stats.rejected.values())
