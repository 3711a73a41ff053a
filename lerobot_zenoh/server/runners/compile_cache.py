"""The compile cache folder: where inductor and Triton keep what they compiled, and who may write there.

Inductor loads what it finds in its cache folder: it unpickles the files under ``fxgraph/`` and
``aotautograd/`` and loads the shared objects it built there. Whoever can write into that folder (or
can replace it, or one of the folders above it) runs code as the server's user at its next compilation
or restart. So the folder is held to the rule ``ssh`` applies to ``~/.ssh`` (StrictModes), before
torch reads it:

- the folder itself is owned by the server's user and writable by nobody else: no group or other
  write bit, *whatever* its sticky bit (a sticky world-writable folder still lets anyone create new
  files in it, and inductor would load a planted cache entry); a folder the server creates is 0700;
- every folder above it that the server did not create is owned by the server's user or by root, and
  is not writable by another user: no group or other write bit, **except** a sticky folder such as
  ``/tmp`` (mode 1777). The sticky bit lets another user add entries there but not rename or remove
  the server's own (the kernel checks the entry's owner), so the path below it cannot be swapped. A
  non-sticky group- or world-writable parent would let another user rename the server's folder away
  and put one of their own in its place;
- a symbolic link on the way is followed only when owned by the server's user or root (another
  user's link could be re-pointed later); the checks then apply to the folders it leads to.

A folder that breaks the rule refuses the start in one line naming the manifest's ``compile_cache_dir``
(`ConfigError`: the server exits with status 2). Without ``compile_cache_dir`` the server uses a private
folder of its own (`default_folder`: ``$XDG_CACHE_HOME/lerobot-zenoh/inductor``, else
``~/.cache/lerobot-zenoh/inductor``), held to the same rule, never torch's shared default
(``/tmp/torchinductor_<user>``, a name another local user can create first).

`use_folder` also points every cache location torch 2.11 and Triton read at it (`CACHE_ENVIRONMENT`),
and turns inductor's remote caches off (a cache server's answers are unpickled too), so that nothing
inherited from the caller's environment sends compiled code elsewhere. Torch-free.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from lerobot_zenoh.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["CACHE_ENVIRONMENT", "REMOTE_CACHES_OFF", "check_folder", "default_folder", "use_folder"]

FIELD = "compile_cache_dir"

#: Environment variables torch 2.11 and Triton read for cache locations, relative to the folder.
CACHE_ENVIRONMENT = {
    "TORCHINDUCTOR_CACHE_DIR": ".",  # inductor: fxgraph/, aotautograd/, C++ and Triton kernels
    "TRITON_CACHE_DIR": "triton",  # Triton's compiled kernels (else ~/.triton/cache)
    "TRITON_DUMP_DIR": "triton-dump",
    "TRITON_OVERRIDE_DIR": "triton-override",  # kernels Triton loads in place of its own when asked
}

#: Inductor's remote caches (a cache server's entries are unpickled like local ones): off, whatever
#: the caller's environment says (they are off by default outside Meta's builds).
REMOTE_CACHES_OFF = {
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0",
    "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "0",
    "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "0",
}


def default_folder() -> Path:
    """The server's private cache folder when the manifest names none."""
    base = os.environ.get("XDG_CACHE_HOME")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "lerobot-zenoh" / "inductor"


def use_folder(folder: Path | None, *, uid: int | None = None) -> Path:
    """Create (0700) and check `folder` (the manifest's ``compile_cache_dir``, absolute; None: the
    private default), then point inductor and Triton at it. Returns the folder. `ConfigError` naming
    ``compile_cache_dir`` when it breaks the rule (module docstring). `uid`: the server's user (the
    effective uid; a parameter for tests)."""
    folder = Path(os.path.abspath(folder if folder is not None else default_folder()))
    check_folder(folder, uid=os.geteuid() if uid is None else uid)
    inherited = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inherited and os.path.abspath(inherited) != str(folder):
        log.warning("TORCHINDUCTOR_CACHE_DIR=%s from the environment is not used: compiling into %s "
                    "(set compile_cache_dir in the manifest to choose the folder)", inherited, folder)
    for name, sub in CACHE_ENVIRONMENT.items():
        os.environ[name] = str(folder if sub == "." else folder / sub)
    os.environ.update(REMOTE_CACHES_OFF)
    return folder


def check_folder(folder: Path, *, uid: int) -> None:
    """Create what is missing of `folder` (each new folder 0700, owned by `uid`) and check the rule
    on every folder of its path. `ConfigError` naming ``compile_cache_dir`` otherwise."""
    if not folder.is_absolute():
        raise ValueError(f"{folder} is not absolute")
    created: set[str] = set()
    current = Path(folder.anchor)
    for part in folder.parts[1:]:
        current = current / part
        try:
            os.mkdir(current, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(FIELD, f"cannot create {current}: {exc.strerror or exc}") from None
        else:
            os.chmod(current, 0o700)  # whatever the umask
            created.add(str(current))
    # The path as given: a link on the way must be ours or root's (another user could re-point it).
    current = Path(folder.anchor)
    for part in folder.parts[1:]:
        current = current / part
        info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (uid, 0):
            raise ConfigError(FIELD, f"{folder}: {current} is a symbolic link owned by uid {info.st_uid}, "
                                     "another user (it could be re-pointed); use a folder only you can write")
    # The folders it leads to.
    real = Path(os.path.realpath(folder))
    chain = [real, *real.parents]
    for i, path in enumerate(chain):
        info = os.stat(path)
        if not stat.S_ISDIR(info.st_mode):
            raise ConfigError(FIELD, f"{folder}: {path} is not a folder")
        mode = stat.S_IMODE(info.st_mode)
        others_write = mode & (stat.S_IWGRP | stat.S_IWOTH)
        if i == 0:  # the cache folder itself: ours, and writable by us alone (a sticky bit is no excuse)
            if info.st_uid != uid:
                raise ConfigError(FIELD, f"{folder} is owned by uid {info.st_uid}, not by the server's user "
                                         f"(uid {uid}): what it holds is loaded as code; use a folder of your own")
            if others_write:
                raise ConfigError(FIELD, f"{folder} is writable by other users (mode {mode:04o}): inductor "
                                         "loads what it holds as code; chmod 700 it or use another folder")
            continue
        if str(path) in created:
            continue
        if info.st_uid not in (uid, 0):
            raise ConfigError(FIELD, f"{folder}: the folder above it, {path}, is owned by uid {info.st_uid} "
                                     f"(neither the server's user, uid {uid}, nor root): its owner could replace "
                                     "the cache folder")
        if others_write and not mode & stat.S_ISVTX:
            raise ConfigError(FIELD, f"{folder}: the folder above it, {path}, is writable by other users without "
                                     f"the sticky bit (mode {mode:04o}): they could replace the cache folder")
