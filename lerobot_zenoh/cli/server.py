"""`lerobot-policy-server --manifest=manifests/<file>.yaml`: pre-warm and serve until SIGINT/SIGTERM.

SIGHUP re-reads the manifest and takes its client lists (with integer `max_batch_size` and the task
streams of `pipeline`) without a restart; a manifest that fails to load or that changes any other
field is refused in one log line, and the running one stays in force (docs/server.md, "Reloading the client list").

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
    # Write this process's id here once serving (removed at exit): what `kill -HUP $(cat FILE)` and
    # lerobot-zenoh-admit signal to reload the manifest's client lists and task streams.
    pid_file: str | None = None

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

    stop, hup, wake = threading.Event(), threading.Event(), threading.Event()
    for sig, flag in ((signal.SIGINT, stop), (signal.SIGTERM, stop), (signal.SIGHUP, hup)):
        signal.signal(sig, lambda *_, f=flag: (f.set(), wake.set()))
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
    pid_file = _write_pid(args.pid_file)
    try:
        while not stop.is_set():
            wake.wait(1.0)
            wake.clear()
            if hup.is_set() and not stop.is_set():
                hup.clear()
                _reload(server, args, log)
    finally:
        log.info("stopping")
        server.stop()
        if pid_file is not None:
            pid_file.unlink(missing_ok=True)
    return 0


def _reload(server, args: ServerConfig, log: logging.Logger) -> None:
    """SIGHUP: re-read the manifest; the server takes its client lists or refuses it (one line)."""
    from lerobot_zenoh.cli.parsing import one_line
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.server.manifest import load_manifest

    try:
        manifest = load_manifest(args.manifest)
    except ConfigError as exc:
        log.error("manifest reload refused: %s; the running manifest stays in force", one_line(str(exc)))
        return
    if args.server_id:
        manifest = manifest.model_copy(update={"server_id": args.server_id})
    server.reload(manifest)


def _write_pid(path: str | None):
    from pathlib import Path

    if path is None:
        return None
    pid_file = Path(path)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = pid_file.with_name(pid_file.name + ".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(pid_file)  # a reader never sees a half-written id
    return pid_file


if __name__ == "__main__":
    sys.exit(main())
