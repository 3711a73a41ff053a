"""The session table of one model: sessions, newest-only slots, and whom to serve next (with its
request scheduler). Not an engine: engines (`server/engine/`, `server/dispatch/`) run what this table picks.

Pure decisions: no Zenoh, no torch, no decoding and no clock (every call takes `now_s`, seconds
of one process's monotonic clock), and no calls back into the shell. The shell (`server/shell/policy_server.py`,
through `server/engine/admission.py`) calls it from two threads:

    Zenoh callback thread    admit(client, payload, now, header, header_error) -> None (kept) or why it was dropped
                             on_token(client, alive, now)        (the client's liveliness token)
    inference thread         expire(now) -> closed sessions      (the shell forgets their runner state)
                             unread() -> slots                   (header-less observations the scheduler must rank:
                                                                  the shell has the runner adapter decode them)
                             schedule(now) -> Batch              (session rules, whom to serve in one forward pass)
                             judge(session, slot)                (session rules of a picked header-less one, decoded)
                             take_reset / finish / requeue       (bookkeeping after the pass)
    telemetry thread         snapshot() -> SessionTableSnapshot        (a typed copy of the counters; no percentiles)

What an observation is (its `seq_id`, `session_nonce`, `episode_id`, `ExecutionInfo`) is read once:
from its header, by the shell at admission (`server/engine/admission.py`), and kept in the slot with the
payload. The session rules (`server/session_table/rules.py`) judge it when the scheduler first hears of it,
in `schedule`, and the verdict stays in the slot (`judged`). An observation sent without a header is
decoded by the runner adapter: before the scheduler hears of it when the scheduler ranks by
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

Which sessions exist (opening, closing, liveliness, the pool of unknown ids) is the roster's
(`server/session_table/roster.py`); which observation a session accepts, the session rules'
(`server/session_table/rules.py`, docs/protocol.md §10.5, docs/security.md "Sessions against a forger").
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import replace

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.messages import ObservationHeader
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.scheduling.request_schedulers import RequestScheduler
from lerobot_zenoh.scheduling.scheduler_interface import ranked, tell_took
from lerobot_zenoh.server.session_table import rules
from lerobot_zenoh.server.session_table.rate_limit import RejectionRateLimit
from lerobot_zenoh.server.session_table.roster import SessionRoster
from lerobot_zenoh.server.session_table.rules import (
    MAX_SEQ_RATE_HZ,
    MAX_SEQ_STEP,
    NONCE_REQUIRED,
    NONCELESS_REPLAY_WINDOW_S,
    REPLAYED,
    SEQ_JUMP,
)
from lerobot_zenoh.server.session_table.records import (
    Batch,
    Ranking,
    Session,
    SessionSnapshot,
    SessionStats,
    SessionTableConfig,
    SessionTableSnapshot,
    Slot,
)

# (What the table's callers import from here: the data in `sessions.py`, the rules' reasons.)
__all__ = ["Batch", "MAX_SEQ_RATE_HZ", "MAX_SEQ_STEP", "NONCELESS_REPLAY_WINDOW_S", "NONCE_REQUIRED",
           "RATE_LIMITED", "REFRESH_LATE", "REPLAYED", "Ranking", "SEQ_JUMP", "Session", "SessionStats",
           "SessionTable", "SessionTableConfig", "SessionTableSnapshot", "Slot", "TOO_LARGE",
           "TOO_MANY_CLIENTS", "UNKNOWN_CLIENT"]

# Drop reasons of `admit` (docs/protocol.md, "Rejections").
UNKNOWN_CLIENT = Reason.UNKNOWN_CLIENT
TOO_MANY_CLIENTS = Reason.TOO_MANY_CLIENTS
RATE_LIMITED = Reason.RATE_LIMITED
TOO_LARGE = Reason.TOO_LARGE
REFRESH_LATE = "refreshes_late"  # a re-fetch refresh whose request no longer waits (counted, not a rejection)


class SessionTable:
    def __init__(self, config: SessionTableConfig, scheduler: RequestScheduler,
                 rate_limit: RejectionRateLimit | None = None):
        self.config = config
        self.scheduler = scheduler
        self.rate_limit = rate_limit or RejectionRateLimit()
        # A scheduler that ranks by ExecutionInfo hears of a header-less observation only once the
        # runner adapter decoded it (`unread`); others when it lands, and it is decoded only if served.
        # (The declared scheduler interface makes this an attribute every scheduler has.)
        self.needs_execution_info: bool = scheduler.needs_execution_info
        self._lock = threading.Lock()  # guards the roster too
        self.roster = SessionRoster(self._forget)
        self.sessions: dict[str, Session] = self.roster.sessions  # (the roster's: never replaced)
        self.dropped: Counter = self.roster.dropped  # observations dropped before any session: reason -> count
        self.batch_sizes: deque = deque(maxlen=256)
        self.decoded_on_arrival = 0  # header-less observations decoded before the scheduler heard of them
        self.headers_read = 0  # observations whose header told the scheduler instead
        self._maybe_unread = False  # an observation nothing is known of was admitted since the last unread()

    # -- Zenoh callback thread ----------------------------------------------------------------

    def admit(self, client_id: str, payload: bytes, now_s: float, header: ObservationHeader | None = None,
              header_error: ProtocolError | None = None, task: str | None = None, refused: str | None = None) -> str | None:
        """Put an observation in its session's slot; None if kept, else why it was dropped (counted).
        `header`: what admission read of it (`server/engine/admission.py`; None: none, or of a version this
        server does not read); `header_error`: its header is malformed (rejected, with its reason, by
        `schedule`); `task`: the multi-model task whose stream it came on; `refused`: why admission
        refused its body on arrival (`task_too_long`), a rejection of the session like `too_large`."""
        listed = client_id in self.config.listed
        with self._lock:
            session = self.sessions.get(client_id) or self.roster.place(client_id, listed, self.config, now_s,
                                                                         self.rate_limit.blocked)
            if isinstance(session, str):
                return session  # unknown_client, rate_limited (a fresh unknown id), too_many_clients
            stats = session.stats
            if self.rate_limit.blocked(client_id, now_s):
                stats.dropped[RATE_LIMITED] += 1  # not a rejection: the cool-down ends on time
                return RATE_LIMITED
            # `last_seen_s` moves only once the observation passes the session rules (`schedule`) or is
            # served: what is rejected keeps no session alive.
            refused = TOO_LARGE if len(payload) > self.config.max_message_bytes else refused
            if refused is not None:  # before it takes a slot
                self._count_rejection(session, refused, now_s)
                return refused
            if header is not None and header.refreshes_seq_id is not None:
                if rules.refresh_is_late(session, header):
                    stats.refreshes_late += 1
                    return REFRESH_LATE
                stats.refreshes += 1
            session.put(payload, now_s, header, header_error, task)
            if header is None and header_error is None:
                self._maybe_unread = True
        return None

    def on_token(self, client_id: str, alive: bool, now_s: float) -> None:
        """The client's liveliness token appeared or vanished (`SessionRoster.on_token`)."""
        with self._lock:
            self.roster.on_token(client_id, alive, now_s)

    # -- inference thread ---------------------------------------------------------------------

    def expire(self, now_s: float) -> list[Session]:
        """Close the sessions that are due (`SessionRoster.expire`: their token gone for
        `liveliness_grace_s`, idle for `idle_timeout_s`, or, while the unknown pool is wanted, an
        unknown id's token never seen) and return them with those `update_clients` closed since."""
        with self._lock:
            return self.roster.expire(now_s, self.config)

    # -- any thread -----------------------------------------------------------------------------

    def update_clients(self, listed: frozenset[str], max_batch_size: int | None = None,
                       close: Collection[str] = ()) -> list[str]:
        """Take a new list of clients (a manifest reload; docs/server.md, "Reloading the client list"):
        `SessionRoster.relist`; `close`: robots of a task stream the server no longer hears. Returns
        the ids closed (handed to the shell by the next `expire`, like expired ones)."""
        listed = frozenset(listed)
        with self._lock:
            self.config = replace(self.config, listed=listed, max_batch_size=max_batch_size or self.config.max_batch_size)
            return [s.client_id for s in self.roster.relist(listed, close)]

    def close_all(self) -> list[Session]:
        with self._lock:
            return self.roster.close_all()

    def waiting(self, *, computing: bool = False) -> int:
        """Observations waiting in a slot (and, with `computing`, requests being computed)."""
        with self._lock:
            return sum(1 for s in self.sessions.values() if s.slot is not None or (computing and s.computing is not None))

    def drop_slots(self) -> None:
        """Forget every waiting observation (a standby stepping back)."""
        with self._lock:
            for session in self.sessions.values():
                session.slot = None

    def unread(self) -> list[Slot]:
        """For a scheduler that ranks by `ExecutionInfo`: the new observations nothing is known of yet
        (sent without a header, or with one of a version this server does not read). The shell has
        the runner adapter decode each into its slot (`observation`, or `error`) before the next
        `schedule`, which announces them only then. Other schedulers: none (never decoded early)."""
        if not (self.needs_execution_info and self._maybe_unread):  # (the usual case: no lock, no scan)
            return []
        with self._lock:
            self._maybe_unread = False
            return [s.slot for s in self.sessions.values()
                    if s.slot is not None and not s.slot.announced and s.slot.known is None and s.slot.error is None]

    def schedule(self, now_s: float, *, exclude: Collection[str] = ()) -> Batch | None:
        """Announce new observations to the scheduler and let it pick up to `max_batch_size` sessions.

        Each new observation known here (from its header, or the runner adapter's decode of a header-less
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
        """Rank, then take (an edge scheduler placing across engines, `server/dispatch/dispatcher.py`): announce
        and judge as `schedule` does, and return every ready client in the scheduler's order with its
        payload's size, and what was rejected. Nothing is taken: the caller places the order outside
        this table's lock and hands back what it dispatches (`take`)."""
        rejected: list[tuple[Session, Slot, str, str]] = []
        with self._lock:
            ready = self._announce(rejected, exclude)
            order = ranked(self.scheduler, ready, now_s) if ready else []
            sizes = {c: len(self.sessions[c].slot.payload) for c in order}
        return Ranking(order, sizes, rejected)

    def take(self, chosen: Sequence[str], ranking: Ranking, now_s: float) -> Batch | None:
        """Take the slots of `chosen` (a subset of `ranking.order`, in order) and tell the scheduler
        what was taken of its order (`took`: the others were skipped). A client whose slot emptied
        meanwhile, or now holds a newer observation not yet judged, is left out (that one is
        announced and judged at the next round)."""
        with self._lock:
            tell_took(self.scheduler, chosen, ranking.order, now_s)
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
                    rejected.append((session, slot, why, rules.detail(session, known, why)))
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
                    rules.picked(session, known.session_nonce, known.seq_id)
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
        """The session rules for a picked observation sent without a header, once the runner adapter
        decoded it (`slot.observation`; a scheduler that does not rank by `ExecutionInfo` never needs it
        earlier): None to serve it, else (reason, detail): `replayed`, `nonce_required` or `seq_jump`.
        Every other observation was judged when the scheduler heard of it (`slot.judged`)."""
        with self._lock:
            if slot.judged:
                return None
            why = self._judge(session, slot)
            if why is not None:
                return why, rules.detail(session, slot.known, why)
            rules.picked(session, slot.known.session_nonce, slot.known.seq_id)
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
                if self.sessions.get(session.client_id) is not session:  # closed meanwhile: only the totals count it
                    self.roster.closed.count_served(inference_ms, queue_ms, window=False)
                    continue
                rules.served(session, seq_id, now_s)
                session.stats.count_served(inference_ms, queue_ms)

    # -- telemetry thread ---------------------------------------------------------------------

    def take_opened(self) -> list[tuple[str, bool]]:
        """(client id, listed) of the sessions opened since the last call (the newest `OPENED_KEPT`)."""
        with self._lock:
            return self.roster.take_opened()

    def snapshot(self) -> SessionTableSnapshot:
        """A copy of every counter (per session and of closed ones); the caller computes percentiles."""
        with self._lock:
            return SessionTableSnapshot(
                sessions={cid: SessionSnapshot(s.listed, s.stats.copy()) for cid, s in self.sessions.items()},
                closed=self.roster.closed.copy(),
                dropped=dict(self.dropped),
                unknown_open=self.roster.unknown_open,
                sessions_opened=self.roster.opened_total,
                sessions_closed=dict(self.roster.closed_by_reason),
                batch_sizes=list(self.batch_sizes),
                headers_read=self.headers_read,
                decoded_on_arrival=self.decoded_on_arrival,
                scheduler=self.scheduler.stats(),
            )

    # -- internals (caller holds the lock) ----------------------------------------------------

    def _forget(self, client_id: str) -> None:
        """A session closed: what else keeps per-client state forgets it."""
        self.scheduler.forget(client_id)
        self.rate_limit.forget(client_id)

    def _judge(self, session: Session, slot: Slot) -> str | None:
        """The session rules for the slot's observation: None when accepted, else why it is refused."""
        why, reset = rules.judge(session, slot)
        if reset:
            self.scheduler.forget(session.client_id)  # its task starts again (wait ratio: a new task)
        return why

    def _count_rejection(self, session: Session, reason: str, now_s: float, cool_down: bool = True) -> int:
        session.stats.rejected[reason] += 1
        if cool_down and rules.cools_down(reason):
            self.rate_limit.on_rejection(session.client_id, now_s)
        return sum(session.stats.rejected.values())
