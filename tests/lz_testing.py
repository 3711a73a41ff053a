"""Helpers shared by the test modules (on pytest's pythonpath; tests/ is not a package)."""

from __future__ import annotations

import time

from testbed.ports import free_port, free_port_range  # noqa: F401 (tests import them from here)
from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.settings import ZenohSettings


def wait_for(predicate, timeout_s: float = 10.0, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False


CAMS = {"front": (48, 64), "wrist": (48, 64)}


def make_server(port, app_key, latency_ms=10.0, cameras=CAMS, action_dim=6, chunk_size=30, rtc=False,
                history_length=1, clients=None, max_task_tokens=None, max_batch_size=None):
    """A synthetic-policy server on loopback; `clients`: the ids it serves (default: any), `max_task_tokens`:
    the task's word limit it simulates (task_too_long beyond), `max_batch_size`: requests it batches (default:
    the manifest's)."""
    extra = {} if max_task_tokens is None else {"max_task_tokens": max_task_tokens}
    batching = {} if max_batch_size is None else {"max_batch_size": max_batch_size}
    listed = {} if clients is None else {"accept_unknown_clients": False,
                                         "clients": [{"client_uuid": c} for c in clients]}
    return PolicyServer(parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{
            "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "synthetic": {"state_dim": 6, "action_dim": action_dim, "chunk_size": chunk_size,
                          "cameras": cameras, "latency_ms": latency_ms, "rtc": rtc,
                          "history_length": history_length, **extra},
            "fps": 30, "accept_unknown_clients": True, **listed, **batching,
        }],
    }))


def make_config(port, app_key, **kw):
    robot = kw.pop("robot", None) or SimRobotConfig(cameras=dict(CAMS), fps=30)
    return RobotClientConfig(
        robot=robot, client_uuid=kw.pop("client_uuid", "r1"), cluster_uuid=app_key.cluster,
        experiment_tag=app_key.experiment, model_id=app_key.model, model_version=app_key.version,
        application_tag=app_key.app, endpoint=kw.pop("endpoint", f"tcp/127.0.0.1:{port}"),
        zenoh=ZenohSettings(multicast_scouting=False), fps=30, **kw)


class TappedSession:
    """A real, open Zenoh session whose publishers call `on_put(key, payload, attachment)` before each
    put: a test hands it to `RobotClient(session_factory=...)` to count or slow what the client puts."""

    def __init__(self, session, on_put):
        self._session = session
        self._on_put = on_put

    def publisher(self, key, qos):
        return _TappedPublisher(self._session.publisher(key, qos), key, self._on_put)

    def __getattr__(self, name):
        return getattr(self._session, name)


class _TappedPublisher:
    def __init__(self, publisher, key, on_put):
        self._publisher, self._key, self._on_put = publisher, key, on_put

    def put(self, payload, attachment=None):
        self._on_put(self._key, payload, attachment)
        return self._publisher.put(payload, attachment=attachment)

    def __getattr__(self, name):
        return getattr(self._publisher, name)

