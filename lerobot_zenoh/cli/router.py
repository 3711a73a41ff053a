"""`lerobot-zenoh-router`: a Zenoh router with the project's settings, for multi-host deployments.

    lerobot-zenoh-router --zenoh.listen=tcp/0.0.0.0:7447 [--zenoh.connect=tcp/other-router:7447]

Options are the --zenoh.* settings of transport/settings.py (the robot client's); --listen,
--connect, --set PATH=JSON5 and --no-scouting are older spellings, still accepted. Exit codes: 0
when stopped by SIGINT/SIGTERM, 2 for a configuration mistake (one line).

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

from lerobot_zenoh.transport.settings import add_arguments, settings_from_arguments

#: Zenoh config path -> the option that sets it (with --config, only options given override the file).
_OPTION_OF_PATH = {"listen/endpoints": "listen", "connect/endpoints": "connect",
                   "scouting/multicast/enabled": "multicast_scouting",
                   "transport/shared_memory/enabled": "shared_memory"}


def _named(args, path: str) -> bool:
    option = _OPTION_OF_PATH.get(path)
    if option is not None:
        return getattr(args, f"zenoh_{option}") is not None
    return True  # TLS, access control and --set entries exist only when given


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.cli.parsing import OneLineArgumentParser, one_line

    # argparse (Zenoh's own config file is the base here), with the other scripts' --snake_case
    # spelling and one-line errors (exit 2).
    parser = OneLineArgumentParser(prog="lerobot-zenoh-router", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a Zenoh JSON5 config file (e.g. the TLS + ACL router file written by "
                                         "`lerobot-zenoh-secure init --router`); --listen/--connect/--set apply on top")
    # Zenoh: the fields of transport/settings.py, older spellings kept.
    add_arguments(parser, ("listen", "connect", "multicast_scouting", "shared_memory", "tls_root_ca",
                           "tls_certificate", "tls_private_key", "access_control_file", "json5_overrides"),
                  aliases={"listen": ["--listen"], "connect": ["--connect"], "json5_overrides": ["--set"]})
    parser.add_argument("--no-scouting", dest="zenoh_multicast_scouting", action="store_false", default=None,
                        help="same as --zenoh.multicast_scouting=false")
    parser.add_argument("--log_level", "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        type=str.upper, help="logging level (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lerobot-zenoh-router")

    from lerobot_zenoh.errors import LeRobotZenohError
    from lerobot_zenoh.transport.session import ZenohSession

    try:
        settings = settings_from_arguments(args, mode="router")
    except LeRobotZenohError as exc:
        print(f"lerobot-zenoh-router: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if args.config:
        # The file is the base; the options only override what they name.
        given = {"mode": '"router"'}
        given.update((path, literal) for path, literal in settings.json5_entries()
                     if path != "mode" and _named(args, path))
        session = ZenohSession(settings.replace(json5_overrides=given), config_file=args.config)
        where = args.config
    else:
        if not settings.listen:
            settings = settings.replace(listen=["tcp/0.0.0.0:7447"])
        session = ZenohSession(settings)
        where = ", ".join(settings.listen)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        session.open()
    except LeRobotZenohError as exc:
        print(f"lerobot-zenoh-router: cannot start on {where}: {one_line(str(exc))}", file=sys.stderr)
        return 2
    log.info("router %s started (%s)", session.zid, where)
    try:
        stop.wait()
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
