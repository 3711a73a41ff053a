"""The wire schema: each message's fields, in the order they are sent, with their wire types.

One table per message (`OBSERVATION`, `ACTION_CHUNK`, ... at the bottom), row for row the tables of
docs/protocol.md §5. Encoding, decoding and validation all follow from it: `Record.encode` turns a
message record (`protocol/messages.py`) into the map MessagePack writes, `Record.decode` checks a
map read from the wire and builds the record. `protocol/codec.py` adds the envelope and the bytes.

Rules every table obeys (docs/protocol.md §4.3):

- A field absent or nil is its record's default; a required one is `missing_field` when absent and
  `bad_field` when nil. Keys a table does not list are ignored.
- The encoder writes every field whose value is not None, in table order, except a `sparse` field
  left at its default.
- A value of the wrong MessagePack type is `bad_field` (bool is never an int or a number); a value
  out of its declared bounds is the type's `reason` (default `bad_field`). A field declared with
  its own `reason` reports every fault of its value under that reason (e.g. `bad_rtc_prefix`).
- Arrays are maps ``{dtype, shape, data}`` with raw little-endian bytes (§6); images are raw JPEG
  bytes (§7). Nothing is ever unpickled.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from operator import attrgetter
from typing import Any, Callable, Iterable

import numpy as np

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.messages import (
    MAX_COMPONENTS,
    MAX_REFUSAL_DETAIL_BYTES,
    MAX_TASK_BYTES,
    ActionChunk,
    ExecutionInfo,
    HistoryFrame,
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
from lerobot_zenoh.protocol.reasons import OutputKind, Reason, VerdictLabel

#: dtypes accepted on the wire (numeric and bool only; always little-endian).
ALLOWED_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)
UINT64_MAX = 2**64 - 1
#: Observation.history frames a message may carry.
MAX_HISTORY_FRAMES = 16


@dataclass(frozen=True)
class CodecLimits:
    """Bounds enforced before and while unpacking, against hostile or broken peers (docs/protocol.md §8.1)."""

    # Default: room for four 1080p JPEG cameras at high quality (~2-3 MB each) plus state.
    max_message_bytes: int = 16 * 1024 * 1024
    max_container_len: int = 4096  # entries of any one map or array
    max_depth: int = 8  # nesting of maps/arrays
    max_str_bytes: int = 64 * 1024
    max_ndim: int = 4
    max_image_pixels: int = 4096 * 4096


DEFAULT_LIMITS = CodecLimits()


# ----------------------------------------------------------------------------- arrays (§6)


def pack_array(array: np.ndarray) -> dict[str, Any]:
    arr = np.asarray(array)
    if arr.dtype.name not in ALLOWED_DTYPES:
        raise ProtocolError(Reason.BAD_DTYPE, f"{arr.dtype} is not a numeric or bool dtype")
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.tobytes()}


def unpack_array(obj: Any, name: str, limits: CodecLimits = DEFAULT_LIMITS) -> np.ndarray:
    if not isinstance(obj, dict):
        raise ProtocolError(Reason.BAD_ARRAY, f"{name} must be a map with dtype, shape, data")
    dtype_name, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if type(dtype_name) is not str or dtype_name not in ALLOWED_DTYPES:
        raise ProtocolError(Reason.BAD_DTYPE, f"{name}.dtype={dtype_name!r} is not allowed"[:200])
    if type(shape) is not list or len(shape) > limits.max_ndim or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(Reason.BAD_SHAPE, f"{name}.shape={shape!r}"[:200])
    if type(data) is not bytes:
        raise ProtocolError(Reason.BAD_ARRAY, f"{name}.data must be bytes")
    dtype = np.dtype(dtype_name).newbyteorder("<")
    if math.prod(shape) * dtype.itemsize != len(data):
        raise ProtocolError(Reason.SIZE_MISMATCH, f"{name}: shape {shape} x {dtype.itemsize} B != {len(data)} B of data")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


# ----------------------------------------------------------------------------- wire types


class WireType:
    """How one value travels: `encode` makes it MessagePack-ready, `decode` checks it and builds it."""

    what = "a value"  # for error details: "<name> must be <what>"
    reason = Reason.BAD_FIELD  # of a value of the right type but out of bounds

    def encode(self, value: Any) -> Any:
        return value

    def decode(self, value: Any, name: str, limits: CodecLimits) -> Any:
        raise NotImplementedError

    def wrong(self, value: Any, name: str) -> ProtocolError:
        return ProtocolError(Reason.BAD_FIELD, f"{name} must be {self.what}, got {type(value).__name__}"[:200])


class Str(WireType):
    """A str; `max_len` bounds its characters, `max_bytes` its UTF-8 bytes (both checked on decode)."""

    def __init__(self, max_len: int | None = None, choices: type | None = None, reason: Reason = Reason.BAD_FIELD,
                 max_bytes: int | None = None):
        self.max_len, self.choices, self.reason, self.max_bytes = max_len, choices, reason, max_bytes
        self.what = "a string" if choices is None else f"one of {', '.join(choices)}"

    def encode(self, value: Any) -> str:
        if self.choices is not None and value not in self.choices:
            raise ProtocolError(self.reason, f"{value!r} is not {self.what}"[:200])
        return str(value)

    def decode(self, value: Any, name: str, limits: CodecLimits) -> str:
        if type(value) is not str:
            raise self.wrong(value, name)
        if self.max_len is not None and len(value) > self.max_len:
            raise ProtocolError(self.reason, f"{name} longer than {self.max_len} characters")
        if self.max_bytes is not None and len(value) > self.max_bytes // 4:  # (4 bytes a character at most)
            n = len(value) if value.isascii() else len(value.encode())
            if n > self.max_bytes:
                raise ProtocolError(self.reason, f"{name} is {n} bytes of UTF-8, at most {self.max_bytes}")
        if self.choices is not None and value not in self.choices:
            raise ProtocolError(self.reason, f"{name} {value!r} is not {self.what}"[:200])
        return value


class Int(WireType):
    """An integer in ``lo..hi`` (default: uint64). The encoder checks the bounds only of a field
    that narrows them (a uint64 needs no check: MessagePack refuses anything wider)."""

    def __init__(self, lo: int | None = 0, hi: int | None = UINT64_MAX, reason: Reason = Reason.BAD_FIELD):
        self.lo, self.hi, self.reason = lo, hi, reason
        self.narrow = (lo, hi) != (0, UINT64_MAX) and (lo, hi) != (None, None)
        self.what = "an integer" if (lo, hi) == (None, None) else "a uint64" if not self.narrow else f"an integer in {lo}..{hi}"

    def encode(self, value: Any) -> int:
        value = int(value)
        if self.narrow and not self.lo <= value <= self.hi:
            raise ProtocolError(self.reason, f"{value} is not {self.what}")
        return value

    def decode(self, value: Any, name: str, limits: CodecLimits) -> int:
        if type(value) is not int:
            raise self.wrong(value, name)
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise ProtocolError(self.reason, f"{name}={value} is not {self.what}"[:200])
        return value


class Number(WireType):
    """An int or a float, decoded as a float; `lo..hi` (both finite) when bounded."""

    what = "a number"

    def __init__(self, lo: float | None = None, hi: float | None = None, reason: Reason = Reason.BAD_FIELD):
        self.lo, self.hi, self.reason = lo, hi, reason

    def encode(self, value: Any) -> float:
        return float(value)

    def decode(self, value: Any, name: str, limits: CodecLimits) -> float:
        if type(value) is not float and type(value) is not int:
            raise self.wrong(value, name)
        value = float(value)
        if self.lo is not None and not (math.isfinite(value) and self.lo <= value <= self.hi):
            raise ProtocolError(self.reason, f"{name} {value!r} is not in {self.lo}..{self.hi}")
        return value


class Figure(Number):
    """A telemetry figure: an int stays an int, on the wire and decoded; anything else is a float."""

    def encode(self, value: Any) -> int | float:
        return value if type(value) is int else float(value)

    def decode(self, value: Any, name: str, limits: CodecLimits) -> int | float:
        if type(value) is not float and type(value) is not int:
            raise self.wrong(value, name)
        return value


class Bool(WireType):
    what = "a bool"

    def encode(self, value: Any) -> bool:
        return bool(value)

    def decode(self, value: Any, name: str, limits: CodecLimits) -> bool:
        if type(value) is not bool:
            raise self.wrong(value, name)
        return value


class Bin(WireType):
    what = "bytes"

    def encode(self, value: Any) -> bytes:
        return bytes(value)

    def decode(self, value: Any, name: str, limits: CodecLimits) -> bytes:
        if type(value) is not bytes:
            raise self.wrong(value, name)
        return value


class AnyMap(WireType):
    """A map whose contents the protocol does not check (a LeRobot feature description)."""

    what = "a map"

    def encode(self, value: Any) -> dict:
        return value

    def decode(self, value: Any, name: str, limits: CodecLimits) -> dict:
        if type(value) is not dict:
            raise self.wrong(value, name)
        return value


class NdArray(WireType):
    """An array map (§6) of `ndim` dimensions and a dtype of one of `kinds` (numpy kind letters)."""

    what = "an array map"

    def __init__(self, ndim: int | None = None, kinds: str = "biuf", finite: bool = False,
                 reason: Reason = Reason.BAD_FIELD):
        self.ndim, self.kinds, self.finite, self.reason = ndim, kinds, finite, reason
        self.shape_words = f"{ndim}-D {'float' if kinds == 'f' else 'numeric'}"

    def encode(self, value: Any) -> dict:
        return pack_array(value)

    def decode(self, value: Any, name: str, limits: CodecLimits) -> np.ndarray:
        if type(value) is not dict:
            raise self.wrong(value, name)
        array = unpack_array(value, name, limits)
        if (self.ndim is not None and array.ndim != self.ndim) or array.dtype.kind not in self.kinds:
            raise ProtocolError(self.reason, f"{name} must be a {self.shape_words} array, got {array.dtype} {array.shape}")
        if self.finite and not np.all(np.isfinite(array)):
            raise ProtocolError(self.reason, f"{name} contains NaN or infinity")
        return array


class MapOf(WireType):
    """A map of string keys to `values`; `lo..hi` entries."""

    def __init__(self, values: WireType, lo: int = 0, hi: int | None = None, reason: Reason = Reason.BAD_FIELD):
        self.values, self.lo, self.hi, self.reason = values, lo, hi, reason
        self.what = f"a map of strings to {values.what}"

    def encode(self, value: Any) -> dict:
        enc = self.values.encode
        return {str(k): enc(v) for k, v in value.items()}

    def decode(self, value: Any, name: str, limits: CodecLimits) -> dict:
        if type(value) is not dict:
            raise self.wrong(value, name)
        if not self.lo <= len(value) <= (self.hi if self.hi is not None else len(value)):
            raise ProtocolError(self.reason, f"{name} has {len(value)} entries, {self.lo}..{self.hi} allowed")
        dec = self.values.decode
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise ProtocolError(Reason.BAD_FIELD, f"{name} keys must be strings")
            out[k] = dec(v, f"{name}[{k!r}]", limits)
        return out


class ListOf(WireType):
    """An array of `items` (at most `hi`, else the type's `reason`), decoded as a tuple."""

    def __init__(self, items: WireType, hi: int | None = None, reason: Reason = Reason.BAD_FIELD):
        self.items, self.hi, self.reason = items, hi, reason
        self.what = f"an array of {items.what}"

    def encode(self, value: Any) -> list:
        enc = self.items.encode
        return [enc(v) for v in value]

    def decode(self, value: Any, name: str, limits: CodecLimits) -> tuple:
        if type(value) is not list:
            raise self.wrong(value, name)
        if self.hi is not None and len(value) > self.hi:
            raise ProtocolError(self.reason, f"{name} has {len(value)} entries, at most {self.hi}")
        dec = self.items.decode
        return tuple(dec(v, f"{name}[{i}]", limits) for i, v in enumerate(value))


class Tuple(WireType):
    """An array of exactly one integer of each of `items` (integer types), decoded as a tuple."""

    def __init__(self, *items: WireType, reason: Reason = Reason.BAD_FIELD):
        self.items, self.reason = items, reason
        self.what = f"an array of {len(items)} integers"

    def encode(self, value: Any) -> list:
        return [t.encode(v) for t, v in zip(self.items, value, strict=True)]

    def decode(self, value: Any, name: str, limits: CodecLimits) -> tuple:
        if type(value) is not list or len(value) != len(self.items):
            raise ProtocolError(self.reason, f"{name} must be {self.what}")
        return tuple(t.decode(v, f"{name}[{i}]", limits) for i, (t, v) in enumerate(zip(self.items, value)))


@dataclass(frozen=True)
class Field:
    """One row of a table: the wire key (= the record's attribute), its type, whether it must be
    present, whether the encoder leaves it out at its default (`sparse`), and the reason every
    fault of its value is reported under (None: each check's own)."""

    key: str
    type: WireType
    required: bool = False
    sparse: bool = False
    reason: Reason | None = None


class Record(WireType):
    """A map whose keys are declared by `Field`s, decoded into the record class `cls`.

    `check(record, name, limits)` runs after the fields, for rules that span several of them.
    `since`: the minor version of protocol 1 that set a message's required fields (docs/protocol.md
    §4.2); a message of an older minor is refused as `unsupported_version` before its fields are
    read, so an older peer is told apart from a broken one. Only top-level messages use it."""

    what = "a map"

    def __init__(self, cls: type, rows: Iterable[Field], check: Callable[[Any, str, CodecLimits], None] | None = None,
                 reason: Reason = Reason.BAD_FIELD, since: int = 0):
        self.cls, self.rows, self.check, self.reason, self.since = cls, tuple(rows), check, reason, since
        declared = {f.name: f for f in fields(cls)}
        keys = [r.key for r in self.rows]
        if sorted(keys) != sorted(declared):  # the table and the record must name the same fields
            raise TypeError(f"{cls.__name__}: the wire table lists {keys}, the record has {list(declared)}")
        self.defaults = {k: (f.default if f.default is not MISSING else f.default_factory()
                             if f.default_factory is not MISSING else MISSING) for k, f in declared.items()}
        for r in self.rows:
            if self.defaults[r.key] is MISSING and not r.required:
                raise TypeError(f"{cls.__name__}.{r.key} has no default, so the wire must require it")
        # What the loops below read, looked up once (they run for every message).
        self._get = attrgetter(*(r.key for r in self.rows)) if len(self.rows) > 1 else (
            lambda obj, k=self.rows[0].key: (getattr(obj, k),))
        self._encoders = tuple((r.key, r.type.encode, r.sparse, self.defaults[r.key]) for r in self.rows)
        self._decoders = tuple((r.key, r.type.decode, r.required, r.reason, r.type.what) for r in self.rows)

    def encode(self, value: Any) -> dict[str, Any]:
        out = {}
        for (key, encode, sparse, default), v in zip(self._encoders, self._get(value)):
            if v is None or (sparse and v == default):
                continue
            out[key] = encode(v)
        return out

    def decode(self, value: Any, name: str, limits: CodecLimits) -> Any:
        if type(value) is not dict:
            raise ProtocolError(self.reason, f"{name} must be a map, got {type(value).__name__}")
        kwargs = {}
        for key, decode, required, reason, what in self._decoders:
            path = f"{name}.{key}" if name else key
            raw = value.get(key)
            try:
                if raw is None:
                    if required:
                        raise ProtocolError(Reason.MISSING_FIELD if key not in value else Reason.BAD_FIELD,
                                            f"{path} is missing ({what})")
                    continue
                kwargs[key] = decode(raw, path, limits)
            except ProtocolError as exc:
                if reason is None or exc.reason == reason:
                    raise
                raise ProtocolError(reason, str(exc)) from None
        record = self.cls(**kwargs)
        if self.check is not None:
            self.check(record, name, limits)
        return record


# ----------------------------------------------------------------------------- the tables (§5)

UINT64 = Int()
NUMBER = Number()
STR = Str()
BOOL = Bool()
JPEGS = MapOf(Bin())  # camera name -> JPEG bytes (§7)
NUMBERS = MapOf(Figure())
COMPONENT_MASK = Int(1, 2**MAX_COMPONENTS - 1)  # one bit per component of a task (docs/pipelines.md)

EXECUTION_INFO = Record(ExecutionInfo, [
    Field("task_elapsed_s", NUMBER),
    Field("actions_buffered", UINT64),
    Field("control_period_s", NUMBER),
])


def _delay_within_prefix(rtc: RtcInputs, name: str, limits: CodecLimits) -> None:
    if not 0 <= rtc.delay_steps <= len(rtc.prefix):
        raise ProtocolError(Reason.BAD_RTC_DELAY, f"{name}.delay_steps={rtc.delay_steps} outside "
                                                  f"0..{len(rtc.prefix)} (the rows of {name}.prefix)")


RTC_INPUTS = Record(RtcInputs, [
    Field("prefix", NdArray(2, "f", finite=True, reason=Reason.BAD_RTC_PREFIX), required=True,
          reason=Reason.BAD_RTC_PREFIX),
    Field("delay_steps", Int(None, None), required=True, reason=Reason.BAD_RTC_DELAY),
], check=_delay_within_prefix)

HISTORY_FRAME = Record(HistoryFrame, [
    Field("state", NdArray(1, "fiu", reason=Reason.BAD_HISTORY), required=True),
    Field("images", JPEGS, required=True),
], reason=Reason.BAD_HISTORY)

_SEGMENT_CHARS = frozenset("0123456789abcdef-lz")


def _frames_in_bounds(shared: SharedFrames, name: str, limits: CodecLimits) -> None:
    if not shared.segment or not set(shared.segment) <= _SEGMENT_CHARS:
        raise ProtocolError(Reason.BAD_SHARED_FRAMES, f"{name}.segment must be a client's frame-file name")
    for camera, (offset, h, w) in shared.frames.items():
        if offset < 16 or h <= 0 or w <= 0 or h * w > limits.max_image_pixels or offset > 2**40:
            raise ProtocolError(Reason.BAD_SHARED_FRAMES, f"{camera}: offset {offset}, {h}x{w} out of bounds"[:200])


SHARED_FRAMES = Record(SharedFrames, [
    Field("segment", Str(64), required=True),
    Field("generation", Int(1), required=True),
    Field("frames", MapOf(Tuple(Int(None, None), Int(None, None), Int(None, None)), 1, 64), required=True),
], check=_frames_in_bounds)

OBSERVATION = Record(Observation, [
    Field("seq_id", UINT64, required=True),
    Field("client_uuid", STR, required=True),
    Field("state", NdArray(1, "fiu", reason=Reason.BAD_STATE), required=True),
    Field("images", JPEGS, required=True),
    Field("task", Str(max_bytes=MAX_TASK_BYTES, reason=Reason.TASK_TOO_LONG)),
    Field("episode_id", STR),
    Field("session_nonce", UINT64),
    Field("execution", EXECUTION_INFO),
    Field("history", ListOf(HISTORY_FRAME, MAX_HISTORY_FRAMES, Reason.BAD_HISTORY), sparse=True),
    Field("rtc", RTC_INPUTS),
    Field("shared_frames", SHARED_FRAMES, reason=Reason.BAD_SHARED_FRAMES),
    Field("refreshes_seq_id", UINT64),
    Field("component_mask", COMPONENT_MASK),
    Field("refusals", BOOL, sparse=True),
])

ACTION_CHUNK = Record(ActionChunk, [
    Field("response_to_seq_id", UINT64, required=True),
    Field("inference_time_ms", NUMBER, required=True),
    Field("actions", NdArray(2, "f", reason=Reason.BAD_ACTIONS), required=True),
    Field("server_id", STR),
    Field("queue_time_ms", NUMBER),
    Field("execution_horizon", UINT64),
    Field("rtc_delay_steps", UINT64),
    Field("engine_id", STR),
    Field("tier", STR),
])

STATUS = Record(Status, [
    Field("model_id", STR, required=True),
    Field("model_version", STR, required=True),
    Field("expected_cameras", MapOf(Tuple(Int(1), Int(1))), required=True),  # name -> [height, width]
    Field("action_dim", UINT64, required=True),
    Field("max_actions_per_chunk", UINT64, required=True),
    Field("observation_features", MapOf(AnyMap()), required=True),
    Field("policy_type", STR),
    Field("fps", UINT64),
    Field("server_id", STR),
    Field("state_dim", UINT64),
    Field("action_names", ListOf(STR)),
    Field("accepts_unknown_clients", BOOL),
    Field("client_admitted", BOOL),
    Field("chunk_size", UINT64),
    Field("reads_task", BOOL),
    Field("history_length", UINT64),
    Field("rtc", Record(RtcAdvert, [Field("execution_horizon", Int(1))])),
    Field("same_host", Record(SameHostAdvert, [Field("probe", Str(64), required=True),
                                               Field("token", Str(64), required=True)])),
    Field("output", Str(choices=OutputKind)),
    Field("refreshes", BOOL),
    Field("streams_text", BOOL),
    Field("max_task_tokens", UINT64),
    Field("task_tokens", UINT64),
    Field("refusals", BOOL),
])

TELEMETRY = Record(Telemetry, [
    Field("source", STR, required=True),
    Field("source_id", STR, required=True),
    Field("seq", UINT64, required=True),
    Field("uptime_s", NUMBER, required=True),
    Field("period_s", NUMBER, required=True),
    Field("metrics", NUMBERS),
    Field("per_client", MapOf(NUMBERS)),
    Field("labels", MapOf(STR)),
])

TEXT_RESULT = Record(TextResult, [
    Field("response_to_seq_id", UINT64, required=True),
    Field("text", STR, required=True),
    Field("inference_time_ms", NUMBER, required=True),
    Field("server_id", STR),
    Field("queue_time_ms", NUMBER),
    Field("partial", BOOL, sparse=True),
])

VERDICT = Record(Verdict, [
    Field("response_to_seq_id", UINT64, required=True),
    Field("label", Str(choices=VerdictLabel, reason=Reason.BAD_VERDICT), required=True),
    Field("inference_time_ms", NUMBER, required=True),
    Field("score", Number(0.0, 1.0, Reason.BAD_VERDICT)),
    Field("server_id", STR),
    Field("queue_time_ms", NUMBER),
])
REFUSAL = Record(Refusal, [
    Field("response_to_seq_id", UINT64, required=True),
    Field("reason", Str(64), required=True),
    Field("detail", Str(max_bytes=MAX_REFUSAL_DETAIL_BYTES)),
    Field("permanent", BOOL, sparse=True),
    Field("server_id", STR),

], since=5)
