"""lerobot-zenoh-profile against a real server over loopback Zenoh (synthetic policy, set latency)."""

import pytest
from lz_testing import free_port, make_server

from lerobot_zenoh.pipelines.profiles import load_profiles
from lerobot_zenoh.pipelines.profiling import add_points, latency_point
from lerobot_zenoh.protocol.keys import AppKey


def test_latency_point_and_add_points_are_pure():
    p = latency_point(4, 10.0, [10.0, 20.0, 30.0, 40.0])
    assert p.mean_ms == 25.0 and p.p50_ms == 25.0 and p.p99_ms > p.p90_ms > p.p50_ms
    profiles = add_points(None, "m", [p])
    profiles = add_points(profiles, "m", [latency_point(4, 20.0, [50.0]), latency_point(1, 5.0, [9.0])])
    assert sorted((q.batch_size, q.rate_hz) for q in profiles.models["m"].points) == [(1, 5.0), (4, 20.0)]
    with pytest.raises(ValueError):
        latency_point(1, 1.0, [])


def test_profile_a_running_server_writes_a_profile_the_planner_reads(tmp_path, capsys):
    from lerobot_zenoh.cli.profile import main

    port = free_port()
    app = AppKey("prof", f"t{port}", "synthetic", "v1", "any")
    server = make_server(port, app, latency_ms=20.0).start()
    try:
        out = tmp_path / "profiles.yaml"
        rc = main([f"--endpoint=tcp/127.0.0.1:{port}", f"--output={out}", "--profile_name=synth",
                   f"--cluster_uuid={app.cluster}", f"--experiment_tag={app.experiment}", "--model_id=synthetic",
                   "--application_tag=any", "--clients=4", "--saturation_s=1", "--seconds_per_rate=1",
                   "--timeout_s=2", "--fractions=[0.2,0.5]"])
    finally:
        server.stop()
    assert rc == 0, capsys.readouterr().err
    prof = load_profiles(out).models["synth"]
    assert [p.batch_size for p in prof.points] == [1, 1]
    assert all(p.mean_ms >= 20.0 and p.p99_ms >= p.p50_ms for p in prof.points)
    assert prof.points[0].rate_hz < prof.points[1].rate_hz


def test_no_server_is_exit_3(tmp_path, capsys):
    from lerobot_zenoh.cli.profile import main

    rc = main([f"--endpoint=tcp/127.0.0.1:{free_port()}", f"--output={tmp_path / 'p.yaml'}", "--profile_name=x",
               "--saturation_s=0.5"])
    assert rc == 3 and "no server answers" in capsys.readouterr().err


@pytest.mark.parametrize("output", ["text", "verdict"])
def test_a_text_or_verdict_component_is_profiled_by_its_answers(tmp_path, capsys, output):
    """A System 2 / safety server answers TextResults / Verdicts: the latency is measured to them."""
    from lerobot_zenoh.cli.profile import main
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer

    port = free_port()
    app = AppKey("prof", f"t{port}", "vlm", "v1", "comp")
    server = PolicyServer(parse_manifest({
        "cluster_uuid": app.cluster, "experiment_tag": app.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": "vlm", "model_version": "v1", "application_tag": "comp", "accept_unknown_clients": True,
                    "synthetic": {"output": output, "chunk_size": 1, "latency_ms": 30.0,
                                  "cameras": {"front": [16, 16]}},
                    "pipeline": {"task": "kit", "component": "c", "bit": 1}}],
    })).start()
    try:
        out = tmp_path / "profiles.yaml"
        rc = main([f"--endpoint=tcp/127.0.0.1:{port}", f"--output={out}", "--profile_name=qwen",
                   f"--cluster_uuid={app.cluster}", f"--experiment_tag={app.experiment}", "--model_id=vlm",
                   "--application_tag=comp", "--clients=4", "--saturation_s=1", "--seconds_per_rate=1",
                   "--timeout_s=2", "--fractions=[0.5]", "--batching=continuous"])
    finally:
        server.stop()
    assert rc == 0, capsys.readouterr().err
    prof = load_profiles(out).models["qwen"]
    assert prof.batching == "continuous" and len(prof.points) == 1 and prof.points[0].mean_ms >= 30.0
