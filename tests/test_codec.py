"""The codec: round trips, hostile bytes, limits, JPEG, and golden bytes pinning the wire."""

from __future__ import annotations

import os
import pathlib
import re

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lerobot_zenoh.errors import ProtocolError, VersionError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.codec import CodecLimits
from lerobot_zenoh.protocol.messages import (
    ActionChunk,
    ExecutionInfo,
    Observation,
    Refusal,
    RtcAdvert,
    RtcInputs,
    SameHostAdvert,
    SharedFrames,
    Status,
    Telemetry,
    TextResult,
    Verdict,
)

GOLDEN = pathlib.Path(__file__).parent / "golden"

names = st.text(st.characters(categories=("L", "N"), max_codepoint=0x2FF), min_size=1, max_size=12)
uint64 = st.integers(0, 2**64 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def rtc_inputs(draw):
    dtype = draw(st.sampled_from(["float32", "float64"]))
    elements = st.floats(allow_nan=False, allow_infinity=False, width=32 if dtype == "float32" else 64)
    prefix = draw(hnp.arrays(dtype, (draw(st.integers(0, 12)), draw(st.integers(0, 8))), elements=elements))
    return RtcInputs(prefix=prefix, delay_steps=draw(st.integers(0, len(prefix))))


@st.composite
def observations(draw):
    state = draw(hnp.arrays(draw(st.sampled_from(["float32", "float64", "int32"])), draw(st.integers(0, 16))))
    execution = draw(st.none() | st.builds(
        ExecutionInfo,
        task_elapsed_s=st.none() | finite,
        actions_buffered=st.none() | st.integers(0, 1000),
        control_period_s=st.none() | finite,
    ))
    return Observation(
        seq_id=draw(uint64),
        client_uuid=draw(names),
        state=state,
        images=draw(st.dictionaries(names, st.binary(max_size=64), max_size=4)),
        task=draw(st.text(max_size=40)),
        execution=execution,
        episode_id=draw(st.none() | st.text(max_size=12)),
        session_nonce=draw(st.none() | uint64),
        rtc=draw(st.none() | rtc_inputs()),
        shared_frames=draw(st.none() | shared_frames),
        refreshes_seq_id=draw(st.none() | uint64),
        component_mask=draw(st.none() | st.integers(1, 2**32 - 1)),
    )


shared_frames = st.builds(
    SharedFrames,
    segment=st.from_regex(r"lz-[0-9]{1,10}-[0-9a-f]{32}-[0-9]{1,2}", fullmatch=True),
    generation=st.integers(1, 2**64 - 1),
    frames=st.dictionaries(st.text(min_size=1, max_size=8),
                           st.tuples(st.integers(16, 2**40), st.integers(1, 4096), st.integers(1, 4096)),
                           min_size=1, max_size=4),
)


@st.composite
def chunks(draw):
    shape = (draw(st.integers(0, 20)), draw(st.integers(0, 8)))
    return ActionChunk(
        response_to_seq_id=draw(uint64),
        inference_time_ms=draw(finite),
        actions=draw(hnp.arrays(draw(st.sampled_from(["float32", "float64"])), shape)),
        server_id=draw(st.none() | names),
        queue_time_ms=draw(st.none() | finite),
        execution_horizon=draw(st.none() | st.integers(0, 100)),
        rtc_delay_steps=draw(st.none() | st.integers(0, 100)),
    )


statuses = st.builds(
    Status,
    model_id=names, model_version=names,
    expected_cameras=st.dictionaries(names, st.tuples(st.integers(1, 4096), st.integers(1, 4096)), max_size=4),
    action_dim=st.integers(0, 64), max_actions_per_chunk=st.integers(0, 1000),
    observation_features=st.dictionaries(names, st.fixed_dictionaries({"dtype": names, "shape": st.lists(st.integers(0, 640), max_size=3)}), max_size=4),
    policy_type=names, fps=st.none() | st.integers(1, 1000), server_id=names,
    state_dim=st.none() | st.integers(0, 64), action_names=st.lists(names, max_size=8).map(tuple),
    accepts_unknown_clients=st.booleans(),
    rtc=st.none() | st.builds(RtcAdvert, execution_horizon=st.none() | st.integers(1, 1000)),
    same_host=st.none() | st.builds(SameHostAdvert, probe=st.text(max_size=64), token=st.text(max_size=64)),
)
numbers = st.integers(-(2**63), 2**63 - 1) | finite
telemetries = st.builds(
    Telemetry,
    source=st.sampled_from(["server", "client"]), source_id=names, seq=uint64,
    uptime_s=finite, period_s=finite,
    metrics=st.dictionaries(names, numbers, max_size=8),
    per_client=st.dictionaries(names, st.dictionaries(names, numbers, max_size=4), max_size=3),
    labels=st.dictionaries(names, names, max_size=3),
)


def assert_same(a, b):
    assert type(a) is type(b)
    for name in a.__slots__ if hasattr(a, "__slots__") else a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, RtcInputs):
            assert_same(x, y)
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
        else:
            assert x == y, name


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(observations() | chunks() | statuses | telemetries)
def test_every_message_round_trips(msg):
    data = codec.encode(msg)
    assert_same(codec.decode(data), msg)
    assert_same(codec.decode(data, type(msg)), msg)


@settings(max_examples=400)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_only_raise_protocol_error(data):
    try:
        codec.decode(data)
    except ProtocolError:
        pass


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(observations() | chunks() | statuses | telemetries, st.data())
def test_mutated_messages_only_raise_protocol_error(msg, data):
    raw = bytearray(codec.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "cut" and raw:
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        else:
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        codec.decode(bytes(raw))
    except ProtocolError:
        pass


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(observations(), st.data())
def test_the_task_length_read_on_arrival_is_the_decoded_tasks_and_never_raises(obs, data):
    """`observation_task_bytes` reads what the decoder would read, and on any bytes only returns."""
    raw = codec.encode(obs)
    assert codec.observation_task_bytes(raw) == len(obs.task.encode())
    cut = raw[:data.draw(st.integers(0, len(raw)))]
    assert 0 <= codec.observation_task_bytes(cut) <= len(obs.task.encode())


@pytest.mark.parametrize("length", [0, 31, 32, 255, 256, 65_535, 65_536, 70_000])
def test_the_task_length_read_on_arrival_reads_every_string_header(length):
    packed = msgpack.packb({"seq_id": 1, "task": "t" * length, "images": {"a": b"x" * 300}}, use_bin_type=True)
    assert codec.observation_task_bytes(packed, CodecLimits(max_str_bytes=2**20)) == length


def test_a_hostile_map_naming_the_task_twice_or_not_as_a_string_is_read_at_its_longest():
    twice = b"\x82" + msgpack.packb("task") + msgpack.packb("x" * 5000) + msgpack.packb("task") + msgpack.packb("ok")
    assert codec.observation_task_bytes(twice) == 5000  # the decoder keeps the last: both are read
    for odd in ({"task": b"x" * 5000}, {"task": ["x" * 5000]}, {"task": 7}, ["task", "x" * 5000], "task"):
        assert codec.observation_task_bytes(msgpack.packb(odd, use_bin_type=True)) == 0  # the decoder says why


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**64 - 1), st.text(min_size=1, max_size=40), st.text(max_size=40),
       st.one_of(st.none(), st.text(max_size=600)), st.data())
def test_an_engine_answers_header_read_in_place_is_what_the_decoder_reads_and_never_raises(request_id, engine_id,
                                                                                           incarnation, detail, data):
    """`dispatch.answer_header` (what the scheduler's callback reads of an answer) names the request,
    engine and scheduler process the full decode names; on any truncation it only returns."""
    from lerobot_zenoh.protocol import dispatch

    answer = dispatch.EngineAnswer(request_id, engine_id, "inc", "m", "v", incarnation, "c", 3, detail=detail or "",
                                   actions=np.zeros((4, 2), np.float32), inference_ms=1.0)
    raw = dispatch.encode(answer)
    assert dispatch.answer_header(raw) == dispatch.AnswerHeader(request_id, engine_id, incarnation, True) or (
        len(engine_id.encode()) > codec.HEADER_STR_BYTES or len(incarnation.encode()) > codec.HEADER_STR_BYTES)
    cut = raw[:data.draw(st.integers(0, len(raw)))]
    header = dispatch.answer_header(cut)
    assert header is None or header.request_id == request_id


def test_an_answers_header_reader_refuses_what_is_not_an_answers_header():
    from lerobot_zenoh.protocol import dispatch

    def pack(**fields):
        return msgpack.packb({"protocol_version": [1, 0], "type": "engine_answer", "request_id": 5, "engine_id": "e",
                              "edge_incarnation": "i", **fields}, use_bin_type=True)

    assert dispatch.answer_header(pack()) == dispatch.AnswerHeader(5, "e", "i", True)
    assert dispatch.answer_header(pack(type="engine_status")).is_answer is False
    for odd in (pack(request_id="5"), pack(request_id=[5]), pack(engine_id=b"e"), pack(edge_incarnation=None),
                pack(engine_id="e" * 300), pack(request_id={"deep": [[[[1]]]]}),
                msgpack.packb({f"k{i}": i for i in range(100)}), msgpack.packb([1, 2]), b"", b"\xc1",
                b"\xdf\xff\xff\xff\xff", msgpack.packb({1: 2})):
        assert dispatch.answer_header(odd) is None, odd
    both = b"\x82" + msgpack.packb("request_id") + msgpack.packb(1) + msgpack.packb("request_id") + msgpack.packb(9)
    assert codec.header_fields(both, frozenset({"request_id"}), 4) == {"request_id": 1}  # the first: the walk stops
    assert codec.header_fields(both, frozenset({"request_id", "x"}), 4) == {"request_id": 9}  # walked on: the last


@settings(max_examples=300)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=5),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4)))
def test_well_formed_msgpack_of_any_shape_only_raises_protocol_error(obj):
    for payload in (obj, {"protocol_version": [1, 0], "type": "observation", "x": obj},
                    {"protocol_version": [1, 0], "type": "status", "model_id": obj}):
        try:
            codec.decode(msgpack.packb(payload, use_bin_type=True))
        except ProtocolError:
            pass


def test_fields_removed_in_1_1_are_ignored_when_an_older_peer_sends_them():
    raw = msgpack.unpackb(codec.encode(obs_fixture()), raw=False)
    raw["protocol_version"] = [1, 0]
    raw["execution"] |= {"episode_id": "ep1", "round_id": 3, "phase_elapsed_s": 0.25}
    assert_same(codec.decode(msgpack.packb(raw, use_bin_type=True)), obs_fixture())


def test_unknown_optional_fields_are_ignored():
    raw = msgpack.unpackb(codec.encode(chunk_fixture()), raw=False)
    raw["from_the_future"] = {"anything": [1, 2, 3]}
    raw["protocol_version"] = [1, 7]
    msg = codec.decode(msgpack.packb(raw, use_bin_type=True))
    assert_same(msg, chunk_fixture())


def test_unknown_major_version_is_rejected_with_reason():
    raw = msgpack.unpackb(codec.encode(chunk_fixture()), raw=False)
    raw["protocol_version"] = [2, 0]
    with pytest.raises(VersionError, match="protocol 2.0"):
        codec.decode(msgpack.packb(raw, use_bin_type=True))


def test_wrong_message_type_is_rejected():
    with pytest.raises(ProtocolError, match="expected observation, got action_chunk"):
        codec.decode_observation(codec.encode(chunk_fixture()))


@pytest.mark.parametrize("dtype", ["object", "str", "complex64", "datetime64"])
def test_only_numeric_and_bool_dtypes(dtype):
    raw = msgpack.unpackb(codec.encode(chunk_fixture()), raw=False)
    raw["actions"]["dtype"] = dtype
    with pytest.raises(ProtocolError, match="bad_dtype"):
        codec.decode(msgpack.packb(raw, use_bin_type=True))
    with pytest.raises(ProtocolError):
        codec.pack_array(np.array(["a"], dtype=dtype) if dtype == "str" else np.zeros(2, dtype=dtype))


def test_shape_times_itemsize_must_match_bytes():
    raw = msgpack.unpackb(codec.encode(chunk_fixture()), raw=False)
    raw["actions"]["shape"] = [4, 6]
    with pytest.raises(ProtocolError, match="size_mismatch"):
        codec.decode(msgpack.packb(raw, use_bin_type=True))


def test_size_limit_is_enforced_before_unpacking():
    data = codec.encode(chunk_fixture())
    with pytest.raises(ProtocolError, match="too_large"):
        codec.decode(data, limits=CodecLimits(max_message_bytes=len(data) - 1))


def test_nesting_and_container_limits():
    deep: object = 1
    for _ in range(20):
        deep = [deep]
    with pytest.raises(ProtocolError, match="too_deep"):
        codec.decode(msgpack.packb({"protocol_version": [1, 0], "type": "telemetry", "x": deep}))
    with pytest.raises(ProtocolError, match="bad_msgpack"):
        codec.decode(msgpack.packb({"protocol_version": [1, 0], "type": "telemetry", "x": list(range(10_000))}))


def test_big_endian_arrays_are_sent_little_endian():
    arr = np.arange(6, dtype=">f4")
    obs = Observation(1, "r", arr, {})
    out = codec.decode_observation(codec.encode(obs))
    assert out.state.dtype == np.dtype("<f4") and np.array_equal(out.state, arr)


# ----------------------------------------------------------------------------- JPEG


def scene(h=96, w=128, seed=0):
    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    img = np.stack([xx * 255 // w, yy * 255 // h, np.full_like(xx, 128)], axis=-1).astype(np.uint8)
    img[h // 4: h // 2, w // 4: w // 2] = rng.integers(0, 255, 3)
    return img


def test_jpeg_round_trip_keeps_colours_and_shape():
    img = scene()
    img[:] = (220, 30, 30)  # pure red must stay red (RGB, not BGR, on both sides)
    data = codec.encode_jpeg(img, quality=95)
    assert codec.jpeg_shape(data) == (96, 128, 3)
    out = codec.decode_jpeg(data, expected_shape=(96, 128))
    assert out.shape == (96, 128, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - img).mean() < 4
    assert out[..., 0].mean() > 200 and out[..., 2].mean() < 50


def test_jpeg_shape_is_checked_before_decoding():
    data = codec.encode_jpeg(scene(), quality=80)
    with pytest.raises(ProtocolError, match="wrong_image_shape"):
        codec.decode_jpeg(data, expected_shape=(480, 640))


@settings(max_examples=200)
@given(st.binary(max_size=300))
def test_garbage_jpeg_raises_protocol_error(data):
    with pytest.raises(ProtocolError):
        codec.decode_jpeg(b"\xff\xd8" + data)


def test_jpeg_quality_changes_size():
    img = scene(240, 320)
    assert len(codec.encode_jpeg(img, 30)) < len(codec.encode_jpeg(img, 95))


# ----------------------------------------------------------------------------- golden bytes


def obs_fixture():
    return Observation(
        seq_id=42, client_uuid="robot_a4b9", state=np.array([0.5, -1.25, 2.0], dtype=np.float32),
        images={"front": b"\xff\xd8\xff\xd9"}, task="pick the cookie",
        execution=ExecutionInfo(actions_buffered=7, control_period_s=1 / 32),
        episode_id="ep1", session_nonce=0x1234_5678_9ABC,
    )


def chunk_fixture():
    return ActionChunk(response_to_seq_id=42, inference_time_ms=12.5,
                       actions=np.arange(12, dtype=np.float32).reshape(2, 6), server_id="gpu0")


def status_fixture():
    return Status(
        model_id="act", model_version="v1", expected_cameras={"front": (96, 128)}, action_dim=6,
        max_actions_per_chunk=50,
        observation_features={"observation.state": {"dtype": "float32", "shape": [6], "names": ["j0"]}},
        policy_type="act", fps=30, server_id="gpu0", state_dim=6, action_names=("j0",),
        chunk_size=100, reads_task=False, history_length=1, rtc=None,
    )


def telemetry_fixture():
    return Telemetry(source="client", source_id="robot_a4b9", seq=1, uptime_s=2.5, period_s=1.0,
                     metrics={"rtt_p50_ms": 3.5, "steps": 60}, labels={"cluster": "jupiter"})


def obs_rtc_fixture():
    """The observation fixture with real-time-chunking inputs: 2 leftover actions of 2 dims, delay 1."""
    return Observation(
        seq_id=43, client_uuid="robot_a4b9", state=np.array([0.5], dtype=np.float32), images={},
        episode_id="ep1", session_nonce=7,
        rtc=RtcInputs(prefix=np.array([[0.25, -0.5], [1.0, 2.0]], dtype=np.float32), delay_steps=1),
    )


def chunk_rtc_fixture():
    return ActionChunk(response_to_seq_id=43, inference_time_ms=12.5,
                       actions=np.array([[0.25, -0.5], [1.0, 2.0], [1.5, 2.5]], dtype=np.float32),
                       server_id="gpu0", rtc_delay_steps=1)


def status_rtc_fixture():
    return Status(
        model_id="smolvla", model_version="v1", expected_cameras={}, action_dim=2, max_actions_per_chunk=50,
        observation_features={}, policy_type="smolvla", fps=30, server_id="gpu0", state_dim=1,
        rtc=RtcAdvert(execution_horizon=10),
    )


def obs_shared_fixture():
    """1.2: one camera raw through same-host shared memory, one as JPEG."""
    return Observation(
        seq_id=44, client_uuid="robot_a4b9", state=np.array([0.5], dtype=np.float32), images={"wrist": b"\xff\xd8\xff\xd9"},
        session_nonce=7,
        shared_frames=SharedFrames(segment="lz-4242-0123456789abcdef0123456789abcdef-2", generation=9,
                                   frames={"front": (16, 2, 4)}),
    )


def status_same_host_fixture():
    return Status(
        model_id="act", model_version="v1", expected_cameras={"front": (2, 4)}, action_dim=2, max_actions_per_chunk=50,
        observation_features={}, policy_type="act", fps=30, server_id="gpu0", state_dim=1,
        same_host=SameHostAdvert(probe="lz-probe-4242-00112233445566778899aabbccddeeff",
                                 token="ffeeddccbbaa99887766554433221100"),
    )


def obs_pipeline_fixture():
    """1.3: a refresh of request 44, asking components 0 and 2 of a task."""
    return Observation(seq_id=45, client_uuid="robot_a4b9", state=np.array([0.5], dtype=np.float32), images={},
                       session_nonce=7, refreshes_seq_id=44, component_mask=0b101)


def status_verdict_fixture():
    """1.3: a safety component's server says it answers with verdicts."""
    return Status(model_id="qwen3b", model_version="v1", expected_cameras={"front": (2, 4)}, action_dim=0,
                  max_actions_per_chunk=0, observation_features={}, policy_type="vlm", server_id="safety0",
                  output="verdict", refreshes=True)


def text_result_fixture():
    return TextResult(response_to_seq_id=45, text="pick up the red cube", inference_time_ms=612.5, server_id="vlm0",
                      queue_time_ms=3.25)


def verdict_fixture():
    return Verdict(response_to_seq_id=45, label="unsafe", inference_time_ms=150.0, score=0.875, server_id="safety0")


def refusal_fixture():
    """1.5: why request 45 was refused, every request like it being refused the same way."""
    return Refusal(response_to_seq_id=45, reason="task_too_long", detail="the task is 145 tokens, smolvla reads at most 48",
                   permanent=True, server_id="gpu0")


FIXTURES = {"refusal": refusal_fixture, "observation": obs_fixture, "action_chunk": chunk_fixture, "status": status_fixture, "telemetry": telemetry_fixture,
            "observation_rtc": obs_rtc_fixture, "action_chunk_rtc": chunk_rtc_fixture, "status_rtc": status_rtc_fixture,
            "observation_shared": obs_shared_fixture, "status_same_host": status_same_host_fixture,
            "observation_pipeline": obs_pipeline_fixture, "text_result": text_result_fixture, "verdict": verdict_fixture,
            "status_verdict": status_verdict_fixture}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_golden_bytes(name):
    """An accidental wire change fails here. After a deliberate one: LZ_REGEN_GOLDEN=1 and bump the version."""
    path = GOLDEN / f"{name}_v1.msgpack"
    data = codec.encode(FIXTURES[name]())
    if os.environ.get("LZ_REGEN_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes(data)
    assert data == path.read_bytes()
    assert_same(codec.decode(path.read_bytes()), FIXTURES[name]())


@pytest.mark.parametrize("patch, reason", [
    ({"label": "maybe"}, "bad_verdict"), ({"label": 3}, "bad_field"), ({"score": 1.5}, "bad_verdict"),
    ({"score": float("nan")}, "bad_verdict"), ({"response_to_seq_id": -1}, "bad_field"),
])
def test_hostile_verdicts_are_rejected_with_a_reason(patch, reason):
    raw = msgpack.unpackb(codec.encode(verdict_fixture()), raw=False) | patch
    with pytest.raises(ProtocolError) as exc:
        codec.decode_verdict(msgpack.packb(raw, use_bin_type=True))
    assert exc.value.reason == reason


@pytest.mark.parametrize("mask", [0, -1, 2**32, 1.5, True])
def test_a_bad_component_mask_is_rejected(mask):
    raw = msgpack.unpackb(codec.encode(obs_pipeline_fixture()), raw=False) | {"component_mask": mask}
    with pytest.raises(ProtocolError) as exc:
        codec.decode_observation(msgpack.packb(raw, use_bin_type=True))
    assert exc.value.reason == "bad_field"


def test_a_text_result_is_not_an_action_chunk():
    with pytest.raises(ProtocolError) as exc:
        codec.decode_action_chunk(codec.encode(text_result_fixture()))
    assert exc.value.reason == "wrong_type"


def test_status_client_admitted_is_additive():
    """1.1: `client_admitted` round-trips when set and is absent (1.0 bytes) when None."""
    from dataclasses import replace

    plain = codec.encode(status_fixture())
    assert b"client_admitted" not in plain and codec.decode_status(plain).client_admitted is None
    for admitted in (True, False):
        data = codec.encode(replace(status_fixture(), client_admitted=admitted))
        assert codec.decode_status(data).client_admitted is admitted


def test_no_pickle_anywhere_in_the_package():
    root = pathlib.Path(codec.__file__).parents[1]
    pattern = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|joblib)\b|pickle\.loads?\(", re.M)
    offenders = [str(p) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_frame_header_after_large_metadata_segments_is_found():
    data = codec.encode_jpeg(scene(), 80)
    app = b"\xff\xe2" + (65000).to_bytes(2, "big") + bytes(64998)  # a big APP2 (ICC-like) segment
    padded = data[:2] + app + app + data[2:]
    assert codec.jpeg_shape(padded) == (96, 128, 3)
    assert codec.decode_jpeg(padded, (96, 128)).shape == (96, 128, 3)


# ----------------------------------------------------------------------------- real-time chunking inputs


def _obs_map_with_rtc(rtc):
    raw = msgpack.unpackb(codec.encode(obs_fixture()), raw=False)
    raw["rtc"] = rtc
    return msgpack.packb(raw, use_bin_type=True)


def _prefix(rows, dtype="float32"):
    return codec.pack_array(np.asarray(rows, dtype=dtype))


@pytest.mark.parametrize(("rtc", "reason", "detail"), [
    ({"prefix": _prefix([[0.0, np.nan]]), "delay_steps": 0}, "bad_rtc_prefix", "NaN"),
    ({"prefix": _prefix([[np.inf, 0.0]]), "delay_steps": 0}, "bad_rtc_prefix", "NaN or infinity"),
    ({"prefix": _prefix([1.0, 2.0]), "delay_steps": 0}, "bad_rtc_prefix", "2-D"),
    ({"prefix": _prefix([[1, 2]], "int32"), "delay_steps": 0}, "bad_rtc_prefix", "float"),
    ({"prefix": {"dtype": "float32", "shape": [1, 2], "data": b"\0" * 4}, "delay_steps": 0}, "bad_rtc_prefix", "size_mismatch"),
    ({"delay_steps": 0}, "bad_rtc_prefix", "missing"),
    ({"prefix": _prefix([[1.0, 2.0]]), "delay_steps": -1}, "bad_rtc_delay", "outside 0..1"),
    ({"prefix": _prefix([[1.0, 2.0]]), "delay_steps": 2}, "bad_rtc_delay", "outside 0..1"),
    ({"prefix": _prefix(np.zeros((0, 2))), "delay_steps": 1}, "bad_rtc_delay", "outside 0..0"),
    ({"prefix": _prefix([[1.0, 2.0]]), "delay_steps": True}, "bad_rtc_delay", "integer"),
    ({"prefix": _prefix([[1.0, 2.0]]), "delay_steps": 1.0}, "bad_rtc_delay", "integer"),
    ({"prefix": _prefix([[1.0, 2.0]])}, "bad_rtc_delay", "integer"),
    ([1, 2], "bad_field", "rtc"),
])
def test_bad_rtc_inputs_are_rejected_with_a_reason(rtc, reason, detail):
    with pytest.raises(ProtocolError, match=detail) as exc:
        codec.decode_observation(_obs_map_with_rtc(rtc))
    assert exc.value.reason == reason


def test_rtc_inputs_at_the_bounds_are_accepted():
    obs = codec.decode_observation(_obs_map_with_rtc({"prefix": _prefix(np.zeros((0, 2))), "delay_steps": 0}))
    assert obs.rtc.prefix.shape == (0, 2) and obs.rtc.delay_steps == 0
    obs = codec.decode_observation(_obs_map_with_rtc({"prefix": _prefix(np.ones((3, 2)), "float64"), "delay_steps": 3}))
    assert obs.rtc.prefix.dtype == np.float64 and obs.rtc.delay_steps == 3


def test_a_bad_rtc_advert_or_echo_is_rejected():
    raw = msgpack.unpackb(codec.encode(status_rtc_fixture()), raw=False)
    for horizon in (0, -3, "10", True):
        raw["rtc"] = {"execution_horizon": horizon}
        with pytest.raises(ProtocolError, match="rtc.execution_horizon") as exc:
            codec.decode_status(msgpack.packb(raw, use_bin_type=True))
        assert exc.value.reason == "bad_field"
    raw = msgpack.unpackb(codec.encode(chunk_rtc_fixture()), raw=False)
    raw["rtc_delay_steps"] = -1
    with pytest.raises(ProtocolError, match="rtc_delay_steps"):
        codec.decode_action_chunk(msgpack.packb(raw, use_bin_type=True))


def test_messages_without_rtc_encode_as_before_and_an_advert_may_be_empty():
    assert b"rtc" not in codec.encode(obs_fixture()) + codec.encode(chunk_fixture()) + codec.encode(status_fixture())
    raw = msgpack.unpackb(codec.encode(status_fixture()), raw=False)
    raw["rtc"] = {}
    assert codec.decode_status(msgpack.packb(raw, use_bin_type=True)).rtc == RtcAdvert(None)


@pytest.mark.parametrize("bad", [
    {"segment": "../../etc/passwd", "generation": 1, "frames": {"front": [16, 2, 4]}},
    {"segment": "lz-ab-1", "generation": 0, "frames": {"front": [16, 2, 4]}},
    {"segment": "lz-ab-1", "generation": True, "frames": {"front": [16, 2, 4]}},
    {"segment": "lz-ab-1", "generation": 1, "frames": {}},
    {"segment": "lz-ab-1", "generation": 1, "frames": {"front": [8, 2, 4]}},  # inside the header
    {"segment": "lz-ab-1", "generation": 1, "frames": {"front": [16, 0, 4]}},
    {"segment": "lz-ab-1", "generation": 1, "frames": {"front": [16, 5000, 5000]}},  # pixel limit
    {"segment": "lz-ab-1", "generation": 1, "frames": {"front": [16, 2]}},
    {"segment": "lz-ab-1", "frames": {"front": [16, 2, 4]}},
])
def test_malformed_shared_frames_are_rejected(bad):
    """1.2: every fault of `shared_frames` is `bad_shared_frames`, before any file is touched."""
    m = msgpack.unpackb(codec.encode(obs_shared_fixture()))
    m["shared_frames"] = bad
    with pytest.raises(ProtocolError) as e:
        codec.decode(msgpack.packb(m))
    assert e.value.reason == "bad_shared_frames"
