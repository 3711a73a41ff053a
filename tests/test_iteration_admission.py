"""Fair iteration-level admission: a robot has at most one request decoding per model.

A decode runner (pi0-FAST's shape, without torch): `slots` requests decode at once, each for
`steps` steps; between steps, free slots are offered to the server (`join`). A robot that sends
faster than its chunks come back must not hold more than one slot, so an honest robot beside it
keeps getting chunks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import free_port, wait_for

CAMS = {"front": (16, 24)}
SYN = {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": CAMS, "latency_ms": 0}


class SlotDecoder(SyntheticPolicy):
    """Iteration-level: `slots` decode slots, `steps` steps of `step_s` per request."""

    def __init__(self, slots: int = 4, steps: int = 8, step_s: float = 0.004):
        super().__init__(SyntheticPolicyConfig(**SYN))
        self.spec = replace(self.spec, capabilities=replace(self.spec.capabilities, iteration_level=True))
        self.slots, self.steps, self.step_s = slots, steps, step_s
        self.most_at_once: Counter = Counter()  # client -> most requests it had decoding at once

    def stream(self, first, join, emit):
        pending, active = list(first), {}
        while pending or active:
            while pending and len(active) < self.slots:
                key, request = pending.pop(0)
                active[key] = [request, self.steps]
            for client, n in Counter(r.session_id for r, _ in active.values()).items():
                self.most_at_once[client] = max(self.most_at_once[client], n)
            time.sleep(self.step_s)
            for key in list(active):
                active[key][1] -= 1
                if active[key][1] == 0:
                    request = active.pop(key)[0]
                    emit(key, self.run([request], capture_updates=False)[0])
            if len(active) + len(pending) < self.slots:
                pending += list(join())


def test_a_robot_sending_fast_holds_one_decode_slot_and_an_honest_robot_is_served(app_key):
    port = free_port()
    runner = SlotDecoder()
    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "telemetry_period_s": 0, "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "synthetic": SYN, "accept_unknown_clients": True, "max_batch_size": 4}],
    })
    rng = np.random.default_rng(0)
    jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8)) for n, hw in CAMS.items()}
    got: dict[str, list[int]] = {"greedy": [], "honest": []}
    with PolicyServer(manifest, runners={app_key.model: runner}) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as robot:
        pubs = {}
        for client in got:
            robot.subscribe(app_key.client(client).action,
                            lambda k, b, c=client: got[c].append(codec.decode_action_chunk(b).response_to_seq_id))
            pubs[client] = robot.publisher(app_key.client(client).obs, OBSERVATION_QOS)

        def send(client, seq):
            pubs[client].put(codec.encode(Observation(seq, client, np.zeros(6, np.float32), jpegs, "t", session_nonce=1)))

        stop = threading.Event()

        def greedy():  # a new observation every 2 ms, whatever came back
            seq = 0
            while not stop.wait(0.002):
                seq += 1
                send("greedy", seq)

        thread = threading.Thread(target=greedy)
        thread.start()
        try:
            for seq in range(1, 11):  # the honest robot: one request at a time (sent again if lost: best effort)
                deadline = time.monotonic() + 30
                while not (send("honest", seq) or wait_for(lambda s=seq: s in got["honest"], 2)):
                    assert time.monotonic() < deadline, f"honest request {seq} never answered"
        finally:
            stop.set()
            thread.join()
        assert len(got["greedy"]) > 5
        assert runner.most_at_once["greedy"] == 1 and runner.most_at_once["honest"] == 1
        assert server.models[0].failed is None
