"""What the robot is asked to do: the strategy a `RobotClient` runs its control loop for.

`RobotClient(config, robot, task=...)` composes its parts around one :class:`Task`. The plain task
(this class) is one policy on one server: an observation asks System 1 whenever the send rule says
so, the policy's action always goes to the robot, an episode ends on time. A multi-model task
(``client/pipeline.py``, ``PipelineTask``) decides which components an observation asks, replaces
the policy's action in a fallback or danger mode, and ends, retries or halts its attempts.

Every method has a plain default, so a task overrides only what it changes. The client calls them:

    start-up            ``session_settings`` (where the session connects), ``stream_keys`` (where
                        observations and telemetry go), ``start`` (find and check the other servers;
                        raise CompatibilityError), ``declare`` (its own subscriptions), ``threads``
    server watch        ``same_host_allowed``, ``refetch_allowed``
    control loop        ``ask`` (which components this step's observation asks, or None),
                        ``override`` (an action replacing the policy's), ``failsafe`` (the action
                        when there is none), ``react`` (woken between steps), episodes:
                        ``begin_attempt``, ``outcome``, ``retry_reset_s``
    chunk receiver      ``on_chunk`` (a chunk answering `seq_id` went into the buffer)
    reporting           ``figures`` (added to telemetry), ``summary`` (a section of the summary)

A task that must interrupt the control loop's wait between steps calls the ``wake`` it is given in
``start``. Its own state is its own: it guards it with its own lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lerobot_zenoh.transport.settings import ZenohSettings

__all__ = ["Ask", "Task", "TaskContext"]


@dataclass(frozen=True)
class Ask:
    """What one observation asks: System 1's chunk (`system1`) and, for a multi-model task, the
    components' bit mask and System 1's task string now."""

    system1: bool = True
    component_mask: int | None = None
    task_text: str | None = None


@dataclass(frozen=True)
class TaskContext:
    """What a task gets at start-up, once System 1's server is found and checked."""

    session: object  # the client's session (client/link.py, ClientSession: query, subscribe, ...)
    status: object  # System 1's Status
    features: object  # RobotFeatures
    stop: object  # the client's stop event (threading.Event)
    wake: Callable[[], None]  # interrupt the control loop's wait: it calls `react` at once
    last_action: Callable[[], dict | None]  # the last action the policy gave the robot
    counters: object  # the client's ClientCounters (read-only for a task: its figures may report them)


class Task:
    """The plain task: one policy, one server (see the module docstring)."""

    same_host_allowed = True
    refetch_allowed = True
    reads_refusals = True  # the server may answer a refused request with a Refusal on the action key

    # -- start-up
    def session_settings(self, settings: ZenohSettings) -> ZenohSettings:
        return settings

    def stream_keys(self, config) -> tuple[str, str]:
        """(observation key, metrics key: liveliness token and telemetry)."""
        return config.client_key.obs, config.client_key.metrics

    def observation_route(self, session) -> Callable[[int], object] | None:
        """Where an observation asking components (`Ask.component_mask`) is put, if not on the
        observation key: a publisher per mask (a multi-model task). None: the observation key."""
        return None

    def telemetry_labels(self, robot) -> dict[str, str]:
        return {"robot_type": getattr(robot, "name", "")}

    def start(self, context: TaskContext) -> None:
        """Find and check what else the task needs; raise CompatibilityError."""

    def declare(self, session) -> None:
        """Declare the task's own subscriptions."""

    def threads(self) -> list[tuple[Callable[[], None], str]]:
        """Extra threads to run while the client runs: (target, name)."""
        return []

    # -- control loop
    def ask(self, seq_id: int, now_s: float, system1_due: bool) -> Ask | None:
        """What observation `seq_id`, captured now, asks; None: send nothing this step."""
        return Ask() if system1_due else None

    def override(self, observation: dict, now_s: float) -> dict | None:
        """An action that replaces the policy's this step (a fallback or a danger mode), or None."""
        return None

    def failsafe(self, observation: dict, default: dict) -> dict:
        """The action when the robot has none (and at exit); `default` is the client's fail-safe."""
        return default

    def react(self, observation: dict | None, now_s: float) -> dict | None:
        """Woken between steps: an action to send at once, or None."""
        return None

    def begin_attempt(self, now_s: float) -> None:
        """An episode (an attempt at the task) starts."""

    def outcome(self, now_s: float) -> str | None:
        """None (go on), or how the attempt ended: done, retry, stop."""
        return None

    def retry_reset_s(self) -> float:
        return 0.0

    # -- chunks and reporting
    def on_chunk(self, seq_id: int, arrived_s: float) -> None:
        """A chunk answering `seq_id` went into the buffer."""

    def figures(self) -> dict:
        return {}

    def summary(self) -> dict | None:
        return None
