"""One ROS 2 robot on rmw_zenoh, seen by the fleet's robot client as a LeRobot `Robot`.

The door runs the project's own robot client (client/: the send trigger, the chunk intake with
RTC leftovers, the server watch, telemetry) on a :class:`Ros2Robot`, so a ROS 2 robot is served
exactly as a LeRobot robot is. What differs is where the robot's I/O goes:

    in   camera and joint-state topics, subscribed on the robot's Zenoh with rmw_zenoh's keys. A
         Zenoh callback only checks the sample's size against the topic's limit (counted
         ``too_large`` and dropped unread) and keeps it in the topic's newest-wins slot (an older
         sample not yet read is counted ``superseded``); this
         robot's own decoder thread reads each slot (cdr.py: bounded, counted by reason) and keeps
         the newest valid value of each topic with its arrival time (``received.<topic>``). Every
         sample that arrives (``arrived.<topic>``) is thus counted once more: refused by reason,
         superseded, or received (one per topic may be waiting in its slot). A flood or garbage on one
         robot's topics costs its callbacks and its decoder, never another robot's.
    obs  `get_observation` gives the newest of each topic; when any topic's newest valid value is
         older than `max_age_s` (or never came) the observation is stale, and the door's task
         (`StaleGate`) sends nothing that step (counted ``stale.<what>``).
    out  each chunk the client accepts (merged into its action buffer, RTC leftovers kept) is
         published as a ``trajectory_msgs/msg/JointTrajectory`` of the buffer's plan from the next
         control step: point k at ``k / fps`` seconds, the header's stamp 0 (start on receipt).
         With `action_array_topic`, every control step's action is also published as a
         ``std_msgs/msg/Float64MultiArray``. Nothing is published when there is no action (the
         controller holds at the end of its trajectory).

Every publisher and subscription has its liveliness token, and the node its own, so ``ros2 node
list`` / ``ros2 topic info -v`` on the robot's network show them; every put carries rmw_zenoh's
attachment (sequence number, source timestamp, the publisher's gid).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from lerobot.robots import Robot, RobotConfig

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.ros2 import cdr, graph
from lerobot_zenoh.ros2.mapping import RobotMapping
from lerobot_zenoh.transport.session import ACTION_QOS

log = logging.getLogger(__name__)

__all__ = ["Ros2Counters", "Ros2Robot", "Ros2RobotConfig", "TRAJECTORY_QOS"]

#: The controller must get every trajectory, and the newest quickly: the fleet's own QoS for chunks
#: (reliable, express, high priority, queued so that a slow link never blocks the client's receiver
#: thread that publishes it). A step's action is stale by the next step: best effort, not queued.
TRAJECTORY_QOS = ACTION_QOS
STEP_QOS = dataclasses.replace(ACTION_QOS, reliable=False, queue_depth=0)
#: Bytes a JointState may take: 256 joints of 256-byte names and three float64 arrays, with room.
JOINT_STATE_BYTES = 256 * (256 + 8) + 3 * 8 * 256 + 1024
_ENTITY_IDS = itertools.count(1)  # rmw_zenoh numbers a context's nodes and entities; any unique ids do


@RobotConfig.register_subclass("ros2_rmw_zenoh")
@dataclass(kw_only=True)
class Ros2RobotConfig(RobotConfig):
    """A ROS 2 robot reached through rmw_zenoh (built by the ROS 2 front door from its mapping)."""

    mapping: RobotMapping | None = field(default=None)
    cameras: dict[str, tuple[int, int]] = field(default_factory=dict)
    fps: int = 30
    max_jpeg_bytes: int = 4 << 20
    named_attachment: bool = False

    def __post_init__(self) -> None:
        # Not RobotConfig.__post_init__: its check reads LeRobot CameraConfigs; a topic is none.
        if self.mapping is None:
            raise ValueError("a Ros2RobotConfig needs its mapping")


class Ros2Counters:
    """What one robot's ROS side counted (read from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter = Counter()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


class _Slot:
    """The newest sample of one topic, not yet decoded (newest wins: an older one is superseded)."""

    def __init__(self, name: str, limit: int, decode) -> None:
        self.name = name
        self.limit = limit
        self.decode = decode
        self.pending = None  # (payload, arrived_s)
        self.value = None  # the newest valid decoded value
        self.value_s: float | None = None  # its arrival (perf_counter)


class Ros2Robot(Robot):
    """A LeRobot robot whose observation comes from ROS 2 topics and whose actions go to them.

    `session`: an open `ZenohSession` on the robot's Zenoh (shared by the door's robots);
    `counters`: where this robot's rejections and publications are counted."""

    config_class = Ros2RobotConfig
    name = "ros2_rmw_zenoh"

    def __init__(self, config: Ros2RobotConfig, session, counters: Ros2Counters | None = None):
        # Robot.__init__ would make a calibration folder; a ROS 2 robot calibrates itself.
        self.robot_type = self.name
        self.id = config.id
        self.calibration = {}
        self.config = config
        self.mapping: RobotMapping = config.mapping
        self.session = session
        self.counters = counters or Ros2Counters()
        self.dt_s = 1.0 / config.fps
        m = self.mapping
        self._node = m.node()
        self._state_joints = tuple(m.state.joints)
        self._action_joints = tuple(m.action.joints)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._slots: dict[str, _Slot] = {}
        for cam, topic in m.cameras.items():
            hw = tuple(config.cameras[cam])
            if topic.type == cdr.IMAGE:
                limit = hw[0] * hw[1] * 3 + 1024
                self._slots[cam] = _Slot(cam, limit, lambda p, hw=hw: cdr.decode_image(p, hw))
            else:
                limit = config.max_jpeg_bytes + 1024
                self._slots[cam] = _Slot(cam, limit, lambda p, hw=hw: cdr.decode_compressed_image(
                    p, hw, config.max_jpeg_bytes))
        self._slots["state"] = _Slot("state", JOINT_STATE_BYTES,
                                     lambda p: cdr.decode_joint_state(p, self._state_joints))
        self._entities: list = []
        self._trajectory = None
        self._steps = None
        self._seq = itertools.count(1)
        self._connected = False

    # -- features (what the robot client and the model's status compare)

    @property
    def observation_features(self) -> dict:
        features: dict = dict.fromkeys(self._state_joints, float)
        features.update({cam: (*self.config.cameras[cam], 3) for cam in self.mapping.cameras})
        return features

    @property
    def action_features(self) -> dict:
        return {f"{j}.action": float for j in self._action_joints}

    # -- lifecycle

    @property
    def is_connected(self) -> bool:
        return self._connected

    @property
    def is_calibrated(self) -> bool:
        return True

    def calibrate(self) -> None:
        """Nothing to calibrate from here."""

    def configure(self) -> None:
        """Nothing to configure from here."""

    def connect(self, calibrate: bool = True) -> None:
        """Declare the node, its subscriptions and publishers (with their tokens); start the decoder."""
        m, s = self.mapping, self.session
        zid = s.zid
        node_id = next(_ENTITY_IDS)
        self._entities.append(s.declare_token(graph.node_token(m.domain_id, zid, node_id, self._node)))

        def topic(name: str, ros_type: str) -> graph.TopicName:
            return graph.TopicName(self._node.resolve(name), ros_type, cdr.type_hash(ros_type))

        def announce(kind: graph.EntityKind, t: graph.TopicName, qos: graph.QoS) -> bytes:
            token = graph.entity_token(m.domain_id, zid, node_id, next(_ENTITY_IDS), kind, self._node, t, qos)
            self._entities.append(s.declare_token(token))
            return graph.entity_gid(token)

        sensor = graph.QoS(best_effort=True, depth=5)  # what ROS 2's sensor-data profile asks
        inputs = [(cam, topic(c.topic, c.type)) for cam, c in m.cameras.items()]
        inputs.append(("state", topic(m.state.topic, cdr.JOINT_STATE)))
        for name, t in inputs:
            announce(graph.EntityKind.SUBSCRIPTION, t, sensor)
            self._entities.append(s.subscribe(graph.topic_key(m.domain_id, t), self._receiver(self._slots[name]),
                                              copy=False))
        out = topic(m.action.topic, cdr.JOINT_TRAJECTORY)
        self._trajectory = (s.publisher(graph.topic_key(m.domain_id, out), TRAJECTORY_QOS),
                            announce(graph.EntityKind.PUBLISHER, out, graph.QoS()))
        if m.action_array_topic:
            arr = topic(m.action_array_topic, cdr.FLOAT64_MULTI_ARRAY)
            self._steps = (s.publisher(graph.topic_key(m.domain_id, arr), STEP_QOS),
                           announce(graph.EntityKind.PUBLISHER, arr, graph.QoS(best_effort=True)))
        self._stop.clear()
        self._thread = threading.Thread(target=self._decode_loop, name=f"{m.client_uuid}:ros2-decode", daemon=True)
        self._thread.start()
        self._connected = True

    def disconnect(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        for entity in self._entities + [p for p, _ in filter(None, (self._trajectory, self._steps))]:
            self.session.release(entity)
        self._entities = []
        self._trajectory = self._steps = None
        self._connected = False

    # -- in: Zenoh callback -> slot -> decoder thread

    def _receiver(self, slot: _Slot):
        def on_sample(key: str, payload) -> None:
            """Zenoh callback: the size check and the hand-over, nothing else."""
            self.counters.add(f"arrived.{slot.name}")
            if len(payload) > slot.limit:
                self.counters.add(f"rejected.{cdr.Ros2Reason.TOO_LARGE}")
                return
            with self._lock:
                superseded, slot.pending = slot.pending is not None, (payload, time.perf_counter())
            if superseded:
                self.counters.add("superseded")
            self._wake.set()
        return on_sample

    def _decode_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            for slot in self._slots.values():
                with self._lock:
                    taken, slot.pending = slot.pending, None
                if taken is None:
                    continue
                payload, arrived_s = taken
                try:
                    value = slot.decode(bytes(payload))
                except ProtocolError as exc:
                    self.counters.add(f"rejected.{exc.reason}")
                    continue
                except Exception as exc:  # a decoder bug must not end this robot's input for good
                    self.counters.add("rejected.decoder_error")
                    log.warning("%s: %s sample not decoded (%s: %s)", self.mapping.client_uuid, slot.name,
                                type(exc).__name__, exc)
                    continue
                with self._lock:
                    slot.value, slot.value_s = value, arrived_s
                self.counters.add(f"received.{slot.name}")

    # -- observation

    def stale(self, now_s: float | None = None) -> str | None:
        """The first input with no valid value within `max_age_s` (None: the observation is fresh)."""
        now_s = time.perf_counter() if now_s is None else now_s
        with self._lock:
            for slot in self._slots.values():
                if slot.value_s is None or now_s - slot.value_s > self.mapping.max_age_s:
                    return slot.name
        return None

    def get_observation(self) -> dict:
        """The newest valid value of each topic: joint positions, RGB frames or JPEG bytes (zeros
        before the first sample: such an observation is stale and never sent)."""
        with self._lock:
            state = self._slots["state"].value
            frames = {cam: self._slots[cam].value for cam in self.mapping.cameras}
        obs: dict = {}
        values = state if state is not None else np.zeros(len(self._state_joints), np.float32)
        obs.update(zip(self._state_joints, (float(v) for v in values)))
        for cam, frame in frames.items():
            if frame is None:
                h, w = self.config.cameras[cam]
                obs[cam] = np.zeros((h, w, 3), np.uint8)
            else:
                obs[cam] = frame.jpeg if frame.jpeg is not None else frame.rgb
        return obs

    # -- out

    def _attachment(self, gid: bytes) -> bytes:
        return graph.encode_attachment(graph.Attachment(next(self._seq), time.time_ns(), gid),
                                       named=self.config.named_attachment)

    def publish_plan(self, rows: np.ndarray) -> None:
        """The buffer's plan from the next control step as one JointTrajectory."""
        if self._trajectory is None or len(rows) == 0:
            return
        publisher, gid = self._trajectory
        # Stamp 0: "start on receipt" for joint_trajectory_controller. A stamp from this host's clock
        # would be compared with the robot's, and clocks of two machines are never compared here.
        payload = cdr.encode_joint_trajectory(self._action_joints, rows, self.dt_s, 0.0)
        publisher.put(payload, attachment=self._attachment(gid))
        self.counters.add("trajectories_published")

    def send_action(self, action: dict) -> dict:
        """One control step's action: a Float64MultiArray when `action_array_topic` is set. An empty
        action (no chunk to execute) publishes nothing."""
        if action and self._steps is not None:
            publisher, gid = self._steps
            values = np.fromiter((action[f"{j}.action"] for j in self._action_joints), np.float64)
            publisher.put(cdr.encode_float64_multi_array(values), attachment=self._attachment(gid))
            self.counters.add("steps_published")
        return action
