"""`lerobot-zenoh-router`: a Zenoh router with the project's settings, for multi-host deployments.

    lerobot-zenoh-router --listen tcp/0.0.0.0:7447 [--connect tcp/other-router:7447]

Robots and servers then run in Zenoh client mode and connect to a router
(`--zenoh.mode=client --endpoint=tcp/<router>:7447` for clients, `zenoh: {mode: client,
connect: [tcp/<router>:7447]}` in a manifest); key expressions do the routing. Routers connected
to each other route between networks. This is Zenoh's own router (the same as `zenohd` without
plugins) started from Python, not a relay of ours.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lerobot-zenoh-router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a Zenoh JSON5 config file (e.g. the TLS + ACL router file written by "
                                         "`lerobot-zenoh-secure init --router`); --listen/--connect/--set apply on top")
    parser.add_argument("--listen", action="append", default=[], help="endpoint to listen on (repeatable)")
    parser.add_argument("--connect", action="append", default=[], help="router/peer to connect to (repeatable)")
    parser.add_argument("--no-scouting", action="store_true", help="disable multicast scouting")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=JSON5",
                        help="any other Zenoh setting, e.g. transport/link/tx/lease=3000")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lerobot-zenoh-router")

    from lerobot_zenoh.errors import LeRobotZenohError
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings

    import json

    overrides = {}
    for item in args.set:
        path, sep, value = item.partition("=")
        if not sep:
            print(f"lerobot-zenoh-router: --set {item!r} is not PATH=JSON5", file=sys.stderr)
            return 2
        overrides[path] = value
    if args.config:
        # The file is the base; the options only override what they name.
        given = {"mode": '"router"'}
        if args.listen:
            given["listen/endpoints"] = json.dumps(args.listen)
        if args.connect:
            given["connect/endpoints"] = json.dumps(args.connect)
        if args.no_scouting:
            given["scouting/multicast/enabled"] = "false"
        session = ZenohSession(ZenohSettings(mode="router", json5_overrides={**given, **overrides}), config_file=args.config)
        where = args.config
    else:
        settings = ZenohSettings(mode="router", listen=args.listen or ["tcp/0.0.0.0:7447"], connect=args.connect,
                                 multicast_scouting=not args.no_scouting, json5_overrides=overrides)
        session = ZenohSession(settings)
        where = ", ".join(settings.listen)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        session.open()
    except LeRobotZenohError as exc:
        log.error("%s", exc)
        return 2
    log.info("router %s started (%s)", session.zid, where)
    try:
        stop.wait()
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
