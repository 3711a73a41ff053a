"""The session rules (docs/protocol.md §10.5): which observation a session accepts, and what
accepting it changes. Pure functions of a `Session` and what is known of one observation (its
header, or its decode); the session table calls them under its lock.

A session follows one client process, named by its `session_nonce`. An observation without a
nonce never joins a session that has one (`nonce_required`); one whose `seq_id` runs further ahead
of the last served than a client could have counted since (`MAX_SEQ_STEP` + `MAX_SEQ_RATE_HZ` per
second) is refused (`seq_jump`); one at or below the last served is `replayed`; a new nonce starts
the count afresh, so a forger who does not know the robot's nonce costs it at most a reset.
"""

from __future__ import annotations

from dataclasses import dataclass

from lerobot_zenoh.protocol.messages import Observation, ObservationHeader
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.session_table.records import Session, Slot

REPLAYED = Reason.REPLAYED
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


@dataclass(frozen=True)
class Accepted:
    """What the session rules change in a session for an observation they accept (`accept`)."""

    switched: bool  # another session_nonce than the session follows: another client process
    restarted: bool  # a new process, or a nonce-less client's restart: the count starts afresh
    last: int | None  # the last served seq_id the session counts from then (restarted)
    last_s: float | None
    reset: bool  # per-episode state to drop (a new episode or a restarted client)


def judge(session: Session, slot: Slot) -> tuple[str | None, bool]:
    """Judge the slot's observation: (None, reset) when it is accepted (the session follows it from
    then on; `reset`: its per-episode state is to be dropped), else (why it is refused, False) with
    nothing changed."""
    obs = slot.known
    verdict = rules(session, obs, slot.arrival_s)
    slot.judged = True
    if isinstance(verdict, str):
        return verdict, False
    accept(session, obs, slot.arrival_s, verdict)
    return None, verdict.reset


def rules(session: Session, obs: Observation | ObservationHeader, arrival_s: float) -> str | Accepted:
    """Why `obs` is refused, or what accepting it changes (nothing is changed here)."""
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
    return Accepted(switched, restarted, last, last_s, reset)


def accept(session: Session, obs: Observation | ObservationHeader, arrival_s: float, accepted: Accepted) -> None:
    """What an accepted observation changes: the process and episode the session follows, the count
    its seq_ids are judged by, and (a new episode or process) that its per-episode state is dropped."""
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


def picked(session: Session, nonce: int | None, seq_id: int) -> None:
    """Note the newest observation picked for inference (a refresh of a request at or below it is late)."""
    last = session.last_picked
    if last is None or last[0] != nonce or seq_id > last[1]:
        session.last_picked = (nonce, seq_id)


def cools_down(reason: str) -> bool:
    """Whether a rejection for `reason` counts towards the client's cool-down. Neither a failed
    publish nor a session-rule refusal is the client's bad input: a duplicate costs one MessagePack
    decode (a header read, with a header), a client restarting after one must not find itself
    cooled down, and a forger must not be able to cool a robot down by sending what these rules
    refuse on its key."""
    return reason not in (Reason.PUBLISH_ERROR, REPLAYED, NONCE_REQUIRED, SEQ_JUMP)


def served(session: Session, seq_id: int, now_s: float) -> None:
    """A chunk was served for `seq_id`. It passed these rules when it was announced: its seq_id is
    within the bound of the stream `session.nonce` names."""
    if session.last_served_seq is None or seq_id > session.last_served_seq:
        session.last_served_seq = seq_id
    session.last_served_s = now_s
    session.last_seen_s = max(session.last_seen_s, now_s)
    session.token_gone_since_served = False
    picked(session, session.nonce, seq_id)  # (a header-less observation: now)


def refresh_is_late(session: Session, header: ObservationHeader) -> bool:
    """Whether a refresh's request no longer waits: it (or a later observation of this client
    process) was picked, or a newer request of this process waits in the slot."""
    request = header.refreshes_seq_id
    last = session.last_picked
    if last is not None and last[0] == header.session_nonce and request <= last[1]:
        return True
    waiting = session.slot
    return (waiting is not None and waiting.request_seq is not None
            and waiting.known.session_nonce == header.session_nonce and waiting.request_seq > request)


def detail(session: Session, obs: Observation | ObservationHeader, reason: str) -> str:
    """The detail logged with a rejection by the session rules."""
    if reason == NONCE_REQUIRED:
        return f"seq_id {obs.seq_id} carries no session_nonce; this client's session follows nonce {session.nonce}"
    if reason == SEQ_JUMP:
        return (f"seq_id {obs.seq_id} runs further ahead of the last one served for session_nonce "
                f"{obs.session_nonce} than a client can count")
    if session.computing == (obs.session_nonce, obs.seq_id):
        return f"seq_id {obs.seq_id} is being computed already (a resend of the request)"
    return f"seq_id {obs.seq_id} already served"
