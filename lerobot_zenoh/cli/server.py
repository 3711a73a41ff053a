"""`lerobot-policy-server --manifest=manifests/<file>.yaml`: pre-warm and serve until SIGINT/SIGTERM.

Exit codes: 0 when stopped by SIGINT/SIGTERM; 2 for a configuration mistake, in one line naming the
flag or the manifest field (a bad manifest, a checkpoint that cannot be loaded, an unknown flag).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never hang on a hub lookup: checkpoints are local

PROG = "lerobot-policy-server"


@dataclass
class ServerConfig:
    # The YAML manifest: the models to serve, their checkpoints, clients and Zenoh settings (docs/server.md).
    manifest: str
    # Serve under this server id instead of the manifest's server_id.
    server_id: str | None = None
    # Logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        from lerobot_zenoh.errors import ConfigError

        if not os.path.isfile(self.manifest):
            raise ConfigError("manifest", f"{self.manifest} is not a file")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError("log_level", f"{self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.cli.parsing import EXIT_CONFIG, one_line, parse

    args = parse(ServerConfig, argv, PROG)
    logging.basicConfig(level=args.log_level.upper(), force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(PROG)

    from lerobot_zenoh.errors import ConfigError, LeRobotZenohError
    from lerobot_zenoh.server.manifest import load_manifest
    from lerobot_zenoh.server.server import PolicyServer

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        manifest = load_manifest(args.manifest)
        if args.server_id:
            manifest = manifest.model_copy(update={"server_id": args.server_id})
        log.info("loading and warming up %d model(s) from %s ...", len(manifest.server), args.manifest)
        server = PolicyServer(manifest).start()
    except ConfigError as exc:
        where = "" if exc.source else f"{args.manifest}: "
        print(f"{PROG}: {where}{one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except LeRobotZenohError as exc:
        print(f"{PROG}: {args.manifest}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    log.info("server %s ready", manifest.server_id)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        log.info("stopping")
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
