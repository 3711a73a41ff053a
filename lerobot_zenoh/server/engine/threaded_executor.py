"""An executor on a thread of its own (`server/engine/interface.py`): the `local: true` engine of a
model with `engines`, so the dispatcher keeps placing (and relaying remote answers) while this
process's own runner computes.

It wraps an executor that runs on the caller's thread (`BatchExecutor`) and alone calls it,
forgetting a closed session's state included; each batch it ran is reported to `on_done` with the
request ids it carried and when it started and ended, whatever happened (a failure is logged).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lerobot_zenoh.server.engine.interface import EngineExecutor, Work
    from lerobot_zenoh.server.engine.request_table import InFlight

log = logging.getLogger(__name__)

__all__ = ["ThreadedExecutor"]


class ThreadedExecutor:
    """`inner` on the thread `name`; `on_done(request_ids, t0, t1)` after each batch."""

    def __init__(self, inner: EngineExecutor, name: str, on_done: Callable[[list[int], float, float], None],
                 clock: Callable[[], float] = time.monotonic):
        self.inner, self.on_done, self.clock = inner, on_done, clock
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"local-engine:{name}", daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> list[InFlight]:
        self._jobs.put(("work", work))
        return []

    def forget(self, client_id: str) -> None:
        self._jobs.put(("forget", client_id))

    def stop(self, timeout_s: float) -> bool:
        self._jobs.put(None)
        self._thread.join(timeout_s)
        stopped = not self._thread.is_alive()
        return self.inner.stop(timeout_s) and stopped

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, arg = job
            if kind == "forget":
                self.inner.forget(arg)
                continue
            t0 = self.clock()
            try:
                self.inner.submit(arg)
            except Exception:  # the dispatcher must hear back whatever happened
                log.exception("local engine batch failed")
            self.on_done([f.request_id for f in arg.flights], t0, self.clock())
