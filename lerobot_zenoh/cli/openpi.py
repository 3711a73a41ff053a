"""`lerobot-zenoh-openpi`: serve openpi-client robots from the fleet (docs/openpi.md).

    lerobot-zenoh-openpi --config_path=openpi.yaml
    lerobot-zenoh-openpi --endpoint=tcp/gpu-host:7447 --model_id=pi05 \\
        --image=observation/image=front --image=observation/wrist_image=wrist \\
        --mapping.state=observation/state --mapping.prompt=prompt

Every field of the front door's settings (`FrontDoorConfig`, lerobot_zenoh/openpi/front_door.py) is
a flag, generated from the class (cli/settings_flags.py): a field added there is a flag here, with
its help and default. `--config_path` reads a YAML or JSON file of the same fields (its `mapping`
block the key mapping); a flag given overrides the file. Older spellings still work: `--config FILE`,
`--image KEY=CAMERA` (repeatable), `--state KEY` (repeatable: joined in order), `--prompt`,
`--default_prompt`, `--ignore KEY` (repeatable), `--log-level`. Binds to 127.0.0.1 unless --host
says otherwise. Exit codes (docs/client.md, "Command lines"): 0 when stopped by SIGINT/SIGTERM, 2
for a configuration mistake or a mapping that does not fit the model (one line naming the field), 3
when no server answers or it does not serve the front door's client ids.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

PROG = "lerobot-zenoh-openpi"

#: The older spellings of the mapping's flags (before they were generated from the settings class).
_REPEATED = {"--image": "--mapping.images", "--state": "--mapping.state", "--ignore": "--mapping.ignore"}


#: Help for the settings whose class gives no `description` (over the field's terse comment; a field
#: added to the class without either gets its comment, or a generic line).
HELP = {
    "host": "The address to listen on: 127.0.0.1 (this host only) or 0.0.0.0 (every interface).",
    "port": "The websocket port openpi-client connects to (0: any free port, printed at start-up).",
    "token": "A shared secret clients send as openpi-client's api_key (prefer --token_file).",
    "tls_certificate": "TLS: the front door's certificate (PEM); with --tls_private_key it speaks wss://.",
    "tls_private_key": "TLS: the private key of --tls_certificate (PEM).",
    "max_clients": "Most websocket connections open at once; one more is refused.",
    "client_prefix": "Each connection is the robot client <prefix>-<n> of the served model (the manifest must accept it).",
    "max_message_bytes": "Largest message on the Zenoh path (the codec's limit), and the most --max_frame_bytes may be.",
    "max_rejections": "Rejections within --rejection_window_s after which a connection cools down.",
    "rejection_window_s": "The window in which --max_rejections are counted.",
    "cooldown_s": "How long a connection's requests are refused after too many rejections.",
    "endpoint": "Where the policy server (or a Zenoh router) listens, e.g. tcp/gpu-host:7447.",
    "experiment_tag": "The served application's experiment_tag; unset: taken from what the endpoint serves.",
    "model_id": "The served model's model_id; unset: taken from what the endpoint serves.",
    "model_version": "The served model's model_version; unset: taken from what the endpoint serves.",
    "application_tag": "The served application's application_tag; unset: taken from what the endpoint serves.",
    "zenoh": "More Zenoh settings (the --zenoh.* fields of the robot client: TLS, mode, ...), as a map.",
    "discovery_timeout_s": "How long to look for the served model at start-up before exit 3.",
    "cluster_uuid": "The served application's cluster_uuid; unset: taken from what the endpoint serves.",
    "resend_after_s": "An unanswered (best-effort) observation is sent again after this long.",
    "fps": "The robots' control rate, told to an execution-aware scheduler; unset: none.",
    "jpeg_quality": "JPEG quality of the frames sent to the server.",
    "request_timeout_s": "A request with no chunk after this long is answered with an error.",
    "telemetry_period_s": "Seconds between telemetry messages (0: none).",
    "mapping.images": "OpenPI key -> the model's camera, e.g. {observation/image: front} (or --image KEY=CAMERA, repeatable).",
    "mapping.state": "The OpenPI key of the state array, or a list of keys joined in order (or --state KEY, repeatable).",
    "mapping.prompt": "The OpenPI key of the task string (none: --mapping.default_prompt).",
    "mapping.default_prompt": "The task when a request carries no prompt.",
    "mapping.ignore": "Keys a client sends that the model does not use (dropped) (or --ignore KEY, repeatable).",
}


def flags_class() -> type:
    """The draccus dataclass of the command line: the script's own flags, then FrontDoorConfig's."""
    from lerobot_zenoh.cli.settings_flags import flags_dataclass
    from lerobot_zenoh.openpi.front_door import FrontDoorConfig

    own = [
        ("token_file", str | None, dataclasses.field(default=None, metadata={
            "help": "Read the token from this file (kept out of the process list); replaces --token."})),
        ("log_level", str, dataclasses.field(default="INFO", metadata={
            "help": "Logging level: DEBUG, INFO, WARNING or ERROR."})),
    ]
    flags = flags_dataclass(FrontDoorConfig, "OpenPIFrontDoorFlags", own, HELP)
    flags.__doc__ = ("The front door's settings (a --config_path file holds the same fields). Older spellings, "
                     "still accepted: --config FILE, --image KEY=CAMERA, --state KEY, --ignore KEY (each repeatable), "
                     "--prompt, --default_prompt, --log-level.")
    return flags


def spellings():
    from lerobot_zenoh.command_line import Spellings

    return Spellings(aliases={"--config": "--config_path", "--prompt": "--mapping.prompt",
                              "--default_prompt": "--mapping.default_prompt", **_REPEATED, "--log-level": "--log_level"},
                     repeatable=frozenset({"--mapping.state", "--mapping.ignore"}),
                     pairs=frozenset({"--mapping.images"}))


def parse(argv: list[str] | None = None):
    """(FrontDoorConfig, log level) of the command line; a mistake is one line and exit 2."""
    from lerobot_zenoh.command_line import check_log_level, parse as parse_flags, warn_old_spellings
    from lerobot_zenoh.cli.settings_flags import settings_values
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.openpi.front_door import FrontDoorConfig

    args = sys.argv[1:] if argv is None else list(argv)
    warn_old_spellings(PROG, args, {"--log-level": "--log_level", "--config": "--config_path"})
    flags = parse_flags(flags_class(), args, PROG, spellings())
    check_log_level(flags.log_level)
    data = settings_values(flags, FrontDoorConfig)
    if flags.token_file:
        try:
            data["token"] = Path(flags.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError("token_file", str(exc)) from None
    return FrontDoorConfig(**data), flags.log_level


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import EXIT_CONFIG, explain, fail, require_extra, serve_until_stopped
    from lerobot_zenoh.errors import ConfigError

    try:
        config, level = parse(argv)
    except ConfigError as exc:
        fail(PROG, explain(exc), EXIT_CONFIG)
    require_extra(PROG, "openpi", "websockets")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lerobot_zenoh.openpi.front_door import FrontDoor

    scheme = "wss" if config.tls_certificate else "ws"
    loopback = " (loopback only)" if config.host in ("127.0.0.1", "localhost", "::1") else ""
    return serve_until_stopped(PROG, FrontDoor(config),
                               lambda door: f"listening on {scheme}://{config.host}:{door.port}{loopback}")


if __name__ == "__main__":
    sys.exit(main())
