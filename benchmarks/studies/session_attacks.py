"""Scripted attacks on a robot's session in plain mode (docs/security.md, "Sessions against a forger").

A policy server (synthetic policy, 10 ms a pass, chunks of 30 at 30 Hz) serves one listed robot, the
reference `RobotClient` on the simulated robot. A second Zenoh session on the same port plays a LAN
attacker without a certificate: plain mode lets it put on the robot's observation key and read
what the robot sends (it subscribes to `…/robot/obs` to learn the robot's `session_nonce` and its
current `seq_id`). After `--warmup` seconds it attacks once (or streams, per scenario); the robot
runs on for `--seconds`.

Reported per scenario: the robot's control ticks with an empty buffer after the attack (the
robot held, nothing to execute) out of its ticks after the attack, the chunks it received after
the attack, and what the server refused and why.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.session_attacks [--seconds 20] [--scenarios ...]
"""

from __future__ import annotations

import argparse
import sys
import threading
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from testbed.ports import free_port  # noqa: E402
from lerobot_zenoh.client.client import RobotClient  # noqa: E402
from lerobot_zenoh.client.config import RobotClientConfig  # noqa: E402
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey  # noqa: E402
from lerobot_zenoh.protocol.messages import Observation  # noqa: E402
from lerobot_zenoh.server.config.manifest import parse_manifest  # noqa: E402
from lerobot_zenoh.server.shell.policy_server import PolicyServer  # noqa: E402
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import ZenohSettings, loopback_settings  # noqa: E402

CAMS = {"front": (48, 64)}
ROBOT = "robot"

# name -> (what the attacker sends, whether it streams at 20/s until the end)
SCENARIOS = {
    "nonceless_max_seq": "one observation, no session_nonce, seq_id 2**64-1 (the audit's packet)",
    "made_up_nonce_stream": "a stream at 20/s, a made-up session_nonce, seq_ids from 10**6 up",
    "sniffed_nonce_max_seq": "one observation, the robot's own session_nonce read off the wire, seq_id 2**64-1",
    "sniffed_nonce_ahead_500": "one observation, the robot's own session_nonce, seq_id 500 past the robot's",
}


class Sniffer:
    """What plain mode shows anyone on the path: the robot's nonce and newest seq_id."""

    def __init__(self, session: ZenohSession, key: str):
        self.nonce: int | None = None
        self.seq = 0
        session.subscribe(key, self._on, with_attachment=True)

    def _on(self, key, payload, attachment):
        if attachment is not None:
            header = codec.decode_observation_header(bytes(attachment))
            self.nonce, self.seq = header.session_nonce, max(self.seq, header.seq_id)


def forged(seq: int, nonce: int | None) -> tuple[bytes, bytes]:
    o = Observation(seq, ROBOT, np.zeros(6, np.float32),
                    {"front": codec.encode_jpeg(np.zeros((48, 64, 3), np.uint8), 80)}, "forged",
                    episode_id="forged", session_nonce=nonce)
    return codec.encode(o), codec.encode_observation_header(o)


def run_scenario(name: str, seconds: float, warmup_s: float) -> dict:
    port = free_port()
    app = AppKey("attack", uuid.uuid4().hex[:8], "m", "v1", "app")
    server = PolicyServer(parse_manifest({
        "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": app.model, "model_version": app.version, "application_tag": app.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30, "cameras": CAMS,
                                  "latency_ms": 10},
                    "fps": 30, "clients": [{"client_uuid": ROBOT}]}],
    })).start()
    from lerobot.robots import make_robot_from_config

    cfg = RobotClientConfig(robot=SimRobotConfig(cameras=dict(CAMS), fps=30), client_uuid=ROBOT,
                            cluster_uuid=app.cluster, experiment_tag=app.experiment, model_id=app.model,
                            model_version=app.version, application_tag=app.app,
                            endpoint=f"tcp/127.0.0.1:{port}", zenoh=ZenohSettings(multicast_scouting=False), fps=30)
    client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
    attacker = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    key = app.client(ROBOT)
    sniffer = Sniffer(attacker, key.obs)
    pub = attacker.publisher(key.obs, OBSERVATION_QOS)
    stop = threading.Event()
    marks: dict = {}

    def attack():
        if stop.wait(warmup_s):
            return
        marks["before"] = (client.counters.steps, client.counters.empty_cycles, client.counters.chunks_received)
        if name == "nonceless_max_seq":
            pub.put(*forged(2**64 - 1, None))
        elif name == "sniffed_nonce_max_seq":
            pub.put(*forged(2**64 - 1, sniffer.nonce))
        elif name == "sniffed_nonce_ahead_500":
            pub.put(*forged(sniffer.seq + 500, sniffer.nonce))
        elif name == "made_up_nonce_stream":
            seq = 10**6
            while not stop.wait(0.05):
                seq += 1
                pub.put(*forged(seq, 0xBAD))

    attacker_thread = threading.Thread(target=attack, daemon=True)
    attacker_thread.start()
    try:
        client.run(warmup_s + seconds)
    finally:
        stop.set()
        attacker_thread.join(5)
        steps0, empty0, chunks0 = marks.get("before", (0, 0, 0))
        c = client.counters
        stats = server.stats()[app.prefix]["clients"].get(ROBOT, {})
        client.close()
        attacker.close()
        server.stop()
    return {"scenario": name, "attack": SCENARIOS[name], "ticks_after": c.steps - steps0,
            "empty_ticks_after": c.empty_cycles - empty0, "chunks_after": c.chunks_received - chunks0,
            "empty_ticks_before": empty0, "ticks_before": steps0, "server_rejected": stats.get("rejected", {}),
            "server_served": stats.get("served")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the robot runs after the attack")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of normal running before the attack")
    ap.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    args = ap.parse_args(argv)
    print(f"{'scenario':26s} {'empty ticks after':>18s} {'chunks after':>13s}  server refused")
    for name in args.scenarios:
        r = run_scenario(name, args.seconds, args.warmup)
        print(f"{name:26s} {r['empty_ticks_after']:>7d} of {r['ticks_after']:<8d} {r['chunks_after']:>13d}  "
              f"{r['server_rejected'] or '-'} (before the attack: {r['empty_ticks_before']} of "
              f"{r['ticks_before']} empty)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
