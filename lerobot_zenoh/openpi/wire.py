"""OpenPI's wire format: MessagePack maps whose numpy arrays travel as ``{"__ndarray__": True, "data",
"dtype", "shape"}`` (and numpy scalars as ``{"__npgeneric__": True, "data", "dtype"}``), as
``openpi_client.msgpack_numpy`` writes them.

The decoder here never builds an object array and never unpickles: a dtype is accepted only when its
string is a plain little/big-endian bool, integer or float type (``<f4``, ``|u1``, ...), checked as
a string before numpy sees it; the bytes must be exactly shape x itemsize; extension types, deep
nesting and oversized containers are refused. Every failure is one ``ProtocolError`` whose reason
is an :class:`OpenPIReason` (a counter of the front door and the text its client reads).
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
MAX_STR_BYTES = 64 * 1024


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


def _hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        return _scalar(obj)
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


def unpack(data: bytes, max_bytes: int) -> dict:
    """One OpenPI request frame -> a dict (string keys; arrays as read-only numpy views of `data`)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(OpenPIReason.NOT_BINARY, "send the observation as a binary msgpack frame")
    if len(data) > max_bytes:
        raise ProtocolError(OpenPIReason.TOO_LARGE, f"{len(data)} bytes, the limit is {max_bytes}")
    try:
        obj = msgpack.unpackb(
            bytes(data), raw=False, object_hook=_hook, ext_hook=_refuse_ext, strict_map_key=False,
            use_list=True, max_str_len=MAX_STR_BYTES, max_bin_len=max_bytes, max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_CONTAINER_LEN, max_ext_len=0)
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
