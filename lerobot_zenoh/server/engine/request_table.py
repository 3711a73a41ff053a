"""The edge scheduler's requests being computed: one record per request, wherever it runs (pure).

Each request the dispatcher hands to an engine (the local one included) gets a `request_id` and a
record binding it to exactly what it answers: this scheduler process (`edge_incarnation`, new at
every start), the client, the session nonce and the seq_id of the observation. An answer is
delivered only when every one of those matches an outstanding record of the engine it was sent
to; anything else is refused with a counted reason and delivered to nobody. The table also owns
"being computed" (a client with a record is not placed again), timeouts and what is taken back
when an engine goes down or restarts.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from lerobot_zenoh.scheduling.placement import Estimate

__all__ = ["InFlight", "RequestTable", "MATCHED"]

MATCHED = "matched"


@dataclass
class InFlight:
    """A request placed on an engine and not answered yet."""

    request_id: int
    engine_id: str
    session: Any  # server.session_table.Session
    slot: Any  # server.session_table.Slot
    seq_id: int
    nonce: int | None
    dispatched_s: float
    request_bytes: int = 0
    estimate: Estimate | None = None
    observation: object = None  # the decoded Observation (remote engines: kept to build the chunk)
    admitted_s: float = 0.0  # when the request reached this scheduler (its slot's first arrival)
    queue_estimate_s: float | None = None  # expected admission -> start of its batch, at placement

    @property
    def client_id(self) -> str:
        return self.session.client_id


class RequestTable:
    """Outstanding requests by id; ids count up from 1 within one `edge_incarnation`."""

    def __init__(self, edge_incarnation: str):
        self.edge_incarnation = edge_incarnation
        self._ids = itertools.count(1)
        self._by_id: dict[int, InFlight] = {}
        self.last_id = 0  # the newest id handed out

    def next_id(self) -> int:
        self.last_id = next(self._ids)
        return self.last_id

    def add(self, flight: InFlight) -> None:
        if flight.request_id in self._by_id:
            raise ValueError(f"request {flight.request_id} is outstanding already")
        self._by_id[flight.request_id] = flight

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(list(self._by_id.values()))

    def get(self, request_id: int) -> InFlight | None:
        return self._by_id.get(request_id)

    def engine_of(self, request_id: int) -> str | None:
        """The engine an outstanding request is on; None when it is not outstanding. One dict read:
        safe from a Zenoh callback while the inference thread changes the table."""
        flight = self._by_id.get(request_id)
        return None if flight is None else flight.engine_id

    def on(self, engine_id: str) -> list[InFlight]:
        """The requests outstanding on one engine, oldest first."""
        return [f for f in self._by_id.values() if f.engine_id == engine_id]

    def count_on(self, engine_id: str) -> int:
        return sum(1 for f in self._by_id.values() if f.engine_id == engine_id)

    def clients(self) -> set[str]:
        """Clients with a request being computed (not placed again until it is answered)."""
        return {f.client_id for f in self._by_id.values()}

    def take(self, request_id: int) -> InFlight | None:
        """Remove and return one record (an answer of the local engine, a timeout, a re-queue)."""
        return self._by_id.pop(request_id, None)

    def expired(self, now_s: float, bound_s: float, engines: Collection[str]) -> list[InFlight]:
        """Remove and return the requests on `engines` dispatched more than `bound_s` ago."""
        out = [f for f in self._by_id.values() if f.engine_id in engines and now_s - f.dispatched_s > bound_s]
        for f in out:
            del self._by_id[f.request_id]
        return out

    def take_all(self, engine_id: str) -> list[InFlight]:
        """Remove and return every request outstanding on `engine_id` (down, restarted, refused)."""
        out = self.on(engine_id)
        for f in out:
            del self._by_id[f.request_id]
        return out

    def match(self, engine_id: str, request_id: int, edge_incarnation: str, client_id: str, seq_id: int,
              nonce: int | None) -> tuple[InFlight | None, str]:
        """The record an answer is for, removed, and `MATCHED`; or None and why it is refused:
        `stale_incarnation` (asked by an earlier process of this scheduler), `late` (no such request
        outstanding: re-queued, answered, or never sent), `mismatched` (another engine's request, or
        not the client, nonce and seq_id the request was for)."""
        if edge_incarnation != self.edge_incarnation:
            return None, "stale_incarnation"
        flight = self._by_id.get(request_id)
        if flight is None:
            return None, "late"
        if (flight.engine_id, flight.client_id, flight.seq_id, flight.nonce) != (engine_id, client_id, seq_id, nonce):
            return None, "mismatched"  # the real answer may still come: the record stays
        del self._by_id[request_id]
        return flight, MATCHED
