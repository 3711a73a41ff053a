"""A per-client cool-down for clients whose observations keep being rejected (pure; times passed in).

A hostile or broken peer can send observations that the server must decode before rejecting.
The newest-only slot already bounds that to one decode per client per inference turn, but the
decode still costs the inference thread, and the callback still stores every payload. After
`max_rejections` rejections within `window_s`, a client's observations are dropped in the Zenoh
callback, before they take a slot, for `cooldown_s` (counted as `rate_limited`). Other clients
are untouched: the state is per client id.

Except for ids the manifest does not list (a server with `accept_unknown_clients`): given
`listed`, every other id shares one window and one cool-down. Ids cost nothing to invent, so a
limit per unknown id would let a peer that takes a fresh id for each bad observation never be
cooled down (each refusal costs the inference thread a decode); shared, every unknown client is
held off together, and a listed robot keeps its own limit. The shared state also outlives the
sessions of the ids that fed it (`forget` leaves it alone), and the limiter holds state for the
listed ids and one more, whatever the number of ids seen.

Drops during a cool-down are not rejections: a client that fixes itself is served again as soon
as the cool-down ends, instead of being held off by its own retries.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

#: The state every id that is not listed shares (not a valid client id: "*" is reserved in keys).
UNLISTED = "*"


@dataclass
class _ClientWindow:
    times_s: deque = field(default_factory=deque)
    cooldown_until_s: float = float("-inf")
    last_s: float = float("-inf")  # its latest rejection


class RejectionRateLimit:
    """`blocked(client, now)` after more than `max_rejections` rejections in `window_s`.

    `listed(client_id)`: whether an id has a limit of its own; the others share one (`UNLISTED`).
    None: every id has its own (a server that serves only the ids it lists)."""

    def __init__(self, max_rejections: int = 20, window_s: float = 1.0, cooldown_s: float = 5.0,
                 listed: Callable[[str], bool] | None = None):
        if max_rejections < 1 or window_s <= 0 or cooldown_s < 0:
            raise ValueError("max_rejections >= 1, window_s > 0 and cooldown_s >= 0 are required")
        self.max_rejections = max_rejections
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self.listed = listed
        self._clients: dict[str, _ClientWindow] = {}

    def _owner(self, client_id: str) -> str:
        return client_id if self.listed is None or self.listed(client_id) else UNLISTED

    def blocked(self, client_id: str, now_s: float) -> bool:
        state = self._clients.get(self._owner(client_id))
        return state is not None and now_s < state.cooldown_until_s

    def rejected_since(self, client_id: str, since_s: float) -> bool:
        """Whether the client (an unlisted id: any unlisted id) had a rejection at or after `since_s`."""
        state = self._clients.get(self._owner(client_id))
        return state is not None and state.last_s >= since_s

    def on_rejection(self, client_id: str, now_s: float) -> bool:
        """Record one rejection; True when it starts a cool-down."""
        state = self._clients.setdefault(self._owner(client_id), _ClientWindow())
        state.last_s = now_s
        if now_s < state.cooldown_until_s:
            return False
        times = state.times_s
        times.append(now_s)
        while times and times[0] <= now_s - self.window_s:
            times.popleft()
        if len(times) > self.max_rejections:
            times.clear()
            state.cooldown_until_s = now_s + self.cooldown_s
            return True
        return False

    def forget(self, client_id: str) -> None:
        """A client's session closed: its own state goes; the shared state of unlisted ids stays
        (it ends with its window and cool-down), so closing sessions does not reset it."""
        self._clients.pop(client_id, None)  # (never UNLISTED: "*" is no client id)
