"""`lerobot-robot-client --robot.type=... --client_uuid=...`: drive one robot from a policy server.

Exit codes: 0 after a normal run or SIGINT/SIGTERM (robot left in its fail-safe state, dataset
saved); 2 for a bad configuration; 3 when no compatible server was found (no action was sent).

`--plugins=my_package.my_module` imports modules before parsing, so that choices they register
(an aggregation function, a robot) can be named on the command line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def import_plugins(argv: list[str]) -> list[str]:
    """Import modules named by `--plugins=a,b` (e.g. your own aggregation) and drop the option.

    Registration happens at import, so it must come before draccus sees `--aggregate.type=...`.
    """
    import importlib

    if os.getcwd() not in sys.path:  # as `python -m` does, so `--plugins=examples.x` works from a checkout
        sys.path.insert(0, os.getcwd())
    rest = []
    for arg in argv:
        if arg.startswith("--plugins="):
            for module in filter(None, arg.split("=", 1)[1].split(",")):
                importlib.import_module(module)
        else:
            rest.append(arg)
    return rest


# LeRobot's robots register their --robot.type choice when their package is imported; these are
# the ones lerobot-record imports. A robot whose optional dependencies are missing is skipped.
LEROBOT_ROBOT_PACKAGES = (
    "bi_openarm_follower", "bi_rebot_b601_follower", "bi_so_follower", "earthrover_mini_plus", "hope_jr",
    "koch_follower", "omx_follower", "openarm_follower", "reachy2", "rebot_b601_follower", "so_follower",
    "unitree_g1",
)


def register_lerobot_robots() -> None:
    import importlib

    for name in LEROBOT_ROBOT_PACKAGES:
        try:
            importlib.import_module(f"lerobot.robots.{name}")
        except Exception:  # noqa: BLE001 - an optional robot must not stop the others
            pass


def parse_config(argv: list[str] | None = None):
    import draccus
    from lerobot.utils.import_utils import register_third_party_plugins

    import lerobot_zenoh.client.sim_robot  # noqa: F401  (registers --robot.type=zenoh_sim)
    from lerobot_zenoh.client.config import RobotClientConfig

    register_lerobot_robots()
    register_third_party_plugins()  # lerobot_robot_* packages, as LeRobot's own CLIs do
    argv = import_plugins(sys.argv[1:] if argv is None else list(argv))
    return draccus.parse(config_class=RobotClientConfig, args=argv)


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.errors import CompatibilityError, ConfigError, LeRobotZenohError

    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"lerobot-robot-client: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        force=True, format=f"%(asctime)s %(levelname)s [{config.client_uuid}] %(name)s: %(message)s")
    log = logging.getLogger("lerobot-robot-client")

    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.client import RobotClient

    robot = make_robot_from_config(config.robot)
    recorder = None
    if config.dataset_repo_id:
        from lerobot_zenoh.client.recorder import DatasetRecorder

        from pathlib import Path

        root = config.dataset_root or Path("outputs/datasets") / config.dataset_repo_id
        recorder = DatasetRecorder(config.dataset_repo_id, root, config.fps, robot,
                                   config.task, use_videos=config.dataset_use_videos)
    client = RobotClient(config, robot, recorder)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: client.stop())
    code = 0
    try:
        client.start()
        if recorder is not None:
            recorder.start()
        client.run()
    except CompatibilityError as exc:
        log.error("not starting: %s", exc)
        code = 3
    except LeRobotZenohError as exc:
        log.error("%s", exc)
        code = 2
    finally:
        client.close()
        if robot.is_connected:
            robot.disconnect()
        if config.summary_path:
            client.write_summary(config.summary_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
