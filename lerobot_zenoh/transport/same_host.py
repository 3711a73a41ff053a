"""The same-host path: raw camera frames in bounded POSIX shared-memory files (docs/protocol.md §7.1).

When robot client and server run on one machine, JPEG is pure cost. The client then writes each
observation's raw RGB frames into one of a fixed ring of files in ``/dev/shm`` that it owns, and the
observation (still sent over Zenoh) names the file, a generation number and where each frame lies.
The server copies the frames out with ``pread`` and closes the file at once.

Why files read with ``pread`` and not ``mmap`` (nor Zenoh's implicit shared memory, which leaks a
16 MiB segment per session in eclipse-zenoh 1.10.2, see FACTS.md): a mapping of a file that another
process truncates raises SIGBUS in the reader, which kills a Python process. ``pread`` of a file that
shrank returns fewer bytes: a counted rejection. Neither side maps anything, so nothing of the other
side's stays in a process's memory, and the server holds a file descriptor only while it copies.

Same host is proved, not assumed: the server writes a random token into a probe file of its own in
``/dev/shm`` and advertises the file's name and the token in its status; a client uses the path only
if it can read that file, owned by its own user, and finds the token (so one ``/dev/shm``, one user:
a container with its own ``/dev/shm`` or another user fails the check and stays on JPEG).

File layout: a 16-byte header ``b"LZF1"``, 4 zero bytes, the generation as little-endian uint64, then
the frames (RGB uint8, C order) at the offsets the observation gives. A writer sets the generation to
0, writes the frames, then writes the new generation (never 0, increasing); a reader checks the
generation before and after copying, so a frame overwritten while it was read is a rejection
(``shm_stale``), never a torn image.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import struct
from collections.abc import Mapping

import numpy as np

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.messages import SameHostAdvert, SharedFrames

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_RE = re.compile(r"lz-([0-9]{1,10})-[0-9a-f]{32}-[0-9]{1,2}")  # lz-<pid>-<random>-<slot>
PROBE_RE = re.compile(r"lz-probe-([0-9]{1,10})-[0-9a-f]{32}")  # lz-probe-<pid>-<random>
MAGIC = b"LZF1"
HEADER = struct.Struct("<4s4xQ")
MAX_SLOTS = 16
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


# ----------------------------------------------------------------------------- server side


class Probe:
    """The server's proof of host: a token in a file of its own. `advert` is fixed at construction
    (no I/O); `create()` writes the file, `close()` removes it."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.advert = SameHostAdvert(probe=f"lz-probe-{os.getpid()}-{secrets.token_hex(16)}", token=secrets.token_hex(16))
        self.path = os.path.join(directory, self.advert.probe)
        self.created = False

    def create(self) -> bool:
        """Write the probe file; False (and a log line) if this host's shared memory is not usable.

        Also removes the files that processes of this user which died without cleaning up left
        behind (a killed server's probe, a crashed client's frame files): their names carry the pid.
        """
        remove_orphans(self.directory)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, self.advert.token.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.info("same-host path off: cannot write %s (%s)", self.path, exc)
            return False
        self.created = True
        return True

    def close(self) -> None:
        if self.created:
            self.created = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def remove_orphans(directory: str = SHM_DIR) -> int:
    """Remove probe and frame files of this user whose process (the pid in the name) is gone; how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = PROBE_RE.fullmatch(name) or SEGMENT_RE.fullmatch(name)
        if m is None or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed


def read_frames(ref: SharedFrames, expected: Mapping[str, tuple[int, int]], directory: str = SHM_DIR) -> dict[str, np.ndarray]:
    """Copy the referenced frames out (one copy each, into arrays the caller owns) and close the file.

    ProtocolError, counted by the server as a rejection of this observation: ``shm_gone`` (no such
    file), ``shm_unreadable`` (not ours or not readable), ``shm_truncated`` (shorter than the frames),
    ``shm_stale`` (overwritten before or while it was read), ``wrong_cameras``/``wrong_image_shape``.
    """
    if set(ref.frames) != set(expected):
        raise ProtocolError("wrong_cameras", f"shared frames for {sorted(ref.frames)}, expected {sorted(expected)}")
    for name, (_, h, w) in ref.frames.items():
        if (h, w) != tuple(expected[name]):
            raise ProtocolError("wrong_image_shape", f"{name}: {h}x{w}, expected {expected[name][0]}x{expected[name][1]}")
    if not SEGMENT_RE.fullmatch(ref.segment):
        raise ProtocolError("bad_shared_frames", "segment name is not one a client makes")
    try:
        fd = os.open(os.path.join(directory, ref.segment), _OPEN_FLAGS)
    except FileNotFoundError as exc:
        raise ProtocolError("shm_gone", f"{ref.segment} no longer exists") from exc
    except OSError as exc:
        raise ProtocolError("shm_unreadable", f"{ref.segment}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise ProtocolError("shm_unreadable", f"{ref.segment} belongs to another user")
        end = max(offset + h * w * 3 for offset, h, w in ref.frames.values())
        if st.st_size < end:
            raise ProtocolError("shm_truncated", f"{ref.segment} holds {st.st_size} bytes, frames need {end}")
        _check_generation(fd, ref)
        out = {}
        for name, (offset, h, w) in ref.frames.items():
            frame = np.empty((h, w, 3), np.uint8)
            if os.preadv(fd, [frame], offset) != frame.nbytes:
                raise ProtocolError("shm_truncated", f"{ref.segment} shrank while {name} was read")
            out[name] = frame
        _check_generation(fd, ref)
        return out
    except OSError as exc:
        raise ProtocolError("shm_unreadable", f"{ref.segment}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _check_generation(fd: int, ref: SharedFrames) -> None:
    head = os.pread(fd, HEADER.size, 0)
    if len(head) != HEADER.size:
        raise ProtocolError("shm_truncated", f"{ref.segment} has no header")
    magic, generation = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError("bad_shared_frames", f"{ref.segment} is not a frame file")
    if generation != ref.generation:
        raise ProtocolError("shm_stale", f"{ref.segment} was overwritten (generation {generation}, "
                                         f"expected {ref.generation})")


# ----------------------------------------------------------------------------- client side


def probe_ok(advert: SameHostAdvert | None, directory: str = SHM_DIR) -> bool:
    """Whether the server that sent `advert` shares this process's /dev/shm and user."""
    if advert is None or not PROBE_RE.fullmatch(advert.probe):
        return False
    try:
        fd = os.open(os.path.join(directory, advert.probe), _OPEN_FLAGS)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return False
        return os.pread(fd, 64, 0) == advert.token.encode()
    except OSError:
        return False
    finally:
        os.close(fd)


class FrameRing:
    """A fixed ring of `slots` files in /dev/shm, owned (created, written, removed) by one client.

    Bounded: at most `slots` files of one observation's frames each. Files are created on first use
    and removed by `close()`. `write` raises OSError when shared memory stops working; the caller
    falls back to JPEG.
    """

    def __init__(self, slots: int = 4, directory: str = SHM_DIR):
        if not 2 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 2..{MAX_SLOTS}, got {slots}")
        self.directory = directory
        self.slots = slots
        self._stem = f"lz-{os.getpid()}-{secrets.token_hex(16)}"
        self._fds: list[int | None] = [None] * slots
        self._sizes = [0] * slots
        self._next = 0
        self._generation = 0

    def names(self) -> list[str]:
        return [f"{self._stem}-{i}" for i in range(self.slots)]

    def write(self, frames: Mapping[str, np.ndarray]) -> SharedFrames:
        """Write RGB uint8 (H, W, 3) frames into the next slot; what the observation should carry."""
        slot = self._next
        self._next = (slot + 1) % self.slots
        self._generation += 1
        layout, offset, arrays = {}, HEADER.size, []
        for name, image in frames.items():
            arr = np.ascontiguousarray(image)
            if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
                raise ValueError(f"{name}: expected uint8 (H, W, 3), got {arr.dtype} {arr.shape}")
            layout[name] = (offset, arr.shape[0], arr.shape[1])
            offset += arr.nbytes
            arrays.append(arr)
        fd = self._fds[slot]
        name = f"{self._stem}-{slot}"
        if fd is None:
            fd = os.open(os.path.join(self.directory, name),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self._fds[slot] = fd
        if self._sizes[slot] != offset:
            os.ftruncate(fd, offset)
            self._sizes[slot] = offset
        os.pwrite(fd, HEADER.pack(MAGIC, 0), 0)  # busy: a reader now sees a stale generation
        if os.pwritev(fd, arrays, HEADER.size) != offset - HEADER.size:
            raise OSError("short write to shared memory")
        os.pwrite(fd, HEADER.pack(MAGIC, self._generation), 0)
        return SharedFrames(segment=name, generation=self._generation, frames=layout)

    def close(self) -> None:
        for i, fd in enumerate(self._fds):
            if fd is None:
                continue
            self._fds[i] = None
            try:
                os.close(fd)
            except OSError:
                pass
            try:
                os.unlink(os.path.join(self.directory, f"{self._stem}-{i}"))
            except OSError:
                pass
