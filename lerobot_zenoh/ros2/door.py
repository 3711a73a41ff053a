"""The ROS 2 front door: each configured ROS 2 robot (rmw_zenoh) is one robot session of a served model.

    start()  open the fleet's Zenoh (`endpoint`) and find the served model; check every robot's
             mapping against the model's status (a mismatch: one `ConfigError` naming the field,
             ``robots.<i>.<field>``); open the robots' Zenoh (`ros_endpoint`, their router or a
             fleet router that routes for them); then, per robot, the project's robot client
             (client/client.py) on a `Ros2Robot`, with `StaleGate` as its task, and its control
             loop on a thread of its own.
    close()  stop the loops, close the clients, undeclare the ROS 2 entities, close the sessions.

The clients share the door's fleet session; each has its own client id, nonce, in-flight table,
action buffer and threads, so the server batches, schedules, limits and reports each as the robot
it is, and one robot's faults (a flood on its topics, garbage, a camera that stops) stay its own.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Literal

from pydantic import Field, field_validator

from lerobot_zenoh.client.task import Ask, Task
from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import CompatibilityError, ConfigError
from lerobot_zenoh.protocol.keys import APP_FIELDS
from lerobot_zenoh.ros2.mapping import RobotMapping
from lerobot_zenoh.transport.settings import ZenohSettings

log = logging.getLogger(__name__)

__all__ = ["Ros2Door", "Ros2DoorConfig", "StaleGate"]


class Ros2DoorConfig(Settings):
    """The ROS 2 front door's settings (a YAML/JSON file for `lerobot-zenoh-ros2 --config_path`, or flags)."""

    config_prefix = ""

    # -- the fleet side (docs/protocol.md): what the robot client would be given
    endpoint: str = "tcp/127.0.0.1:7447"  # the policy server, or a fleet router
    cluster_uuid: str | None = None  # unset: taken from what the endpoint serves
    experiment_tag: str | None = None
    model_id: str | None = None
    model_version: str | None = None
    application_tag: str | None = None
    zenoh: dict[str, Any] = Field(default_factory=dict)  # more ZenohSettings for the fleet side (TLS, mode, ...)
    discovery_timeout_s: float = Field(10.0, gt=0)
    jpeg_quality: int = Field(90, ge=1, le=100)  # raw camera images are JPEG-encoded for the fleet
    telemetry_period_s: float = Field(1.0, ge=0)
    client: dict[str, Any] = Field(default_factory=dict, description=(
        "More robot-client settings for every robot (lerobot-robot-client's flags as a map: send, aggregate, rtc, ...)"))
    # -- the ROS 2 side
    ros_endpoint: str = "tcp/127.0.0.1:7447"  # the robots' Zenoh router (rmw_zenohd) or a router routing for them
    ros_zenoh: dict[str, Any] = Field(default_factory=dict)  # more ZenohSettings for the ROS 2 side (TLS, ...)
    max_jpeg_bytes: int = Field(4 << 20, ge=1024, le=64 << 20, description=(
        "The largest CompressedImage JPEG taken (a larger sample is refused unread, too_large)"))
    attachment: Literal["current", "named"] = Field("current", description=(
        "The attachment layout the door writes: current (rmw_zenoh's AttachmentData: sequence number, timestamp, "
        "gid) or named (each field after its name, as earlier rmw_zenoh releases wrote and read it)"))
    robots: list[RobotMapping] = Field(default_factory=list, validate_default=True)  # the ROS 2 robots and their topics (docs/ros2.md)

    @field_validator("robots")
    @classmethod
    def _unique_ids(cls, value: list[RobotMapping]) -> list[RobotMapping]:
        if not value:
            raise ValueError("name at least one robot (client_uuid, cameras, state, action)")
        ids = [r.client_uuid for r in value]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"client_uuid {twice[0]!r} is used by more than one robot")
        return value

    def given_app(self) -> dict[str, str]:
        return {n: v for n in APP_FIELDS if (v := getattr(self, n)) is not None}

    def fleet_settings(self) -> ZenohSettings:
        return _settings("zenoh", {"mode": "client", "connect": [self.endpoint], "multicast_scouting": False,
                                   **self.zenoh})

    def ros_settings(self) -> ZenohSettings:
        return _settings("ros_zenoh", {"mode": "client", "connect": [self.ros_endpoint],
                                       "multicast_scouting": False, **self.ros_zenoh})


def _settings(field: str, values: dict) -> ZenohSettings:
    try:
        return ZenohSettings(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(field, str(exc)) from None


#: Robot-client settings the door sets itself (from the mapping, the model or its own settings).
_DOOR_SETS = frozenset({"robot", "client_uuid", "cluster_uuid", "experiment_tag", "model_id", "model_version",
                        "application_tag", "endpoint", "server_address", "zenoh", "fps", "task", "jpeg_quality",
                        "telemetry_period_s", "discovery_timeout_s", "dataset", "pipeline", "resume", "same_host",
                        "duration_s", "summary_path", "log_level"})


def client_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The `client:` block as robot-client settings: each field decoded as lerobot-robot-client's flag
    of that name is (draccus), e.g. ``{send: {max_in_flight: 2}, aggregate: {type: latest_only}}``."""
    import dataclasses
    import typing

    import draccus

    from lerobot_zenoh.client.config import RobotClientConfig

    hints = typing.get_type_hints(RobotClientConfig)
    known = {f.name for f in dataclasses.fields(RobotClientConfig)} - _DOOR_SETS
    out = {}
    for name, value in values.items():
        if name not in known:
            raise ConfigError(f"client.{name}", f"not a robot-client setting the door takes (it takes: "
                              f"{', '.join(sorted(known))})")
        if dataclasses.is_dataclass(value):
            out[name] = value
            continue
        try:
            out[name] = draccus.decode(hints[name], value)
        except Exception as exc:  # draccus raises several kinds; each is one mistake in this field
            raise ConfigError(f"client.{name}", str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    return out


class StaleGate(Task):
    """The robot client's task for a ROS 2 robot: send only fresh observations, publish each chunk.

    `ask`: when the send rule says so, an observation is sent only if every topic's newest valid
    value is within `max_age_s` (else counted ``stale.<what>`` and nothing is sent).
    `on_chunk`: the action buffer's plan (the accepted chunk merged, RTC leftovers kept) goes to
    the robot's controller as one JointTrajectory. `failsafe`: no action, so nothing is published.
    """

    same_host_allowed = False  # JPEG frames pass through untouched: never through /dev/shm
    refetch_allowed = False  # a refresh would capture without the freshness check

    def __init__(self, robot, buffer):
        self.robot = robot
        self.buffer = buffer

    def ask(self, seq_id: int, now_s: float, system1_due: bool) -> Ask | None:
        if not system1_due:
            return None
        stale = self.robot.stale(now_s)
        if stale is not None:
            self.robot.counters.add(f"stale.{stale}")
            return None
        return Ask()

    def on_chunk(self, seq_id: int, arrived_s: float) -> None:
        _, rows = self.buffer.leftover()
        self.robot.publish_plan(rows)

    def failsafe(self, observation: dict, default: dict) -> dict:
        return {}

    def telemetry_labels(self, robot) -> dict[str, str]:
        return {"robot_type": "ros2_rmw_zenoh", "role": "ros2_front_door"}

    def figures(self) -> dict:
        return {f"ros2.{k}": v for k, v in self.robot.counters.snapshot().items()}


class Ros2Door:
    """Construct with a config (no I/O); `start()` checks and connects everything; `close()`."""

    def __init__(self, config: Ros2DoorConfig, *, fleet_session=None, ros_session=None):
        self.config = config
        self.status = None
        self.app = None
        self.clients: dict[str, object] = {}
        self.robots: dict[str, object] = {}
        self._fleet = fleet_session
        self._own_fleet = fleet_session is None
        self._ros = ros_session
        self._own_ros = ros_session is None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Ros2Door:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> Ros2Door:
        from lerobot_zenoh.client.discovery import find_app, query_status
        from lerobot_zenoh.client.link import open_session

        cfg = self.config
        if self._fleet is None:
            self._fleet = open_session(cfg.fleet_settings(), cfg.discovery_timeout_s)
        served = find_app(self._fleet, cfg.given_app(), cfg.discovery_timeout_s)
        self.app = served.app
        statuses = []
        for i, robot in enumerate(cfg.robots):
            status = query_status(self._fleet, self.app, client_uuid=robot.client_uuid) or served.status
            if status.client_admitted is False:
                raise CompatibilityError(f"the server does not serve client {robot.client_uuid!r} (robots.{i}): list "
                                         "it under the model's `clients` in its manifest, or set accept_unknown_clients")
            robot.check(status, f"robots.{i}")
            statuses.append(status)
        self.status = statuses[0]
        if not self.status.fps:
            raise CompatibilityError(f"model {self.status.model_id!r} states no fps: the door cannot pace its robots")
        if self._ros is None:
            try:  # (as the fleet's side: a dead endpoint is one line at once, a refused certificate named)
                self._ros = open_session(cfg.ros_settings(), cfg.discovery_timeout_s)
            except CompatibilityError as exc:
                raise CompatibilityError(f"--ros_endpoint: {exc}") from None
        for robot in cfg.robots:
            self._start_robot(robot, self.status)
        log.info("ROS 2 front door: %d robot(s) served by %s at %d fps", len(cfg.robots), self.app.prefix,
                 self.status.fps)
        return self

    def _start_robot(self, mapping: RobotMapping, status) -> None:
        from lerobot_zenoh.client.client import RobotClient
        from lerobot_zenoh.client.config import RobotClientConfig
        from lerobot_zenoh.ros2.robot import Ros2Robot, Ros2RobotConfig
        from lerobot_zenoh.scheduling.action_buffer import ActionBuffer

        cfg, app = self.config, self.app
        fps = int(status.fps)
        robot_cfg = Ros2RobotConfig(id=mapping.client_uuid, mapping=mapping, cameras=dict(status.expected_cameras),
                                    fps=fps, max_jpeg_bytes=cfg.max_jpeg_bytes,
                                    named_attachment=cfg.attachment == "named")
        client_cfg = RobotClientConfig(
            robot=robot_cfg, client_uuid=mapping.client_uuid, cluster_uuid=app.cluster,
            experiment_tag=app.experiment, model_id=app.model, model_version=app.version,
            application_tag=app.app, endpoint=cfg.endpoint, zenoh=cfg.fleet_settings(), fps=fps,
            task=mapping.task, jpeg_quality=cfg.jpeg_quality, telemetry_period_s=cfg.telemetry_period_s,
            discovery_timeout_s=cfg.discovery_timeout_s, **client_fields(cfg.client))
        robot = Ros2Robot(robot_cfg, self._ros)
        buffer = ActionBuffer(client_cfg.aggregate)
        client = RobotClient(client_cfg, robot, task=StaleGate(robot, buffer), session=self._fleet,
                             buffer=buffer)
        self.robots[mapping.client_uuid] = robot
        self.clients[mapping.client_uuid] = client
        client.start()
        thread = threading.Thread(target=client.run, name=f"{mapping.client_uuid}:ros2-loop", daemon=True)
        thread.start()
        self._threads.append(thread)

    def figures(self) -> dict[str, dict]:
        """Per robot: the ROS side's counters and the robot client's main ones."""
        out = {}
        for uuid, client in self.clients.items():
            c = client.counters
            out[uuid] = {**self.robots[uuid].counters.snapshot(), "steps": c.steps,
                         "observations_published": c.observations_published, "chunks_received": c.chunks_received}
        return out

    def close(self) -> None:
        self._stop.set()
        for client in self.clients.values():
            client.stop()
        for thread in self._threads:
            thread.join(10)
        for client in self.clients.values():
            client.close()
        for robot in self.robots.values():
            if robot.is_connected:
                robot.disconnect()
        if self._ros is not None and self._own_ros:
            self._ros.close()
        if self._fleet is not None and self._own_fleet:
            self._fleet.close()
        self._ros = self._fleet = None
