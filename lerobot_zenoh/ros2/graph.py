"""rmw_zenoh's names on Zenoh: data keys, the attachment, liveliness tokens (the ROS graph).

What a ROS 2 node on rmw_zenoh puts on Zenoh (ros2/rmw_zenoh ``docs/design.md`` and its
``rmw_zenoh_cpp/src/detail/liveliness_utils.cpp`` and ``attachment_helpers.cpp``, which this module
follows from their documented formats; docs/ros2.md names the versions):

    data key     <domain_id>/<fully qualified topic, no leading or trailing '/'>/<DDS type name>/<type hash>
                 e.g. 0/robot1/joint_states/sensor_msgs::msg::dds_::JointState_/RIHS01_a13e...
    payload      CDR, little-endian, with its 4-byte encapsulation header (lerobot_zenoh/ros2/cdr.py)
    attachment   zenoh-ext serialisation of: sequence number (int64 LE), source timestamp (int64 LE,
                 ns since the epoch), source gid (a 16-byte array: a varint length 16, then the bytes).
                 Earlier releases wrote each field after its name as a string ("sequence_number", ...);
                 `decode_attachment` reads both, `encode_attachment` writes the current one.
    token        @ros2_lv/<domain>/<session zid>/<node id>/<entity id>/<NN|MP|MS|SS|SC>/<enclave>/
                 <namespace>/<node name>[/<topic>/<type name>/<type hash>/<qos>], every '/' inside a
                 part written as '%' (so the empty namespace "/" is "%")

Pure functions and frozen dataclasses; nothing here imports zenoh.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Attachment", "EntityKind", "NodeName", "QoS", "TopicName", "decode_attachment",
           "dds_type_name", "encode_attachment", "entity_token", "mangle", "node_token", "topic_key"]

ADMIN_SPACE = "@ros2_lv"
GID_BYTES = 16

# ROS 2 names (REP 144 / rcl's validation): tokens of [A-Za-z0-9_] not starting with a digit, joined by '/'.
_TOKEN = r"[A-Za-z_][A-Za-z0-9_]*"
_RELATIVE = re.compile(rf"^{_TOKEN}(/{_TOKEN})*$")
_NAMESPACE = re.compile(rf"^/({_TOKEN}(/{_TOKEN})*)?$")
_TYPE = re.compile(rf"^({_TOKEN})/msg/({_TOKEN})$")


class EntityKind(StrEnum):
    NODE = "NN"
    PUBLISHER = "MP"
    SUBSCRIPTION = "MS"


def mangle(part: str) -> str:
    """A name as one key chunk of a liveliness token: each '/' written as '%'."""
    return part.replace("/", "%")


def dds_type_name(ros_type: str) -> str:
    """``sensor_msgs/msg/Image`` -> ``sensor_msgs::msg::dds_::Image_`` (the name on the wire)."""
    m = _TYPE.match(ros_type)
    if m is None:
        raise ValueError(f"{ros_type!r} is not a message type name like sensor_msgs/msg/Image")
    return f"{m.group(1)}::msg::dds_::{m.group(2)}_"


@dataclass(frozen=True)
class NodeName:
    """A node: its namespace ('/' or '/a/b') and name; topics not starting with '/' are relative to
    the namespace."""

    namespace: str = "/"
    name: str = "lerobot_zenoh"
    enclave: str = "/"

    def __post_init__(self) -> None:
        if not _NAMESPACE.match(self.namespace):
            raise ValueError(f"namespace {self.namespace!r}: '/' or '/name[/name...]' of letters, digits and '_'")
        if not re.fullmatch(_TOKEN, self.name):
            raise ValueError(f"node name {self.name!r}: letters, digits and '_', not starting with a digit")

    def resolve(self, topic: str) -> str:
        """The fully qualified name of `topic` ('/ns/topic'); ValueError for one ROS would refuse."""
        relative = topic[1:] if topic.startswith("/") else topic
        if not _RELATIVE.match(relative):
            raise ValueError(f"topic {topic!r}: names of letters, digits and '_' (not starting with a digit) "
                             "joined by '/'")
        if topic.startswith("/"):
            return topic
        return f"{self.namespace.rstrip('/')}/{relative}"


@dataclass(frozen=True)
class TopicName:
    """A topic as rmw_zenoh names it: fully qualified name, ROS type and its RIHS01 type hash."""

    name: str  # fully qualified, '/a/b'
    ros_type: str  # sensor_msgs/msg/Image
    type_hash: str  # RIHS01_<64 hex>

    def __post_init__(self) -> None:
        if not re.fullmatch(r"RIHS01_[0-9a-f]{64}", self.type_hash):
            raise ValueError(f"type hash {self.type_hash!r} is not RIHS01_<64 lowercase hex digits>")


def topic_key(domain_id: int, topic: TopicName) -> str:
    """The key expression the topic's samples are put on."""
    return f"{domain_id}/{topic.name.strip('/')}/{dds_type_name(topic.ros_type)}/{topic.type_hash}"


@dataclass(frozen=True)
class QoS:
    """The QoS an entity announces in its token. rmw_zenoh writes only what differs from ROS 2's
    default profile (reliable, volatile, keep last 10): empty fields are the default."""

    best_effort: bool = False
    depth: int = 10

    def keyexpr(self) -> str:
        # <reliability>:<durability>:<history>,<depth>:<deadline s>,<ns>:<lifespan s>,<ns>:<liveliness>,<s>,<ns>
        reliability = "2" if self.best_effort else ""  # RMW_QOS_POLICY_RELIABILITY_BEST_EFFORT
        depth = "" if self.depth == 10 else str(self.depth)
        return f"{reliability}::,{depth}:,:,:,,"


def node_token(domain_id: int, zid: str, node_id: int, node: NodeName) -> str:
    """The token that makes `node` appear in ``ros2 node list``."""
    return "/".join([ADMIN_SPACE, str(domain_id), zid, str(node_id), str(node_id), EntityKind.NODE,
                     mangle(node.enclave), mangle(node.namespace), mangle(node.name)])


def entity_token(domain_id: int, zid: str, node_id: int, entity_id: int, kind: EntityKind, node: NodeName,
                 topic: TopicName, qos: QoS) -> str:
    """The token of a publisher (MP) or subscription (MS) of `node` on `topic`."""
    return "/".join([ADMIN_SPACE, str(domain_id), zid, str(node_id), str(entity_id), kind,
                     mangle(node.enclave), mangle(node.namespace), mangle(node.name), mangle(topic.name),
                     mangle(dds_type_name(topic.ros_type)), mangle(topic.type_hash), qos.keyexpr()])


def entity_gid(token: str) -> bytes:
    """A 16-byte id of the entity, derived from its token (rmw_zenoh hashes the token with XXH3-128;
    any stable 16 bytes serve: peers compare gids, they never recompute them)."""
    return hashlib.blake2b(token.encode(), digest_size=GID_BYTES).digest()


# -- the attachment ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attachment:
    sequence_number: int
    source_timestamp_ns: int
    source_gid: bytes


_INT64 = struct.Struct("<q")
_KEYS = ("sequence_number", "source_timestamp", "source_gid")


def encode_attachment(attachment: Attachment, *, named: bool = False) -> bytes:
    """The current layout: int64, int64, varint 16, 16 bytes (33 bytes); `named`: the earlier one,
    each field after its name (a varint length, then the UTF-8 name)."""
    if len(attachment.source_gid) != GID_BYTES:
        raise ValueError(f"a source gid is {GID_BYTES} bytes, got {len(attachment.source_gid)}")
    fields = [_INT64.pack(attachment.sequence_number), _INT64.pack(attachment.source_timestamp_ns),
              bytes([GID_BYTES]) + attachment.source_gid]
    if not named:
        return b"".join(fields)
    return b"".join(bytes([len(name)]) + name.encode() + value for name, value in zip(_KEYS, fields))


def decode_attachment(data: bytes) -> Attachment:
    """Either layout (current, or each field after its name); ValueError for anything else."""
    data = bytes(data[:256])
    if len(data) == 33 and data[16] == GID_BYTES:
        seq, = _INT64.unpack_from(data, 0)
        stamp, = _INT64.unpack_from(data, 8)
        return Attachment(seq, stamp, data[17:])
    values = []
    at = 0
    for name in _KEYS:
        size = len(name)
        if data[at:at + 1 + size] != bytes([size]) + name.encode():
            raise ValueError(f"attachment: expected the field {name!r} at byte {at}")
        at += 1 + size
        if name == "source_gid":
            if data[at:at + 1] != bytes([GID_BYTES]) or len(data) != at + 1 + GID_BYTES:
                raise ValueError("attachment: the source gid is not 16 bytes")
            values.append(data[at + 1:])
        else:
            if len(data) < at + 8:
                raise ValueError(f"attachment: {name} is cut short")
            values.append(_INT64.unpack_from(data, at)[0])
            at += 8
    return Attachment(*values)
