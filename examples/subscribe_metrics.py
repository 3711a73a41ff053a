"""Read a fleet's telemetry with nothing but Zenoh and msgpack (no lerobot-zenoh needed).

    python examples/subscribe_metrics.py tcp/127.0.0.1:7447

Every server publishes on  <cluster>/<experiment>/<model>/<version>/<app>/server/<id>/metrics
and every robot client on  <cluster>/<experiment>/<model>/<version>/<app>/<client>/metrics,
so `**/metrics` selects them all (docs/telemetry.md lists every figure).
"""

import json
import sys
import time

import msgpack
import zenoh

conf = zenoh.Config()
if len(sys.argv) > 1:
    conf.insert_json5("connect/endpoints", json.dumps(sys.argv[1:]))


def show(sample: zenoh.Sample) -> None:
    msg = msgpack.unpackb(sample.payload.to_bytes())
    figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(msg["metrics"].items()))
    print(f"{sample.key_expr}  [{msg['source']} {msg['source_id']}]  {figures}", flush=True)


with zenoh.open(conf) as session:
    session.declare_subscriber("**/metrics", show)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
