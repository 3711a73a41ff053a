"""Configuration of the simulated robot, registered in LeRobot's robot registry as ``zenoh_sim``.

It lives in its own module, apart from :mod:`lerobot_zenoh.client.sim_robot`, because that is
how LeRobot finds the device class of a config it does not know by name:
``make_robot_from_config`` strips ``Config`` from the class name (``SimRobot``) and, for a config
module named ``config_<x>``, imports the sibling module ``<x>`` (here ``sim_robot``). Importing
either module registers the choice, so ``--robot.type=zenoh_sim`` works on a draccus CLI::

    --robot.type=zenoh_sim --robot.cameras='{front: [96, 128]}' --robot.control_mode=velocity
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lerobot.robots import RobotConfig

from lerobot_zenoh.client.options import SIM_CAMERAS
from lerobot_zenoh.errors import ConfigError

__all__ = ["SO101_JOINTS", "SimRobotConfig"]

# The joints of an SO-101 arm, in LeRobot's order.
SO101_JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
CONTROL_MODES = ("position", "velocity")


@RobotConfig.register_subclass("zenoh_sim")
@dataclass(kw_only=True)
class SimRobotConfig(RobotConfig):
    """A robot without hardware: first-order joint dynamics and rendered camera images."""

    joints: list[str] = field(
        default_factory=lambda: list(SO101_JOINTS), metadata={"help": "Joint names, in action order."}
    )
    cameras: dict[str, tuple[int, int]] = field(
        default_factory=lambda: dict(SIM_CAMERAS),
        metadata={"help": "Camera name -> (height, width) of its RGB image, e.g. '{front: [96, 128]}'."},
    )
    control_mode: str = field(
        default="position",
        metadata={"help": "'position': actions are joint targets (<joint>.pos); 'velocity': joint velocities (<joint>.vel)."},
    )
    time_constant_s: float = field(
        default=0.1, metadata={"help": "Position mode: first-order time constant of each joint tracking its target."}
    )
    fps: int = field(default=30, metadata={"help": "Control rate; every send_action advances the dynamics 1/fps s."})
    initial_positions: dict[str, float] = field(
        default_factory=dict, metadata={"help": "Joint -> starting position; joints not named start at 0."}
    )
    position_noise_std: float = field(default=0.0, metadata={"help": "Std of noise added to observed positions."})
    image_noise_std: float = field(default=0.0, metadata={"help": "Std of noise added to image pixels (0-255)."})
    seed: int | None = field(default=None, metadata={"help": "Seed of the observation noise."})

    def __post_init__(self) -> None:
        # Deliberately not RobotConfig.__post_init__: its only check reads CameraConfig attributes,
        # and a simulated camera is no LeRobot CameraConfig (it has only a shape): its cameras are
        # validated here. (No comment above a field: draccus would print it as the flag's help.)
        if not self.joints:
            raise ConfigError("robot.joints", "needs at least one joint")
        if len(set(self.joints)) != len(self.joints):
            raise ConfigError("robot.joints", f"joint names must be unique, got {self.joints}")
        for name in self.joints:
            if not name or "/" in name or "." in name:
                raise ConfigError("robot.joints", f"invalid joint name {name!r} (empty, '/' or '.')")
        for cam, shape in self.cameras.items():
            if not cam or "/" in cam or "." in cam:
                raise ConfigError("robot.cameras", f"invalid camera name {cam!r} (empty, '/' or '.')")
            if cam in self.joints:
                raise ConfigError("robot.cameras", f"camera {cam!r} has the name of a joint")
            if len(shape) != 2 or any(int(v) != v or v <= 0 for v in shape):
                raise ConfigError(f"robot.cameras.{cam}", f"must be [height, width] of positive ints, got {shape}")
        self.cameras = {cam: (int(h), int(w)) for cam, (h, w) in self.cameras.items()}
        if self.control_mode not in CONTROL_MODES:
            raise ConfigError("robot.control_mode", f"must be one of {CONTROL_MODES}, got {self.control_mode!r}")
        if not (math.isfinite(self.time_constant_s) and self.time_constant_s > 0):
            raise ConfigError("robot.time_constant_s", f"must be positive, got {self.time_constant_s}")
        if self.fps <= 0:
            raise ConfigError("robot.fps", f"must be positive, got {self.fps}")
        unknown = set(self.initial_positions) - set(self.joints)
        if unknown:
            raise ConfigError("robot.initial_positions", f"unknown joints {sorted(unknown)}; joints: {self.joints}")
        for name in ("position_noise_std", "image_noise_std"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"robot.{name}", f"must be >= 0, got {value}")

    @property
    def dt_s(self) -> float:
        return 1.0 / self.fps
