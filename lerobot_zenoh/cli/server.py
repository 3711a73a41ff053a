"""`lerobot-policy-server --manifest manifests/<file>.yaml`: pre-warm and serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never hang on a hub lookup: checkpoints are local


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lerobot-policy-server", description=__doc__)
    parser.add_argument("--manifest", required=True, help="YAML manifest (see docs/server.md)")
    parser.add_argument("--server-id", help="override the manifest's server_id")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lerobot-policy-server")

    from lerobot_zenoh.errors import LeRobotZenohError
    from lerobot_zenoh.server.manifest import load_manifest
    from lerobot_zenoh.server.server import PolicyServer

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        manifest = load_manifest(args.manifest)
        if args.server_id:
            manifest = manifest.model_copy(update={"server_id": args.server_id})
        server = PolicyServer(manifest).start()
    except LeRobotZenohError as exc:
        log.error("%s", exc)
        return 2
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
