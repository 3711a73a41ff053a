"""The edge scheduler's failure machine without the network: a fake transport, a fake clock.

`Dispatcher` runs here exactly as in the server, but its link to the engines is an in-memory fake
(`FakeLink`: what it publishes is kept, statuses are scripted) and its clock is a number the test
moves, so timeouts, restarts, forged statuses and forged answers are tested in milliseconds.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import numpy as np
import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol import codec, dispatch
from lerobot_zenoh.protocol.dispatch import EngineAnswer, EngineKeys, EngineRequest, EngineStatus
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.scheduling.engine_load import EngineLoad
from lerobot_zenoh.scheduling.placement import BatchProfile, profile_from_peer_ms
from lerobot_zenoh.server.dispatch.dispatcher import Dispatcher
from lerobot_zenoh.server.dispatch.engine_link import ENGINE_ERROR
from lerobot_zenoh.server.model.failover import ServingRole
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.engine.request_table import InFlight, RequestTable
from lerobot_zenoh.server.config.runner_loading import load_runner
from lerobot_zenoh.server.shell.policy_server import ServedModel

pytestmark = pytest.mark.core

APP = AppKey("c1", "e1", "m1", "v1", "a1")
CAMS = {"front": (16, 24)}
TIMEOUT_S = 0.5


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class FakePublisher:
    def __init__(self, link, key):
        self.link, self.key = link, key

    def put(self, payload: bytes, attachment=None) -> None:
        self.link.sent[self.key].append(payload)


class FakeLink:
    """The transport seam in memory: publishes are kept per key, answers are handed to the
    subscribed callback, status queries answered from `statuses`."""

    def __init__(self):
        self.sent = defaultdict(list)
        self.handlers = {}
        self.statuses: dict[str, bytes | None] = {}

    def publisher(self, key, qos):
        return FakePublisher(self, key)

    def subscribe(self, key, handler, **kw):
        self.handlers[key] = handler

    def watch_liveliness(self, key, on_change):
        self.handlers[("token", key)] = on_change

    def query(self, key, timeout_s=1.0, parameters=None):
        payload = self.statuses.get(key)
        return [(key, payload)] if payload is not None else []

    def requests(self, engine_id: str) -> list[EngineRequest]:
        """Every request dispatched to `engine_id` so far (taken: a later call returns only newer ones)."""
        key = EngineKeys(APP, engine_id).dispatch
        out = [dispatch.decode(p) for p in self.sent[key]]
        self.sent[key].clear()
        return out

    def answer(self, engine_id: str, payload: bytes) -> None:
        self.handlers[EngineKeys(APP, engine_id).answer](EngineKeys(APP, engine_id).answer, payload)


class FakeHost:
    def __init__(self):
        self.published: list[tuple[str, object]] = []
        self.rejected: list[tuple[str, str, bool]] = []

    def reject(self, model, session, reason, detail, *, cool_down=True):
        model.session_table.reject(session, reason, 0.0, cool_down=cool_down)
        self.rejected.append((session.client_id, reason, cool_down))

    def publish(self, model, client_id, payload, *, valid=None):
        if valid is None or valid():  # (the publisher's thread asks again, `failover.answer_check`)
            self.published.append((client_id, codec.decode_action_chunk(payload)))

    def wake(self):
        pass

    def local_executor(self, model):
        raise AssertionError("no local engine here")

    def measure_profile(self, model):
        return {}


def make_manifest(engines, profile=None):
    return parse_manifest({
        "cluster_uuid": APP.cluster, "experiment_tag": APP.experiment, "server_id": "edge0", "telemetry_period_s": 0,
        "zenoh": {"listen": ["tcp/127.0.0.1:7999"], "multicast_scouting": False},
        "server": [{"model_id": APP.model, "model_version": APP.version, "application_tag": APP.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": CAMS, "latency_ms": 1},
                    "accept_unknown_clients": True, "max_batch_size": 4, "actions_per_chunk": 10,
                    "engines": engines,
                    "dispatch": {"answer_timeout_s": TIMEOUT_S, "probe_period_s": 0.1, "probes_lost": 2,
                                 "start_timeout_s": 1.0}}],
    })


def status(engine_id="cloud0", incarnation="eng-1", profile_ms=None, capacity=4):
    return EngineStatus(engine_id, incarnation, APP.model, APP.version, "synthetic", 6, 20, capacity,
                        profile_ms if profile_ms is not None else {1: 50.0, 4: 60.0})


class Edge:
    """One edge scheduler process: its served model, its dispatcher over the fake link."""

    def __init__(self, link: FakeLink, clock: FakeClock, incarnation: str, engines=None):
        engines = engines or [{"engine_id": "cloud0", "tier": "cloud", "capacity": 4, "profile": "measured"}]
        manifest = make_manifest(engines)
        entry = manifest.server[0]
        self.host = FakeHost()
        self.clock = clock
        self.link = link
        self.model = ServedModel(manifest, entry, load_runner(manifest, entry), "edge0", runs_on=lambda model: Dispatcher(
            self.host, model, link, clock=clock, edge_incarnation=incarnation))
        self.dispatcher = self.model.dispatcher
        self.dispatcher.start(threads=False)

    def send(self, client_id: str, seq_id: int, nonce: int = 7) -> None:
        rng = np.random.default_rng(seq_id)
        jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8)) for n, hw in CAMS.items()}
        payload = codec.encode(Observation(seq_id, client_id, rng.normal(size=6).astype(np.float32), jpegs, "task",
                                           session_nonce=nonce))
        assert self.model.session_table.admit(client_id, payload, self.clock(), None, None) is None

    def round(self) -> bool:
        self.dispatcher.inbox.drain()
        return self.dispatcher.round()

    def figures(self) -> dict:
        return self.dispatcher.figures(fresh=True)

    def close(self) -> None:
        self.dispatcher.stop(1.0)
        self.model.adapter.close()


def answer_to(request: EngineRequest, *, engine_id="cloud0", incarnation="eng-1", **changes) -> bytes:
    fields = dict(request_id=request.request_id, engine_id=engine_id, incarnation=incarnation, model_id=APP.model,
                  model_version=APP.version, edge_incarnation=request.edge_incarnation, client_id=request.client_id,
                  seq_id=request.seq_id, session_nonce=request.session_nonce,
                  actions=np.full((20, 6), request.seq_id, np.float32), inference_ms=50.0, queue_ms=0.0)
    return dispatch.encode(EngineAnswer(**(fields | changes)))


@pytest.fixture
def link():
    link = FakeLink()
    link.statuses[EngineKeys(APP, "cloud0").status] = dispatch.encode(status())
    return link


@pytest.fixture
def clock():
    return FakeClock()


def test_after_an_edge_restart_an_answer_reaches_only_the_request_it_was_computed_for(link, clock):
    first = Edge(link, clock, "edge-A")
    first.send("robot_3", 10)
    first.send("robot_4", 20)
    assert first.round()
    old = {r.client_id: r for r in link.requests("cloud0")}
    assert {r.request_id for r in old.values()} == {1, 2}
    first.close()  # the edge process dies; the cloud engine still holds its requests

    edge = Edge(link, clock, "edge-B")  # restarted: request ids count from 1 again
    edge.send("robot_4", 1, nonce=8)
    assert edge.round()
    edge.send("robot_3", 1, nonce=9)
    assert edge.round()
    new = {r.client_id: r for r in link.requests("cloud0")}
    assert new["robot_4"].request_id == old["robot_3"].request_id  # the same id, another robot
    for request in old.values():  # the old process' answers
        link.answer("cloud0", answer_to(request))
    edge.round()
    assert edge.host.published == []
    assert edge.figures()["engine.cloud0.refused.stale_incarnation"] == 2

    # Forged: this process' incarnation and a live request id, but another client's seq or nonce
    # (each read before the next arrives: while one answer to a request waits, another is dropped).
    for forged in (answer_to(new["robot_4"], client_id="robot_3", seq_id=1, session_nonce=9),
                   answer_to(new["robot_4"], session_nonce=1234), answer_to(new["robot_4"], engine_id="cloud0", seq_id=2)):
        link.answer("cloud0", forged)
        edge.round()
    assert edge.host.published == []
    assert edge.figures()["engine.cloud0.refused.mismatched"] == 3

    for request in new.values():
        link.answer("cloud0", answer_to(request))
    edge.round()
    assert sorted((c, chunk.response_to_seq_id) for c, chunk in edge.host.published) == [("robot_3", 1), ("robot_4", 1)]
    assert all(float(chunk.actions[0, 0]) == chunk.response_to_seq_id for _, chunk in edge.host.published)
    link.answer("cloud0", answer_to(new["robot_3"]))  # a replay of a delivered answer
    edge.round()
    assert len(edge.host.published) == 2 and edge.figures()["engine.cloud0.late"] == 1
    edge.close()


def test_an_engine_answer_is_held_like_a_local_one_when_the_edge_may_not_serve(link, clock):
    """An edge woken from a freeze (or replaced by its standby meanwhile) publishes no answer its
    engines computed before, as its own inference thread holds its own (`ServingRole.may_serve`)."""
    edge = Edge(link, clock, "edge-A")
    edge.model.role = ServingRole(APP.prefix, None)
    edge.model.role.active.set()
    edge.send("robot_1", 1)
    assert edge.round()
    (request,) = link.requests("cloud0")
    edge.model.role.hold_until_s = time.monotonic() + 600  # woken from a freeze: answers held
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert edge.host.published == [] and edge.model.role.answers_held == 1
    edge.model.role.hold_until_s = 0.0
    edge.send("robot_1", 2)
    assert edge.round()
    (request,) = link.requests("cloud0")
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert [chunk.response_to_seq_id for _, chunk in edge.host.published] == [2]
    edge.close()


@pytest.mark.parametrize("profile_ms, capacity", [
    ({1: math.nan}, 4), ({1: -5.0}, 4), ({1: math.inf}, 4), ({0: 5.0}, 4), ({1: 100.0, 8: 1.0}, 4),
    ({i: 10.0 + i for i in range(1, 100)}, 4), ({1: 10.0}, 0), ({1: 1e9}, 4),
])
def test_a_forged_status_refuses_that_engine_and_the_loop_goes_on(link, clock, profile_ms, capacity):
    edge = Edge(link, clock, "edge-A")
    key = EngineKeys(APP, "cloud0").status
    link.statuses[key] = dispatch.encode(status(incarnation="forged-2", profile_ms=profile_ms, capacity=capacity))
    edge.dispatcher._event(("probe", "cloud0", edge.dispatcher.probers[0].probe(0.1)))
    edge.send("robot_1", 1)
    assert not edge.round()  # no exception; nothing placed on the refused engine
    state = edge.dispatcher.engines["cloud0"]
    assert not state.up and state.down_reason == "bad_status"
    assert edge.figures()["engine.cloud0.refused.bad_status"] == 1
    link.statuses[key] = dispatch.encode(status())  # the real engine answers again
    clock.advance(0.1)
    edge.dispatcher._event(("probe", "cloud0", edge.dispatcher.probers[0].probe(0.1)))
    assert edge.round()  # back, and the waiting request goes to it
    edge.close()


def test_profiles_from_a_peer_are_validated():
    assert profile_from_peer_ms({1: 50.0, 4: 60.0}) == BatchProfile.from_ms({1: 50.0, 4: 60.0})
    for bad in ({}, {1: math.nan}, {1: 0.0}, {True: 5.0}, {1: "5"}, {5000: 1.0}, {1: 100.0, 2: 60.0, 3: 40.0}):
        with pytest.raises(ValueError):
            profile_from_peer_ms(bad)


def test_error_answers_are_bounded_reasons_and_never_cool_a_robot_down(link, clock):
    edge = Edge(link, clock, "edge-A")
    for seq in range(1, 41):
        edge.send("robot_1", seq)
        assert edge.round()
        (request,) = link.requests("cloud0")
        error = "x" * 60_000 if seq % 2 else "bad_jpeg"
        link.answer("cloud0", answer_to(request, error=error, actions=None, detail="d" * 60_000))
        edge.round()
        clock.advance(0.01)
    figures = edge.figures()
    assert figures[f"engine.cloud0.errors.{ENGINE_ERROR}"] == 20 and figures["engine.cloud0.errors.bad_jpeg"] == 20
    assert not any(k.startswith("engine.cloud0.errors.x") for k in figures)
    assert {(reason, cool) for _, reason, cool in edge.host.rejected} == {(ENGINE_ERROR, False), ("bad_jpeg", False)}
    assert not edge.model.session_table.rate_limit.blocked("robot_1", clock())
    edge.send("robot_1", 41)  # still admitted and served
    assert edge.round()
    edge.close()


def test_a_request_that_timed_out_never_goes_back_to_its_engine_while_it_is_suspect(link, clock):
    edge = Edge(link, clock, "edge-A")
    edge.send("robot_1", 1)
    edge.send("robot_2", 1)
    assert edge.round()
    assert len(link.requests("cloud0")) == 2  # the engine went silent
    clock.advance(TIMEOUT_S + 0.01)
    assert not edge.round()  # re-queued; the engine is suspect: nothing goes back to it
    state = edge.dispatcher.engines["cloud0"]
    assert state.suspect_since_s is not None and edge.figures()["engine.cloud0.requeued.timeout"] == 2
    for _ in range(5):
        clock.advance(0.05)
        edge.dispatcher._event(("probe", "cloud0", edge.dispatcher.probers[0].probe(0.1)))
        assert not edge.round() and link.requests("cloud0") == []  # probes sent too soon after do not count
    clock.advance(TIMEOUT_S)
    edge.dispatcher._event(("probe", "cloud0", edge.dispatcher.probers[0].probe(0.1)))
    assert edge.round()
    (request,) = link.requests("cloud0")  # on probation: one request at a time
    assert not edge.round()
    link.answer("cloud0", answer_to(request))
    assert edge.round()  # it answers again: no longer suspect, the other one goes too
    assert len(link.requests("cloud0")) == 1 and not state.probation
    edge.close()


def test_lost_probes_take_an_engine_down_and_its_requests_back(link, clock):
    edge = Edge(link, clock, "edge-A")
    edge.send("robot_1", 1)
    assert edge.round()
    link.statuses[EngineKeys(APP, "cloud0").status] = None  # stopped: probes go unanswered
    for n in range(2):
        clock.advance(0.1)
        edge.dispatcher._event(("probe", "cloud0", edge.dispatcher.probers[0].probe(0.1)))
        edge.round()
    state = edge.dispatcher.engines["cloud0"]
    assert not state.up and state.down_reason == "partition"
    assert edge.figures()["engine.cloud0.requeued.partition"] == 1 and len(edge.dispatcher.table) == 0
    edge.close()


def test_an_engine_restart_requeues_and_its_old_answers_are_late(link, clock):
    edge = Edge(link, clock, "edge-A")
    edge.send("robot_1", 1)
    assert edge.round()
    (old,) = link.requests("cloud0")
    link.statuses[EngineKeys(APP, "cloud0").status] = dispatch.encode(status(incarnation="eng-2"))
    edge.dispatcher._event(("probe", "cloud0", edge.dispatcher.probers[0].probe(0.1)))
    assert edge.round()  # re-queued at the restart and placed again at once
    (new,) = link.requests("cloud0")
    assert new.request_id != old.request_id and new.seq_id == old.seq_id
    link.answer("cloud0", answer_to(old))
    edge.round()
    assert edge.host.published == [] and edge.figures()["engine.cloud0.late"] == 1
    link.answer("cloud0", answer_to(new, incarnation="eng-2"))
    edge.round()
    assert [c for c, _ in edge.host.published] == ["robot_1"]
    edge.close()


def test_an_answer_flood_is_dropped_unread_and_the_real_answer_still_gets_through(link, clock):
    """Answers are screened by their header in the Zenoh callback (nothing decoded): only one naming
    a request of this process in flight on the engine it came from is queued, one per request; every
    other is dropped and counted by reason, so no flood fills the queue before the real answer."""
    edge = Edge(link, clock, "edge-A")
    edge.send("robot_1", 1)
    assert edge.round()
    (request,) = link.requests("cloud0")
    big = answer_to(request, actions=np.zeros((20, 6), np.float32), detail="d" * (edge.dispatcher.max_bytes + 10))
    link.answer("cloud0", big)
    floods = {
        "refused.unknown_request": answer_to(request, request_id=999),  # an id this process never sent
        "refused.stale_incarnation": answer_to(request, edge_incarnation="edge-Z"),
        "refused.wrong_type": answer_to(request, engine_id="cloud1"),  # not the engine of its key
        "refused.bad_header": answer_to(request)[:20],  # truncated before its request id
    }
    for payload in floods.values():
        for _ in range(1000):
            link.answer("cloud0", payload)
    for junk in (b"", b"\xc1", b"\x91" * 5000, bytes(range(256)) * 10):
        link.answer("cloud0", junk)
    figures = edge.figures()
    assert edge.dispatcher.inbox._queue.qsize() == 0
    assert figures["engine.cloud0.refused.too_large"] == 1 and figures["engine.cloud0.answers_dropped_full"] == 0
    assert {k: figures[f"engine.cloud0.{k}"] for k in floods} == {
        **dict.fromkeys(floods, 1000), "refused.bad_header": 1004}
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert [c for c, _ in edge.host.published] == ["robot_1"]
    link.answer("cloud0", answer_to(request))  # answered: a replay is late
    assert edge.figures()["engine.cloud0.late"] == 1 and edge.dispatcher.inbox._queue.qsize() == 0
    edge.close()


def test_one_answer_per_request_waits_so_a_flood_naming_a_live_request_holds_one_place(link, clock):
    """An answer naming a real request in flight is queued, and while it waits every other answer
    to that request is dropped (`refused.duplicate`): at most as many answers wait as requests are
    in flight, whatever is sent. A forged one read first is refused (`mismatched`), and the real one
    sent after it is served."""
    edge = Edge(link, clock, "edge-A")
    edge.send("robot_1", 1)
    edge.send("robot_2", 1)
    assert edge.round()
    requests = {r.client_id: r for r in link.requests("cloud0")}
    forged = answer_to(requests["robot_1"], seq_id=77)
    for _ in range(500):
        link.answer("cloud0", forged)
    link.answer("cloud0", answer_to(requests["robot_2"]))
    inbox = edge.dispatcher.inbox
    assert inbox._queue.qsize() == 2 == len(edge.dispatcher.table)
    assert edge.figures()["engine.cloud0.refused.duplicate"] == 499
    edge.round()
    assert [c for c, _ in edge.host.published] == ["robot_2"]
    assert edge.figures()["engine.cloud0.refused.mismatched"] == 1 and not inbox._waiting
    link.answer("cloud0", answer_to(requests["robot_1"]))
    edge.round()
    assert sorted(c for c, _ in edge.host.published) == ["robot_1", "robot_2"]
    edge.close()


def test_estimates_are_corrected_by_answers_and_track_what_is_measured(link, clock):
    """A cloud engine that batches what reached it: the placement estimate stays within 25 % of the
    dispatch-to-answer time (it used to grow by a batch latency per dispatch)."""
    profile = BatchProfile.from_ms({1: 50.0, 4: 60.0})
    one_way_s = 0.01
    edge = Edge(link, clock, "edge-A", engines=[
        {"engine_id": "cloud0", "tier": "cloud", "capacity": 4, "profile": {1: 50.0, 4: 60.0}, "max_in_flight": 8}])
    edge.dispatcher.engines["cloud0"].rtt_s = 2 * one_way_s
    robots = [f"robot_{i}" for i in range(6)]
    seq = dict.fromkeys(robots, 0)
    next_send = dict.fromkeys(robots, clock())
    inbox, running, answers = [], None, []  # engine: (arrival, request); (done at, requests); (arrival, payload)
    end = clock() + 20.0
    while clock() < end:
        now = clock()
        for r in robots:
            if next_send[r] is not None and now >= next_send[r]:
                seq[r] += 1
                edge.send(r, seq[r])
                next_send[r] = None
        edge.round()
        inbox += [(now + one_way_s, q) for q in link.requests("cloud0")]
        if running is not None and now >= running[0]:
            answers += [(now + one_way_s, answer_to(q)) for q in running[1]]
            running = None
        if running is None:
            arrived = [q for t, q in inbox if t <= now][:4]
            if arrived:
                inbox = [(t, q) for t, q in inbox if q not in arrived]
                running = (now + profile.latency_s(len(arrived)), arrived)
        for t, payload in [a for a in answers if a[0] <= now]:
            link.answer("cloud0", payload)
        answers = [a for a in answers if a[0] > now]
        for client, chunk in edge.host.published:
            if next_send[client] is None:
                next_send[client] = now + 0.03  # the robot asks again 30 ms after its chunk
        edge.host.published.clear()
        clock.advance(0.001)
    figures = edge.figures()
    estimate, actual = figures["engine.cloud0.estimate_ms_mean"], figures["engine.cloud0.actual_ms_mean"]
    print(f"estimate {estimate:.1f} ms, actual {actual:.1f} ms, answered {figures['engine.cloud0.answered']}")
    assert figures["engine.cloud0.answered"] > 500
    assert abs(estimate - actual) <= 0.25 * actual
    edge.close()


def test_engine_load_forgets_what_is_withdrawn_and_resets():
    load = EngineLoad(BatchProfile({1: 0.1}), capacity=1)
    load.dispatched(["a", "b"], sent_s=0.0, arrival_s=0.0)
    assert load.running == 2 and load.busy_until_s == pytest.approx(0.2)  # (one group larger than capacity: runs alone)
    assert load.withdrawn("a") and not load.withdrawn("a")
    assert load.busy_until_s == pytest.approx(0.1)
    assert not load.answered("zzz", 5.0) and load.running == 1
    with pytest.raises(ValueError):
        load.dispatched(["b"], 0.0, 0.0)
    load.reset()
    assert load.running == 0 and load.busy_until_s == 0.0


def test_the_request_table_matches_on_every_field():
    table = RequestTable("inc-1")
    table.add(InFlight(table.next_id(), "cloud0", type("S", (), {"client_id": "r1"})(), None, 5, 9, 0.0))
    assert table.match("cloud0", 1, "inc-0", "r1", 5, 9) == (None, "stale_incarnation")
    assert table.match("cloud0", 2, "inc-1", "r1", 5, 9) == (None, "late")
    for wrong in (("cloud1", 1, "inc-1", "r1", 5, 9), ("cloud0", 1, "inc-1", "r2", 5, 9),
                  ("cloud0", 1, "inc-1", "r1", 6, 9), ("cloud0", 1, "inc-1", "r1", 5, None)):
        assert table.match(*wrong) == (None, "mismatched")
    flight, why = table.match("cloud0", 1, "inc-1", "r1", 5, 9)
    assert why == "matched" and flight.seq_id == 5 and len(table) == 0


def test_engines_on_an_iteration_level_runner_fail_at_start_naming_the_field(link, clock):
    from dataclasses import replace

    manifest = make_manifest([{"engine_id": "cloud0", "tier": "cloud", "capacity": 4, "profile": "measured"}])
    entry = manifest.server[0]
    runner = load_runner(manifest, entry)
    runner.spec = replace(runner.spec, capabilities=replace(runner.spec.capabilities, iteration_level=True))
    model = ServedModel(manifest, entry, runner, "edge0")
    with pytest.raises(ConfigError, match=r"server\[m1\]\.engines"):
        Dispatcher(FakeHost(), model, link, clock=clock).start(threads=False)
    model.adapter.close()


def test_an_older_engines_answer_is_told_apart_by_its_version(link, clock):
    """An engine of protocol 1.4 (before the request binding was required) is refused and counted
    as `unsupported_version`, whether or not its answer happens to carry the binding fields."""
    import msgpack

    edge = Edge(link, clock, "edge-A")
    edge.send("robot_1", 1)
    assert edge.round()
    (request,) = link.requests("cloud0")
    raw = msgpack.unpackb(answer_to(request), raw=False) | {"protocol_version": [1, 4]}
    link.answer("cloud0", msgpack.packb(raw, use_bin_type=True))
    edge.round()
    assert edge.host.published == [] and edge.figures()["engine.cloud0.refused.unsupported_version"] == 1
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert [c for c, _ in edge.host.published] == ["robot_1"]
    edge.close()


class DeferringHost(FakeHost):
    """A host whose publishes wait in a queue, as a robot's queued publisher holds them for its thread
    (`flush` is that thread: it asks each answer's `valid` just before handing the bytes on)."""

    def __init__(self):
        super().__init__()
        self.queued: list[tuple[str, bytes, object]] = []
        self.withheld = 0

    def publish(self, model, client_id, payload, *, valid=None):
        self.queued.append((client_id, payload, valid))

    def flush(self) -> None:
        queued, self.queued = self.queued, []
        for client_id, payload, valid in queued:
            if valid is not None and not valid():
                self.withheld += 1
            else:
                self.published.append((client_id, codec.decode_action_chunk(payload)))


class HeartbeatLink(FakeLink):
    """The heartbeats' own fake link (their subscriptions are closed with them)."""

    def subscribe(self, key, handler, **kw):
        super().subscribe(key, handler, **kw)
        return self

    def close(self) -> None:
        pass


def frozen_edge(link, clock, host=None):
    """An edge scheduler serving as a primary, with its heartbeat thread's ticks driven by hand on the fake clock."""
    from lerobot_zenoh.server.model.failover import Heartbeats

    edge = Edge(link, clock, "edge-A")
    if host is not None:
        edge.host = edge.dispatcher.host = edge.dispatcher.relay.host = host
    edge.model.role = ServingRole(APP.prefix, None)
    edge.model.role.start_primary(False, 0.0)
    beats = Heartbeats(HeartbeatLink(), "edge0", [edge.model], withdraw=lambda model, why: None, period_s=3600).start()
    beats.tick(clock())
    return edge, beats


def test_an_engine_answer_to_an_observation_from_before_a_freeze_is_never_relayed(link, clock):
    """SIGSTOP while an engine computes: on waking (no other server heard before, so the short hold
    only), the engine's answer to the observation that arrived before the freeze is stale, as a local
    answer would be: held and counted, its request closed; the robot's next observation is served."""
    from lerobot_zenoh.server.model.failover import RESUME_HOLD_S, TAKEOVER_AFTER_S

    edge, beats = frozen_edge(link, clock)
    role = edge.model.role
    edge.send("robot_1", 1)
    assert edge.round()
    (request,) = link.requests("cloud0")
    clock.advance(TAKEOVER_AFTER_S + 1.0)  # frozen: not even the heartbeat thread ran
    beats.tick(clock())  # woke
    clock.advance(RESUME_HOLD_S)
    beats.tick(clock())  # the hold is over: it may serve again, but never what arrived before
    assert role.may_serve(clock())
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert edge.host.published == [] and role.answers_held == 1
    assert len(edge.dispatcher.table) == 0 and edge.model.session_table.sessions["robot_1"].computing is None
    clock.advance(0.01)
    edge.send("robot_1", 2)  # arrived after the freeze: served
    assert edge.round()
    (request,) = link.requests("cloud0")
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert [chunk.response_to_seq_id for _, chunk in edge.host.published] == [2] and role.answers_held == 1
    beats.close()
    edge.close()


def test_a_relayed_answer_queued_when_the_edge_froze_is_withheld_by_the_publishers_thread(link, clock):
    """The relay let an answer out before the freeze, into the robot's publisher queue; on waking, the
    publisher's thread asks again, as it does for a local answer, and withholds it."""
    from lerobot_zenoh.server.model.failover import RESUME_HOLD_S, TAKEOVER_AFTER_S

    host = DeferringHost()
    edge, beats = frozen_edge(link, clock, host)
    role = edge.model.role
    edge.send("robot_1", 1)
    assert edge.round()
    (request,) = link.requests("cloud0")
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert len(host.queued) == 1  # passed the relay's check; waits for the publisher's thread
    clock.advance(TAKEOVER_AFTER_S + 1.0)
    beats.tick(clock())
    clock.advance(RESUME_HOLD_S)
    beats.tick(clock())
    host.flush()
    assert host.published == [] and host.withheld == 1 and role.answers_held == 1
    beats.close()
    edge.close()


def test_an_edge_held_after_a_freeze_places_nothing_until_its_hold_ends(link, clock):
    """As the local path schedules nothing while held (or standing by), an edge scheduler places no
    request on its engines then: an observation that arrives during the hold waits in its slot and is
    placed, and answered, once the hold ends, instead of being computed and its answer dropped."""
    from lerobot_zenoh.server.model.failover import RESUME_HOLD_S, TAKEOVER_AFTER_S

    edge, beats = frozen_edge(link, clock)
    role = edge.model.role
    clock.advance(TAKEOVER_AFTER_S + 1.0)
    beats.tick(clock())  # woke: held
    assert not role.may_serve(clock())
    clock.advance(0.01)
    edge.send("robot_1", 1)  # arrived after the freeze, during the hold
    assert not edge.round() and link.requests("cloud0") == []
    clock.advance(RESUME_HOLD_S)
    beats.tick(clock())
    assert role.may_serve(clock()) and edge.round()
    (request,) = link.requests("cloud0")
    link.answer("cloud0", answer_to(request))
    edge.round()
    assert [chunk.response_to_seq_id for _, chunk in edge.host.published] == [1] and role.answers_held == 0
    beats.close()
    edge.close()
