"""A per-client cool-down for clients whose observations keep being rejected (pure; times passed in).

A hostile or broken peer can send observations that the server must decode before rejecting.
The newest-only slot already bounds that to one decode per client per inference turn, but the
decode still costs the inference thread, and the callback still stores every payload. After
`max_rejections` rejections within `window_s`, a client's observations are dropped in the Zenoh
callback, before they take a slot, for `cooldown_s` (counted as `rate_limited`). Other clients
are untouched: the state is per client id.

Drops during a cool-down are not rejections: a client that fixes itself is served again as soon
as the cool-down ends, instead of being held off by its own retries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class _ClientWindow:
    times_s: deque = field(default_factory=deque)
    cooldown_until_s: float = float("-inf")


class RejectionRateLimit:
    """`blocked(client, now)` after more than `max_rejections` rejections in `window_s`."""

    def __init__(self, max_rejections: int = 20, window_s: float = 1.0, cooldown_s: float = 5.0):
        if max_rejections < 1 or window_s <= 0 or cooldown_s < 0:
            raise ValueError("max_rejections >= 1, window_s > 0 and cooldown_s >= 0 are required")
        self.max_rejections = max_rejections
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self._clients: dict[str, _ClientWindow] = {}

    def blocked(self, client_id: str, now_s: float) -> bool:
        state = self._clients.get(client_id)
        return state is not None and now_s < state.cooldown_until_s

    def on_rejection(self, client_id: str, now_s: float) -> bool:
        """Record one rejection; True when it starts a cool-down."""
        state = self._clients.setdefault(client_id, _ClientWindow())
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
        self._clients.pop(client_id, None)
