"""`lerobot-zenoh-admit` on a small planned factory (mix2's tasks, rosa profiles): an admitted robot
is written into the deployment and taken by its running servers; a refused one changes nothing."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from lerobot_zenoh.cli.admit import main as admit_main
from lerobot_zenoh.cli.plan import main as plan_main
from lerobot_zenoh.client.discovery import query_status
from lerobot_zenoh.pipelines.deployment import application_tag, client_command, load_deployment, server_endpoint
from lerobot_zenoh.pipelines.profiles import dump_profiles, rosa_profiles
from lerobot_zenoh.pipelines.robot_plan import load_robot_plan
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey, pipeline_app
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.config.manifest import load_manifest
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings
from lz_testing import free_port_range, wait_for

ROOT = Path(__file__).resolve().parent.parent
MIX2 = yaml.safe_load((ROOT / "factories" / "mix2.yaml").read_text())


def plan_deployment(tmp_path: Path, fleet: list[dict], count: int) -> Path:
    """mix2's tasks with this fleet planned on `count` servers, ports free for this test."""
    data = copy.deepcopy(MIX2)
    data["fleet"] = fleet
    data["servers"].update(count=count, port_base=free_port_range(count))
    factory, profiles = tmp_path / "factory.yaml", tmp_path / "profiles.yaml"
    factory.write_text(yaml.safe_dump(data))
    profiles.write_text(dump_profiles(rosa_profiles()))
    out = tmp_path / "deploy"
    assert plan_main([f"--factory={factory}", f"--profiles={profiles}", f"--output={out}"]) == 0
    return out


@pytest.fixture
def deployment(tmp_path) -> Path:
    """Two pick-and-place robots (System 1 + monitor) planned on three servers."""
    return plan_deployment(tmp_path, [{"task": "pick_and_place_simple", "robots": 2, "min_throughput_hz": 1,
                                       "robot_type": "zenoh_sim", "client_args": ["--robot.control_mode=position"]}], 3)


@contextlib.contextmanager
def running_servers(deployment: Path):
    """Every planned server runs (servers.sh's lines, each writing its pid file); stopped at exit, each
    exiting 0."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    script = (deployment / "servers.sh").read_text().splitlines()
    (router,) = [shlex.split(line.removesuffix(" &")) for line in script if line.startswith("lerobot-zenoh-router")]
    lines = [shlex.split(line.removesuffix(" &")) for line in script if line.startswith("lerobot-policy-server")]
    router_proc = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.router", *router[1:]], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    procs = [subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.server", *argv[1:]], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for argv in lines]
    try:
        for i in range(len(procs)):
            assert wait_for(lambda i=i: (deployment / "run" / f"srv{i}.pid").is_file() or procs[i].poll() is not None,
                            60)
            assert procs[i].poll() is None, procs[i].stderr.read()[-2000:]
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        router_proc.send_signal(signal.SIGTERM)
        router_proc.wait(20)
    assert all(proc.returncode == 0 for proc in procs)


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_robot_is_told_why_in_one_line_and_nothing_changes(deployment, capsys):
    before = files(deployment)
    capsys.readouterr()
    # No server hosts System 2 or safety in this placement: an assemble_kit robot cannot join it.
    assert admit_main([f"--deployment={deployment}", "--task=assemble_kit"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("lerobot-zenoh-admit: refused assemble_kit-r0: component ") and "\n" not in err
    assert "no server hosts" in err and "re-plan" in err and captured.out == ""
    # A task the factory does not have is the user's mistake (exit 2), not a refusal.
    assert admit_main([f"--deployment={deployment}", "--task=nosuch"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("lerobot-zenoh-admit: task: unknown task 'nosuch' "
                                    "(tasks: assemble_kit, pick_and_place_simple)") and captured.out == ""
    assert admit_main([f"--deployment={deployment}", "--task=pick_and_place_simple",
                       "--robot=pick_and_place_simple-r1"]) == 1
    assert "already in the fleet" in capsys.readouterr().err
    assert files(deployment) == before


def test_an_admitted_robot_is_written_into_the_deployment_and_taken_by_its_running_servers(deployment, capsys):
    """Every planned server runs (servers.sh's lines); admission rewrites the changed manifests,
    signals those servers, which then serve the robot (confirmed by their status), and prints the
    robot's client command, the one clients.sh has for its fleet mates."""
    with running_servers(deployment):
        _, _, plan_before = load_deployment(deployment)
        capsys.readouterr()
        assert admit_main([f"--deployment={deployment}", "--task=pick_and_place_simple"]) == 0
        out = capsys.readouterr().out.splitlines()
        robot = "pick_and_place_simple-r2"
        assert out[0].startswith(f"admitted {robot} (pick_and_place_simple at ")

        factory, _, plan = load_deployment(deployment)
        routes = plan.routing[robot]
        assert set(routes) == {"act", "progress"} and plan_before.routing.items() <= plan.routing.items()
        assert sorted(out[1:-1]) == sorted(f"srv{i}: reloaded" for i in set(routes.values()))
        for i in set(routes.values()):
            (entry,) = load_manifest(deployment / "manifests" / f"srv{i}.yaml").server
            assert robot in {c.client_uuid for c in entry.clients}
        doc = json.loads((deployment / "plan.json").read_text())
        assert doc["robots"][robot]["routes"]["act"]["server"] == routes["act"]
        # What the robot's pipeline client reads at start: its routes, from the updated plan.json.
        assert set(load_robot_plan(deployment / "plan.json", robot).routes) == {"act", "progress"}

        # The client command: printed, appended to admitted.sh, built like clients.sh's lines.
        command = client_command(factory, plan, robot, deployment / "plan.json")
        assert out[-1] == command and command.startswith("lerobot-robot-client ")
        assert "--robot.control_mode=position" in command and f"--client_uuid={robot}" in command
        assert (deployment / "admitted.sh").read_text().splitlines()[-2:] == [command + " &", "wait"]
        mate = client_command(factory, plan, "pick_and_place_simple-r0", deployment / "plan.json")
        assert mate + " &" in (deployment / "clients.sh").read_text().splitlines()

        # A second one is appended after the first.
        assert admit_main([f"--deployment={deployment}", "--task=pick_and_place_simple", "--robot=late"]) == 0
        script = (deployment / "admitted.sh").read_text().splitlines()
        assert [line.split("--client_uuid=")[1].split()[0] for line in script if "--client_uuid=" in line] == [robot, "late"]


def _served_over_the_task_stream(factory, plan, index: int, task: str, robot: str, bit: int,
                                 timeout_s: float = 10.0) -> bool:
    """The wire side of `robot` of `task`: its token and an observation (asking component `bit`) on the
    task's stream, resent while unanswered; whether server `index` answers with a chunk on its own app."""
    served = factory.models[plan.servers[index].model]
    app = AppKey(factory.cluster_uuid, factory.experiment_tag, served.model_id, served.model_version,
                 application_tag(plan.servers[index]))
    stream = pipeline_app(factory.cluster_uuid, factory.experiment_tag, task).client(robot)
    settings = ZenohSettings(mode="client", connect=[server_endpoint(factory, index)], multicast_scouting=False)
    answered = threading.Event()
    with ZenohSession(settings) as session:
        status = query_status(session, app, timeout_s=2.0)
        assert status is not None and status.output == "actions"
        session.subscribe(app.client(robot).action, lambda key, payload: answered.set())
        session.declare_token(stream.metrics)
        pub = session.publisher(stream.obs, OBSERVATION_QOS)
        rng = np.random.default_rng(0)
        images = {name: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8), 90)
                  for name, hw in status.expected_cameras.items()}
        obs = Observation(1, robot, np.zeros(status.state_dim, np.float32), images, "assemble the kit",
                          episode_id="e0", session_nonce=1, component_mask=1 << bit)
        payload, header = codec.encode(obs), codec.encode_observation_header(obs)
        deadline = threading.Event()
        timer = threading.Timer(timeout_s, deadline.set)
        timer.start()
        try:
            while not deadline.is_set():
                pub.put(payload, header)
                if answered.wait(0.3):
                    return True
        finally:
            timer.cancel()
    return False


def test_a_robot_of_another_task_is_admitted_onto_a_server_that_served_only_one_task(tmp_path, capsys):
    """Placement-preserving admission (Rosa 3.4.4) puts assemble_kit's System 1 on srv2, a gr00t server
    that so far served pick_and_place_simple robots only: its manifest gains an assemble_kit pipeline
    item, its running server reloads it (subscribes to the task's stream), every changed server
    confirms, and srv2 answers the new robot's observations published on assemble_kit's stream."""
    deployment = plan_deployment(tmp_path, [{"task": "pick_and_place_simple", "robots": 1, "min_throughput_hz": 1},
                                            {"task": "assemble_kit", "robots": 3, "min_throughput_hz": 1}], 5)
    factory, _, before = load_deployment(deployment)
    assert [sh.stream.task for sh in before.servers[2].shares] == ["pick_and_place_simple"]
    with running_servers(deployment):
        capsys.readouterr()
        assert admit_main([f"--deployment={deployment}", "--task=assemble_kit"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out.splitlines()
        robot = "assemble_kit-r3"
        _, _, plan = load_deployment(deployment)
        assert plan.routing[robot]["act"] == 2
        changed = [line for line in out if line.startswith("srv")]
        assert {f"srv{i}: reloaded" for i in plan.routing[robot].values()} <= set(changed)
        assert all(line.endswith(": reloaded") for line in changed), out
        (entry,) = load_manifest(deployment / "manifests" / "srv2.yaml").server
        items = {item.task: item for item in entry.pipeline}
        assert set(items) == {"pick_and_place_simple", "assemble_kit"} and items["assemble_kit"].component == "act"
        assert _served_over_the_task_stream(factory, plan, 2, "assemble_kit", robot, items["assemble_kit"].bit)


def test_a_deployment_written_before_admission_existed_is_a_one_line_config_error(deployment, capsys):
    (deployment / "plan_state.json").unlink()
    capsys.readouterr()
    assert admit_main([f"--deployment={deployment}", "--task=pick_and_place_simple"]) == 2
    err = capsys.readouterr().err.strip()
    assert "plan_state.json is missing" in err and "lerobot-zenoh-plan" in err and "\n" not in err


def test_a_pid_file_of_another_process_or_of_a_gone_one_is_not_signalled(deployment, capsys):
    """A stale pid file (its id reused by another process, or by none) never gets a process SIGHUP."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (deployment / "run").mkdir()
        for i in range(3):
            (deployment / "run" / f"srv{i}.pid").write_text(f"{other.pid}\n")
        capsys.readouterr()
        assert admit_main([f"--deployment={deployment}", "--task=pick_and_place_simple"]) == 0
        states = [line for line in capsys.readouterr().out.splitlines() if line.startswith("srv")]
        assert states and all("is not its server: not signalled" in s for s in states)
        assert other.poll() is None  # still sleeping: never signalled
    finally:
        other.kill()
        other.wait(10)
    for i in range(3):
        (deployment / "run" / f"srv{i}.pid").write_text(f"{other.pid}\n")
    assert admit_main([f"--deployment={deployment}", "--task=pick_and_place_simple"]) == 0
    states = [line for line in capsys.readouterr().out.splitlines() if line.startswith("srv")]
    assert states and all("is gone" in s for s in states)
