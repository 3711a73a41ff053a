"""Checkpoints named by Hugging Face hub id: `lerobot/smolvla_base`, or `user/repo@revision`.

A `pretrained_path` (manifest) or `--policy.path` (single-model server) that is not a local folder
but reads as a hub repo id is fetched into the Hugging Face cache with ``snapshot_download``, as
LeRobot's own `--policy.path=user/repo` is; the policy is then loaded from that snapshot folder like
any local checkpoint. The revision (a branch, tag or commit) follows `@`, the notation of
huggingface_hub's `hf://` paths; without one, `main`.

The user's ``HF_HUB_OFFLINE`` is respected: offline, the id resolves from the cache
(``$HF_HOME/hub/models--<org>--<name>/snapshots/<commit>/`` through ``refs/<revision>``) or fails in
one line saying how to fetch it. A local folder always wins over a hub id of the same spelling.
"""

from __future__ import annotations

import re
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


def checkpoint_folder(value: str, local: Path, field: str) -> Path:
    """The folder to load a checkpoint from: `local` when it exists, else the hub snapshot `value`
    names (downloaded, or from the cache offline). `PolicyError` in one line naming `field` otherwise."""
    if local.exists():
        return local
    ref = HubRef.parse(value)
    if ref is None:
        raise PolicyError(f"{field}: {local} does not exist (a local checkpoint folder, or a Hugging Face hub id "
                          "such as lerobot/smolvla_base; build one offline with lerobot-zenoh-build-checkpoint)")
    return snapshot(ref, field)


def snapshot(ref: HubRef, field: str, allow_patterns: list[str] | None = None) -> Path:
    """The local snapshot folder of `ref`: fetched when online, from the cache when offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = is_offline()
    try:
        folder = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=allow_patterns)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise PolicyError(f"{field}: {ref} is not a local folder and not in the Hugging Face cache, and {why}: "
                          f"fetch it with `{ref.download_hint()}` (or give a local folder)") from None
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
