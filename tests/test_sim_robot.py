"""The simulated robot: LeRobot registry and CLI, dynamics, images that follow the joints."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import draccus
import numpy as np
import pytest
from lerobot.robots import Robot, RobotConfig, make_robot_from_config
from lerobot.utils.errors import DeviceAlreadyConnectedError, DeviceNotConnectedError

from lerobot_zenoh.client.sim_robot import SimRobot, SimRobotConfig
from lerobot_zenoh.errors import ConfigError

JOINTS = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper"]


@dataclass
class _ClientLikeConfig:
    robot: RobotConfig


def test_registered_and_built_by_lerobot(tmp_path):
    assert RobotConfig.get_choice_class("zenoh_sim") is SimRobotConfig
    config = SimRobotConfig(id="sim0")
    assert config.type == "zenoh_sim"
    robot = make_robot_from_config(config)
    assert isinstance(robot, SimRobot) and isinstance(robot, Robot)
    assert robot.name == "zenoh_sim" and robot.id == "sim0"


def test_constructor_creates_no_calibration_folder(tmp_path):
    SimRobot(SimRobotConfig(calibration_dir=tmp_path / "calib"))
    assert not (tmp_path / "calib").exists()


def test_draccus_cli_parses_type_cameras_and_mode():
    cfg = draccus.parse(
        _ClientLikeConfig,
        args=[
            "--robot.type=zenoh_sim",
            '--robot.cameras={"front": [48, 64], "top": [24, 32]}',
            "--robot.control_mode=velocity",
            "--robot.joints=[a, b, c]",
            "--robot.initial_positions={b: 5.0}",
            "--robot.time_constant_s=0.2",
            "--robot.seed=3",
        ],
    )
    robot_cfg = cfg.robot
    assert isinstance(robot_cfg, SimRobotConfig)
    assert robot_cfg.cameras == {"front": (48, 64), "top": (24, 32)}
    assert robot_cfg.control_mode == "velocity"
    assert robot_cfg.joints == ["a", "b", "c"]
    assert robot_cfg.initial_positions == {"b": 5.0}
    robot = make_robot_from_config(robot_cfg)
    assert robot.observation_features == {
        "a.pos": float,
        "b.pos": float,
        "c.pos": float,
        "front": (48, 64, 3),
        "top": (24, 32, 3),
    }
    assert robot.action_features == {"a.vel": float, "b.vel": float, "c.vel": float}


def test_defaults_look_like_an_so101_with_two_cameras():
    robot = SimRobot(SimRobotConfig())
    assert robot.action_features == {f"{j}.pos": float for j in JOINTS}
    assert robot.observation_features["front"] == (96, 128, 3)
    assert robot.observation_features["wrist"] == (96, 128, 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"control_mode": "torque"}, "robot.control_mode"),
        ({"cameras": {"front": (0, 128)}}, "robot.cameras.front"),
        ({"cameras": {"a/b": (8, 8)}}, "robot.cameras"),
        ({"joints": []}, "robot.joints"),
        ({"joints": ["a", "a"]}, "robot.joints"),
        ({"time_constant_s": 0.0}, "robot.time_constant_s"),
        ({"fps": 0}, "robot.fps"),
        ({"initial_positions": {"elbow": 1.0}}, "robot.initial_positions"),
        ({"image_noise_std": -1.0}, "robot.image_noise_std"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as excinfo:
        SimRobotConfig(**kwargs)
    assert excinfo.value.field == field


def test_connection_contract():
    robot = SimRobot(SimRobotConfig())
    with pytest.raises(DeviceNotConnectedError):
        robot.get_observation()
    with pytest.raises(DeviceNotConnectedError):
        robot.send_action({})
    with robot:
        assert robot.is_connected and robot.is_calibrated
        with pytest.raises(DeviceAlreadyConnectedError):
            robot.connect()
    assert not robot.is_connected


def test_observation_matches_features():
    with SimRobot(SimRobotConfig(initial_positions={"elbow_flex": 12.5})) as robot:
        obs = robot.get_observation()
        assert set(obs) == set(robot.observation_features)
        assert obs["elbow_flex.pos"] == 12.5
        for cam in ("front", "wrist"):
            assert obs[cam].dtype == np.uint8 and obs[cam].shape == (96, 128, 3)
            assert obs[cam].std() > 10  # content, not a flat colour


def test_position_mode_first_order_convergence():
    config = SimRobotConfig(time_constant_s=0.1, fps=30)
    with SimRobot(config) as robot:
        target = {f"{j}.pos": 50.0 for j in JOINTS}
        sent = robot.send_action(target)
        assert sent == target
        alpha = 1 - math.exp(-(1 / 30) / 0.1)
        np.testing.assert_allclose(robot.positions, 50.0 * alpha)
        for _ in range(59):
            robot.send_action(target)
        np.testing.assert_allclose(robot.positions, 50.0 * (1 - (1 - alpha) ** 60))
        assert np.all(np.abs(robot.positions - 50.0) < 0.01)  # 2 s = 20 time constants
        np.testing.assert_array_equal(robot.commanded, 50.0)
        assert robot.steps == 60


def test_partial_action_keeps_other_commands_and_bad_actions_are_refused():
    with SimRobot(SimRobotConfig(initial_positions={"gripper": 30.0})) as robot:
        sent = robot.send_action({"elbow_flex.pos": 10.0})
        assert sent["gripper.pos"] == 30.0 and sent["elbow_flex.pos"] == 10.0
        with pytest.raises(ValueError):
            robot.send_action({"elbow_flex.vel": 1.0})
        with pytest.raises(ValueError):
            robot.send_action({"elbow_flex.pos": float("nan")})


def test_velocity_mode_integrates_and_zero_velocity_stops():
    config = SimRobotConfig(control_mode="velocity", fps=50, initial_positions={"gripper": 1.0})
    with SimRobot(config) as robot:
        assert set(robot.action_features) == {f"{j}.vel" for j in JOINTS}
        assert set(robot.observation_features) >= {f"{j}.pos" for j in JOINTS}
        for _ in range(50):  # one second at 2 units/s
            robot.send_action({"shoulder_pan.vel": 2.0})
        assert robot.positions[0] == pytest.approx(2.0)
        assert robot.positions[-1] == pytest.approx(1.0)
        assert robot.fail_safe_action() == robot.zero_velocity_action()
        robot.send_action(robot.fail_safe_action())
        robot.send_action(robot.fail_safe_action())
        assert robot.positions[0] == pytest.approx(2.0)
        np.testing.assert_array_equal(robot.commanded, 0.0)


def test_hold_action_holds_position():
    with SimRobot(SimRobotConfig()) as robot:
        for _ in range(5):
            robot.send_action({f"{j}.pos": 40.0 for j in JOINTS})
        held = robot.positions
        assert robot.fail_safe_action() == robot.hold_action()
        for _ in range(10):
            robot.send_action(robot.hold_action())
        np.testing.assert_allclose(robot.positions, held)


def test_images_change_with_the_joint_state_and_are_deterministic():
    with SimRobot(SimRobotConfig()) as a, SimRobot(SimRobotConfig()) as b:
        first = a.get_observation()
        assert np.array_equal(first["front"], b.get_observation()["front"])
        for joint in JOINTS:  # every joint moves at least one camera's picture
            robot = SimRobot(SimRobotConfig(initial_positions={joint: 40.0}))
            robot.connect()
            moved = robot.get_observation()
            diff = sum(np.abs(moved[c].astype(int) - first[c]).mean() for c in ("front", "wrist"))
            assert diff > 0.5, joint
            robot.disconnect()
        assert not np.array_equal(first["front"], first["wrist"])


def test_noise_is_seeded():
    config = dict(position_noise_std=0.5, image_noise_std=4.0, seed=7)
    with SimRobot(SimRobotConfig(**config)) as a, SimRobot(SimRobotConfig(**config)) as b:
        oa, ob = a.get_observation(), b.get_observation()
        assert oa["gripper.pos"] == ob["gripper.pos"] != 0.0
        assert np.array_equal(oa["front"], ob["front"])
        assert a.positions[-1] == 0.0  # noise is in the observation, not the state


def test_rendering_is_cheap():
    with SimRobot(SimRobotConfig(cameras={"front": (96, 128)})) as robot:
        robot.get_observation()
        start = time.perf_counter()
        for _ in range(200):
            robot.get_observation()
        per_call_s = (time.perf_counter() - start) / 200
    # A loose bound that only catches an accidental per-pixel Python loop; timing lives in benchmarks.
    assert per_call_s < 0.01
