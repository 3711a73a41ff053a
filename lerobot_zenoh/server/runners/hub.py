"""Checkpoints named by Hugging Face hub id: `lerobot/smolvla_base`, or `user/repo@revision`.

A `pretrained_path` (manifest) or `--policy.path` (single-model server) that is not a local folder
but reads as a hub repo id is fetched into the Hugging Face cache with ``snapshot_download``, as
LeRobot's own `--policy.path=user/repo` is; the policy is then loaded from that snapshot folder like
any local checkpoint. The revision (a branch, tag or commit) follows `@`, the notation of
huggingface_hub's `hf://` paths; without one, `main`.

The user's ``HF_HUB_OFFLINE`` is respected: offline, the id resolves from the cache
(``$HF_HOME/hub/models--<org>--<name>/snapshots/<commit>/`` through ``refs/<revision>``, or a commit
given in full or by a unique prefix) or fails in one line saying how to fetch it. A local folder
always wins over a hub id of the same spelling; a path whose parent folder exists here
(`checkpoints/demo_actt`) and that the cache does not hold is reported as a missing folder, and a
training output folder (`outputs/train/x`) is answered with the checkpoint inside it.

`place_in_cache` puts a local checkpoint folder into the cache under a repo id, as `hf download`
would have left it (`lerobot-zenoh-cache`), so that `--policy.path=user/name` serves it offline.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from lerobot_zenoh.errors import PolicyError

# What the hub accepts as <namespace>/<name> (letters, digits, - _ .), then an optional @revision.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<rev>[^\s@]+))?$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None

    @classmethod
    def parse(cls, value: str) -> HubRef | None:
        """The hub reference `value` spells, or None when it cannot be one (an absolute path, ./x, ~)."""
        m = _HUB_ID.match(value.strip())
        if m is None or ".." in m.group("repo"):
            return None
        return cls(m.group("repo"), m.group("rev"))

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    @property
    def name(self) -> str:
        return self.repo_id.split("/", 1)[1]

    def download_hint(self) -> str:
        return f"hf download {self.repo_id}" + (f" --revision {self.revision}" if self.revision else "")


def is_offline() -> bool:
    """huggingface_hub's reading of HF_HUB_OFFLINE (imported late: it reads the variable at import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


#: Where a checkpoint sits inside what `lerobot-train` writes (its --output_dir) or inside one of its
#: numbered checkpoints: the folder to serve is the first of these that holds a config.json.
TRAINING_LAYOUTS = ("pretrained_model", "checkpoints/last/pretrained_model")


def checkpoint_folder(value: str, local: Path, field: str) -> Path:
    """The folder to load a checkpoint from: `local` when it exists, else the hub snapshot `value`
    names (downloaded, or from the cache offline). `PolicyError` in one line naming `field` otherwise."""
    if local.exists():
        inner = training_checkpoint(local)
        if inner is not None:
            raise PolicyError(f"{field}: {local} is a training output folder, not a checkpoint: give the "
                              f"checkpoint inside it, {inner}")
        return local
    ref = HubRef.parse(value)
    if ref is None:
        raise PolicyError(f"{field}: {missing_folder(local)} (a local checkpoint folder, or a Hugging Face hub id "
                          "such as lerobot/smolvla_base; build one offline with lerobot-zenoh-build-checkpoint)")
    if local.parent.is_dir() and local.parent != Path(local.anchor):  # reads as a path here: a typo is likelier
        try:
            return snapshot(ref, field)
        except PolicyError:
            raise PolicyError(f"{field}: {missing_folder(local)}, and {ref} is no Hugging Face hub id in the cache "
                              "either") from None
    return snapshot(ref, field)


def training_checkpoint(folder: Path) -> Path | None:
    """The checkpoint inside a training output folder (`folder` holds no config.json of its own)."""
    if (folder / "config.json").is_file():
        return None
    return next((folder / inner for inner in TRAINING_LAYOUTS if (folder / inner / "config.json").is_file()), None)


def missing_folder(local: Path) -> str:
    """`local` does not exist, with the nearest name its parent folder holds, if any."""
    import difflib

    parent = local.parent
    try:
        names = sorted(p.name for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    except OSError:
        names = []
    near = difflib.get_close_matches(local.name, names, n=1, cutoff=0.6)
    return f"no folder {local}" + (f" (did you mean {parent / near[0]}?)" if near else "")


def snapshot(ref: HubRef, field: str, allow_patterns: list[str] | None = None) -> Path:
    """The local snapshot folder of `ref`: fetched when online, from the cache when offline (a commit
    may then be given by a unique prefix, as `git` takes it)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = is_offline()
    revision = cached_commit(ref) if offline else ref.revision
    try:
        # Offline, look in the cache only: a revision that is a commit would otherwise be looked up
        # on the hub (and fail, blaming HF_HUB_OFFLINE) even with its snapshot in the cache.
        folder = snapshot_download(ref.repo_id, revision=revision, allow_patterns=allow_patterns,
                                   local_files_only=offline)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise PolicyError(f"{field}: {ref} is not a local folder and not in the Hugging Face cache, and {why}: "
                          f"fetch it with `{ref.download_hint()}`, put a local checkpoint there with "
                          f"`lerobot-zenoh-cache --folder=FOLDER --repo_id={ref.repo_id}`, or give a local folder") from None
    except GatedRepoError:
        raise PolicyError(f"{field}: {ref} is a gated repo: accept its terms on huggingface.co and log in "
                          "(`hf auth login`)") from None
    except RevisionNotFoundError:
        raise PolicyError(f"{field}: {ref}: the hub has no revision {ref.revision!r} of {ref.repo_id}") from None
    except RepositoryNotFoundError:
        raise PolicyError(f"{field}: {ref} is neither a local folder nor a model repo on the Hugging Face hub "
                          "(private? then `hf auth login`)") from None
    except (OSError, ValueError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PolicyError(f"{field}: cannot fetch {ref} from the Hugging Face hub: {text}") from None
    return Path(folder)


def cache_folder(repo_id: str) -> Path:
    """The Hugging Face cache's folder of model repo `repo_id` (models--<org>--<name>), where
    HF_HOME / HF_HUB_CACHE say the cache is."""
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))


def cached_commit(ref: HubRef) -> str | None:
    """`ref.revision`, or the full commit its unique prefix names in the cache (offline: the hub
    cannot resolve a short commit)."""
    rev = ref.revision
    if rev is None or not re.fullmatch(r"[0-9a-f]{4,39}", rev) or (cache_folder(ref.repo_id) / "refs" / rev).exists():
        return rev
    try:
        found = [p.name for p in (cache_folder(ref.repo_id) / "snapshots").iterdir() if p.name.startswith(rev)]
    except OSError:
        return rev
    return found[0] if len(found) == 1 else rev


def place_in_cache(folder: Path, ref: HubRef) -> tuple[str, Path]:
    """Put checkpoint `folder` into the Hugging Face cache as repo `ref.repo_id` at revision
    `ref.revision` (default main), laid out as `hf download` leaves a repo: each file once under
    blobs/<sha256>, snapshots/<commit>/ linking to them, refs/<revision> naming the commit. The commit
    is a hash of the files' names and contents: the same folder placed twice is one snapshot.
    Returns (commit, snapshot folder). `PolicyError` for a folder that is not a checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PolicyError(f"--folder: {missing_folder(folder)}" if not folder.exists() else f"--folder: {folder} is not a folder")
    inner = training_checkpoint(folder)
    if inner is not None:
        raise PolicyError(f"--folder: {folder} is a training output folder, not a checkpoint: give the checkpoint "
                          f"inside it, {inner}")
    if not (folder / "config.json").is_file():
        raise PolicyError(f"--folder: {folder} holds no config.json: not a checkpoint folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.relative_to(folder).parts)
    digests = {}
    for path in files:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digests[path.relative_to(folder).as_posix()] = h.hexdigest()
    commit = hashlib.sha1("".join(f"{name}\0{d}\n" for name, d in digests.items()).encode()).hexdigest()
    repo = cache_folder(ref.repo_id)
    snapshot_dir = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            tmp = blob.with_name(blob.name + ".incomplete")
            try:
                os.link(folder / name, tmp)  # same file system: no copy
            except OSError:
                shutil.copyfile(folder / name, tmp)
            tmp.replace(blob)
        link = snapshot_dir / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / (ref.revision or "main")).write_text(commit)
    return commit, snapshot_dir
