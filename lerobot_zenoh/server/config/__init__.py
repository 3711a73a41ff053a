"""The server's configuration: the YAML manifest, validated at start-up with file and field in every
error, and the runner each entry asks for.

    manifest.py        `Manifest`, `ModelEntry` and their blocks (pydantic), `load_manifest`, reload rules
    runner_loading.py  `load_runner`: the runner an entry asks for (synthetic, VLM, checkpoint folder or
                       hub id), its family blocks handed over

May import (server/): runners.
Must not be imported by: runners.
"""
