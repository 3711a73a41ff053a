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


def test_our_bench_client_round_trips_and_runs_its_loop_through_the_injected_parts(port):
    """OursClient observes the real client through its seams (a task, a session factory, the robot):
    each round trip is timed from the hand-over to the merge, payload sizes and step starts are seen."""
    server = systems.OursServer([f"tcp/127.0.0.1:{port}"], [{"app": "ingest", "workload": "cam1_224x224"}])
    client = systems.OursClient("cam1_224x224", f"tcp/127.0.0.1:{port}", app="ingest")
    try:
        server.start()
        client.start()
        trips = client.round_trips(3)
        assert len(trips["rtt_ms"]) + trips["lost"] == 3 and len(trips["rtt_ms"]) >= 2
        assert trips["obs_bytes"] and trips["obs_bytes"] > 1000  # one JPEG frame at least
        loop = client.control_loop(0.5)
        assert len(loop["steps"]) >= 5 and loop["chunks"] >= 1
    finally:
        client.close()
        server.close()


def test_a_benchmark_without_matplotlib_says_so_in_one_line_and_keeps_its_numbers(tmp_path, capsys, monkeypatch):
    """latency, ingest and control_loop draw their figure with matplotlib (the `bench` extra); run
    by hand without it they used to print their table only after failing on the plot."""
    import sys

    from benchmarks.harness.results import Run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    run = Run(str(tmp_path))
    drawn = []
    assert run.write_plot("latency", lambda result, path: drawn.append(path), {"cases": []}) is None
    assert drawn == [] and "no latency.png: matplotlib is not installed" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", sys)  # any module: "installed"
    assert run.write_plot("latency", lambda result, path: drawn.append(path), {}) == tmp_path / "latency.png"
    assert drawn == [tmp_path / "latency.png"]
