"""benchmarks/studies/pipelines_run.py: the baselines it runs are deployments the project's own code writes and
reads back, its SLO-qualified count is what its docstring says, and (slow) one tiny fleet runs end to
end over real Zenoh (server processes from the manifests, the real pipeline clients)."""

from __future__ import annotations

import pytest
import yaml

from benchmarks.studies.pipelines_run import (
    dedicated_plan,
    factory_doc,
    scaled_profiles,
    shared_plan,
    tally,
)
from lerobot_zenoh.pipelines.deployment import write_deployment
from lerobot_zenoh.pipelines.descriptor import parse_factory
from lerobot_zenoh.pipelines.planner import evaluate_server
from lerobot_zenoh.pipelines.robot_plan import load_robot_plan
from lerobot_zenoh.server.config.manifest import load_manifest

SCALE = 2.0


def _factory(workload: str, robots: int, servers: int = 8):
    return parse_factory(factory_doc(workload, robots, servers, SCALE, fps=10, port_base=7600, tag="t",
                                     camera=(24, 32)))


def test_scaled_profiles_multiply_every_time():
    base, scaled = scaled_profiles(1.0).get("gr00t-n1.6-3b"), scaled_profiles(SCALE).get("gr00t-n1.6-3b")
    assert scaled.latency_ms(1, 2.0, "p99") == pytest.approx(SCALE * base.latency_ms(1, 2.0 * SCALE, "p99"))


def test_shared_baseline_splits_servers_by_kind_and_deals_robots_evenly(tmp_path):
    f = _factory("Mix2", 16)
    plan = shared_plan(f, scaled_profiles(SCALE))
    kinds = [sorted({sh.stream.kind for sh in s.shares}) for s in plan.servers]
    assert [k for (k,) in kinds].count("system1") == 2 and [k for (k,) in kinds].count("safety") == 2
    s1_loads = [sum(sh.robots for sh in s.shares) for s in plan.servers if s.shares[0].stream.kind == "system1"]
    assert s1_loads == [8, 8]  # 16 robots dealt in turn over 2 servers
    assert all(s.batch_size == 1 for s in plan.servers if s.shares[0].stream.kind == "system1")
    out = write_deployment(f, plan, tmp_path / "shared")
    for s in plan.servers:  # the server reads what the deployment code wrote
        (entry,) = load_manifest(out / "manifests" / f"srv{s.index}.yaml").server
        assert entry.max_batch_size == s.batch_size and len(entry.clients) == sum(sh.robots for sh in s.shares)
    robot = load_robot_plan(out / "plan.json", "P4-r0")
    assert set(robot.routes) == {"s1", "s2", "safe", "mon"}
    assert robot.system1.rate_hz == pytest.approx(1000 / (200 * SCALE))  # no cap below 1 / t_act


def test_dedicated_baseline_gives_each_component_of_a_robot_its_own_server(tmp_path):
    f = _factory("P4", 16)
    plan = dedicated_plan(f, scaled_profiles(SCALE))
    assert len(plan.routing) == 2 and len(plan.servers) == 8  # 8 servers / 4 components
    assert all(len(s.shares) == 1 and s.shares[0].robots == 1 for s in plan.servers)
    assert all(evaluate_server(scaled_profiles(SCALE).get(s.model), s.shares) for s in plan.servers)
    out = write_deployment(f, plan, tmp_path / "ded")
    assert yaml.safe_load((out / "manifests" / "srv0.yaml").read_text())["server"][0]["clients"] == [{"client_uuid": "P4-r0"}]


def test_qualified_counts_system1_chunks_in_time_of_robots_whose_other_components_met_their_slo():
    f = _factory("P4", 8)
    ok = {f"slo.{c}.{k}": 0 for c in ("s1", "s2", "safe", "mon") for k in ("requests", "met", "missed")}
    r0 = {**ok, "slo.s1.requests": 12, "slo.s1.met": 10, "slo.s1.missed": 2, "slo.safe.met": 9}
    r1 = {**ok, "slo.s1.requests": 10, "slo.s1.met": 10, "slo.safe.met": 8, "slo.safe.missed": 1}  # safety p99 broken
    robots = {rid: {"task": "P4", "delta": d, "latency_ms_p99": {}, "overruns": 0} for rid, d in (("a", r0), ("b", r1))}
    got = tally(f, robots, seconds=10.0)
    assert got["qualified_hz"] == 1.0 and got["s1_met_hz"] == 2.0 and got["robots_qualified"] == 1
    assert got["misses"] == {"P4.s1": 2, "P4.safe": 1}


@pytest.mark.slow  # server and robot processes (LeRobot import): ~20 s on the shared 2-core machine
def test_a_tiny_planned_fleet_runs_on_real_zenoh(tmp_path):
    from benchmarks.studies.pipelines_run import run_one

    row = run_one("P2", 2, "planned", servers=2, scale=SCALE, fps=10, warmup_s=1.0, seconds=3.0, robot_procs=1,
                  workdir=tmp_path, start_delay_s=6.0)
    assert row["robots_run"] == 2 and row["servers_used"] == 2
    assert row["s1_requests_hz"] > 0 and row["qualified_hz"] > 0
