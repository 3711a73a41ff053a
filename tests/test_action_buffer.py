"""Action buffer: merge/pop semantics, aggregation registry, and a threaded property test (no
step popped twice or lost while chunks merge)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import draccus
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.scheduling.action_buffer import (
    ActionBuffer,
    AggregateConfig,
    AverageConfig,
    ConservativeConfig,
    LatestOnlyConfig,
    WeightedAverageConfig,
    WeightedConfig,
    make_aggregate,
)


@AggregateConfig.register_subclass("test_yielding_weighted")
@dataclass
class YieldingWeightedConfig(AggregateConfig):
    """0.4 old + 0.6 new, and gives the GIL away mid-merge so a concurrent pop gets its chance."""

    new_weight: float = 0.6

    def blend(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        time.sleep(0)
        return (1.0 - self.new_weight) * old + self.new_weight * new


def chunk(first_value: float, n: int, dim: int = 2) -> np.ndarray:
    return (first_value + np.arange(n, dtype=np.float32))[:, None].repeat(dim, axis=1)


def drain(buffer: ActionBuffer) -> list[tuple[int, np.ndarray]]:
    out = []
    while (item := buffer.pop()) is not None:
        out.append(item)
    return out


# --------------------------------------------------------------------------- sequential semantics


def test_pop_on_empty_returns_none_and_does_not_advance():
    buffer = ActionBuffer()
    assert buffer.pop() is None
    assert buffer.next_step == 0
    assert buffer.stats().empty_pops == 1


def test_new_steps_are_appended_and_popped_in_order():
    buffer = ActionBuffer(LatestOnlyConfig())
    result = buffer.merge(chunk(0, 3), first_step=0)
    assert (result.discarded_stale, result.blended, result.appended) == (0, 0, 3)
    assert len(buffer) == buffer.depth == 3
    popped = drain(buffer)
    assert [s for s, _ in popped] == [0, 1, 2]
    assert [a[0] for _, a in popped] == [0, 1, 2]
    assert buffer.next_step == 3


def test_stale_rows_are_discarded_and_overlap_is_blended():
    buffer = ActionBuffer(WeightedAverageConfig())
    buffer.merge(np.zeros((5, 2), np.float32), first_step=0)
    assert buffer.pop()[0] == 0
    assert buffer.pop()[0] == 1
    # Chunk for an observation taken at step 0: rows 0, 1 already executed.
    result = buffer.merge(np.ones((6, 2), np.float32), first_step=0)
    assert (result.discarded_stale, result.blended, result.appended) == (2, 3, 1)
    popped = drain(buffer)
    assert [s for s, _ in popped] == [2, 3, 4, 5]
    np.testing.assert_allclose([a[0] for _, a in popped], [0.7, 0.7, 0.7, 1.0], rtol=1e-6)
    stats = buffer.stats()
    assert (stats.merged_chunks, stats.blended_steps, stats.discarded_stale_rows) == (2, 3, 2)


def test_entirely_stale_chunk_changes_nothing():
    buffer = ActionBuffer()
    buffer.merge(chunk(0, 4), first_step=0)
    for _ in range(4):
        buffer.pop()
    result = buffer.merge(chunk(9, 3), first_step=1)
    assert (result.discarded_stale, result.blended, result.appended) == (3, 0, 0)
    assert buffer.pop() is None


def test_gap_is_jumped_and_counted():
    buffer = ActionBuffer(LatestOnlyConfig())
    buffer.merge(chunk(0, 2), first_step=0)
    buffer.merge(chunk(10, 2), first_step=5)
    assert [s for s, _ in drain(buffer)] == [0, 1, 5, 6]
    assert buffer.stats().skipped_steps == 3


def test_empty_buffer_with_later_chunk_jumps_forward():
    buffer = ActionBuffer(first_step=3)
    buffer.merge(chunk(0, 2), first_step=7)
    assert buffer.pop()[0] == 7
    assert buffer.next_step == 8


def test_clear_keeps_next_step():
    buffer = ActionBuffer()
    buffer.merge(chunk(0, 5), first_step=0)
    buffer.pop()
    assert buffer.clear() == 4
    assert len(buffer) == 0 and buffer.next_step == 1
    assert buffer.merge(chunk(0, 3), first_step=0).discarded_stale == 1


def test_merge_copies_the_callers_array():
    buffer = ActionBuffer(LatestOnlyConfig())
    rows = chunk(0, 2)
    buffer.merge(rows, first_step=0)
    rows[:] = 99
    assert buffer.pop()[1][0] == 0


def test_bad_chunks_are_rejected_and_leave_the_buffer_unchanged():
    buffer = ActionBuffer(action_dim=2)
    buffer.merge(chunk(0, 3), first_step=0)
    with pytest.raises(ProtocolError) as excinfo:
        buffer.merge(chunk(0, 3, dim=3), first_step=0)
    assert excinfo.value.reason == "action_shape"
    with pytest.raises(ProtocolError):
        buffer.merge(np.zeros(3, np.float32), first_step=0)
    bad = chunk(0, 3)
    bad[1, 0] = np.nan
    with pytest.raises(ProtocolError) as excinfo:
        buffer.merge(bad, first_step=0)
    assert excinfo.value.reason == "non_finite"
    assert [a[0] for _, a in drain(buffer)] == [0, 1, 2]
    assert buffer.stats().merged_chunks == 1


def test_action_dim_is_taken_from_first_chunk():
    buffer = ActionBuffer()
    assert buffer.action_dim is None
    buffer.merge(chunk(0, 1, dim=6), first_step=0)
    assert buffer.action_dim == 6
    with pytest.raises(ConfigError):
        ActionBuffer(action_dim=0)


def test_popped_actions_are_float32():
    buffer = ActionBuffer()
    buffer.merge(np.arange(6, dtype=np.float64).reshape(3, 2), first_step=0)
    assert buffer.pop()[1].dtype == np.float32


# --------------------------------------------------------------------------- aggregation registry


@pytest.mark.parametrize(
    ("name", "expected"),
    [("weighted_average", 0.7), ("latest_only", 1.0), ("average", 0.5), ("conservative", 0.3)],
)
def test_builtin_aggregations(name, expected):
    agg = make_aggregate(name)
    assert agg.type == name
    out = agg.blend(np.zeros(3, np.float32), np.ones(3, np.float32))
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_default_is_weighted_average():
    assert isinstance(ActionBuffer().aggregate, WeightedAverageConfig)
    assert AggregateConfig.default_choice_name() == "weighted_average"


def test_unknown_aggregation_names_the_field():
    with pytest.raises(ConfigError) as excinfo:
        make_aggregate("median")
    assert excinfo.value.field == "aggregate"


def test_weighted_validates_its_weight():
    with pytest.raises(ConfigError) as excinfo:
        WeightedConfig(new_weight=1.5)
    assert excinfo.value.field == "aggregate.new_weight"


@dataclass
class _CliConfig:
    aggregate: AggregateConfig | None = None


@pytest.mark.parametrize(
    ("args", "cls"),
    [
        (["--aggregate.type=latest_only"], LatestOnlyConfig),
        (["--aggregate.type=average"], AverageConfig),
        (["--aggregate.type=conservative"], ConservativeConfig),
        (["--aggregate.type=weighted_average"], WeightedAverageConfig),
        (["--aggregate.type=test_yielding_weighted"], YieldingWeightedConfig),  # a user's own
    ],
)
def test_draccus_cli_selects_aggregation(args, cls):
    cfg = draccus.parse(_CliConfig, args=args)
    assert type(cfg.aggregate) is cls


def test_draccus_cli_parametric_weighted():
    cfg = draccus.parse(_CliConfig, args=["--aggregate.type=weighted", "--aggregate.new_weight=0.8"])
    assert isinstance(cfg.aggregate, WeightedConfig)
    assert cfg.aggregate.new_weight == pytest.approx(0.8)


# --------------------------------------------------------------------------- property tests

# A merge plan: each chunk starts at or before the furthest step any earlier chunk reached, so the
# union of chunk ranges is contiguous from step 0 and no gap can ever be jumped.
merge_plans = st.lists(
    st.tuples(st.integers(min_value=0, max_value=12), st.integers(min_value=1, max_value=12)),
    min_size=1,
    max_size=25,
)


def _chunks_from_plan(plan, dim=3, seed=0):
    rng = np.random.default_rng(seed)
    chunks, end = [], 0
    for back, length in plan:
        first = max(end - back, 0)
        chunks.append((first, rng.standard_normal((length, dim)).astype(np.float32)))
        end = max(end, first + length)
    return chunks, end


def _expected_actions(chunks, results, aggregate):
    """Sequential semantics: merge m contributes to step s iff s is in its rows and was not stale."""
    expected: dict[int, np.ndarray] = {}
    for (first, rows), result in zip(chunks, results, strict=True):
        for i in range(result.discarded_stale, len(rows)):
            step = first + i
            if step in expected:
                expected[step] = np.asarray(aggregate.blend(expected[step], rows[i]), np.float32)
            else:
                expected[step] = rows[i]
    return expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=merge_plans, ops=st.lists(st.sampled_from(["pop", "merge"]), max_size=80))
def test_sequential_interleaving_matches_reference(plan, ops):
    """Any single-threaded interleaving: popped steps 0, 1, 2, ... and each value is the reference blend."""
    aggregate = WeightedAverageConfig()
    chunks, end = _chunks_from_plan(plan)
    buffer = ActionBuffer(aggregate)
    results, popped, pending = [], [], list(chunks)
    for op in ops:
        if op == "merge" and pending:
            first, rows = pending.pop(0)
            results.append(buffer.merge(rows, first))
        elif op == "pop" and (item := buffer.pop()) is not None:
            popped.append(item)
    for first, rows in pending:
        results.append(buffer.merge(rows, first))
    popped += drain(buffer)

    assert [s for s, _ in popped] == list(range(end))
    expected = _expected_actions(chunks, results, aggregate)
    for step, action in popped:
        np.testing.assert_array_equal(action, expected[step])
    stats = buffer.stats()
    assert stats.skipped_steps == 0
    assert stats.blended_steps + stats.appended_steps + stats.discarded_stale_rows == sum(
        len(rows) for _, rows in chunks
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=merge_plans, seed=st.integers(min_value=0, max_value=2**16))
def test_concurrent_pops_and_merges_lose_nothing_and_repeat_nothing(plan, seed):
    """Real threads: a control loop popping and a reception thread merging, at the same time.

    The merge results say where ``next_step`` stood at each merge (first_step + discarded rows),
    which fixes the sequential order the lock imposed; every popped action must equal the blend
    that order defines, every step must be popped exactly once, in order, with no gap.
    """
    aggregate = YieldingWeightedConfig()
    chunks, end = _chunks_from_plan(plan, seed=seed)
    buffer = ActionBuffer(aggregate)
    results, popped = [], []
    start = threading.Barrier(2)
    merging_done = threading.Event()

    def control_loop():
        start.wait()
        while not merging_done.is_set():
            item = buffer.pop()
            if item is not None:
                popped.append(item)
            time.sleep(0)
        popped.extend(drain(buffer))

    def reception():
        start.wait()
        try:
            for first, rows in chunks:
                results.append(buffer.merge(rows, first))
                time.sleep(0)
        finally:
            merging_done.set()

    threads = [threading.Thread(target=control_loop), threading.Thread(target=reception)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)

    steps = [s for s, _ in popped]
    assert steps == list(range(end)), "a step was executed twice, lost, or out of order"
    # Where some but not all rows were stale, first_step + discarded is exactly the next_step that
    # merge saw; across merges it never goes backwards.
    seen = [first + r.discarded_stale for (first, rows), r in zip(chunks, results) if 0 < r.discarded_stale < len(rows)]
    assert seen == sorted(seen)
    expected = _expected_actions(chunks, results, aggregate)
    for step, action in popped:
        np.testing.assert_array_equal(action, expected[step])
    assert buffer.stats().popped_steps == end


def test_concurrent_stress_with_long_chunks():
    """Many 50-step chunks racing a fast control loop: each step once, in order."""
    buffer = ActionBuffer(WeightedAverageConfig())
    popped: list[int] = []
    stop = threading.Event()
    n_chunks, length = 300, 50

    def control_loop():
        while not stop.is_set():
            item = buffer.pop()
            if item is not None:
                popped.append(item[0])

    t = threading.Thread(target=control_loop)
    t.start()
    rng = np.random.default_rng(1)
    try:
        for _ in range(n_chunks):
            first = buffer.next_step  # observation tagged with the step about to execute
            buffer.merge(rng.standard_normal((length, 6)).astype(np.float32), first)
    finally:
        stop.set()
        t.join(timeout=20)
    popped += [s for s, _ in drain(buffer)]
    assert popped == list(range(len(popped)))
    assert len(popped) >= length


# --------------------------------------------------------------------------- replace_from and leftover (RTC)


def test_leftover_is_exactly_what_pop_will_return():
    buffer = ActionBuffer(LatestOnlyConfig())
    assert buffer.leftover() == (0, pytest.approx(np.zeros((0, 0), np.float32)))
    rows = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    buffer.merge(rows, 0)
    buffer.pop()
    step, left = buffer.leftover()
    assert step == 1 and left.dtype == np.float32 and left.tobytes() == rows[1:].tobytes()
    assert buffer.leftover(2)[1].tobytes() == rows[1:3].tobytes()
    left[:] = 0  # a copy: the buffer is untouched
    assert [a.tobytes() for _, a in drain(buffer)] == [r.tobytes() for r in rows[1:]]
    buffer.merge(chunk(0, 2, 3), 10)  # next_step is 6 now; 10, 11 lie past a gap
    assert buffer.leftover()[1].shape == (0, 3)  # nothing is executed from next_step on before the gap


def test_replace_from_drops_the_executed_rows_and_replaces_everything_after():
    buffer = ActionBuffer(WeightedAverageConfig())
    buffer.merge(chunk(0, 10), 0)
    drain_n = [buffer.pop() for _ in range(3)]  # steps 0, 1, 2 executed
    assert [s for s, _ in drain_n] == [0, 1, 2]
    r = buffer.replace_from(chunk(100, 5), 1)  # row 0 is step 1: rows 0, 1 are for executed steps
    assert (r.discarded_stale, r.blended, r.appended, r.replaced, r.next_step) == (2, 0, 3, 7, 3)
    # steps 3, 4, 5 are the chunk's rows 2, 3, 4 unblended; the old steps 6..9 are gone
    assert [(s, a[0]) for s, a in drain(buffer)] == [(3, 102.0), (4, 103.0), (5, 104.0)]
    stats = buffer.stats()
    assert (stats.replaced_chunks, stats.replaced_steps, stats.blended_steps) == (1, 7, 0)


def test_replace_from_with_a_chunk_all_in_the_past_changes_nothing():
    buffer = ActionBuffer()
    buffer.merge(chunk(0, 6), 0)
    [buffer.pop() for _ in range(4)]
    r = buffer.replace_from(chunk(100, 3), 0)
    assert (r.discarded_stale, r.appended, r.replaced) == (3, 0, 0)
    assert [(s, a[0]) for s, a in drain(buffer)] == [(4, 4.0), (5, 5.0)]


def test_replace_from_rejects_bad_chunks_and_leaves_the_buffer_unchanged():
    buffer = ActionBuffer(action_dim=2)
    buffer.merge(chunk(0, 3), 0)
    bad = chunk(10, 3)
    bad[1, 1] = np.inf
    with pytest.raises(ProtocolError, match="non_finite"):
        buffer.replace_from(bad, 0)
    with pytest.raises(ProtocolError, match="action_shape"):
        buffer.replace_from(chunk(10, 3, dim=3), 0)
    assert [a[0] for _, a in drain(buffer)] == [0.0, 1.0, 2.0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=merge_plans, seed=st.integers(min_value=0, max_value=2**16))
def test_concurrent_pops_and_replacements_execute_each_step_once_from_the_newest_chunk(plan, seed):
    """Real threads, replace_from instead of merge: every step is executed once, in order, and each
    executed action is the row of the newest chunk replaced in before that step was popped."""
    chunks, end = _chunks_from_plan(plan, seed=seed)
    buffer = ActionBuffer()
    results, popped = [], []
    start = threading.Barrier(2)
    replacing_done = threading.Event()

    def control_loop():
        start.wait()
        while not replacing_done.is_set():
            if (item := buffer.pop()) is not None:
                popped.append(item)
            time.sleep(0)
        popped.extend(drain(buffer))

    def reception():
        start.wait()
        try:
            for first, rows in chunks:
                results.append(buffer.replace_from(rows, first))
                time.sleep(0)
        finally:
            replacing_done.set()

    threads = [threading.Thread(target=control_loop), threading.Thread(target=reception)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    steps = [s for s, _ in popped]
    assert steps == sorted(set(steps)), "a step was executed twice or out of order"
    # Replay the replacements in the order the lock imposed (each result's next_step): a step's action
    # is that of the last replacement that wrote it before it was popped.
    expected: dict[int, np.ndarray] = {}
    for (first, rows), r in zip(chunks, results, strict=True):
        assert r.discarded_stale == min(max(r.next_step - first, 0), len(rows))
        if r.appended:
            start_step = first + r.discarded_stale
            for s in [s for s in expected if s >= start_step]:
                del expected[s]
            expected.update({start_step + i: rows[r.discarded_stale + i] for i in range(r.appended)})
    for step, action in popped:
        np.testing.assert_array_equal(action, expected[step])
