"""A fleet of simulated robots on one policy server, in one script (library API).

    python examples/fleet_on_one_server.py --robots 4 --seconds 10             # synthetic policy
    python examples/fleet_on_one_server.py --checkpoint checkpoints/demo_act    # a real ACT checkpoint

The server and every client talk over real Zenoh on loopback; each robot runs its own control loop
in a thread (in production each robot is its own process on its own machine: see `make demo`).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading

from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
from lerobot_zenoh.scheduling.action_buffer import AggregateConfig, WeightedAverageConfig
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.settings import ZenohSettings

CAMERAS = {"front": (96, 128), "wrist": (96, 128)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fleet(robots: int = 3, seconds: float = 10.0, checkpoint: str | None = None,
              aggregate: AggregateConfig | None = None, buffer_time_s: float | None = None) -> list[dict]:
    port = free_port()
    policy = ({"pretrained_path": checkpoint} if checkpoint else
              {"synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 50, "cameras": CAMERAS, "latency_ms": 40}})
    manifest = parse_manifest({
        "cluster_uuid": "local", "experiment_tag": "example", "server_id": "example-server",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": "policy", "model_version": "v1", "application_tag": "fleet", "fps": 30,
                    "accept_unknown_clients": True, **policy}],
    })
    summaries: list[dict] = []
    with PolicyServer(manifest):
        clients = []
        for i in range(robots):
            config = RobotClientConfig(
                robot=SimRobotConfig(cameras=dict(CAMERAS), seed=i), client_uuid=f"robot_{i + 1}",
                cluster_uuid="local", experiment_tag="example", model_id="policy", model_version="v1",
                application_tag="fleet", endpoint=f"tcp/127.0.0.1:{port}",
                zenoh=ZenohSettings(multicast_scouting=False), aggregate=aggregate or WeightedAverageConfig(),
                send=SendTriggerConfig(buffer_time_s=buffer_time_s))
            clients.append(RobotClient(config, make_robot_from_config(config.robot)).start())
        threads = [threading.Thread(target=c.run, kwargs={"duration_s": seconds}) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in clients:
            c.close()
            summaries.append(c.summary())
    for s in summaries:
        print(json.dumps({k: s[k] for k in ("client_uuid", "steps", "actions_executed", "chunks_received",
                                            "rtt_ms_p50", "empty_buffer_cycles", "blended_steps")}))
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--robots", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--checkpoint", help="a LeRobot checkpoint folder (default: a synthetic policy)")
    args = parser.parse_args()
    run_fleet(args.robots, args.seconds, args.checkpoint)


if __name__ == "__main__":
    main()
