"""One robot's part of a plan: what `lerobot-robot-client --pipeline.plan=plan.json` runs.

plan.json (written by `pipelines/deployment.py`) carries, besides the summary, the factory's key
prefix (`cluster_uuid`, `experiment_tag`), every task descriptor (`tasks`) and per robot its task,
control rate, chunk length and one route per component: the server's endpoint, its app key
(`model_id`, `model_version`, `application_tag`), the component's kind and its planned request rate.
Reading it is pure and strict: a missing or malformed field is a ConfigError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lerobot_zenoh.errors import ConfigError, KeyExprError
from lerobot_zenoh.pipelines.descriptor import Task, parse_task
from lerobot_zenoh.protocol.keys import AppKey, pipeline_app


@dataclass(frozen=True)
class Route:
    """Where one component of the robot's task is served."""

    component: str
    kind: str  # system1 | system2 | safety | monitor
    app: AppKey  # the server's app key: it answers on <app>/<robot>/{action,text,verdict}
    endpoint: str | None
    rate_hz: float | None  # planned requests per second


@dataclass(frozen=True)
class RobotPlan:
    robot: str
    task: Task
    cluster: str
    experiment: str
    routes: dict[str, Route]
    fps: int | None = None
    actions_per_chunk: int | None = None

    @property
    def stream(self) -> AppKey:
        """The task's observation stream: the robot publishes each observation here, once."""
        return pipeline_app(self.cluster, self.experiment, self.task.name)

    @property
    def system1(self) -> Route:
        return next(r for r in self.routes.values() if r.kind == "system1")

    @property
    def rates_hz(self) -> dict[str, float]:
        return {name: r.rate_hz for name, r in self.routes.items() if r.rate_hz}


def _field(d: dict, name: str, kinds, where: str):
    if not isinstance(d, dict) or name not in d:
        raise ConfigError(f"{where}.{name}", "missing (a plan.json written by an older lerobot-zenoh-plan? re-plan)")
    value = d[name]
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise ConfigError(f"{where}.{name}", f"has the wrong type ({type(value).__name__})")
    return value


def robot_plan(doc: dict, robot: str, source: str = "<memory>") -> RobotPlan:
    """The plan of `robot` in a plan.json document."""
    try:
        robots = _field(doc, "robots", dict, "plan")
        if robot not in robots:
            known = sorted(robots)
            raise ConfigError("client_uuid", f"{robot!r} is not a robot of this plan (it has {len(known)}: "
                                             f"{', '.join(known[:5])}{', ...' if len(known) > 5 else ''})", source=source)
        entry = robots[robot]
        where = f"robots.{robot}"
        task_name = _field(entry, "task", str, where)
        tasks = _field(doc, "tasks", dict, "plan")
        if task_name not in tasks:
            raise ConfigError(f"{where}.task", f"{task_name!r} is not in the plan's tasks")
        task = parse_task({**tasks[task_name], "name": task_name}, source=f"{source}: tasks.{task_name}")
        cluster = _field(doc, "cluster_uuid", str, "plan")
        experiment = _field(doc, "experiment_tag", str, "plan")
        routes = {}
        for comp, r in _field(entry, "routes", dict, where).items():
            rw = f"{where}.routes.{comp}"
            if comp not in task.components:
                raise ConfigError(rw, f"is not a component of task {task_name!r}")
            app = AppKey(cluster, experiment, _field(r, "model_id", str, rw), _field(r, "model_version", str, rw),
                         _field(r, "application_tag", str, rw))
            rate = r.get("rate_hz")
            routes[comp] = Route(comp, task.components[comp].kind, app, r.get("endpoint"),
                                 float(rate) if isinstance(rate, (int, float)) and rate > 0 else None)
        missing = sorted(set(task.components) - set(routes))
        if missing:
            raise ConfigError(f"{where}.routes", f"no route for component(s) {', '.join(missing)}")
        fps = entry.get("fps")
        apc = entry.get("actions_per_chunk")
        return RobotPlan(robot, task, cluster, experiment, routes, fps if isinstance(fps, int) else None,
                         apc if isinstance(apc, int) else None)
    except KeyExprError as exc:
        raise ConfigError(exc.field, str(exc), source=source) from None
    except ConfigError as exc:
        if exc.source is None:
            raise ConfigError(exc.field, str(exc).split(": ", 1)[-1], source=source) from None
        raise


def load_robot_plan(path: str | Path, robot: str) -> RobotPlan:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("pipeline.plan", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("pipeline.plan", f"{path} is not JSON: {exc}") from None
    return robot_plan(doc, robot, source=str(path))
