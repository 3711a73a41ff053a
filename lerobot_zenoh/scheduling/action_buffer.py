"""The robot client's action buffer: timestep-indexed actions, merged and popped under one lock.

Two threads share it. The control loop calls :meth:`ActionBuffer.pop` once per control period;
the reception thread calls :meth:`ActionBuffer.merge` with each action chunk that arrives.

Steps
    Every action is indexed by an absolute integer ``step``. ``next_step`` is the step the next
    :meth:`~ActionBuffer.pop` will execute; it advances only when an action is actually returned,
    so it counts executed actions (as LeRobot's ``latest_action`` does). An observation captured
    just before a pop is tagged with ``next_step``; the server answers with a chunk whose row 0
    is that step. A period in which the buffer was empty executes nothing and does not advance
    the step: the robot held still, so the policy's first rows are still the right next moves.

Merging a chunk ``(T, D)`` whose row 0 is ``first_step``
    1. rows for steps ``< next_step`` were already executed from an earlier chunk: discarded
       (counted as ``discarded_stale_rows``). This is the precise form of stale-step trimming:
       it drops exactly the steps executed since the observation, however long the round trip.
       A caller that also trims by RTT (``expired_steps``) passes ``chunk[k:]`` with
       ``first_step + k``; both compose, because the buffer only ever discards the past.
    2. rows for steps already buffered are blended, ``aggregate.blend(old, new)``.
    3. rows for new steps are stored as they are.

    The whole merge runs under the lock that ``pop`` takes (aggregating over a live reference to
    the queue outside the lock, as LeRobot's async client 0.6.1 does, loses or replays the actions
    popped meanwhile). Hence: no step is executed twice, and no buffered step is lost
    (tests/test_action_buffer.py checks it with threads).

Replacing from a step (real-time chunking)
    :meth:`ActionBuffer.replace_from` takes a chunk computed *for* the actions the robot executes
    meanwhile (the server conditioned it on the buffer's :meth:`~ActionBuffer.leftover` sent with
    the observation), so nothing is blended: rows for steps already executed are discarded as in
    ``merge``, and every buffered action from the first remaining row's step on (``next_step`` at
    that instant, read under the lock) is dropped and replaced by the chunk's rows, old steps past
    the chunk's end included. A chunk entirely in the past changes nothing.

Leftover
    :meth:`ActionBuffer.leftover` returns, under the same lock, ``next_step`` and the actions the
    robot will execute from it on (the consecutive buffered steps), exactly as stored: what an
    observation captured now carries for real-time chunking.

Gaps
    If a chunk starts after the last buffered step (or after ``next_step`` on an empty buffer),
    the steps in between have no action. ``pop`` then jumps over them to the next buffered step
    (counted as ``skipped_steps``): steps are labels of executed actions, so there is nothing to
    wait for.

Aggregation functions are a draccus ``ChoiceRegistry`` (docs/client.md, "Options"), so
``--aggregate.type=latest_only`` works on a draccus CLI and a user's subclass registered by
import is a choice like the built-in ones::

    @AggregateConfig.register_subclass("max_abs")
    @dataclass
    class MaxAbsConfig(AggregateConfig):
        def blend(self, old, new):
            return np.where(np.abs(new) > np.abs(old), new, old)
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field

import draccus
import numpy as np

from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.protocol.reasons import Reason

__all__ = [
    "ActionBuffer",
    "ActionBufferStats",
    "AggregateConfig",
    "AverageConfig",
    "ConservativeConfig",
    "LatestOnlyConfig",
    "MergeResult",
    "WeightedAverageConfig",
    "WeightedConfig",
    "make_aggregate",
]


# --------------------------------------------------------------------------- aggregation


@dataclass
class AggregateConfig(draccus.ChoiceRegistry, abc.ABC):
    """How an overlapping step is blended: ``blend(old, new)`` on arrays of one shape.

    ``blend`` must be elementwise-shaped (it receives ``(K, D)`` stacks of the ``K`` overlapping
    steps at once) and pure; it runs inside the buffer's lock, so it must be cheap.
    """

    @property
    def type(self) -> str:
        return self.get_choice_name(self.__class__)

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "weighted_average"

    @abc.abstractmethod
    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Return the action to keep for steps present in both the buffer and the new chunk."""


def _mix(old: np.ndarray, new: np.ndarray, new_weight: float) -> np.ndarray:
    return (1.0 - new_weight) * old + new_weight * new


@AggregateConfig.register_subclass("weighted_average")
@dataclass
class WeightedAverageConfig(AggregateConfig):
    """``0.3 * old + 0.7 * new``: smooth transitions that favour the newer prediction (default)."""

    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        return _mix(old, new, 0.7)


@AggregateConfig.register_subclass("latest_only")
@dataclass
class LatestOnlyConfig(AggregateConfig):
    """``new``: most responsive; can jump where two chunks disagree."""

    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        return new


@AggregateConfig.register_subclass("average")
@dataclass
class AverageConfig(AggregateConfig):
    """``0.5 * old + 0.5 * new``."""

    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        return _mix(old, new, 0.5)


@AggregateConfig.register_subclass("conservative")
@dataclass
class ConservativeConfig(AggregateConfig):
    """``0.7 * old + 0.3 * new``: smooth, slow to adapt."""

    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        return _mix(old, new, 0.3)


@AggregateConfig.register_subclass("weighted")
@dataclass
class WeightedConfig(AggregateConfig):
    """``(1 - new_weight) * old + new_weight * new`` with a chosen weight."""

    new_weight: float = field(default=0.7, metadata={"help": "Weight of the newer chunk, in [0, 1]."})

    def __post_init__(self) -> None:
        if not 0.0 <= self.new_weight <= 1.0:
            raise ConfigError("aggregate.new_weight", f"must be within [0, 1], got {self.new_weight}")

    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        return _mix(old, new, self.new_weight)


def make_aggregate(name: str) -> AggregateConfig:
    """The registered aggregation called `name`, with its default settings.

    For configs that name the function by a string (LeRobot's ``aggregate_fn_name``).
    """
    known = AggregateConfig.get_known_choices()
    if name not in known:
        raise ConfigError("aggregate", f"unknown aggregation {name!r}; known: {sorted(known)}")
    return known[name]()


# --------------------------------------------------------------------------- buffer


@dataclass(frozen=True)
class MergeResult:
    """What one :meth:`ActionBuffer.merge` did with the rows of its chunk."""

    discarded_stale: int  # rows for steps already executed
    blended: int  # rows blended into buffered steps
    appended: int  # rows stored for steps that were not buffered (replace_from: every row stored)
    replaced: int = 0  # replace_from: buffered actions dropped (overwritten or past the chunk's end)
    next_step: int | None = None  # the buffer's next_step when the chunk went in (under the lock)


@dataclass(frozen=True)
class ActionBufferStats:
    """A consistent snapshot of the buffer's counters (taken under its lock)."""

    next_step: int
    depth: int
    merged_chunks: int
    blended_steps: int
    appended_steps: int
    discarded_stale_rows: int
    popped_steps: int
    empty_pops: int
    skipped_steps: int
    replaced_chunks: int = 0  # chunks taken by replace_from (real-time chunking)
    replaced_steps: int = 0  # buffered actions those chunks dropped


class ActionBuffer:
    """Actions indexed by absolute control step; see the module docstring for the semantics.

    Args:
        aggregate: how overlapping steps are blended (default ``weighted_average``).
        action_dim: expected action length; ``None`` takes it from the first chunk merged.
        first_step: the step the first :meth:`pop` executes.
    """

    def __init__(
        self,
        aggregate: AggregateConfig | None = None,
        *,
        action_dim: int | None = None,
        first_step: int = 0,
    ) -> None:
        self.aggregate = aggregate if aggregate is not None else WeightedAverageConfig()
        if action_dim is not None and action_dim <= 0:
            raise ConfigError("action_dim", f"must be positive, got {action_dim}")
        self._action_dim = action_dim
        self._lock = threading.Lock()
        # step -> action (float32, shape (D,)). Only steps >= _next_step are ever present.
        self._actions: dict[int, np.ndarray] = {}
        self._next_step = first_step
        self._merged_chunks = 0
        self._blended_steps = 0
        self._appended_steps = 0
        self._discarded_stale_rows = 0
        self._popped_steps = 0
        self._empty_pops = 0
        self._skipped_steps = 0
        self._replaced_chunks = 0
        self._replaced_steps = 0

    # -- control-loop side

    def pop(self) -> tuple[int, np.ndarray] | None:
        """Take the action for the next step, or ``None`` if the buffer holds none.

        Returns ``(step, action)``; ``step`` is ``next_step`` unless a gap is jumped over.
        ``None`` leaves ``next_step`` unchanged (nothing was executed).
        """
        with self._lock:
            action = self._actions.pop(self._next_step, None)
            if action is None:
                if not self._actions:
                    self._empty_pops += 1
                    return None
                # Only steps > next_step remain: jump over the gap to the earliest one.
                first = min(self._actions)
                self._skipped_steps += first - self._next_step
                self._next_step = first
                action = self._actions.pop(first)
            step = self._next_step
            self._next_step += 1
            self._popped_steps += 1
            return step, action

    # -- reception side

    def merge(self, chunk: np.ndarray, first_step: int) -> MergeResult:
        """Blend a chunk ``(T, D)`` whose row 0 is the action for step `first_step`.

        Raises :class:`ProtocolError` (reason ``action_shape`` or ``non_finite``) for a chunk
        that must not reach the robot; the buffer is left unchanged.
        """
        rows = self._checked(chunk)
        first_step = int(first_step)

        with self._lock:
            self._check_dim(rows)
            # 1. discard rows for steps already executed.
            stale = min(max(self._next_step - first_step, 0), len(rows))
            rows = rows[stale:]
            start = first_step + stale
            steps = range(start, start + len(rows))
            # 2. blend the overlap in one vectorised call, 3. store the rest.
            overlap = [i for i, step in enumerate(steps) if step in self._actions]
            if overlap:
                old = np.stack([self._actions[steps[i]] for i in overlap])
                blended = np.asarray(self.aggregate.blend(old, rows[overlap]), dtype=np.float32)
                if blended.shape != old.shape:
                    raise ProtocolError(Reason.ACTION_SHAPE,
                        f"aggregate {self.aggregate.type!r} returned {blended.shape}, expected {old.shape}",
                    )
                rows[overlap] = blended
            for i, step in enumerate(steps):
                self._actions[step] = rows[i]
            self._merged_chunks += 1
            self._discarded_stale_rows += stale
            self._blended_steps += len(overlap)
            self._appended_steps += len(rows) - len(overlap)
            return MergeResult(discarded_stale=stale, blended=len(overlap), appended=len(rows) - len(overlap),
                               next_step=self._next_step)

    def replace_from(self, chunk: np.ndarray, first_step: int) -> MergeResult:
        """Replace the buffer, from the first not-yet-executed step of a chunk ``(T, D)`` whose row 0
        is step `first_step`, by the chunk's rows (real-time chunking: no blending, see the module
        docstring). Raises :class:`ProtocolError` like :meth:`merge`; the buffer is then unchanged.
        """
        rows = self._checked(chunk)
        first_step = int(first_step)
        with self._lock:
            self._check_dim(rows)
            stale = min(max(self._next_step - first_step, 0), len(rows))
            rows = rows[stale:]
            start = first_step + stale
            replaced = 0
            if len(rows):
                dropped = [step for step in self._actions if step >= start]
                for step in dropped:
                    del self._actions[step]
                replaced = len(dropped)
                for i in range(len(rows)):
                    self._actions[start + i] = rows[i]
            self._merged_chunks += 1
            self._replaced_chunks += 1
            self._replaced_steps += replaced
            self._discarded_stale_rows += stale
            self._appended_steps += len(rows)
            return MergeResult(discarded_stale=stale, blended=0, appended=len(rows), replaced=replaced,
                               next_step=self._next_step)

    def leftover(self, max_rows: int | None = None) -> tuple[int, np.ndarray]:
        """``(next_step, actions)``: the actions the robot will execute from ``next_step`` on, in order
        (the run of consecutive buffered steps starting there, at most `max_rows`), float32 ``(n, D)``,
        copied exactly as stored, read under the lock. ``n`` is 0 when ``next_step`` is not buffered;
        ``D`` is 0 while the action dimension is unknown.
        """
        with self._lock:
            step = self._next_step
            rows = []
            while (max_rows is None or len(rows) < max_rows) and (step + len(rows)) in self._actions:
                rows.append(self._actions[step + len(rows)])
            dim = self._action_dim or 0
        return step, (np.stack(rows) if rows else np.zeros((0, dim), dtype=np.float32))

    @staticmethod
    def _checked(chunk: np.ndarray) -> np.ndarray:
        rows = np.array(chunk, dtype=np.float32, copy=True)  # ours: the caller may reuse theirs
        if rows.ndim != 2 or rows.shape[1] == 0:
            raise ProtocolError(Reason.ACTION_SHAPE, f"chunk must be (T, D) with D > 0, got {rows.shape}")
        if not np.all(np.isfinite(rows)):
            raise ProtocolError(Reason.NON_FINITE, "action chunk contains NaN or infinity")
        return rows

    def _check_dim(self, rows: np.ndarray) -> None:
        # Caller holds the lock. The first chunk fixes the dimension.
        if self._action_dim is None:
            self._action_dim = rows.shape[1]
        elif rows.shape[1] != self._action_dim:
            raise ProtocolError(Reason.ACTION_SHAPE, f"chunk has {rows.shape[1]} action dims, buffer holds {self._action_dim}"
            )

    # -- shared

    def clear(self) -> int:
        """Drop every buffered action (``next_step`` is kept, so late chunks stay stale). Returns how many."""
        with self._lock:
            dropped = len(self._actions)
            self._actions.clear()
            return dropped

    @property
    def next_step(self) -> int:
        """The step the next :meth:`pop` executes (if the buffer holds it)."""
        with self._lock:
            return self._next_step

    @property
    def depth(self) -> int:
        """Number of buffered actions (steps not yet executed)."""
        with self._lock:
            return len(self._actions)

    def __len__(self) -> int:
        return self.depth

    @property
    def action_dim(self) -> int | None:
        with self._lock:
            return self._action_dim

    def stats(self) -> ActionBufferStats:
        with self._lock:
            return ActionBufferStats(
                next_step=self._next_step,
                depth=len(self._actions),
                merged_chunks=self._merged_chunks,
                blended_steps=self._blended_steps,
                appended_steps=self._appended_steps,
                discarded_stale_rows=self._discarded_stale_rows,
                popped_steps=self._popped_steps,
                empty_pops=self._empty_pops,
                skipped_steps=self._skipped_steps,
                replaced_chunks=self._replaced_chunks,
                replaced_steps=self._replaced_steps,
            )
