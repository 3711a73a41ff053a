"""Record what a robot saw and did into a local LeRobotDataset, then open it with LeRobot.

    python examples/record_and_open_dataset.py --seconds 5 --root outputs/example_dataset

The recorder stores the raw observations (not the JPEG-degraded ones sent to the server) and the
actions actually executed, through LeRobot's own `build_dataset_frame` + `add_frame`, on a writer
thread that never stalls the control loop. From the CLI the same is `--dataset.repo_id=...
--dataset.root=...` on `lerobot-robot-client` (LeRobot's own `lerobot-record` flags; docs/client.md).
"""

from __future__ import annotations

import argparse
import shutil
import socket
from pathlib import Path

from lerobot.datasets.lerobot_dataset import LeRobotDataset
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
from lerobot_zenoh.client.recorder import DatasetRecorder
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.settings import ZenohSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--root", default="outputs/example_dataset")
    args = parser.parse_args()
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)  # the recorder creates a new dataset

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cameras = {"front": (96, 128), "wrist": (96, 128)}
    manifest = parse_manifest({
        "cluster_uuid": "local", "experiment_tag": "example", "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": "policy", "model_version": "v1", "application_tag": "record", "fps": 30,
                    "synthetic": {"cameras": cameras, "latency_ms": 30}, "clients": [{"client_uuid": "recorder_bot"}]}],
    })
    config = RobotClientConfig(
        robot=SimRobotConfig(cameras=cameras), client_uuid="recorder_bot", cluster_uuid="local",
        experiment_tag="example", model_id="policy", model_version="v1", application_tag="record",
        endpoint=f"tcp/127.0.0.1:{port}", zenoh=ZenohSettings(multicast_scouting=False), task="wave")
    with PolicyServer(manifest):
        robot = make_robot_from_config(config.robot)
        recorder = DatasetRecorder("local/example", root, config.fps, robot, config.task)
        client = RobotClient(config, robot, recorder).start()
        recorder.start()
        try:
            client.run(duration_s=args.seconds)
        finally:
            client.close()  # saves the episode and finalizes the dataset

    dataset = LeRobotDataset("local/example", root=root, video_backend="pyav")
    frame = dataset[0]
    print(f"{dataset.num_episodes} episode(s), {dataset.num_frames} frames (client executed {client.counters.steps} steps)")
    print("features:", sorted(dataset.features))
    print("first frame:", {k: tuple(v.shape) if hasattr(v, "shape") else v for k, v in frame.items()})


if __name__ == "__main__":
    main()
