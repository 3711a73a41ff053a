"""The same-host path: raw camera frames in a sealed, pre-mapped shared-memory ring (docs/protocol.md §7.1).

When robot client and server run on one machine, JPEG is pure cost. The client then keeps a ring of
frame slots in one ``memfd`` that it maps once and writes each observation's raw RGB frames straight
into; the observation (still sent over Zenoh) names the ring, a generation number and where each
frame lies. The server maps the same ``memfd`` once (read-only) and hands the model *views* of the
mapping: no copy on either side but the client's one copy of the camera frame into the ring, and no
system call per observation but one ``stat``.

Safety, the reason for every choice below:

- **No SIGBUS.** A mapping of a file that another process shrinks raises SIGBUS in whoever touches
  the lost pages, which kills a Python process. The ring is a ``memfd`` sealed with
  ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` before anyone maps it: nobody, its owner included,
  can shrink it afterwards (``ftruncate`` fails with EPERM), and the server maps it only after
  checking the seals itself. Its pages are allocated up front (``posix_fallocate``), so a write into
  the mapping never faults for memory either.
- **Found by name, checked by identity.** A ``memfd`` has no path. The client writes a small pointer
  file ``/dev/shm/<segment>`` (mode 0600: magic ``LZM1``, the ring's fd number in the client, its
  size); the server opens ``/proc/<pid>/fd/<fd>`` (``O_NONBLOCK``: a FIFO there cannot block it) and
  uses it only if it is a regular file of its own user named ``memfd:<segment>`` (the name carries
  32 random hex digits) with the seals set. The pointer file is what the client removes when it
  stops: a ring whose pointer file is gone is ``shm_gone``.
- **Torn frames are rejected, not served.** Each slot starts with a header ``LZF2``, 4 zero bytes,
  a generation (little-endian uint64). The writer sets the generation to 0, writes the frames, then
  writes the new generation (never 0, increasing); the server checks it when it takes the views
  (`FrameReader.read`) and again after the model has read them (`FrameReader.current`): a slot
  rewritten in between (the server more than `slots` observations behind) is ``shm_stale``.
- **Bounded on both sides.** The client's ring is `slots` slots of one observation each, in one
  memfd. The server keeps at most `max_mappings` rings mapped, and unmaps one whose pointer file is
  gone, whose process is gone or that was not read for `idle_s`, at the latest on the next read
  (views still held by a request keep their pages until that request is done; nothing else does).

Same host is proved, not assumed: the server writes a random token into a probe file of its own in
``/dev/shm``, keeps the file open and advertises its name and the token in its status. The probe file
holds ``<token>\\nfd <n>\\n``, n being the server's fd of that file. A client uses the path only if it
can read that file, owned by its own user, finds the token, and ``/proc/<server pid>/fd/<n>`` is that
same file: one ``/dev/shm``, one user, one pid namespace, and ``/proc/<pid>/fd`` open to the other
process (which the server needs to map the client's ring).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.protocol.messages import SameHostAdvert, SharedFrames

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_RE = re.compile(r"lz-([0-9]{1,10})-[0-9a-f]{32}-[0-9]{1,2}")  # lz-<pid>-<random>-<ring>
PROBE_RE = re.compile(r"lz-probe-([0-9]{1,10})-[0-9a-f]{32}")  # lz-probe-<pid>-<random>
POINTER = struct.Struct("<4s4xQQ")  # b"LZM1", fd of the ring in the writer, ring size in bytes
POINTER_MAGIC = b"LZM1"
HEADER = struct.Struct("<4s4xQ")  # per slot: b"LZF2", generation
MAGIC = b"LZF2"
MAX_SLOTS = 16
ORPHAN_SWEEP_S = 60.0  # how often a reading server removes the files of dead clients
SLOT_ALIGN = 4096  # slots start on page boundaries
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_RING_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # no O_NOFOLLOW: /proc/<pid>/fd/<n> is a link


# ----------------------------------------------------------------------------- server side


class Probe:
    """The server's proof of host: a token in a file of its own, kept open while the server runs.
    `advert` is fixed at construction (no I/O); `create()` writes the file, `close()` removes it."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.advert = SameHostAdvert(probe=f"lz-probe-{os.getpid()}-{secrets.token_hex(16)}", token=secrets.token_hex(16))
        self.path = os.path.join(directory, self.advert.probe)
        self._fd: int | None = None

    def create(self) -> bool:
        """Write the probe file; False (and a log line) if this host's shared memory is not usable.

        Also removes the files that processes of this user which died without cleaning up left
        behind (a killed server's probe, a crashed client's pointer files): their names carry the pid.
        """
        remove_orphans(self.directory)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.info("same-host path off: cannot write %s (%s)", self.path, exc)
            return False
        try:
            os.write(fd, f"{self.advert.token}\nfd {fd}\n".encode())
        except OSError as exc:
            os.close(fd)
            self._unlink()
            log.info("same-host path off: cannot write %s (%s)", self.path, exc)
            return False
        self._fd = fd
        return True

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def remove_orphans(directory: str = SHM_DIR) -> int:
    """Remove probe and pointer files of this user whose process (the pid in the name) is gone; how many."""
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


class _Mapped:
    """One client ring mapped read-only in the server."""

    __slots__ = ("segment", "pid", "pointer", "buffer", "size", "used_s")

    def __init__(self, segment: str, pid: int, pointer: os.stat_result, buffer: mmap.mmap, size: int):
        self.segment, self.pid, self.pointer, self.buffer, self.size = segment, pid, pointer, buffer, size
        self.used_s = time.monotonic()


class FrameReader:
    """The server's side: maps each client ring once and returns views of its frames.

    `read` checks the observation's frames and returns read-only (H, W, 3) uint8 views into the
    client's ring; `current` says whether those frames are still the ones read (call it after the
    model has read them: a slot the client rewrote meanwhile is ``shm_stale``). Thread-safe; the
    server calls it from its inference thread.
    """

    def __init__(self, *, max_mappings: int = 64, idle_s: float = 10.0, directory: str = SHM_DIR):
        if max_mappings < 1:
            raise ValueError(f"max_mappings must be >= 1, got {max_mappings}")
        self.directory = directory
        self.max_mappings = max_mappings
        self.idle_s = idle_s
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._swept_s = time.monotonic()
        self._orphans_swept_s = 0.0  # the first sweep also removes files of dead processes
        self.mapped_total = 0  # rings mapped so far (a mapping is reused for every later observation)
        self.orphans_removed = 0  # pointer files of clients that died without removing them

    def __len__(self) -> int:
        return len(self._maps)

    def read(self, ref: SharedFrames, expected: Mapping[str, tuple[int, int]]) -> dict[str, np.ndarray]:
        """Read-only views of the referenced frames; ProtocolError (a counted rejection of this observation):

        ``shm_gone`` (the ring's pointer file or its process is gone), ``shm_unreadable`` (not ours,
        not a sealed ring, cannot be opened), ``shm_truncated`` (the ring is shorter than its frames),
        ``shm_stale`` (the slot was rewritten, or is being written), ``bad_shared_frames`` (malformed
        name, pointer or slot header), ``wrong_cameras``/``wrong_image_shape``.
        """
        if set(ref.frames) != set(expected):
            raise ProtocolError(Reason.WRONG_CAMERAS, f"shared frames for {sorted(ref.frames)}, expected {sorted(expected)}")
        for name, (_, h, w) in ref.frames.items():
            if (h, w) != tuple(expected[name]):
                raise ProtocolError(Reason.WRONG_IMAGE_SHAPE, f"{name}: {h}x{w}, expected {expected[name][0]}x{expected[name][1]}")
        m = SEGMENT_RE.fullmatch(ref.segment)
        if m is None:
            raise ProtocolError(Reason.BAD_SHARED_FRAMES, "segment name is not one a client makes")
        start = min(offset for offset, _, _ in ref.frames.values()) - HEADER.size
        end = max(offset + h * w * 3 for offset, h, w in ref.frames.values())
        if start < 0:
            raise ProtocolError(Reason.BAD_SHARED_FRAMES, "frames start inside the slot header")
        with self._lock:
            mapped = self._mapping(ref.segment, int(m.group(1)))
            if mapped.size < end:
                raise ProtocolError(Reason.SHM_TRUNCATED, f"{ref.segment} holds {mapped.size} bytes, frames need {end}")
            self._check(mapped, start, ref)
            buf = mapped.buffer
        return {name: np.frombuffer(buf, np.uint8, h * w * 3, offset).reshape(h, w, 3)
                for name, (offset, h, w) in ref.frames.items()}

    def current(self, ref: SharedFrames) -> bool:
        """Whether the slot of `ref` still holds generation `ref.generation` (no system call)."""
        start = min(offset for offset, _, _ in ref.frames.values()) - HEADER.size
        with self._lock:
            mapped = self._maps.get(ref.segment)
            buf = mapped.buffer if mapped is not None else None
        if buf is None:  # evicted meanwhile: views held by requests keep the pages, but say stale
            return False
        magic, generation = HEADER.unpack_from(buf, start)
        return magic == MAGIC and generation == ref.generation

    def close(self) -> None:
        """Forget every mapping (views still held keep theirs until they are dropped)."""
        with self._lock:
            self._maps.clear()

    # -- internals (under the lock) --------------------------------------------------------------

    def _check(self, mapped: _Mapped, start: int, ref: SharedFrames) -> None:
        magic, generation = HEADER.unpack_from(mapped.buffer, start)
        if magic != MAGIC:
            raise ProtocolError(Reason.BAD_SHARED_FRAMES, f"{ref.segment} has no slot header at {start}")
        if generation != ref.generation:
            raise ProtocolError(Reason.SHM_STALE, f"{ref.segment} was overwritten (generation {generation}, "
                                             f"expected {ref.generation})")

    def _mapping(self, segment: str, pid: int) -> _Mapped:
        now = time.monotonic()
        if now - self._swept_s > 1.0:
            self._sweep(now)
        path = os.path.join(self.directory, segment)
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError as exc:
            self._maps.pop(segment, None)
            raise ProtocolError(Reason.SHM_GONE, f"{segment} no longer exists") from exc
        except OSError as exc:
            raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: {exc.strerror}") from exc
        mapped = self._maps.get(segment)
        if mapped is not None and (st.st_ino, st.st_dev, st.st_size) == (
                mapped.pointer.st_ino, mapped.pointer.st_dev, mapped.pointer.st_size):
            mapped.used_s = now
            self._maps.move_to_end(segment)
            return mapped
        self._maps.pop(segment, None)  # a pointer file replaced or truncated under us: map again
        mapped = self._map(segment, pid, path)
        self._maps[segment] = mapped
        while len(self._maps) > self.max_mappings:
            self._maps.popitem(last=False)
        self.mapped_total += 1
        return mapped

    def _map(self, segment: str, pid: int, path: str) -> _Mapped:
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError as exc:
            raise ProtocolError(Reason.SHM_GONE, f"{segment} no longer exists") from exc
        except OSError as exc:
            raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: {exc.strerror}") from exc
        try:
            pointer = os.fstat(fd)
            if pointer.st_uid != os.getuid() or not stat.S_ISREG(pointer.st_mode):
                raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment} belongs to another user or is not a file")
            raw = os.pread(fd, POINTER.size, 0)
        except OSError as exc:
            raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        if len(raw) != POINTER.size:
            raise ProtocolError(Reason.SHM_TRUNCATED, f"{segment} holds {len(raw)} bytes, a pointer needs {POINTER.size}")
        magic, ring_fd, size = POINTER.unpack(raw)
        if magic != POINTER_MAGIC or ring_fd > 2**31 or not 0 < size <= 2**40:
            raise ProtocolError(Reason.BAD_SHARED_FRAMES, f"{segment} is not a ring pointer")
        try:
            fd = os.open(f"/proc/{pid}/fd/{ring_fd}", _RING_FLAGS)
        except FileNotFoundError as exc:
            raise ProtocolError(Reason.SHM_GONE, f"{segment}: process {pid} or its ring is gone") from exc
        except OSError as exc:
            raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: /proc/{pid}/fd/{ring_fd}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: the ring is not a file of this user")
            if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{segment} (deleted)":
                raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: fd {ring_fd} of process {pid} is not its ring")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0:
                raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: the ring is not sealed against shrinking")
            if st.st_size != size:
                raise ProtocolError(Reason.SHM_TRUNCATED, f"{segment}: the ring holds {st.st_size} bytes, "
                                                     f"its pointer says {size}")
            # Sealed: it can never shrink, so no page of this mapping can go away (no SIGBUS).
            # MAP_POPULATE: page-table entries now, not one fault per 4 KiB on the first reads.
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ)
        except OSError as exc:
            raise ProtocolError(Reason.SHM_UNREADABLE, f"{segment}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        return _Mapped(segment, pid, pointer, buffer, size)

    def _sweep(self, now: float) -> None:
        """Unmap rings whose pointer file or process is gone, or that were not read for `idle_s`; every
        `ORPHAN_SWEEP_S`, remove the pointer files of this user's clients that died without removing
        them (killed: a long-running server would otherwise keep collecting them until it restarts)."""
        self._swept_s = now
        if now - self._orphans_swept_s > ORPHAN_SWEEP_S:
            self._orphans_swept_s = now
            self.orphans_removed += remove_orphans(self.directory)
        for segment, mapped in list(self._maps.items()):
            if (now - mapped.used_s > self.idle_s or not os.path.exists(f"/proc/{mapped.pid}")
                    or not os.path.exists(os.path.join(self.directory, segment))):
                del self._maps[segment]  # unmapped when the last view of it goes (never close(): views)


_reader = FrameReader()


def read_frames(ref: SharedFrames, expected: Mapping[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Copies of the referenced frames, checked current after the copy (a one-off reader's API;
    the server's runner adapter uses a `FrameReader` and reads the views in place)."""
    views = _reader.read(ref, expected)
    out = {name: np.array(view) for name, view in views.items()}
    if not _reader.current(ref):
        raise ProtocolError(Reason.SHM_STALE, f"{ref.segment} was overwritten while it was read")
    return out


# ----------------------------------------------------------------------------- client side


def probe_ok(advert: SameHostAdvert | None, directory: str = SHM_DIR) -> bool:
    """Whether the server that sent `advert` shares this process's /dev/shm, user and /proc."""
    if advert is None:
        return False
    m = PROBE_RE.fullmatch(advert.probe)
    if m is None:
        return False
    try:
        fd = os.open(os.path.join(directory, advert.probe), _OPEN_FLAGS)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            return False
        lines = os.pread(fd, 128, 0).decode("ascii", "replace").split("\n")
        if len(lines) != 3 or lines[0] != advert.token or lines[2] != "" or not re.fullmatch(r"fd [0-9]{1,9}", lines[1]):
            return False
        # The server's own fd of this file, seen through /proc: one pid namespace, and /proc/<pid>/fd
        # open between the two processes (the server maps our ring the same way).
        theirs = os.stat(f"/proc/{m.group(1)}/fd/{lines[1][3:]}")
        return (theirs.st_ino, theirs.st_dev) == (st.st_ino, st.st_dev)
    except OSError:
        return False
    finally:
        os.close(fd)


class FrameRing:
    """A ring of `slots` frame slots in one sealed memfd, owned (created, written, removed) by one client.

    Bounded: `slots` slots of one observation's frames each. Created on the first write, sized for
    that observation (a later observation whose frames do not fit makes a new ring and drops the
    old one); removed by `close()`. `write` raises OSError when shared memory does not work; the
    caller falls back to JPEG.
    """

    def __init__(self, slots: int = 4, directory: str = SHM_DIR):
        if not 2 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 2..{MAX_SLOTS}, got {slots}")
        self.directory = directory
        self.slots = slots
        self._stem = f"lz-{os.getpid()}-{secrets.token_hex(16)}"
        self._rings = 0  # rings made so far; the name's last field
        self._name: str | None = None
        self._pointer_path = ""
        self._fd: int | None = None
        self._buffer: mmap.mmap | None = None
        self._slot_bytes = 0
        self._layout: tuple | None = None  # ((name, h, w), ...) the views below were made for
        self._views: list[list[np.ndarray]] = []  # per slot, per camera: a writable view into the ring
        self._offsets: list[dict[str, tuple[int, int, int]]] = []
        self._next = 0
        self._generation = 0

    def names(self) -> list[str]:
        """The name of the pointer file of the current ring (empty before the first write)."""
        return [self._name] if self._name is not None else []

    @property
    def ring_bytes(self) -> int:
        return self._slot_bytes * self.slots

    def write(self, frames: Mapping[str, np.ndarray]) -> SharedFrames:
        """Copy RGB uint8 (H, W, 3) frames into the next slot; what the observation should carry."""
        layout = []
        for name, image in frames.items():
            if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
                raise ValueError(f"{name}: expected uint8 (H, W, 3), got {image.dtype} {image.shape}")
            layout.append((name, image.shape[0], image.shape[1]))
        layout = tuple(layout)
        if layout != self._layout:
            self._lay_out(layout)
        elif not os.path.exists(self._pointer_path):  # removed under us (one stat): put it back
            self._write_pointer()
        slot = self._next
        self._next = (slot + 1) % self.slots
        self._generation += 1
        base = slot * self._slot_bytes
        buf = self._buffer
        HEADER.pack_into(buf, base, MAGIC, 0)  # busy: a reader now sees a stale generation
        for view, image in zip(self._views[slot], frames.values(), strict=True):
            np.copyto(view, image)
        HEADER.pack_into(buf, base, MAGIC, self._generation)
        return SharedFrames(segment=self._name, generation=self._generation, frames=self._offsets[slot])

    def _lay_out(self, layout: tuple) -> None:
        need = HEADER.size + sum(h * w * 3 for _, h, w in layout)
        if need > self._slot_bytes:
            self._release()
            self._create(-(-need // SLOT_ALIGN) * SLOT_ALIGN)
        self._views, self._offsets = [], []
        for slot in range(self.slots):
            offset = slot * self._slot_bytes + HEADER.size
            views, offsets = [], {}
            for name, h, w in layout:
                views.append(np.frombuffer(self._buffer, np.uint8, h * w * 3, offset).reshape(h, w, 3))
                offsets[name] = (offset, h, w)
                offset += h * w * 3
            self._views.append(views)
            self._offsets.append(offsets)
        self._layout = layout

    def _create(self, slot_bytes: int) -> None:
        if self._rings >= 100:
            raise OSError("more than 100 rings made: frame sizes keep changing")
        name = f"{self._stem}-{self._rings}"
        self._rings += 1
        size = slot_bytes * self.slots
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # every page now: a write into the mapping never faults for memory
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            buffer = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._name, self._fd, self._buffer, self._slot_bytes = name, fd, buffer, slot_bytes
        self._pointer_path = os.path.join(self.directory, name)
        self._next = 0
        self._write_pointer()

    def _write_pointer(self) -> None:
        """The file in /dev/shm by which the server finds the ring: magic, our fd of it, its size."""
        tmp = f"{self._pointer_path}.{secrets.token_hex(4)}"  # written whole, then renamed: never half a pointer
        pointer = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(pointer, POINTER.pack(POINTER_MAGIC, self._fd, self._slot_bytes * self.slots))
        finally:
            os.close(pointer)
        os.rename(tmp, self._pointer_path)

    def _release(self) -> None:
        """Remove the pointer file (readers see ``shm_gone``) and let go of the ring."""
        name, fd = self._name, self._fd
        self._name = self._fd = self._buffer = None
        self._views, self._offsets, self._layout, self._slot_bytes = [], [], None, 0
        if name is not None:
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError:
                pass
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        # The mapping goes with the last reference to it (the views above, dropped): never close()
        # an mmap that numpy arrays may still point into.

    def close(self) -> None:
        self._release()
