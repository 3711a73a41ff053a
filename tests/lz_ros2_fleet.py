"""The door's side of the ROS 2 tests: the mapping of the simulated robots, the door's settings, and a
Zenoh router on loopback that stands for the robots' rmw_zenohd (tests/ only)."""

from __future__ import annotations

import contextlib

from lz_testing import free_port

from lerobot_zenoh.ros2.door import Ros2DoorConfig
from lerobot_zenoh.scheduling.action_buffer import LatestOnlyConfig
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings

CAMS = {"front": (48, 64), "wrist": (48, 64)}
JOINTS = ("j1", "j2", "j3", "j4", "j5", "j6")
ROBOT_CAMERAS = {"front": ("camera/front/image_raw", "raw", CAMS["front"]),
                 "wrist": ("camera/wrist/image_raw/compressed", "jpeg", CAMS["wrist"])}


def mapping(client_uuid="arm1", namespace="/arm1", **changes) -> dict:
    m = {"client_uuid": client_uuid, "namespace": namespace,
         "cameras": {"front": {"topic": "camera/front/image_raw"},
                     "wrist": {"topic": "camera/wrist/image_raw/compressed",
                               "type": "sensor_msgs/msg/CompressedImage"}},
         "state": {"topic": "joint_states", "joints": list(JOINTS)},
         "action": {"topic": "arm_controller/joint_trajectory", "joints": list(JOINTS)}}
    m.update(changes)
    return m


#: Both robots keep two requests in flight, so that the server finds them waiting together (batches).
EAGER = SendTriggerConfig(buffer_time_s=5.0, max_in_flight=2)


def door_config(port, ros_port, app_key, robots, client=None, **kw) -> Ros2DoorConfig:
    # latest_only: the plan is the newest chunk's rows, so a trajectory is a slice of one answer.
    return Ros2DoorConfig(endpoint=f"tcp/127.0.0.1:{port}", cluster_uuid=app_key.cluster,
                          experiment_tag=app_key.experiment, model_id=app_key.model,
                          ros_endpoint=f"tcp/127.0.0.1:{ros_port}", telemetry_period_s=0, robots=robots,
                          client={"aggregate": LatestOnlyConfig(), **(client or {})}, **kw)


@contextlib.contextmanager
def ros_router():
    """A Zenoh router on loopback (the robots' rmw_zenohd): yields (its port, its session)."""
    ros_port = free_port()
    with ZenohSession(ZenohSettings(mode="router", listen=[f"tcp/127.0.0.1:{ros_port}"],
                                    multicast_scouting=False)) as router:
        yield ros_port, router
