"""Discovery and validation: reach the network, ask the server what it serves, compare with the robot.

Pure comparison (`compare`), a bounded wait for the first Zenoh connection (`wait_connected`), and
one bounded query loop (`discover`). The status query carries the client's id (selector parameter
`client=<id>`); a 1.1 server answers with `client_admitted`, so a client the server does not serve
is refused at start-up instead of holding its robot waiting for chunks that never come.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import Status
from lerobot_zenoh.transport.session import ZenohSession

log = logging.getLogger(__name__)


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
        problems.append("it does not serve this client id: list it under the model's `clients` in the "
                        "server's manifest (or set accept_unknown_clients)")
    if set(status.expected_cameras) != set(robot.cameras):
        problems.append(f"cameras: server expects {sorted(status.expected_cameras)}, robot has {sorted(robot.cameras)}")
    for name in sorted(set(status.expected_cameras) & set(robot.cameras)):
        if tuple(status.expected_cameras[name]) != robot.cameras[name]:
            h, w = status.expected_cameras[name]
            rh, rw = robot.cameras[name]
            problems.append(f"camera {name!r}: server expects {h}x{w}, robot gives {rh}x{rw}")
    if status.action_dim != len(robot.action_names):
        problems.append(f"action_dim: server produces {status.action_dim}, robot takes {len(robot.action_names)}")
    if status.state_dim is not None and status.state_dim != len(robot.state_names):
        problems.append(f"state_dim: server expects {status.state_dim}, robot has {len(robot.state_names)}")
    if status.fps is not None and status.fps != fps:
        problems.append(f"fps: server model runs at {status.fps}, client at {fps}")
    return problems


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


def query_status(session: ZenohSession, app: AppKey, timeout_s: float = 0.5, client_uuid: str | None = None) -> Status | None:
    """One status query (naming the client, if given); the first decodable reply, or None."""
    parameters = f"client={client_uuid}" if client_uuid else None
    for _, payload in session.query(app.status, timeout_s=timeout_s, parameters=parameters):
        try:
            return codec.decode_status(payload)
        except ProtocolError as exc:
            log.warning("ignoring an undecodable status reply on %s: %s", app.status, exc)
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
