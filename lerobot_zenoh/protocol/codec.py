"""The only code that turns messages into bytes and back: MessagePack, numpy arrays, JPEG.

Why not pickle: unpickling runs code chosen by whoever sent the bytes (LeRobot's gRPC prototype
does exactly that on an open port). MessagePack carries only maps, arrays, strings, numbers and
bytes. What each message holds is declared once, in `protocol/schema.py`; this module adds the
envelope (`protocol_version`, `type`), the byte limits, JPEG (encoded with OpenCV, decoded with
simplejpeg's libjpeg-turbo: the pair chosen by ``benchmarks/studies/codec.py``, docs/benchmarks.md "JPEG
codec") and the observation header. Every decode failure, whatever the input, raises
``ProtocolError`` with a reason; nothing else escapes from ``decode``.

The byte layout is specified in docs/protocol.md; golden tests pin it.
"""

from __future__ import annotations

import struct
from typing import Any

import cv2
import msgpack
import numpy as np
import simplejpeg

from lerobot_zenoh.errors import ProtocolError, VersionError
from lerobot_zenoh.protocol import schema
from lerobot_zenoh.protocol.messages import (
    PROTOCOL_VERSION,
    ActionChunk,
    ExecutionInfo,
    Message,
    MessageType,
    Observation,
    ObservationHeader,
    Refusal,
    Status,
    Telemetry,
    TextResult,
    Verdict,
)
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.protocol.schema import (  # noqa: F401  (the codec's public names)
    ALLOWED_DTYPES,
    DEFAULT_LIMITS,
    UINT64_MAX,
    CodecLimits,
    pack_array,
    unpack_array,
)

#: Each message type's record class and wire table.
TABLES: dict[str, tuple[type, schema.Record]] = {
    MessageType.OBSERVATION: (Observation, schema.OBSERVATION),
    MessageType.ACTION_CHUNK: (ActionChunk, schema.ACTION_CHUNK),
    MessageType.STATUS: (Status, schema.STATUS),
    MessageType.TELEMETRY: (Telemetry, schema.TELEMETRY),
    MessageType.TEXT_RESULT: (TextResult, schema.TEXT_RESULT),
    MessageType.VERDICT: (Verdict, schema.VERDICT),
    MessageType.REFUSAL: (Refusal, schema.REFUSAL),
}
#: What a client reads on its action key: a chunk, or (1.5) why its request was refused.
ACTION_ANSWERS = {kind: TABLES[kind] for kind in (MessageType.ACTION_CHUNK, MessageType.REFUSAL)}
_KIND_OF = {cls: (kind, table) for kind, (cls, table) in TABLES.items()}


# ----------------------------------------------------------------------------- envelope and bytes


def encode_map(kind: str, table: schema.Record, msg: Any) -> bytes:
    """The envelope, then the fields of `msg` as `table` declares them, as MessagePack."""
    out = {"protocol_version": list(PROTOCOL_VERSION), "type": kind}
    out.update(table.encode(msg))
    return msgpack.packb(out, use_bin_type=True)


def decode_map(data: Any, tables: dict[str, tuple[type, schema.Record]], expected: str | None,
               limits: CodecLimits) -> Any:
    """Bytes -> the record of one of `tables` (of type `expected` when given). Only ever raises
    ProtocolError (VersionError for another major version, or a minor older than the message's
    `since`)."""
    try:
        obj = _unpack(data, limits)
        kind, minor = _envelope(obj, tables)
        if expected is not None and kind != expected:
            raise ProtocolError(Reason.WRONG_TYPE, f"expected {expected}, got {kind}")
        table = tables[kind][1]
        if minor < table.since:
            raise VersionError(Reason.UNSUPPORTED_VERSION,
                               f"{kind} of protocol 1.{minor}: its fields are those of 1.{table.since} and later")
        return table.decode(obj, "", limits)
    except ProtocolError:
        raise
    except Exception as exc:  # any other failure of a hostile byte string is still a protocol error
        raise ProtocolError(Reason.MALFORMED, f"{type(exc).__name__}: {exc}") from exc


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(Reason.BAD_MSGPACK, f"extension type {code} is not allowed")


def _unpack(data: Any, limits: CodecLimits) -> dict:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(Reason.NOT_BYTES, type(data).__name__)
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(Reason.TOO_LARGE, f"{len(data)} B > limit {limits.max_message_bytes} B")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext, timestamp=0,
            max_str_len=limits.max_str_bytes, max_bin_len=limits.max_message_bytes,
            max_array_len=limits.max_container_len, max_map_len=limits.max_container_len, max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(Reason.BAD_MSGPACK, f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(Reason.BAD_MSGPACK, "top level must be a map")
    if not _depth_ok(obj, limits.max_depth):
        raise ProtocolError(Reason.TOO_DEEP, f"nesting deeper than {limits.max_depth}")
    return obj


def _depth_ok(obj: Any, max_depth: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                return False
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            if depth > max_depth:
                return False
            stack.extend((v, depth + 1) for v in node)
    return True


def _envelope(obj: dict, tables: dict) -> tuple[str, int]:
    """The message's type and its minor version (of a major version this peer speaks)."""
    version = obj.get("protocol_version")
    if not (type(version) is list and len(version) == 2 and all(type(v) is int for v in version)):
        raise ProtocolError(Reason.MISSING_VERSION, "protocol_version must be [major, minor]")
    if version[0] != PROTOCOL_VERSION[0]:
        raise VersionError(Reason.UNSUPPORTED_VERSION,
                           f"message is protocol {version[0]}.{version[1]}, this peer speaks {PROTOCOL_VERSION[0]}.x")
    kind = obj.get("type")
    if type(kind) is not str or kind not in tables:
        raise ProtocolError(Reason.UNKNOWN_TYPE, repr(kind)[:64])
    return kind, version[1]


# ----------------------------------------------------------------------------- public API


def encode(msg: Message) -> bytes:
    """Message -> bytes. Raises ProtocolError for values the protocol cannot carry."""
    try:
        kind, table = _KIND_OF[type(msg)]
    except KeyError:
        raise TypeError(f"not a protocol message: {type(msg).__name__}") from None
    return encode_map(kind, table, msg)


def decode(data: bytes, expected: type[Message] | None = None, limits: CodecLimits = DEFAULT_LIMITS) -> Message:
    """Bytes -> message. Only ever raises ProtocolError (VersionError for another major version)."""
    return decode_map(data, TABLES, None if expected is None else _KIND_OF[expected][0], limits)


def decode_observation(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> Observation:
    return decode_map(data, TABLES, MessageType.OBSERVATION, limits)


def observation_task_bytes(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> int:
    """The length in bytes of an encoded observation's `task`, read without decoding anything else:
    the top-level map's keys are unpacked, every other value is skipped unread (in msgpack's C
    code) and the task's string header is read in place, so a 64 kB task costs no UTF-8 decode.
    The longest, should a hostile map name `task` twice; 0 without one (or one that is not a
    string: the decoder rejects it with its reason), and 0 for bytes the walk cannot read (not a
    map, truncated, over `limits`: the decoder rejects those too). What the server reads of an
    observation on arrival, to refuse a long task before the inference thread sees it."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1), max_str_len=limits.max_str_bytes,
                                max_bin_len=limits.max_message_bytes, max_array_len=limits.max_container_len,
                                max_map_len=limits.max_container_len, max_ext_len=0)
    longest = 0
    try:
        unpacker.feed(data)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "task":
                longest = max(longest, _str_length_at(data, unpacker.tell()))
            unpacker.skip()
    except Exception:  # not a map, truncated, over a limit: left to the decoder, which says why
        pass
    return longest


def _str_length_at(data: bytes, at: int) -> int:
    """The length of the msgpack string whose header starts at `at`; 0 for any other type."""
    head = data[at]
    if 0xA0 <= head <= 0xBF:  # fixstr
        return head & 0x1F
    width = {0xD9: 1, 0xDA: 2, 0xDB: 4}.get(head)
    return int.from_bytes(data[at + 1:at + 1 + width], "big") if width else 0


#: `header_fields`: a string value longer than this is not read (a header names ids, not text).
HEADER_STR_BYTES = 256
_INT_HEADS = frozenset(range(0x00, 0x80)) | frozenset(range(0xE0, 0x100)) | frozenset(range(0xCC, 0xD4))


def header_fields(data: bytes, names: frozenset[str], max_entries: int) -> dict[str, int | str] | None:
    """The integer and short string values of the top-level map's entries named in `names`, read
    in place: every other value is skipped unread (in msgpack's C code), and a named value is
    unpacked only after its type byte says it is an integer or a string of at most
    `HEADER_STR_BYTES` (its length read from its header first); the walk stops when every name is
    read. What a Zenoh callback reads of a message to decide whether it is worth queueing, at a cost
    bounded by `max_entries` whatever the bytes. None when the bytes are not a map of at most
    `max_entries` entries, are truncated before a named value, or a named value is of another type
    or longer. A name given twice is read once, the first: the decoder keeps the last, so a caller
    checks that its full decode names the same (a header only decides what is worth decoding)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1), max_str_len=HEADER_STR_BYTES,
                                max_bin_len=len(data), max_array_len=max_entries, max_map_len=max_entries,
                                max_ext_len=0)
    out: dict[str, int | str] = {}
    try:
        unpacker.feed(data)
        entries = unpacker.read_map_header()
        if entries > max_entries:
            return None
        for _ in range(entries):
            head = data[unpacker.tell()]
            if not (0xA0 <= head <= 0xBF or head in (0xD9, 0xDA, 0xDB)):
                return None  # the envelope's and the tables' keys are all strings
            name = unpacker.unpack()
            if name not in names:
                unpacker.skip()
                continue
            at = unpacker.tell()
            head = data[at]
            if head in _INT_HEADS or _str_length_at(data, at) <= HEADER_STR_BYTES and (
                    0xA0 <= head <= 0xBF or head in (0xD9, 0xDA, 0xDB)):
                out[name] = unpacker.unpack()
                if len(out) == len(names):
                    return out
            else:
                return None
    except Exception:  # not a map, truncated, a string over the bound: the decoder would refuse it too
        return None
    return out


def decode_action_chunk(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> ActionChunk:
    return decode_map(data, TABLES, MessageType.ACTION_CHUNK, limits)


def decode_action_answer(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> ActionChunk | Refusal:
    """What arrives on a client's action key: an ActionChunk, or a Refusal (1.5)."""
    return decode_map(data, ACTION_ANSWERS, None, limits)


def decode_status(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> Status:
    return decode_map(data, TABLES, MessageType.STATUS, limits)


def decode_telemetry(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> Telemetry:
    return decode_map(data, TABLES, MessageType.TELEMETRY, limits)


def decode_text_result(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> TextResult:
    return decode_map(data, TABLES, MessageType.TEXT_RESULT, limits)


def decode_verdict(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> Verdict:
    return decode_map(data, TABLES, MessageType.VERDICT, limits)


# ----------------------------------------------------------------------------- JPEG (§7)


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """Encode an RGB (H, W, 3) or grey (H, W) uint8 image. The JPEG holds the true colours."""
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        raise ProtocolError(Reason.BAD_IMAGE, f"expected uint8 (H, W, 3) or (H, W), got {image.dtype} {image.shape}")
    if not 1 <= quality <= 100:
        raise ProtocolError(Reason.BAD_IMAGE, f"jpeg quality {quality} outside 1..100")
    bgr = cv2.cvtColor(image, cv2.COLOR_RGB2BGR) if image.ndim == 3 else image
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise ProtocolError(Reason.BAD_IMAGE, "OpenCV could not encode the image")
    return buf.tobytes()


_COMPONENTS = {"Gray": 1, "YCbCr": 3, "RGB": 3, "CMYK": 4, "YCCK": 4}


def jpeg_shape(data: bytes) -> tuple[int, int, int]:
    """(height, width, components) from the JPEG frame header (libjpeg-turbo's), without decoding pixels."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        raise ProtocolError(Reason.BAD_JPEG, "missing JPEG start-of-image marker")
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(Reason.BAD_JPEG, f"no readable frame header: {exc}") from None
    return height, width, _COMPONENTS.get(colorspace, 0)


def check_jpeg(
    data: bytes,
    expected_shape: tuple[int, int] | None = None,
    limits: CodecLimits = DEFAULT_LIMITS,
) -> tuple[int, int]:
    """(height, width) of a JPEG that may be decoded: bytes with a readable frame header, within the
    pixel limit and of `expected_shape` when given; ProtocolError (``bad_jpeg``, ``wrong_image_shape``)
    otherwise. Reads the header only: no pixel is decoded before every check passed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(Reason.BAD_JPEG, "image must be bytes")
    height, width, _ = jpeg_shape(data)
    if height * width > limits.max_image_pixels or height == 0 or width == 0:
        raise ProtocolError(Reason.BAD_JPEG, f"{height}x{width} outside the pixel limit")
    if expected_shape is not None and (height, width) != tuple(expected_shape):
        raise ProtocolError(Reason.WRONG_IMAGE_SHAPE, f"{height}x{width}, expected {expected_shape[0]}x{expected_shape[1]}")
    return height, width


def decode_checked_jpeg(data: bytes, height: int, width: int) -> np.ndarray:
    """The RGB uint8 (H, W, 3) pixels of a JPEG that `check_jpeg` passed as (`height`, `width`);
    ProtocolError (``bad_jpeg``) when its data cannot be decoded or decodes to another size."""
    # libjpeg-turbo with the accurate DCT and smooth chroma upsampling: the same pixels as OpenCV's
    # decoder (equal PSNR, measured) in 0.75-0.85x its time. The fast DCT/upsampling cost ~1 dB and are
    # not used. TurboJPEG never applies an EXIF orientation, so the pixels are as stored.
    try:
        rgb = simplejpeg.decode_jpeg(data, "RGB", fastdct=False, fastupsample=False)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(Reason.BAD_JPEG, f"could not decode the image: {exc}") from exc
    if rgb.shape[:2] != (height, width):
        raise ProtocolError(Reason.BAD_JPEG, "decoded size differs from the frame header")
    return rgb


def decode_jpeg(
    data: bytes,
    expected_shape: tuple[int, int] | None = None,
    limits: CodecLimits = DEFAULT_LIMITS,
) -> np.ndarray:
    """Decode to RGB uint8 (H, W, 3); check (H, W) against `expected_shape` before decoding
    (`check_jpeg`, then `decode_checked_jpeg`).

    `data` may be a memoryview of a transport buffer: it is read in place, never copied, and the
    returned array owns its pixels (the view can be released as soon as this returns).
    """
    height, width = check_jpeg(data, expected_shape, limits)
    return decode_checked_jpeg(data, height, width)


# ------------------------------------------------------------------ observation header (§5.1.1)

#: The header's first byte. A decoder that meets another value returns None: the server then
#: decodes the observation itself, as for a header-less put.
OBS_HEADER_VERSION = 2
# version, flags, seq_id, nonce, elapsed, buffered, dt, len(episode_id), refreshes_seq_id, component_mask
_OBS_HEADER = struct.Struct("<BBQQdQdHQI")
_H_NONCE, _H_EPISODE, _H_ELAPSED, _H_BUFFERED, _H_PERIOD, _H_REFRESHES, _H_COMPONENTS = 1, 2, 4, 8, 16, 32, 64
_H_KNOWN = 127


def encode_observation_header(obs: Observation) -> bytes:
    """The header of an observation (its Zenoh attachment): 56 bytes + the episode id's UTF-8."""
    execution = obs.execution or ExecutionInfo()
    episode = obs.episode_id.encode() if obs.episode_id is not None else b""
    if len(episode) > 0xFFFF:
        raise ProtocolError(Reason.BAD_FIELD, "episode_id longer than 65535 bytes")
    for name, value in (("seq_id", obs.seq_id), ("session_nonce", obs.session_nonce),
                        ("actions_buffered", execution.actions_buffered), ("refreshes_seq_id", obs.refreshes_seq_id)):
        if value is not None and not 0 <= value <= UINT64_MAX:
            raise ProtocolError(Reason.BAD_FIELD, f"{name}={value} is not a uint64")
    mask = obs.component_mask
    if mask is not None:
        schema.COMPONENT_MASK.encode(mask)  # the observation's own bounds
    flags = ((_H_NONCE if obs.session_nonce is not None else 0) | (_H_EPISODE if obs.episode_id is not None else 0)
             | (_H_ELAPSED if execution.task_elapsed_s is not None else 0)
             | (_H_BUFFERED if execution.actions_buffered is not None else 0)
             | (_H_PERIOD if execution.control_period_s is not None else 0)
             | (_H_REFRESHES if obs.refreshes_seq_id is not None else 0) | (_H_COMPONENTS if mask is not None else 0))
    return _OBS_HEADER.pack(OBS_HEADER_VERSION, flags, obs.seq_id, obs.session_nonce or 0,
                            float(execution.task_elapsed_s or 0.0), execution.actions_buffered or 0,
                            float(execution.control_period_s or 0.0), len(episode), obs.refreshes_seq_id or 0,
                            mask or 0) + episode


def decode_observation_header(data: bytes) -> ObservationHeader | None:
    """Bytes -> header; None for another header version; ProtocolError("bad_header") if malformed."""
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) < 1:
        raise ProtocolError(Reason.BAD_HEADER, "empty or not bytes")
    if data[0] != OBS_HEADER_VERSION:
        return None
    if len(data) < _OBS_HEADER.size:
        raise ProtocolError(Reason.BAD_HEADER, f"{len(data)} B, a header has at least {_OBS_HEADER.size}")
    _, flags, seq_id, nonce, elapsed, buffered, period, n, refreshes, mask = _OBS_HEADER.unpack_from(data)
    if flags & ~_H_KNOWN:
        raise ProtocolError(Reason.BAD_HEADER, f"unknown flags {flags:#04x}")
    if len(data) != _OBS_HEADER.size + n:
        raise ProtocolError(Reason.BAD_HEADER, f"{len(data)} B for an episode id of {n} B")
    if flags & _H_COMPONENTS and mask == 0:
        raise ProtocolError(Reason.BAD_HEADER, "component_mask flagged but empty")
    try:
        episode = bytes(data[_OBS_HEADER.size:]).decode() if flags & _H_EPISODE else None
    except UnicodeDecodeError as exc:
        raise ProtocolError(Reason.BAD_HEADER, f"episode_id is not UTF-8: {exc}") from None
    execution = None
    if flags & (_H_ELAPSED | _H_BUFFERED | _H_PERIOD):
        execution = ExecutionInfo(task_elapsed_s=elapsed if flags & _H_ELAPSED else None,
                                  actions_buffered=buffered if flags & _H_BUFFERED else None,
                                  control_period_s=period if flags & _H_PERIOD else None)
    return ObservationHeader(seq_id, episode, nonce if flags & _H_NONCE else None, execution,
                             refreshes if flags & _H_REFRESHES else None, mask if flags & _H_COMPONENTS else None)


def header_matches(header: ObservationHeader, obs: Observation) -> bool:
    """Whether a header says what its observation says (seq_id, episode, nonce, refresh, components)."""
    return ((header.seq_id, header.episode_id, header.session_nonce, header.refreshes_seq_id, header.component_mask)
            == (obs.seq_id, obs.episode_id, obs.session_nonce, obs.refreshes_seq_id, obs.component_mask))
