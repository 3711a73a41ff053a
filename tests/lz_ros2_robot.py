"""A simulated ROS 2 robot on rmw_zenoh, written apart from the door (tests/ only).

It speaks what a ROS 2 node on rmw_zenoh puts on Zenoh, built from rosbags' CDR serialiser and
rmw_zenoh's documented formats (ros2/rmw_zenoh docs/design.md, liveliness_utils.cpp,
attachment_helpers.cpp), not from lerobot_zenoh.ros2:

    key         <domain>/<topic without its leading '/'>/<pkg>::msg::dds_::<Type>_/<RIHS01 hash>
    attachment  zenoh-ext: int64 sequence number, int64 source timestamp, 16 gid bytes (length-prefixed)

It publishes camera images (sensor_msgs/msg/Image rgb8 or sensor_msgs/msg/CompressedImage JPEG)
and joint states at `rate_hz`, and follows the JointTrajectory it receives: at each tick its joints
take the positions of the newest trajectory's point due by then (time_from_start since arrival).
With `hold=True` its joints never move (every observation the same: a test compares answers).
"""

from __future__ import annotations

import threading
import time

import cv2
import numpy as np
import zenoh
import zenoh.ext as zx
from rosbags.typesys import Stores, get_typestore

STORE = get_typestore(Stores.ROS2_JAZZY)
T = STORE.types


def key(domain: int, topic: str, ros_type: str) -> str:
    pkg, _, name = ros_type.split("/")
    return f"{domain}/{topic.strip('/')}/{pkg}::msg::dds_::{name}_/{STORE.hash_rihs01(ros_type)}"


def frame(hw, seed: int) -> np.ndarray:
    """A fixed RGB frame per camera (`seed`), with structure a JPEG keeps."""
    h, w = hw
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([(x * 4 + seed * 40) % 256, (y * 5 + seed * 20) % 256,
                     np.full((h, w), (seed * 70) % 256)], axis=2).astype(np.uint8)


class SimRos2Robot:
    """cameras: name -> (topic, "raw" | "jpeg", (h, w)); joints in the JointState's order (written
    shuffled, so the door must follow the names)."""

    def __init__(self, router_port: int, *, domain: int = 0, namespace: str = "/arm1", cameras: dict,
                 joints: tuple[str, ...], trajectory_topic: str = "arm_controller/joint_trajectory",
                 rate_hz: float = 30.0, hold: bool = False, initial=None):
        self.domain, self.ns, self.cameras, self.joints = domain, namespace.rstrip("/"), cameras, joints
        self.rate_hz, self.hold = rate_hz, hold
        self.positions = np.array(initial if initial is not None else np.linspace(0.1, 0.6, len(joints)), float)
        self.trajectory_key = key(domain, f"{self.ns}/{trajectory_topic}", "trajectory_msgs/msg/JointTrajectory")
        self.trajectories: list = []  # (arrived monotonic s, message, attachment bytes)
        self.published = 0
        self.publishing = {name: True for name in [*cameras, "state"]}  # a test stops a topic
        self._stop = threading.Event()
        conf = zenoh.Config()
        conf.insert_json5("mode", '"client"')
        conf.insert_json5("connect/endpoints", f'["tcp/127.0.0.1:{router_port}"]')
        conf.insert_json5("scouting/multicast/enabled", "false")
        self.session = zenoh.open(conf)
        self.gid = bytes(range(16))
        self._lock = threading.Lock()
        self._sub = self.session.declare_subscriber(self.trajectory_key, self._on_trajectory)
        self._thread = threading.Thread(target=self._run, name="sim-ros2-robot", daemon=True)

    def __enter__(self) -> SimRos2Robot:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.undeclare()
        self.session.close()

    def _on_trajectory(self, sample: zenoh.Sample) -> None:
        msg = STORE.deserialize_cdr(sample.payload.to_bytes(), "trajectory_msgs/msg/JointTrajectory")
        attachment = sample.attachment.to_bytes() if sample.attachment is not None else None
        with self._lock:
            self.trajectories.append((time.monotonic(), msg, attachment))

    def _attachment(self, seq: int) -> bytes:
        return zx.z_serialize((zx.Int64(seq), zx.Int64(time.time_ns()), self.gid)).to_bytes()

    def _header(self):
        now = time.time()
        return T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](
            sec=int(now), nanosec=int((now % 1) * 1e9)), frame_id="base")

    def image_payload(self, name: str) -> bytes:
        _, kind, hw = self.cameras[name]
        rgb = frame(hw, list(self.cameras).index(name) + 1)
        if kind == "jpeg":
            ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90])
            msg = T["sensor_msgs/msg/CompressedImage"](header=self._header(), format="rgb8; jpeg compressed bgr8",
                                                       data=jpeg.reshape(-1))
            return bytes(STORE.serialize_cdr(msg, "sensor_msgs/msg/CompressedImage"))
        msg = T["sensor_msgs/msg/Image"](header=self._header(), height=hw[0], width=hw[1], encoding="rgb8",
                                         is_bigendian=0, step=hw[1] * 3, data=rgb.reshape(-1))
        return bytes(STORE.serialize_cdr(msg, "sensor_msgs/msg/Image"))

    def state_payload(self) -> bytes:
        order = list(reversed(range(len(self.joints))))  # not the door's order
        msg = T["sensor_msgs/msg/JointState"](header=self._header(), name=[self.joints[i] for i in order],
                                              position=self.positions[order].copy(), velocity=np.zeros(0),
                                              effort=np.zeros(0))
        return bytes(STORE.serialize_cdr(msg, "sensor_msgs/msg/JointState"))

    def _follow(self) -> None:
        with self._lock:
            if self.hold or not self.trajectories:
                return
            arrived, msg, _ = self.trajectories[-1]
        elapsed = time.monotonic() - arrived
        due = [p for p in msg.points if p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 <= elapsed]
        if due:
            by_name = dict(zip(msg.joint_names, due[-1].positions))
            self.positions = np.array([by_name[j] for j in self.joints])

    def _run(self) -> None:
        keys = {name: key(self.domain, f"{self.ns}/{topic}", "sensor_msgs/msg/Image" if kind == "raw"
                          else "sensor_msgs/msg/CompressedImage") for name, (topic, kind, _) in self.cameras.items()}
        keys["state"] = key(self.domain, f"{self.ns}/joint_states", "sensor_msgs/msg/JointState")
        pubs = {name: self.session.declare_publisher(k) for name, k in keys.items()}
        period = 1.0 / self.rate_hz
        seq = 0
        next_t = time.monotonic()
        while not self._stop.is_set():
            self._follow()
            for name, pub in pubs.items():
                if self.publishing[name]:
                    seq += 1
                    payload = self.state_payload() if name == "state" else self.image_payload(name)
                    pub.put(payload, attachment=self._attachment(seq))
            self.published += 1
            next_t += period
            self._stop.wait(max(0.0, next_t - time.monotonic()))
        for pub in pubs.values():
            pub.undeclare()

    def graph(self) -> list[str]:
        """The live ROS graph tokens of this domain, as `ros2 node list` / `topic list` read them."""
        return sorted(str(r.ok.key_expr) for r in self.session.liveliness().get(f"@ros2_lv/{self.domain}/**",
                                                                                  timeout=2.0) if r.ok is not None)
