"""The fleet planner on synthetic profiles: pure and fast (docs/pipelines.md).

Every plan is re-checked here against the profiles (each server meets every SLO it carries, every
robot is routed for every component, the budget holds, the closed-loop bound holds), and its files
are parsed by the same code that starts servers and clients.
"""

import copy
import json
from pathlib import Path

import pytest
import yaml

from lerobot_zenoh.pipelines.deployment import client_args, server_manifest, write_deployment
from lerobot_zenoh.pipelines.descriptor import parse_factory
from lerobot_zenoh.pipelines.planner import Infeasible, evaluate_server, plan
from lerobot_zenoh.pipelines.profiles import rosa_profiles
from lerobot_zenoh.server.config.manifest import load_manifest

ROOT = Path(__file__).resolve().parent.parent
MIX2 = yaml.safe_load((ROOT / "factories" / "mix2.yaml").read_text())
PROFILES = rosa_profiles()


def factory(fleet: list[dict], servers: int, tasks=None) -> dict:
    data = copy.deepcopy(MIX2)
    data["servers"]["count"] = servers
    data["fleet"] = fleet
    if tasks:
        data["tasks"].update(tasks)
    return data


def p1() -> dict:
    """Rosa's P1: System 1 only."""
    act = copy.deepcopy(MIX2["tasks"]["assemble_kit"]["components"]["act"])
    return {"action_period_ms": 200, "components": {"act": {**act, "inputs": []}}}


def check_plan(data: dict, result) -> None:
    f = parse_factory(data)
    assert len(result.servers) <= f.servers.count
    for s in result.servers:
        found = evaluate_server(PROFILES.get(s.model), s.shares)
        assert found is not None, f"server {s.index} breaks an SLO"
        assert {sh.stream.model for sh in s.shares} == {s.model}
    for cls_ in f.fleet:
        task = f.tasks[cls_.task]
        assert result.rates_hz[cls_.task] * cls_.robots >= cls_.min_throughput_hz - 1e-9
        assert result.rates_hz[cls_.task] <= 1000 / task.action_period_ms
    for rid, routes in result.routing.items():
        assert set(routes) == set(f.tasks[result.robot_task[rid]].components)
    assert len(result.routing) == sum(c.robots for c in f.fleet)


def test_one_class_binary_search_uses_batching_and_obeys_the_closed_loop():
    data = factory([{"task": "p1", "robots": 32}], servers=4, tasks={"p1": p1()})
    result = plan(parse_factory(data), PROFILES)
    check_plan(data, result)
    f = result.rates_hz["p1"]
    l1 = max(s.mean_ms for s in result.servers)
    assert f <= 1000 / (200 + l1) * (1 + 1e-9)
    assert f > 0.9 * 1000 / (200 + l1)  # the search reaches the bound within its tolerance
    assert max(s.batch_size for s in result.servers) > 1  # 8 robots per server need batching


def test_more_servers_never_plan_less_throughput():
    tp = []
    for n in (1, 2, 4, 8):
        data = factory([{"task": "p1", "robots": 32}], servers=n, tasks={"p1": p1()})
        tp.append(plan(parse_factory(data), PROFILES).throughput_hz)
    assert tp == sorted(tp) and tp[-1] > tp[0]


def test_obligations_get_the_fewest_servers():
    # The synthetic safety model meets 500 ms p99 up to ~64 requests/s on one server.
    def safety_servers(robots: int) -> int:
        data = factory([{"task": "assemble_kit", "robots": robots}], servers=12)
        result = plan(parse_factory(data), PROFILES)
        check_plan(data, result)
        return sum(1 for s in result.servers if s.model == "qwen2.5-vl-3b")
    assert safety_servers(16) == 1
    assert safety_servers(48) == 2


def test_mix2_plan_meets_every_constraint_and_weights_the_heavier_class():
    result = plan(parse_factory(MIX2), PROFILES)
    check_plan(MIX2, result)
    assert {s.role for s in result.servers} == {"obligation", "goal"}
    assert result.objective == pytest.approx(sum(
        c["weight"] * c["robots"] * result.rates_hz[c["task"]] for c in MIX2["fleet"]))


def test_compaction_merges_classes_onto_a_shared_server():
    # Two classes of one robot each, one server: isolated packing needs two System 1 servers.
    tasks = {"a": p1(), "b": {**p1(), "action_period_ms": 400}}
    data = factory([{"task": "a", "robots": 1}, {"task": "b", "robots": 1}], servers=1, tasks=tasks)
    result = plan(parse_factory(data), PROFILES)
    check_plan(data, result)
    assert len(result.servers) == 1 and len(result.servers[0].shares) == 2


@pytest.mark.parametrize("fleet, servers, words", [
    ([{"task": "assemble_kit", "robots": 200}], 3, "server count: the obligation models alone need"),
    ([{"task": "assemble_kit", "robots": 16}], 3, "goal models .* need at least one server each"),
    ([{"task": "assemble_kit", "robots": 16, "min_throughput_hz": 100}], 8, "min_throughput_hz: task 'assemble_kit'"),
    ([{"task": "assemble_kit", "robots": 64, "min_throughput_hz": 300}], 6,
     r"goal streams need \d+ servers after compaction .*at the minimum throughputs assemble_kit: 300"),
])
def test_an_infeasible_fleet_names_the_binding_constraint(fleet, servers, words):
    with pytest.raises(Infeasible, match=words) as info:
        plan(parse_factory(factory(fleet, servers)), PROFILES)
    assert "\n" not in str(info.value)


def test_a_closed_loop_bound_binds_and_is_named():
    # 4 robots asking 4.5 chunks/s each: above 1/(t_act + l_S1) whatever the placement.
    data = factory([{"task": "p1", "robots": 4, "min_throughput_hz": 18}], servers=4, tasks={"p1": p1()})
    with pytest.raises(Infeasible, match=r"closed loop: task 'p1'"):
        plan(parse_factory(data), PROFILES)


def test_profiles_of_other_hardware_and_a_model_too_big_for_a_server_are_refused():
    from lerobot_zenoh.errors import ConfigError

    data = factory([{"task": "assemble_kit", "robots": 8}], 8)
    data["servers"]["hardware"] = "L4"
    with pytest.raises(ConfigError, match=r"servers.hardware.*'L4'.*'synthetic-H200'"):
        plan(parse_factory(data), PROFILES)
    data = factory([{"task": "assemble_kit", "robots": 8}], 8)
    data["servers"]["memory_gb"] = 16
    big = PROFILES.model_copy(deep=True)
    big.models["qwen2.5-vl-7b"] = big.models["qwen2.5-vl-7b"].model_copy(update={"memory_gb": 20})
    with pytest.raises(ConfigError, match=r"component 'progress': model 'qwen2.5-vl-7b' needs 20 GB, a server has 16 GB"):
        plan(parse_factory(data), big)
    data["servers"]["memory_gb"] = 24
    assert plan(parse_factory(data), big).throughput_hz > 0


def test_written_deployment_starts_as_is(tmp_path):
    f = parse_factory(MIX2)
    result = plan(f, PROFILES)
    out = write_deployment(f, result, tmp_path / "deploy")
    doc = json.loads((out / "plan.json").read_text())
    assert set(doc["robots"]) == set(result.routing)
    routed = {}
    for s in result.servers:
        manifest = load_manifest(out / "manifests" / f"srv{s.index}.yaml")  # what lerobot-policy-server reads
        (entry,) = manifest.server
        assert entry.max_batch_size == s.batch_size and not entry.accept_unknown_clients
        # Servers listen nowhere: each connects to the deployment's router, as every robot does.
        zs = manifest.zenoh_settings()
        assert zs.listen == [] and zs.connect == ["tcp/127.0.0.1:7500"] and zs.effective_mode == "client"
        for c in entry.clients:
            routed.setdefault(c.client_uuid, set()).add(s.index)
        # Every component's server takes its robots' observations from their task's stream, at the
        # component's bit, and answers what its kind needs.
        assert {(p.task, p.component) for p in entry.pipeline} == {(sh.stream.task, sh.stream.component)
                                                                   for sh in s.shares}
        for p in entry.pipeline:
            assert p.bit == list(f.tasks[p.task].components).index(p.component)
            kind = f.tasks[p.task].components[p.component].kind
            assert entry.synthetic.output == {"system1": "actions", "system2": "text"}.get(kind, "verdict")
            assert p.labels == {"safety": ["safe", "unsafe"], "monitor": ["ongoing", "done", "failed"]}.get(kind, [])
    assert all(set(routes.values()) == routed[rid] for rid, routes in result.routing.items())
    assert len((out / "clients.sh").read_text().splitlines()) == 2 + 32 + 1
    router_line = (out / "servers.sh").read_text().splitlines()[2]
    assert router_line == "lerobot-zenoh-router --zenoh.listen=tcp/127.0.0.1:7500 --zenoh.multicast_scouting=false &"
    # The client arguments name the robot's System 1 server and its app key.
    rid = "assemble_kit-r0"
    args = dict(a.split("=", 1) for a in client_args(f, result, rid))
    s1 = result.servers[result.routing[rid]["act"]]
    manifest = server_manifest(f, result, s1)
    assert args["--application_tag"] == manifest["server"][0]["application_tag"]
    assert args["--endpoint"] == manifest["zenoh"]["connect"][0]
    assert args["--actions_per_chunk"] == "6"  # 200 ms at 30 fps


def test_client_arguments_parse_with_the_robot_client(tmp_path):
    from lerobot_zenoh.cli.client import parse_config

    f = parse_factory(MIX2)
    result = plan(f, PROFILES)
    config = parse_config(client_args(f, result, "pick_and_place_simple-r3"))
    assert config.client_uuid == "pick_and_place_simple-r3" and config.actions_per_chunk == 6
    assert config.task == "pick package and place in bin"


def test_plan_json_gives_each_robot_its_pipeline_and_the_client_reads_it(tmp_path, capsys):
    from lerobot_zenoh.cli.client import main as client_main
    from lerobot_zenoh.cli.client import parse_config
    from lerobot_zenoh.client.pipeline import configure
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.pipelines.robot_plan import load_robot_plan

    f = parse_factory(MIX2)
    result = plan(f, PROFILES)
    out = write_deployment(f, result, tmp_path / "deploy")
    rid = "assemble_kit-r0"
    rp = load_robot_plan(out / "plan.json", rid)
    assert rp.task == f.tasks["assemble_kit"]            # the descriptor survives the round trip
    assert set(rp.routes) == {"act", "plan", "safety", "progress"}
    for comp, route in rp.routes.items():
        manifest = server_manifest(f, result, result.servers[result.routing[rid][comp]])
        entry = manifest["server"][0]
        assert (route.app.model, route.app.app) == (entry["model_id"], entry["application_tag"])
        assert route.endpoint == manifest["zenoh"]["connect"][0] and route.kind == f.tasks["assemble_kit"].components[comp].kind
    assert rp.stream.prefix == "factory/mix2/_pipeline/1/assemble_kit"
    assert rp.rates_hz["safety"] == 2.0 and rp.system1.rate_hz == pytest.approx(result.rates_hz["assemble_kit"], rel=1e-3)
    # the generated line parses, and the plan sets routing, fps, chunk length and the System 1 rate cap
    line = next(ln for ln in (out / "clients.sh").read_text().splitlines() if f"--client_uuid={rid} " in ln)
    import shlex

    config = configure(parse_config(shlex.split(line.removesuffix(" &"))[1:]), rp)
    assert config.application_tag == rp.system1.app.app and config.endpoint == rp.system1.endpoint
    assert config.actions_per_chunk == 6 and config.send.max_in_flight == 1
    assert config.send.max_rate_hz == pytest.approx(rp.system1.rate_hz)
    with pytest.raises(ConfigError, match="client_uuid: 'nobody' is not a robot of this plan"):
        load_robot_plan(out / "plan.json", "nobody")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        client_main([f"--pipeline.plan={out / 'plan.json'}", "--client_uuid=nobody", "--robot.type=zenoh_sim"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "is not a robot of this plan" in err


def test_cli_writes_a_deployment_and_refuses_an_infeasible_fleet(tmp_path, capsys):
    from lerobot_zenoh.cli.plan import main

    profiles = ROOT / "factories" / "rosa_profiles.yaml"
    assert main([f"--factory={ROOT / 'factories' / 'mix2.yaml'}", f"--profiles={profiles}",
                 f"--output={tmp_path / 'd'}"]) == 0
    assert (tmp_path / "d" / "manifests" / "srv0.yaml").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(factory([{"task": "assemble_kit", "robots": 200}], 3)))
    capsys.readouterr()
    assert main([f"--factory={bad}", f"--profiles={profiles}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lerobot-zenoh-plan: infeasible: server count") and "\n" not in err


@pytest.mark.slow  # starts the robot client in a process of its own (it imports LeRobot)
def test_a_generated_server_and_client_run_as_written(tmp_path):
    """The manifests and the client line of one robot, used as written: the pipeline client finds
    every component's server through the planned routes and runs its task (exit 0)."""
    import os
    import shlex
    import subprocess
    import sys

    from lz_testing import free_port_range

    from lerobot_zenoh.server.shell.policy_server import PolicyServer

    data = copy.deepcopy(MIX2)
    data["servers"]["port_base"] = free_port_range(data["servers"]["count"])
    f = parse_factory(data)
    result = plan(f, PROFILES)
    out = write_deployment(f, result, tmp_path / "deploy")
    line = (out / "clients.sh").read_text().splitlines()[2]
    argv = shlex.split(line.removesuffix(" &"))
    assert argv[0] == "lerobot-robot-client"
    robot = next(a.split("=", 1)[1] for a in argv if a.startswith("--client_uuid="))
    assert argv[1] == f"--pipeline.plan={out / 'plan.json'}"
    from lerobot_zenoh.pipelines.deployment import router_endpoint
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings

    # servers.sh's first line, in this process: the router every server and robot connects to
    router = ZenohSession(ZenohSettings(mode="router", listen=[router_endpoint(f)], multicast_scouting=False)).open()
    servers = [PolicyServer(load_manifest(out / "manifests" / f"srv{i}.yaml")).start()
               for i in sorted(set(result.routing[robot].values()))]
    summary = tmp_path / "summary.json"
    try:
        proc = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.client", *argv[1:], "--duration_s=2",
                               f"--summary_path={summary}"],
                              capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    finally:
        for server in servers:
            server.stop()
        router.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    done = json.loads(summary.read_text())
    assert done["chunks_received"] > 0 and done["pipeline"]["task"] == result.robot_task[robot]


def test_a_vlm_model_is_written_with_the_output_its_components_need(tmp_path):
    data = copy.deepcopy(MIX2)
    data["models"]["qwen2.5-vl-7b"] = {"model_id": "qwen7b", "pretrained_path": "checkpoints/demo_smolvlm",
                                       "vlm": {"max_new_tokens": 8, "cameras": {"front": [96, 128]}}}
    f = parse_factory(data)
    result = plan(f, PROFILES)
    out = write_deployment(f, result, tmp_path / "deploy")
    outputs = set()
    for s in result.servers:
        (entry,) = load_manifest(out / "manifests" / f"srv{s.index}.yaml").server
        if s.model == "qwen2.5-vl-7b":
            outputs.add(entry.vlm.output)
            assert entry.vlm.max_new_tokens == 8 and entry.pipeline
    assert outputs == {"text", "verdict"}  # System 2 (plan) and the monitors (progress) on servers of their own
