"""The ROS 2 messages the door reads and writes, as CDR: bounded readers in, rosbags' encoder out.

A ROS 2 peer's bytes are hostile. The three message types the door reads (``sensor_msgs/msg/Image``,
``sensor_msgs/msg/CompressedImage``, ``sensor_msgs/msg/JointState``) are read here by a small CDR
reader that checks every length against what is left of the payload and against the door's limits
before it takes a slice, and every image's height, width, encoding and step against the model's
camera before it makes an array: nothing is allocated from a length the peer chose. Pixels are a
view of the payload until the one copy that turns them into the model's RGB frame. A rejection is a
`ProtocolError` with one of :class:`Ros2Reason`'s values (the door counts them by reason).

The messages the door writes (``trajectory_msgs/msg/JointTrajectory``,
``std_msgs/msg/Float64MultiArray``) and every type hash (RIHS01, REP 2011) come from `rosbags`'
type store (its ROS 2 Jazzy definitions): no ROS 2 installation is needed.

CDR here is XCDR1 as rmw_zenoh sends it: a 4-byte encapsulation header (00 01 00 00: CDR, little
endian), then each primitive aligned to its size counted from the end of that header; strings are
a uint32 length that counts the terminating NUL; sequences a uint32 count.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum
from functools import cache

import numpy as np

from lerobot_zenoh.errors import ProtocolError

__all__ = ["CdrReader", "DecodedImage", "Ros2Reason", "decode_compressed_image", "decode_image",
           "decode_joint_state", "encode_float64_multi_array", "encode_joint_trajectory", "type_hash"]

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE = "sensor_msgs/msg/CompressedImage"
JOINT_STATE = "sensor_msgs/msg/JointState"
JOINT_TRAJECTORY = "trajectory_msgs/msg/JointTrajectory"
FLOAT64_MULTI_ARRAY = "std_msgs/msg/Float64MultiArray"

CDR_LE = b"\x00\x01\x00\x00"  # CDR, little endian, no options
MAX_STRING_BYTES = 256  # frame ids, encodings, formats, joint names
MAX_JOINTS = 256

#: Image encodings the door takes (sensor_msgs/image_encodings.hpp) -> channels.
ENCODINGS = {"rgb8": 3, "bgr8": 3, "mono8": 1}


class Ros2Reason(StrEnum):
    """Why a ROS 2 sample was refused (the door's counters: ``rejected.<reason>``)."""

    TOO_LARGE = "too_large"  # over the topic's byte limit, refused before anything is read
    MALFORMED = "malformed_cdr"  # a length or count past the end, a bad header, trailing garbage
    BIG_ENDIAN = "big_endian"  # a CDR big-endian payload (rmw_zenoh sends little endian)
    BAD_ENCODING = "bad_encoding"  # an image encoding other than rgb8, bgr8, mono8, or a big-endian image
    WRONG_IMAGE_SHAPE = "wrong_image_shape"  # height x width is not the model's camera
    BAD_STEP = "bad_step"  # step or data length disagree with width, height and encoding
    NOT_JPEG = "not_jpeg"  # a CompressedImage that is not a JPEG of the camera's size
    MISSING_JOINT = "missing_joint"  # a declared joint is not in the JointState (or no positions)
    BAD_STATE = "bad_state"  # a NaN or an infinity among the declared joints' positions


class CdrReader:
    """Reads one CDR payload front to back; every read is checked against what is left."""

    def __init__(self, data: bytes | memoryview):
        view = memoryview(data)
        if len(view) < 4:
            raise ProtocolError(Ros2Reason.MALFORMED, "shorter than the CDR encapsulation header")
        head = bytes(view[:4])
        if head[:2] == b"\x00\x00":
            raise ProtocolError(Ros2Reason.BIG_ENDIAN, "big-endian CDR is not read (rmw_zenoh sends little endian)")
        if head[:2] != CDR_LE[:2]:
            raise ProtocolError(Ros2Reason.MALFORMED, f"encapsulation {head[:2].hex()} is not CDR little endian")
        self._view = view[4:]
        self._at = 0

    def _take(self, size: int, align: int) -> memoryview:
        at = (self._at + align - 1) & ~(align - 1)
        if size < 0 or at + size > len(self._view):
            raise ProtocolError(Ros2Reason.MALFORMED, f"{size} bytes at offset {at} run past the payload's "
                                f"{len(self._view)}")
        self._at = at + size
        return self._view[at:at + size]

    def u8(self) -> int:
        return self._take(1, 1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self._take(4, 4))[0]

    def i32(self) -> int:
        return struct.unpack("<i", self._take(4, 4))[0]

    def string(self, limit: int = MAX_STRING_BYTES) -> str:
        size = self.u32()
        if size == 0 or size > limit + 1:  # the length counts the NUL
            raise ProtocolError(Ros2Reason.MALFORMED, f"a string of {size} bytes (at most {limit})")
        raw = self._take(size, 1)
        if raw[-1] != 0:
            raise ProtocolError(Ros2Reason.MALFORMED, "a string without its terminating NUL")
        try:
            return bytes(raw[:-1]).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(Ros2Reason.MALFORMED, "a string that is not UTF-8") from None

    def octets(self, limit: int) -> memoryview:
        """A sequence<uint8>: a view of the payload (never copied)."""
        size = self.u32()
        if size > limit:
            raise ProtocolError(Ros2Reason.TOO_LARGE, f"a byte sequence of {size} bytes (at most {limit})")
        return self._take(size, 1)

    def float64s(self, limit: int) -> np.ndarray:
        count = self.u32()
        if count > limit:
            raise ProtocolError(Ros2Reason.MALFORMED, f"a sequence of {count} numbers (at most {limit})")
        if count == 0:
            return np.zeros(0)
        return np.frombuffer(self._take(8 * count, 8), dtype="<f8")

    def header(self) -> None:
        """std_msgs/Header: the stamp and frame id, read and dropped (stamps are another machine's clock)."""
        self.i32()
        self.u32()
        self.string()

    def end(self) -> None:
        """Only CDR's padding may follow the last field (up to 3 bytes to a 4-byte boundary)."""
        if len(self._view) - self._at > 3:
            raise ProtocolError(Ros2Reason.MALFORMED, f"{len(self._view) - self._at} bytes after the message")


@dataclass(frozen=True)
class DecodedImage:
    """A camera frame: RGB uint8 (H, W, 3), or a JPEG passed through as it came."""

    rgb: np.ndarray | None = None
    jpeg: bytes | None = None


def decode_image(payload: bytes | memoryview, hw: tuple[int, int]) -> DecodedImage:
    """A ``sensor_msgs/msg/Image`` of exactly the camera's (height, width), as RGB."""
    r = CdrReader(payload)
    r.header()
    height, width = r.u32(), r.u32()
    encoding = r.string()
    bigendian = r.u8()
    step = r.u32()
    if (height, width) != tuple(hw):
        raise ProtocolError(Ros2Reason.WRONG_IMAGE_SHAPE, f"{height}x{width}, the model's camera is {hw[0]}x{hw[1]}")
    channels = ENCODINGS.get(encoding)
    if channels is None or bigendian not in (0, 1):
        raise ProtocolError(Ros2Reason.BAD_ENCODING, f"encoding {encoding[:32]!r} (the door reads "
                            f"{', '.join(ENCODINGS)})")
    if step != width * channels:
        raise ProtocolError(Ros2Reason.BAD_STEP, f"step {step} for {width} pixels of {encoding} "
                            f"(expected {width * channels}; padded rows are not read)")
    data = r.octets(height * step)
    if len(data) != height * step:
        raise ProtocolError(Ros2Reason.BAD_STEP, f"{len(data)} bytes of pixels, {height}x{step} expected")
    r.end()
    pixels = np.frombuffer(data, dtype=np.uint8).reshape(height, width, channels)
    if encoding == "rgb8":
        rgb = pixels.copy()
    elif encoding == "bgr8":
        rgb = pixels[:, :, ::-1].copy()
    else:
        rgb = np.repeat(pixels, 3, axis=2)
    return DecodedImage(rgb=rgb)


def decode_compressed_image(payload: bytes | memoryview, hw: tuple[int, int], max_bytes: int) -> DecodedImage:
    """A ``sensor_msgs/msg/CompressedImage`` holding a JPEG of the camera's size, passed through
    undecoded (its size is read from the JPEG frame header)."""
    from lerobot_zenoh.protocol import codec

    r = CdrReader(payload)
    r.header()
    fmt = r.string()
    data = r.octets(max_bytes)
    r.end()
    if "jpeg" not in fmt.lower() and "jpg" not in fmt.lower():
        raise ProtocolError(Ros2Reason.NOT_JPEG, f"format {fmt[:32]!r} (the door passes JPEG through)")
    jpeg = bytes(data)
    try:
        height, width, components = codec.jpeg_shape(jpeg)
    except ProtocolError as exc:
        raise ProtocolError(Ros2Reason.NOT_JPEG, str(exc)) from None
    if (height, width) != tuple(hw) or components not in (1, 3):
        raise ProtocolError(Ros2Reason.WRONG_IMAGE_SHAPE, f"a {height}x{width} JPEG, the model's camera is "
                            f"{hw[0]}x{hw[1]}")
    return DecodedImage(jpeg=jpeg)


def decode_joint_state(payload: bytes | memoryview, joints: tuple[str, ...]) -> np.ndarray:
    """The positions of `joints`, in that order, from a ``sensor_msgs/msg/JointState``."""
    r = CdrReader(payload)
    r.header()
    count = r.u32()
    if count > MAX_JOINTS:
        raise ProtocolError(Ros2Reason.MALFORMED, f"{count} joint names (at most {MAX_JOINTS})")
    names = [r.string() for _ in range(count)]
    position = r.float64s(MAX_JOINTS)
    r.float64s(MAX_JOINTS)  # velocity
    r.float64s(MAX_JOINTS)  # effort
    r.end()
    if len(position) != len(names):
        raise ProtocolError(Ros2Reason.MISSING_JOINT, f"{len(names)} names but {len(position)} positions")
    index = {n: i for i, n in enumerate(names)}
    missing = [j for j in joints if j not in index]
    if missing:
        raise ProtocolError(Ros2Reason.MISSING_JOINT, f"joint {missing[0]!r} is not in the JointState "
                            f"({len(names)} joints)")
    values = position[[index[j] for j in joints]].astype(np.float32)
    if not np.all(np.isfinite(values)):
        raise ProtocolError(Ros2Reason.BAD_STATE, "a NaN or an infinity among the joints' positions")
    return values


# -- what the door writes (rosbags) ------------------------------------------------------------------


@cache
def _store():
    from rosbags.typesys import Stores, get_typestore

    return get_typestore(Stores.ROS2_JAZZY)


@cache
def type_hash(ros_type: str) -> str:
    """The RIHS01 hash of a message type (REP 2011), e.g. ``RIHS01_a13ee3a3...`` for JointState."""
    return _store().hash_rihs01(ros_type)


def _time(store, seconds: float):
    sec = int(np.floor(seconds))
    return store.types["builtin_interfaces/msg/Time"](sec=sec, nanosec=int(round((seconds - sec) * 1e9)) % 1_000_000_000)


def encode_joint_trajectory(joint_names: tuple[str, ...], positions: np.ndarray, dt_s: float, stamp_s: float,
                            frame_id: str = "") -> bytes:
    """A JointTrajectory: point k holds row k of `positions` at ``time_from_start = k * dt_s``."""
    s = _store()
    t = s.types
    points = []
    for k, row in enumerate(np.asarray(positions, dtype=np.float64)):
        ns = int(round(k * dt_s * 1e9))
        points.append(t["trajectory_msgs/msg/JointTrajectoryPoint"](
            positions=row, velocities=np.zeros(0), accelerations=np.zeros(0), effort=np.zeros(0),
            time_from_start=t["builtin_interfaces/msg/Duration"](sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)))
    header = t["std_msgs/msg/Header"](stamp=_time(s, stamp_s), frame_id=frame_id)
    message = t[JOINT_TRAJECTORY](header=header, joint_names=list(joint_names), points=points)
    return bytes(s.serialize_cdr(message, JOINT_TRAJECTORY))


def encode_float64_multi_array(values: np.ndarray) -> bytes:
    """A Float64MultiArray of one action (one dimension, no padding)."""
    s = _store()
    t = s.types
    values = np.asarray(values, dtype=np.float64)
    layout = t["std_msgs/msg/MultiArrayLayout"](dim=[t["std_msgs/msg/MultiArrayDimension"](
        label="joints", size=len(values), stride=len(values))], data_offset=0)
    return bytes(s.serialize_cdr(t[FLOAT64_MULTI_ARRAY](layout=layout, data=values), FLOAT64_MULTI_ARRAY))
