"""A wire-level robot for network-namespace tests, run as a script inside a namespace:

    python tests/lz_probe_robot.py --endpoint tcp/10.234.1.1:7447 --app c/e/m/v/a --client r1 \
        --period-s 0.0333 --duration-s 20 --out r1.json

It publishes one observation per period (seq 1, 2, ...; whether or not the previous one was
answered, as a robot streaming at its control rate would) and records, on this host's monotonic
clock (shared by every namespace), when each was sent and when each chunk arrived. Creates
``<out>.serving`` once a second's worth of chunks has arrived (for a test to wait on) and writes
{"sent": {seq: t_s}, "chunks": [[t_s, seq], ...]} to ``<out>`` at the end. Not imported by the tests.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--app", required=True, help="cluster/experiment/model/version/app")
    parser.add_argument("--client", required=True)
    parser.add_argument("--period-s", type=float, default=1 / 30)
    parser.add_argument("--duration-s", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    app = AppKey(*args.app.split("/"))
    key = app.client(args.client)
    sent: dict[int, float] = {}
    chunks: list[tuple[float, int]] = []
    lock = threading.Lock()

    def on_chunk(_key: str, payload: bytes) -> None:
        t = time.monotonic()
        chunk = codec.decode_action_chunk(payload)
        with lock:
            chunks.append((t, chunk.response_to_seq_id))

    rng = np.random.default_rng(0)
    images = {name: codec.encode_jpeg(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), 80) for name in ("front", "wrist")}
    with ZenohSession(ZenohSettings(connect=[args.endpoint], connect_timeout_s=60)) as session:
        session.subscribe(key.action, on_chunk)
        deadline = time.monotonic() + 60
        while not session.query(app.status, 0.5) and time.monotonic() < deadline:
            pass
        pub = session.publisher(key.obs, OBSERVATION_QOS)
        t_end = time.monotonic() + args.duration_s
        seq, next_t = 0, time.monotonic()
        serving = Path(f"{args.out}.serving")
        while time.monotonic() < t_end:
            if len(chunks) >= 1 / args.period_s and not serving.exists():
                serving.touch()
            seq += 1
            state = np.full(6, seq % 100, np.float32)
            payload = codec.encode(Observation(seq, args.client, state, images, "probe", session_nonce=1))
            with lock:
                sent[seq] = time.monotonic()
            pub.put(payload)
            next_t += args.period_s
            time.sleep(max(0.0, next_t - time.monotonic()))
        time.sleep(0.5)  # the last answers
    with lock:
        result = {"sent": sent, "chunks": chunks}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
