"""`lerobot-robot-client --robot.type=... --client_uuid=...`: drive one robot from a policy server.

Exit codes: 0 after a normal run or SIGINT/SIGTERM (robot left in its fail-safe state, dataset
saved); 2 for a configuration mistake, printed in one line naming the flag or the device (a bad
value, an unknown or missing flag, a robot that cannot be found or opened); 3 when no server
drives this robot (nothing answers at the endpoint, no server answers the app's status key, the
server does not serve this client id, or it is incompatible with the robot), and no action was sent.

`--pipeline.plan=plan.json` runs this robot's multi-model task as planned by lerobot-zenoh-plan
(client/pipeline.py, docs/pipelines.md).

`--plugins=my_package.my_module` imports modules before parsing, so that choices they register
(an aggregation function, a robot) can be named on the command line.
"""

from __future__ import annotations

import logging
import os
import re
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


PROG = "lerobot-robot-client"


def parse_config(argv: list[str] | None = None):
    from lerobot.utils.import_utils import register_third_party_plugins

    import lerobot_zenoh.client.sim_robot  # noqa: F401  (registers --robot.type=zenoh_sim)
    from lerobot_zenoh.cli.parsing import UsageError, fail, parse
    from lerobot_zenoh.client.config import RobotClientConfig

    register_lerobot_robots()
    register_third_party_plugins()  # lerobot_robot_* packages, as LeRobot's own CLIs do
    try:
        argv = import_plugins(sys.argv[1:] if argv is None else list(argv))
    except ImportError as exc:
        fail(PROG, str(UsageError("--plugins", f"cannot import {exc.name or exc}: {exc}")))
    return parse(RobotClientConfig, argv, PROG)


def make_robot(config):
    """The robot of `--robot.*`, connected; a missing driver or device is one line and exit 2."""
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.cli.parsing import fail

    kind = config.robot.type
    port = getattr(config.robot, "port", None)
    if isinstance(port, str) and port.startswith("/dev/") and not os.path.exists(port):
        fail(PROG, f"--robot.port: {port} does not exist: is the robot plugged in and powered? "
                   "(lerobot-find-port lists the serial ports)")
    try:
        robot = make_robot_from_config(config.robot)
    except ImportError as exc:  # e.g. feetech-servo-sdk, dynamixel-sdk
        m = re.search(r"'([\w.\[\]-]+)' is required", str(exc))
        missing = m.group(1) if m else (exc.name or "a driver")
        fail(PROG, f"--robot.type: this robot needs {missing}, which is not installed: "
                   "pip install 'lerobot-zenoh[hardware]' (LeRobot's feetech and dynamixel motor drivers)")
    except Exception as exc:  # noqa: BLE001 - any robot's own config check
        fail(PROG, f"--robot: {_first_line(exc)}")
    try:
        robot.connect()
    except Exception as exc:  # noqa: BLE001 - serial, camera, calibration, network robots: all one line
        where = f" at {port}" if port else ""
        fail(PROG, f"--robot: cannot connect to the {kind}{where}: {_first_line(exc)}")
    return robot


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.cli.parsing import EXIT_CONFIG, EXIT_NO_SERVER
    from lerobot_zenoh.errors import CompatibilityError, LeRobotZenohError

    config = parse_config(argv)
    plan = None
    if config.pipeline.plan:  # a multi-model task: the plan names the servers, rates and fps
        from lerobot_zenoh.cli.parsing import fail
        from lerobot_zenoh.client.pipeline import configure
        from lerobot_zenoh.errors import ConfigError
        from lerobot_zenoh.pipelines.robot_plan import load_robot_plan

        try:
            plan = load_robot_plan(config.pipeline.plan, config.client_uuid)
            config = configure(config, plan)
        except ConfigError as exc:
            fail(PROG, str(exc).replace("\n", " "))
    logging.basicConfig(level=config.log_level.upper(),
                        force=True, format=f"%(asctime)s %(levelname)s [{config.client_uuid}] %(name)s: %(message)s")
    log = logging.getLogger(PROG)

    from lerobot_zenoh.client.client import RobotClient

    robot = make_robot(config)
    recorder = None
    if config.dataset is not None:
        from lerobot_zenoh.client.recorder import DatasetRecorder

        recorder = DatasetRecorder.from_config(config.dataset, config.dataset_root, robot, config.task_text,
                                               resume=config.resume)
    if plan is not None:
        from lerobot_zenoh.client.pipeline import PipelineClient

        client = PipelineClient(config, robot, plan, recorder)
    else:
        client = RobotClient(config, robot, recorder)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: client.stop())
    code = 0
    try:
        if recorder is not None:
            recorder.check_root()  # a mistake to report before waiting for a server
        client.start()
        if recorder is not None:
            recorder.start()
        client.run()
    except CompatibilityError as exc:
        log.error("not starting: %s", exc)
        code = EXIT_NO_SERVER
    except LeRobotZenohError as exc:
        from lerobot_zenoh.cli.parsing import explain

        log.error("%s", explain(exc))
        code = EXIT_CONFIG
    finally:
        client.close()
        if robot.is_connected:
            robot.disconnect()
        if config.summary_path:
            client.write_summary(config.summary_path)
        try:
            log.info("%s", summary_line(client.summary()))
        except Exception:  # a summary is never worth a traceback at exit
            log.debug("no summary", exc_info=True)
    return code


def summary_line(summary: dict) -> str:
    """One line at exit: what the robot did, and for a multi-model task each component's SLO."""
    line = (f"{summary['client_uuid']}: {summary['steps']} steps, {summary['actions_executed']} actions executed, "
            f"{summary['chunks_received']} chunks, {summary['empty_buffer_cycles']} steps with an empty buffer, "
            f"{summary['requests_unanswered']} requests unanswered")
    if summary.get("rtt_ms_p50") is not None:
        line += f", RTT p50 {summary['rtt_ms_p50']:.1f} ms"
    pipeline = summary.get("pipeline") or {}
    comps = sorted({k.split(".")[1] for k in pipeline if k.startswith("slo.")})
    if comps:
        slo = ", ".join(f"{c} {pipeline.get(f'slo.{c}.met', 0)}/{pipeline.get(f'slo.{c}.requests', 0)}"
                        for c in comps)
        line += f"; in SLO (met/asked): {slo}; attempts {pipeline.get('attempts', 0)}"
    return line


if __name__ == "__main__":
    sys.exit(main())
