"""OpenPI's wire format: MessagePack maps whose numpy arrays travel as ``{"__ndarray__": True, "data",
"dtype", "shape"}`` (and numpy scalars as ``{"__npgeneric__": True, "data", "dtype"}``), as
``openpi_client.msgpack_numpy`` writes them.

The decoder here never builds an object array and never unpickles: a dtype is accepted only when its
string is a plain little/big-endian bool, integer or float type (``<f4``, ``|u1``, ...), checked as
a string before numpy sees it; the bytes must be exactly shape x itemsize; extension types, deep
nesting and oversized containers are refused. Every failure is one ``ProtocolError`` whose reason
is an :class:`OpenPIReason` (a counter of the front door and the text its client reads).

Bytes are not the cost of a frame: 16 MiB of nested empty maps and lists decode to tens of millions
of Python objects (gigabytes, tens of seconds). So the decoder counts, as msgpack's C code hands
each map and array over (``object_hook``/``list_hook``, called as each one is complete), the
entries of every container it has built, and gives up past `max_items` before anything else is
allocated: a frame costs at most its bytes plus `max_items` objects (plus the one container being
filled, at most ``MAX_CONTAINER_LEN`` entries per level of nesting) whatever its shape. A real
request is a few arrays and a prompt: tens of entries.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np

from lerobot_zenoh.errors import ProtocolError

__all__ = ["OpenPIReason", "pack", "unpack"]


class OpenPIReason(StrEnum):
    """Why the front door refused a request (counted as ``rejected.<reason>``; docs/openpi.md)."""

    NOT_BINARY = "not_binary"  # a text frame where a msgpack frame belongs
    TOO_LARGE = "too_large"  # over the message-size limit (the websocket closes with 1009)
    BAD_MSGPACK = "bad_msgpack"
    TOO_DEEP = "too_deep"
    TOO_MANY_ITEMS = "too_many_items"  # more map and array entries than `max_frame_items`
    NOT_A_MAP = "not_a_map"
    BAD_ARRAY = "bad_array"
    BAD_DTYPE = "bad_dtype"  # object, void, complex, string or structured arrays: never decoded
    SIZE_MISMATCH = "size_mismatch"
    UNKNOWN_KEY = "unknown_key"
    MISSING_KEY = "missing_key"
    BAD_STATE = "bad_state"
    WRONG_IMAGE_SHAPE = "wrong_image_shape"
    BAD_PROMPT = "bad_prompt"
    RATE_LIMITED = "rate_limited"
    UNANSWERED = "unanswered"  # the fleet gave no chunk within the request time-out
    SERVER_ERROR = "server_error"  # a chunk the front door could not use


#: ``<byte order><kind><size>``: bool, signed, unsigned or float. Nothing else is ever handed to numpy.
_DTYPE = re.compile(r"^[<>|=]?(b1|[iu][1248]|f[248])$")
#: A numpy scalar may also be a string (``np.str_``), which decodes to a Python str.
_SCALAR_STR = re.compile(r"^[<>|=]?U\d{1,6}$")
MAX_DEPTH = 8
MAX_NDIM = 4
MAX_CONTAINER_LEN = 4096
#: Map and array entries one frame may hold in all (a request holds tens).
MAX_FRAME_ITEMS = 16384


def _array(obj: dict) -> np.ndarray:
    dtype, shape, data = obj.get(b"dtype"), obj.get(b"shape"), obj.get(b"data")
    if isinstance(dtype, bytes):
        dtype = dtype.decode("ascii", "replace")
    if not isinstance(dtype, str) or not _DTYPE.match(dtype):
        raise ProtocolError(OpenPIReason.BAD_DTYPE, f"array dtype {dtype!r} refused: only bool, int, uint and float "
                            "arrays are accepted (never object or pickled data)")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(type(n) is int and 0 <= n < 2**31 for n in shape)):
        raise ProtocolError(OpenPIReason.BAD_ARRAY, f"array shape {shape!r} is not a list of at most {MAX_NDIM} sizes")
    if not isinstance(data, bytes):
        raise ProtocolError(OpenPIReason.BAD_ARRAY, "array data is not bytes")
    dt = np.dtype(dtype)
    if math.prod(shape) * dt.itemsize != len(data):
        raise ProtocolError(OpenPIReason.SIZE_MISMATCH, f"array of shape {tuple(shape)} and dtype {dtype} needs "
                            f"{math.prod(shape) * dt.itemsize} bytes, got {len(data)}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def _scalar(obj: dict) -> Any:
    dtype, data = obj.get(b"dtype"), obj.get(b"data")
    if isinstance(dtype, bytes):
        dtype = dtype.decode("ascii", "replace")
    if isinstance(dtype, str) and _SCALAR_STR.match(dtype) and isinstance(data, str):
        return data
    if not isinstance(dtype, str) or not _DTYPE.match(dtype) or not isinstance(data, (bool, int, float)):
        raise ProtocolError(OpenPIReason.BAD_DTYPE, f"numpy scalar of dtype {dtype!r} refused")
    try:
        return np.dtype(dtype).type(data)
    except (OverflowError, ValueError) as exc:
        raise ProtocolError(OpenPIReason.BAD_ARRAY, f"numpy scalar {data!r} does not fit {dtype}") from exc


class _Budget:
    """The object and list hooks of one decode: count every container's entries as it is complete."""

    def __init__(self, max_items: int):
        self.left = max_items

    def _spend(self, n: int) -> None:
        self.left -= n + 1
        if self.left < 0:
            raise ProtocolError(OpenPIReason.TOO_MANY_ITEMS, "the frame holds more map and array entries than the "
                                "front door decodes (a request is a few arrays and a prompt)")

    def on_map(self, obj: dict) -> Any:
        self._spend(len(obj))
        if b"__ndarray__" in obj:
            return _array(obj)
        if b"__npgeneric__" in obj:
            return _scalar(obj)
        return obj

    def on_list(self, obj: list) -> list:
        self._spend(len(obj))
        return obj


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(OpenPIReason.BAD_MSGPACK, f"msgpack extension type {code} refused")


def _depth(obj: Any, left: int) -> bool:
    if left < 0:
        return False
    if isinstance(obj, dict):
        return all(_depth(v, left - 1) for v in obj.values())
    if isinstance(obj, list):
        return all(_depth(v, left - 1) for v in obj)
    return True


def unpack(data: bytes, max_bytes: int, max_items: int = MAX_FRAME_ITEMS) -> dict:
    """One OpenPI request frame -> a dict (string keys; arrays as read-only numpy views of `data`).
    Strings may be as long as the frame: a prompt too long for the fleet is refused by the mapping,
    with the fleet's own reason (task_too_long), not as unreadable msgpack."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(OpenPIReason.NOT_BINARY, "send the observation as a binary msgpack frame")
    if len(data) > max_bytes:
        raise ProtocolError(OpenPIReason.TOO_LARGE, f"{len(data)} bytes, the limit is {max_bytes}")
    try:
        budget = _Budget(max_items)
        obj = msgpack.unpackb(
            bytes(data), raw=False, object_hook=budget.on_map, list_hook=budget.on_list, ext_hook=_refuse_ext,
            strict_map_key=False, use_list=True, max_str_len=max_bytes, max_bin_len=max_bytes,
            max_array_len=MAX_CONTAINER_LEN, max_map_len=MAX_CONTAINER_LEN, max_ext_len=0)
    except ProtocolError:
        raise
    except RecursionError as exc:
        raise ProtocolError(OpenPIReason.TOO_DEEP, f"nested deeper than {MAX_DEPTH}") from exc
    except Exception as exc:  # msgpack's own errors: ExtraData, FormatError, StackError, ValueError, ...
        raise ProtocolError(OpenPIReason.BAD_MSGPACK, f"not a msgpack frame ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(OpenPIReason.NOT_A_MAP, f"the observation must be a map, got {type(obj).__name__}")
    if not _depth(obj, MAX_DEPTH):
        raise ProtocolError(OpenPIReason.TOO_DEEP, f"nested deeper than {MAX_DEPTH}")
    if not all(isinstance(k, str) for k in obj):
        raise ProtocolError(OpenPIReason.NOT_A_MAP, "observation keys must be strings")
    return obj


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if not _DTYPE.match(obj.dtype.str):
            raise TypeError(f"cannot send a {obj.dtype} array")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def pack(obj: dict) -> bytes:
    """A reply (or the metadata) as OpenPI's client reads it."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)
