"""The ROS 2 front door against a simulated ROS 2 robot (tests/lz_ros2_robot.py: rosbags' CDR and
rmw_zenoh's documented keys, not the door's code), a real policy server and real Zenoh on loopback:
a Zenoh router stands for the robot's rmw_zenohd."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("rosbags", reason="the ROS 2 front door needs rosbags (pip install 'lerobot-zenoh[ros2]')")

from lz_ros2_robot import SimRos2Robot, frame  # noqa: E402
import lz_ros2_fleet  # noqa: E402
from lz_ros2_fleet import CAMS, EAGER, JOINTS, ROBOT_CAMERAS, door_config, mapping  # noqa: E402
from lz_testing import make_config, make_server, wait_for  # noqa: E402
from lerobot.robots import Robot  # noqa: E402

from lerobot_zenoh.client.client import RobotClient  # noqa: E402
from lerobot_zenoh.errors import ConfigError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.ros2 import graph  # noqa: E402
from lerobot_zenoh.ros2.door import Ros2Door  # noqa: E402
from lerobot_zenoh.transport.session import ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import ZenohSettings  # noqa: E402

@pytest.fixture
def ros_router():
    with lz_ros2_fleet.ros_router() as router:
        yield router


class FixedRobot(Robot):
    """A Zenoh robot whose observation never changes: the same state and frames as the ROS 2 robot."""

    name = "fixed"

    def __init__(self, state: np.ndarray, images: dict):
        self.robot_type, self.id, self.calibration = self.name, "fixed", {}
        self._state, self._images, self._connected = state, images, False

    observation_features = property(lambda self: {**{f"s{i}": float for i in range(6)},
                                                  **{c: (*hw, 3) for c, hw in CAMS.items()}})
    action_features = property(lambda self: {f"a{i}": float for i in range(6)})
    is_connected = property(lambda self: self._connected)
    is_calibrated = property(lambda self: True)

    def connect(self, calibrate: bool = True) -> None:
        self._connected = True

    def calibrate(self) -> None: ...
    def configure(self) -> None: ...

    def disconnect(self) -> None:
        self._connected = False

    def get_observation(self) -> dict:
        return {**{f"s{i}": float(v) for i, v in enumerate(self._state)}, **self._images}

    def send_action(self, action: dict) -> dict:
        return action


def test_chunks_reach_the_ros2_robot_batched_with_a_zenoh_robot_and_equal_its_answer(port, app_key, ros_router):
    ros_port, _ = ros_router
    with make_server(port, app_key, latency_ms=150, cameras=CAMS, chunk_size=20, max_batch_size=4) as server, \
            SimRos2Robot(ros_port, cameras=ROBOT_CAMERAS, joints=JOINTS, hold=True) as sim, \
            Ros2Door(door_config(port, ros_port, app_key, [mapping()], client={"send": EAGER})) as door:
        # The Zenoh robot: the same observation (state in the mapping's joint order, the same frames).
        state = sim.positions.astype(np.float32)
        zenoh_robot = FixedRobot(state, {"front": frame(CAMS["front"], 1), "wrist": frame(CAMS["wrist"], 2)})
        chunks: list[np.ndarray] = []
        listener = ZenohSession(ZenohSettings(mode="client", connect=[f"tcp/127.0.0.1:{port}"],
                                              multicast_scouting=False)).open()
        listener.subscribe(app_key.client("zr").action,
                           lambda k, p: chunks.append(codec.decode_action_answer(p).actions))
        # JPEG as the door sends (same host, it would otherwise hand the server raw pixels through /dev/shm).
        client = RobotClient(make_config(port, app_key, client_uuid="zr", same_host=False, send=EAGER), zenoh_robot).start()
        loop = threading.Thread(target=client.run, daemon=True)
        loop.start()
        try:
            batched = lambda: max(server.models[0].session_table.batch_sizes, default=0) > 1  # noqa: E731
            assert wait_for(lambda: len(sim.trajectories) >= 8 and len(chunks) >= 8 and batched(), 30), \
                (len(sim.trajectories), len(chunks), door.figures())
        finally:
            client.stop()
            loop.join(5)
            client.close()
            listener.close()
        answer = chunks[-1]
        for other in chunks:
            np.testing.assert_array_equal(other, answer)
        for _, msg, attachment in sim.trajectories:
            assert list(msg.joint_names) == list(JOINTS)
            assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (0, 0)  # start on receipt
            points = np.stack([p.positions for p in msg.points])
            starts = [k for k in range(len(answer)) if np.allclose(answer[k], points[0], atol=1e-6)]
            assert starts, (points[0], answer)
            k0 = starts[0]
            np.testing.assert_allclose(points, answer[k0:k0 + len(points)], atol=1e-6)
            times = [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points]
            np.testing.assert_allclose(times, np.arange(len(points)) / 30, atol=1e-6)
            seq = graph.decode_attachment(attachment)
            assert seq.sequence_number > 0 and len(seq.source_gid) == 16
        # The door is in the ROS graph: its node, its subscriptions and its trajectory publisher.
        tokens = sim.graph()
        assert any(t.endswith("/NN/%/%arm1/lerobot_zenoh_door") for t in tokens), tokens
        assert any("/MP/%/%arm1/lerobot_zenoh_door/%arm1%arm_controller%joint_trajectory/"
                   "trajectory_msgs::msg::dds_::JointTrajectory_/RIHS01_" in t for t in tokens), tokens
        assert sum("/MS/" in t for t in tokens) == 3, tokens
        figures = door.figures()["arm1"]
        assert figures["trajectories_published"] >= 8 and not any(k.startswith("rejected.") for k in figures)


def test_the_ros2_robot_follows_its_trajectories_with_real_time_chunking(port, app_key, ros_router):
    ros_port, _ = ros_router
    with make_server(port, app_key, latency_ms=20, cameras=CAMS, chunk_size=20, rtc=True), \
            SimRos2Robot(ros_port, cameras=ROBOT_CAMERAS, joints=JOINTS) as sim, \
            Ros2Door(door_config(port, ros_port, app_key, [mapping()], attachment="named")) as door:
        start = sim.positions.copy()
        assert wait_for(lambda: len(sim.trajectories) >= 3, 15), door.figures()
        _, _, attachment = sim.trajectories[-1]  # the earlier layout, each field after its name
        assert b"sequence_number" in attachment and graph.decode_attachment(attachment).sequence_number > 0
        assert wait_for(lambda: np.abs(sim.positions - start).max() > 0.02, 10)  # its joints moved as told
        assert door.clients["arm1"].counters.observations_published >= 3
        # The robot client's RTC leftovers went with its observations; chunks came back computed with them.
        assert door.clients["arm1"].rtc_active
        assert wait_for(lambda: door.clients["arm1"].counters.rtc_chunks >= 2, 10), door.figures()
        figures, _ = door.clients["arm1"].telemetry_figures()  # the ROS side's counters, in its telemetry
        assert figures["ros2.received.state"] > 0 and figures["ros2.trajectories_published"] >= 3, figures


@pytest.mark.parametrize("change, field", [
    ({"cameras": {"front": {"topic": "a"}, "top": {"topic": "b"}}}, "robots.0.cameras.top"),
    ({"cameras": {"front": {"topic": "a"}}}, "robots.0.cameras"),
    ({"action": {"topic": "t", "joints": ["j1", "j2"]}}, "robots.0.action.joints"),
    ({"state": {"topic": "s", "joints": ["j1"]}}, "robots.0.state.joints"),
])
def test_a_mapping_that_does_not_fit_the_model_fails_naming_the_field(port, app_key, ros_router, change, field):
    ros_port, _ = ros_router
    with make_server(port, app_key, cameras=CAMS):
        with pytest.raises(ConfigError) as exc:
            with Ros2Door(door_config(port, ros_port, app_key, [mapping(**change)], discovery_timeout_s=5)):
                pass
    assert exc.value.field == field, exc.value


def test_cli_refuses_a_mapping_that_does_not_fit_in_one_line(port, app_key, ros_router, tmp_path):
    import subprocess
    import sys

    import yaml

    ros_port, _ = ros_router
    config = tmp_path / "ros2.yaml"
    config.write_text(yaml.safe_dump({
        "endpoint": f"tcp/127.0.0.1:{port}", "cluster_uuid": app_key.cluster, "ros_endpoint": f"tcp/127.0.0.1:{ros_port}",
        "robots": [mapping(cameras={"front": {"topic": "a"}, "wrist": {"topic": "b"}, "top": {"topic": "c"}})]}))
    with make_server(port, app_key, cameras=CAMS):
        done = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.ros2", f"--config_path={config}"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("lerobot-zenoh-ros2: --robots.0.cameras.top: 'top' is not a camera of model"), lines


def test_a_robots_router_that_nothing_listens_on_is_one_line_at_once(port, app_key):
    """A typo in --ros_endpoint: refused as the fleet's endpoint is (nothing listens there), naming
    the flag, instead of Zenoh's own timeout and message."""
    import time

    from lz_testing import free_port

    from lerobot_zenoh.errors import CompatibilityError

    with make_server(port, app_key, cameras=CAMS):
        t0 = time.monotonic()
        with pytest.raises(CompatibilityError, match=r"^--ros_endpoint: cannot connect to tcp/127\.0\.0\.1:\d+: "
                                                     r"nothing answers there"):
            with Ros2Door(door_config(port, free_port(), app_key, [mapping()], discovery_timeout_s=5)):
                pass
        print(f"refused in {time.monotonic() - t0:.2f} s")
