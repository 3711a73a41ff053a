"""Discovery and validation: reach the network, ask the server what it serves, compare with the robot.

Pure comparison (`compare`), a bounded wait for the first Zenoh connection (`wait_connected`), and
one bounded query loop (`discover`). The status query carries the client's id (selector parameter
`client=<id>`); the server answers with `client_admitted`, so a client the server does not serve
is refused at start-up instead of holding its robot waiting for chunks that never come.
"""

from __future__ import annotations

import itertools
import logging
import re
import time
from dataclasses import dataclass

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import APP_FIELDS, AppKey
from lerobot_zenoh.protocol.messages import Status
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.protocol.reasons import OutputKind
from lerobot_zenoh.telemetry.publisher import worth_logging

log = logging.getLogger(__name__)
#: Undecodable status replies seen by this process: anything on the status key can answer, as
#: often as it is asked (a retrying discovery asks every 50 ms), so they are logged 1, 10, 100, ...
_undecodable = itertools.count(1)


@dataclass(frozen=True)
class RobotFeatures:
    """What a LeRobot robot produces and takes, in the order the wire uses."""

    state_names: tuple[str, ...]  # scalar observation features, in the robot's order
    cameras: dict[str, tuple[int, int]]  # camera name -> (H, W)
    action_names: tuple[str, ...]

    @classmethod
    def of(cls, robot) -> RobotFeatures:
        obs = robot.observation_features
        state = tuple(k for k, v in obs.items() if not isinstance(v, tuple))
        cams = {k: (int(v[0]), int(v[1])) for k, v in obs.items() if isinstance(v, tuple)}
        return cls(state, cams, tuple(robot.action_features))


def compare(status: Status, robot: RobotFeatures, fps: int) -> list[str]:
    """Every difference between what the server expects and what the robot has (empty: compatible)."""
    problems: list[str] = []
    if status.client_admitted is False:
        problems.append(NOT_ADMITTED)
    problems += camera_problems(status, robot.cameras)
    if status.action_dim != len(robot.action_names):
        problems.append(f"action_dim: server produces {status.action_dim}, robot takes {len(robot.action_names)}")
    if status.state_dim is not None and status.state_dim != len(robot.state_names):
        problems.append(f"state_dim: server expects {status.state_dim}, robot has {len(robot.state_names)}")
    problems += fps_problems(status, fps)
    return problems


NOT_ADMITTED = ("it does not serve this client id: list it under the model's `clients` in the server's manifest "
                "(or set accept_unknown_clients)")


#: The flag a user changes for each kind of `compare` difference (by its first word).
_PROBLEM_FLAGS = {"cameras:": "--robot.cameras", "camera": "--robot.cameras", "action_dim:": "--robot.type",
                  "state_dim:": "--robot.type", "fps:": "--fps", "it": "--client_uuid"}


def with_flag(problem: str) -> str:
    """A `compare` difference led by the flag to change (`--robot.type: action_dim: server produces 4,
    robot takes 6`): the robot's cameras, its type (state and actions), --fps, the client id."""
    flag = _PROBLEM_FLAGS.get(problem.split(" ", 1)[0])
    return f"{flag}: {problem}" if flag else problem


def camera_problems(status: Status, cameras: dict[str, tuple[int, int] | None]) -> list[str]:
    """The cameras' differences (names, then (H, W) where the robot's is known: None is not)."""
    if set(status.expected_cameras) != set(cameras):
        return [f"cameras: server expects {sorted(status.expected_cameras)}, robot has {sorted(cameras)}"]
    problems = []
    for name in sorted(cameras):
        shape = cameras[name]
        if shape is not None and tuple(status.expected_cameras[name]) != tuple(shape):
            h, w = status.expected_cameras[name]
            problems.append(f"camera {name!r}: server expects {h}x{w}, robot gives {shape[0]}x{shape[1]}")
    return problems


def fps_problems(status: Status, fps: int) -> list[str]:
    return [f"fps: server model runs at {status.fps}, client at {fps}"] if status.fps is not None and status.fps != fps else []


def preflight_problems(status: Status, client_uuid: str, fps: int,
                       cameras: dict[str, tuple[int, int] | None] | None, task_flag: str = "--task") -> list[str]:
    """What the server's status (queried naming the client and the task) settles before LeRobot is
    imported and the robot opened, each naming the flag to change: the client id, --fps, the
    cameras when the command line says them (`cameras` None: not known before the robot is
    opened), and a task over the model's token limit (`task_tokens`, counted by the server with the
    model's own tokenizer, against `max_task_tokens`). The robot's own shapes (state, actions) are
    compared once it is open (`compare`)."""
    problems = []
    if status.client_admitted is False:
        problems.append(f"--client_uuid: server {status.server_id or '?'} does not serve client {client_uuid!r}: list "
                        "it under the model's `clients` in the server's manifest (or set accept_unknown_clients)")
    problems += [f"--{p}" for p in fps_problems(status, fps)]
    if cameras is not None:
        problems += [f"--robot.{p}" if p.startswith("cameras:") else f"--robot.cameras: {p}"
                     for p in camera_problems(status, cameras)]
    limit, tokens = status.max_task_tokens, status.task_tokens
    if limit is not None and tokens is not None and tokens > limit:
        problems.append(f"{task_flag}: the task is {tokens} tokens, {status.policy_type or 'the model'} reads at most "
                        f"{limit} (task_too_long)")
    return problems


def as_endpoint(value: str) -> str | None:
    """A Zenoh endpoint from `tcp/host:port` (as is) or LeRobot's `host:port` (tcp); None if neither."""
    value = value.strip()
    if re.match(r"^[a-z][a-z0-9-]*/\S+$", value):
        return value
    if re.match(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):\d{1,5}$", value):
        return f"tcp/{value}"
    return None


def wait_connected(session: ZenohSession, endpoints: list[str], timeout_s: float = 2.0) -> bool:
    """True once the session is linked to some peer or router (at once when no endpoint is given)."""
    if not endpoints:
        return True
    info = session.raw.info
    deadline = time.monotonic() + timeout_s
    while True:
        if any(True for _ in info.peers_zid()) or any(True for _ in info.routers_zid()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def query_status(session: ZenohSession, app: AppKey, timeout_s: float = 0.5, client_uuid: str | None = None,
                 task: str | None = None) -> Status | None:
    """One status query (naming the client, and the task whose tokens the server counts, if given);
    the first decodable reply, or None."""
    from urllib.parse import quote

    asked = ([f"client={client_uuid}"] if client_uuid else []) + ([f"task={quote(task, safe='')}"] if task else [])
    parameters = ";".join(asked) or None
    for _, payload in session.query(app.status, timeout_s=timeout_s, parameters=parameters):
        try:
            return codec.decode_status(payload)
        except ProtocolError as exc:
            n = next(_undecodable)
            if worth_logging(n):
                log.warning("ignoring an undecodable status reply on %s: %s [%d so far]", app.status, exc, n)
    return None


def discover(session: ZenohSession, app: AppKey, timeout_s: float, stop=None, client_uuid: str | None = None) -> Status | None:
    """Retry the status query until answered, `timeout_s` passes, or `stop` (an Event) is set."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        status = query_status(session, app, timeout_s=min(0.5, max(0.05, deadline - time.monotonic())),
                              client_uuid=client_uuid)
        if status is not None:
            return status
        time.sleep(0.05)
    return None


# -- finding the application at an endpoint (docs/client.md, "Finding the server") ---------------

#: How long the applications an endpoint serves must keep not including the one asked for before the
#: client gives up: a server declares all its models within milliseconds of each other.
OTHERS_GRACE_S = 0.5


@dataclass(frozen=True)
class ServedApp:
    """One application an endpoint serves, as its status query answered."""

    app: AppKey
    status: Status

    def flags(self) -> str:
        """The client flags that route to it."""
        a = self.app
        return (f"--cluster_uuid={a.cluster} --experiment_tag={a.experiment} --model_id={a.model} "
                f"--model_version={a.version} --application_tag={a.app}")

    def describe(self) -> str:
        """One line: the key, the server and what the model needs (`lerobot-robot-client --list`)."""
        s = self.status
        cams = ", ".join(f"{k} {h}x{w}" for k, (h, w) in sorted(s.expected_cameras.items())) or "none"
        state = "?" if s.state_dim is None else s.state_dim
        clients = "any client" if s.accepts_unknown_clients else "listed clients"
        tokens = f"  task at most {s.max_task_tokens} tokens" if s.max_task_tokens else ""
        return (f"{self.app.prefix}  server {s.server_id or '?'}  {s.policy_type or '?'} ({s.output or 'actions'})  "
                f"fps {s.fps or '?'}  state {state}  actions {s.action_dim}  cameras {cams}  {clients}{tokens}")


def list_apps(session: ZenohSession, selector: str, timeout_s: float = 1.0) -> list[ServedApp]:
    """Every application answering a status query on `selector` (keys.status_selector), sorted."""
    from lerobot_zenoh.errors import KeyExprError
    from lerobot_zenoh.protocol.keys import parse_key

    found: dict[str, ServedApp] = {}
    for key, payload in session.query(selector, timeout_s=timeout_s):
        try:
            found.setdefault(key, ServedApp(parse_key(key).app, codec.decode_status(payload)))
        except (ProtocolError, KeyExprError) as exc:
            log.warning("ignoring an undecodable status reply on %s: %s", key, exc)
    return [found[k] for k in sorted(found)]


def choose_app(served: list[ServedApp], given: dict[str, str]) -> tuple[ServedApp | None, str | None]:
    """The one application of `served` that fits the routing flags `given` (client config field ->
    value), or why none can be chosen (None while nothing is served at all)."""
    def fits(s: ServedApp) -> bool:
        chunks = (s.app.cluster, s.app.experiment, s.app.model, s.app.version, s.app.app)
        return all(given.get(n) in (None, c) for n, c in zip(APP_FIELDS, chunks))

    if not served:
        return None, None
    actions = [s for s in served if s.status.output in (None, OutputKind.ACTIONS)]
    matching = [s for s in actions if fits(s)]
    if len(matching) == 1:
        return matching[0], None
    listing = "; ".join(s.app.prefix + ("" if s in actions else f" ({s.status.output})") for s in served)
    if not matching:
        asked = " ".join(f"--{n}={v}" for n, v in given.items()) or "an application serving actions"
        return None, f"the endpoint does not serve {asked}; it serves: {listing}"
    return None, (f"{len(matching)} applications fit; name one with --model_id (and --application_tag, ...): "
                  f"{'; '.join(s.app.prefix for s in matching)} (lerobot-robot-client --list shows them)")


def find_app(session: ZenohSession, given: dict[str, str], timeout_s: float, stop=None) -> ServedApp:
    """The application the routing flags `given` name, found at the endpoint within `timeout_s`.

    Everything the endpoint serves is asked for at once. While nothing answers (a server still
    loading), keep asking until `timeout_s`; once applications answer but none fits (or several do),
    wait `OTHERS_GRACE_S` more, then raise `CompatibilityError` listing them (the robot is never driven)."""
    from lerobot_zenoh.errors import CompatibilityError
    from lerobot_zenoh.protocol.keys import status_selector

    everything = status_selector()  # a mismatch can then say what is there
    # All five given: the app's own key first (an access-control list may refuse the wildcard).
    exact = status_selector(*(given.get(n) for n in APP_FIELDS)) if len(given) == len(APP_FIELDS) else None
    deadline = time.monotonic() + timeout_s
    give_up_at = None
    why = None
    while not (stop is not None and stop.is_set()):
        wait_s = min(1.0, max(0.1, deadline - time.monotonic()))
        served = list_apps(session, exact, timeout_s=wait_s) if exact else []
        served = served or list_apps(session, everything, timeout_s=wait_s)
        chosen, why = choose_app(served, given)
        if chosen is not None:
            return chosen
        now = time.monotonic()
        if why is not None:
            give_up_at = give_up_at or min(deadline, now + OTHERS_GRACE_S)
        if now >= (give_up_at or deadline):
            break
        time.sleep(0.1)
    if stop is not None and stop.is_set():
        raise CompatibilityError("stopped (SIGINT/SIGTERM) before a server answered")
    if why is None:
        raise CompatibilityError(f"no server answers at the endpoint within {timeout_s:.0f} s (is one serving "
                                 "there, still loading, or behind another router?)")
    raise CompatibilityError(why)
