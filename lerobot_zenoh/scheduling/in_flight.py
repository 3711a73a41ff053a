"""The robot client's requests in flight: one record per request, one table, one lock.

Pure bookkeeping with an injected clock: every method that depends on time takes ``now_s`` (one
process's ``time.perf_counter()``); nothing here reads a clock, sleeps or does I/O.

A *request* is an observation sent for a chunk (seq_id ``r``). While it waits, the client may publish
*refreshes* of it (re-fetch, docs/protocol.md §10.7): fresh captures with their own seq_ids that stand
for ``r``. Everything the client knows about ``r`` lives in one :class:`Request` record:

    seq_id, sent_s              the request and its first send (its round trip runs from here)
    published_s                 its last publication, first send or refresh (the re-fetch clock)
    nonce                       the session nonce it was sent under
    captures                    seq_id -> :class:`Capture` (step at capture, capture time, predicted
                                delay) of the request and of each refresh: what a chunk answering that
                                seq_id is aligned to (``aligned`` False once forgotten: a new episode)
    outstanding                 True while it holds a send slot; False once presumed lost (timed out
                                or forgotten): a late answer is still measured and merged

Three readers, one table (:class:`InFlightTable`):

- the RTT estimate (``RttTracker``) takes a sample from :meth:`InFlightTable.answer`;
- the send rule (``SendTrigger``) counts outstanding records, presumes old ones lost
  (:meth:`InFlightTable.expire`) and finds the one due for a refresh;
- the chunk intake (``ChunkIntake``) gets the capture the chunk answers from the same
  :meth:`InFlightTable.answer` call, so a chunk is resolved, timed, freed and aligned in one step
  under one lock.

An answered request leaves the table at once (a second answer, to it or to one of its refreshes, is
unknown). Bounds: at most ``max_requests`` records (the oldest leaves first, counted as evicted), at
most ``max_refreshes`` refreshes remembered per request, and a record leaves ``max_age_s`` after its
first send whatever its state (counted as expired): nothing here grows with time or with what a
server sends back.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from lerobot_zenoh.errors import ConfigError

__all__ = ["Answer", "Capture", "InFlightTable", "Request"]


@dataclass(frozen=True, slots=True)
class Capture:
    """One publication of a request: the request itself or one of its refreshes."""

    seq_id: int
    step: int | None  # the step row 0 of its chunk is meant for (None: not tracked by a chunk intake)
    captured_s: float
    predicted_delay_steps: int | None = None  # what a real-time-chunking observation carried


@dataclass(slots=True)
class Request:
    """Everything known about one request in flight (see the module docstring)."""

    seq_id: int
    sent_s: float
    published_s: float
    nonce: int | None = None
    outstanding: bool = True
    captures: dict[int, Capture] = field(default_factory=dict)
    aligned: bool = True  # False once its captures were forgotten (a new episode): answers carry none

    @property
    def refreshes(self) -> int:
        return sum(1 for seq in self.captures if seq != self.seq_id)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the table knew about the seq_id a chunk answers (:meth:`InFlightTable.answer`)."""

    seq_id: int
    request_seq: int  # the request answered: seq_id itself, or the request a refresh stood for
    rtt_s: float | None  # from the request's first send; None when the request was unknown
    slot: str  # "answered" (it held a slot), "late" (presumed lost before), or "unknown"
    capture: Capture | None  # the publication answered, None when unknown or forgotten (`forget_captures`)


class InFlightTable:
    """Requests in flight by seq_id, and the refreshes that stand for them; thread-safe.

    Args:
        max_requests: most records kept; the oldest leaves beyond it (``evicted``).
        max_age_s: a record leaves this long after its first send (``expired``); None: never.
        max_refreshes: most refreshes remembered per request (the oldest forgotten beyond it).
    """

    def __init__(self, *, max_requests: int = 256, max_age_s: float | None = 60.0, max_refreshes: int = 64) -> None:
        if max_requests < 1:
            raise ConfigError("in_flight.max_requests", f"must be at least 1, got {max_requests}")
        if max_age_s is not None and not (math.isfinite(max_age_s) and max_age_s > 0):
            raise ConfigError("in_flight.max_age_s", f"must be a positive number or None, got {max_age_s}")
        if max_refreshes < 0:
            raise ConfigError("in_flight.max_refreshes", f"must be >= 0, got {max_refreshes}")
        self.max_requests = max_requests
        self.max_age_s = max_age_s
        self.max_refreshes = max_refreshes
        self._lock = threading.Lock()
        self._records: OrderedDict[int, Request] = OrderedDict()  # by first send, oldest first
        self._request_of: dict[int, int] = {}  # refresh seq_id -> its request's seq_id (an index of `captures`)
        self._outstanding = 0  # records with outstanding=True (an index: decide() reads it every period)
        self.evicted = 0
        self.expired = 0

    # -- writing

    def add_request(self, seq_id: int, now_s: float, *, step: int | None = None, captured_s: float | None = None,
                    predicted_delay_steps: int | None = None, nonce: int | None = None) -> None:
        """Request `seq_id` leaves at `now_s` and holds a slot; a reused seq_id starts afresh."""
        seq_id = int(seq_id)
        capture = Capture(seq_id, None if step is None else int(step), float(now_s if captured_s is None else captured_s),
                          None if predicted_delay_steps is None else int(predicted_delay_steps))
        with self._lock:
            self._drop(seq_id)
            self._records[seq_id] = Request(seq_id, float(now_s), float(now_s), nonce, True, {seq_id: capture})
            self._outstanding += 1
            self._bound(now_s)

    def add_refresh(self, seq_id: int, request_seq: int, now_s: float, *, step: int | None = None,
                    predicted_delay_steps: int | None = None) -> bool:
        """Refresh `seq_id` of the outstanding request `request_seq` leaves at `now_s`. False (nothing
        recorded) when the request is no longer outstanding (answered, timed out, forgotten)."""
        seq_id, request_seq = int(seq_id), int(request_seq)
        with self._lock:
            record = self._records.get(request_seq)
            if record is None or not record.outstanding:
                return False
            record.published_s = float(now_s)
            record.captures[seq_id] = Capture(seq_id, None if step is None else int(step), float(now_s),
                                              None if predicted_delay_steps is None else int(predicted_delay_steps))
            self._request_of[seq_id] = request_seq
            while len(record.captures) > self.max_refreshes + 1:  # the request's own capture stays
                oldest = next(s for s in record.captures if s != request_seq)
                del record.captures[oldest]
                self._request_of.pop(oldest, None)
            return True

    def answer(self, seq_id: int, now_s: float) -> Answer:
        """A chunk answering `seq_id` arrived at `now_s`: resolve it to its request, take the round trip
        from the request's first send, free its slot and forget the request (with every refresh).

        Raises ``ValueError`` (and changes nothing) when `now_s` precedes the send: two clocks mixed.
        """
        seq_id = int(seq_id)
        with self._lock:
            request_seq = self._request_of.get(seq_id, seq_id)
            record = self._records.get(request_seq)
            if record is None:
                return Answer(seq_id, request_seq, None, "unknown", None)
            rtt_s = now_s - record.sent_s
            if rtt_s < 0:
                raise ValueError(f"reply to seq {seq_id} at {now_s} precedes its send at {record.sent_s}: mixed clocks?")
            slot = "answered" if record.outstanding else "late"
            capture = record.captures.get(seq_id) if record.aligned else None
            self._drop(request_seq)
            return Answer(seq_id, request_seq, rtt_s, slot, capture)

    def expire(self, now_s: float, timeout_s: float) -> list[int]:
        """Presume lost (free the slot of) every outstanding request sent `timeout_s` or longer ago.
        Returns their seq_ids, oldest first; their records stay for a late answer."""
        lost: list[int] = []
        with self._lock:
            if self._outstanding:
                for record in self._records.values():
                    if now_s - record.sent_s < timeout_s:
                        break  # oldest first: the rest are younger
                    if record.outstanding:
                        record.outstanding = False
                        lost.append(record.seq_id)
                self._outstanding -= len(lost)
            self._bound(now_s)
        return lost

    def forget_outstanding(self) -> list[int]:
        """Presume every outstanding request lost now (records kept for late answers)."""
        with self._lock:
            lost = [r.seq_id for r in self._records.values() if r.outstanding]
            for seq in lost:
                self._records[seq].outstanding = False
            self._outstanding = 0
            return lost

    def forget_captures(self) -> int:
        """Forget what every publication was captured at (a new episode): later answers are still timed
        and free their slots, but carry no capture. Returns how many captures were forgotten."""
        with self._lock:
            n = sum(len(r.captures) for r in self._records.values() if r.aligned)
            for record in self._records.values():
                record.aligned = False
            return n

    def remove(self, seq_id: int) -> bool:
        """Drop a request without answering it. Returns whether it was there."""
        with self._lock:
            return self._drop(int(seq_id))

    # -- reading

    def request_of(self, seq_id: int) -> int:
        """The request a seq_id stands for: the one it refreshes, else itself."""
        with self._lock:
            return self._request_of.get(seq_id, seq_id)

    def refresh_due(self, now_s: float, after_s: float) -> int | None:
        """The oldest outstanding request last published `after_s` or longer ago, or None."""
        with self._lock:
            if not self._outstanding:
                return None
            for record in self._records.values():
                if record.outstanding and now_s - record.published_s >= after_s:
                    return record.seq_id
        return None

    def get(self, seq_id: int) -> Request | None:
        """A copy of the record of request `seq_id` (not of a refresh), or None."""
        with self._lock:
            record = self._records.get(seq_id)
            if record is None:
                return None
            return Request(record.seq_id, record.sent_s, record.published_s, record.nonce, record.outstanding,
                           dict(record.captures), record.aligned)

    def __contains__(self, seq_id: int) -> bool:
        with self._lock:
            return seq_id in self._records

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    @property
    def captures(self) -> int:
        """Publications whose capture is remembered (requests and refreshes)."""
        with self._lock:
            return sum(len(r.captures) for r in self._records.values() if r.aligned)

    # -- internals (the caller holds the lock)

    def _drop(self, request_seq: int) -> bool:
        record = self._records.pop(request_seq, None)
        if record is None:
            return False
        if record.outstanding:
            self._outstanding -= 1
        for seq in record.captures:
            if seq != request_seq:
                self._request_of.pop(seq, None)
        return True

    def _bound(self, now_s: float) -> None:
        while len(self._records) > self.max_requests:
            self._drop(next(iter(self._records)))
            self.evicted += 1
        if self.max_age_s is not None:
            while self._records:
                oldest = next(iter(self._records.values()))
                if now_s - oldest.sent_s < self.max_age_s:
                    break
                self._drop(oldest.seq_id)
                self.expired += 1
