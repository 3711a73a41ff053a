"""The pipeline runtime with a fake clock: send rules, deadlines, fallbacks, danger, the plan, the task
retry policy and the SLO counters (lerobot_zenoh/pipelines/runtime.py, docs/pipelines.md)."""

import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.pipelines.descriptor import parse_task
from lerobot_zenoh.pipelines.runtime import PipelineRuntime

POSE = [0.0, -1.2, 1.5, 0.8, 0.0, 0.0]


def task(only=None, **over):
    comps = {
        "act": {"kind": "system1", "model": "m1", "prompt": "pick", "invocation": "per_chunk",
                "slo": {"deadline_ms": 200}, "on_slo_miss": {"action": "retry", "max_retries": 2, "then": "hold"},
                "inputs": ["plan"]},
        "plan": {"kind": "system2", "model": "m2", "prompt": "next?", "invocation": {"every_n_chunks": 3},
                 "slo": {"deadline_ms": 2000}, "on_slo_miss": "use_last"},
        "safety": {"kind": "safety", "model": "m3", "invocation": {"rate_hz": 2}, "slo": {"deadline_ms": 500},
                   "on_slo_miss": "zero_velocity", "on_danger": {"action": "safe_pose", "pose": POSE}},
        "progress": {"kind": "monitor", "model": "m2", "invocation": {"rate_hz": 0.5}, "slo": {"deadline_ms": 2000},
                     "on_slo_miss": "hold", "on_danger": "stop_episode"},
    }
    for path, value in over.items():
        comp, key = path.split("__")
        comps[comp][key] = value
    if only:
        comps = {k: v for k, v in comps.items() if k in only}
        comps["act"]["inputs"] = []
    return parse_task({"name": "kit", "action_period_ms": 200, "retry": {"max_retries": 1, "then": "stop_episode"},
                       "components": comps})


def runtime(**over):
    rt = PipelineRuntime(task(**over))
    rt.begin_attempt(0.0)
    return rt


ACT, PLAN, SAFETY, PROGRESS = 1, 2, 4, 8


def send(rt, seq, now, s1=True):
    mask = rt.due_mask(now, s1)
    if mask:
        rt.on_sent(seq, mask, now)
    return mask


def test_bits_follow_the_descriptor_order():
    rt = runtime()
    assert rt.components == ["act", "plan", "safety", "progress"]
    assert [rt.bit(c) for c in rt.components] == [ACT, PLAN, SAFETY, PROGRESS]
    assert rt.components_in(ACT | SAFETY) == ["act", "safety"]


def test_send_rules_system2_every_n_chunks_and_rates():
    rt = runtime()
    # t=0: everything is due at the start of an attempt
    assert send(rt, 1, 0.0) == ACT | PLAN | SAFETY | PROGRESS
    # System 1 alone until the 3rd chunk after the plan; safety every 0.5 s, monitor every 2 s
    assert send(rt, 2, 0.2) == ACT
    assert send(rt, 3, 0.4) == ACT
    assert send(rt, 4, 0.46) == ACT | PLAN | SAFETY   # safety due at 0.5: taken 0.04 s early (< 10 % of 0.5 s)
    assert rt.due_mask(0.6, False) == 0                # nothing due: nothing published
    assert rt.due_mask(1.0, False) == SAFETY           # due on its own: an observation for it alone
    rt.on_sent(5, SAFETY, 1.0)
    masks = [rt.due_mask(t / 100, False) for t in range(101, 150)]
    assert set(masks) == {0}
    assert rt.due_mask(1.5, False) == SAFETY
    rt.on_sent(6, SAFETY, 1.5)
    assert rt.due_mask(2.0, False) == SAFETY | PROGRESS


def test_planned_rate_replaces_the_descriptor_rate():
    rt = PipelineRuntime(task(), rates_hz={"safety": 10.0})
    rt.begin_attempt(0.0)
    send(rt, 1, 0.0)
    assert rt.due_mask(0.1, False) == SAFETY
    with pytest.raises(ConfigError, match="rates_hz.safety"):
        PipelineRuntime(task(), rates_hz={"safety": 0.0})


def test_deadlines_met_missed_and_late_are_counted():
    rt = runtime()
    send(rt, 1, 0.0)
    assert rt.on_chunk(1, 0.15) == "met"
    send(rt, 2, 0.2)
    assert rt.poll(0.39) == []
    assert rt.poll(0.41) == ["act"]          # 200 ms deadline passed
    assert rt.on_chunk(2, 0.5) == "late"
    assert rt.on_chunk(99, 0.5) == "unknown"
    s = rt.stats()["act"]
    assert (s.requests, s.answered, s.met, s.missed, s.late, s.rejected) == (2, 2, 1, 1, 1, 1)
    f = rt.figures()
    assert f["slo.act.attainment"] == 0.5 and f["slo.act.slo_violated"] == 1 and f["slo.act.fallbacks"] == 1


def test_an_answer_after_its_deadline_not_yet_polled_is_a_miss():
    rt = runtime()
    send(rt, 1, 0.0)
    assert rt.on_chunk(1, 0.25) == "late"
    assert rt.stats()["act"].missed == 1 and rt.stats()["act"].met == 0


def test_latency_percentiles_include_answers_that_came_after_their_deadline():
    """An answer 900 ms after its request, whose 200 ms deadline poll() saw pass, counts in the
    percentiles (they were capped near the deadline when late answers were left out)."""
    rt = runtime(only=("act",))
    for i in range(9):
        send(rt, i + 1, float(i))
        assert rt.on_chunk(i + 1, i + 0.05) == "met"
    send(rt, 10, 9.0)
    assert rt.poll(9.25) == ["act"]
    assert rt.on_chunk(10, 9.9) == "late"
    s = rt.stats()["act"]
    assert sorted(s.latencies_ms)[-1] == pytest.approx(900.0)
    assert rt.figures()["slo.act.latency_ms_p99"] > 800.0
    assert rt.on_chunk(10, 9.95) == "unknown"  # a second answer to it is nobody's


def test_retry_reasks_then_falls_back_to_hold_until_an_answer_in_time():
    rt = PipelineRuntime(task(only=("act",)))
    rt.begin_attempt(0.0)
    send(rt, 1, 0.0)
    rt.on_chunk(1, 0.01)
    send(rt, 2, 0.1)
    rt.poll(0.31)                             # miss 1: re-asked at once, no mode
    assert rt.mode is None and rt.due_mask(0.31, False) & ACT
    send(rt, 3, 0.31, s1=False)
    rt.poll(0.52)                             # miss 2: re-asked
    assert rt.mode is None
    send(rt, 4, 0.52, s1=False)
    rt.poll(0.73)                             # miss 3 > max_retries 2: then = hold
    assert rt.mode.action == "hold" and "act" in rt.mode.reason
    assert rt.due_mask(0.74, False) & ACT == 0    # no longer forced: the send trigger decides
    send(rt, 5, 0.8)
    assert rt.on_chunk(5, 0.9) == "met"
    assert rt.mode is None
    assert rt.stats()["act"].fallbacks == 3


def test_safety_miss_is_zero_velocity_and_unsafe_latches_safe_pose_until_a_later_safe():
    rt = runtime()
    send(rt, 1, 0.0)
    rt.poll(0.6)                               # safety's 500 ms passed
    assert rt.mode.action == "zero_velocity"
    assert rt.on_verdict("safety", 1, "safe", 0.7) == "late"
    assert rt.mode.action == "zero_velocity"   # a late answer does not clear a missed-SLO mode
    rt.on_sent(2, SAFETY, 1.4)
    rt.on_sent(3, SAFETY, 1.5)
    assert rt.on_verdict("safety", 3, "unsafe", 1.6) == "met"
    assert rt.mode.action == "safe_pose" and rt.mode.pose == tuple(POSE)
    assert rt.on_verdict("safety", 2, "safe", 1.61) == "met"   # about an earlier observation: still unsafe
    assert rt.mode.action == "safe_pose"
    rt.on_sent(4, SAFETY, 2.0)
    rt.on_verdict("safety", 4, "safe", 2.1)
    assert rt.mode is None


def test_labels_that_do_not_fit_the_component_are_rejected():
    rt = runtime()
    send(rt, 1, 0.0)
    assert rt.on_verdict("safety", 1, "done", 0.1) == "rejected"
    assert rt.on_verdict("progress", 1, "unsafe", 0.1) == "rejected"
    assert rt.on_text("safety", 1, "x", 0.1) == "rejected"
    assert rt.outcome is None and rt.mode is None
    assert rt.stats()["safety"].rejected == 2 and rt.stats()["progress"].rejected == 1


def test_system2_text_becomes_system1_task_and_resets_each_attempt():
    rt = runtime()
    assert rt.task_text == "pick"
    send(rt, 1, 0.0)
    for seq, t in ((2, 0.2), (3, 0.4), (4, 0.6)):
        send(rt, seq, t)
    assert rt.on_text("plan", 4, "place the cube", 0.9) == "met"
    assert rt.on_text("plan", 1, "grasp the cube", 1.0) == "met"   # an older request's answer: not the plan
    assert rt.task_text == "place the cube"
    rt.poll(5.0)
    assert rt.task_text == "place the cube"    # use_last: a missed plan keeps the last one
    rt.on_sent(7, PLAN, 5.5)
    rt.begin_attempt(6.0)
    assert rt.task_text == "pick"
    assert rt.on_text("plan", 7, "stale", 6.1) == "stale" and rt.task_text == "pick"


def test_a_plan_longer_than_a_server_reads_is_cut_at_a_character_boundary():
    from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES

    rt = runtime()
    send(rt, 1, 0.0)
    assert rt.on_text("plan", 1, "x" + "ü" * MAX_TASK_BYTES, 0.5) == "met"
    assert len(rt.task_text.encode()) == MAX_TASK_BYTES - 1 and rt.task_text.startswith("xü")


def test_failed_ends_the_attempt_then_the_task_retry_policy():
    rt = runtime()
    send(rt, 1, 0.0)
    rt.on_verdict("progress", 1, "failed", 0.5)
    assert rt.outcome.kind == "failed" and rt.due_mask(0.6, True) == 0
    assert rt.conclude() == "retry"
    rt.begin_attempt(1.0)
    assert rt.attempt == 2 and rt.outcome is None
    send(rt, 2, 1.0)
    rt.on_verdict("progress", 2, "failed", 1.5)
    assert rt.conclude() == "stop"                 # max_retries 1 spent, then: stop_episode


def test_retry_budget_spent_with_then_safe_pose_halts():
    t = task().model_copy(update={"retry": task().retry.model_copy(update={"max_retries": 0, "then": "safe_pose"})})
    rt = PipelineRuntime(t)
    rt.begin_attempt(0.0)
    send(rt, 1, 0.0)
    rt.on_verdict("progress", 1, "failed", 0.1)
    assert rt.conclude() == "halt"
    assert rt.mode.action == "safe_pose" and rt.mode.pose == tuple(POSE)
    rt.begin_attempt(0.2)
    assert rt.due_mask(0.2, True) == 0 and rt.mode.action == "safe_pose"


def test_done_is_a_success_and_a_monitor_failed_mode_holds_during_the_reset():
    rt = runtime(progress__on_danger="hold")
    send(rt, 1, 0.0)
    rt.on_verdict("progress", 1, "failed", 0.1)
    assert rt.mode.action == "hold"
    rt.conclude()
    rt.begin_attempt(0.5)
    assert rt.mode is None
    send(rt, 2, 0.5)
    rt.on_verdict("progress", 2, "done", 0.6)
    assert rt.outcome.kind == "done" and rt.conclude() == "done"


def test_stop_episode_fallback_and_unsafe_stop_episode_end_the_attempt():
    rt = runtime(progress__on_slo_miss="stop_episode")
    send(rt, 1, 0.0)
    rt.on_chunk(1, 0.1)
    rt.on_verdict("safety", 1, "safe", 0.1)
    rt.on_text("plan", 1, "x", 0.1)
    rt.poll(2.1)
    assert rt.outcome.kind == "stopped" and "progress" in rt.outcome.reason
    rt2 = runtime(safety__on_danger="stop_episode")
    send(rt2, 1, 0.0)
    rt2.on_verdict("safety", 1, "unsafe", 0.1)
    assert rt2.outcome.kind == "stopped" and rt2.mode is None


def test_the_most_severe_mode_wins():
    rt = runtime()
    send(rt, 1, 0.0)
    rt.on_chunk(1, 0.01)
    rt.on_text("plan", 1, "x", 0.01)
    rt.poll(2.1)                                # safety (zero_velocity) and monitor (hold) missed
    assert rt.mode.action == "zero_velocity"
    assert rt.figures()["pipeline.mode"] == 2
