"""`lerobot-zenoh-openpi`: serve openpi-client robots from the fleet (docs/openpi.md).

    lerobot-zenoh-openpi --config openpi.yaml
    lerobot-zenoh-openpi --endpoint tcp/gpu-host:7447 --model_id pi05 \\
        --image observation/image=front --image observation/wrist_image=wrist \\
        --state observation/state --prompt prompt

The file (YAML or JSON) holds `FrontDoorConfig`'s fields (lerobot_zenoh/openpi/front_door.py), its
`mapping` block the key mapping; a flag given overrides the file. Binds to 127.0.0.1 unless --host
says otherwise. Exit codes: 0 when stopped by SIGINT/SIGTERM, 2 for a configuration mistake or a
mapping that does not fit the model (one line naming the field), 3 when no server answers or it does
not serve the front door's client ids.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

PROG = "lerobot-zenoh-openpi"

_SCALARS = ("host", "port", "token", "tls_certificate", "tls_private_key", "max_clients", "client_prefix", "endpoint",
            "cluster_uuid", "experiment_tag", "model_id", "model_version", "application_tag", "jpeg_quality",
            "request_timeout_s", "discovery_timeout_s", "fps", "max_message_bytes")


def parse(argv: list[str] | None = None):
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.openpi.front_door import FrontDoorConfig

    from lerobot_zenoh.cli.parsing import OneLineArgumentParser

    p = OneLineArgumentParser(prog=PROG, description="OpenPI websocket front door for a lerobot-zenoh fleet.")
    p.add_argument("--config", help="YAML or JSON file of the front door's settings")
    for name in _SCALARS:
        p.add_argument(f"--{name}", default=None)
    p.add_argument("--token_file", help="read the token from this file (kept out of the process list)")
    p.add_argument("--image", action="append", default=[], metavar="OPENPI_KEY=CAMERA")
    p.add_argument("--state", action="append", default=[], metavar="OPENPI_KEY",
                   help="the OpenPI key of the state array (several: joined in order)")
    p.add_argument("--prompt", help="the OpenPI key of the task string")
    p.add_argument("--default_prompt")
    p.add_argument("--ignore", action="append", default=[], metavar="OPENPI_KEY", help="a key to accept and drop")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    data: dict = {}
    if args.config:
        import yaml

        try:
            data = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError("config", f"cannot read {args.config}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("config", f"{args.config} must hold a map of settings")
    for name in _SCALARS:
        if (value := getattr(args, name)) is not None:
            data[name] = value
    if args.token_file:
        try:
            data["token"] = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError("token_file", str(exc)) from None
    mapping = dict(data.get("mapping") or {})
    for item in args.image:
        key, sep, cam = item.rpartition("=")
        if not sep or not key or not cam:
            raise ConfigError("image", f"{item!r} is not OPENPI_KEY=CAMERA")
        mapping.setdefault("images", {})[key] = cam
    if args.state:
        mapping["state"] = args.state[0] if len(args.state) == 1 else args.state
    for name in ("prompt", "default_prompt"):
        if (value := getattr(args, name)) is not None:
            mapping[name] = value
    if args.ignore:
        mapping["ignore"] = [*mapping.get("ignore", ()), *args.ignore]
    data["mapping"] = mapping
    return FrontDoorConfig(**data), args.log_level


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.errors import CompatibilityError, ConfigError

    try:
        config, level = parse(argv)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    from lerobot_zenoh.cli.parsing import require_extra

    require_extra(PROG, "openpi", "websockets")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lerobot_zenoh.openpi.front_door import FrontDoor
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    door = FrontDoor(config)
    try:
        door.start()
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        door.close()
        return 2
    except CompatibilityError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        door.close()
        return 3
    print(f"{PROG}: listening on {'wss' if config.tls_certificate else 'ws'}://{config.host}:{door.port}"
          f"{' (loopback only)' if config.host in ('127.0.0.1', 'localhost', '::1') else ''}", flush=True)
    stop.wait()
    door.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
