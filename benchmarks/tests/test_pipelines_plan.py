"""benchmarks/studies/pipelines_plan.py: its model of the planner's baselines ranks the plan first."""

from __future__ import annotations

from benchmarks.studies.pipelines_plan import dedicated_per_model, dedicated_per_robot, make_factory, planned, shared
from lerobot_zenoh.pipelines.profiles import rosa_profiles

PROFILES = rosa_profiles()


def test_the_benchmark_model_ranks_the_plan_above_both_baselines_on_p4():
    f = make_factory("P4", 32, 8)
    tp, _ = planned(f, PROFILES)
    assert tp > 80
    assert shared(f, PROFILES) == 0.0  # uncapped robots queue past the System 1 SLO
    assert dedicated_per_model(f, PROFILES) < tp / 10 and dedicated_per_robot(f, PROFILES) == 0.0
