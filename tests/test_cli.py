"""Every console script, run as a user runs it: each configuration mistake is one or two lines on
stderr naming the flag or the device, with exit code 2 (docs/client.md, "Exit codes"); --help
still lists every option."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each case starts a Python process that imports LeRobot

SCRIPTS = {
    "lerobot-robot-client": "lerobot_zenoh.cli.client",
    "lerobot-policy-server": "lerobot_zenoh.cli.server",
    "lerobot-zenoh-monitor": "lerobot_zenoh.cli.monitor",
    "lerobot-zenoh-build-checkpoint": "lerobot_zenoh.cli.build_checkpoint",
    "lerobot-zenoh-router": "lerobot_zenoh.cli.router",
    "lerobot-zenoh-secure": "lerobot_zenoh.cli.secure",
}


def command(script: str) -> list[str]:
    """The installed console script next to this interpreter (as a user types it), else `python -m`."""
    installed = Path(sys.executable).parent / script
    return [str(installed)] if installed.exists() else [sys.executable, "-m", SCRIPTS[script]]


def run_all(cases: list[tuple[str, list[str]]], timeout_s: float = 120) -> list[subprocess.CompletedProcess]:
    """Run the cases side by side (each is a cold start of a LeRobot-importing process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(command(script) + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for script, args in cases]
    results = []
    for (script, args), proc in zip(cases, procs):
        try:
            out, err = proc.communicate(timeout=timeout_s)
        finally:
            proc.kill()
        results.append(subprocess.CompletedProcess([script, *args], proc.returncode, out, err))
    return results


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.returncode == 2, (result.args, result.returncode, result.stderr[-2000:])
    assert 1 <= len(lines) <= 2, (result.args, result.stderr[-2000:])
    for needle in needles:
        assert needle in result.stderr, (result.args, needle, result.stderr)
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr


CLIENT = ["--robot.type=zenoh_sim"]

MISTAKES = [
    # (script, arguments, what the one line must name)
    ("lerobot-robot-client", [*CLIENT, "--failsafe=stop"], ["--failsafe", "'stop'", "hold"]),  # bad value
    ("lerobot-robot-client", [*CLIENT, "--dataset.num_episodes=two"], ["--dataset.num_episodes", "'two'"]),  # wrong type
    ("lerobot-robot-client", [*CLIENT, "--num_episodes=2"], ["unknown flag --num_episodes=2"]),  # unknown flag
    ("lerobot-robot-client", [], ["missing required flag --robot.type"]),
    ("lerobot-robot-client", [*CLIENT, "--robot.control_mode=torque"], ["--robot.control_mode", "torque"]),
    ("lerobot-robot-client", [*CLIENT, "--dataset.repo_id=nouser"], ["--dataset.repo_id", "<user>/<name>"]),
    ("lerobot-robot-client", ["--robot.type=so101_follower", "--robot.port=/dev/ttyACM_not_there"],
     ["--robot.port", "/dev/ttyACM_not_there does not exist"]),  # missing device
    # a device that is there but is no robot: without LeRobot's feetech driver installed, the missing
    # driver and the extra that brings it; with it ([hardware]), "cannot connect to the so100_follower at /dev/null"
    ("lerobot-robot-client", ["--robot.type=so101_follower", "--robot.port=/dev/null"], ["--robot"]),
    ("lerobot-policy-server", ["--manifest=/nonexistent/m.yaml"], ["--manifest", "/nonexistent/m.yaml is not a file"]),
    ("lerobot-policy-server", ["--manifest=manifests/demo.yaml", "--log_level=LOUD"], ["--log_level", "LOUD"]),
    ("lerobot-policy-server", ["--manifest=manifests/demo.yaml", "--server-id=x"], ["unknown flag --server-id=x"]),
    ("lerobot-policy-server", [], ["missing required flag --manifest"]),
    ("lerobot-zenoh-monitor", ["--prometheus_port=70000"], ["--prometheus_port", "70000"]),
    ("lerobot-zenoh-monitor", ["--refresh_s=fast"], ["--refresh_s", "'fast'"]),
    ("lerobot-zenoh-monitor", ["--prometheus-port=9464"], ["unknown flag --prometheus-port=9464"]),
    ("lerobot-zenoh-build-checkpoint", ["--output=/tmp/never", "--state_dim=0"], ["--state_dim", ">= 1"]),
    ("lerobot-zenoh-build-checkpoint", ["--output=/tmp/never", "--state-dim=2"], ["unknown flag --state-dim=2"]),
    ("lerobot-zenoh-build-checkpoint", ["--state_dim=2"], ["missing required flag --output"]),
    ("lerobot-zenoh-router", ["--zenoh.multicast_scouting=maybe"], ["--zenoh.multicast_scouting", "'maybe'"]),
    ("lerobot-zenoh-router", ["--nope"], ["unrecognized arguments: --nope"]),
    ("lerobot-zenoh-secure", ["init", "--out=/tmp/never"], ["--manifest"]),
    ("lerobot-zenoh-secure", ["init", "--manifest=manifests/demo.yaml", "--out=/tmp/never", "--valid_days=soon"],
     ["--valid_days", "'soon'"]),
]


def test_every_configuration_mistake_is_one_line_and_exit_2():
    for (script, args, needles), result in zip(MISTAKES, run_all([(s, a) for s, a, _ in MISTAKES])):
        assert_one_line_error(result, *needles)


def test_a_dead_endpoint_is_one_line_and_exit_3(port):
    (result,) = run_all([("lerobot-robot-client", [*CLIENT, f"--endpoint=tcp/127.0.0.1:{port}"])])
    assert result.returncode == 3, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"cannot connect to tcp/127.0.0.1:{port}" in errors[0], result.stderr[-2000:]


def test_help_lists_every_option():
    cases = [("lerobot-robot-client", ["--help"]), ("lerobot-policy-server", ["--help"]),
             ("lerobot-zenoh-monitor", ["--help"]), ("lerobot-zenoh-build-checkpoint", ["--help"]),
             ("lerobot-zenoh-router", ["--help"]), ("lerobot-zenoh-secure", ["init", "--help"])]
    client, server, monitor, build, router, secure = run_all(cases)
    for result in (client, server, monitor, build, router, secure):
        assert result.returncode == 0, (result.args, result.stderr[-2000:])
    for flag in ("--robot.type", "--client_uuid", "--endpoint", "--zenoh.connect", "--dataset.repo_id",
                 "--dataset.root", "--dataset.episode_time_s", "--dataset.reset_time_s", "--dataset.num_episodes",
                 "--dataset.video", "--dataset.single_task", "--resume", "--duration_s", "--failsafe"):
        assert flag in client.stdout, flag
    words = " ".join(client.stdout.split())
    assert "the robot is held, nothing is recorded" in words  # help in a user's words
    assert "Most observations awaiting their action chunk at once" in words  # field(metadata={"help": ...})
    assert "Zenoh mode: auto" in words and "Control rate; every send_action" in words
    assert "--manifest" in server.stdout and "--server_id" in server.stdout
    for flag in ("--endpoint", "--zenoh.mode", "--prometheus_port", "--json", "--duration_s", "--cluster_uuid"):
        assert flag in monitor.stdout, flag
    assert "--policy_type" in build.stdout and "--overrides" in build.stdout
    assert "--zenoh.listen" in router.stdout and "--log_level" in router.stdout
    assert "--router_endpoint" in secure.stdout and "--ca_cert" in secure.stdout
    for result in (client, server, monitor, build, router, secure):
        for citation in ("seed 002", "G7", "G14", "§"):
            assert citation not in result.stdout, (result.args, citation)


def test_a_listen_port_in_use_is_one_line_and_exit_2():
    """The device here is a TCP port: the router cannot listen where something else already does."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        (result,) = run_all([("lerobot-zenoh-router", [f"--zenoh.listen=tcp/127.0.0.1:{taken}"])])
    assert_one_line_error(result, f"cannot start on tcp/127.0.0.1:{taken}", "Address already in use")


def test_the_client_says_what_it_did_in_one_line_at_exit():
    from lerobot_zenoh.cli.client import summary_line

    base = {"client_uuid": "r0", "steps": 300, "actions_executed": 163, "chunks_received": 28,
            "empty_buffer_cycles": 137, "requests_unanswered": 0, "rtt_ms_p50": 46.83}
    assert summary_line(base) == ("r0: 300 steps, 163 actions executed, 28 chunks, 137 steps with an empty buffer, "
                                  "0 requests unanswered, RTT p50 46.8 ms")
    piped = base | {"rtt_ms_p50": None, "pipeline": {"attempts": 1, "slo.act.met": 28, "slo.act.requests": 28,
                                                     "slo.safety.met": 19, "slo.safety.requests": 20}}
    assert summary_line(piped).endswith("requests unanswered; in SLO (met/asked): act 28/28, safety 19/20; attempts 1")
