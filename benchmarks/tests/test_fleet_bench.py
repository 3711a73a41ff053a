"""The fleet benchmark's own pieces: trace generation, the capacity search, and a short real run.

The real run drives a few virtual robots over real Zenoh against a real `lerobot-policy-server`
process; it checks that the pieces are wired (chunks flow, the horizon the server sends is obeyed),
not how fast anything is.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from benchmarks.studies import fleet as fleet_model
from benchmarks.studies.fleet_traces import CHUNK_SIZE, Task, generate_traces, load_traces, write_traces
from benchmarks.studies import fleet_zenoh
from benchmarks.studies.fleet_server import register
from benchmarks.studies.fleet_zenoh import RunConfig, Study, aggregate, manifest, run
from lerobot_zenoh.server.config.manifest import Manifest


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
    register()  # what the benchmark's server launcher does: the FIFO-running-first rung is a plugin
    for kw in (dict(), dict(scheduler="wait_ratio", buckets=5, aging=2, first_request="lowest"),
               dict(max_batch="auto", horizon="dynamic"), dict(scheduler="fifo_running_first", max_batch="16")):
        m = Manifest.model_validate(manifest(RunConfig(**kw), port=7999))
        assert m.server[0].max_batch_size == {"auto": "auto", "16": 16}.get(kw.get("max_batch"), 1)


def test_the_compiled_capacity_study_serves_pi0_both_ways_to_robots_that_send_what_it_reads(tmp_path):
    """`benchmarks/studies/compiled_capacity.py`: the eager and compiled manifests differ only in `compile`,
    and its robots send a 6-D state, both cameras as 96x128 JPEG and a task, as the reference client does."""
    from benchmarks.studies import compiled_capacity as study
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.server.config.manifest import parse_manifest

    eager, compiled = (study.manifest(mode, 7999, tmp_path / "pi0", tmp_path / "cache", 8) for mode in study.MODES)
    assert {**eager["server"][0], "compile": None} == {**compiled["server"][0], "compile": None}
    assert [parse_manifest(m).server[0].compile.mode for m in (eager, compiled)] == ["off", "default"]
    sent = []
    robot = study.CameraRobot("r000", RunConfig(), SimpleNamespace(put=sent.append), phase=3,
                              frames=study.camera_frames(2))
    robot.start_task(Task(static_h=10, length=40, rounds=(10,)), now=0.0, measured=True)
    robot.tick(0.0, fleet_zenoh.Counters())  # an empty buffer: the first tick asks for a chunk
    obs = codec.decode_observation(sent[0])
    assert obs.state.shape == (study.STATE_DIM,) and obs.task in study.TASKS and obs.seq_id == 1
    assert {name: codec.decode_jpeg(data).shape for name, data in obs.images.items()} == \
        {name: (h, w, 3) for name, (h, w) in study.CAMERAS.items()}


def test_largest_fleet_search_from_a_guess_is_exact_to_one_robot():
    """The real study's search (the model's, started from a guess) with a fake run whose stalls start above 23 robots."""
    tried = []

    def fake(n):
        tried.append(n)
        return SimpleNamespace(stalled_arrival_pct=0.2 if n <= 23 else 5.0)

    for guess in (1, 5, 22, 23, 24, 40):
        tried.clear()
        n = fleet_model.largest_fleet(fake, "stalled_arrival_pct", start=guess)
        assert n == "23" and 23 in tried and 24 in tried, (guess, n, tried)
        assert len(tried) <= 12
    tried.clear()
    assert fleet_model.largest_fleet(fake, "stalled_arrival_pct", start=23) == "23" and tried == [23, 24]  # a good guess: 2 points
    assert fleet_model.largest_fleet(fake, "stalled_arrival_pct", limit=20, start=5) == ">= 20"
    assert fleet_model.largest_fleet(lambda n: SimpleNamespace(s=9.0), "s", start=4) == "0"


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
    static = run(base, tasks, tmp_path / "static", verbose=False)
    assert static["chunks"] > 0 and static["actions_per_s"] > 0
    assert static["stalled_arrival_pct"] > static["stalled_pct"]  # each task's wait for its first chunk counts too
    assert static["server_inferences"] > 0
    # the robot keeps the task's static horizon: never more than the largest static H
    assert static["mean_kept_rows"] <= max(t.static_h for t in tasks)

    dynamic = run(replace(base, horizon="dynamic", scheduler="wait_ratio"), tasks, tmp_path / "dynamic", verbose=False)
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


def fake_result(cfg: RunConfig) -> dict:
    """A run's result with stalls over 2 % above 5 robots one at a time or 11 batched, and seed-dependent throughput."""
    over = cfg.robots > (5 if cfg.max_batch == "1" else 11)
    figures = {k: 1.0 for k in fleet_zenoh.METRICS}
    figures.update(stalled_arrival_pct=4.0 if over else 1.5 if cfg.robots > 1 else 1.0, stalled_pct=0.0,
                   actions_per_s=30.0 * cfg.robots + cfg.seed, latency_mean_s=math.nan if cfg.seed == 2 else 5.0 + cfg.seed)
    return {"config": {"robots": cfg.robots}, "tasks_measured": 3, **figures}


def test_the_cache_key_holds_the_configuration_and_the_code_version(monkeypatch, tmp_path):
    cfg = RunConfig()
    assert cfg.key() == RunConfig().key() != replace(cfg, seed=1).key() != replace(cfg, robots=11).key()
    assert len(fleet_zenoh.code_version()) == 16
    key_now = cfg.key()
    monkeypatch.setattr(fleet_zenoh, "_CODE_VERSION", ["another version"])
    assert cfg.key() != key_now  # a result measured on other code is not reused

    calls = []
    monkeypatch.setattr(fleet_zenoh, "run", lambda c, tasks, out: calls.append(c) or fake_result(c))
    study = Study([], tmp_path, fresh=False)
    first = study.run(cfg)
    assert study.run(cfg) == first and len(calls) == 1  # cached
    stored = json.loads((tmp_path / "runs" / f"{cfg.key()}.json").read_text())
    assert stored["code_version"] == "another version" and stored["git"]
    assert Study([], tmp_path, fresh=True).run(cfg) and len(calls) == 2  # --fresh runs it again


def test_seeds_are_aggregated_as_mean_and_sample_sd_nan_seeds_left_out():
    runs = [fake_result(RunConfig(robots=4, seed=s)) for s in (0, 1, 2)]
    r = aggregate(runs)
    assert r.actions_per_s == pytest.approx(121.0) and r.sd["actions_per_s"] == pytest.approx(1.0)
    assert r.latency_mean_s == pytest.approx(5.5) and r.sd["latency_mean_s"] == pytest.approx(math.sqrt(0.5))
    assert r.robots == 4 and r.tasks_measured == 9 and r.runs == runs
    assert fleet_model.pm(r, "actions_per_s", ".0f") == "121 ± 1"


def test_the_study_searches_every_rung_and_sets_it_beside_the_model(monkeypatch, tmp_path):
    monkeypatch.setattr(fleet_zenoh, "run", lambda c, tasks, out: fake_result(c))
    args = SimpleNamespace(traces=None, tasks=20, trace_seed=1, seeds=3, profile="gpu", out=str(tmp_path), fresh=False,
                           lock=str(tmp_path / "bench.lock"), warmup_s=2.0, measure_s=6.0, max_fleet=16)
    body, data = fleet_zenoh.study(args)
    assert [r["name"] for r in data["rungs"]] == [name for name, _ in fleet_model.RUNGS]
    assert {r["real"] for r in data["rungs"]} == {"5", "11"}  # exact to one robot on every rung
    assert all(r["model"] and r["model_capture"] and r["model_capture_ticks"] for r in data["rungs"])
    for name, _ in fleet_model.RUNGS:
        assert body.count(f"| {name} |") == 2  # the real table and the real-vs-model table
    assert "dedicated server per robot" in body and "capture-aligned / on ticks (ratios)" in body
    assert all(len(runs) == 3 for r in data["rungs"] for runs in r["points"].values())  # 3 seeds per point

    def no_run(*_):
        raise AssertionError("--cached-only ran something")

    monkeypatch.setattr(fleet_zenoh, "run", no_run)
    again, _ = fleet_zenoh.study(SimpleNamespace(**{**vars(args), "cached_only": True}))
    assert again == body  # a report from the cache alone
    batched = replace(RunConfig(warmup_s=2.0, measure_s=6.0), scheduler="wait_ratio", max_batch="16", robots=12, seed=1)
    (tmp_path / "runs" / f"{batched.key()}.json").unlink()  # an interrupted search
    partial, data = fleet_zenoh.study(SimpleNamespace(**{**vars(args), "cached_only": True}))
    assert "Searches not finished" in partial and "wait ratio, batched: >= 11" in partial.split("Searches not finished")[1]
    assert [r["name"] for r in data["rungs"]] == [name for name, _ in fleet_model.RUNGS[:-1]]


def test_the_model_aligned_at_capture_buys_fewer_actions_per_request():
    """chunk_start=capture (the reference client's alignment): a request sent L actions ahead buys H - L new
    ones, so the same tasks take more requests and finish later, and nothing else changes for a robot alone."""
    traces = [t.executed_rounds(False) for t in generate_traces(30, seed=2)]
    latency = fleet_model.gpu_latency()
    base = fleet_model.Config(robots=1, duration_s=120.0, warmup_s=5.0)
    after = fleet_model.FleetSim(base, traces, latency).run()
    capture = fleet_model.FleetSim(replace(base, chunk_start="capture"), traces, latency).run()
    assert capture.requests > 1.1 * after.requests
    assert capture.tasks_done >= after.tasks_done - 1 and capture.stalled_pct < 1.0  # alone, still no mid-task stall
    assert capture.actions_per_s == pytest.approx(after.actions_per_s, rel=0.05)
    loaded = replace(base, robots=10)  # one at a time: the extra requests saturate the server
    assert (fleet_model.FleetSim(replace(loaded, chunk_start="capture"), traces, latency).run().stalled_arrival_pct
            > fleet_model.FleetSim(loaded, traces, latency).run().stalled_arrival_pct + 5)


def test_the_model_on_ticks_sends_and_starts_chunks_only_on_a_robots_tick():
    """tick_phases=N (the real driver's robots): a robot acts on its own 30 Hz tick, so each chunk waits for
    the next tick after it arrives; alone that costs stalls (never throughput), and robot i ticks in phase i % N."""
    traces = [t.executed_rounds(False) for t in generate_traces(30, seed=2)]
    latency = fleet_model.gpu_latency()
    base = fleet_model.Config(robots=1, duration_s=120.0, warmup_s=5.0, chunk_start="capture")
    sim = fleet_model.FleetSim(replace(base, tick_phases=10), traces, latency)
    robot = sim._robot("r13")
    assert robot.phase_s == pytest.approx(3 * fleet_model.DT_S / 10)
    assert robot.tick(robot.phase_s + 2 * fleet_model.DT_S) == pytest.approx(robot.phase_s + 2 * fleet_model.DT_S)
    assert robot.tick(robot.phase_s + 2.1 * fleet_model.DT_S) == pytest.approx(robot.phase_s + 3 * fleet_model.DT_S)
    assert fleet_model.FleetSim(base, traces, latency)._robot("r13").phase_s is None  # continuous by default
    continuous, ticked = fleet_model.FleetSim(base, traces, latency).run(), sim.run()
    assert ticked.actions_per_s == pytest.approx(continuous.actions_per_s, rel=0.05)
    assert ticked.stalled_arrival_pct > continuous.stalled_arrival_pct


def test_requests_per_task_alone_is_one_per_round_after_the_buffer_and_more_at_capture():
    """The load basis of `--load-basis alone`: with chunks started after the buffer a robot alone asks one
    request per round (over a long window: no edge bias), with the client's alignment more."""
    traces = [t.executed_rounds(False) for t in generate_traces(40, seed=2)]
    latency = fleet_model.gpu_latency()
    rounds = sum(map(len, traces)) / len(traces)
    after = fleet_model.requests_per_task_alone(fleet_model.Config(duration_s=60.0, warmup_s=5.0), traces, latency, [0, 1])
    capture = fleet_model.requests_per_task_alone(
        fleet_model.Config(duration_s=60.0, warmup_s=5.0, chunk_start="capture", tick_phases=10), traces, latency, [0, 1])
    assert after == pytest.approx(rounds, rel=0.03)
    assert capture > 1.05 * after


# -- tiers: edge engines, a cloud behind a WAN, placement ----------------------------------------


def _tier_cfg(**kw):
    base = fleet_model.Config(mode="online", scheduler="wait_ratio", max_batch=16, duration_s=30.0, warmup_s=8.0,
                              seed=1)
    return replace(base, **kw)


def _tier_run(cfg):
    traces = [t.executed_rounds(False) for t in generate_traces(60, seed=4)]
    latency = fleet_model.gpu_latency()
    rate = fleet_model.rate_for_load(cfg.rate_per_s, latency, cfg.max_batch, traces)  # rate_per_s given as a load
    return fleet_model.FleetSim(replace(cfg, rate_per_s=rate), traces, latency).run()


def test_the_one_gpu_server_is_unchanged_by_the_tier_settings_it_does_not_use():
    plain = _tier_run(_tier_cfg(rate_per_s=0.9))
    same = _tier_run(_tier_cfg(rate_per_s=0.9, cloud_engines=3, wan_one_way_s=0.02, payload_bytes=1))
    # tiers=edge with one engine: the server's own loop, no placement
    assert replace(plain, cfg=None, runs=[]) == replace(same, cfg=None, runs=[])
    assert plain.offload_pct == 0.0


def test_hybrid_offloads_past_the_edges_saturation_and_keeps_tasks_short():
    edge = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="edge"))
    hybrid = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="hybrid"))
    cloud = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="cloud"))
    assert cloud.offload_pct == 100.0
    assert 20 < hybrid.offload_pct < 80  # the edge keeps what it can serve in time
    assert hybrid.latency_mean_s < 0.5 * edge.latency_mean_s  # edge-only is overloaded at 1.6
    assert hybrid.stalled_arrival_pct < edge.stalled_arrival_pct
    light = _tier_run(_tier_cfg(rate_per_s=0.5, tiers="hybrid"))
    assert light.offload_pct < 2  # below saturation the edge answers first: nothing to gain across the WAN


def test_a_slower_wan_offloads_less_and_history_bytes_cost_time():
    near = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="hybrid", wan_one_way_s=0.025))
    far = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="hybrid", wan_one_way_s=0.2))
    assert far.offload_pct < near.offload_pct
    assert far.latency_mean_s > near.latency_mean_s
    # 400 kB of history at 2.5 MB/s: 0.2 s more per offloaded request; past saturation the edge cannot
    # keep them, so the tasks get longer
    thin = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="hybrid", wan_bandwidth_bps=2.5e6, history_bytes=400_000))
    assert thin.latency_mean_s > _tier_run(_tier_cfg(rate_per_s=1.6, tiers="hybrid")).latency_mean_s


def test_engines_behind_one_scheduler_and_independent_servers_both_add_capacity():
    one = _tier_run(_tier_cfg(rate_per_s=1.6))
    shared = _tier_run(_tier_cfg(rate_per_s=1.6, edge_engines=2))
    split = _tier_run(_tier_cfg(rate_per_s=1.6, servers=2))
    assert shared.latency_mean_s < 0.5 * one.latency_mean_s
    assert split.latency_mean_s < 0.5 * one.latency_mean_s
    assert shared.offload_pct == split.offload_pct == 0.0
    with pytest.raises(ValueError, match="tiers"):
        fleet_model.Config(tiers="fog")


def test_cloud_only_as_the_real_run_has_it_holds_at_most_its_capacity_in_flight():
    """cloud_site=engine: the edge scheduler relays to a cloud engine that holds at most its batch in
    flight (as the product's dispatcher): past what that carries over the round trip it overloads,
    where a whole server at the cloud site (or an engine kept busy through the round trip) does not."""
    server = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="cloud"))
    relayed = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="cloud", cloud_site="engine"))
    covered = _tier_run(_tier_cfg(rate_per_s=1.6, tiers="cloud", cloud_site="engine", cloud_in_flight="cover"))
    assert relayed.offload_pct == covered.offload_pct == 100.0
    assert relayed.latency_mean_s > 1.5 * server.latency_mean_s
    assert covered.latency_mean_s < relayed.latency_mean_s
    with pytest.raises(ValueError, match="cloud_site"):
        fleet_model.Config(cloud_site="moon")
    with pytest.raises(ValueError, match="cloud_in_flight"):
        fleet_model.Config(cloud_in_flight="all")


def test_the_real_hybrid_runs_draw_the_models_arrivals():
    """Seed k is the same Poisson arrival times in `benchmarks/studies/hybrid.py` and the model."""
    from benchmarks.studies import hybrid

    for seed in (0, 3):
        cfg = fleet_model.Config(mode="online", rate_per_s=6, arrivals_s=5, duration_s=20, warmup_s=1,
                                 trigger="fixed:0", seed=seed)
        sim = fleet_model.FleetSim(cfg, [[10] * 2], fleet_model.gpu_latency())
        starts, start = [], sim._start_task
        sim._start_task = lambda t, robot: (starts.append(t), start(t, robot))
        sim.run()
        assert starts == pytest.approx(hybrid.arrival_times(6, seed, 5), abs=1e-12)


def test_pass_jitter_keeps_the_arrivals_and_varies_only_the_passes():
    """`pass_jitter` draws from its own stream: the same seed still has the real runs' arrivals, and
    the passes vary around their profile (never more than the jitter either way)."""
    from benchmarks.studies import hybrid

    cfg = fleet_model.Config(mode="online", tiers="hybrid", rate_per_s=6, arrivals_s=5, duration_s=20, warmup_s=1,
                             trigger="fixed:0", seed=3, max_batch=4, wan_one_way_s=0.05, pass_jitter=0.1)
    sim = fleet_model.FleetSim(cfg, [[10] * 2], fleet_model.gpu_latency())
    starts, start = [], sim._start_task
    sim._start_task = lambda t, robot: (starts.append(t), start(t, robot))
    factors, jitter = [], sim._jitter
    sim._jitter = lambda: factors.append(jitter()) or factors[-1]
    result = sim.run()
    assert starts == pytest.approx(hybrid.arrival_times(6, 3, 5), abs=1e-12)
    assert result.tasks_done > 0 and len(factors) > 10
    assert all(0.9 <= f <= 1.1 for f in factors) and len(set(factors)) == len(factors)
    with pytest.raises(ValueError, match="pass_jitter"):
        fleet_model.Config(pass_jitter=1.0)


def test_the_model_beside_a_real_hybrid_run_point_by_point(tmp_path, capsys):
    """`fleet_hybrid_check` runs the model at a real run's settings and seeds and sets the two side by
    side; a 'real' run that is the model's own output agrees exactly, a slower one is flagged, and
    the calibration fits non-negative overheads."""
    from benchmarks.studies import fleet_hybrid_check as check

    args = {"duration_s": 4.0, "warmup_s": 1.0, "rounds": 2, "steps": 5, "wan_ms": 50.0, "wan_mbit": 1000.0}
    rows = [{"mode": m, "rate": 3.0, "seed": s, "mean_s": 1.0, "offload_share": 0.0} for m in ("edge", "cloud", "hybrid")
            for s in (0, 1)]
    real = {"args": args, "payload_bytes": 5000, "rows": rows}
    for row, model in zip(rows, check.run_model(real), strict=True):
        row.update(mean_s=model["mean_s"], offload_share=model["offload_share"])
    rows[0]["mean_s"] *= 1.5  # edge-only, seed 0: the real run 50 % slower
    rows[0].update(resends=1, tasks=2)  # ... for one resend (10 s over 2 tasks)
    path = tmp_path / "hybrid.json"
    path.write_text(json.dumps(real))
    assert check.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 3 | hybrid |" in out and "| 3 | cloud |" in out and "+0.0 %" in out
    assert "**no**" in out and "2 of 3 points within 10 % (2 with the resend waits added)" in out
    points = check.compare(real, check.run_model(real), check.run_model(real, scale=1.05))
    edge = next(p for p in points if p["mode"] == "edge")
    assert edge["with_resends_pct"] > edge["diff_pct"] + 100  # + 5 s per task of seed 0
    assert all(p["slower_moves_pct"] > 0 for p in points)
    edge_s, engine_s = check.calibrate(real)
    assert edge_s > 0 and engine_s >= 0
    assert check.observation_bytes() > 1000  # one 96x128 JPEG camera


def test_scaleout_layouts_are_valid_manifests():
    from benchmarks.studies import fleet_scaleout
    from lerobot_zenoh.server.config.manifest import parse_manifest

    for layout in fleet_scaleout.LAYOUTS:
        for name, data in fleet_scaleout.manifests(layout, 2, fleet_scaleout.profile_ms(2.0)):
            parsed = parse_manifest(data)
            assert parsed.server[0].model_id == fleet_scaleout.APP.model, name
    assert len(fleet_scaleout.endpoints("static", 4)) == 4 and len(fleet_scaleout.endpoints("pooled", 4)) == 1


def test_both_hybrid_benchmarks_take_the_wan_delay_one_way(tmp_path, capsys):
    """`benchmarks/studies/hybrid.py --wan-ms` and `benchmarks/studies/fleet.py --wan-ms` are the same quantity: the
    edge-cloud link's delay in ONE direction (Kairos' base latency); a round trip is twice it."""
    from benchmarks.studies import hybrid

    assert hybrid.Topology(tmp_path, wan=(100.0, 1000.0)).specs[1][2:] == (100.0, 1000.0)  # shaped per direction
    assert hybrid.EDGE_CLOUD[2] == 100.0  # Kairos' WAN by default
    for main, argv in ((hybrid.main, ["study", "--help"]), (fleet_model.main, ["--help"])):
        with pytest.raises(SystemExit):
            main(argv)
        assert "ONE-WAY" in " ".join(capsys.readouterr().out.split())
    sim = fleet_model.FleetSim(fleet_model.Config(tiers="hybrid", wan_one_way_s=0.1, max_batch=4), [[10]],
                               fleet_model.gpu_latency())
    cloud = [e for e in sim.servers[0].engines if e.tier == "cloud"][0]
    assert cloud.view().rtt_s == pytest.approx(0.2)
