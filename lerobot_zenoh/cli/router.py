"""`lerobot-zenoh-router`: a Zenoh router with the project's settings, for multi-host deployments.

    lerobot-zenoh-router --zenoh.listen=tcp/0.0.0.0:7447 [--zenoh.connect=tcp/other-router:7447]

Options are the --zenoh.* settings of transport/settings.py (the robot client's), parsed by draccus
as every console script's; a list option may also be given once per item (`--zenoh.listen A
--zenoh.listen B`). --listen, --connect, --set PATH=JSON5, --no-scouting and --log-level are older
spellings, still accepted. Exit codes: 0 when stopped by SIGINT/SIGTERM, 2 for a configuration
mistake (one line).

Robots and servers then run in Zenoh client mode and connect to a router
(`--zenoh.mode=client --endpoint=tcp/<router>:7447` for clients, `zenoh: {mode: client,
connect: [tcp/<router>:7447]}` in a manifest); key expressions do the routing. Routers connected
to each other route between networks. This is Zenoh's own router (the same as `zenohd` without
plugins) started from Python, not a relay of ours.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import typing
from dataclasses import dataclass, field

from lerobot_zenoh.transport.settings import ZenohSettings

PROG = "lerobot-zenoh-router"

#: The --zenoh.* settings a router takes (its mode is `router`; the client-side ones do not apply).
ROUTER_FIELDS = ("listen", "connect", "multicast_scouting", "shared_memory", "tls_root_ca", "tls_certificate",
                 "tls_private_key", "access_control_file", "json5_overrides")


def _router_zenoh() -> type:
    """ZenohSettings' own fields (types, defaults, help) for `ROUTER_FIELDS`, as a draccus group."""
    hints = typing.get_type_hints(ZenohSettings)
    chosen = {f.name: f for f in dataclasses.fields(ZenohSettings) if f.name in ROUTER_FIELDS}
    cls = dataclasses.make_dataclass("RouterZenohSettings", [
        (name, hints[name], field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
        for name, f in chosen.items()])
    cls.__doc__ = "ZenohSettings' fields a router takes (transport/settings.py)."
    return cls


RouterZenohSettings = _router_zenoh()


@dataclass
class RouterConfig:
    # A Zenoh JSON5 config file (e.g. the TLS + ACL router file written by `lerobot-zenoh-secure init
    # --router`); the --zenoh.* options given apply on top.
    config: str | None = None
    # The router's Zenoh settings (transport/settings.py); a list may also be given once per item
    # (--zenoh.listen A --zenoh.listen B). Older spellings, still accepted: --listen, --connect,
    # --set PATH=JSON5 (--zenoh.json5_overrides), --no-scouting (--zenoh.multicast_scouting=false),
    # --log-level.
    zenoh: RouterZenohSettings = field(default_factory=RouterZenohSettings)
    # Logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        from lerobot_zenoh.errors import ConfigError

        self.log_level = self.log_level.upper()
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError("log_level", f"{self.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")

    def settings(self) -> ZenohSettings:
        return ZenohSettings(mode="router", **dataclasses.asdict(self.zenoh))


def spellings():
    from lerobot_zenoh.command_line import Spellings

    return Spellings(aliases={"--listen": "--zenoh.listen", "--connect": "--zenoh.connect",
                              "--set": "--zenoh.json5_overrides", "--log-level": "--log_level"},
                     switches={"--no-scouting": "--zenoh.multicast_scouting=false"},
                     repeatable=frozenset({"--zenoh.listen", "--zenoh.connect"}),
                     pairs=frozenset({"--zenoh.json5_overrides"}))


#: Zenoh config path -> the option that sets it (with --config, only options given override the file).
_OPTION_OF_PATH = {"listen/endpoints": "listen", "connect/endpoints": "connect",
                   "scouting/multicast/enabled": "multicast_scouting",
                   "transport/shared_memory/enabled": "shared_memory"}


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import one_line, parse
    from lerobot_zenoh.cli.stopping import begin_stop

    args = sys.argv[1:] if argv is None else list(argv)
    config = parse(RouterConfig, args, PROG, spellings())
    given = {a.partition("=")[0].removeprefix("--zenoh.") for a in spellings().rewrite(args) if a.startswith("--")}
    logging.basicConfig(level=config.log_level, force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger(PROG)

    from lerobot_zenoh.errors import LeRobotZenohError
    from lerobot_zenoh.transport.session import ZenohSession

    settings = config.settings()
    if config.config:
        # The file is the base; the options only override what they name (TLS, access control and
        # --set entries exist only when given).
        named = {"mode": '"router"'}
        named.update((path, literal) for path, literal in settings.json5_entries()
                     if path != "mode" and _OPTION_OF_PATH.get(path, "") in given | {""})
        session = ZenohSession(settings.replace(json5_overrides=named), config_file=config.config)
        where = config.config
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
        print(f"{PROG}: cannot start on {where}: {one_line(str(exc))}", file=sys.stderr)
        return 2
    log.info("router %s started (%s)", session.zid, where)
    try:
        stop.wait()
    finally:
        begin_stop(log)
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
