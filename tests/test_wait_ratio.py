"""The wait-ratio scheduler (Kairos Algorithm 1), driven by a fake clock: no sleeps, no I/O."""

from __future__ import annotations

import math

import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol.messages import ExecutionInfo
from lerobot_zenoh.scheduling.request_schedulers import SCHEDULERS, make_scheduler
from lerobot_zenoh.scheduling.wait_ratio import WaitRatioScheduler, round_wait

pytestmark = pytest.mark.core  # the pure serving core: make test-core

DT = 0.1  # a 10 Hz robot keeps the arithmetic readable


def info(buffered=0, **kw):
    return ExecutionInfo(actions_buffered=buffered, control_period_s=DT, **kw)


def serve(s, client, start, end):
    """G = [start, end] for `client`; the scheduler hears about it at `end`."""
    s.on_served([client], end, end - start)


# -- the dominant-side rule (Kairos Fig. 8) ---------------------------------------------------


def test_generation_dominated_round_waits_on_the_generation_side():
    s = WaitRatioScheduler()
    s.on_arrival("a", 0.0, info(0))
    serve(s, "a", 0.0, 0.5)  # G_0 = [0, 0.5], |G_0| = 0.5
    s.on_arrival("a", 0.6, info(2))  # E_0 = [0.5, 0.6 + 2 * 0.1 = 0.8], |E_0| = 0.3 < |G_0|
    serve(s, "a", 1.0, 1.5)  # G_1 starts at 1.0
    assert s.total_wait_s("a") == pytest.approx(1.0 - 0.5)  # G_1.start - G_0.end


def test_execution_dominated_round_waits_on_the_execution_side():
    s = WaitRatioScheduler()
    s.on_arrival("a", 0.0, info(0))
    serve(s, "a", 0.0, 0.2)  # |G_0| = 0.2
    s.on_arrival("a", 1.0, info(5))  # E_0 = [0.2, 1.5], |E_0| = 1.3 > |G_0|
    serve(s, "a", 1.1, 1.3)  # the chunk is there before the robot runs dry
    assert s.total_wait_s("a") == 0.0  # the gap between G_0 and G_1 is not a wait
    s.on_arrival("a", 2.0, info(5))  # E_1 = [1.3, 2.5]
    serve(s, "a", 2.6, 2.8)  # E_2 can start only at 2.8: the robot stood still 0.3 s
    assert s.total_wait_s("a") == pytest.approx(0.3)


def test_round_wait_is_never_negative_and_without_execution_counts_generation():
    assert round_wait((0, 1), None, (3, 4)) == 2
    assert round_wait((0, 1), (1, 5), (2, 3)) == 0  # chunk ready long before the robot needs it
    assert round_wait((0, 1), (1, 5), (5, 7)) == 2


def test_the_execution_interval_starts_when_its_chunk_was_computed():
    # Protocol 1.1 removed phase_elapsed_s (no client sent it): E_j.start is G_j.end.
    s = WaitRatioScheduler()
    s.on_arrival("a", 0.0, info(0))
    serve(s, "a", 0.0, 0.1)
    s.on_arrival("a", 1.0, info(3))  # E_0 = [0.1, 1.3]
    assert s.ranking(["a"], 1.0)[0][2] == pytest.approx(1.2)


def test_bad_reported_durations_are_ignored():
    s = WaitRatioScheduler()
    s.on_arrival("a", 0.0, info(0, task_elapsed_s=float("nan")))
    serve(s, "a", 0.0, 0.1)
    s.on_arrival("a", 0.5, ExecutionInfo(actions_buffered=3, control_period_s=-1.0))
    serve(s, "a", 0.6, 0.7)
    assert s.total_wait_s("a") == pytest.approx(0.5)  # no execution interval: generation side


# -- buckets, longest execution first, aging ---------------------------------------------------


def two_tasks_with_ratios():
    """a: W = 0.1, b: W = 0.7, both started at 0; at t = 1.0 their ratios are 0.1 and 0.7."""
    s = WaitRatioScheduler(buckets=10, aging=1000)
    for c in "ab":
        s.on_arrival(c, 0.0, info(0))
    serve(s, "a", 0.0, 0.1)
    serve(s, "b", 0.1, 0.2)
    s.on_arrival("a", 0.2, info(0))
    s.on_arrival("b", 0.2, info(0))
    serve(s, "a", 0.2, 0.3)  # W_a = 0.2 - 0.1
    serve(s, "b", 0.9, 1.0)  # W_b = 0.9 - 0.2
    s.on_arrival("a", 1.0, info(0))
    s.on_arrival("b", 1.0, info(0))
    return s


def test_requests_are_served_by_wait_ratio_bucket_highest_first():
    s = two_tasks_with_ratios()
    assert s.wait_ratio("a", 1.0) == pytest.approx(0.1)
    assert s.wait_ratio("b", 1.0) == pytest.approx(0.7)
    assert [(c, b) for c, b, _ in s.ranking(["a", "b"], 1.0)] == [("b", 7), ("a", 1)]
    assert s.pick(["a", "b"], 1.0) == ["b"]
    assert s.pick(["a", "b"], 1.0, max_batch=2) == ["b", "a"]


def test_with_one_bucket_longest_execution_decides():
    s = WaitRatioScheduler(buckets=1)
    s.on_arrival("short", 0.0, info(0))
    s.on_arrival("long", 0.0, info(0))
    serve(s, "short", 0.0, 0.1)
    serve(s, "long", 0.0, 0.1)
    s.on_arrival("short", 0.2, info(1))  # |E| = 0.2
    s.on_arrival("long", 0.2, info(9))  # |E| = 1.0
    assert s.pick(["short", "long"], 0.3) == ["long"]


def test_longest_execution_first_inside_a_bucket_scaled_by_skips():
    s = WaitRatioScheduler(aging=1000)  # no bucket promotion: only the (1 + skipped) factor ages
    for c in "ab":
        s.on_arrival(c, 0.0, info(0))
        serve(s, c, 0.0, 0.1)
    s.on_arrival("a", 0.2, info(9))  # |E_a| = 1.0
    s.on_arrival("b", 0.2, info(2))  # |E_b| = 0.3
    order = [s.pick(["a", "b"], 0.3)[0] for _ in range(4)]
    # b's estimate 0.3 x (1 + skipped): 0.3, 0.6, 0.9, 1.2 -> it overtakes a at the fourth pick.
    assert order == ["a", "a", "a", "b"]
    assert s.skipped("b") == 0 and s.skipped("a") == 1


def test_a_request_skipped_A_times_moves_up_a_bucket():
    s = two_tasks_with_ratios()
    s.aging = 2
    buckets = []
    for _ in range(5):
        buckets.append({c: b for c, b, _ in s.ranking(["a", "b"], 1.0)}["a"])
        assert s.pick(["a", "b"], 1.0) == ["b"]
    # a: bucket 1, skipped 0 1 2 3 4 -> +0 +0 +1 +1 +2
    assert buckets == [1, 1, 2, 2, 3]


def test_no_request_starves_behind_a_stream_of_urgent_ones():
    s = WaitRatioScheduler(buckets=10, aging=2, first_request="highest")
    s.on_arrival("slow", 0.0, info(0))
    serve(s, "slow", 0.0, 0.1)
    s.on_arrival("slow", 0.1, info(0))
    serve(s, "slow", 0.1, 0.2)  # W_0 = 0: ratio 0, bucket 0
    s.on_arrival("slow", 0.2, info(0))
    t, served = 0.3, []
    for i in range(40):
        urgent = f"u{i}"  # a fresh task every time, ranked at the top (first_request="highest")
        s.on_arrival(urgent, t, info(0))
        chosen = s.pick(["slow", urgent], t)
        serve(s, chosen[0], t, t + 0.1)
        served.append(chosen[0])
        t += 0.1
        if "slow" in served:
            break
    # promoted one bucket per 2 skips from bucket 0 to 9, then it wins the tie on estimate x (1 + skipped)
    assert "slow" in served and len(served) <= 2 * 9 + 1


# -- the first request of a task -----------------------------------------------------------


def established_and_new(rule):
    """old: ratio 0.35 at t = 2.0 (bucket 3); new: a task that arrives at 2.0."""
    s = WaitRatioScheduler(first_request=rule)
    s.on_arrival("old", 0.0, info(0))
    serve(s, "old", 0.0, 0.1)
    s.on_arrival("old", 0.1, info(0))
    serve(s, "old", 0.8, 0.9)  # W = 0.7
    s.on_arrival("old", 1.9, info(0))
    s.on_arrival("new", 2.0, info(0))
    return s


def test_first_request_rule_highest_puts_new_tasks_first():
    assert established_and_new("highest").pick(["old", "new"], 2.0) == ["new"]


def test_first_request_rule_lowest_puts_new_tasks_last():
    assert established_and_new("lowest").pick(["old", "new"], 2.0) == ["old"]


def test_first_request_rule_mean_ranks_like_the_average_task():
    s = established_and_new("mean")
    ranks = {c: b for c, b, _ in s.ranking(["old", "new"], 2.0)}
    assert ranks == {"old": 3, "new": 3}  # the only task with a ratio is "old"
    s.on_arrival("other", 0.0, info(0))
    serve(s, "other", 0.0, 0.1)
    s.on_arrival("other", 0.1, info(0))
    serve(s, "other", 1.6, 1.7)  # W = 1.5 -> ratio 0.75 at t = 2.0
    ranks = {c: b for c, b, _ in s.ranking(["old", "new", "other"], 2.0)}
    assert ranks == {"old": 3, "new": 5, "other": 7}  # new: mean(0.35, 0.75) = 0.55


def test_the_rule_applies_until_the_task_has_a_recorded_wait():
    s = WaitRatioScheduler(first_request="lowest")
    s.on_arrival("a", 0.0, info(0))
    serve(s, "a", 0.0, 0.1)
    s.on_arrival("a", 0.1, info(0))
    assert s.ranking(["a"], 0.5)[0][1] == 0  # second request: W_0 is unknown until G_1 ends
    serve(s, "a", 0.5, 0.6)
    s.on_arrival("a", 0.6, info(0))
    assert s.ranking(["a"], 0.6)[0][1] == 6  # W_0 = 0.4 over 0.6 s


# -- a multi-task timeline worked out by hand (in the spirit of Kairos Fig. 5) -----------------


def test_hand_worked_timeline_serves_the_task_that_would_stall_first():
    """Three robots, generation 1 s each, one GPU, asynchronous rounds, dt = 0.1 s.

    t=0  A, B, C each send their first request (buffers empty). With first_request="highest" all
         three share the top bucket with the same estimate (no history): FIFO by arrival, A B C.
         G_A = [0, 1], G_B = [1, 2], G_C = [2, 3].
    t=2.5  A asks again with 5 actions left: E_A0 = [1, 3] (2 s, execution-dominated).
    t=2.5  B asks again with 25 actions left: E_B0 = [2, 5] (3 s).
    At t=3 the GPU is free. Neither has a recorded wait, both rank top; B's execution is the longer
    one so Kairos serves B first (it protects long executions from starving): G_B1 = [3, 4]. A is
    skipped once, served next: G_A1 = [4, 5]. A's robot ran dry at 3 and got its chunk at 5:
    W_A0 = 5 - 3 = 2 s. B's chunk came at 4 < 5: W_B0 = 0.
    t=5  C asks with 0 left after its 1-action round: E_C0 = [3, 5], |E| = 2 > |G| = 1.
    t=5  A and B ask again, A with 10 left (E_A1 = [5, 6]), B with 10 left (E_B1 = [4, 6]).
    At t=5: A has ratio 2/5 = 0.4 (bucket 4), B 0/5 (bucket 0), C has no recorded wait (top).
    Order: C (top bucket), then A (bucket 4), then B.
    """
    s = WaitRatioScheduler(first_request="highest", aging=1000)
    for c in "ABC":
        s.on_arrival(c, 0.0, info(0))
    order = []
    for t in (0.0, 1.0, 2.0):
        chosen = s.pick([c for c in "ABC" if c not in order], t)[0]
        order.append(chosen)
        serve(s, chosen, t, t + 1.0)
    assert order == ["A", "B", "C"]

    s.on_arrival("A", 2.5, info(5))
    s.on_arrival("B", 2.5, info(25))
    assert s.pick(["A", "B"], 3.0) == ["B"]
    serve(s, "B", 3.0, 4.0)
    assert s.pick(["A"], 4.0) == ["A"]
    serve(s, "A", 4.0, 5.0)
    assert s.total_wait_s("A") == pytest.approx(2.0)
    assert s.total_wait_s("B") == 0.0

    s.on_arrival("C", 5.0, info(0))
    s.on_arrival("A", 5.0, info(10))
    s.on_arrival("B", 5.0, info(10))
    ranking = s.ranking(["A", "B", "C"], 5.0)
    assert [(c, b) for c, b, _ in ranking] == [("C", 9), ("A", 4), ("B", 0)]


# -- lifecycle, clients without execution info, configuration ----------------------------------


def test_a_new_episode_starts_a_new_task():
    s = WaitRatioScheduler()
    s.on_arrival("a", 0.0, info(0))
    serve(s, "a", 0.0, 0.1)
    s.on_arrival("a", 0.1, info(0))
    serve(s, "a", 0.5, 0.6)
    assert s.total_wait_s("a") == pytest.approx(0.4)
    s.forget("a")  # the server's session does this when the client's episode_id changes
    s.on_arrival("a", 1.0, info(0, task_elapsed_s=0.0))
    assert s.total_wait_s("a") == 0.0 and s.wait_ratio("a", 2.0) == 0.0


def test_clients_without_execution_info_are_still_served_and_forget_drops_them():
    s = WaitRatioScheduler()
    assert s.pick(["x", "y"], 0.0) == ["x"]  # never announced: treated as arriving now
    serve(s, "x", 0.0, 0.1)
    s.on_arrival("x", 0.3)
    serve(s, "x", 0.3, 0.4)
    assert s.total_wait_s("x") == pytest.approx(0.2)
    s.forget("x")
    assert s.stats()["tasks"] == 1 and s.pick([], 1.0) == []


@pytest.mark.parametrize("kwargs, field", [
    ({"buckets": 0}, "wait_ratio.buckets"),
    ({"aging": 0}, "wait_ratio.aging"),
    ({"first_request": "oldest"}, "wait_ratio.first_request"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        WaitRatioScheduler(**kwargs)


def test_registered_for_the_manifest():
    assert "wait_ratio" in SCHEDULERS
    assert make_scheduler("wait_ratio").name == "wait_ratio"


# -- Algorithm 1 read literally, as an independent reference ----------------------------------


class Algorithm1:
    """Kairos Algorithm 1, phases 1, 2 and the skip update, written from the paper over recorded
    histories (lists of G and E intervals), for one edge server. Two readings the paper leaves open
    are the implementation's documented ones: aging promotes floor(s/A) buckets (the text; the
    pseudo-code's ceil jumps two at s = A + 1), and ties go to the oldest request, then the client id.
    A task with no recorded W has sum(W) = 0 (bucket 0) and, with no E yet, |E_last| = 0."""

    def __init__(self, buckets, aging, dt):
        self.B, self.A, self.dt = buckets, aging, dt
        self.tasks = {}

    def arrive(self, c, t, buffered):
        task = self.tasks.setdefault(c, {"start": t, "G": [], "E": [], "skipped": 0, "since": None})
        if task["since"] is None:
            task["since"] = t
        if task["G"]:  # the request for round j+1 tells E_j (a newer one for the same round refines it)
            g_end = task["G"][-1][1]
            e = (g_end, max(g_end, t + buffered * self.dt))
            j = len(task["G"]) - 1
            task["E"] = task["E"][:j] + [e]

    def waits(self, task):
        G, E = task["G"], task["E"]
        total = 0.0
        for j in range(len(G) - 1):
            e = E[j] if j < len(E) else None
            if e is None or G[j][1] - G[j][0] >= e[1] - e[0]:
                total += max(0.0, G[j + 1][0] - G[j][1])
            else:  # E_{j+1}.start = max(E_j.end, G_{j+1}.end)
                total += max(0.0, max(e[1], G[j + 1][1]) - e[1])
        return total

    def pick(self, ready, now, max_batch):
        rows = []
        for c in ready:
            task = self.tasks[c]
            w = self.waits(task) / (now - task["start"]) if now > task["start"] else 0.0
            b = min(self.B - 1, math.floor(w * self.B))
            s = task["skipped"]
            if s >= self.A:
                b = min(self.B - 1, b + s // self.A)
            e_last = task["E"][-1] if task["E"] else None
            estimate = (e_last[1] - e_last[0] if e_last else 0.0) * (1 + s)
            rows.append((-b, -estimate, task["since"], c))
        order = [r[3] for r in sorted(rows)]
        chosen = order[:max_batch]
        for c in ready:
            self.tasks[c]["skipped"] = 0 if c in chosen else self.tasks[c]["skipped"] + 1
        return chosen

    def served(self, clients, start, end):
        for c in clients:
            task = self.tasks[c]
            task["G"].append((start, end))
            task["since"] = None


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_batch", [1, 3])
def test_configured_literally_it_takes_algorithm_1s_decisions(seed, max_batch):
    """Random multi-task timelines on a fake clock: every dispatch of the scheduler with
    ``first_request="literal"`` equals the reference's (arrivals, superseding resends, new tasks)."""
    import random

    rng = random.Random(seed)
    buckets, aging = rng.choice([(10, 2), (5, 1), (10, 4), (3, 1000)])
    s = WaitRatioScheduler(buckets=buckets, aging=aging, first_request="literal")
    ref = Algorithm1(buckets, aging, DT)
    clients = [f"c{i}" for i in range(rng.randint(3, 7))]
    next_arrival = {c: rng.uniform(0, 2) for c in clients}
    pending: set[str] = set()
    t, decisions = 0.0, 0
    while decisions < 80:
        for c in clients:
            if next_arrival[c] <= t:
                buffered = rng.randint(0, 30)
                s.on_arrival(c, next_arrival[c], info(buffered))
                ref.arrive(c, next_arrival[c], buffered)
                pending.add(c)
                # a client whose request waits may send a newer observation that supersedes it
                next_arrival[c] = next_arrival[c] + rng.uniform(0.1, 1.0) if rng.random() < 0.2 else math.inf
        if not pending:
            t = min(next_arrival.values())
            continue
        ready = sorted(pending)
        chosen = s.pick(ready, t, max_batch)
        assert chosen == ref.pick(ready, t, max_batch), (decisions, t)
        decisions += 1
        gen = 0.3 + 0.1 * len(chosen)
        s.on_served(chosen, t + gen, gen)
        ref.served(chosen, t, t + gen)
        t += gen
        for c in chosen:
            pending.discard(c)
            if rng.random() < 0.08:  # the client's episode ends: its next request starts a new task
                s.forget(c)
                del ref.tasks[c]
            next_arrival[c] = t + rng.uniform(0.0, 2.0)


def test_literal_first_request_goes_after_running_tasks_of_its_bucket():
    s = WaitRatioScheduler(first_request="literal", aging=1000)
    s.on_arrival("old", 0.0, info(0))
    serve(s, "old", 0.0, 0.1)
    s.on_arrival("old", 0.1, info(5))  # E_0 = [0.1, 0.6]: estimate 0.5
    s.on_arrival("new", 0.05, info(0))  # older request, but no recorded E: estimate 0
    assert [(c, b, e) for c, b, e in s.ranking(["new", "old"], 0.2)] == [("old", 0, pytest.approx(0.5)),
                                                                         ("new", 0, 0.0)]
    # "lowest" ranks the same bucket but estimates a new task's execution as the fleet's mean
    s2 = WaitRatioScheduler(first_request="lowest", aging=1000)
    for c, t, b in (("old", 0.0, 0),):
        s2.on_arrival(c, t, info(b))
    serve(s2, "old", 0.0, 0.1)
    s2.on_arrival("old", 0.1, info(5))
    s2.on_arrival("new", 0.05, info(0))
    assert s2.pick(["new", "old"], 0.2) == ["new"]  # same estimate, older request
