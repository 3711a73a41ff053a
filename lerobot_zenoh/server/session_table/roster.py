"""Which sessions of one model exist: opening, closing, liveliness tokens, and the pool of places
for clients the manifest does not list. The session table holds one and calls it under its own
lock (every method here assumes that lock is held).

A session is opened by a client's first admitted observation and closed when its liveliness token
has been gone for `liveliness_grace_s`, after `idle_timeout_s` without an accepted observation, when
the client is no longer listed (`delisted`), or at a stop (`server_stop`). Unknown clients (when
accepted) share `max_unknown_clients` places; once the pool is full and another unknown id asks for
a place, the sessions of unknown ids whose token was not seen within the grace close (`no_token`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection

from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.session_table.records import Session, SessionStats, SessionTableConfig

#: How many distinct refused unknown ids are counted one by one (hostile peers can invent many).
MAX_TRACKED_UNKNOWN = 256
#: Liveliness tokens remembered for ids that have no session yet (a client declares its token
#: before its first observation); the oldest are forgotten first.
MAX_TRACKED_TOKENS = 4096
#: Session openings kept for the log between two expiry passes (a flood of new ids logs this many).
OPENED_KEPT = 64


class SessionRoster:
    def __init__(self, forget: Callable[[str], None]):
        self._forget = forget  # what else keeps per-client state (the scheduler, the rate limit)
        self.sessions: dict[str, Session] = {}
        self.dropped: Counter = Counter()  # observations dropped before any session: reason -> count
        self.unknown_refused: Counter = Counter()  # refused ids, bounded
        self.unknown_open = 0  # sessions of clients not in the manifest
        self.closed = SessionStats()  # the counts of closed sessions, folded in
        self.opened_total = 0
        self.closed_by_reason: Counter = Counter()
        self._opened: deque = deque(maxlen=OPENED_KEPT)  # sessions opened, not yet logged
        self._delisted: list[Session] = []  # closed by `relist`; handed out by the next `expire`
        self._tokens: dict[str, None] = {}  # ids whose liveliness token is present and that have no session (bounded)
        self.pool_wanted = False  # an unknown id found the pool full since the last `expire`

    def place(self, client_id: str, listed: bool, cfg: SessionTableConfig, now_s: float,
              blocked: Callable[[str, float], bool]) -> Session | str:
        """A session for a client that has none (opened), or why it gets none (counted in `dropped`):
        an unknown id when they are not accepted, while the cool-down unknown ids share runs
        (`blocked`, server/session_table/rate_limit.py: waited out before it takes a place), or when the pool of
        unknown ids is full."""
        if not listed and not cfg.accept_unknown:
            self.dropped[Reason.UNKNOWN_CLIENT] += 1
            if client_id in self.unknown_refused or len(self.unknown_refused) < MAX_TRACKED_UNKNOWN:
                self.unknown_refused[client_id] += 1
            return Reason.UNKNOWN_CLIENT
        if not listed and blocked(client_id, now_s):
            self.dropped[Reason.RATE_LIMITED] += 1
            return Reason.RATE_LIMITED
        if not listed and self.unknown_open >= cfg.max_unknown_clients:
            self.dropped[Reason.TOO_MANY_CLIENTS] += 1
            self.pool_wanted = True  # the next `expire` frees the places of ids without a token
            return Reason.TOO_MANY_CLIENTS
        return self.open(client_id, listed, now_s)

    def open(self, client_id: str, listed: bool, now_s: float) -> Session:
        session = self.sessions[client_id] = Session(client_id, listed, now_s)
        session.token_seen = client_id in self._tokens
        self._tokens.pop(client_id, None)
        if not listed and not session.token_seen:
            session.token_lost_s = now_s  # awaited: closed as `no_token` unless it shows within the grace
        if not listed:
            self.unknown_open += 1
        self.opened_total += 1
        self._opened.append((client_id, listed))  # logged by the inference thread (`take_opened`)
        return session

    def close(self, session: Session, reason: str) -> None:
        if self.sessions.pop(session.client_id, None) is not session:
            return
        if not session.listed:
            self.unknown_open -= 1
        self.closed.add_counts(session.stats)
        self.closed_by_reason[reason] += 1
        session.closed_reason = reason
        self._forget(session.client_id)
        session.slot = None

    def on_token(self, client_id: str, alive: bool, now_s: float) -> None:
        """The client's liveliness token appeared or vanished: a session notes it; for an id without
        a session it is remembered (boundedly) so that the session it opens next knows it is there."""
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

    def expire(self, now_s: float, cfg: SessionTableConfig) -> list[Session]:
        """Close the sessions that are due (see the module's docstring); with those `relist` closed
        since the last call, return them."""
        due = []
        pool_wanted, self.pool_wanted = self.pool_wanted, False
        for s in self.sessions.values():
            if s.token_lost_s is not None and now_s - s.token_lost_s >= cfg.liveliness_grace_s and s.token_seen:
                due.append((s, "liveliness"))
            elif s.token_lost_s is not None and now_s - s.token_lost_s >= cfg.liveliness_grace_s and pool_wanted:
                due.append((s, "no_token"))  # an unknown id without a token, while another id wants its place
            elif now_s - max(s.last_seen_s, s.slot.arrival_s if s.slot is not None else s.last_seen_s) \
                    >= cfg.idle_timeout_s:  # an observation still waiting to be judged counts
                due.append((s, "idle"))
        for session, reason in due:
            self.close(session, reason)
        delisted, self._delisted = self._delisted, []
        return delisted + [s for s, _ in due]

    def relist(self, listed: frozenset[str], close: Collection[str]) -> list[Session]:
        """A new client list: a newly listed client with an unknown session keeps it, now on a
        reserved place; one no longer listed, or named in `close`, is closed (`delisted`) and handed
        out by the next `expire`. Returns those closed."""
        closing = []
        for session in list(self.sessions.values()):
            if session.client_id in close or (session.listed and session.client_id not in listed):
                closing.append(session)
            elif session.client_id in listed and not session.listed:
                session.listed = True
                self.unknown_open -= 1
        for session in closing:
            self.close(session, "delisted")
        self._delisted += closing
        return closing

    def close_all(self) -> list[Session]:
        closing = list(self.sessions.values())
        for session in closing:
            self.close(session, "server_stop")
        return closing

    @property
    def tokens_remembered(self) -> int:
        """Liveliness tokens remembered for ids without a session (at most `MAX_TRACKED_TOKENS`)."""
        return len(self._tokens)

    def take_opened(self) -> list[tuple[str, bool]]:
        out = list(self._opened)
        self._opened.clear()
        return out
