"""`lerobot-zenoh-ros2`: serve ROS 2 robots on rmw_zenoh from the fleet (docs/ros2.md).

    lerobot-zenoh-ros2 --config_path=ros2.yaml
    lerobot-zenoh-ros2 --config_path=ros2.yaml --endpoint=tcp/gpu-host:7447 --ros_endpoint=tcp/robot:7447

Every field of the door's settings (`Ros2DoorConfig`, lerobot_zenoh/ros2/door.py) is a flag,
generated from the class (cli/settings_flags.py); `--config_path` reads a YAML or JSON file of the
same fields (its `robots` list the mapping of each robot); a flag given overrides the file. Exit
codes (docs/client.md, "Command lines"): 0 when stopped by SIGINT/SIGTERM, 2 for a configuration
mistake or a mapping that does not fit the model (one line naming the field), 3 when no server
answers or it does not serve a robot's client id.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

PROG = "lerobot-zenoh-ros2"

HELP = {
    "endpoint": "Where the policy server (or a fleet router) listens, e.g. tcp/gpu-host:7447.",
    "cluster_uuid": "The served application's cluster_uuid; unset: taken from what the endpoint serves.",
    "experiment_tag": "The served application's experiment_tag; unset: taken from what the endpoint serves.",
    "model_id": "The served model's model_id; unset: taken from what the endpoint serves.",
    "model_version": "The served model's model_version; unset: taken from what the endpoint serves.",
    "application_tag": "The served application's application_tag; unset: taken from what the endpoint serves.",
    "zenoh": "More Zenoh settings of the fleet side (the --zenoh.* fields of the robot client: TLS, mode, ...), as a map.",
    "discovery_timeout_s": "How long to look for the served model at start-up before exit 3.",
    "jpeg_quality": "JPEG quality of raw camera images sent to the server (CompressedImage JPEGs pass as they are).",
    "telemetry_period_s": "Seconds between each robot's telemetry messages (0: none).",
    "ros_endpoint": "The robots' Zenoh: their router (rmw_zenohd, tcp/robot-host:7447) or a router routing for them.",
    "ros_zenoh": "More Zenoh settings of the ROS 2 side (the same fields as --zenoh: TLS, mode, ...), as a map.",
    "robots": "The ROS 2 robots and their topics (a list; see docs/ros2.md, 'The mapping'); usually in --config_path.",
}


def flags_class() -> type:
    """The draccus dataclass of the command line: the script's own flags, then Ros2DoorConfig's."""
    from lerobot_zenoh.cli.settings_flags import flags_dataclass
    from lerobot_zenoh.ros2.door import Ros2DoorConfig

    own = [("log_level", str, dataclasses.field(default="INFO", metadata={
        "help": "Logging level: DEBUG, INFO, WARNING or ERROR."}))]
    flags = flags_dataclass(Ros2DoorConfig, "Ros2FrontDoorFlags", own, HELP)
    flags.__doc__ = "The ROS 2 front door's settings (a --config_path file holds the same fields)."
    return flags


def parse(argv: list[str] | None = None):
    """(Ros2DoorConfig, log level) of the command line; a mistake is one line and exit 2."""
    from lerobot_zenoh.cli.settings_flags import settings_values
    from lerobot_zenoh.command_line import Spellings, check_log_level, parse as parse_flags
    from lerobot_zenoh.ros2.door import Ros2DoorConfig

    args = sys.argv[1:] if argv is None else list(argv)
    flags = parse_flags(flags_class(), args, PROG, Spellings())
    check_log_level(flags.log_level)
    return Ros2DoorConfig(**settings_values(flags, Ros2DoorConfig)), flags.log_level


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.command_line import EXIT_CONFIG, explain, fail, require_extra, serve_until_stopped
    from lerobot_zenoh.errors import ConfigError

    try:
        config, level = parse(argv)
    except ConfigError as exc:
        fail(PROG, explain(exc), EXIT_CONFIG)
    require_extra(PROG, "ros2", "rosbags", "lerobot")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lerobot_zenoh.ros2.door import Ros2Door

    robots = ", ".join(f"{r.client_uuid} (domain {r.domain_id}, {r.namespace})" for r in config.robots)
    return serve_until_stopped(PROG, Ros2Door(config),
                               lambda door: f"serving {robots} with {door.app.prefix} at {door.status.fps} fps")


if __name__ == "__main__":
    sys.exit(main())
