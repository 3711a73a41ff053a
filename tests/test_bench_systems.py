"""The systems `make bench` compares, as far as they can be checked without running the benchmark:
our server as the ingest benchmark starts and reads it (a refactor of the server once broke
`stats()` and only `make bench` noticed)."""

from __future__ import annotations

from benchmarks import systems
from lerobot_zenoh.protocol import codec


def test_our_bench_server_starts_reports_its_stats_and_stops(port, monkeypatch):
    for name in ("decode_observation", "decode_jpeg"):  # OursServer wraps these to count: restored after
        monkeypatch.setattr(codec, name, getattr(codec, name))
    server = systems.OursServer([f"tcp/127.0.0.1:{port}"], [{"app": "ingest", "workload": "cam1_224x224"}])
    try:
        server.start()
        stats = server.stats()
        assert stats["received"] == stats["served"] == stats["samples"] == 0
        assert {"decoded_observations", "decoded_jpegs", "rejected", "superseded"} <= set(stats)
    finally:
        server.close()
