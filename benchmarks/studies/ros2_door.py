"""The ROS 2 front door's added latency: a ROS 2 robot through the door beside a Zenoh robot
(`lerobot-robot-client`'s own client on the simulated robot), both served by one model at once.

    python -m benchmarks.studies.ros2_door [--seconds 20] [--height 224 --width 224] [--latency-ms 5] [--chunk 10]

One process holds a synthetic-policy server (chunk --chunk x 6, a set latency, batches up to 8), a Zenoh
router standing for the ROS 2 robot's rmw_zenohd, a ROS 2 robot emulated from rosbags' CDR (two
rgb8 cameras and a JointState at 30 Hz, on rmw_zenoh's keys), the door, and the Zenoh robot. Both
robots run at 30 fps with the same send rule. Figures (ms, loopback):

  capture -> chunk       the robot client's round trip (observation captured -> chunk in its action
                         buffer), for the Zenoh robot and for the door's client of the ROS 2 robot
  sample -> trajectory   what the ROS 2 robot sees: its JointState sample published -> the
                         JointTrajectory computed from it received (its joint j1 carries a counter the
                         synthetic model's answer gives back: action[0] = state[0] + ... < 1)

The difference between the ROS 2 robot's sample -> trajectory and the Zenoh robot's capture ->
chunk is what the door adds as a ROS 2 robot sees it: the age of the newest sample when the
door's control tick captures it (up to one period of 33 ms), CDR decoding, and the trajectory's
encoding and hop back. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid

import numpy as np

HZ = 30
JOINTS = ("j1", "j2", "j3", "j4", "j5", "j6")


def percentiles(values: list[float]) -> str:
    if not values:
        return "- / - (n=0)"
    p50, p99 = np.percentile(values, [50, 99])
    return f"{p50:.1f} / {p99:.1f} (n={len(values)})"


class EmulatedRos2Robot:
    """Two rgb8 cameras and a JointState at 30 Hz on rmw_zenoh's keys; j1 = 10 x sample number."""

    def __init__(self, session, cameras: dict, trajectory_key: str, keys: dict):
        from rosbags.typesys import Stores, get_typestore

        self.store = get_typestore(Stores.ROS2_JAZZY)
        self.session, self.cameras, self.keys = session, cameras, keys
        self.sent_at: dict[int, float] = {}
        self.latencies_ms: list[float] = []
        self._stop = threading.Event()
        self._sub = session.subscribe(trajectory_key, self._on_trajectory)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_trajectory(self, key: str, payload: bytes) -> None:
        now = time.perf_counter()
        msg = self.store.deserialize_cdr(payload, "trajectory_msgs/msg/JointTrajectory")
        n = int(msg.points[0].positions[0] // 10)
        if n in self.sent_at:
            self.latencies_ms.append((now - self.sent_at[n]) * 1000)

    def _run(self) -> None:
        from lerobot_zenoh.ros2 import graph
        from lerobot_zenoh.transport.session import OBSERVATION_QOS

        t = self.store.types
        header = t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=0, nanosec=0), frame_id="")
        rng = np.random.default_rng(0)
        images = {}
        for cam, (h, w) in self.cameras.items():
            msg = t["sensor_msgs/msg/Image"](header=header, height=h, width=w, encoding="rgb8", is_bigendian=0,
                                             step=w * 3, data=rng.integers(0, 255, h * w * 3, dtype=np.uint8))
            images[cam] = bytes(self.store.serialize_cdr(msg, "sensor_msgs/msg/Image"))
        pubs = {name: self.session.publisher(k, OBSERVATION_QOS) for name, k in self.keys.items()}
        gid = bytes(16)
        n = 0
        next_t = time.perf_counter()
        while not self._stop.is_set():
            n += 1
            state = t["sensor_msgs/msg/JointState"](header=header, name=list(JOINTS),
                                                    position=np.array([10.0 * n, 0, 0, 0, 0, 0]),
                                                    velocity=np.zeros(0), effort=np.zeros(0))
            attachment = graph.encode_attachment(graph.Attachment(n, time.time_ns(), gid))
            for cam, payload in images.items():
                pubs[cam].put(payload, attachment=attachment)
            self.sent_at[n] = time.perf_counter()
            pubs["state"].put(bytes(self.store.serialize_cdr(state, "sensor_msgs/msg/JointState")),
                              attachment=attachment)
            next_t += 1 / HZ
            self._stop.wait(max(0.0, next_t - time.perf_counter()))

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run(seconds: float, height: int, width: int, latency_ms: float, chunk: int) -> dict:
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.client import RobotClient
    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
    from lerobot_zenoh.protocol.keys import AppKey
    from lerobot_zenoh.ros2 import cdr, graph
    from lerobot_zenoh.ros2.door import Ros2Door, Ros2DoorConfig
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings
    from testbed.ports import free_port

    app = AppKey("bench", uuid.uuid4().hex[:8], "m", "v1", "app")
    port, ros_port = free_port(), free_port()
    cams = {"front": (height, width), "wrist": (height, width)}
    manifest = parse_manifest({
        "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0", "telemetry_period_s": 0,
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": chunk, "cameras": cams,
                                  "latency_ms": latency_ms},
                    "fps": HZ, "max_batch_size": 8, "accept_unknown_clients": True}]})
    node = graph.NodeName("/arm1", "bench")

    def key(topic: str, ros_type: str) -> str:
        return graph.topic_key(0, graph.TopicName(node.resolve(topic), ros_type, cdr.type_hash(ros_type)))

    keys = {"front": key("front/image_raw", cdr.IMAGE), "wrist": key("wrist/image_raw", cdr.IMAGE),
            "state": key("joint_states", cdr.JOINT_STATE)}
    mapping = {"client_uuid": "ros2-arm", "namespace": "/arm1",
               "cameras": {"front": {"topic": "front/image_raw"}, "wrist": {"topic": "wrist/image_raw"}},
               "state": {"joints": list(JOINTS)}, "action": {"topic": "joint_trajectory", "joints": list(JOINTS)}}
    # latest_only: a trajectory's first point is the newest chunk's (the counter read back is its observation's).
    client = {"aggregate": {"type": "latest_only"}}
    with PolicyServer(manifest), \
            ZenohSession(ZenohSettings(mode="router", listen=[f"tcp/127.0.0.1:{ros_port}"],
                                       multicast_scouting=False)), \
            ZenohSession(ZenohSettings(mode="client", connect=[f"tcp/127.0.0.1:{ros_port}"],
                                       multicast_scouting=False)) as robot_session:
        ros_robot = EmulatedRos2Robot(robot_session, cams, key("joint_trajectory", cdr.JOINT_TRAJECTORY), keys).start()
        door = Ros2Door(Ros2DoorConfig(endpoint=f"tcp/127.0.0.1:{port}", cluster_uuid=app.cluster,
                                       ros_endpoint=f"tcp/127.0.0.1:{ros_port}", telemetry_period_s=0,
                                       robots=[mapping], client=client)).start()
        zcfg = RobotClientConfig(robot=SimRobotConfig(cameras=cams, fps=HZ), client_uuid="zenoh-arm",
                                 cluster_uuid=app.cluster, experiment_tag=app.experiment, model_id=app.model,
                                 model_version=app.version, application_tag=app.app,
                                 endpoint=f"tcp/127.0.0.1:{port}", zenoh=ZenohSettings(multicast_scouting=False),
                                 fps=HZ, same_host=False, telemetry_period_s=0)
        zenoh_robot = RobotClient(zcfg, make_robot_from_config(zcfg.robot)).start()
        loop = threading.Thread(target=zenoh_robot.run, daemon=True)
        loop.start()
        time.sleep(2.0)  # warm-up: first RTTs, JPEG and CDR paths
        door_client = door.clients["ros2-arm"]
        marks = (len(ros_robot.latencies_ms), len(door_client.counters.rtt_ms), len(zenoh_robot.counters.rtt_ms))
        time.sleep(seconds)
        out = {"ros2 sample -> trajectory": list(ros_robot.latencies_ms)[marks[0]:],
               "ros2 door client capture -> chunk": list(door_client.counters.rtt_ms)[marks[1]:],
               "zenoh robot capture -> chunk": list(zenoh_robot.counters.rtt_ms)[marks[2]:],
               "rejected": {k: v for k, v in door.robots["ros2-arm"].counters.snapshot().items()
                            if k.startswith(("rejected.", "stale."))}}
        zenoh_robot.stop()
        loop.join(5)
        zenoh_robot.close()
        door.close()
        ros_robot.stop()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--height", type=int, default=224)
    p.add_argument("--width", type=int, default=224)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--chunk", type=int, default=10, help="actions per chunk (10: a request every ~0.3 s)")
    args = p.parse_args(argv)
    out = run(args.seconds, args.height, args.width, args.latency_ms, args.chunk)
    print(f"\n2 cameras {args.height}x{args.width} rgb8 + 6 joints at {HZ} Hz, model {args.latency_ms:g} ms, "
          f"chunk {args.chunk} x 6, {args.seconds:g} s after a 2 s warm-up\n")
    print("| path | p50 / p99 ms |\n|---|---|")
    for name in ("zenoh robot capture -> chunk", "ros2 door client capture -> chunk", "ros2 sample -> trajectory"):
        print(f"| {name} | {percentiles(out[name])} |")
    z, r = out["zenoh robot capture -> chunk"], out["ros2 sample -> trajectory"]
    if z and r:
        print(f"\nadded for the ROS 2 robot (p50): {np.percentile(r, 50) - np.percentile(z, 50):.1f} ms; "
              f"refused or stale: {out['rejected'] or 'none'}")


if __name__ == "__main__":
    main()
