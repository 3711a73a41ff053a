"""Hot standby (docs/reliability.md; after Rosa section 3.4.4): whether this server serves a model right now.

A primary serves from start-up. A standby (manifest `standby_for: <primary server_id>`) pre-warms
the same models and announces itself with its own liveliness token, but serves nobody (it drops
observations and stays silent on status queries) while the primary's token is present. When the
token vanishes (process killed, host or network gone, lease expired) the standby takes over at
once; when it reappears the standby steps back.

Exactly one server serves at a time, so a client never gets two chunks for one observation: a
primary that starts while other servers of its app are alive (a standby may be serving) waits
`handover_grace_s` before serving, long enough for the standby to see its token and stop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ServingRole:
    def __init__(self, name: str, standby_for: str | None, on_deactivate: Callable[[], None] = lambda: None):
        self.name = name
        self.standby_for = standby_for
        self.active = threading.Event()
        self.takeovers = 0
        self.stepped_back = 0
        self._on_deactivate = on_deactivate
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.failed = False  # its server can no longer serve it: it never serves again

    @property
    def is_standby(self) -> bool:
        return self.standby_for is not None

    def start_primary(self, others_alive: bool, grace_s: float) -> None:
        if not others_alive or grace_s <= 0:
            self.active.set()
            return
        log.info("%s: other servers are up; serving in %.2f s (hand-over grace)", self.name, grace_s)
        self._timer = threading.Timer(grace_s, self._activate)
        self._timer.daemon = True
        self._timer.start()

    def _activate(self) -> None:
        with self._lock:
            if not self.failed:
                self.active.set()

    def fail(self) -> None:
        """This server can no longer serve (its loop failed): stop now and never serve again."""
        with self._lock:
            self.failed = True
            if self._timer is not None:
                self._timer.cancel()
            self.active.clear()
            self._on_deactivate()

    def on_primary(self, alive: bool) -> None:
        """A standby learns that its primary's token appeared (alive) or vanished."""
        with self._lock:
            if self.failed:
                return
            if alive and self.active.is_set():
                self.active.clear()
                self.stepped_back += 1
                log.warning("%s: primary %s is back; standing by", self.name, self.standby_for)
                self._on_deactivate()
            elif not alive and not self.active.is_set():
                self.active.set()
                self.takeovers += 1
                log.warning("%s: primary %s is gone; taking over", self.name, self.standby_for)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
