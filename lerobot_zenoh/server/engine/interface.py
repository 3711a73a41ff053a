"""The engine executor interface: every engine a model's requests run on is one of these
(docs/architecture.md, "One engine core").

An executor runs what the scheduler hands it and reports what came of it; it ranks nothing, places
nothing and keeps no bookkeeping of what is in flight (the scheduler's: the session table, and for
a model with `engines` the dispatcher's request table and per-engine load). The kinds, one module each:

- `server/engine/batch_executor.py` (`BatchExecutor`): this process's runner, one forward pass per batch,
  on the caller's thread (a model without `engines` is a scheduler with this one executor);
- `server/engine/decoding_executor.py` (`DecodingExecutor`): this process's iteration-level runner
  (pi0-FAST; docs/server.md, "Iteration-level serving"): decodes step by step and takes the next
  robots' requests between steps, on the caller's thread;
- `server/engine/threaded_executor.py` (`ThreadedExecutor`): any of the above on a thread of its own, so
  the scheduler keeps placing while it computes (the `local: true` engine of a model with `engines`);
- `server/dispatch/remote_executor.py` (`RemoteExecutor`): another `lerobot-policy-server` process started
  with `role: engine`, on the site or across a WAN, reached by `EngineRequest`s on its dispatch key
  (its answers come back through `server/dispatch/engine_link.py`).

Adding an engine kind is one more module with a class of this interface, built where the
dispatcher builds its executors (`Dispatcher.start`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from lerobot_zenoh.server.session_table.records import Batch

if TYPE_CHECKING:
    from lerobot_zenoh.server.engine.request_table import InFlight

__all__ = ["EngineExecutor", "Work"]


@dataclass
class Work:
    """What the scheduler hands an executor: the picked requests (`batch`, in the scheduler's order),
    their records in the dispatcher's request table (`flights`, in the same order; empty for a
    model without `engines`, whose one executor is tracked by the session table alone), and the
    clients whose runner state this engine must drop before serving them (`reset`: a new episode
    since it last served them)."""

    batch: Batch
    flights: Sequence[InFlight] = ()
    reset: Collection[str] = field(default_factory=frozenset)


class EngineExecutor(Protocol):
    """One engine of a model (module docstring)."""

    def submit(self, work: Work) -> list[InFlight]:
        """Run `work` (at once on this thread, or handed to a thread or a process; never waits on
        another process). Returns the flights it could not take (their link refused them): the
        scheduler puts them back to wait. What came of the others is reported as it happens."""

    def forget(self, client_id: str) -> None:
        """A closed session: drop the runner state this engine keeps for it."""

    def stop(self, timeout_s: float) -> bool:
        """Stop taking work; True when whatever ran for it has ended."""
