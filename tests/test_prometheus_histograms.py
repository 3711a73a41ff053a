"""Latencies as Prometheus histograms (docs/telemetry.md, "Histograms"): bins in the telemetry, the
monitor's `_bucket{le}`/`_sum`/`_count` in seconds, checked by promtool and aggregated across two
servers by a real Prometheus."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from lerobot_zenoh.protocol.messages import Telemetry
from lerobot_zenoh.telemetry.fleet import FleetView
from lerobot_zenoh.telemetry.histogram import LATENCY_BOUNDS_S, LatencyHistogram, parse_bound
from lerobot_zenoh.telemetry.prometheus import families, render

from lz_testing import free_port, wait_for

FAMILY = "lerobot_zenoh_server_inference_seconds"


def server_message(server_id: str, seq: int, inference: LatencyHistogram, robot: LatencyHistogram) -> Telemetry:
    return Telemetry("server", server_id, seq, float(seq), 0.5, {"inferences": inference.count, **inference.figures("inference")},
                     {"r1": robot.figures("queue")})


def feed(view: FleetView, server_id: str, seq: int, inference: LatencyHistogram, robot: LatencyHistogram) -> None:
    view.on_telemetry(f"c/e/act/v1/a/server/{server_id}/metrics", server_message(server_id, seq, inference, robot),
                      time.monotonic())


def test_a_histogram_travels_as_its_non_empty_bins_and_comes_back_cumulative_in_seconds():
    h = LatencyHistogram()
    for ms in (3, 3, 40, 40, 40, 20_000):
        h.observe_ms(ms)
    figures = h.figures("inference")
    assert figures == {"inference_hist.le_5000": 2, "inference_hist.le_50000": 3, "inference_hist.le_inf": 1,
                       "inference_hist.sum_s": 20.126, "inference_hist.count": 6}
    assert parse_bound("le_2500") == 0.0025 and parse_bound("le_inf") == float("inf") and parse_bound("le_x") is None
    view = FleetView()
    feed(view, "gpu0", 1, h, LatencyHistogram())
    [fam] = [f for f in families(view.samples())[0] if f.name == FAMILY]
    [(labels, buckets, sum_s)] = fam.histograms
    assert labels["server"] == "gpu0" and labels["model"] == "act" and sum_s == 20.126
    assert [b for b, _ in buckets] == [*LATENCY_BOUNDS_S, float("inf")]  # every bound, so that servers add up
    assert dict(buckets)[0.0025] == 0 and dict(buckets)[0.005] == 2 and dict(buckets)[0.05] == 5
    assert dict(buckets)[10.0] == 5 and buckets[-1] == (float("inf"), 6)
    text, _ = render(families(view.samples())[0])
    assert f'{FAMILY}_bucket{{app="a",cluster="c",experiment="e",model="act",server="gpu0",version="v1",le="0.005"}} 2.0' in text
    assert f'{FAMILY}_count{{app="a",cluster="c",experiment="e",model="act",server="gpu0",version="v1"}} 6.0' in text
    assert "# TYPE lerobot_zenoh_server_client_queue_seconds histogram" not in text  # the robot's is empty


def test_a_forged_histogram_is_left_out_not_exported_broken():
    view = FleetView()
    view.on_telemetry("c/e/act/v1/a/server/gpu0/metrics", Telemetry(
        "server", "gpu0", 1, 1.0, 0.5, {"inference_hist.le_1000": -3, "queue_hist.le_5000": 2, "queue_hist.sum_s": 0.01,
                                        "queue_hist.count": 2}), 0.0)
    names = {f.name for f in families(view.samples())[0] if f.histograms}
    assert names == {"lerobot_zenoh_server_queue_seconds"}


def two_servers(seq: int) -> dict[str, tuple[LatencyHistogram, LatencyHistogram]]:
    """server id -> (its inference histogram, its robot's queue histogram) after 100 * seq chunks."""
    out = {}
    for i, server_id in enumerate(("gpu0", "gpu1")):
        inference, robot = LatencyHistogram(), LatencyHistogram()
        for k in range(100 * seq):
            inference.observe_ms(20 + (k % 10) + 10 * i)  # gpu0 20..29 ms, gpu1 30..39 ms
            robot.observe_ms(2)
        out[server_id] = (inference, robot)
    return out


def exposition_of_two_servers(seq: int) -> str:
    view = FleetView()
    for server_id, hists in two_servers(seq).items():
        feed(view, server_id, seq, *hists)
    return render(families(view.samples())[0])[0]


def test_the_exposition_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; make ci-tools installs it in CI)")
    text = exposition_of_two_servers(1)
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_a_real_prometheus_aggregates_the_histogram_across_two_servers(tmp_path):
    """Prometheus scrapes the monitor's /metrics (two servers' inference histograms, growing between
    scrapes) and answers the dashboard's query: the p99 of both servers together."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (apt-get install -y --no-install-recommends prometheus)")
    from lerobot_zenoh.cli.monitor import serve_prometheus

    view = FleetView()
    metrics_port, prom_port = free_port(), free_port()
    http = serve_prometheus(view, metrics_port)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: lz, static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]}}]\n")
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    query = "histogram_quantile(0.99, sum by (le) (rate(lerobot_zenoh_server_inference_seconds_bucket[1m])))"
    answer: dict = {}
    seq = [1]

    def answered() -> bool:
        seq[0] += 1
        for server_id, hists in two_servers(seq[0]).items():  # both servers served 100 more chunks
            feed(view, server_id, seq[0], *hists)
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=2).read())
        except OSError:
            return False
        answer.update(body)
        result = body.get("data", {}).get("result", [])
        return bool(result) and result[0]["value"][1] not in ("NaN", "+Inf")

    try:
        found = wait_for(answered, 60, poll_s=0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        http.shutdown()
    assert found, (answer, proc.stderr.read()[-2000:] if proc.stderr else "")
    [series] = answer["data"]["result"]
    p99 = float(series["value"][1])
    # 99 % of both servers' chunks took at most 39 ms: the p99 lies in the bucket (0.025, 0.05]
    assert 0.025 < p99 <= 0.05, p99
    assert series["metric"] == {}  # one series: summed over the two servers



@pytest.mark.parametrize("server_id", [None, "gpu0"], ids=["no server_id", "server_id"])
def test_a_server_without_server_id_warns_that_its_series_change_every_start(port, app_key, caplog, server_id):
    """The `server` label is the manifest's server_id; <hostname>-<pid> (a new series at every
    restart) only when none is given, and then the server says so once it serves."""
    import logging

    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer

    data = {"cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment,
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
            "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                        "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 10, "cameras": {},
                                      "latency_ms": 1.0}, "fps": 30, "accept_unknown_clients": True}]}
    if server_id:
        data["server_id"] = server_id
    with caplog.at_level(logging.WARNING, logger="lerobot_zenoh.server.shell.policy_server"), PolicyServer(parse_manifest(data)) as server:
        warned = [r.getMessage() for r in caplog.records if "no server_id" in r.getMessage()]
        assert warned == ([] if server_id else [
            f"no server_id in the manifest (or --server_id): serving as {server.server_id}, which changes with every "
            "start; set server_id for stable metrics series (docs/telemetry.md)"])
