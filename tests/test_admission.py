"""Placement-preserving admission control on synthetic profiles (pure)."""

import copy
from pathlib import Path

import pytest
import yaml

from lerobot_zenoh.pipelines.fleet_admission import admit
from lerobot_zenoh.pipelines.descriptor import parse_factory
from lerobot_zenoh.pipelines.planner import evaluate_server, plan
from lerobot_zenoh.pipelines.profiles import rosa_profiles

ROOT = Path(__file__).resolve().parent.parent
MIX2 = yaml.safe_load((ROOT / "factories" / "mix2.yaml").read_text())
PROFILES = rosa_profiles()


def planned(fleet, servers=8):
    data = copy.deepcopy(MIX2)
    data["fleet"], data["servers"]["count"] = fleet, servers
    f = parse_factory(data)
    return f, plan(f, PROFILES)


def test_a_robot_that_fits_is_admitted_without_moving_any_model():
    f, p = planned([{"task": "pick_and_place_simple", "robots": 8}, {"task": "assemble_kit", "robots": 8}])
    before = [(s.index, s.model, s.role) for s in p.servers]
    a = admit(f, PROFILES, p, "assemble_kit")
    assert a.admitted, a.reason
    assert a.robot == "assemble_kit-r8" and set(a.routes) == {"act", "plan", "safety", "progress"}
    assert [(s.index, s.model, s.role) for s in a.plan.servers] == before  # placement preserved
    for s in a.plan.servers:
        assert evaluate_server(PROFILES.get(s.model), s.shares) is not None
    for i in a.routes.values():  # each route's server lists the robot (its manifest's clients)
        assert any(a.robot in sh.robot_ids for sh in a.plan.servers[i].shares)
    assert a.plan.routing[a.robot] == a.routes and "assemble_kit-r8" not in p.routing  # the input is untouched
    assert a.plan.throughput_hz > p.throughput_hz


def test_robots_are_admitted_until_a_server_is_full_then_refused_with_the_reason():
    # One safety server meets 500 ms p99 up to ~64 requests/s: 32 robots at 2 Hz.
    f, p = planned([{"task": "assemble_kit", "robots": 30}], servers=12)
    admitted = 0
    while True:
        a = admit(f, PROFILES, p, "assemble_kit")
        if not a.admitted:
            break
        p, admitted = a.plan, admitted + 1
        assert admitted < 100
    assert admitted >= 1
    assert "component 'safety'" in a.reason and "breaks an SLO" in a.reason
    assert a.plan is None and a.routes == {}


def test_a_model_not_placed_is_refused():
    f, p = planned([{"task": "pick_and_place_simple", "robots": 4}], servers=4)
    a = admit(f, PROFILES, p, "assemble_kit")  # no System 2 / safety servers in this placement
    assert not a.admitted and "no server hosts" in a.reason and "re-plan" in a.reason


def test_a_new_class_gets_the_highest_rate_that_fits():
    f, p = planned([{"task": "pick_and_place_simple", "robots": 4}, {"task": "assemble_kit", "robots": 4}])
    p2 = copy.copy(p)
    p2.rates_hz = {"assemble_kit": p.rates_hz["assemble_kit"]}
    p2.robot_task = {k: v for k, v in p.robot_task.items() if v == "assemble_kit"}
    p2.routing = {k: v for k, v in p.routing.items() if k in p2.robot_task}
    a = admit(f, PROFILES, p2, "pick_and_place_simple", robot="newcomer")
    assert a.admitted and 0 < a.rate_hz <= 1000 / 200


def test_unknown_task_and_duplicate_robot_are_refused():
    f, p = planned([{"task": "pick_and_place_simple", "robots": 2}], servers=3)
    assert "unknown task 'paint'" in admit(f, PROFILES, p, "paint").reason
    assert "already in the fleet" in admit(f, PROFILES, p, "pick_and_place_simple", robot="pick_and_place_simple-r0").reason


def test_only_a_rate_change_that_shows_is_reported_and_every_lowering_is_kept_in_the_plan():
    """Mix2 (16 + 16 robots): an assemble_kit robot slows its System 1 server by a hair, 2.8232 ->
    2.8228 Hz. The plan takes the exact bound; the reason does not claim '2.823 -> 2.823 Hz'."""
    f, p = planned(MIX2["fleet"])
    a = admit(f, PROFILES, p, "assemble_kit")
    assert a.admitted, a.reason
    assert a.plan.rates_hz["assemble_kit"] < p.rates_hz["assemble_kit"]  # lowered, exactly
    assert f"{a.plan.rates_hz['assemble_kit']:.3f}" == f"{p.rates_hz['assemble_kit']:.3f}"
    assert "rates lowered" not in a.reason
    # A lowering that shows is reported, old and new rate differing.
    f, p = planned([{"task": "pick_and_place_simple", "robots": 1}, {"task": "assemble_kit", "robots": 3}], servers=5)
    a = admit(f, PROFILES, p, "assemble_kit")
    assert a.admitted and "; rates lowered to the closed-loop bound: pick_and_place_simple " in a.reason
    old, new = a.reason.rsplit("pick_and_place_simple ", 1)[1].removesuffix(" Hz").split(" -> ")
    assert float(new) < float(old)


def test_after_a_rate_lowering_every_server_carries_what_its_robots_send():
    """A server's planned rate is the sum of the rates of the robots routed to it, the lowered class's
    included (it kept the old rate: 10.917 Hz planned on a server whose robots summed to 9.855)."""
    from lerobot_zenoh.pipelines.deployment import _rate

    f, p = planned([{"task": "pick_and_place_simple", "robots": 1}, {"task": "assemble_kit", "robots": 3}], servers=5)
    a = admit(f, PROFILES, p, "assemble_kit")
    assert a.admitted and "rates lowered" in a.reason
    for server in a.plan.servers:
        routed = sum(_rate(f, a.plan, rid, comp) for rid, routes in a.plan.routing.items()
                     for comp, idx in routes.items() if idx == server.index)
        assert server.rate_hz == pytest.approx(routed, rel=1e-9), server.index
        assert evaluate_server(PROFILES.get(server.model), server.shares)[0] == server.batch_size
