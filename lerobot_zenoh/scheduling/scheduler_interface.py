"""The request-scheduler interface: what the server needs of a scheduler, what it reports, and the
registry that maps a manifest's `scheduler` to a type (docs/server.md, "Schedulers and their settings").

Declared in the manner of vLLM's scheduler interface: a scheduler is a pure decision object (no
I/O, no clock of its own: `now_s` is passed in) that the inference loop (server/shell/inference_loop.py) drives
through five calls and one attribute:

    needs_execution_info                      read once at start: True makes the server decode each
                                              observation's `ExecutionInfo` on arrival to hand it over
    on_arrival(client_id, now_s, execution)   a new observation landed in the client's slot
    pick(ready, now_s, max_batch) -> [ids]    choose whom to serve now (ready = clients with a slot)
    rank(ready, now_s) -> [ids]               rank, then take: every ready client in order, nothing
    took(chosen, ranked, now_s)               recorded; the caller (the edge scheduler's placement
                                              across engines, outside any lock) takes a subset and
                                              says which (the rest count as skipped). `pick` is
                                              `rank`, the first `max_batch`, then `took`
    on_served(client_ids, now_s, duration_s)  the inference for them finished
    forget(client_id)                         the client is gone, or its episode changed
    stats() -> {name: number}                 counters and gauges, published as the model's
                                              ``scheduler.<name>`` metrics (docs/telemetry.md)

Each scheduler type declares its settings as a `SchedulerConfig` subclass (a `Settings` block:
types, bounds, defaults) and is built from an instance of it. `register_scheduler` puts a type in
`SCHEDULERS`; the manifest's ``scheduler: {type: <name>, <settings>}`` is validated through it, by
the type's config class, for a plugin's scheduler exactly as for the built-in ones
(request_schedulers.py registers round robin, FIFO and wait ratio).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lerobot_zenoh.config import Settings, misplaced_settings
from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol.messages import ExecutionInfo

class SchedulerConfig(Settings):
    """The settings of a scheduler type. A type with settings subclasses it and declares them as
    fields; this base is the config of a type that has none (round robin, FIFO)."""


class RequestScheduler(Protocol):
    """What the server needs of a scheduler and what it reports (module docstring)."""

    #: The name it is registered under (a manifest's `scheduler.type`).
    name: str
    #: Whether `on_arrival` needs the observation's `ExecutionInfo` (decoded on arrival only then).
    needs_execution_info: bool

    def on_arrival(self, client_id: str, now_s: float, execution: ExecutionInfo | None = None) -> None:
        """A new observation of `client_id` is waiting (it may replace an unserved one)."""

    def pick(self, ready: Sequence[str], now_s: float, max_batch: int = 1) -> list[str]:
        """Whom to serve now, in order: at most `max_batch` of `ready`. Records a decision: the
        server calls it once per dispatch."""

    def rank(self, ready: Sequence[str], now_s: float) -> list[str]:
        """Every client of `ready`, most urgent first; records nothing (optional: a scheduler without
        it is ranked by `pick(ready, now_s, len(ready))`)."""

    def took(self, chosen: Sequence[str], ranked: Sequence[str], now_s: float) -> None:
        """Of the order `rank` gave, `chosen` were taken now and the others skipped (optional)."""

    def on_served(self, client_ids: Sequence[str], now_s: float, duration_s: float) -> None:
        """The inference for `client_ids` ended at `now_s` after `duration_s`."""

    def forget(self, client_id: str) -> None:
        """Drop the client's state: its session closed or its episode changed."""

    def stats(self) -> Mapping[str, int | float]:
        """The scheduler's numbers (each a ``scheduler.<key>`` metric)."""


def ranked(scheduler: RequestScheduler, ready: Sequence[str], now_s: float) -> list[str]:
    """`scheduler`'s whole order of `ready`, recording nothing; a scheduler without `rank`: its
    `pick` of all of them, taken as one decision."""
    rank = getattr(scheduler, "rank", None)
    return list(rank(ready, now_s)) if rank is not None else list(scheduler.pick(ready, now_s, len(ready)))


def tell_took(scheduler: RequestScheduler, chosen: Sequence[str], ranked_order: Sequence[str], now_s: float) -> None:
    """Tell a scheduler that has `took` what was taken of the order it ranked."""
    took = getattr(scheduler, "took", None)
    if took is not None and ranked_order:
        took(list(chosen), ranked_order, now_s)


# -- the registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulerType:
    """One registered scheduler type: its name, its config class, and how to build it from a config."""

    name: str
    factory: Callable[[Any], RequestScheduler]  # called with an instance of `config_class`
    config_class: type[SchedulerConfig] = SchedulerConfig

    def validate(self, settings: Mapping[str, Any]) -> SchedulerConfig:
        """`settings` validated by the config class. Raises pydantic's ValidationError (a bad or
        unknown setting, located on its key) or ValueError (another type's settings)."""
        misplaced = misplaced_settings(self.name, settings, scheduler_configs(), "scheduler")
        if misplaced:
            raise ValueError(misplaced)
        return self.config_class.model_validate(dict(settings))

    def build(self, config: SchedulerConfig | None = None) -> RequestScheduler:
        return self.factory(config if config is not None else self.config_class())


#: Scheduler name -> its type. Fill it with `register_scheduler`, never by hand.
SCHEDULERS: dict[str, SchedulerType] = {}


def register_scheduler(name: str, factory: Callable[[Any], RequestScheduler],
                       config_class: type[SchedulerConfig] = SchedulerConfig, *, replace: bool = False) -> SchedulerType:
    """Make `name` a scheduler a manifest can ask for: ``scheduler: {type: name, <settings>}``.

    `factory` is called with an instance of `config_class` (the scheduler class itself, when its
    constructor takes its config) and returns an object with the `RequestScheduler` interface.
    `config_class` declares the settings (a `SchedulerConfig` subclass; the base for none). A name
    already registered is refused unless `replace`.
    """
    if not (isinstance(name, str) and name):
        raise ValueError(f"a scheduler name must be a non-empty string, got {name!r}")
    if not (isinstance(config_class, type) and issubclass(config_class, SchedulerConfig)):
        raise TypeError(f"scheduler {name!r}: config_class must be a SchedulerConfig subclass, got {config_class!r}")
    if not callable(factory):
        raise TypeError(f"scheduler {name!r}: factory must be callable, got {factory!r}")
    if name in SCHEDULERS and not replace:
        raise ValueError(f"scheduler {name!r} is already registered (replace=True to override it)")
    entry = SCHEDULERS[name] = SchedulerType(name, factory, config_class)
    return entry


def scheduler_type(name: str, field: str = "scheduler") -> SchedulerType:
    """The registered type `name`; ConfigError naming `field` (and the choices) if there is none."""
    entry = SCHEDULERS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ConfigError(field, f"unknown scheduler {name!r}; choose one of {', '.join(sorted(SCHEDULERS))}")
    return entry


def scheduler_configs() -> dict[str, type[SchedulerConfig]]:
    """Every registered type's config class, by name."""
    return {name: kind.config_class for name, kind in SCHEDULERS.items()}
