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
    "lerobot-zenoh-cache": "lerobot_zenoh.cli.cache",
}


def command(script: str) -> list[str]:
    """The installed console script next to this interpreter (as a user types it), else `python -m`."""
    installed = Path(sys.executable).parent / script
    return [str(installed)] if installed.exists() else [sys.executable, "-m", SCRIPTS[script]]


def run_all(cases: list[tuple[str, list[str]]], timeout_s: float = 120,
            env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run the cases side by side (each is a cold start of a LeRobot-importing process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
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
    """Exit 2 and one line (two at most) saying why, after the progress log lines (INFO) if any."""
    import re

    info = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO ")
    lines = [line for line in result.stderr.strip().splitlines() if line.strip() and not info.match(line)]
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
    ("lerobot-policy-server", [], ["--policy.path: missing", "--manifest=FILE"]),
    ("lerobot-zenoh-monitor", ["--prometheus_port=70000"], ["--prometheus_port", "70000"]),
    ("lerobot-zenoh-monitor", ["--refresh_s=fast"], ["--refresh_s", "'fast'"]),
    ("lerobot-zenoh-monitor", ["--prometheus-port=9464"], ["unknown flag --prometheus-port=9464"]),
    ("lerobot-zenoh-build-checkpoint", ["--output=/tmp/never", "--state_dim=0"], ["--state_dim", ">= 1"]),
    ("lerobot-zenoh-build-checkpoint", ["--output=/tmp/never", "--state-dim=2"], ["unknown flag --state-dim=2"]),
    ("lerobot-zenoh-build-checkpoint", ["--state_dim=2"], ["missing required flag --output"]),
    ("lerobot-zenoh-router", ["--zenoh.multicast_scouting=maybe"], ["--zenoh.multicast_scouting", "'maybe'"]),
    ("lerobot-zenoh-router", ["--nope"], ["unknown flag --nope"]),
    ("lerobot-zenoh-router", ["--set", "no-equals"], ["--zenoh.json5_overrides", "KEY=VALUE"]),
    ("lerobot-zenoh-router", ["--log-level=LOUD"], ["--log_level", "LOUD"]),
    ("lerobot-zenoh-secure", ["init", "--out=/tmp/never"], ["--manifest"]),
    ("lerobot-zenoh-secure", ["init", "--manifest=manifests/demo.yaml", "--out=/tmp/never", "--valid_days=soon"],
     ["--valid_days", "'soon'"]),
]


def test_every_configuration_mistake_is_one_line_and_exit_2():
    for (script, args, needles), result in zip(MISTAKES, run_all([(s, a) for s, a, _ in MISTAKES])):
        assert_one_line_error(result, *needles)


ROUTING_MISTAKES = [
    ("lerobot-policy-server", ["--policy.path=x", "--endpoint=7447"], ["--endpoint", "'7447'"]),
    ("lerobot-policy-server", ["--policy.path=x", "--manifest=manifests/demo.yaml"], ["--policy.path", "not both"]),
    ("lerobot-policy-server", ["--policy.path=x", "--fps=0"], ["--fps", "1"]),
    ("lerobot-robot-client", [*CLIENT, "--model_id=a/b"], ["--model_id", "'/'"]),
    ("lerobot-robot-client", [*CLIENT, "--server_address=nowhere"], ["--server_address", "HOST:PORT"]),
    # several routers are several items: --zenoh.connect once per endpoint (or a list), --endpoint one
    ("lerobot-robot-client", [*CLIENT, "--endpoint=tcp/a:7447,tcp/b:7447"], ["--endpoint", "--zenoh.connect"]),
    ("lerobot-robot-client", [*CLIENT, "--zenoh.connect=tcp/a:7447", "--zenoh.connect=tcp/b:7447,tcp/c:7447"],
     ["--zenoh.connect", "not one endpoint"]),
    ("lerobot-zenoh-monitor", ["--endpoint=tcp/a:7447,tcp/b:7447"], ["--endpoint", "--zenoh.connect"]),
]


def test_routing_mistakes_are_one_line_and_exit_2():
    for (script, args, needles), result in zip(ROUTING_MISTAKES, run_all([(s, a) for s, a, _ in ROUTING_MISTAKES])):
        assert_one_line_error(result, *needles)


def test_a_dead_endpoint_is_one_line_and_exit_3(port):
    (result,) = run_all([("lerobot-robot-client", [*CLIENT, f"--endpoint=tcp/127.0.0.1:{port}"])])
    assert result.returncode == 3, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"cannot connect to tcp/127.0.0.1:{port}" in errors[0], result.stderr[-2000:]


def test_help_lists_every_option():
    cases = [("lerobot-robot-client", ["--help", "--robot.type=zenoh_sim"]), ("lerobot-policy-server", ["--help"]),
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
    for result in (monitor, router):  # draccus lists a group's config-file option twice; we once
        assert result.stdout.count("Config file for zenoh") == 1, result.stdout[:3000]
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


def test_a_task_over_the_models_token_limit_is_one_line_and_exit_3_on_the_servers_first_answer(port, app_key):
    """The real client against a server whose model reads at most 4 tokens of the task: the
    server's Refusal stops the client on its first answer, one line naming --task, exit 3, no action.

    A server up at start-up has the task counted by the early check, before LeRobot loads
    (tests/test_cli_fast.py); the Refusal path is what catches the task when that check cannot: the
    client is routed through a router (--zenoh.connect) with no server behind it yet, so its early
    check finds nothing and it goes on (not a failure: it waits for a server, as it promises); the
    server connects to the router only once the client has said so (its log line, not a clock),
    while LeRobot loads. A server that is still loading when the robot starts meets the task this way."""
    import re
    from datetime import datetime

    from lerobot_zenoh.client.options import routing_args
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings
    from lz_testing import free_port, make_server

    behind = f"tcp/127.0.0.1:{free_port()}"
    server = make_server(port, app_key, cameras={"front": (96, 128), "wrist": (96, 128)}, max_task_tokens=4)
    server.manifest = server.manifest.model_copy(update={"zenoh": server.manifest.zenoh.with_connect(behind)})
    with ZenohSession(ZenohSettings(mode="router", listen=[behind], multicast_scouting=False)).open():
        client = start("lerobot-robot-client", [*CLIENT, *routing_args(app_key, "r1"), f"--zenoh.connect={behind}",
                                                "--task=pick up the red cube and put it in the box",
                                                "--duration_s=30"])
        try:
            early = wait_line(client, "starting: no server answers at")
            with server:
                client.wait(timeout=120)
                lines = early + list(iter(client.lines.get, None))
                sent = server.models[0].refusals_sent["task_too_long"]
        finally:
            client.kill()
    output = "".join(lines)
    errors = [line for line in lines if " ERROR " in line]
    assert client.returncode == 3 and len(errors) == 1, output[-3000:]
    assert "stopped: --task: the task is 11 tokens, synthetic reads at most 4 (server gpu0 refuses every request " \
           "like it: task_too_long)" in errors[0]
    assert " 0 actions executed" in output and sent >= 1 and "Traceback" not in output
    assert any("starting: importing LeRobot" in line for line in lines[len(early):])  # the server came after the check
    stamp = re.compile(r"^(\d{4}-\d\d-\d\d [\d:]+,\d{3}) ")
    asked = next(line for line in lines if "starting: asking the server for its status" in line)
    seconds = (datetime.strptime(stamp.match(errors[0]).group(1), "%Y-%m-%d %H:%M:%S,%f")
               - datetime.strptime(stamp.match(asked).group(1), "%Y-%m-%d %H:%M:%S,%f")).total_seconds()
    print(f"from asking the server for its status to the refusal's line: {seconds:.2f} s")


def test_a_model_that_cannot_drive_this_robot_is_one_line_naming_the_flag_and_exit_3(port, app_key):
    """A model of 4 actions for a 6-joint robot: known once the robot is open (its features), one
    line naming --robot.type, exit 3, nothing sent."""
    from lerobot_zenoh.client.options import routing_args
    from lz_testing import make_server

    with make_server(port, app_key, cameras={"front": (96, 128), "wrist": (96, 128)}, action_dim=4):
        [result] = run_all([("lerobot-robot-client", [*CLIENT, *routing_args(app_key, "r1", f"tcp/127.0.0.1:{port}")])])
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert result.returncode == 3 and len(errors) == 1, result.stderr[-3000:]
    assert "not starting: server gpu0 is incompatible: --robot.type: action_dim: server produces 4, robot takes 6" \
        in errors[0]


# -- LeRobot users' habits: hub ids, one model without a manifest, finding the server -----------------

TINY_ACT = {"dim_model": 32, "n_heads": 2, "dim_feedforward": 64, "n_encoder_layers": 1, "n_vae_encoder_layers": 1}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A Hugging Face cache holding `someone/tiny_act` (main) as `hf download` leaves it: the
    checkpoint under snapshots/<commit>/, refs/main naming the commit."""
    from lerobot_zenoh.client.config_sim_robot import SO101_JOINTS
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--someone--tiny_act"
    names = tuple(f"{j}.pos" for j in SO101_JOINTS)
    build_checkpoint(repo / "snapshots" / COMMIT, policy_type="act", state_names=names, action_names=names,
                     cameras={"front": (96, 128), "wrist": (96, 128)}, chunk_size=20, fps=30, overrides=TINY_ACT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def start(script: str, args: list[str], env: dict | None = None, read: bool = True) -> subprocess.Popen:
    """The console script running; `read=False` discards its output (nobody reads the pipe)."""
    out = subprocess.PIPE if read else subprocess.DEVNULL
    return subprocess.Popen(command(script) + args, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def wait_line(proc: subprocess.Popen, needle: str, timeout_s: float = 120) -> list[str]:
    """The process's output lines up to the first holding `needle` (fails if it exits first)."""
    import queue
    import threading

    if not hasattr(proc, "lines"):  # one reader thread per process: a pipe is never read from two places
        proc.lines = queue.Queue()
        threading.Thread(target=lambda: [proc.lines.put(line) for line in proc.stdout] + [proc.lines.put(None)],
                         daemon=True).start()
    lines = []
    while True:
        try:
            line = proc.lines.get(timeout=timeout_s)
        except queue.Empty:
            line = None
        if line is None:
            raise AssertionError(f"no {needle!r} (exit {proc.poll()}):\n" + "".join(lines)[-3000:])
        lines.append(line)
        if needle in line:
            return lines


def timed(script: str, args: list[str], env: dict | None = None, timeout_s: float = 120):
    import time

    t0 = time.monotonic()
    result = subprocess.run(command(script) + args, capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    return result, time.monotonic() - t0


def stop(proc: subprocess.Popen) -> str:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # (a server exits within its stop grace, 20 s): say what it printed
        proc.kill()
        proc.wait()
        raise AssertionError("still running 30 s after SIGINT:\n" + "".join(iter(proc.lines.get, None))[-4000:]
                             if hasattr(proc, "lines") else "still running 30 s after SIGINT") from None
    lines = []
    while hasattr(proc, "lines") and (line := proc.lines.get(timeout=5)) is not None:
        lines.append(line)
    return "".join(lines)


def assert_fails_in_one_line(result: subprocess.CompletedProcess, *needles: str) -> None:
    """A start-up failure after the progress log lines (INFO): exit 2 and one line saying why."""
    import re

    info = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO |^Loading weights")
    assert_one_line_error(subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout,
        "".join(line for line in result.stderr.splitlines(True) if not info.match(line))), *needles)


def test_one_model_from_a_cached_hub_id_is_found_by_a_client_given_only_the_endpoint(hf_home, port):
    """`--policy.path=user/repo` offline, from the cache; the client needs only `--endpoint`; `--list`
    shows the app; a client asking for another model fails within seconds naming what is served; a
    second server on the busy port fails at once, in one line."""
    env = {"HF_HOME": str(hf_home)}
    server = start("lerobot-policy-server", ["--policy.path=someone/tiny_act", f"--endpoint=tcp/127.0.0.1:{port}"], env)
    try:
        wait_line(server, "ready")
        # The client and the busy-port server side by side (each a cold start that imports LeRobot).
        cases = [("lerobot-robot-client", ["--robot.type=zenoh_sim", f"--endpoint=127.0.0.1:{port}", "--duration_s=2"]),
                 ("lerobot-robot-client", ["--robot.type=zenoh_sim", f"--server_address=127.0.0.1:{port}",
                                           "--model_id=smolvla", "--discovery_timeout_s=60"]),
                 ("lerobot-policy-server", ["--policy.path=someone/tiny_act", f"--endpoint=tcp/127.0.0.1:{port}"])]
        listed, list_s = timed("lerobot-robot-client", ["--list", f"--endpoint=tcp/127.0.0.1:{port}"])
        runs = run_all(cases, env=env)
    finally:
        out = stop(server)
    assert server.returncode == 0, out[-2000:]
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].startswith("local/default/tiny_act/v1/default  server ")
    assert "--model_id=tiny_act" in listed.stdout and list_s < 10, (listed.stdout, list_s)
    ok, wrong, busy = runs
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "the endpoint serves local/default/tiny_act/v1/default" in ok.stderr
    assert " 0 requests unanswered" in ok.stderr and ", 0 chunks" not in ok.stderr, ok.stderr[-2000:]
    assert wrong.returncode == 3, wrong.stderr[-2000:]
    errors = [line for line in wrong.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "does not serve --model_id=smolvla; it serves: local/default/tiny_act/v1/default" \
        in errors[0], wrong.stderr[-2000:]
    assert_fails_in_one_line(busy, f"cannot listen on tcp/127.0.0.1:{port}: the address is in use")
    assert ".rs:" not in busy.stderr


def test_the_busy_port_is_found_before_any_model_loads(port):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result, elapsed = timed("lerobot-policy-server", ["--manifest=manifests/demo.yaml",
                                                          f"--endpoint=tcp/127.0.0.1:{port}"])
    assert_fails_in_one_line(result, f"cannot listen on tcp/127.0.0.1:{port}: the address is in use")
    assert "loading" not in result.stderr.replace("then loading", ""), result.stderr  # nothing was loaded


def test_a_hub_id_in_a_manifest_and_a_missing_one(hf_home, tmp_path, port):
    """A manifest's pretrained_path may be a hub id (from the cache offline); one that is not cached is
    one line naming the repo and the `hf download` that fetches it."""
    import yaml

    manifest = yaml.safe_load(Path("manifests/demo.yaml").read_text())
    entry = manifest["server"][0]
    entry.update(pretrained_path="someone/tiny_act@fedcba9", endpoint=f"tcp/127.0.0.1:{port}", actions_per_chunk=20)
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump(manifest))
    entry["pretrained_path"] = f"someone/tiny_act@{COMMIT}"  # a commit, served from the cache offline
    (tmp_path / "cached.yaml").write_text(yaml.safe_dump(manifest))
    env = {"HF_HOME": str(hf_home)}
    missing, _ = timed("lerobot-policy-server", [f"--manifest={tmp_path / 'missing.yaml'}"], env)
    nothing, _ = timed("lerobot-policy-server", ["--policy.path=nobody/nothing@v2", f"--endpoint=tcp/127.0.0.1:{port}"],
                       env)
    server = start("lerobot-policy-server", [f"--manifest={tmp_path / 'cached.yaml'}"], env)
    try:
        lines = wait_line(server, "ready")
    finally:
        stop(server)
    assert any("serving local/demo/act/v1/pick_cube" in line for line in lines), "".join(lines)
    assert_fails_in_one_line(missing, "server[act].pretrained_path: someone/tiny_act@fedcba9 is not a local folder and "
                                   "not in the Hugging Face cache", "HF_HUB_OFFLINE is set",
                          "`hf download someone/tiny_act --revision fedcba9`")
    assert_fails_in_one_line(nothing, "--policy.path: nobody/nothing@v2", "`hf download nobody/nothing --revision v2`")


STOPPING = """
import logging, signal, sys, threading, time
from lerobot_zenoh.cli.stopping import begin_stop

def stuck_in_close():
    threading.Event().wait()  # a close that never returns

asked = threading.Event()  # the handler is in place before "serving" is printed: no signal can come too early
signal.signal(signal.SIGINT, lambda *_: asked.set())
print("serving", flush=True)
asked.wait()
begin_stop(None, grace_s=float(sys.argv[1]), repeat_window_s=float(sys.argv[2]))
print("stopping", flush=True)
stuck_in_close()
"""


def stopping(grace_s: float, repeat_window_s: float = 1.0) -> subprocess.Popen:
    """STOPPING asked to stop (SIGINT) and now inside its close that never returns."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", STOPPING, str(grace_s), str(repeat_window_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_line(proc, "serving", timeout_s=30)
    proc.send_signal(signal.SIGINT)
    wait_line(proc, "stopping", timeout_s=30)
    return proc


def test_a_stop_that_hangs_prints_the_stacks_and_exits_after_its_grace():
    import time

    proc = stopping(1.5)
    t0 = time.monotonic()
    assert proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 10
    out = stop(proc)  # (exited: only what it printed)
    assert "stuck_in_close" in out, out  # the stack says where it hung


def test_a_second_ctrl_c_ends_a_stop_at_once():
    import signal

    proc = stopping(600, repeat_window_s=0)
    proc.send_signal(signal.SIGINT)  # (the main thread waits in a lock, which a signal interrupts)
    assert proc.wait(timeout=10) == 128 + signal.SIGINT
    assert "SIGINT again: exiting without finishing the stop" in stop(proc)


def test_the_same_stop_signal_delivered_twice_is_not_a_second_ctrl_c():
    """A terminal's Ctrl-C reaches the whole process group, and `make demo` forwards it as well:
    within the repeat window the stop goes on (here to its grace, exit 1), it is not cut short."""
    import signal

    proc = stopping(1.5, repeat_window_s=600)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 1
    assert "again" not in stop(proc)


def test_a_stop_signal_during_the_teardown_does_not_kill_a_stopped_process():
    """Once a stopped process exits, the interpreter puts back the signals' default action; a repeat
    then (a parent forwarding the terminal's Ctrl-C late) must not turn its exit 0 into a kill."""
    script = """
import atexit, os, signal, time
from lerobot_zenoh.cli.stopping import begin_stop

def late_repeat():  # registered first, so it runs after begin_stop's own exit hook
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print("torn down", flush=True)

atexit.register(late_repeat)
begin_stop(None, grace_s=60, repeat_window_s=0)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "torn down" in result.stdout, result.stdout + result.stderr


def test_hub_ids_and_folders_are_told_apart(tmp_path):
    from lerobot_zenoh.server.runners.hub import HubRef

    assert HubRef.parse("lerobot/smolvla_base") == HubRef("lerobot/smolvla_base")
    assert HubRef.parse("user/repo@v1.0") == HubRef("user/repo", "v1.0")
    for path in ("/abs/path", "./rel/x", "~/x", "../x/y", "one", "a/b/c", "x/../y"):
        assert HubRef.parse(path) is None, path


# -- make demo: its own server, no fixed deadline, the failed process named, Ctrl-C a clean stop ------

@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory) -> Path:
    from lerobot_zenoh.client.config_sim_robot import SO101_JOINTS
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    names = tuple(f"{j}.pos" for j in SO101_JOINTS)
    return build_checkpoint(tmp_path_factory.mktemp("demo") / "act", policy_type="act", state_names=names,
                            action_names=names, cameras={"front": (96, 128), "wrist": (96, 128)}, chunk_size=50,
                            fps=30, overrides=TINY_ACT)


def demo(args: list[str]) -> subprocess.Popen:
    # Its own process group, as a terminal runs it: Ctrl-C reaches the demo and every process it started.
    return subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_the_demo_refuses_a_busy_port_before_starting_anything(demo_checkpoint, tmp_path, port):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = demo([f"--checkpoint={demo_checkpoint}", f"--port={port}", "--robots=1", "--seconds=5",
                     f"--out={tmp_path}"])
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"port {port} on 127.0.0.1 is in use" in out and "choose another with --port=" in out
    assert "starting the policy server" not in out  # found before anything started
    assert "starting 1 simulated robots" not in out  # never drove robots against someone else's server


def test_ctrl_c_stops_the_demo_cleanly(demo_checkpoint, tmp_path, port):
    import signal

    proc = demo([f"--checkpoint={demo_checkpoint}", f"--port={port}", "--robots=1", "--seconds=120",
                 f"--out={tmp_path}"])
    try:
        lines = wait_line(proc, " ms, ")  # the robot runs (a live line with its round trip)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        proc.wait(timeout=60)
        out = "".join(lines) + stop(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert "demo stopped by Ctrl-C (server exit code 0)" in out, out[-3000:]  # its stop not cut short
    assert "FAILED" not in out and "Traceback" not in out, out[-3000:]
    assert (tmp_path / "robot_1.json").exists()  # the robot wrote its summary on the way out


def test_a_new_recordings_repo_id_is_stamped_only_when_no_stamp_is_false_and_never_on_resume():
    import re

    from lerobot_zenoh.cli.client import parse_config

    record = [*CLIENT, "--dataset.repo_id=local/t", "--dataset.single_task=pick"]
    assert parse_config(record).dataset.repo_id == "local/t"  # our default: --dataset.no_stamp=true
    stamped = parse_config([*record, "--dataset.no_stamp=false"]).dataset.repo_id
    assert re.fullmatch(r"local/t_\d{8}_\d{6}", stamped), stamped  # lerobot-record's tag
    assert parse_config([*record, "--dataset.no_stamp=false", "--resume=true"]).dataset.repo_id == "local/t"


# -- recording: unwritable roots in one line, hints that work when copied, no encoder chatter -------

def test_an_unwritable_dataset_root_is_one_line_and_exit_2_before_any_server_is_sought(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "file").write_text("")
    record = [*CLIENT, "--dataset.repo_id=local/t", "--dataset.single_task=pick", "--endpoint=tcp/127.0.0.1:9"]
    cases = [("lerobot-robot-client", [*record, "--dataset.root=/sys/lerobot_zenoh_test/ds"]),  # EPERM, even as root
             ("lerobot-robot-client", [*record, f"--dataset.root={tmp_path / 'file' / 'ds'}"]),
             ("lerobot-robot-client", [*record, f"--dataset.root={tmp_path / 'taken'}"]),
             ("lerobot-robot-client", [*record, f"--dataset.root={tmp_path / 'none'}", "--resume=true"])]
    env_case = subprocess.run(command("lerobot-robot-client") + record, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_LEROBOT_HOME": "/sys/lerobot_zenoh_test"})
    sys_root, under_file, taken, none = run_all(cases)
    assert_one_line_error(sys_root, "--dataset.root: cannot write under /sys", "choose another --dataset.root")
    assert_one_line_error(under_file, f"{tmp_path / 'file'} is not a folder")
    assert_one_line_error(taken, "already exists; add --resume=true to append")
    assert_one_line_error(none, "--resume: no dataset at", "drop --resume to create one")
    assert_one_line_error(env_case, "--dataset.root: cannot write under /sys", "$HF_LEROBOT_HOME")
    for result in (sys_root, taken, env_case):  # the robot was never opened, no server sought (port 9)
        assert "cannot connect" not in result.stderr


def test_recording_prints_no_encoder_chatter_and_the_resume_hint_works_as_written(tmp_path, port, app_key):
    from lz_testing import make_server

    root = tmp_path / "ds"
    record = ["--robot.type=zenoh_sim", "--robot.cameras={front: [48, 64], wrist: [48, 64]}",
              f"--endpoint=127.0.0.1:{port}", "--dataset.repo_id=local/t", f"--dataset.root={root}",
              "--dataset.single_task=pick", "--dataset.num_episodes=2", "--dataset.episode_time_s=1",
              "--dataset.reset_time_s=0.5"]
    with make_server(port, app_key):
        first, _ = timed("lerobot-robot-client", record)
        refused, _ = timed("lerobot-robot-client", record)
        hint = refused.stderr.strip().splitlines()[-1]
        again, _ = timed("lerobot-robot-client", [*record, "--dataset.num_episodes=1", *re_flags(hint, "--resume")])
    for result in (first, again):
        assert result.returncode == 0, result.stderr[-3000:]
        chatter = [line for line in result.stderr.splitlines() if " INFO " not in line and line.strip()]
        assert chatter == [], chatter[:10]  # no Svt[info], [mp4 @ ...], Map: progress bars
        assert "Using video codec" not in result.stderr
    assert "saved episode 1" in first.stderr and "saved episode 2" in again.stderr


def re_flags(line: str, flag: str) -> list[str]:
    """The flags `line` tells the user to add, as written (e.g. `--resume=true`)."""
    import re

    return re.findall(rf"{re.escape(flag)}\S*", line)


# -- install: the wheel carries what the README runs; --help starts with the client's own options ---

def test_the_wheel_ships_the_manifests_and_examples(tmp_path):
    import zipfile

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("lerobot_zenoh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = "lerobot_zenoh-0.1.0.data/data/share/lerobot-zenoh/"
    for shipped in ("manifests/demo.yaml", "manifests/synthetic.yaml", "examples/fleet_on_one_server.py",
                    "examples/record_and_open_dataset.py"):
        assert data + shipped in names, shipped
    assert "lerobot_zenoh/demo.py" in names and "lerobot_zenoh/server/runners/hub.py" in names


def test_the_demo_finds_its_manifest_installed_from_a_wheel(tmp_path, monkeypatch):
    from lerobot_zenoh import demo as demo_module

    monkeypatch.setattr(demo_module, "ROOT", tmp_path / "no_checkout")
    monkeypatch.setattr(demo_module, "SHARED", tmp_path / "share")
    (tmp_path / "share" / "manifests").mkdir(parents=True)
    (tmp_path / "share" / "manifests" / "demo.yaml").write_text("x: 1\n")
    assert demo_module.shipped("manifests/demo.yaml") == tmp_path / "share" / "manifests" / "demo.yaml"
    assert demo_module.DemoConfig().manifest == str(tmp_path / "share" / "manifests" / "demo.yaml")


def test_the_client_help_starts_with_its_own_options_and_shows_one_robot_on_request():
    short, so101, sim = run_all([("lerobot-robot-client", ["--help"]),
                                 ("lerobot-robot-client", ["--help", "--robot.type=so101_follower"]),
                                 ("lerobot-robot-client", ["--help", "--robot.type=zenoh_sim"])])
    assert short.returncode == 0 and so101.returncode == 0 and sim.returncode == 0
    # --robot.cameras says what it takes, in the user's words (not a developer's comment)
    assert "'{front: {type: opencv, index_or_path: 0" in " ".join(so101.stdout.split())
    assert "Camera name -> (height, width)" in sim.stdout and "__post_init__" not in sim.stdout
    assert sim.stdout.count("How overlapping actions") == 1
    lines = short.stdout.splitlines()
    assert len(lines) < 500, len(lines)  # draccus alone: 1,300 lines (every robot type expanded)
    first_option = next(line for line in lines if line.strip().startswith("--"))
    assert first_option.strip().startswith("--client_uuid"), first_option
    assert "--robot.type" in short.stdout and "--robot.port str" not in short.stdout
    assert "--help --robot.type=so101_follower" in short.stdout
    assert "--robot.port str" in so101.stdout and "--robot.left_arm_config" not in so101.stdout


# -- the Grafana dashboard queries only what /metrics of a running fleet exports ----------------------

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "grafana-lerobot-zenoh.json"


def dashboard_metrics() -> set[str]:
    import json
    import re

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return {m for e in exprs for m in re.findall(r"\blerobot_zenoh_\w+", e)}


def test_every_metric_the_grafana_dashboard_queries_is_on_the_monitors_metrics(port, app_key):
    import urllib.request

    from lz_testing import free_port, make_server, wait_for

    wanted = dashboard_metrics()
    assert len(wanted) >= 20, wanted
    http_port = free_port()
    exported: set[str] = set()

    def all_there() -> bool:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=2).read().decode()
        except OSError:
            return False
        exported.clear()
        exported.update(line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#")
        return wanted <= exported

    with make_server(port, app_key):
        robot = start("lerobot-robot-client", ["--robot.type=zenoh_sim", "--robot.cameras={front: [48, 64], wrist: [48, 64]}",
                                               f"--endpoint=127.0.0.1:{port}", "--duration_s=120",
                                               "--telemetry_period_s=0.5"], read=False)
        monitor = start("lerobot-zenoh-monitor", [f"--endpoint=tcp/127.0.0.1:{port}", f"--prometheus_port={http_port}",
                                                  "--json=true"], read=False)
        try:
            found = wait_for(all_there, timeout_s=150, poll_s=1.0)
        finally:
            for proc in (robot, monitor):
                proc.kill()
                proc.wait()
    assert found, f"queried by the dashboard but not exported: {sorted(wanted - exported)}"


def test_ctrl_c_while_the_models_load_stops_the_server_cleanly(demo_checkpoint, port):
    import signal
    import time

    server = start("lerobot-policy-server", [f"--policy.path={demo_checkpoint}", f"--endpoint=tcp/127.0.0.1:{port}"])
    try:
        lines = wait_line(server, "loading act/v1")
        t0 = time.monotonic()
        server.send_signal(signal.SIGINT)
        out = "".join(lines) + stop(server)
        elapsed = time.monotonic() - t0
    finally:
        server.kill()
    assert server.returncode == 0 and "Traceback" not in out, out[-2000:]
    assert "stopped while loading" in out or "server" in out and "ready" in out, out[-2000:]
    assert elapsed < 15, elapsed


def test_the_router_takes_its_older_spellings_and_repeated_list_flags():
    """lerobot-zenoh-router is parsed by draccus, as every console script; what it accepted before
    (repeatable list options, --listen/--connect/--set/--no-scouting/--log-level) still means the same."""
    from lerobot_zenoh.command_line import parse
    from lerobot_zenoh.cli.router import RouterConfig, spellings
    from lerobot_zenoh.transport.settings import ZenohSettings

    def settings(*args):
        config = parse(RouterConfig, list(args), "lerobot-zenoh-router", spellings())
        return config.settings(), config.log_level

    expected = ZenohSettings(mode="router", listen=["tcp/127.0.0.1:1", "tcp/127.0.0.1:2"],
                             connect=["tcp/10.0.0.1:7447"], multicast_scouting=False,
                             json5_overrides={"transport/link/tx/lease": "10000", "a/b": '["x", "y"]'})
    assert settings("--listen", "tcp/127.0.0.1:1", "--zenoh.listen=tcp/127.0.0.1:2", "--connect=tcp/10.0.0.1:7447",
                    "--no-scouting", "--set", "transport/link/tx/lease=10000", "--set", 'a/b=["x", "y"]',
                    "--log-level", "debug") == (expected, "DEBUG")
    assert settings("--zenoh.listen=[tcp/127.0.0.1:1, tcp/127.0.0.1:2]", "--zenoh.connect", "tcp/10.0.0.1:7447",
                    "--zenoh.multicast_scouting", "false",
                    '--zenoh.json5_overrides={"transport/link/tx/lease": "10000", "a/b": "[\\"x\\", \\"y\\"]"}') == (expected, "INFO")
    assert settings() == (ZenohSettings(mode="router"), "INFO")
