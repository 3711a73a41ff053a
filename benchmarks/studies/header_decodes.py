"""Decodes per served observation with the wait-ratio scheduler, with and without the observation header.

    PYTHONPATH=. python -m benchmarks.studies.header_decodes [--clients 100] [--seconds 5] [--policy-ms 50]

One real `PolicyServer` (synthetic policy, `--policy-ms` per pass, `wait_ratio`, max batch 1) and N
robots in this process publishing 30 Hz observations (4-D state, one 96x128 JPEG camera) over real
Zenoh on loopback, first without the header (as protocol 1.1 clients before docs/protocol.md §5.1.1 did), then with
it. Counted by wrapping `codec.decode_observation`: every msgpack decode of an observation in the
process (the robots decode none); and `codec.decode_observation_header`: every read of a header
(the server reads each once, on arrival: one per observation received). Most observations are
superseded before they are served; the figure that matters is decodes per served observation
(1.0 = only what is served is decoded). A third run puts the model on a multi-model task's stream
(docs/pipelines.md), every other observation asking another component (dropped unread): each
header is still read once.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


from benchmarks.common import free_port  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.keys import AppKey, pipeline_app  # noqa: E402
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation  # noqa: E402
from lerobot_zenoh.server.manifest import parse_manifest  # noqa: E402
from lerobot_zenoh.server.server import PolicyServer  # noqa: E402
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import loopback_settings  # noqa: E402

FPS = 30


def run(n: int, seconds: float, policy_ms: float, with_header: bool, port: int, task_stream: bool = False) -> dict:
    """`task_stream`: the model serves a component (bit 0) of a multi-model task and the robots publish
    on the task's stream, every other observation asking another component (bit 1)."""
    key = AppKey("bench", f"hdr{int(with_header)}{int(task_stream)}{port}", "m", "v1", "app")
    pipeline = [{"task": "kit", "component": "act", "bit": 0}] if task_stream else []
    manifest = parse_manifest({
        "cluster_uuid": key.cluster, "experiment_tag": key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": key.model, "model_version": key.version, "application_tag": key.app,
                    "synthetic": {"state_dim": 4, "action_dim": 4, "chunk_size": 10,
                                  "cameras": {"front": [96, 128]}, "latency_ms": policy_ms},
                    "fps": FPS, "scheduler": "wait_ratio", "max_batch_size": 1,
                    "clients": [{"client_uuid": f"r{i}"} for i in range(n)], "pipeline": pipeline}],
    })
    source = pipeline_app(key.cluster, key.experiment, "kit") if task_stream else key
    decodes = [0]
    header_decodes = [0]
    real = codec.decode_observation
    real_header = codec.decode_observation_header

    def counting(*a, **kw):
        decodes[0] += 1
        return real(*a, **kw)

    def counting_header(*a, **kw):
        header_decodes[0] += 1
        return real_header(*a, **kw)

    codec.decode_observation = counting
    codec.decode_observation_header = counting_header
    rng = np.random.default_rng(0)
    jpeg = codec.encode_jpeg(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8))
    try:
        with PolicyServer(manifest) as server, \
                ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
            pubs = [session.publisher(source.client(f"r{i}").obs, OBSERVATION_QOS) for i in range(n)]
            deadline = time.monotonic() + 10
            while not session.query(key.status, 0.3) and time.monotonic() < deadline:
                pass
            engine = server.models[0].session_table
            t0 = time.monotonic()
            step = 0
            while time.monotonic() - t0 < seconds:
                step += 1
                for i, pub in enumerate(pubs):
                    obs = Observation(step, f"r{i}", rng.normal(size=4).astype(np.float32), {"front": jpeg}, "task",
                                      ExecutionInfo(step / FPS, int(rng.integers(0, 30)), 1 / FPS),
                                      episode_id="0", session_nonce=1,
                                      component_mask=(0b1 if step % 2 else 0b10) if task_stream else None)
                    pub.put(codec.encode(obs), attachment=codec.encode_observation_header(obs) if with_header else None)
                sleep = t0 + step / FPS - time.monotonic()
                if sleep > 0:
                    time.sleep(sleep)  # the robots' control period
            time.sleep(0.5)  # the last pass
            snap = engine.snapshot()
            total = snap.total()
            return {"header": with_header, "received": total.received, "served": total.served, "decodes": decodes[0],
                    "decoded_on_arrival": snap.decoded_on_arrival, "headers_read": snap.headers_read,
                    "header_decodes": header_decodes[0], "offered": step * n}
    finally:
        codec.decode_observation = real
        codec.decode_observation_header = real_header


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--policy-ms", type=float, default=50.0)
    args = p.parse_args(argv)
    print(f"{args.clients} robots x {FPS} Hz, {args.seconds:g} s, policy {args.policy_ms:g} ms, wait_ratio, max batch 1")
    print("| observations | offered | received | served | msgpack decodes | decodes per served | "
          "decoded on arrival | headers read | header decodes |\n|---|---|---|---|---|---|---|---|---|")
    for name, with_header, task_stream in (("without header", False, False), ("with header", True, False),
                                           ("task stream, with header", True, True)):
        r = run(args.clients, args.seconds, args.policy_ms, with_header, free_port(), task_stream)
        print(f"| {name} | {r['offered']} | {r['received']} | "
              f"{r['served']} | {r['decodes']} | {r['decodes'] / max(1, r['served']):.2f} | "
              f"{r['decoded_on_arrival']} | {r['headers_read']} | {r['header_decodes']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
