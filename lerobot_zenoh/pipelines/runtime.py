"""The robot side of a multi-model task: pure decisions with an injected clock (docs/pipelines.md).

`PipelineRuntime` is driven by the pipeline client (`client/pipeline.py`) and does no I/O, reads no
clock and takes no lock: every time is a ``now_s`` argument (one process's ``perf_counter``), and the
caller serialises calls (the client holds one short lock around each). What it decides:

send rules
    ``due_mask(now_s, system1_due)``: which components the observation captured now asks (bit i =
    the i-th component of the task descriptor, ``Observation.component_mask``). System 1 when the
    client's send trigger fires (``system1_due``); System 2 with every ``every_n_chunks``-th System 1
    request; safety and monitor at their ``rate_hz`` (or the plan's rate): due when their period has
    passed, and taken up to 10 % of a period early when an observation goes anyway, so that one
    capture serves several components. A component a ``retry`` fallback re-asks is due at once.
    0: nothing is due, nothing is published.

deadlines
    every request carries ``sent + slo.deadline_ms``. An answer by then is *met*; none by then is
    *missed* (``poll``), and the component's ``on_slo_miss`` applies; an answer after it is *late*
    (still used: it is the newest the robot has, but the miss stands).

fallbacks (`on_slo_miss`)
    ``hold`` / ``zero_velocity`` / ``safe_pose``: the robot's mode until that component's next answer
    within its SLO; ``retry``: ask the component again at once, up to ``max_retries`` misses in a
    row, then its ``then``; ``use_last`` (System 2): keep the last plan; ``stop_episode``: the attempt
    ends (the task retry policy follows).

danger (`on_danger`)
    an ``unsafe`` verdict: the mode is latched until the safety component says ``safe`` about a later
    observation (``stop_episode`` ends the attempt instead). A monitor's ``failed`` ends the attempt:
    its ``on_danger`` mode is what the robot does while the task is reset, then the task retry policy
    (``retry.max_retries`` attempts more, then ``retry.then``, which holds for the rest of the run or,
    for ``stop_episode``, ends it). ``done`` ends the attempt as a success.

The plan
    System 2's latest text becomes System 1's task string (``task_text``), reset to the base task at
    each attempt.

Per component: requests, answered, met, missed, late answers, fallbacks taken, rejected answers,
latency p50/p99 and SLO attainment (met / decided) against the SLO's percentile.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.pipelines.descriptor import Fallback, Task
from lerobot_zenoh.protocol.messages import MAX_COMPONENTS, MAX_TASK_BYTES, MONITOR_LABELS, SAFETY_LABELS
from lerobot_zenoh.protocol.reasons import OutputKind

#: What each kind answers with (Status.output) and on which topic.
OUTPUT_OF_KIND = {"system1": OutputKind.ACTIONS, "system2": OutputKind.TEXT, "safety": OutputKind.VERDICT,
                  "monitor": OutputKind.VERDICT}
#: Robot modes, least to most severe: when several apply at once the most severe wins.
MODES = ("hold", "zero_velocity", "safe_pose")
#: A rate-driven component may be asked this fraction of its period early to share an observation.
EARLY_FRACTION = 0.1
#: Missed request ids kept per component to recognise late answers.
MISSED_KEPT = 256
#: Requests awaiting an answer kept per component (the oldest is dropped, as missed, beyond it).
PENDING_KEPT = 1024


@dataclass(frozen=True)
class Mode:
    """What the robot does instead of executing the policy's actions."""

    action: str  # hold | zero_velocity | safe_pose
    pose: tuple[float, ...] | None = None  # safe_pose only
    reason: str = ""

    @property
    def severity(self) -> int:
        return MODES.index(self.action)


@dataclass(frozen=True)
class Outcome:
    """How the current attempt ended: `done`, `failed` (the monitor said so) or `stopped` (a fallback)."""

    kind: str
    reason: str
    component: str | None = None
    mode: Mode | None = None  # what the robot does while the task is reset (a `failed` verdict's on_danger)


@dataclass
class ComponentStats:
    requests: int = 0
    answered: int = 0  # answers to a request of ours, in time or late
    met: int = 0
    missed: int = 0
    late: int = 0  # answers that came after their deadline (already counted as missed)
    fallbacks: int = 0
    rejected: int = 0  # answers with a label that does not fit the component, or to nothing we asked
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=512))
    recent: deque = field(default_factory=lambda: deque(maxlen=200))  # 1 met / 0 missed, last decided

    def attainment(self) -> float | None:
        decided = self.met + self.missed
        return None if decided == 0 else self.met / decided

    def figures(self, prefix: str, target: float) -> dict[str, float | int | None]:
        """These figures, flat under `prefix`; `target`: the SLO's share of requests in time."""
        lat = list(self.latencies_ms)
        recent = list(self.recent)
        p = prefix
        return {
            p + "requests": self.requests, p + "answered": self.answered, p + "met": self.met,
            p + "missed": self.missed, p + "late": self.late, p + "fallbacks": self.fallbacks,
            p + "rejected": self.rejected,
            p + "latency_ms_p50": float(np.percentile(lat, 50)) if lat else None,
            p + "latency_ms_p99": float(np.percentile(lat, 99)) if lat else None,
            p + "attainment": self.attainment(),
            # the SLO holds when the share of the last 200 decided requests in time reaches its percentile
            p + "slo_violated": None if not recent else int(sum(recent) / len(recent) < target),
        }


@dataclass
class _Component:
    name: str
    bit: int
    kind: str
    spec: object  # descriptor Component
    rate_hz: float | None
    pending: OrderedDict = field(default_factory=OrderedDict)  # seq_id -> (sent_s, deadline_s)
    missed_ids: OrderedDict = field(default_factory=OrderedDict)  # seq_id -> sent_s, at most MISSED_KEPT
    dropped_ids: deque = field(default_factory=lambda: deque(maxlen=MISSED_KEPT))  # of an ended attempt
    next_due_s: float | None = None
    misses_in_a_row: int = 0
    degraded: Mode | None = None  # an on_slo_miss mode, until an answer in time
    danger: Mode | None = None  # an on_danger mode (safety), until `safe` about a later observation
    danger_seq: int = -1
    last_verdict_seq: int = -1
    stats: ComponentStats = field(default_factory=ComponentStats)


class PipelineRuntime:
    """The send rules, deadlines, fallbacks and plan of one robot running one task (module docstring).

    Args:
        task: the task descriptor.
        rates_hz: planned request rates by component (plan.json); used for rate-driven components,
            whose descriptor rate is the default.
        base_task: System 1's task string before System 2 says anything (its prompt, or --task).
    """

    def __init__(self, task: Task, *, rates_hz: Mapping[str, float] | None = None, base_task: str = ""):
        if len(task.components) > MAX_COMPONENTS:
            raise ConfigError("components", f"a task has at most {MAX_COMPONENTS} components (one mask bit each)")
        self.task = task
        rates_hz = dict(rates_hz or {})
        self._components: dict[str, _Component] = {}
        for i, (name, comp) in enumerate(task.components.items()):
            rate = comp.invocation.rate_hz
            if rate is not None and name in rates_hz:
                if not rates_hz[name] > 0:
                    raise ConfigError(f"rates_hz.{name}", f"must be positive, got {rates_hz[name]}")
                rate = float(rates_hz[name])
            self._components[name] = _Component(name, i, comp.kind, comp, rate)
        s1 = task.component("system1")
        self.system1 = s1[0]
        s2 = task.component("system2")
        self.system2 = s2[0] if s2 else None
        self.base_task = base_task or s1[1].prompt
        self.task_text = self.base_task
        self._text_seq = -1
        self._system1_requests = 0
        self._force: set[str] = set()
        self.outcome: Outcome | None = None
        self.concluded = False  # the task retry policy has decided about `outcome`
        self.attempt = 0
        self.failures = 0
        self.halted: Mode | None = None  # the task retry budget is spent: this mode for the rest of the run
        self._safe_pose = _any_safe_pose(task)
        if task.retry.then == "safe_pose" and self._safe_pose is None:
            raise ConfigError("retry.then", "safe_pose needs a pose: give one in some component's safe_pose fallback")

    # -- identity ------------------------------------------------------------------------------

    @property
    def components(self) -> list[str]:
        return list(self._components)

    def bit(self, component: str) -> int:
        return 1 << self._components[component].bit

    def kind(self, component: str) -> str:
        return self._components[component].kind

    def components_in(self, mask: int) -> list[str]:
        return [c.name for c in self._components.values() if mask >> c.bit & 1]

    # -- attempts ------------------------------------------------------------------------------

    def begin_attempt(self, now_s: float) -> None:
        """Start (or restart) the task: every component is asked at once, the plan is the base task,
        requests in flight are forgotten (their answers belong to the attempt that ended)."""
        self.attempt += 1
        self.outcome = None
        self.concluded = False
        self.task_text = self.base_task
        self._text_seq = -1
        self._system1_requests = 0
        self._force.clear()
        for c in self._components.values():
            c.dropped_ids.extend(c.pending)
            c.pending.clear()
            c.next_due_s = now_s
            c.misses_in_a_row = 0
            c.degraded = None
            c.danger = None

    def conclude(self) -> str:
        """Apply the task retry policy to the ended attempt: ``done`` (it succeeded), ``retry`` (start
        another with `begin_attempt`), ``stop`` (the budget is spent and `retry.then` is stop_episode:
        the run ends) or ``halt`` (the budget is spent: `halted` is the robot's mode from now on)."""
        if self.outcome is None or self.concluded:
            raise RuntimeError("conclude() without an ended attempt, or twice")
        self.concluded = True
        if self.outcome.kind == "done":
            return "done"
        self.failures += 1
        if self.failures <= self.task.retry.max_retries:
            return "retry"
        then = self.task.retry.then
        if then == "stop_episode":
            return "stop"
        self.halted = Mode(then, self._safe_pose if then == "safe_pose" else None, "task retries spent")
        return "halt"

    # -- sending -------------------------------------------------------------------------------

    def due_mask(self, now_s: float, system1_due: bool) -> int:
        """Which components the observation captured now asks; 0: publish nothing."""
        if self.outcome is not None or self.halted is not None:
            return 0
        s1 = self._components[self.system1]
        mask = 0
        if system1_due or self.system1 in self._force:
            mask |= 1 << s1.bit
            if self.system2 is not None:
                every = self._components[self.system2].spec.invocation.every_n_chunks
                if self._system1_requests % every == 0:
                    mask |= 1 << self._components[self.system2].bit
        for name in self._force:
            mask |= 1 << self._components[name].bit
        for c in self._components.values():
            if c.rate_hz is None or c.next_due_s is None:
                continue
            early_s = EARLY_FRACTION / c.rate_hz if mask else 0.0
            if now_s >= c.next_due_s - early_s:
                mask |= 1 << c.bit
        return mask

    def on_sent(self, seq_id: int, mask: int, now_s: float) -> None:
        """The observation `seq_id` asking `mask` was captured at `now_s`: its deadlines start."""
        for c in self._components.values():
            if not mask >> c.bit & 1:
                continue
            self._force.discard(c.name)
            c.stats.requests += 1
            c.pending[seq_id] = (now_s, now_s + c.spec.slo.deadline_ms / 1000.0)
            while len(c.pending) > PENDING_KEPT:
                old, (old_sent_s, _) = c.pending.popitem(last=False)
                self._miss(c, old, old_sent_s)
            if c.kind == "system1":
                self._system1_requests += 1
            if c.rate_hz is not None:
                period_s = 1.0 / c.rate_hz
                due = (c.next_due_s if c.next_due_s is not None else now_s) + period_s
                # a sample taken early or a little late keeps the schedule; one a period behind restarts it
                c.next_due_s = due if due > now_s else now_s + period_s

    # -- answers -------------------------------------------------------------------------------

    def _answer(self, c: _Component, seq_id: int, now_s: float) -> str:
        """Book an answer: ``met``, ``late`` (after its deadline), ``stale`` (a request of an attempt that
        ended: ignored) or ``unknown`` (not a request of ours)."""
        entry = c.pending.pop(seq_id, None)
        if entry is None:
            if seq_id in c.dropped_ids:
                return "stale"
            sent_s = c.missed_ids.pop(seq_id, None)
            if sent_s is not None:  # missed already (poll() saw its deadline pass): late, and its latency counts
                c.stats.answered += 1
                c.stats.late += 1
                c.stats.latencies_ms.append((now_s - sent_s) * 1000.0)
                return "late"
            c.stats.rejected += 1
            return "unknown"
        sent_s, deadline_s = entry
        c.stats.answered += 1
        c.stats.latencies_ms.append((now_s - sent_s) * 1000.0)
        if now_s <= deadline_s:
            c.stats.met += 1
            c.stats.recent.append(1)
            c.misses_in_a_row = 0
            c.degraded = None
            return "met"
        self._miss(c, seq_id, None)  # an answer after its deadline that poll() has not seen yet
        c.stats.late += 1
        return "late"

    def on_chunk(self, seq_id: int, now_s: float) -> str:
        """System 1 answered `seq_id` (the chunk itself goes to the action buffer)."""
        return self._answer(self._components[self.system1], seq_id, now_s)

    def on_text(self, component: str, seq_id: int, text: str, now_s: float) -> str:
        """System 2 answered: its text becomes System 1's task string (the newest request's wins),
        cut to the `MAX_TASK_BYTES` a server reads (at a character boundary)."""
        c = self._components[component]
        if c.kind != "system2":
            c.stats.rejected += 1
            return "rejected"
        result = self._answer(c, seq_id, now_s)
        if result in ("met", "late") and seq_id > self._text_seq and self.outcome is None:
            self._text_seq = seq_id
            self.task_text = text.encode()[:MAX_TASK_BYTES].decode(errors="ignore")
        return result

    def on_verdict(self, component: str, seq_id: int, label: str, now_s: float) -> str:
        """A safety or monitor verdict; returns met/late/unknown/rejected."""
        c = self._components[component]
        allowed = SAFETY_LABELS if c.kind == "safety" else MONITOR_LABELS if c.kind == "monitor" else ()
        if label not in allowed:
            c.stats.rejected += 1
            return "rejected"
        result = self._answer(c, seq_id, now_s)
        if result not in ("met", "late") or self.outcome is not None:
            return result
        if c.kind == "safety":
            if label == "unsafe":
                c.stats.fallbacks += 1
                fb = c.spec.on_danger
                if fb.action == "stop_episode":
                    self.outcome = Outcome("stopped", f"{c.name}: unsafe", c.name)
                else:
                    c.danger, c.danger_seq = self._mode(fb, f"{c.name}: unsafe"), max(c.danger_seq, seq_id)
            elif seq_id > c.danger_seq:
                c.danger = None
        else:
            if seq_id < c.last_verdict_seq:
                return result  # an older judgement than one already acted on
            c.last_verdict_seq = seq_id
            if label == "done":
                self.outcome = Outcome("done", f"{c.name}: done", c.name)
            elif label == "failed":
                c.stats.fallbacks += 1
                fb = c.spec.on_danger
                mode = None if fb.action == "stop_episode" else self._mode(fb, f"{c.name}: failed")
                self.outcome = Outcome("failed", f"{c.name}: failed", c.name, mode)
        return result

    # -- deadlines -----------------------------------------------------------------------------

    def poll(self, now_s: float) -> list[str]:
        """Expire every request past its deadline and apply fallbacks; returns the components that missed."""
        missed = []
        for c in self._components.values():
            while c.pending:
                seq_id, (sent_s, deadline_s) = next(iter(c.pending.items()))
                if now_s <= deadline_s:
                    break
                c.pending.popitem(last=False)
                self._miss(c, seq_id, sent_s)
                missed.append(c.name)
        return missed

    def _miss(self, c: _Component, seq_id: int, sent_s: float | None) -> None:
        """Count a missed deadline; `sent_s`: its send time, kept so that a late answer's latency is
        recorded (None: the answer is being booked now)."""
        if sent_s is not None:
            c.missed_ids[seq_id] = sent_s
            while len(c.missed_ids) > MISSED_KEPT:
                c.missed_ids.popitem(last=False)
        c.stats.missed += 1
        c.stats.recent.append(0)
        if self.outcome is not None:
            return
        c.stats.fallbacks += 1
        c.misses_in_a_row += 1
        fb: Fallback = c.spec.on_slo_miss
        if fb.action == "retry":
            if c.misses_in_a_row <= fb.max_retries:
                self._force.add(c.name)
                return
            fb = Fallback(action=fb.then or "hold", pose=self._safe_pose if fb.then == "safe_pose" else None)
        if fb.action == "use_last":
            return
        if fb.action == "stop_episode":
            self.outcome = Outcome("stopped", f"{c.name}: missed its SLO", c.name)
            return
        c.degraded = self._mode(fb, f"{c.name}: missed its SLO")

    # -- what the control loop reads -----------------------------------------------------------

    @property
    def mode(self) -> Mode | None:
        """The robot's mode now: the most severe of the halted mode, every danger latch and every
        missed-SLO mode, or the ended attempt's reset mode; None: execute the policy's actions."""
        modes = [m for c in self._components.values() for m in (c.danger, c.degraded) if m is not None]
        if self.halted is not None:
            modes.append(self.halted)
        if self.outcome is not None and self.outcome.mode is not None:
            modes.append(self.outcome.mode)
        return max(modes, key=lambda m: m.severity) if modes else None

    def _mode(self, fb: Fallback, reason: str) -> Mode:
        pose = tuple(fb.pose) if fb.action == "safe_pose" and fb.pose else None
        if fb.action == "safe_pose" and pose is None:
            pose = self._safe_pose
        return Mode(fb.action, pose, reason)

    # -- figures -------------------------------------------------------------------------------

    def stats(self) -> dict[str, ComponentStats]:
        return {name: c.stats for name, c in self._components.items()}

    def figures(self) -> dict[str, float | int | None]:
        """Per-component SLO figures, flat (`slo.<component>.<figure>`), for telemetry and summaries."""
        out: dict[str, float | int | None] = {}
        for name, c in self._components.items():
            out.update(c.stats.figures(f"slo.{name}.", c.spec.slo.percentile / 100.0))
        out["pipeline.attempt"] = self.attempt
        out["pipeline.failures"] = self.failures
        mode = self.mode
        out["pipeline.mode"] = 0 if mode is None else 1 + mode.severity
        return out


def _any_safe_pose(task: Task) -> tuple[float, ...] | None:
    """The first safe pose any component's fallback gives (for a fallback or retry policy that names none)."""
    for comp in task.components.values():
        for fb in (comp.on_danger, comp.on_slo_miss):
            if fb is not None and fb.action == "safe_pose" and fb.pose:
                return tuple(fb.pose)
    return None
