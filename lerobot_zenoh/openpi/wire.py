"""OpenPI's wire format: MessagePack maps whose numpy arrays travel as ``{"__ndarray__": True, "data",
"dtype", "shape"}`` (and numpy scalars as ``{"__npgeneric__": True, "data", "dtype"}``), as
``openpi_client.msgpack_numpy`` writes them.

The decoder here never builds an object array and never unpickles: a dtype is accepted only when its
string is a plain little/big-endian bool, integer or float type (``<f4``, ``|u1``, ...), checked as
a string before numpy sees it; the bytes must be exactly shape x itemsize; extension types, deep
nesting and oversized containers are refused. Every failure is one ``ProtocolError`` whose reason
is an :class:`OpenPIReason` (a counter of the front door and the text its client reads).

Bytes are not the cost of a frame: 16 MiB of nested empty maps and lists decode to tens of millions
of Python objects (gigabytes, tens of seconds), and msgpack allocates a container as soon as it
reads its header (an array header claiming 4,096 entries is a 32 KB list before one entry is read:
3 KB of nested array headers cost 33 MB). So before msgpack sees a frame, `screen` walks its
headers only (type bytes and lengths; string and binary payloads are skipped, never copied) and
refuses it, having allocated nothing, when it holds more than `max_items` map and array entries in
all, a container over ``MAX_CONTAINER_LEN`` entries, nesting deeper than ``MAX_DEPTH``, an extension
type, or lengths that run past its end. Its cost is bounded by `max_items` values, whatever the
frame's size; a real request is a few arrays and a prompt: tens of entries.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np

from lerobot_zenoh.errors import ProtocolError

__all__ = ["OpenPIReason", "pack", "screen", "unpack"]


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


def _on_map(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        return _scalar(obj)
    return obj


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(OpenPIReason.BAD_MSGPACK, f"msgpack extension type {code} refused")


#: Fixed-size msgpack values: type byte -> bytes after it (nil, bools, floats, ints).
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
#: str and bin with a length: type byte -> bytes of the length.
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
#: arrays and maps with a length: type byte -> (bytes of the length, values per entry).
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def screen(data: bytes, max_items: int = MAX_FRAME_ITEMS) -> None:
    """Refuse (`ProtocolError`) a frame whose structure would cost more than its budget to decode,
    reading its headers only: at most `max_items` map and array entries in all (a container counts
    one more), at most ``MAX_CONTAINER_LEN`` in one, nesting at most ``MAX_DEPTH`` deep (the
    top-level map is depth 1), no extension type, every length within the frame and nothing after
    its one value. Allocates nothing that grows with the frame; walks at most `max_items` + 1 values."""
    n, pos, items = len(data), 0, 0
    left = [1]  # values still to read in each open container (the frame itself: one)
    while left:
        if left[-1] == 0:
            left.pop()
            continue
        left[-1] -= 1
        if pos >= n:
            raise ProtocolError(OpenPIReason.BAD_MSGPACK, "not a msgpack frame (it ends inside a value)")
        b = data[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0:  # fixints
            continue
        if b <= 0x9F:  # fixmap, fixarray
            count, per = (b & 0x0F, 2) if b <= 0x8F else (b & 0x0F, 1)
        elif b <= 0xBF:  # fixstr
            pos += b & 0x1F
            continue
        elif (size := _FIXED.get(b)) is not None:
            pos += size
            continue
        elif (size := _SIZED.get(b)) is not None:
            pos += size + int.from_bytes(data[pos:pos + size], "big")
            continue
        elif (shape := _CONTAINERS.get(b)) is not None:
            size, per = shape
            count = int.from_bytes(data[pos:pos + size], "big")
            pos += size
        else:  # 0xC1 (never used) and the extension types
            raise ProtocolError(OpenPIReason.BAD_MSGPACK, f"msgpack type 0x{b:02x} refused (extension types "
                                "are never decoded)")
        if count > MAX_CONTAINER_LEN:
            raise ProtocolError(OpenPIReason.TOO_MANY_ITEMS, f"a container of {count} entries (at most "
                                f"{MAX_CONTAINER_LEN})")
        items += count + 1
        if items > max_items:
            raise ProtocolError(OpenPIReason.TOO_MANY_ITEMS, f"the frame holds more than {max_items} map and array "
                                "entries (a request is a few arrays and a prompt)")
        if len(left) > MAX_DEPTH:
            raise ProtocolError(OpenPIReason.TOO_DEEP, f"nested deeper than {MAX_DEPTH}")
        left.append(count * per)
    if pos != n:
        raise ProtocolError(OpenPIReason.BAD_MSGPACK, "not a msgpack frame (" + (
            "it ends inside a value)" if pos > n else f"{n - pos} bytes after its value)"))


def unpack(data: bytes, max_bytes: int, max_items: int = MAX_FRAME_ITEMS) -> dict:
    """One OpenPI request frame -> a dict (string keys; arrays as read-only numpy views of `data`),
    `screen`ed first: msgpack only ever builds what the budget allows. Strings may be as long as the
    frame: a prompt too long for the fleet is refused by the mapping, with the fleet's own reason
    (task_too_long), not as unreadable msgpack."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(OpenPIReason.NOT_BINARY, "send the observation as a binary msgpack frame")
    if len(data) > max_bytes:
        raise ProtocolError(OpenPIReason.TOO_LARGE, f"{len(data)} bytes, the limit is {max_bytes}")
    data = bytes(data)
    screen(data, max_items)
    failure = None
    try:
        obj = msgpack.unpackb(
            data, raw=False, object_hook=_on_map, ext_hook=_refuse_ext, strict_map_key=False, use_list=True,
            max_str_len=max_bytes, max_bin_len=max_bytes, max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_CONTAINER_LEN, max_ext_len=0)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack's own errors (a screened frame's invalid UTF-8, ...)
        failure = f"not a msgpack frame ({type(exc).__name__}: {exc})"
    if failure is not None:  # raised here: an exception bound in this frame would keep `data` alive in a cycle
        raise ProtocolError(OpenPIReason.BAD_MSGPACK, failure)
    if not isinstance(obj, dict):
        raise ProtocolError(OpenPIReason.NOT_A_MAP, f"the observation must be a map, got {type(obj).__name__}")
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
