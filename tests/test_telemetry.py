"""Telemetry: what a plain Zenoh subscriber sees, the monitor's table/JSON/Prometheus views."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
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
    proc = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint=tcp/127.0.0.1:{port}",
                           "--zenoh.multicast_scouting=false", f"--cluster_uuid={app_key.cluster}", "--json=true",
                           "--duration_s=3"], capture_output=True, text=True, timeout=60)
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
    assert f"lerobot_zenoh_client_chunks_received_total{{{labels}" in body
    assert 'lerobot_zenoh_server_inferences_total{' in body and 'server="gpu0"' in body
    assert "lerobot_zenoh_server_client_inferences_total{" in body
    assert "lerobot_zenoh_client_up{" in body
    assert "# TYPE lerobot_zenoh_client_chunks_received_total counter" in body
    assert "# TYPE lerobot_zenoh_client_round_trip_p50_seconds gauge" not in body  # rtt is named rtt
    _lint_exposition(body)
    promtool = shutil.which("promtool") or os.environ.get("PROMTOOL")
    if promtool:  # Debian's `prometheus` package ships it (make ci-tools installs it in CI)
        check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check.stdout + check.stderr


def _lint_exposition(body: str) -> None:
    """What `promtool check metrics` checks, so that the rules hold where promtool is absent too."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(body):
        if not family.name.startswith("lerobot_zenoh_"):
            continue  # the client library's own process/python metrics
        names.add(family.name)
        assert family.documentation and "telemetry figure" not in family.documentation, family.name
        assert all(s.name.endswith("_total") for s in family.samples) == (family.type == "counter"), family.name
        assert not any(f"_{unit}" in family.name for unit in ("ms_", "mb_", "_ms", "_mb", "milli", "mega")), family.name
    assert {"lerobot_zenoh_client_rtt_p50_seconds", "lerobot_zenoh_server_inference_p99_seconds",
            "lerobot_zenoh_server_resident_memory_bytes", "lerobot_zenoh_client_control_loop_rate_hertz"} <= names


def test_monitor_with_its_prometheus_port_busy_says_so_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--prometheus_port={taken}",
                            "--zenoh.multicast_scouting=false"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"lerobot-zenoh-monitor: --prometheus_port: cannot listen on 127.0.0.1:{taken}: Address already in use "
        "(another monitor or exporter? pick another port)"]
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_monitor_ends_within_a_second_of_a_signal(port, sig):
    peer = ZenohSession(loopback_settings(port)).open()  # something to connect to
    proc = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint=tcp/127.0.0.1:{port}",
                             "--zenoh.multicast_scouting=false", f"--prometheus_port={free_port()}", "--refresh_s=5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "lerobot-zenoh fleet" in proc.stdout.readline() + proc.stdout.readline()  # running: first table drawn
        t0 = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 1.0
        assert proc.returncode == 0, proc.stderr.read()
    finally:
        proc.kill()
        peer.close()


def test_monitor_with_a_dead_endpoint_says_it_cannot_connect(port):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint=tcp/127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"lerobot-zenoh-monitor: cannot connect to tcp/127.0.0.1:{port}: nothing answers there (is the server or "
        "router running, and is the address right?)"], r.stderr
    assert time.monotonic() - t0 < 20


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_monitor_live_table_in_a_real_terminal(fleet, port, app_key, tmp_path):
    """The table as a person sees it: run in a tmux pane, read the screen back with capture-pane."""
    session = f"lz-monitor-{port}"
    cmd = (f"{shlex.quote(sys.executable)} -m lerobot_zenoh.cli.monitor --endpoint=tcp/127.0.0.1:{port} "
           f"--zenoh.multicast_scouting=false --cluster_uuid={app_key.cluster} --refresh_s=0.5")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "40", cmd], check=True, env=env)
    try:
        screen = ""

        def table_shows_both() -> bool:
            nonlocal screen
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
            rows = {line.split()[1]: line.split() for line in screen.splitlines()
                    if line.startswith(app_key.prefix) and len(line.split()) > 3}
            return rows.get("gpu0", [None] * 3)[2] == "up" and rows.get("r1", [None] * 3)[2] == "up"

        assert wait_for(table_shows_both, timeout_s=30, poll_s=0.3), screen
        assert "SERVERS" in screen and "CLIENTS" in screen and "trip p50" in screen and "unanswered" in screen
        assert "overrun" in screen and "(ms)" in screen and "(Hz)" in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


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
    assert "SERVERS" in table and "CLIENTS" in table and "rate" in table and "(Hz)" in table


def test_the_monitor_shows_a_pipeline_clients_slo_attainment_in_one_cell():
    fleet = FleetView()
    msg = Telemetry("client", "r1", 0, 1.0, 1.0, metrics={
        "loop_hz": 30.0, "slo.act.requests": 10, "slo.act.missed": 0, "slo.act.attainment": 1.0,
        "slo.progress.requests": 7, "slo.progress.missed": 2, "slo.progress.attainment": 0.714})
    fleet.on_telemetry("f/e/_pipeline/1/kit/r1/metrics", msg, 0.0)
    fleet.on_telemetry("f/e/m/v1/app/r2/metrics", Telemetry("client", "r2", 0, 1.0, 1.0, metrics={"loop_hz": 30.0}), 0.0)
    rows = {r["id"]: r for r in fleet.rows(0.0)}
    assert rows["r1"]["slo"] == "act 100% progress 71% (2 missed)" and rows["r2"]["slo"] is None
    table = format_table(fleet.rows(0.0))
    assert "act 100% progress 71% (2 missed)" in table and "f/e/_pipeline/1/kit" in table


def test_a_pipeline_clients_slo_figures_export_as_prometheus_families_labelled_by_component():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from lerobot_zenoh.telemetry.prometheus import families

    fleet = FleetView()
    metrics = {"loop_hz": 30.0, "pipeline.attempt": 1, "pipeline.failures": 0, "pipeline.mode": 3,
               "pipeline.override_steps": 12, "pipeline.results_dropped": 0, "pipeline.results_rejected": 0,
               "pipeline.danger_reaction_ms_max": 0.8}
    for comp in ("act", "safety"):
        metrics.update({f"slo.{comp}.{k}": 3 for k in ("requests", "answered", "met", "missed", "late", "fallbacks",
                                                       "rejected", "slo_violated")})
        metrics.update({f"slo.{comp}.latency_ms_p50": 12.0, f"slo.{comp}.latency_ms_p99": 20.0,
                        f"slo.{comp}.attainment": 0.5})
    fleet.on_telemetry("f/e/_pipeline/1/kit/r1/metrics", Telemetry("client", "r1", 0, 1.0, 1.0, metrics=metrics), 0.0)

    class Collector:
        def collect(self):
            for fam in families(fleet.samples()):
                names = sorted({k for labels, _ in fam.samples for k in labels})
                family = (CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily)(fam.name, fam.help, labels=names)
                for labels, value in fam.samples:
                    family.add_metric([labels.get(k, "") for k in names], value)
                yield family

    registry = CollectorRegistry()
    registry.register(Collector())
    body = generate_latest(registry).decode()
    assert 'lerobot_zenoh_client_slo_missed_total{' in body and 'component="safety"' in body
    assert "lerobot_zenoh_client_slo_latency_p99_seconds{" in body and "lerobot_zenoh_client_slo_attainment_ratio{" in body
    assert "lerobot_zenoh_client_pipeline_danger_reaction_max_seconds{" in body
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(body):
        assert family.documentation and "telemetry figure" not in family.documentation.lower(), family.name
        assert all(s.name.endswith("_total") for s in family.samples) == (family.type == "counter"), family.name
    promtool = shutil.which("promtool") or os.environ.get("PROMTOOL")
    if promtool:
        check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check.stdout + check.stderr
