"""The TCP fault kit (testbed/fault_kit/tcp.py) on the monitor's Prometheus endpoint, each fault beside an
honest scraper; and the kit's own pieces. The front door's runs are in tests/test_openpi_faults.py.
Short by default, never timing-asserted; LZ_FAULTS_LONG=1 (`make test-faults-tcp`) runs them long
and prints what the honest client got.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest
from lz_testing import free_port, wait_for
from testbed.fault_kit import tcp

LONG = os.environ.get("LZ_FAULTS_LONG") == "1"
SECONDS = 15 if LONG else 2


def scrape(port: int) -> None:
    status, body = tcp.http_get("127.0.0.1", port, "/metrics", timeout_s=10)
    assert status == 200 and b"# TYPE" in body, status


@pytest.fixture
def metrics_port():
    pytest.importorskip("prometheus_client")
    from lerobot_zenoh.cli.monitor import serve_prometheus
    from lerobot_zenoh.telemetry.fleet import FleetView

    port = free_port()
    http = serve_prometheus(FleetView(), port)
    try:
        yield port
    finally:
        http.shutdown()


@pytest.mark.parametrize("fault", ["storm", "resets", "mid_upgrade", "slowloris", "flood"])
def test_the_metrics_endpoint_serves_an_honest_scraper_beside_each_fault(metrics_port, fault):
    port = metrics_port
    faults = {
        "storm": lambda stop: tcp.storm("127.0.0.1", port, 10**6, stop),
        "resets": lambda stop: tcp.resets("127.0.0.1", port, 10**6, stop),
        "mid_upgrade": lambda stop: tcp.close_at_stage("127.0.0.1", port, "mid_upgrade", 10**6, stop),
        "slowloris": lambda stop: tcp.slowloris("127.0.0.1", port, 300, stop, byte_every_s=0.5),
        "flood": lambda stop: tcp.http_flood("127.0.0.1", port, stop, path="/metrics", connections=4),
    }
    service, done = tcp.beside(lambda: scrape(port), faults[fault], SECONDS, period_s=0.05)
    print(f"/metrics beside {fault}: {service.line()}; fault sent {done.sent}")
    assert service.served >= 1 and not service.errors, service.line()
    scrape(port)  # and after it


_CHILD = r"""
import sys, time
from lerobot_zenoh.cli.monitor import serve_prometheus
from lerobot_zenoh.telemetry.fleet import FleetView
http = serve_prometheus(FleetView(), int(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
http.shutdown()
"""


def test_the_metrics_endpoint_goes_on_under_an_open_file_limit(tmp_path):
    pytest.importorskip("prometheus_client")
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, preexec_fn=tcp.nofile_limit(128),
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    idle = []
    try:
        assert child.stdout.readline().strip() == "ready"
        idle = tcp.hold_idle("127.0.0.1", port, 300)  # more than its limit: EMFILE, then the oldest go
        assert wait_for(lambda: _served(port), 30)
        for sock in idle:
            sock.close()
        idle = []
        scrape(port)
    finally:
        for sock in idle:
            sock.close()
        child.stdin.close()
        child.wait(30)


def _served(port: int) -> bool:
    try:
        scrape(port)
        return True
    except (OSError, AssertionError):
        return False


def test_the_kits_frames_are_what_they_claim():
    frame = tcp.nested_frame(1 << 20, "lists")
    assert (1 << 20) * 0.5 < len(frame) <= (1 << 20) * 1.1
    unpacked = msgpack.unpackb(frame)
    assert len(unpacked["x"]) > 100 and all(v == [] for v in unpacked["x"][0])
    maps = msgpack.unpackb(tcp.nested_frame(1 << 20, "maps"))
    assert isinstance(maps["x"], dict) and len(next(iter(maps["x"].values()))) == 4096
    wire = tcp.ws_frame(b"hello" * 1000)
    assert wire[0] == 0x82 and wire[1] & 0x80  # binary, final, masked
    assert json.dumps(tcp.Service().line())
    with pytest.raises(ValueError, match="loopback only"):
        tcp.storm("192.0.2.1", 80, 1)
