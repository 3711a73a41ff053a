"""Telemetry: what a plain Zenoh subscriber sees, the monitor's table/JSON/Prometheus views."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import msgpack
import pytest
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.protocol.messages import Telemetry
from lerobot_zenoh.telemetry.fleet import FleetView, format_table
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings

from lz_testing import free_port, make_config, make_server, wait_for




@pytest.fixture
def fleet(port, app_key):
    """A server and one running client, both publishing telemetry every 0.2 s."""
    server = make_server(port, app_key)
    server.manifest = server.manifest.model_copy(update={"telemetry_period_s": 0.2})
    server.start()
    cfg = make_config(port, app_key, telemetry_period_s=0.2)
    client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
    runner = threading.Thread(target=client.run, daemon=True)
    runner.start()
    yield server, client
    client.stop()
    runner.join(5)
    client.close()
    server.stop()


def test_a_bare_zenoh_subscriber_decodes_fleet_telemetry_with_msgpack(fleet, port, app_key):
    import zenoh

    seen = {}
    conf = zenoh.Config()
    conf.insert_json5("mode", '"peer"')
    conf.insert_json5("scouting/multicast/enabled", "false")
    conf.insert_json5("connect/endpoints", json.dumps([f"tcp/127.0.0.1:{port}"]))
    with zenoh.open(conf) as session:
        sub = session.declare_subscriber("**/metrics", lambda s: seen.__setitem__(str(s.key_expr), msgpack.unpackb(s.payload.to_bytes())))
        server_key = f"{app_key.prefix}/server/gpu0/metrics"
        client_key = f"{app_key.prefix}/r1/metrics"
        assert wait_for(lambda: server_key in seen and client_key in seen
                        and seen[client_key]["metrics"].get("chunks_received", 0) > 0
                        and seen[server_key]["metrics"].get("inferences", 0) > 0)
        sub.undeclare()
    server_msg, client_msg = seen[server_key], seen[client_key]
    assert server_msg["type"] == "telemetry" and server_msg["protocol_version"][0] == 1
    assert server_msg["source"] == "server" and server_msg["source_id"] == "gpu0"
    assert {"clients", "inferences", "inference_ms_p50", "inference_ms_p99", "queue_ms_p50",
            "observations_received", "observations_superseded", "observations_rejected", "cpu_rss_mb"} <= set(server_msg["metrics"])
    assert server_msg["per_client"]["r1"]["inferences"] > 0
    assert client_msg["source"] == "client" and client_msg["source_id"] == "r1"
    assert {"loop_hz", "rtt_ms_p50", "rtt_ms_p99", "trimmed_steps", "buffer_depth", "empty_buffer_cycles",
            "chunks_received", "observations_published", "observations_dropped_in_outbox", "watchdog_events",
            "loop_overruns"} <= set(client_msg["metrics"])


def test_monitor_json_and_prometheus(fleet, port, app_key):
    from lerobot_zenoh.cli.monitor import serve_prometheus
    from lerobot_zenoh.protocol import codec

    # --json: one line per message, from the real console script.
    proc = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.monitor", "--connect", f"tcp/127.0.0.1:{port}",
                           "--no-scouting", "--cluster", app_key.cluster, "--json", "--duration-s", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert {(m["source"], m["source_id"]) for m in lines} >= {("server", "gpu0"), ("client", "r1")}

    # Prometheus: the same figures over HTTP, with the key's chunks as labels.
    view = FleetView()
    with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        session.subscribe("**/metrics", lambda k, b: view.on_telemetry(k, codec.decode_telemetry(b), time.monotonic()))
        session.watch_liveliness("**", lambda k, alive: view.on_liveliness(k, alive, time.monotonic()))
        http_port = free_port()
        http, collector = serve_prometheus(view, http_port)
        try:
            assert wait_for(lambda: len(view.members()) == 2 and all(m.metrics for m in view.members()))
            body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
        finally:
            http.shutdown()
            from prometheus_client.core import REGISTRY

            REGISTRY.unregister(collector)
    labels = f'app="{app_key.app}",client="r1",cluster="{app_key.cluster}",experiment="{app_key.experiment}"'
    assert f"lerobot_zenoh_client_chunks_received{{{labels}" in body
    assert 'lerobot_zenoh_server_inferences{' in body and 'server="gpu0"' in body
    assert "lerobot_zenoh_server_client_inferences{" in body
    assert "lerobot_zenoh_client_alive{" in body


def test_fleet_view_marks_silent_members():
    view = FleetView(stale_periods=3)
    key = "c/e/m/v/a/r1/metrics"
    view.on_telemetry(key, Telemetry("client", "r1", 0, 1.0, 1.0, {"loop_hz": 30.0}), now_s=100.0)
    view.on_telemetry("c/e/m/v/a/server/g/metrics", Telemetry("server", "g", 0, 1.0, 1.0, {"inferences": 3}), now_s=100.0)
    view.on_telemetry("not/a/fleet/key", Telemetry("client", "x", 0, 1.0, 1.0), now_s=100.0)
    assert view.rejected == 1
    assert [r["state"] for r in view.rows(101.0)] == ["up", "up"]
    assert [r["state"] for r in view.rows(104.0)] == ["SILENT", "SILENT"]
    view.on_telemetry(key, Telemetry("client", "r1", 1, 5.0, 1.0, {"loop_hz": 30.0}), now_s=104.0)
    view.on_liveliness("c/e/m/v/a/server/g", False, now_s=104.0)
    states = {r["id"]: r["state"] for r in view.rows(104.5)}
    assert states == {"r1": "up", "g": "SILENT"}
    table = format_table(view.rows(104.5))
    assert "SERVERS" in table and "CLIENTS" in table and "loop Hz" in table
