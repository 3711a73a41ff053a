"""The fleet benchmark's own pieces: trace generation, the capacity search, and a short real run.

The real run drives a few virtual robots over real Zenoh against a real `lerobot-policy-server`
process; it checks that the pieces are wired (chunks flow, the horizon the server sends is obeyed),
not how fast anything is.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks import fleet as fleet_model
from benchmarks.fleet_traces import CHUNK_SIZE, Task, generate_traces, load_traces, write_traces
from benchmarks.fleet_zenoh import RunConfig, Study, manifest, run
from lerobot_zenoh.server.manifest import Manifest


def test_traces_follow_the_documented_distributions():
    tasks = generate_traces(200, seed=3)
    assert tasks == generate_traces(200, seed=3)  # deterministic
    for t in tasks:
        assert 9 <= t.static_h <= 48
        assert t.length % t.static_h == 0 and 4 <= t.length // t.static_h <= 12
        assert all(t.static_h <= h <= CHUNK_SIZE for h in t.rounds)
        assert sum(t.rounds) >= t.length > sum(t.rounds[:-1])
    assert len({t.static_h for t in tasks}) > 20  # heterogeneous
    ratios = [h / t.static_h for t in tasks for h in t.rounds]
    assert 0.1 < sum(r >= 2 for r in ratios) / len(ratios) < 0.6


def test_trusted_actions_is_the_round_covering_the_progress():
    task = Task(static_h=10, length=40, rounds=(10, 20, 15))
    assert [task.trusted_actions(p) for p in (0, 9, 10, 29, 30, 44, 100)] == [10, 10, 20, 20, 15, 15, 15]


def test_traces_round_trip_through_json(tmp_path):
    tasks = generate_traces(5, seed=0)
    write_traces(tmp_path / "t.json", tasks)
    assert load_traces(tmp_path / "t.json") == tasks


def test_generated_manifests_are_valid_for_every_lever(tmp_path):
    for kw in (dict(), dict(scheduler="wait_ratio", buckets=5, aging=2, first_request="lowest"),
               dict(max_batch="auto", horizon="dynamic")):
        m = Manifest.model_validate(manifest(RunConfig(**kw), port=7999))
        assert m.server[0].max_batch_size == ("auto" if kw.get("max_batch") == "auto" else 1)


def test_largest_fleet_search_brackets_the_stall_budget(tmp_path):
    """The search with a fake run whose stalls start above 23 robots."""
    study = Study([], tmp_path, fresh=True)
    tried = []

    def fake(cfg):
        tried.append(cfg.robots)
        return {"stalled_pct": 0.2 if cfg.robots <= 23 else 5.0, "config": {"robots": cfg.robots}}

    study.run = fake
    for guess in (5, 23, 40):
        tried.clear()
        n, points = study.largest_fleet(RunConfig(), guess)
        assert 0.92 * 23 <= n <= 23 and n in tried, (guess, n, tried)  # within the search's 8 % resolution
        assert len(tried) <= 12


def test_the_model_runs_the_shared_traces_static_and_dynamic():
    tasks = generate_traces(30, seed=2)
    static = [t.executed_rounds(False) for t in tasks]
    dynamic = [t.executed_rounds(True) for t in tasks]
    assert all(sum(s) == sum(d) == t.length for s, d, t in zip(static, dynamic, tasks))  # same motion
    assert sum(map(len, dynamic)) < sum(map(len, static))  # in fewer rounds
    cfg = fleet_model.Config(robots=4, duration_s=40.0, warmup_s=5.0)
    result = fleet_model.FleetSim(cfg, static, fleet_model.gpu_latency()).run()
    assert result.actions_per_s > 0 and result.tasks_done > 0 and result.stalled_pct < 5


@pytest.mark.slow
def test_a_short_fleet_run_over_real_zenoh(tmp_path):
    tasks = generate_traces(50, seed=1)
    base = RunConfig(robots=4, max_batch="auto", warmup_s=2.0, measure_s=5.0)
    static = run(base, tasks, tmp_path / "static", port=7531, verbose=False)
    assert static["chunks"] > 0 and static["actions_per_s"] > 0
    assert static["server_inferences"] > 0
    # the robot keeps the task's static horizon: never more than the largest static H
    assert static["mean_kept_rows"] <= max(t.static_h for t in tasks)

    dynamic = run(replace(base, horizon="dynamic", scheduler="wait_ratio"), tasks, tmp_path / "dynamic", port=7532,
                  verbose=False)
    assert dynamic["chunks"] > 0
    # the server's diffusion_confidence horizon (from the synthetic model's updates) is what the robots
    # keep: longer than the static horizon on these traces
    assert dynamic["mean_kept_rows"] > static["mean_kept_rows"]


def test_the_model_counts_stalls_from_arrival_and_its_refetch_bounds_the_age():
    traces = [t.executed_rounds(False) for t in generate_traces(30, seed=2)]
    latency = fleet_model.gpu_latency()
    rate = fleet_model.rate_for_load(1.0, latency, 1, traces)
    base = fleet_model.Config(mode="online", rate_per_s=rate, duration_s=60.0, warmup_s=10.0)
    off = fleet_model.FleetSim(base, traces, latency).run()
    on = fleet_model.FleetSim(replace(base, refresh_s=0.1), traces, latency).run()
    assert off.stalled_arrival_pct > off.stalled_pct  # the wait for the first chunk counts too
    # at most the threshold plus the one-way time of the refresh then on its way
    assert off.age_p99_ms > 300 and on.age_p99_ms <= (0.1 + base.one_way_s) * 1000 + 1e-6 and on.refreshes_per_request > 0
    assert on.latency_mean_s == pytest.approx(off.latency_mean_s)  # FIFO: a refresh keeps its place


def test_fifo_running_first_serves_a_running_task_before_a_new_one():
    s = fleet_model.FifoRunningFirst()
    s.on_arrival("new", 0.0)
    s.on_arrival("old", 0.0)
    s.on_served(["old"], 0.1, 0.1)
    s.on_arrival("old", 0.2)
    assert s.pick(["new", "old"], 0.3) == ["old"]  # although "new" has waited longer
    s.forget("old")
    s.on_arrival("old", 0.4)
    assert s.pick(["new", "old"], 0.5) == ["new"]


def test_largest_fleet_is_exact_to_one_robot():
    def fake(n):
        return replace(fleet_model.Result(fleet_model.Config(), 0, 0.5 if n <= 23 else 2.0, 0, 0, 0, 0, 0, 0, 0, 0, 0))

    assert fleet_model.largest_fleet(fake, "stalled_pct") == "23"
    assert fleet_model.largest_fleet(lambda n: fake(1), "stalled_pct", limit=64) == ">= 64"
