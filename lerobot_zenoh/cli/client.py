"""`lerobot-robot-client --robot.type=... --client_uuid=...`: drive one robot from a policy server.

Exit codes: 0 after a normal run or SIGINT/SIGTERM (robot left in its fail-safe state, dataset
saved); 2 for a configuration mistake, printed in one line naming the flag or the device (a bad
value, an unknown or missing flag, a robot that cannot be found or opened); 3 when no server
drives this robot (nothing answers at the endpoint, no server answers the app's status key, the
server does not serve this client id, or it is incompatible with the robot: --fps, the cameras, the
task's tokens), and no action was sent; or (protocol 1.5) the server refuses every request like
this robot's (a Refusal: `stopped: --task: the task is 145 tokens, ...`), the robot left in its
fail-safe state.

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

#: Flags of the robot and of the dataset: parsed against LeRobot's configurations (slow: they import torch).
LEROBOT_GROUPS = ("robot", "dataset")


def parse_config(argv: list[str] | None = None):
    """The full configuration (imports LeRobot). Mistakes the fast pass (`preflight`) cannot see,
    such as a LeRobot robot's own flags, are one line here."""
    from lerobot.utils.import_utils import register_third_party_plugins

    import lerobot_zenoh.client.sim_robot  # noqa: F401  (registers --robot.type=zenoh_sim)
    from lerobot_zenoh.command_line import CONNECT_SPELLINGS, UsageError, fail, parse
    from lerobot_zenoh.client.config import RobotClientConfig

    register_lerobot_robots()
    register_third_party_plugins()  # lerobot_robot_* packages, as LeRobot's own CLIs do
    try:
        argv = import_plugins(sys.argv[1:] if argv is None else list(argv))
    except ImportError as exc:
        fail(PROG, str(UsageError("--plugins", f"cannot import {exc.name or exc}: {exc}")))
    config = parse(RobotClientConfig, argv, PROG, CONNECT_SPELLINGS)
    if config.dataset is not None and not config.resume:
        # LeRobot's own rule: a new recording's repo_id gets a date-time tag unless --dataset.no_stamp
        # (our default: true, so that LeRobotDataset(repo_id) finds what was recorded).
        config.dataset.stamp_repo_id()
    return config


# -- the fast pass: everything that can be checked before LeRobot (and torch) is imported -----------

def split_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the client's own arguments, {flag: value} of the --robot.* and --dataset.* ones). A value may
    follow its flag as the next argument (`--robot.type so101_follower`), as draccus accepts."""
    own: list[str] = []
    lerobot: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        name, eq, value = arg.partition("=")
        if name.startswith("--") and name[2:].split(".")[0] in LEROBOT_GROUPS:
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            lerobot[name] = value
        else:
            own.append(arg)
    return own, lerobot


def lerobot_robot_types() -> set[str]:
    """The --robot.type choices of LeRobot's robot packages (LEROBOT_ROBOT_PACKAGES) and of this
    project, read from their source files' `register_subclass("...")` lines: importing them takes
    seconds (torch); reading them, milliseconds. A package whose import fails later is not a choice
    then, which the full parse reports."""
    import importlib.util
    from pathlib import Path

    names = {"zenoh_sim"}
    spec = importlib.util.find_spec("lerobot")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for package in LEROBOT_ROBOT_PACKAGES:
            for source in (Path(folder) / "robots" / package).glob("*.py"):
                try:
                    text = source.read_text(errors="replace")
                except OSError:
                    continue
                names.update(re.findall(r"register_subclass\(\s*[\"'](\w+)[\"']", text))
    return names


def robot_plugins_installed() -> bool:
    """Whether a LeRobot plugin distribution (lerobot_robot_*, ...) may register more robot types."""
    from importlib import metadata

    prefixes = ("lerobot_robot_", "lerobot_teleoperator_", "lerobot_camera_")
    return any((d.metadata["Name"] or "").startswith(prefixes) for d in metadata.distributions())


def check_robot_type(robot_type: str) -> None:
    """Exit 2 in one line when no robot of `robot_type` can exist here. Types registered by a plugin
    (`--plugins`, or a lerobot_robot_* distribution) are left to the full parse."""
    from lerobot_zenoh.command_line import fail

    known = lerobot_robot_types()
    if robot_type in known:
        return
    if "lerobot.robots" in sys.modules:  # a --plugins module imported LeRobot's registry: ask it
        from lerobot.robots import RobotConfig

        if robot_type in RobotConfig.get_known_choices():
            return
    if robot_plugins_installed():
        return
    import difflib

    near = difflib.get_close_matches(robot_type, sorted(known), n=1)
    hint = f"did you mean {near[0]}? " if near else ""
    fail(PROG, f"--robot.type: {robot_type!r} is not a robot type here ({hint}--help lists the types; a plugin's "
               "robot: install its lerobot_robot_* package, or --plugins=your.module)")


def preflight(argv: list[str]):
    """(the client's own options, the robot's cameras as its flags say them (`cameras_from_flags`),
    (the flag giving the task, the task)), parsed and checked without LeRobot (client/options.py),
    after the mistakes of --robot.* and --dataset.* that need no LeRobot: a missing or unknown
    --robot.type, a serial port that does not exist, a dataset id that is not <user>/<name>, a
    dataset folder that cannot be written, a task over 2,048 bytes. Each is one line and exit 2
    (`fail`). None when a --config_path file (read by draccus only) may hold any of them."""
    from lerobot_zenoh.command_line import CONNECT_SPELLINGS, explain, fail, parse
    from lerobot_zenoh.client.options import ClientOptions, check_dataset_root, check_task_bytes, default_dataset_root
    from lerobot_zenoh.errors import ConfigError

    if any(a.split("=", 1)[0] == "--config_path" for a in argv):
        return None
    own, lerobot = split_flags(argv)
    options = parse(ClientOptions, own, PROG, CONNECT_SPELLINGS)
    if "--robot" not in lerobot:  # (a whole --robot={...} is left to draccus)
        robot_type = lerobot.get("--robot.type")
        if not robot_type:
            fail(PROG, "missing required flag --robot.type (e.g. --robot.type=so101_follower; --help lists the types)")
        check_robot_type(robot_type)
        port = lerobot.get("--robot.port")
        if port and port.startswith("/dev/") and not os.path.exists(port):
            fail(PROG, f"--robot.port: {port} does not exist: is the robot plugged in and powered? "
                       "(lerobot-find-port lists the serial ports)")
    dataset = {k.removeprefix("--dataset."): v for k, v in lerobot.items() if k.startswith("--dataset.")}
    try:
        if not dataset and "--dataset" not in lerobot:
            if options.resume:
                raise ConfigError("resume", "needs --dataset.repo_id (and --dataset.root if not the default)")
        elif "repo_id" in dataset:
            repo_id = dataset["repo_id"]
            if "/" not in repo_id:
                raise ConfigError("dataset.repo_id", f"expected <user>/<name>, e.g. local/pick_cube, got {repo_id!r}")
            single_task = dataset.get("single_task")
            if options.task and single_task and options.task != single_task:
                raise ConfigError("task", f"differs from --dataset.single_task ({single_task!r}); give one of them")
            if single_task and not options.task:
                check_task_bytes("dataset.single_task", single_task)
            from pathlib import Path

            root = Path(dataset["root"]).expanduser() if dataset.get("root") else default_dataset_root(repo_id)
            check_dataset_root(root, options.resume)
    except ConfigError as exc:
        fail(PROG, explain(exc))
    single_task = dataset.get("single_task", "")
    task = ("--task", options.task) if options.task else ("--dataset.single_task", single_task)
    return options, (cameras_from_flags(lerobot) if "--robot" not in lerobot else None), task


def lookup_early(options, stop, cameras: dict | None = None, task: tuple[str, str] | None = None) -> object | None:
    """With an endpoint or routers given (--endpoint, --server_address, --zenoh.connect): the
    application the routing flags name, found before LeRobot is imported, so that a dead endpoint or
    a server serving something else is reported in a second, and what its status settles (`discovery.preflight_problems`: this client id not served, --fps,
    the cameras the command line names, a task over the model's token limit: `task` is (its flag,
    the task), counted by the server) too. CompatibilityError for those; None while no server
    answers yet (one still loading: the client then opens its robot and waits for it as before, up
    to --discovery_timeout_s)."""
    from lerobot_zenoh.client.discovery import find_app, preflight_problems, query_status
    from lerobot_zenoh.errors import CompatibilityError

    with open_lookup_session(options) as session:
        try:
            served = find_app(session, options.routing_given, min(1.0, options.discovery_timeout_s), stop)
        except CompatibilityError as exc:
            if str(exc).startswith("no server answers"):
                return None
            raise
        flag, text = task or ("--task", "")
        status = query_status(session, served.app, timeout_s=min(1.0, options.discovery_timeout_s),
                              client_uuid=options.client_uuid, task=text or None)
    problems = preflight_problems(status or served.status, options.client_uuid, options.fps, cameras, flag)
    if problems:
        raise CompatibilityError("; ".join(problems))
    return served


def cameras_from_flags(lerobot: dict[str, str]) -> dict[str, tuple[int, int] | None] | None:
    """The robot's cameras as the command line says them, read without LeRobot: name -> (H, W), or
    None for a camera whose size its flags leave to the device. `--robot.cameras` as the simulated
    robot takes it (`{front: [96, 128]}`) or as LeRobot's robots do (`{front: {type: opencv, width:
    640, height: 480, ...}}`); the simulated robot's defaults without it. None when the cameras are
    not known before the robot is opened (another robot without --robot.cameras, or a value that
    does not read as one of those)."""
    import yaml

    from lerobot_zenoh.client.options import SIM_CAMERAS

    text = lerobot.get("--robot.cameras")
    if text is None:
        return dict(SIM_CAMERAS) if lerobot.get("--robot.type") == "zenoh_sim" else None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None  # draccus reports it
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        return None
    cameras: dict[str, tuple[int, int] | None] = {}
    for name, value in data.items():
        if isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
            cameras[name] = (value[0], value[1])
        elif isinstance(value, dict):  # a rotated camera's frames are (width, height): left to the robot
            h, w = value.get("height"), value.get("width")
            sized = isinstance(h, int) and isinstance(w, int) and value.get("rotation") in (None, 0, "NO_ROTATION")
            cameras[name] = (h, w) if sized else None
        else:
            return None
    return cameras


_SECTION = re.compile(r"^(?P<cls>\w+)(?: \['(?P<path>[\w.]+)'\])?:$")


def fast_help() -> str:
    """`--help` without LeRobot: the client's own options, the robot types (read from LeRobot's
    sources) and how to see a robot's or the dataset's options (those import LeRobot)."""
    from lerobot_zenoh.client.options import ClientOptions

    types = ", ".join(sorted(lerobot_robot_types()))
    text = short_help(ClientOptions, None, robot_types=f"--robot.type: one of {types} (or a plugin's)")
    return text.rstrip("\n") + (
        f"\n\nRecording a LeRobotDataset: --dataset.repo_id=<user>/<name> and lerobot-record's other --dataset.* "
        f"options; {PROG} --help --dataset lists them\n")


def short_help(config_class, robot_type: str | None, robot_types: str | None = None) -> str:
    """`--help`: this client's own options first, then the robot types; a robot's own options only
    for the `--robot.type` given (draccus would expand every robot LeRobot knows: 1,300 lines).
    `robot_types`: the line listing them, when `config_class` has no robot (fast_help)."""
    from lerobot_zenoh.command_line import help_text

    sections: list[tuple[str, str | None, list[str]]] = []  # (class, dotted path, lines)
    for line in help_text(config_class, PROG).splitlines():
        m = _SECTION.match(line)
        if m and not line.startswith("usage"):
            sections.append((m.group("cls"), m.group("path"), [line]))
        elif sections:
            sections[-1][2].append(line)
    chosen = None
    if robot_type is not None:
        from lerobot.robots import RobotConfig

        try:
            chosen = RobotConfig.get_choice_class(robot_type)
        except Exception:  # noqa: BLE001 - an unknown type: list the known ones below
            chosen = None
    nested = {f"robot.{f}" for f in getattr(chosen, "__dataclass_fields__", {})}
    own, robot_types, robot = [], [robot_types] if robot_types else [], []
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
    own = _tidy_choice_sections(own)
    robot = [_with_camera_help(section) for section in robot]
    if robot:
        robot_part = robot
    else:
        robot_part = [f"The options of one robot type: {PROG} --help --robot.type=so101_follower" +
                      (f" ({robot_type!r} is not a robot type LeRobot knows here)" if robot_type else "")]
    usage = (f"usage: {PROG} --robot.type=TYPE [--robot.*] [--endpoint=HOST:PORT] [options]\n"
             f"       {PROG} --list --endpoint=HOST:PORT")
    return "\n\n".join([usage, *own, EXTRA_HELP, *robot_types, *robot_part]) + "\n"


#: What the client takes besides its dataclass' flags (read before draccus parses the rest).
EXTRA_HELP = """Also:
  --list                Print every application the endpoint serves (with --endpoint), each with the
                        routing flags to paste here, and exit.
  --plugins MODULES     Import these modules first (comma-separated, e.g. my_pkg.blend): the
                        --aggregate.type or --robot.type choices they register can then be named.
  LeRobot async-inference flags (--pretrained_name_or_path, --policy_type, --policy_device,
  --chunk_size_threshold, --aggregate_fn_name) are answered with what does the same here;
  --server_address=HOST:PORT is --endpoint."""

#: The help of --robot.cameras when a LeRobot robot's config gives none.
CAMERAS_HELP = ("Camera name -> camera, e.g. '{front: {type: opencv, index_or_path: 0, width: 640, "
                "height: 480, fps: 30}}' (the server's status names the cameras and sizes its model takes)")


def _tidy_choice_sections(sections: list[str]) -> list[str]:
    """A choice group (`--aggregate.type`) as one section: draccus prints the group's description
    again above each choice, and says "Which type of AggregateConfig ['aggregate'] to use
    (default: None)" for the choice flag. A choice's section keeps only its own options (none:
    dropped), and the choice flag says its default."""
    out: list[str] = []
    described: dict[str, str] = {}  # dotted path -> the group's description
    for section in sections:
        head, _, body = section.partition("\n")
        m = _SECTION.match(head)
        path = m.group("path") if m else None
        description = body.split("\n\n", 1)[0] if body and not body.lstrip().startswith("--") else ""
        if path and path in described and description == described[path]:
            options = body[len(description):].strip("\n")
            if "--" in options:
                choice = re.sub(r"Config$", "", m.group("cls"))
                out.append(f"{head}\n  (with --{path}.type={_snake(choice)})\n\n{options}")
            continue
        if path and description:
            described[path] = description
        out.append(_choice_default(section, path))
    return out


def _choice_default(section: str, path: str | None) -> str:
    """The choice flag's developer text replaced by what it chooses, with its real default."""
    pattern = re.compile(r"Which type of \w+ \['[\w.]+'\] to use\s+\(default: None\)")
    if path is None or not pattern.search(section):
        return section
    from lerobot_zenoh.client.options import ClientOptions

    default = getattr(getattr(ClientOptions(), path, None), "type", None)
    return pattern.sub(f"Which one (default: {default})", section)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _with_camera_help(section: str) -> str:
    """A robot's `--robot.cameras` line given a help text when its config has none."""
    import textwrap

    text = textwrap.fill(CAMERAS_HELP, width=80, initial_indent=" " * 24, subsequent_indent=" " * 24)
    return re.sub(r"^(  --robot\.cameras [^\n]*)$(?!\n {20,}\S)", lambda m: f"{m.group(1)}\n{text}", section,
                  flags=re.M)


def make_robot(config):
    """The robot of `--robot.*`, connected; a missing driver or device is one line and exit 2."""
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.command_line import fail

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
    from lerobot_zenoh.command_line import EXIT_NO_SERVER, UsageError, fail, parse
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
    """Everything that needs no LeRobot first (flags, --help, the endpoint and what it serves), then
    LeRobot: the robot's own flags, the robot, the dataset."""
    import threading

    from lerobot_zenoh.command_line import (EXIT_CONFIG, EXIT_NO_SERVER, LEROBOT_CLIENT_FLAGS, UsageError,
                                           answer_foreign_flags, fail, require_role)
    from lerobot_zenoh.errors import CompatibilityError, LeRobotZenohError

    argv = sys.argv[1:] if argv is None else list(argv)
    answer_foreign_flags(PROG, argv, LEROBOT_CLIENT_FLAGS)  # LeRobot async-inference flags: their equivalent
    if "--list" in argv:
        return list_main(argv)
    require_role(PROG, "lerobot", "robot")
    try:
        argv = import_plugins(argv)
    except ImportError as exc:
        fail(PROG, str(UsageError("--plugins", f"cannot import {exc.name or exc}: {exc}")))
    if "-h" in argv or "--help" in argv:
        robot_type = next((a.split("=", 1)[1] for a in argv if a.startswith("--robot.type=")), None)
        if robot_type is None and not any(a.split("=")[0].split(".")[0] == "--dataset" for a in argv):
            print(fast_help(), end="")
        else:  # a robot's own options, or the dataset's: LeRobot's configurations
            from lerobot_zenoh.client.config import RobotClientConfig

            import lerobot_zenoh.client.sim_robot  # noqa: F401
            register_lerobot_robots()
            print(short_help(RobotClientConfig, robot_type))
        return 0
    options, cameras, task = preflight(argv) or (None, None, None)
    if options is not None and options.pipeline.plan:  # this robot in the plan: before LeRobot loads, too
        from lerobot_zenoh.errors import ConfigError
        from lerobot_zenoh.pipelines.robot_plan import load_robot_plan

        try:
            load_robot_plan(options.pipeline.plan, options.client_uuid)
        except ConfigError as exc:
            fail(PROG, str(exc).replace("\n", " "))
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    log = logging.getLogger(PROG)
    if options is not None:
        logging.basicConfig(level=options.log_level.upper(), force=True,
                            format=f"%(asctime)s %(levelname)s [{options.client_uuid}] %(name)s: %(message)s")
    served = None
    connect = options.zenoh_settings().connect if options is not None else []
    if connect and not options.pipeline.plan:  # --endpoint, --server_address or --zenoh.connect
        # Each "starting:" line names the step under way (make demo shows it while a robot starts).
        log.info("starting: asking %s what it serves", ", ".join(connect))
        try:
            served = lookup_early(options, stopped, cameras, task)
        except CompatibilityError as exc:
            if stopped.is_set():
                return 0
            log.error("not starting: %s", exc)
            return EXIT_NO_SERVER
        if stopped.is_set():
            return 0
        if served is None:  # linked, nothing serves there yet: waited for below, as without these checks
            log.info("starting: no server answers at %s yet; waiting for one (up to %.0f s) once the robot is open",
                     ", ".join(connect), options.discovery_timeout_s)
    log.info("starting: importing LeRobot")
    root = logging.getLogger()
    quiet = root.level > logging.DEBUG
    if quiet:  # what LeRobot logs while its configurations load (its video codec, ...) is not for the user
        saved = root.level
        root.setLevel(logging.WARNING)
    try:
        config = parse_config(argv)
    finally:
        if quiet:
            root.setLevel(saved)
    found_app = served is not None and len(config.routing_given) < 5  # (a routing flag left unset)
    if served is not None:
        config.use_app(served.app)
    plan = None
    if config.pipeline.plan:  # a multi-model task: the plan names the servers, rates and fps
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
    if found_app:
        log.info("the endpoint serves %s (server %s): using it", served.app.prefix, served.status.server_id)

    from lerobot_zenoh.client.client import RobotClient

    if config.dataset is not None:  # before waiting for a server or opening the robot
        from lerobot_zenoh.command_line import explain
        from lerobot_zenoh.client.options import check_dataset_root
        from lerobot_zenoh.errors import ConfigError

        try:
            check_dataset_root(config.dataset_root, config.resume)
        except ConfigError as exc:
            fail(PROG, explain(exc))
    log.info("starting: connecting the %s robot", config.robot.type)
    robot = make_robot(config)  # a robot mistake is reported before a wait for a server
    if stopped.is_set():  # Ctrl-C while LeRobot was loading
        robot.disconnect()
        return 0
    log.info("starting: asking the server for its status")
    if plan is None and served is None:
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
        refusal = getattr(client, "refusal", None)
        if refusal is not None:  # the server refuses every request like ours: stopped on its first answer
            log.error("stopped: %s", refusal_line(refusal))
            code = EXIT_NO_SERVER
    except CompatibilityError as exc:
        log.error("not starting: %s", exc)
        code = EXIT_NO_SERVER
    except LeRobotZenohError as exc:
        from lerobot_zenoh.command_line import explain

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


#: The flag a user changes for each reason a server refuses every request with (`REPEATING_REASONS`).
REFUSAL_FLAGS = {
    "task_too_long": "--task", "prompt_too_long": "--task", "text_over_token_limit": "--task",
    "wrong_cameras": "--robot.cameras", "wrong_image_shape": "--robot.cameras", "wrong_state_dim": "--robot.type",
    "client_mismatch": "--client_uuid", "nonce_required": "--client_uuid", "component_not_served": "--pipeline.plan",
    "unknown_client": "--client_uuid",
}


def refusal_line(refusal) -> str:
    """One line for a server's permanent refusal: the flag to change, the server's reason and detail."""
    flag = REFUSAL_FLAGS.get(refusal.reason)
    where = f"server {refusal.server_id}" if refusal.server_id else "the server"
    return (f"{flag + ': ' if flag else ''}{refusal.detail or refusal.reason} ({where} refuses every request like it: "
            f"{refusal.reason})")


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
