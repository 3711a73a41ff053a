"""Hybrid placement (Kairos Algorithm 1, phase 3): the pure rule with fake numbers, and BatchProfile."""

from __future__ import annotations

import math

import pytest

from lerobot_zenoh.scheduling.placement import (
    CLOUD,
    EDGE,
    BatchProfile,
    EngineView,
    Placement,
    RequestView,
    expected_busy_until_s,
    place,
    service_estimate_s,
)

pytestmark = pytest.mark.core  # the pure serving core: make test-core

# An edge GPU at 100 ms for a batch of 1 .. 140 ms for 4; a cloud GPU twice as fast.
EDGE_PROFILE = BatchProfile({1: 0.100, 2: 0.110, 4: 0.140})
CLOUD_PROFILE = EDGE_PROFILE.scaled(0.5)


def edge(engine_id="edge", capacity=4, running=0, busy_until_s=0.0, profile=EDGE_PROFILE, **kw):
    return EngineView(engine_id, EDGE, capacity, running, busy_until_s, profile, **kw)


def cloud(engine_id="cloud", capacity=4, running=0, busy_until_s=0.0, rtt_s=0.1, bandwidth_bps=125e6,
          profile=CLOUD_PROFILE, **kw):
    return EngineView(engine_id, CLOUD, capacity, running, busy_until_s, profile, rtt_s=rtt_s,
                      bandwidth_bps=bandwidth_bps, **kw)


def reqs(n, payload=100_000, history=0, prefix="r"):
    return [RequestView(f"{prefix}{i}", payload, history) for i in range(n)]


def everyone(p: Placement) -> list:
    return [r for ids in p.assigned.values() for r in ids] + list(p.waiting)


# -- BatchProfile --------------------------------------------------------------------------------


def test_profile_interpolates_between_points_and_extrapolates_on_the_last_slope():
    p = BatchProfile({1: 0.060, 4: 0.072, 8: 0.100})
    assert p.latency_s(1) == 0.060
    assert p.latency_s(2) == pytest.approx(0.064)
    assert p.latency_s(4) == 0.072
    assert p.latency_s(6) == pytest.approx(0.086)
    assert p.latency_s(16) == pytest.approx(0.100 + 8 * 0.007)


def test_profile_below_the_smallest_point_and_with_one_point():
    assert BatchProfile({2: 0.05, 4: 0.08}).latency_s(1) == 0.05  # a smaller batch is never slower
    one = BatchProfile({1: 0.05})
    assert one.latency_s(1) == 0.05
    assert one.latency_s(3) == pytest.approx(0.15)  # no batching gain assumed past what was measured
    assert BatchProfile.constant(0.03).latency_s(8) == pytest.approx(0.03)


def test_profile_from_what_max_batch_size_auto_measures():
    # server/batch_profiling.measure_batch_profile returns {batch size: seconds}, smallest first
    measured = {1: 0.060, 2: 0.064, 4: 0.072, 8: 0.100, 16: 0.200}
    p = BatchProfile(measured)
    assert p.points == measured
    assert p.saturation_batch_size() == 8
    assert BatchProfile.from_ms({1: 60, 16: 200}) == BatchProfile({1: 0.06, 16: 0.2})
    assert p.scaled(2).latency_s(8) == pytest.approx(0.2)


@pytest.mark.parametrize("points", [{}, {0: 0.1}, {1: -0.1}, {1: math.nan}, {1: math.inf}, {1.5: 0.1}])
def test_profile_refuses_bad_points(points):
    with pytest.raises(ValueError):
        BatchProfile(points)


def test_profile_refuses_batch_size_zero():
    with pytest.raises(ValueError):
        EDGE_PROFILE.latency_s(0)


# -- EngineView / RequestView -------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "field"), [
    (dict(tier="fog"), "tier"), (dict(capacity=0), "capacity"), (dict(running=-1), "running"),
    (dict(rtt_s=-0.1), "rtt_s"), (dict(bandwidth_bps=0.0), "bandwidth_bps"), (dict(max_in_flight=-1), "max_in_flight"),
])
def test_engine_view_refuses_bad_numbers_naming_the_field(kw, field):
    base = dict(engine_id="e", tier=EDGE, capacity=2, running=0, busy_until_s=0.0, profile=EDGE_PROFILE)
    with pytest.raises(ValueError, match=field):
        EngineView(**{**base, **kw})


def test_service_estimate_of_an_idle_engine_is_rtt_plus_transfer_plus_batch_latency():
    c = cloud(rtt_s=0.1, bandwidth_bps=1e6)
    assert service_estimate_s(c, 2, 50_000, now_s=10.0) == pytest.approx(0.1 + 0.05 + CLOUD_PROFILE.latency_s(2))


def test_service_estimate_waits_for_a_busy_engine():
    c = cloud(rtt_s=0.1, bandwidth_bps=math.inf, running=4, busy_until_s=10.3)
    # the bytes are there at 10.05, the engine is free at 10.3: start then, answer 50 ms after its batch
    assert service_estimate_s(c, 1, 0, now_s=10.0) == pytest.approx(0.3 + 0.05 + 0.05)


# -- the rule -----------------------------------------------------------------------------------


def test_empty_inputs():
    assert place([], [edge(), cloud()], 0.0) == Placement({}, [], {})
    p = place(reqs(3), [], 0.0)
    assert p.assigned == {} and p.waiting == ["r0", "r1", "r2"]
    assert all(e.engine_id is None and e.latency_s == math.inf and e.edge_delay_s == math.inf
               for e in p.estimates.values())


def test_fills_the_idle_edge_first_in_order():
    p = place(reqs(3), [edge(capacity=4), cloud()], 0.0)
    assert p.assigned == {"edge": ["r0", "r1", "r2"]}
    assert p.waiting == []
    assert p.estimates["r2"] == ("edge", pytest.approx(EDGE_PROFILE.latency_s(3)), pytest.approx(EDGE_PROFILE.latency_s(3)))


def test_the_cloud_takes_what_the_edge_cannot_when_waiting_would_be_slower():
    # edge full with r0..r3 (answers at 140 ms), r4 would wait 140 ms + 100 ms = 240 ms at the edge;
    # the cloud answers in 100 ms RTT + 0.8 ms transfer + 50 ms = 151 ms: offloaded
    p = place(reqs(6), [edge(capacity=4), cloud()], 0.0)
    assert p.assigned["edge"] == ["r0", "r1", "r2", "r3"]
    assert p.assigned["cloud"] == ["r4", "r5"]
    engine, est, edge_delay = p.estimates["r4"]
    assert engine == "cloud"
    assert est == pytest.approx(0.1 + 100_000 / 125e6 + 0.05)
    assert edge_delay == pytest.approx(0.140 + 0.100)
    assert p.estimates["r5"].latency_s == pytest.approx(0.1 + 100_000 / 125e6 + CLOUD_PROFILE.latency_s(2))
    assert p.estimates["r5"].edge_delay_s == pytest.approx(0.140 + 0.100)  # r4 left: r5 is first in the edge queue


def test_no_offload_when_the_wan_makes_the_cloud_slower_than_the_edge_queue():
    p = place(reqs(6), [edge(capacity=4), cloud(rtt_s=0.3)], 0.0)
    assert p.assigned == {"edge": ["r0", "r1", "r2", "r3"]}
    assert p.waiting == ["r4", "r5"]
    assert p.estimates["r4"] == ("cloud", pytest.approx(0.3 + 0.0008 + 0.05), pytest.approx(0.24))


def test_the_edge_queue_deepens_so_later_requests_do_offload():
    # a 250 ms RTT: the first waiting request's edge delay (240 ms) beats the cloud (300.8 ms); the queue
    # behind it grows (batch 2 at the edge: 250 ms ... then the next batch: 140 + 140 + 100 ms = 380 ms)
    p = place(reqs(9), [edge(capacity=4), cloud(rtt_s=0.25)], 0.0)
    assert p.waiting[:4] == ["r4", "r5", "r6", "r7"]
    assert p.assigned["cloud"] == ["r8"]
    assert p.estimates["r8"].edge_delay_s == pytest.approx(0.140 + 0.140 + 0.100)


def test_a_busy_edge_counts_its_remaining_work_in_the_queueing_delay():
    busy = edge(capacity=2, running=2, busy_until_s=10.5)
    p = place(reqs(1), [busy, cloud()], 10.0)
    assert p.assigned == {"cloud": ["r0"]}  # 0.5 s + 0.1 s at the edge against 0.15 s in the cloud
    assert p.estimates["r0"].edge_delay_s == pytest.approx(0.6)
    nearly_done = edge(capacity=2, running=2, busy_until_s=10.01)
    assert place(reqs(1), [nearly_done, cloud()], 10.0).waiting == ["r0"]  # 110 ms at the edge wins


def test_cloud_capacity_is_respected_including_requests_in_flight():
    p = place(reqs(12), [edge(capacity=4), cloud(capacity=4, running=1, busy_until_s=0.02)], 0.0)
    assert len(p.assigned["cloud"]) == 3
    assert p.waiting == ["r7", "r8", "r9", "r10", "r11"]
    full = place(reqs(6), [edge(capacity=4), cloud(capacity=2, running=2, busy_until_s=1.0)], 0.0)
    assert "cloud" not in full.assigned
    assert full.estimates["r4"].engine_id is None  # no cloud engine had room


def test_max_in_flight_lets_a_busy_cloud_queue_a_next_batch():
    busy = cloud(capacity=2, running=2, busy_until_s=0.06, max_in_flight=4)
    p = place(reqs(8), [edge(capacity=4), busy], 0.0)
    assert p.assigned["cloud"] == ["r4", "r5"]
    assert p.estimates["r4"].latency_s == pytest.approx(0.06 + 0.05 + 0.05)  # starts when the engine frees


def test_history_bytes_are_counted_in_the_transfer():
    slow_link = dict(rtt_s=0.1, bandwidth_bps=1e6)  # 1 MB/s
    light = place(reqs(5, payload=20_000), [edge(capacity=4), cloud(**slow_link)], 0.0)
    assert light.assigned["cloud"] == ["r4"]  # 100 + 20 + 50 ms < 240 ms
    heavy = place(reqs(5, payload=20_000, history=80_000), [edge(capacity=4), cloud(**slow_link)], 0.0)
    assert heavy.waiting == ["r4"]  # 100 + 100 + 50 ms > 240 ms
    assert heavy.estimates["r4"].latency_s == pytest.approx(0.1 + 0.1 + 0.05)


def test_shorter_rtt_and_more_bandwidth_offload_more():
    def offloaded(rtt_s, bandwidth_bps):
        engines = [edge(capacity=4), cloud(capacity=8, rtt_s=rtt_s, bandwidth_bps=bandwidth_bps)]
        return len(place(reqs(14, payload=200_000), engines, 0.0).assigned.get("cloud", []))

    rtts, bandwidths = (0.025, 0.1, 0.15, 0.2, 0.3, 0.5), (12.5e6, 25e6, 125e6)  # 100 Mbit/s .. 1 Gbit/s
    grid = {(r, b): offloaded(r, b) for r in rtts for b in bandwidths}
    for b in bandwidths:
        assert [grid[r, b] for r in rtts] == sorted((grid[r, b] for r in rtts), reverse=True)
    for r in rtts:
        assert [grid[r, b] for b in bandwidths] == sorted(grid[r, b] for b in bandwidths)
    assert grid[0.025, 125e6] == 8  # the cloud's capacity
    assert grid[0.15, 12.5e6] == 7 < grid[0.15, 125e6]  # 16 ms of transfer at 100 Mbit/s tips the 8th
    assert grid[0.5, 125e6] < grid[0.2, 125e6] < 8


def test_a_tie_stays_at_the_edge():
    # edge: r1 waits for r0's batch (100 ms) and runs in 100 ms; cloud: 100 ms RTT + 100 ms
    e = edge(capacity=1, profile=BatchProfile({1: 0.1, 2: 0.11}))
    c = cloud(rtt_s=0.1, bandwidth_bps=math.inf, profile=BatchProfile({1: 0.1}))
    p = place(reqs(2, payload=0), [e, c], 0.0)
    assert p.estimates["r1"] == ("cloud", pytest.approx(0.2), pytest.approx(0.2))
    assert p.waiting == ["r1"]  # equal: the edge keeps it


def test_equal_cloud_engines_tie_to_the_one_listed_first_and_the_faster_one_wins():
    engines = [edge(capacity=1), cloud("c1", capacity=1), cloud("c2", capacity=1)]
    p = place(reqs(3), engines, 0.0)
    assert p.assigned == {"edge": ["r0"], "c1": ["r1"], "c2": ["r2"]}
    faster = [edge(capacity=1), cloud("c1", capacity=1), cloud("c2", capacity=1, rtt_s=0.05)]
    assert place(reqs(2), faster, 0.0).assigned == {"edge": ["r0"], "c2": ["r1"]}


def test_several_idle_edge_engines_spread_the_batch():
    p = place(reqs(4), [edge("e1", capacity=4), edge("e2", capacity=4)], 0.0)
    assert p.assigned == {"e1": ["r0", "r2"], "e2": ["r1", "r3"]}


def test_a_busy_edge_engine_is_not_fed_and_the_idle_one_is():
    p = place(reqs(3), [edge("e1", capacity=4, running=1, busy_until_s=0.5), edge("e2", capacity=2)], 0.0)
    assert p.assigned == {"e2": ["r0", "r1"]}
    assert p.waiting == ["r2"]
    # r2 waits for e2's batch (110 ms) rather than busy e1 (500 ms): 110 + 100 ms
    assert p.estimates["r2"].edge_delay_s == pytest.approx(0.21)


def test_cloud_only_sends_everything_the_cloud_has_room_for():
    p = place(reqs(6), [cloud(capacity=4)], 0.0)
    assert p.assigned == {"cloud": ["r0", "r1", "r2", "r3"]}
    assert p.waiting == ["r4", "r5"]
    assert p.estimates["r0"].edge_delay_s == math.inf


def test_every_request_is_placed_once_and_order_is_kept():
    engines = [edge("e1", capacity=3), edge("e2", capacity=2, running=2, busy_until_s=0.2), cloud(capacity=5)]
    ordered = reqs(20)
    p = place(ordered, engines, 0.0)
    placed = everyone(p)
    assert sorted(placed) == sorted(r.request_id for r in ordered)
    assert set(p.estimates) == set(placed)
    rank = {r.request_id: i for i, r in enumerate(ordered)}
    for ids in [*p.assigned.values(), p.waiting]:
        assert ids == sorted(ids, key=rank.get)
    assert p.tier_of("r0", engines) == EDGE
    assert p.tier_of(p.waiting[0], engines) is None


def test_duplicate_ids_are_refused():
    with pytest.raises(ValueError, match="engine id"):
        place(reqs(1), [edge("e"), cloud("e")], 0.0)
    with pytest.raises(ValueError, match="request id"):
        place([RequestView("a", 1), RequestView("a", 1)], [edge()], 0.0)


def test_expected_busy_until_batches_what_reached_the_engine():
    p = BatchProfile({1: 0.1, 2: 0.12, 4: 0.16})
    assert expected_busy_until_s([], 3.0, p, 4) == 3.0  # nothing in flight: free since then
    # two groups there before it frees at 1.0 run together (2 requests: 120 ms); a later one after
    assert expected_busy_until_s([(0.5, 1), (0.9, 1), (1.5, 1)], 1.0, p, 4) == pytest.approx(1.6)
    # capacity 2: the third group waits for the next batch even though it has arrived
    assert expected_busy_until_s([(0.1, 1), (0.1, 1), (0.1, 1)], 0.0, p, 2) == pytest.approx(0.1 + 0.12 + 0.1)
    # a group larger than the capacity runs alone (as sent)
    assert expected_busy_until_s([(0.0, 6)], 0.0, p, 4) == pytest.approx(p.latency_s(6))
