"""Which ROS 2 topic is which camera, state and action of the served model: declared, then checked.

One block per ROS 2 robot (``robots:`` of the door's settings, docs/ros2.md)::

    - client_uuid: arm1                 # its robot session on the fleet (the manifest's `clients`)
      domain_id: 0                      # ROS_DOMAIN_ID of the robot
      namespace: /arm1                  # relative topics below resolve under it
      cameras:                          # the model's camera -> the robot's topic
        front: {topic: camera/front/image_raw}                  # sensor_msgs/msg/Image (rgb8, bgr8, mono8)
        wrist: {topic: camera/wrist/image_raw/compressed, type: sensor_msgs/msg/CompressedImage}  # JPEG
      state: {topic: joint_states, joints: [j1, j2, j3, j4, j5, j6]}   # sensor_msgs/msg/JointState, in order
      action: {topic: arm_controller/joint_trajectory, joints: [j1, j2, j3, j4, j5, j6]}
      action_array_topic: null          # optional std_msgs/msg/Float64MultiArray, one action per step
      max_age_s: 0.25                   # a topic silent for longer: no observation is sent

`check` compares each block with the model's status at start-up and raises one `ConfigError`
naming the field (``robots.0.cameras.front``) for the first thing that does not fit.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol.keys import validate_client_id
from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES, Status
from lerobot_zenoh.ros2 import cdr, graph

__all__ = ["ActionTopic", "CameraTopic", "RobotMapping", "StateTopic"]


def _checked_topic(value: str) -> str:
    graph.NodeName().resolve(value)  # ValueError names the rule
    return value


def _checked_joints(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise ValueError("name at least one joint")
    if len(set(value)) != len(value):
        raise ValueError(f"a joint is named twice: {list(value)}")
    if any(not j or len(j.encode()) > cdr.MAX_STRING_BYTES for j in value):
        raise ValueError(f"joint names are 1..{cdr.MAX_STRING_BYTES} bytes")
    return value


class CameraTopic(Settings):
    topic: str
    type: Literal["sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage"] = "sensor_msgs/msg/Image"

    _topic = field_validator("topic")(classmethod(lambda cls, v: _checked_topic(v)))


class StateTopic(Settings):
    topic: str = "joint_states"
    joints: tuple[str, ...]

    _topic = field_validator("topic")(classmethod(lambda cls, v: _checked_topic(v)))
    _joints = field_validator("joints")(classmethod(lambda cls, v: _checked_joints(v)))


class ActionTopic(Settings):
    topic: str
    joints: tuple[str, ...]  # the JointTrajectory's joint_names, in the model's action order

    _topic = field_validator("topic")(classmethod(lambda cls, v: _checked_topic(v)))
    _joints = field_validator("joints")(classmethod(lambda cls, v: _checked_joints(v)))


class RobotMapping(Settings):
    """One ROS 2 robot of the door (see the module docstring)."""

    config_prefix = "robots"

    client_uuid: str
    domain_id: int = Field(0, ge=0, le=232)  # ROS 2's range of domain ids
    namespace: str = "/"
    node_name: str = "lerobot_zenoh_door"
    cameras: dict[str, CameraTopic] = Field(default_factory=dict)
    state: StateTopic
    action: ActionTopic
    action_array_topic: str | None = None
    max_age_s: float = Field(0.25, gt=0, le=10)
    task: str = Field("", max_length=MAX_TASK_BYTES)

    @field_validator("client_uuid")
    @classmethod
    def _client_id(cls, value: str) -> str:
        validate_client_id("client_uuid", value)
        return value

    @field_validator("action_array_topic")
    @classmethod
    def _array_topic(cls, value: str | None) -> str | None:
        return value if value is None else _checked_topic(value)

    @model_validator(mode="after")
    def _names(self) -> RobotMapping:
        try:
            node = self.node()
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        topics = [node.resolve(c.topic) for c in self.cameras.values()] + [node.resolve(self.state.topic)]
        outs = [node.resolve(self.action.topic)] + ([node.resolve(self.action_array_topic)]
                                                    if self.action_array_topic else [])
        twice = sorted({t for t in topics + outs if (topics + outs).count(t) > 1})
        if twice:
            raise ValueError(f"topic {twice[0]!r} is mapped twice")
        return self

    def node(self) -> graph.NodeName:
        return graph.NodeName(self.namespace, self.node_name)

    def check(self, status: Status, at: str) -> None:
        """ConfigError naming the field under `at` (``robots.0``) when this robot does not fit the model."""
        cams = status.expected_cameras
        for cam in self.cameras:
            if cam not in cams:
                raise ConfigError(f"{at}.cameras.{cam}", f"{cam!r} is not a camera of model {status.model_id!r} "
                                  f"(it has: {', '.join(sorted(cams)) or 'none'})")
        unmapped = sorted(set(cams) - set(self.cameras))
        if unmapped:
            raise ConfigError(f"{at}.cameras", f"the model's camera {unmapped[0]!r} has no topic "
                              f"(add '{unmapped[0]}: {{topic: <image topic>}}')")
        if status.state_dim is not None and len(self.state.joints) != status.state_dim:
            raise ConfigError(f"{at}.state.joints", f"{len(self.state.joints)} joints, model {status.model_id!r} "
                              f"takes a state of {status.state_dim}")
        if len(self.action.joints) != status.action_dim:
            raise ConfigError(f"{at}.action.joints", f"{len(self.action.joints)} joints, model "
                              f"{status.model_id!r} gives actions of {status.action_dim}")
