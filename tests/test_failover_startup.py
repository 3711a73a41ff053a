"""A standby's start-up judgement, step-back and heartbeat identity, driven with an in-memory
transport and a fake clock (the real TLS runs: tests/test_failover_tls.py).

The transport here is what made a standby serve beside its primary under TLS via a router: for the
first `route_s` nothing crosses it (no heartbeat, no token, no robot's observation), while a
liveliness query made then would have found nothing."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from lz_testing import wait_for

from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.server.model.failover import (
    HEARTBEAT_PERIOD_S, STARTUP_GRACE_S, TAKEOVER_AFTER_S, Beat, Heartbeats, ServingRole, StartupJudge,
)

APP = AppKey("c", "e", "m", "v", "a")
PERIOD = HEARTBEAT_PERIOD_S


class Bus:
    """Heartbeat keys in memory: a put reaches every other node's subscribers once `routes(node)`."""

    def __init__(self):
        self.subscribers: dict[str, list] = defaultdict(list)  # node -> [(key expression, handler)]
        self.routed: set[str] = set()
        self.pending: list[tuple[str, str, bytes]] = []  # (from node, key, payload)

    def session(self, node: str) -> FakeSession:
        return FakeSession(self, node)

    def deliver(self) -> None:
        """Everything put so far reaches the routed nodes (a node whose link does not route yet
        neither sends nor receives: its puts wait, as Zenoh's would not; none is lost)."""
        keep = []
        for sender, key, payload in self.pending:
            if sender not in self.routed:
                keep.append((sender, key, payload))
                continue
            for node, subs in self.subscribers.items():
                if node != sender and node in self.routed:
                    for expr, handler in subs:
                        if _matches(expr, key):
                            handler(key, payload)
        self.pending = keep


def _matches(expr: str, key: str) -> bool:
    e, k = expr.split("/"), key.split("/")
    return len(e) == len(k) and all(a == "*" or a == b for a, b in zip(e, k))


class FakeSession:
    def __init__(self, bus: Bus, node: str):
        self.bus, self.node = bus, node

    def publisher(self, key, qos):
        bus, node = self.bus, self.node

        class Publisher:
            def put(self, payload, attachment=None):
                bus.pending.append((node, key, payload))

        return Publisher()

    def subscribe(self, key, handler, **kw):
        self.bus.subscribers[self.node].append((key, handler))

        class Subscription:
            def close(self):
                pass

        return Subscription()


class Table:
    def __init__(self):
        self.waiting_now = 0

    def waiting(self, computing=False):
        return self.waiting_now


class Model:
    def __init__(self, role: ServingRole):
        self.app, self.role, self.session_table, self.standby_dropped = APP, role, Table(), 0


class Node:
    """One server's failover parts (its role and heartbeat thread) on the bus, ticked by hand."""

    def __init__(self, bus: Bus, server_id: str, standby_for: str | None = None):
        self.role = ServingRole(f"{server_id}:app", standby_for, incarnation=f"{server_id}-1")
        self.model = Model(self.role)
        self.withdrawn: list[str] = []
        self.beats = Heartbeats(bus.session(server_id), server_id, [self.model],
                                lambda model, why: (self.withdrawn.append(why), model.role.fail()))
        for i, model in enumerate(self.beats.models):  # start() without the thread: ticks come from the test
            self.beats._publishers.append(self.beats.session.publisher(model.app.server_heartbeat(server_id), None))
            self.beats._subscriptions.append(self.beats.session.subscribe(
                model.app.all_server_heartbeats, lambda key, payload, i=i: self.beats._on_beat(i, key, payload)))


def start_up(route_s: float, seconds: float = 6.0, primary_lead_s: float = 1.8, token: bool = True):
    """gpu0 serving `primary_lead_s` before gpu1 starts; gpu1's link routes only `route_s` after its
    start (gpu0's always did). Robots' observations reach gpu1 once it routes, and (`token`) its
    liveliness watcher reports gpu0's token. Returns the nodes and the times at which both served."""
    bus = Bus()
    gpu0, gpu1 = Node(bus, "gpu0"), Node(bus, "gpu1", standby_for="gpu0")
    bus.routed.add("gpu0")
    gpu0.role.start_primary(False, 0.0)
    both_served, t, started = [], -primary_lead_s, False
    while t < seconds:
        if not started and t >= 0:
            gpu1.role.start_standby(t)
            started = True
        if started and t >= route_s:
            if "gpu1" not in bus.routed:
                bus.routed.add("gpu1")
                if token:
                    gpu1.role.on_primary(True)  # its liveliness watcher reports the primary's token now
            gpu1.model.standby_dropped += 3  # robots at 30 Hz: their observations reach it (dropped: standing by)
        bus.deliver()
        gpu0.beats.tick(t)
        if started:
            gpu1.beats.tick(t)
            if gpu1.role.active.is_set() and gpu0.role.active.is_set() and t >= route_s:
                both_served.append(t)  # robots reach both: every observation answered twice
        t = round(t + PERIOD, 6)
    return gpu0, gpu1, both_served


def test_a_standby_whose_transport_routes_late_never_serves_beside_its_primary_20_times():
    """20 start-ups, gpu1's link routing 0-2.5 s after its start (the old rule asked once, at once,
    and took over on an empty answer): it stands by every time, judged on the primary's heartbeat."""
    rng = random.Random(42)
    for run in range(20):
        route_s = rng.uniform(0.0, 2.5)
        gpu0, gpu1, both = start_up(route_s)
        assert both == [], f"run {run} (routes after {route_s:.2f} s): both served at {both[:3]}"
        assert gpu1.role.takeovers == 0 and not gpu1.role.active.is_set() and gpu0.role.active.is_set()
        assert gpu1.role.startup is None  # judged
        assert gpu1.role.startup_judged_s <= route_s + 2 * PERIOD


def test_a_standby_that_judged_after_its_grace_steps_back_within_one_heartbeat_period():
    """A link that routes only after the start-up grace: the standby took over with nothing heard,
    then steps back at the first tick after the primary's serving heartbeat reaches it, counted
    (here its liveliness watcher never reports the token: that report can come before the takeover,
    as it did under TLS via a router, and then nothing else would have stepped it back)."""
    route_s = STARTUP_GRACE_S + 1.0
    gpu0, gpu1, both = start_up(route_s, primary_lead_s=0.5, token=False)
    assert gpu1.role.takeovers == 1 and gpu1.role.stepped_back == 1 and gpu1.role.primary_found_serving == 1
    assert both == []  # stepped back at the first tick that heard it: within one heartbeat period
    assert not gpu1.role.active.is_set() and gpu0.role.active.is_set()


def test_a_standby_without_a_primary_takes_over_once_robots_reach_it_and_the_primary_stays_silent():
    bus = Bus()
    gpu1 = Node(bus, "gpu1", standby_for="gpu0")
    bus.routed.add("gpu1")
    gpu1.role.start_standby(0.0)
    t = 0.0
    while not gpu1.role.active.is_set():
        gpu1.model.standby_dropped += 1  # robots' observations: the transport routes
        gpu1.beats.tick(t)
        t = round(t + PERIOD, 6)
        assert t < STARTUP_GRACE_S
    assert TAKEOVER_AFTER_S <= t <= TAKEOVER_AFTER_S + 2 * PERIOD and gpu1.role.takeovers == 1


def test_the_startup_judge():
    judge = StartupJudge(10.0, grace_s=3.0, quiet_s=1.0)
    assert judge.verdict(10.5, False, None) is None  # nothing known: no judgement
    assert judge.verdict(10.5, True, None) == "standby"
    assert judge.verdict(10.5, False, True) == "standby"
    assert judge.verdict(10.5, False, False).startswith("gone")  # its token vanished
    judge.on_routed(11.0)
    assert judge.verdict(11.9, False, None) is None
    assert "routes" in judge.verdict(12.0, False, None)
    assert "grace" in StartupJudge(10.0, grace_s=3.0).verdict(13.0, False, None)


def test_a_standby_steps_back_only_for_its_serving_primary_not_a_replaced_or_dead_one():
    role = ServingRole("gpu1:app", "gpu0", incarnation="s")
    role.on_primary(False)  # judged already (no start_standby): the token vanished, take over
    assert role.active.is_set()
    role.on_primary_serving()  # a beat still in flight from the dead primary
    assert role.active.is_set() and role.primary_found_serving == 0
    role.on_primary(True)  # back: step back on the token
    assert not role.active.is_set() and role.stepped_back == 1
    role.take_over_stalled("old", "test")
    role.on_primary_serving()  # (Heartbeats never passes the replaced incarnation's beats; the role keeps serving)
    assert role.active.is_set()


def _forged(claimed: str, serving: bool = True, served: int = 0) -> bytes:
    return Beat(claimed, "forged", serving, served, 0, 0.01).encode(1, 1.0)


def test_a_beat_naming_another_server_than_its_key_is_refused_and_counted():
    """gpu2 puts beats claiming `source_id: gpu0` on its own key: refused (identity), so they
    neither keep gpu1 standing by nor count as gpu0's heartbeats."""
    bus = Bus()
    gpu1 = Node(bus, "gpu1", standby_for="gpu0")
    gpu1.role.on_primary(True)  # judged: standing by with gpu0's token there
    key = APP.server_heartbeat("gpu2")
    for k in range(5):
        gpu1.beats._on_beat(0, key, _forged("gpu0", served=k))
    gpu1.beats._on_beat(0, "c/e/m/v/a/server/gpu2/metrics", _forged("gpu2"))  # not a heartbeat key
    gpu1.beats.tick(0.0)
    # (only gpu2's newest beat is read at a tick: one refusal for the five)
    assert gpu1.role.heartbeats_refused_by == {"heartbeat_identity": 1, "heartbeat_key": 1}
    assert not gpu1.beats.heard_primary(0)
    gpu1.beats._on_beat(0, APP.server_heartbeat("gpu0"), _forged("gpu0", served=1))
    gpu1.beats.tick(0.1)
    assert gpu1.beats.heard_primary(0) and gpu1.role.heartbeats_refused == 2


def test_a_flood_of_beats_on_other_keys_crowds_out_none_of_the_primarys():
    """Another server floods its own key (10,000 beats between two ticks) and 100 invented server
    ids put one each: the primary's beat is still read at the next tick, each flood costs one decode,
    and senders beyond MAX_SENDERS are refused, counted."""
    from lerobot_zenoh.server.model.failover import MAX_SENDERS

    bus = Bus()
    gpu1 = Node(bus, "gpu1", standby_for="gpu0")
    gpu1.role.on_primary(True)
    for k in range(10_000):
        gpu1.beats._on_beat(0, APP.server_heartbeat("gpu2"), Beat("gpu2", "x", False, k, 0, 0.01).encode(k, 1.0))
    for n in range(100):
        gpu1.beats._on_beat(0, APP.server_heartbeat(f"fake{n}"), Beat(f"fake{n}", "x", False, 0, 0, 0.01).encode(1, 1.0))
    gpu1.beats._on_beat(0, APP.server_heartbeat("gpu0"), _forged("gpu0", served=7))
    gpu1.beats.tick(0.0)
    assert gpu1.beats.heard_primary(0) and gpu1.beats._watches[0].last.served == 7
    assert gpu1.role.heartbeats_refused_by == {"heartbeat_senders": 100 - (MAX_SENDERS - 1)}
    assert gpu1.beats._peers_s[0]["gpu2"] == 0.0  # gpu2's newest beat was read


@pytest.mark.parametrize("payload, reason", [
    (b"\x00" * 5000, "too_large"), (b"\x81\xa1", "bad_msgpack"),
])
def test_unreadable_beats_are_counted_by_reason(payload, reason):
    bus = Bus()
    gpu1 = Node(bus, "gpu1", standby_for="gpu0")
    gpu1.beats._on_beat(0, APP.server_heartbeat("gpu0"), payload)
    gpu1.beats.tick(0.0)
    assert gpu1.role.heartbeats_refused_by == {reason: 1}


def test_a_woken_primary_waits_to_hear_the_servers_it_heard_before_and_believes_a_late_claim():
    """Frozen past the lease, its link reconnects: the standby's claim arrives 2 s after waking.
    Its answers are held until it hears that standby again (at most RESUME_HOLD_MAX_S), and the
    claim, late, still withdraws it."""
    bus = Bus()
    gpu0, gpu1 = Node(bus, "gpu0"), Node(bus, "gpu1", standby_for="gpu0")
    bus.routed |= {"gpu0", "gpu1"}
    gpu0.role.start_primary(False, 0.0)
    gpu1.role.on_primary(True)
    for t in (0.0, 0.1, 0.2, 0.3):
        bus.deliver()
        gpu0.beats.tick(t)
        gpu1.beats.tick(t)
    gpu0.model.session_table.waiting_now = 1
    gpu1.model.standby_dropped += 1
    bus.pending.clear()  # gpu0 freezes at 0.3: nothing more from it
    t = 0.4
    while not gpu1.role.active.is_set():
        bus.deliver()
        gpu1.beats.tick(t)
        gpu1.model.standby_dropped += 1
        t = round(t + PERIOD, 6)
    assert gpu1.role.replaced == "gpu0/gpu0-1"
    bus.routed.discard("gpu0")  # its link is gone while it is frozen; what gpu1 says waits
    bus.pending.clear()
    gpu0.beats.tick(8.0)  # wakes
    assert not gpu0.role.may_publish(0.2, 8.0) and not gpu0.role.may_publish(8.01, 8.6)  # held: gpu1 not heard
    assert not gpu0.role.may_serve(9.0)
    gpu0.beats.tick(9.5)
    assert not gpu0.role.may_serve(9.5)
    gpu1.beats.tick(9.9)
    bus.routed.add("gpu0")  # reconnected
    bus.deliver()
    gpu0.beats.tick(10.0)  # 2 s after waking: the claim, believed
    assert gpu0.withdrawn and gpu0.role.failed


def test_a_woken_primary_without_peers_serves_after_the_short_hold_but_never_what_arrived_before():
    bus = Bus()
    gpu0 = Node(bus, "gpu0")
    gpu0.role.start_primary(False, 0.0)
    gpu0.beats.tick(0.0)
    gpu0.beats.tick(5.0)  # woke
    gpu0.beats.tick(5.5)
    assert gpu0.role.may_serve(5.55)
    assert not gpu0.role.may_publish(4.99, 5.6)  # arrived before it woke: stale
    assert gpu0.role.may_publish(5.2, 5.6) and gpu0.role.answers_held == 1


def test_an_answer_queued_when_the_process_froze_is_withheld_by_the_publishers_thread():
    """SIGSTOP with one answer inside Zenoh's put and the next in the publisher's queue (both passed
    `may_publish` before the freeze): on waking, the queued one is checked again and withheld."""
    import threading

    from lerobot_zenoh.transport.session import QueuedPublisher

    class Raw:  # Zenoh's publisher: the first put is where the process froze
        def __init__(self):
            self.sent, self.frozen, self.entered = [], threading.Event(), threading.Event()

        def put(self, payload, attachment=None):
            self.entered.set()
            self.frozen.wait(10)
            self.sent.append(payload)

        def undeclare(self):
            pass

    role = ServingRole("gpu0:app", None)
    role.start_primary(False, 0.0)
    role.beat_tick_s = 10.0
    raw = Raw()
    pub = QueuedPublisher(raw, "k", 8)
    try:
        for payload, arrival_s in ((b"first", 9.9), (b"second", 9.95)):
            def valid(a=arrival_s):
                return role.may_publish(a, role.beat_tick_s)

            assert valid()
            pub.put(payload, valid=valid)
        assert raw.entered.wait(5)
        role.beat_tick_s = 20.0
        role.woke(20.0, 20.0)  # the heartbeat thread's first tick after the freeze
        raw.frozen.set()
        assert wait_for(lambda: pub.withheld == 1, 5)
    finally:
        pub.close()
    assert raw.sent == [b"first"] and role.answers_held == 1


def test_the_generated_acl_lets_each_identity_put_on_no_heartbeat_key_but_a_servers_own():
    """The key a beat arrives on is its sender's identity only if nobody else may put there: with
    gpu0, its standby gpu1 and gpu2 serving one app, robots, an engine and a monitor, every put a
    rule grants is checked against every server's heartbeat key (router mesh rules aside: routers
    pass what was checked where it entered)."""
    import zenoh

    from lerobot_zenoh.security.acl import AppGrant, Deployment, access_control

    other = AppKey("c", "e", "m2", "v", "a")  # a second app served by gpu0 only
    servers = ("gpu0", "gpu1", "gpu2")
    acl = access_control(Deployment((AppGrant(APP, ("robA", "robB"), servers, engines=("edge0",)),
                                     AppGrant(other, ("robA",), ("gpu0",))), ("mon",)))
    rules = {r["id"]: r for r in acl["rules"]}
    for policy in acl["policies"]:
        name = policy["subjects"][0].removeprefix("cn/")
        puts = [k for rid in policy["rules"] for k in rules[rid]["key_exprs"]
                if "put" in rules[rid]["messages"] and "ingress" in rules[rid]["flows"]]
        for app in (APP, other):
            for server in (*servers, "gpu9"):
                beat_key = zenoh.KeyExpr(app.server_heartbeat(server))
                allowed = [k for k in puts if zenoh.KeyExpr(k).intersects(beat_key)]
                own = name == server and (app is APP or server == "gpu0")
                assert allowed == ([app.server_heartbeat(server)] if own else []), (name, server, allowed)
