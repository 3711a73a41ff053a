"""A robot shut out of its server session, with and without drawing a new session nonce.

One real `PolicyServer` (synthetic policy) and one real `RobotClient` on the simulated robot, over
Zenoh on loopback. Once the robot is served, a second session publishes one forged observation on the
robot's key with the robot's own nonce and a seq_id 1000 ahead, within the server's bound on seq_id jumps
(an attacker on the LAN who read one plain-mode observation). The server serves it, and it becomes the session's newest: every later
request of the robot is `replayed` and goes unanswered. Side by side, for each
`--new_nonce_after_unanswered` value: how long after the forgery the robot got a chunk again
(docs/client.md, "Failures"). 0 is the behaviour without the renewal.

    python -m benchmarks.studies.session_renewal [--values 0,3,5] [--watch-s 30]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from lerobot.robots import make_robot_from_config

from benchmarks.common import free_port
from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings

CAMERAS = {"front": (48, 64), "wrist": (48, 64)}


def _until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def run_once(renew_after: int, watch_s: float) -> dict:
    port = free_port()
    app = AppKey("bench", f"renewal{port}", "m", "v1", "app")
    server = PolicyServer(parse_manifest({
        "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app, "fps": 30,
                    "accept_unknown_clients": True,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30, "cameras": CAMERAS,
                                  "latency_ms": 10.0}}],
    }))
    config = RobotClientConfig(robot=SimRobotConfig(cameras=dict(CAMERAS), fps=30), client_uuid="r1",
                               cluster_uuid=app.cluster, experiment_tag=app.experiment, model_id=app.model,
                               model_version=app.version, application_tag=app.app,
                               endpoint=f"tcp/127.0.0.1:{port}", zenoh=ZenohSettings(multicast_scouting=False),
                               fps=30, telemetry_period_s=0, log_level="ERROR",
                               new_nonce_after_unanswered=renew_after)
    served: list[int] = []
    with server, ZenohSession(ZenohSettings(connect=[f"tcp/127.0.0.1:{port}"], multicast_scouting=False)) as attacker:
        attacker.subscribe(app.client("r1").action, lambda k, b: served.append(codec.decode_action_chunk(b).response_to_seq_id))
        client = RobotClient(config, make_robot_from_config(config.robot)).start()
        runner = threading.Thread(target=client.run, kwargs={"duration_s": watch_s + 15})
        runner.start()
        try:
            if not _until(lambda: client.counters.chunks_received >= 3, 10):
                raise RuntimeError("the robot was never served")
            frame = np.zeros((48, 64, 3), np.uint8)
            forged = Observation(max(served) + 1000, "r1", np.zeros(6, np.float32),
                                 {cam: codec.encode_jpeg(frame, 80) for cam in CAMERAS}, "", ExecutionInfo(),
                                 episode_id=str(client.episode), session_nonce=client.session_nonce)
            attacker.publisher(app.client("r1").obs, OBSERVATION_QOS).put(
                codec.encode(forged), attachment=codec.encode_observation_header(forged))
            t_forged = time.perf_counter()
            poisoned = _until(lambda: forged.seq_id in served, 5)
            before = client.counters.chunks_received
            back = _until(lambda: client.counters.chunks_received > before, watch_s)
            return {"new_nonce_after_unanswered": renew_after, "forgery_served": poisoned,
                    "served_again_after_s": round(time.perf_counter() - t_forged, 2) if back else None,
                    "session_renewals": client.counters.session_renewals}
        finally:
            client.stop()
            runner.join(10)
            client.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", default="0,3,5", help="new_nonce_after_unanswered values, comma-separated")
    parser.add_argument("--watch-s", type=float, default=30.0, help="how long to wait for a chunk after the forgery")
    args = parser.parse_args(argv)
    print("new_nonce_after_unanswered  forgery served  served again after  renewals")
    for value in (int(v) for v in args.values.split(",")):
        r = run_once(value, args.watch_s)
        again = "never" if r["served_again_after_s"] is None else f"{r['served_again_after_s']:.2f} s"
        print(f"{value:>26}  {str(r['forgery_served']):>14}  {again:>18}  {r['session_renewals']:>8}"
              + ("" if r["served_again_after_s"] is not None else f" (watched {args.watch_s:g} s)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
