"""`lerobot-zenoh-cache --folder=CHECKPOINT --repo_id=USER/NAME`: put a local checkpoint into the Hugging
Face cache under a repo id, so that `--policy.path=USER/NAME` (or a manifest's `pretrained_path`) finds
it offline, as if `hf download USER/NAME` had fetched it.

    lerobot-zenoh-cache --folder=outputs/train/act_pick/checkpoints/last/pretrained_model --repo_id=me/act_pick
    HF_HUB_OFFLINE=1 lerobot-policy-server --policy.path=me/act_pick

The cache is the one huggingface_hub uses ($HF_HUB_CACHE, else $HF_HOME/hub). Files are linked (or
copied across file systems) once under blobs/; snapshots/<commit>/ names them, where <commit> is a
hash of the folder's files (the same folder placed twice is one snapshot), and refs/<revision> names
that commit. Prints `USER/NAME@<commit>` and the snapshot folder. Exit codes: 0 placed, 2 a mistake in
one line (no such folder, not a checkpoint, a repo id that is not USER/NAME).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

PROG = "lerobot-zenoh-cache"


@dataclass
class CacheConfig:
    # The checkpoint folder (it holds config.json), e.g. a training run's checkpoints/last/pretrained_model.
    folder: str
    # The repo id to file it under: USER/NAME, what --policy.path will name.
    repo_id: str
    # The revision (branch or tag) that will name it: USER/NAME@REVISION; main is what USER/NAME alone reads.
    revision: str = "main"


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import fail, parse, require_extra

    args = parse(CacheConfig, argv, PROG)
    require_extra(PROG, "server", "huggingface_hub")  # where the cache is (a server host has it)
    from pathlib import Path

    from lerobot_zenoh.errors import PolicyError
    from lerobot_zenoh.server.runners.hub import HubRef, place_in_cache

    ref = HubRef.parse(args.repo_id)
    if ref is None or ref.revision is not None:
        fail(PROG, f"--repo_id: {args.repo_id!r} is not USER/NAME (give a revision with --revision)")
    if not args.revision or "/" in args.revision or args.revision.startswith("."):
        fail(PROG, f"--revision: {args.revision!r} is not a branch or tag name")
    try:
        commit, folder = place_in_cache(Path(args.folder), HubRef(ref.repo_id, args.revision))
    except PolicyError as exc:
        fail(PROG, str(exc))
    except OSError as exc:
        fail(PROG, f"cannot write the Hugging Face cache: {exc}")
    name = ref.repo_id if args.revision == "main" else f"{ref.repo_id}@{args.revision}"
    print(f"{ref.repo_id}@{commit} ({name}) -> {folder}")
    print(f"serve it with: lerobot-policy-server --policy.path={name}  (offline: HF_HUB_OFFLINE=1)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
