"""rmw_zenoh's names and bytes: keys, tokens, attachments and CDR, against independent encoders.

The expected values come from rmw_zenoh's documentation (its design.md examples), from rosbags'
CDR serialiser and from zenoh-ext's serialiser (`zenoh.ext.z_serialize`, the format rmw_zenoh's
C++ serialiser writes), never from the door's own encoders.
"""

from __future__ import annotations

import numpy as np
import pytest
import zenoh.ext as zx
from rosbags.typesys import Stores, get_typestore

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.ros2 import cdr, graph

STORE = get_typestore(Stores.ROS2_JAZZY)
T = STORE.types
STRING_HASH = "RIHS01_df668c740482bbd48fb39d76a70dfd4bd59db1288021743503259e948f6b1a18"  # rmw_zenoh design.md
JOINT_STATE_HASH = "RIHS01_a13ee3a330e346c9d87b5aa18d24e11690752bd33a0350f11c5882bc9179260e"  # ros2 topic info


def header():
    return T["std_msgs/msg/Header"](stamp=T["builtin_interfaces/msg/Time"](sec=1, nanosec=2), frame_id="cam")


def image_bytes(pixels: np.ndarray, encoding: str, **override) -> bytes:
    h, w = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    fields = dict(header=header(), height=h, width=w, encoding=encoding, is_bigendian=0, step=w * channels,
                  data=pixels.reshape(-1))
    fields.update(override)
    return bytes(STORE.serialize_cdr(T[cdr.IMAGE](**fields), cdr.IMAGE))


def joint_state_bytes(names, positions) -> bytes:
    msg = T[cdr.JOINT_STATE](header=header(), name=list(names), position=np.asarray(positions, float),
                             velocity=np.zeros(0), effort=np.zeros(0))
    return bytes(STORE.serialize_cdr(msg, cdr.JOINT_STATE))


def test_type_hashes_match_the_values_ros2_publishes():
    assert cdr.type_hash("std_msgs/msg/String") == STRING_HASH
    assert cdr.type_hash(cdr.JOINT_STATE) == JOINT_STATE_HASH


def test_data_keys_are_rmw_zenohs():
    node = graph.NodeName("/", "talker")
    chatter = graph.TopicName(node.resolve("chatter"), "std_msgs/msg/String", STRING_HASH)
    assert graph.topic_key(0, chatter) == f"0/chatter/std_msgs::msg::dds_::String_/{STRING_HASH}"
    ns = graph.NodeName("/robot1", "talker")
    moved = graph.TopicName(ns.resolve("chatter"), "std_msgs/msg/String", STRING_HASH)
    assert graph.topic_key(0, moved) == f"0/robot1/chatter/std_msgs::msg::dds_::String_/{STRING_HASH}"
    assert ns.resolve("/abs/topic") == "/abs/topic"
    for bad in ["", "2cam", "a//b", "a/b/", "a b", "a/**"]:
        with pytest.raises(ValueError):
            ns.resolve(bad)


def test_liveliness_tokens_mangle_slashes_and_announce_qos():
    node = graph.NodeName("/robot1", "door")
    topic = graph.TopicName("/robot1/arm/joint_trajectory", cdr.JOINT_TRAJECTORY, "RIHS01_" + "a" * 64)
    assert graph.node_token(3, "abc123", 7, node) == "@ros2_lv/3/abc123/7/7/NN/%/%robot1/door"
    token = graph.entity_token(3, "abc123", 7, 9, graph.EntityKind.PUBLISHER, node, topic, graph.QoS())
    assert token == ("@ros2_lv/3/abc123/7/9/MP/%/%robot1/door/%robot1%arm%joint_trajectory/"
                     "trajectory_msgs::msg::dds_::JointTrajectory_/RIHS01_" + "a" * 64 + "/::,:,:,:,,")
    assert graph.QoS(best_effort=True, depth=5).keyexpr() == "2::,5:,:,:,,"
    assert graph.NodeName("/", "door").namespace == "/"
    assert graph.node_token(0, "z", 1, graph.NodeName()).endswith("/NN/%/%/lerobot_zenoh")


def test_the_attachment_is_what_zenoh_ext_serialises():
    gid = bytes(range(16))
    ours = graph.encode_attachment(graph.Attachment(42, 1_700_000_000_123_456_789, gid))
    theirs = zx.z_serialize((zx.Int64(42), zx.Int64(1_700_000_000_123_456_789), gid)).to_bytes()
    assert ours == theirs and len(ours) == 33
    assert graph.decode_attachment(theirs) == graph.Attachment(42, 1_700_000_000_123_456_789, gid)
    keyed = zx.z_serialize(("sequence_number", zx.Int64(5), "source_timestamp", zx.Int64(6),
                            "source_gid", gid)).to_bytes()
    assert graph.decode_attachment(keyed) == graph.Attachment(5, 6, gid)
    assert graph.encode_attachment(graph.Attachment(5, 6, gid), named=True) == keyed
    for bad in [b"", theirs[:20], keyed[:-1], b"x" * 33, keyed.replace(b"source_gid", b"source_gud")]:
        with pytest.raises(ValueError):
            graph.decode_attachment(bad)


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "mono8"])
def test_images_decode_to_the_models_rgb(encoding):
    rng = np.random.default_rng(0)
    shape = (6, 8) if encoding == "mono8" else (6, 8, 3)
    pixels = rng.integers(0, 255, shape, dtype=np.uint8)
    got = cdr.decode_image(image_bytes(pixels, encoding), (6, 8)).rgb
    want = {"rgb8": pixels, "bgr8": pixels[:, :, ::-1] if pixels.ndim == 3 else None,
            "mono8": np.repeat(pixels[:, :, None], 3, axis=2)}[encoding]
    np.testing.assert_array_equal(got, want)
    assert got.flags.owndata or got.base is not None  # a copy: the payload's buffer may go


def test_compressed_jpeg_passes_through_unchanged():
    jpeg = codec.encode_jpeg(np.full((6, 8, 3), 100, np.uint8))
    msg = T[cdr.COMPRESSED_IMAGE](header=header(), format="rgb8; jpeg compressed bgr8",
                                  data=np.frombuffer(jpeg, np.uint8))
    payload = bytes(STORE.serialize_cdr(msg, cdr.COMPRESSED_IMAGE))
    assert cdr.decode_compressed_image(payload, (6, 8), 1 << 20).jpeg == jpeg
    with pytest.raises(ProtocolError) as exc:
        cdr.decode_compressed_image(payload, (8, 6), 1 << 20)
    assert exc.value.reason == cdr.Ros2Reason.WRONG_IMAGE_SHAPE
    png = T[cdr.COMPRESSED_IMAGE](header=header(), format="png", data=np.frombuffer(jpeg, np.uint8))
    with pytest.raises(ProtocolError) as exc:
        cdr.decode_compressed_image(bytes(STORE.serialize_cdr(png, cdr.COMPRESSED_IMAGE)), (6, 8), 1 << 20)
    assert exc.value.reason == cdr.Ros2Reason.NOT_JPEG


def test_joint_states_are_read_in_the_declared_order():
    payload = joint_state_bytes(["b", "a", "c"], [2.0, 1.0, 3.0])
    np.testing.assert_array_equal(cdr.decode_joint_state(payload, ("a", "b", "c")), [1, 2, 3])
    np.testing.assert_array_equal(cdr.decode_joint_state(payload, ("c",)), [3])
    for names, positions, joints, reason in [
        (["a"], [1.0], ("a", "b"), cdr.Ros2Reason.MISSING_JOINT),
        (["a", "b"], [1.0], ("a",), cdr.Ros2Reason.MISSING_JOINT),
        (["a"], [np.nan], ("a",), cdr.Ros2Reason.BAD_STATE),
    ]:
        with pytest.raises(ProtocolError) as exc:
            cdr.decode_joint_state(joint_state_bytes(names, positions), joints)
        assert exc.value.reason == reason


def reason_of(fn, *args):
    with pytest.raises(ProtocolError) as exc:
        fn(*args)
    return exc.value.reason


def test_hostile_images_are_refused_by_reason_before_any_array_is_made():
    pixels = np.zeros((6, 8, 3), np.uint8)
    good = image_bytes(pixels, "rgb8")
    R = cdr.Ros2Reason
    assert reason_of(cdr.decode_image, image_bytes(pixels, "rgb16"), (6, 8)) == R.BAD_ENCODING
    assert reason_of(cdr.decode_image, image_bytes(pixels, "rgb8", step=25), (6, 8)) == R.BAD_STEP
    assert reason_of(cdr.decode_image, image_bytes(pixels, "rgb8"), (8, 6)) == R.WRONG_IMAGE_SHAPE
    # A header claiming a 65535x65535 image: refused from its header, no allocation.
    assert reason_of(cdr.decode_image, image_bytes(pixels, "rgb8", height=65535, width=65535), (6, 8)) == \
        R.WRONG_IMAGE_SHAPE
    assert reason_of(cdr.decode_image, b"\x00\x00\x00\x00" + good[4:], (6, 8)) == R.BIG_ENDIAN
    assert reason_of(cdr.decode_image, good + b"\x00" * 8, (6, 8)) == R.MALFORMED
    # Every truncation is refused, never an IndexError or a short image.
    for cut in range(len(good)):
        with pytest.raises(ProtocolError):
            cdr.decode_image(good[:cut], (6, 8))
    # A data length that claims 4 GiB.
    data_at = len(good) - pixels.size - 4
    huge = good[:data_at] + (0xFFFFFFFF).to_bytes(4, "little") + good[data_at + 4:]
    assert reason_of(cdr.decode_image, huge, (6, 8)) == R.TOO_LARGE


def test_hostile_joint_states_are_refused():
    good = joint_state_bytes(["a", "b"], [1.0, 2.0])
    for cut in range(len(good)):
        with pytest.raises(ProtocolError):
            cdr.decode_joint_state(good[:cut], ("a",))
    count_at = 4 + 8 + 4 + 4  # header: stamp, frame_id "cam\0"
    huge = good[:count_at] + (10**9).to_bytes(4, "little") + good[count_at + 4:]
    assert reason_of(cdr.decode_joint_state, huge, ("a",)) == cdr.Ros2Reason.MALFORMED
    rng = np.random.default_rng(1)
    for _ in range(300):  # random bytes after a valid header: always a counted refusal
        junk = cdr.CDR_LE + rng.integers(0, 255, int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
        with pytest.raises(ProtocolError):
            cdr.decode_joint_state(junk, ("a",))


def test_trajectories_and_arrays_are_what_rosbags_reads():
    rows = np.arange(12, dtype=float).reshape(4, 3)
    msg = STORE.deserialize_cdr(cdr.encode_joint_trajectory(("a", "b", "c"), rows, 0.1, 12.25), cdr.JOINT_TRAJECTORY)
    assert msg.joint_names == ["a", "b", "c"]
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (12, 250_000_000)
    assert [p.time_from_start.sec * 10**9 + p.time_from_start.nanosec for p in msg.points] == \
        [0, 100_000_000, 200_000_000, 300_000_000]
    np.testing.assert_array_equal(np.stack([p.positions for p in msg.points]), rows)
    arr = STORE.deserialize_cdr(cdr.encode_float64_multi_array(np.array([1.5, 2.5])), cdr.FLOAT64_MULTI_ARRAY)
    np.testing.assert_array_equal(arr.data, [1.5, 2.5])
