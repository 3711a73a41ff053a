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
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from lerobot_zenoh.transport.settings import ZenohSettings

# The client never needs the hub (it records locally): a hub lookup would only hang without network.
# An HF_HUB_OFFLINE the user set is kept.
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
    from lerobot_zenoh.cli.parsing import require_role

    require_role(PROG, "lerobot", "robot")
    from lerobot.utils.import_utils import register_third_party_plugins

    import lerobot_zenoh.client.sim_robot  # noqa: F401  (registers --robot.type=zenoh_sim)
    from lerobot_zenoh.cli.parsing import CONNECT_SPELLINGS, UsageError, fail, parse
    from lerobot_zenoh.client.config import RobotClientConfig

    register_lerobot_robots()
    register_third_party_plugins()  # lerobot_robot_* packages, as LeRobot's own CLIs do
    try:
        argv = import_plugins(sys.argv[1:] if argv is None else list(argv))
    except ImportError as exc:
        fail(PROG, str(UsageError("--plugins", f"cannot import {exc.name or exc}: {exc}")))
    if "-h" in argv or "--help" in argv:
        robot_type = next((a.split("=", 1)[1] for a in argv if a.startswith("--robot.type=")), None)
        print(short_help(RobotClientConfig, robot_type))
        raise SystemExit(0)
    config = parse(RobotClientConfig, argv, PROG, CONNECT_SPELLINGS)
    if config.dataset is not None and not config.resume:
        # LeRobot's own rule: a new recording's repo_id gets a date-time tag unless --dataset.no_stamp
        # (our default: true, so that LeRobotDataset(repo_id) finds what was recorded).
        config.dataset.stamp_repo_id()
    return config


_SECTION = re.compile(r"^(?P<cls>\w+)(?: \['(?P<path>[\w.]+)'\])?:$")


def short_help(config_class, robot_type: str | None) -> str:
    """`--help`: this client's own options first, then the robot types; a robot's own options only
    for the `--robot.type` given (draccus would expand every robot LeRobot knows: 1,300 lines)."""
    from lerobot.robots import RobotConfig

    from lerobot_zenoh.cli.parsing import help_text

    sections: list[tuple[str, str | None, list[str]]] = []  # (class, dotted path, lines)
    for line in help_text(config_class, PROG).splitlines():
        m = _SECTION.match(line)
        if m and not line.startswith("usage"):
            sections.append((m.group("cls"), m.group("path"), [line]))
        elif sections:
            sections[-1][2].append(line)
    chosen = None
    if robot_type is not None:
        try:
            chosen = RobotConfig.get_choice_class(robot_type)
        except Exception:  # noqa: BLE001 - an unknown type: list the known ones below
            chosen = None
    nested = {f"robot.{f}" for f in getattr(chosen, "__dataclass_fields__", {})}
    own, robot_types, robot = [], [], []
    for cls, path, lines in sections:
        if cls == config_class.__name__:
            own.append("\n".join([f"{PROG} options:", *lines[1:]]).rstrip())
        elif path == "robot" and cls == "RobotConfig":
            robot_types.append("\n".join(lines).rstrip())
        elif path and (path == "robot" or path.startswith("robot.")):
            section = "\n".join(lines).rstrip()
            if chosen is not None and ((path == "robot" and cls == chosen.__name__) or path in nested) \
                    and section not in robot:  # so100 and so101 share a class: its section appears twice
                robot.append(section)
        elif path is not None:
            own.append("\n".join(lines).rstrip())
    if robot:
        robot_part = robot
    else:
        robot_part = [f"The options of one robot type: {PROG} --help --robot.type=so101_follower" +
                      (f" ({robot_type!r} is not a robot type LeRobot knows here)" if robot_type else "")]
    usage = (f"usage: {PROG} --robot.type=TYPE [--robot.*] [--endpoint=HOST:PORT] [options]\n"
             f"       {PROG} --list --endpoint=HOST:PORT")
    return "\n\n".join([usage, *own, *robot_types, *robot_part]) + "\n"


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
        fail(PROG, f"--robot.type: this robot needs {missing}, which is not installed: pip install '.[hardware]' "
                   "in the lerobot-zenoh checkout (LeRobot's feetech and dynamixel motor drivers)")
    except Exception as exc:  # noqa: BLE001 - any robot's own config check
        fail(PROG, f"--robot: {_first_line(exc)}")
    try:
        robot.connect()
    except Exception as exc:  # noqa: BLE001 - serial, camera, calibration, network robots: all one line
        where = f" at {port}" if port else ""
        fail(PROG, f"--robot: cannot connect to the {kind}{where}: {_first_line(exc)}")
    return robot


def open_lookup_session(config):
    """A Zenoh session linked to the endpoint, opened as the client opens its own (client/link.py), or
    CompatibilityError saying nothing answers there."""
    from lerobot_zenoh.client.link import open_session

    return open_session(config.zenoh_settings(), config.discovery_timeout_s)


def resolve_app(config, stop=None) -> None:
    """Fill in the routing flags left unset from what the endpoint serves, or fail in one line listing
    what it serves instead (CompatibilityError; docs/client.md, "Finding the server")."""
    from lerobot_zenoh.client.discovery import find_app

    log = logging.getLogger(PROG)
    with open_lookup_session(config) as session:
        served = find_app(session, config.routing_given, config.discovery_timeout_s, stop)
    if len(config.routing_given) < 5:
        log.info("the endpoint serves %s (server %s): using it", served.app.prefix, served.status.server_id)
    config.use_app(served.app)


@dataclass
class ListConfig:
    # Where the server (or a Zenoh router) listens: tcp/HOST:PORT, or HOST:PORT.
    endpoint: str | None = None
    # LeRobot's async-inference name for --endpoint (HOST:PORT).
    server_address: str | None = None
    # The Zenoh session (the same block as the robot client's).
    zenoh: ZenohSettings = field(default_factory=ZenohSettings)
    # Seconds to wait for the servers' answers.
    timeout_s: float = 2.0
    # Print each application's client flags too (to paste into lerobot-robot-client).
    flags: bool = True


def list_main(argv: list[str]) -> int:
    """`lerobot-robot-client --list --endpoint=...`: every application the endpoint serves, one a line."""
    from lerobot_zenoh.cli.parsing import EXIT_NO_SERVER, UsageError, fail, parse
    from lerobot_zenoh.client.discovery import as_endpoint, list_apps
    from lerobot_zenoh.errors import CompatibilityError
    from lerobot_zenoh.protocol.keys import status_selector

    args = parse(ListConfig, [a for a in argv if a != "--list"], f"{PROG} --list")
    endpoint = args.endpoint or args.server_address
    if endpoint and as_endpoint(endpoint) is None:
        fail(PROG, str(UsageError("--endpoint", f"{endpoint!r} is neither tcp/HOST:PORT nor HOST:PORT")))
    lookup = SimpleNamespace(zenoh_settings=lambda: args.zenoh.with_connect(as_endpoint(endpoint or "") or None),
                             discovery_timeout_s=args.timeout_s)
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    try:
        with open_lookup_session(lookup) as session:
            served, deadline = [], time.monotonic() + args.timeout_s
            while not served and time.monotonic() < deadline:  # a server still loading answers later
                served = list_apps(session, status_selector(), timeout_s=min(1.0, args.timeout_s))
    except CompatibilityError as exc:
        fail(PROG, str(exc), EXIT_NO_SERVER)
    if not served:
        fail(PROG, f"nothing answers a status query at {endpoint or 'this network'} within {args.timeout_s:g} s",
             EXIT_NO_SERVER)
    for app in served:
        print(app.describe())
        if args.flags:
            print(f"    {app.flags()}")
    return 0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    from lerobot_zenoh.cli.parsing import EXIT_CONFIG, EXIT_NO_SERVER
    from lerobot_zenoh.errors import CompatibilityError, LeRobotZenohError

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--list" in argv:
        return list_main(argv)
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

    if config.dataset is not None:  # before waiting for a server or opening the robot
        from lerobot_zenoh.cli.parsing import explain, fail
        from lerobot_zenoh.client.recorder import check_dataset_root
        from lerobot_zenoh.errors import ConfigError

        try:
            check_dataset_root(config.dataset_root, config.resume)
        except ConfigError as exc:
            fail(PROG, explain(exc))
    robot = make_robot(config)  # a robot mistake is reported before the network is
    if plan is None:
        import threading

        stopped = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopped.set())
        try:
            resolve_app(config, stopped)
        except CompatibilityError as exc:
            if robot.is_connected:  # opened, never sent an action
                robot.disconnect()
            if stopped.is_set():
                return 0
            log.error("not starting: %s", exc)
            return EXIT_NO_SERVER
    recorder = None
    if config.dataset is not None:
        from lerobot_zenoh.client.recorder import DatasetRecorder

        recorder = DatasetRecorder.from_config(config.dataset, config.dataset_root, robot, config.task_text,
                                               resume=config.resume, quiet=config.log_level.upper() != "DEBUG")
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
