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
from lerobot_zenoh.telemetry.fleet import CLIENT_BYTES, MAX_FIGURES, FleetView, format_table
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
        http = serve_prometheus(view, http_port)
        try:
            assert wait_for(lambda: len(view.members()) == 2 and all(m.metrics for m in view.members()))
            body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
        finally:
            http.shutdown()
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


#: Counts the issue tracker once found exported as gauges: they only grow, so they are counters.
MONOTONIC = {
    "client": ["requests_unanswered", "refreshes_sent", "rtc_chunks", "rtc_delay_mispredicted", "rtc_delay_overridden",
               "rtc_fallback_chunks", "steps", "chunks_received", "loop_overruns"],
    "server": ["sessions_opened", "sessions_closed.liveliness", "actions_dropped", "batch_fallbacks",
               "observations_rate_limited", "observations_refreshes", "refreshes_late", "inferences",
               "engine.e0.dispatched", "engine.e0.requeued", "engine.e0.refused.wrong_model", "language.tokens",
               "decode.prefill_ms", "scheduler.decisions"],
    "server_client": ["observations_rate_limited", "observations_refreshes", "refreshes_late", "actions_dropped",
                      "rejected.replayed", "served.edge"],
}


def test_a_running_fleets_figures_are_all_declared_and_those_that_only_grow_are_counters(fleet, port, app_key):
    """Scrape the monitor fed by a real server and robot: every figure they publish is declared (none
    falls through untyped), every figure that only grew during the run is a counter named `_total`,
    and nothing is a gauge named like a counter."""
    from lerobot_zenoh.cli.monitor import serve_prometheus
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.telemetry.prometheus import describe

    history: dict[tuple[str, str, str], list[float]] = {}  # (member kind, member, figure) -> values in order
    view = FleetView()

    def on_metrics(key: str, payload: bytes) -> None:
        msg = codec.decode_telemetry(payload)
        view.on_telemetry(key, msg, time.monotonic())
        for name, value in msg.metrics.items():
            history.setdefault((msg.source, msg.source_id, name), []).append(value)
        for client_id, figures in msg.per_client.items():
            for name, value in figures.items():
                history.setdefault(("server_client", client_id, name), []).append(value)

    with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        session.subscribe("**/metrics", on_metrics)
        http_port = free_port()
        http = serve_prometheus(view, http_port)
        try:
            # a few periods of a robot being served: counters move (0.2 s telemetry period)
            assert wait_for(lambda: len(history.get(("client", "r1", "steps"), [])) >= 8
                            and len(history.get(("server", "gpu0", "inferences"), [])) >= 8, 30)
            body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
        finally:
            http.shutdown()
    undeclared = sorted({(kind, name) for kind, _, name in history if not describe(kind, name).declared})
    assert not undeclared, f"figures published but not declared in telemetry/prometheus.py: {undeclared}"
    # A figure that only grew, by whole numbers, and moved at least twice is a count: it must be a counter.
    grew = sorted({(kind, name) for (kind, _, name), values in history.items()
                   if all(float(v).is_integer() for v in values) and all(b >= a for a, b in zip(values, values[1:]))
                   and sum(b > a for a, b in zip(values, values[1:])) >= 2})
    assert grew, "nothing grew: the run was too short to tell"
    gauges = [(kind, name) for kind, name in grew if describe(kind, name).kind not in ("counter", "histogram")]
    assert not gauges, f"figures that only grow exported as gauges: {gauges}"
    for kind, names in MONOTONIC.items():
        assert [n for n in names if describe(kind, n).kind != "counter"] == [], kind
    from prometheus_client.parser import text_string_to_metric_families

    exported = {f.name: f.type for f in text_string_to_metric_families(body) if f.name.startswith("lerobot_zenoh_")}
    assert "untyped" not in exported.values() and "unknown" not in exported.values(), exported
    assert exported["lerobot_zenoh_client_requests_unanswered"] == "counter"  # the parser drops `_total`
    assert exported["lerobot_zenoh_server_sessions_opened"] == "counter"
    # latencies as histograms too, per server, per model and per robot (docs/telemetry.md, "Histograms")
    for name in ("lerobot_zenoh_server_inference_seconds", "lerobot_zenoh_server_queue_seconds",
                 "lerobot_zenoh_server_client_inference_seconds", "lerobot_zenoh_client_rtt_seconds",
                 "lerobot_zenoh_client_handover_seconds"):
        assert exported.get(name) == "histogram", (name, sorted(exported))
    _lint_exposition(body)


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


def test_monitor_with_a_dead_endpoint_and_exit_when_unreachable_exits_3(port):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint=tcp/127.0.0.1:{port}",
                        "--exit_when_unreachable"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and r.stderr.strip().splitlines() == [
        f"lerobot-zenoh-monitor: cannot connect to tcp/127.0.0.1:{port}: nothing answers there (is the server or "
        "router running, and is the address right?)"], r.stderr
    assert time.monotonic() - t0 < 20


def test_monitor_waits_for_a_server_started_after_it(port, app_key):
    """Run as a service, the monitor starts before the fleet: it says once that nothing answers,
    keeps trying with a back-off, and shows the server once it is up."""
    proc = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint=tcp/127.0.0.1:{port}",
                             "--json", "--duration_s=60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        line = proc.stderr.readline()
        assert "nothing answers at" in line and "--exit_when_unreachable" in line, line
        with make_server(port, app_key):
            first = json.loads(proc.stdout.readline())  # blocks until a telemetry message arrives
            assert first["source"] == "server", first
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert err.count("nothing answers at") == 0, err  # logged once (the first line, read above)


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
    assert states == {"r1": "up", "g": "GONE"}
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
    from lerobot_zenoh.telemetry.prometheus import families, render

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

    fams, taken = families(fleet.samples())
    body, _ = render(fams)
    assert taken == fleet.series_count()
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


# -- what the monitor trusts, and what it forgets (docs/telemetry.md, "What the monitor trusts") ------


def _server_msg(per_client=None, seq=0):
    return Telemetry("server", "g", seq, 1.0, 1.0, {"inferences": 3}, per_client or {})


def test_per_robot_server_figures_come_only_from_server_members():
    view = FleetView()
    view.on_telemetry("c/e/m/v/a/server/g/metrics", _server_msg({"robot_1": {"observations_rejected": 2}}), 0.0)
    # robot_1's own telemetry (its certificate may publish on its metrics key) claims server figures
    view.on_telemetry("c/e/m/v/a/robot_1/metrics", Telemetry("client", "robot_1", 0, 1.0, 1.0, {"loop_hz": 30.0},
                      {"robot_2": {"observations_rejected": 999999}}), 0.0)
    # and it poses as a server on its own key
    view.on_telemetry("c/e/m/v/a/robot_1/metrics", Telemetry("server", "robot_1", 1, 1.0, 1.0, {"inferences": 1},
                      {"robot_2": {"observations_rejected": 999999}}), 0.0)
    per_robot = [(labels["client"], figure, value) for kind, figure, labels, value in view.samples()
                 if kind == "server_client"]
    assert per_robot == [("robot_1", "observations_rejected", 2.0)]
    assert view.per_client_ignored == 1 and view.rejected == 1


def test_gone_silent_stalled_and_unheard_are_told_apart():
    view = FleetView(stale_periods=3)
    server, robot, other = "c/e/m/v/a/server/g", "c/e/m/v/a/r1", "c/e/m/v/a/r2"
    for key in (server, robot + "/metrics", other + "/metrics"):  # a client's token is its metrics key
        view.on_liveliness(key, True, 0.0)
    view.on_telemetry(server + "/metrics", _server_msg(), 0.0)
    view.on_telemetry(robot + "/metrics", Telemetry("client", "r1", 0, 1.0, 1.0, {"loop_hz": 30.0}), 0.0)
    view.on_telemetry(other + "/metrics", Telemetry("client", "r2", 0, 1.0, 1.0, {"loop_hz": 30.0}), 0.0)
    states = lambda now: {r["id"]: r["state"] for r in view.rows(now)}  # noqa: E731
    assert states(1.0) == {"g": "up", "r1": "up", "r2": "up"}
    # r2's process ends: its token goes. r1 keeps publishing; the server keeps publishing.
    view.on_liveliness(other + "/metrics", False, 2.0)
    view.on_telemetry(server + "/metrics", _server_msg(seq=1), 2.0)
    view.on_telemetry(robot + "/metrics", Telemetry("client", "r1", 1, 3.0, 1.0, {"loop_hz": 30.0}), 2.0)
    assert states(3.0) == {"g": "up", "r1": "up", "r2": "GONE"}
    # r1 falls silent while the server is fine: SILENT.
    view.on_telemetry(server + "/metrics", _server_msg(seq=2), 6.0)
    assert states(6.0)["r1"] == "SILENT"
    # The server freezes (its token stays: its Zenoh session is held): STALLED, and its app's silent
    # robots are UNHEARD, not SILENT (their telemetry may travel through it).
    assert states(10.0) == {"g": "STALLED", "r1": "UNHEARD", "r2": "GONE"}


def test_members_are_bounded_and_forgotten_with_their_series():
    view = FleetView(forget_after_s=10.0, max_members=100)
    view.on_liveliness("c/e/m/v/a/r1/metrics", True, 0.0)
    view.on_telemetry("c/e/m/v/a/r1/metrics", Telemetry("client", "r1", 0, 1.0, 1.0, {"loop_hz": 30.0}), 0.0)
    many = {f"figure_{j}": j for j in range(600)}
    for i in range(5_000):  # invented ids, no token, 600 figures each
        view.on_telemetry(f"c/e/m/v/a/x{i}/metrics", Telemetry("client", f"x{i}", 0, 1.0, 1.0, many), 1.0 + i * 1e-4)
    members = view.members()
    assert len(members) <= 100 and any(m.member_id == "r1" for m in members)  # the robot with a token stays
    assert all(len(m.metrics) <= MAX_FIGURES and m.cost <= CLIENT_BYTES for m in members)
    assert view.forget(5.0) == []
    forgotten = view.forget(13.5)
    assert {m.member_id for m in view.members()} == {"r1"} and len(forgotten) == len(members) - 1
    assert not any(labels.get("client", "").startswith("x") for _, _, labels, _ in view.samples())
    view.on_liveliness("c/e/m/v/a/r1/metrics", False, 20.0)  # gone: forgotten after the grace too
    assert view.forget(29.0) == [] and [m.member_id for m in view.forget(30.0)] == ["r1"]
    # What is left is the monitor's own count of what it refused and forgot: 5,001 members seen,
    # none kept, every one forgotten (displaced or expired), none refused (no live token held a place).
    own = {figure: value for kind, figure, _, value in view.samples() if kind == "monitor" and value}
    assert all(kind == "monitor" for kind, *_ in view.samples())
    refused = own.pop("figures_refused.too_many")
    assert refused >= 5_000 * (600 - MAX_FIGURES)  # over the count or the byte budget
    assert own == {"messages": 5_001, "members_forgotten": 5_001}
    assert view.status_line() == f"monitor: 5001 messages, {refused:.0f} figures refused, 0 members, 5001 forgotten"


def test_the_monitor_counts_new_members_refused_while_every_kept_one_has_a_token_and_exports_it():
    from lerobot_zenoh.telemetry.prometheus import families

    view = FleetView(max_members=4)
    for i in range(4):
        view.on_liveliness(f"c/e/m/v/a/r{i}/metrics", True, 0.0)
    view.on_telemetry("c/e/m/v/a/x/metrics", Telemetry("client", "x", 0, 1.0, 1.0, {"loop_hz": 1.0}), 1.0)
    view.on_telemetry("c/e/m/v/a/server/gpu0/metrics", Telemetry("client", "gpu0", 0, 1.0, 1.0, {}), 1.0)  # posing
    assert [m.member_id for m in view.members()] == ["r0", "r1", "r2", "r3"]
    assert (view.members_refused, view.rejected) == (1, 1)
    exported = {f.name: (f.kind, f.samples) for f in families(view.samples())[0] if "_monitor_" in f.name}
    assert exported["lerobot_zenoh_monitor_members_refused"] == ("counter", [({}, 1.0)])
    kind, rejected = exported["lerobot_zenoh_monitor_messages_rejected"]
    assert kind == "counter" and ({"reason": "posing"}, 1.0) in rejected and sum(v for _, v in rejected) == 1
    assert exported["lerobot_zenoh_monitor_members"] == ("gauge", [({}, 4.0)])
    assert "1 refused (table full)" in view.status_line() and "1 rejected" in view.status_line()


def test_the_monitor_over_zenoh_ignores_a_robots_server_figures_and_forgets_a_flood(port, app_key):
    """The real console script with /metrics: a robot's telemetry claiming a server figure about
    robot_2 never shows; 20,000 invented metrics keys are bounded, then leave /metrics."""
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.transport.session import METRICS_QOS

    http_port = free_port()
    with ZenohSession(loopback_settings(port)) as hub:
        monitor = subprocess.Popen(
            [sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint=tcp/127.0.0.1:{port}",
             "--zenoh.multicast_scouting=false", "--json=true", f"--prometheus_port={http_port}",
             "--forget_after_s=10"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            def scrape() -> str:
                return urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()

            def rss_mb() -> float:
                with open(f"/proc/{monitor.pid}/status") as f:
                    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

            assert wait_for(lambda: monitor.poll() is None and _answers(scrape), 15)
            pub = hub.publisher(f"{app_key.prefix}/robot_1/metrics", METRICS_QOS)
            server_pub = hub.publisher(app_key.server_metrics("gpu0"), METRICS_QOS)
            honest = codec.encode(Telemetry("server", "gpu0", 0, 1.0, 1.0, {"inferences": 1},
                                            {"robot_1": {"observations_rejected": 2}}))
            injected = codec.encode(Telemetry("client", "robot_1", 0, 1.0, 1.0, {"loop_hz": 30.0},
                                              {"robot_2": {"observations_rejected": 999999}}))

            def both_seen() -> bool:  # published until the monitor's subscription hears them (best effort)
                server_pub.put(honest)
                pub.put(injected)
                body = scrape()
                return 'client="robot_1"' in body and 'server="gpu0"' in body

            assert wait_for(both_seen, 15, poll_s=0.2)
            body = scrape()
            assert 'client="robot_2"' not in body and not any(line.endswith(" 999999.0") for line in body.splitlines())
            assert "lerobot_zenoh_server_client_observations_rejected_total{" in body
            before = rss_mb()
            flood = codec.encode(Telemetry("client", "x", 0, 1.0, 1.0, {f"figure_{j}": j for j in range(20)}))
            for i in range(20_000):
                hub.raw.put(f"{app_key.prefix}/x{i}/metrics", flood)

            def invented(body: str) -> int:
                return len({line.split('client="', 1)[1].split('"', 1)[0] for line in body.splitlines()
                            if 'client="x' in line})

            assert wait_for(lambda: invented(scrape()) >= 500, 20)  # (its inbox drops some of a flood, counted)
            t0 = time.monotonic()
            flooded = scrape()
            scrape_s = time.monotonic() - t0
            grown = rss_mb() - before
            members = invented(flooded)
            print(f"20,000 invented keys: {members} kept, scrape {len(flooded) / 1e6:.2f} MB in {scrape_s:.2f} s, "
                  f"monitor RSS +{grown:.1f} MB")
            assert members <= 2048
            assert wait_for(lambda: 'client="x' not in scrape(), 30)  # forgotten after --forget_after_s
            print(f"after the grace: scrape {len(scrape()) / 1e3:.1f} kB")
        finally:
            monitor.terminate()
            monitor.wait(10)


def _answers(scrape) -> bool:
    try:
        scrape()
        return True
    except OSError:
        return False


def test_over_zenoh_a_robot_gone_is_told_from_a_silent_one_and_a_stalled_server_from_both(port, app_key):
    """Real sessions: robot B's process goes (its session closes, its token with it): GONE; robot A
    stops publishing but keeps its token: SILENT; then the server stops publishing and keeps its
    token (a frozen process): STALLED, and silent A becomes UNHEARD."""
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.transport.session import METRICS_QOS

    view = FleetView(stale_periods=3)
    period = 0.1
    with ZenohSession(loopback_settings(port)) as monitor:
        monitor.subscribe("**/metrics", lambda k, b: view.on_telemetry(k, codec.decode_telemetry(b), time.monotonic()))
        monitor.watch_liveliness("**", lambda k, alive: view.on_liveliness(k, alive, time.monotonic()))
        sessions = {n: ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
                    for n in ("gpu0", "ra", "rb")}
        keys = {"gpu0": app_key.server_metrics("gpu0"), "ra": app_key.client("ra").metrics,
                "rb": app_key.client("rb").metrics}
        tokens = {"gpu0": app_key.server_token("gpu0"), "ra": keys["ra"], "rb": keys["rb"]}
        pubs = {}
        for n, s in sessions.items():
            s.declare_token(tokens[n])
            pubs[n] = s.publisher(keys[n], METRICS_QOS)
        publishing = {"gpu0", "ra", "rb"}
        stop = threading.Event()

        def publish():
            seq = 0
            while not stop.wait(period):
                seq += 1
                for n in list(publishing):
                    kind = "server" if n == "gpu0" else "client"
                    pubs[n].put(codec.encode(Telemetry(kind, n, seq, seq * period, period, {"x": seq})))

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()

        def states():
            return {r["id"]: r["state"] for r in view.rows(time.monotonic())}

        try:
            assert wait_for(lambda: states() == {"gpu0": "up", "ra": "up", "rb": "up"}, 10)
            publishing.discard("rb")
            sessions.pop("rb").close()
            assert wait_for(lambda: states().get("rb") == "GONE", 10)
            publishing.discard("ra")
            assert wait_for(lambda: states() == {"gpu0": "up", "ra": "SILENT", "rb": "GONE"}, 10)
            publishing.discard("gpu0")
            assert wait_for(lambda: states() == {"gpu0": "STALLED", "ra": "UNHEARD", "rb": "GONE"}, 10)
        finally:
            stop.set()
            publisher.join(2)
            for s in sessions.values():
                s.close()


def test_repeated_events_are_logged_on_the_1st_10th_100th_and_every_1000th():
    from lerobot_zenoh.telemetry.publisher import worth_logging

    assert [n for n in range(0, 10_001) if worth_logging(n)] == [1, 10, 100, *range(1000, 10_001, 1000)]


def test_the_dashboard_rates_counters_only_and_every_panel_has_a_unit():
    """Grafana: a counter is read through rate() or increase() (its running total says nothing), a
    gauge never is, every metric queried is one the monitor declares, and every panel has a unit."""
    import re
    from pathlib import Path

    from lerobot_zenoh.telemetry.prometheus import reference_rows

    declared = {m.group(1) for row in reference_rows() for m in [re.search(r"\| `(lerobot_zenoh_\w+)` \|", row)] if m}
    histograms = {m.group(1) for row in reference_rows() for m in [re.search(r"\| `(lerobot_zenoh_\w+)` \(", row)] if m}
    declared |= {f"{h}_{part}" for h in histograms for part in ("bucket", "sum", "count")}
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "dashboards" / "grafana-lerobot-zenoh.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["fieldConfig"]["defaults"].get("unit") not in (None, "", "none"), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for name in re.findall(r"\blerobot_zenoh_\w+", expr):
                assert name in declared, (panel["title"], name)
                rated = re.search(rf"\b(rate|increase)\(\s*{name}\b", expr) is not None
                counted = name.endswith("_total") or name.removesuffix("_bucket") in histograms or (
                    name.rsplit("_", 1)[0] in histograms and name.endswith(("_sum", "_count")))
                assert rated == counted, (panel["title"], expr)


# -- what the monitor holds, bounded in bytes (docs/telemetry.md, "What the monitor trusts") ----------


class _Untouchable:
    """A payload whose bytes must not be read (refused by its length alone)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __bytes__(self) -> bytes:
        raise AssertionError("copied before its size was checked")


def test_the_inbox_refuses_by_length_before_copying_and_holds_a_byte_budget_at_a_bounded_rate():
    from lerobot_zenoh.telemetry.fleet import TelemetryInbox

    inbox = TelemetryInbox(max_bytes=10_000, max_message_bytes=4_000, bytes_per_s=1_000)
    assert inbox.offer("k", _Untouchable(15 << 20), 0.0) == "too_large"  # a 15 MiB message: never copied
    assert inbox.offer("k", b"x" * 3_999, 0.0) is None and inbox.offer("k", b"x" * 3_999, 0.0) is None
    assert inbox.offer("k", b"x" * 3_999, 0.0) == "inbox_full" and inbox.bytes() == 8_000
    key, payload, _ = inbox.take(0.1)
    assert (key, payload) == ("k", b"x" * 3_999) and inbox.bytes() == 4_000
    # 2,000 bytes of its 10,000-byte bucket are left: the next 3,999 wait for 2 s of intake
    assert inbox.offer("k", b"x" * 3_999, 0.5) == "rate_limited"
    assert inbox.offer("k", b"x" * 3_999, 2.5) is None


def test_figure_names_ids_and_sizes_are_checked_before_anything_is_kept():
    from lerobot_zenoh.telemetry.fleet import MAX_FIGURE_CHARS, MAX_ID_CHARS

    view = FleetView()
    figures = {"loop_hz": 30.0, "n" * 60_000: 1.0, "x" * (MAX_FIGURE_CHARS + 1): 1.0, "bad name{}": 1.0,
               "flag": True, "text": "word", "steps": 5}
    view.on_telemetry("c/e/m/v/a/r1/metrics", Telemetry("client", "r1", 0, 1.0, 1.0, figures), 0.0)
    view.on_telemetry(f"c/e/m/v/a/{'r' * (MAX_ID_CHARS + 1)}/metrics",
                      Telemetry("client", "r" * (MAX_ID_CHARS + 1), 0, 1.0, 1.0, {"steps": 1}), 0.0)
    [member] = view.members()
    assert member.metrics == {"loop_hz": 30.0, "steps": 5}
    assert dict(view.figures_refused) == {"too_long": 2, "bad_name": 1, "not_a_number": 2}
    assert dict(view.rejected_by) == {"unknown_key": 1}


def test_a_heavy_server_member_is_capped_in_figures_and_bytes_and_many_stay_within_the_state_budget():
    from lerobot_zenoh.telemetry.fleet import MAX_CLIENT_FIGURES, SERVER_BYTES

    per_client = {f"robot-{i:04d}": {f"f_{j:02d}": float(j) for j in range(100)} for i in range(1024)}
    view = FleetView(state_bytes=3 * SERVER_BYTES)
    view.on_liveliness("c/e/m/v/a/r1/metrics", True, 0.0)
    for i in range(3):
        view.on_telemetry("c/e/m/v/a/r1/metrics", Telemetry("client", "r1", i, 1.0, 1.0, {"steps": i}), float(i))
    for k in range(8):  # forged heavy servers, plain mode
        view.on_telemetry(f"c/e/m/v/a/server/forged{k}/metrics",
                          Telemetry("server", f"forged{k}", 0, 1.0, 1.0, {"inferences": 1}, per_client), 10.0 + k)
    members = view.members()
    assert view.state_bytes <= 3 * SERVER_BYTES and sum(m.cost for m in members) == view.state_bytes
    assert all(m.cost <= SERVER_BYTES for m in members)
    assert all(len(f) <= MAX_CLIENT_FIGURES for m in members for f in m.per_client.values())
    assert any(m.member_id == "r1" for m in members)  # the honest robot (live token) stays
    assert view.figures_refused["too_many"] > 0 and view.members_forgotten > 0


def test_the_state_budget_is_a_bound_on_what_python_holds():
    """The accounting (FIGURE_BYTES per figure) is not below what CPython really spends on kept figures."""
    import gc
    import tracemalloc

    from lerobot_zenoh.protocol import codec

    server = codec.encode(Telemetry("server", "g", 0, 1.0, 1.0, {"inferences": 1},
                                    {f"robot-{i:04d}": {f"f_{j:02d}": float(j) for j in range(32)} for i in range(256)}))
    robot = codec.encode(Telemetry("client", "x", 0, 1.0, 1.0, {f"figure_{j}": float(j) for j in range(64)}))
    view = FleetView()
    gc.collect()
    tracemalloc.start()
    try:
        for k in range(4):
            view.on_telemetry(f"c/e/m/v/a/server/g{k}/metrics", codec.decode_telemetry(server), 0.0)
        for k in range(200):
            view.on_telemetry(f"c/e/m/v/a/x{k}/metrics", codec.decode_telemetry(robot), 0.0)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= view.state_bytes, (held, view.state_bytes)


def test_metrics_stay_within_their_byte_budget_and_the_fleet_comes_before_a_flood():
    from lerobot_zenoh.telemetry.prometheus import families, render, valid_label_name, valid_metric_name

    assert valid_metric_name("lerobot_zenoh_server_inferences") and not valid_metric_name("a-b")
    assert not valid_metric_name("x" * 201) and not valid_metric_name("1abc")
    assert valid_label_name("client") and not valid_label_name("__name__") and not valid_label_name("a.b")
    view = FleetView()
    for i in range(3):
        view.on_telemetry("c/e/m/v/a/r1/metrics", Telemetry("client", "r1", i, 1.0, 1.0, {"steps": 10 + i}), float(i))
    for i in range(2000):  # invented ids, 64 figures each, after the honest robot
        view.on_telemetry(f"c/e/m/v/a/x{i}/metrics",
                          Telemetry("client", f"x{i}", 0, 1.0, 1.0, {f"figure_{j}": j for j in range(64)}), 5.0)
    budget = 256 << 10
    fams, taken = families(view.samples(), budget)
    body, cut = render(fams, budget)
    assert len(body.encode()) <= budget and taken < view.series_count()
    assert 'lerobot_zenoh_client_steps_total{app="a",client="r1"' in body  # the honest robot first
    assert "lerobot_zenoh_monitor_messages_total " in body  # and the monitor's own counts


def test_the_docs_metric_reference_is_the_declared_table():
    """docs/telemetry.md lists every metric with its type, unit and labels: the table the export uses."""
    from pathlib import Path

    from lerobot_zenoh.telemetry.prometheus import reference_rows

    doc = (Path(__file__).resolve().parents[1] / "docs" / "telemetry.md").read_text()
    section = doc.split("#### Metric reference", 1)[1].strip().splitlines()
    table = [line for line in section if line.startswith("|")]
    assert table == reference_rows(), ("regenerate: python -c 'from lerobot_zenoh.telemetry.prometheus import "
                                       "reference_rows; print(chr(10).join(reference_rows()))'")


def test_the_monitors_intake_channel_hands_over_samples_and_ends_when_closed(port):
    """ZenohSession.subscribe_channel: samples wait in Zenoh's bounded FIFO until taken; recv gives
    (key, payload) with its length readable before any copy, and None once the subscription closed."""
    from lerobot_zenoh.transport.session import METRICS_QOS

    with ZenohSession(loopback_settings(port)) as hub, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as monitor:
        channel = monitor.subscribe_channel("**/metrics", 4)
        taken: list = []
        reader = threading.Thread(target=lambda: taken.extend(iter(channel.recv, None)), daemon=True)
        reader.start()
        pub = hub.publisher("c/e/m/v/a/r1/metrics", METRICS_QOS)
        assert wait_for(lambda: pub.put(b"x" * 5000) is None and len(taken) >= 3, 10, poll_s=0.1)
        key, payload = taken[0]
        assert key == "c/e/m/v/a/r1/metrics" and len(payload) == 5000 and bytes(payload) == b"x" * 5000
        channel.close()
        reader.join(5)
        assert not reader.is_alive()


def test_figures_a_small_fleet_does_not_publish_are_declared_too():
    """Engines, language, pi0-FAST decoding, VLMs, schedulers and pipelines publish figures the
    running-fleet test does not see: each is declared with the type its meaning gives it."""
    from lerobot_zenoh.telemetry.prometheus import describe

    counters = {
        "server": ["language.tokens", "language.decode_steps", "language.step_rows", "language.started",
                   "language.finished.stop", "language.finished.limit", "language.evicted", "language.forgotten",
                   "language.busy", "language.budget_shrunk", "language.decode_ms", "language.step_ms",
                   "decode.kv_allocations", "decode.kv_evictions", "decode.finished_end", "decode.finished_limit",
                   "decode.prefills", "decode.prefill_ms", "decode.decode_steps", "decode.decode_rows", "decode.decode_ms",
                   "decode.packed_steps", "decode.packed_ms", "vlm.prefill_batches", "vlm.decode_steps",
                   "engine.c0.dispatched", "engine.c0.answered", "engine.c0.requeued", "engine.c0.late",
                   "engine.c0.refused", "engine.c0.refused.bad_answer", "engine.c0.restarts", "engine.c0.partitions",
                   "dispatch.requeue_superseded", "dispatch.answers_closed", "scheduler.decisions", "takeovers", "takeovers_stalled",
                   "standby_dropped", "answers.actions", "answers.verdict.safe", "sessions_closed.idle",
                   "shm_rings_opened", "shm_orphans_removed", "batch_fallbacks", "observations_for_other_components"],
        "server_client": ["served.edge", "served.cloud", "rejected.task_too_long"],
        "client": ["slo.act.requests", "slo.act.met", "slo.act.missed", "pipeline.failures", "pipeline.override_steps",
                   "pipeline.results_dropped", "pipeline.results_rejected", "dataset_frames", "session_renewals"],
    }
    gauges = {
        "server": ["language.active", "language.cached_tokens", "decode.slots", "decode.running", "decode.waiting",
                   "decode.kv_bytes", "engine.c0.up", "engine.c0.in_flight", "engine.c0.offload_share", "engine.c0.rtt_ms",
                   "engine.c0.bandwidth_mbps", "engine.c0.estimate_ms_mean", "engine.c0.queue_actual_ms_mean",
                   "offload_share", "scheduler.waiting", "scheduler.clients", "scheduler.tasks", "scheduler.skipped_max",
                   "batch_profile.8_ms", "serving", "gpu_allocated_mb", "shm_rings_mapped", "max_batch_size"],
        "client": ["slo.act.latency_ms_p99", "slo.act.attainment", "slo.act.slo_violated", "pipeline.attempt",
                   "pipeline.mode", "pipeline.danger_reaction_ms_max", "rtc_active", "rtc_delay_error_steps_p90"],
    }
    for expected, table in (("counter", counters), ("gauge", gauges)):
        for kind, figures in table.items():
            wrong = [(f, describe(kind, f).kind) for f in figures if not describe(kind, f).declared
                     or describe(kind, f).kind != expected]
            assert not wrong, (kind, expected, wrong)
    assert describe("server", "language.decode_ms").name.endswith("_seconds") and describe("server", "language.decode_ms").scale == 1e-3
    assert dict(describe("server", "decode.finished_limit").labels) == {"reason": "limit"}


def test_a_message_over_the_monitors_limit_sheds_per_robot_figures_not_the_server():
    """About a thousand robots on one server: the message would be over the monitor's 1 MiB and
    refused unread; it goes without the per-robot histograms (then without per-robot figures), says
    so in `telemetry.per_client_shed`, and the monitor reads it."""
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.telemetry.fleet import MAX_MESSAGE_BYTES
    from lerobot_zenoh.telemetry.publisher import TelemetryPublisher

    sent = []

    class Pub:
        def put(self, payload):
            sent.append(payload)

    def robots(n, histogram_bins):
        per = {"served": 10, "rejected.too_large": 1, "inference_ms_p50": 12.5, "queue_ms_p99": 3.0}
        per |= {f"inference_hist.le_{i}": i for i in range(histogram_bins)}
        return {"count": n}, {f"robot_{i:05d}": dict(per) for i in range(n)}

    # (robots, histogram bins each, what is shed): 3,500 robots' bins are 2 MB; 5,000 robots are more
    # entries than a map of the wire may hold, whatever their size.
    for n, bins, shed in ((100, 12, None), (3500, 24, 1), (5000, 0, 2)):
        publisher = TelemetryPublisher(None, "k/metrics", "server", "gpu0", lambda n=n, b=bins: robots(n, b))
        publisher._publisher = Pub()
        publisher.publish_once()
        assert len(sent[-1]) <= MAX_MESSAGE_BYTES
        msg = codec.decode_telemetry(sent[-1])
        assert msg.metrics.get("telemetry.per_client_shed") == shed and msg.metrics["count"] == n
        assert publisher.shed == (shed is not None)
        if shed == 1:
            assert len(msg.per_client) == n and not any("_hist." in k for f in msg.per_client.values() for k in f)
        if shed == 2:
            assert msg.per_client == {}
