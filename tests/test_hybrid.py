"""The edge scheduler dispatching to engines, over real Zenoh on loopback (docs/server.md, "Engines").

Engine processes are `PolicyServer`s with `role: engine` (in this process, each with its own Zenoh
session and port) loading the same synthetic policy; misbehaving engines (silent, late, wrong model)
are `FakeEngine`s speaking the engine protocol (`protocol/dispatch.py`) on their own session.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol import codec, dispatch
from lerobot_zenoh.protocol.dispatch import EngineAnswer, EngineKeys, EngineRequest, EngineStatus
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import ACTION_QOS, OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import free_port_range, wait_for

CAMS = {"front": (32, 48)}
SYN = {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": CAMS}


def manifest(app_key, port, *, engines=(), dispatch_settings=None, role="server", engine_id=None,
             latency_ms=40.0, batch_latency_ms=None, action_dim=6, connect=()):
    entry = {"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
             "synthetic": {**SYN, "action_dim": action_dim, "latency_ms": latency_ms,
                           **({"batch_latency_ms": batch_latency_ms} if batch_latency_ms else {})},
             "accept_unknown_clients": True, "max_batch_size": 4, "actions_per_chunk": 10}
    if engines:
        entry["engines"] = list(engines)
        entry["dispatch"] = {"answer_timeout_s": 0.5, "probe_period_s": 0.1, "probes_lost": 2,
                             "start_timeout_s": 3.0, **(dispatch_settings or {})}
    data = {"cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": f"s{port}",
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "connect": [f"tcp/127.0.0.1:{p}" for p in connect],
                      "multicast_scouting": False},
            "server": [entry], "telemetry_period_s": 0}
    if role == "engine":
        data |= {"role": "engine", "engine_id": engine_id}
    return parse_manifest(data)


LOCAL = {"engine_id": "local", "tier": "edge", "capacity": 1, "local": True, "profile": {1: 40}}


def cloud(engine_id, port, **kw):
    return {"engine_id": engine_id, "tier": "cloud", "capacity": 4, "endpoint": f"tcp/127.0.0.1:{port}",
            "profile": "measured", **kw}


class Robot:
    """The wire side of a robot: publishes observations, collects the chunks answering them."""

    def __init__(self, session: ZenohSession, app_key, client_id: str, rng):
        self.key = app_key.client(client_id)
        self.client_id = client_id
        self.rng = rng
        self.chunks: list = []
        session.subscribe(self.key.action, lambda k, b: self.chunks.append(codec.decode_action_chunk(b)))
        self.pub = session.publisher(self.key.obs, OBSERVATION_QOS)

    def send(self, seq_id: int) -> None:
        jpegs = {n: codec.encode_jpeg(self.rng.integers(0, 255, (*hw, 3), dtype=np.uint8)) for n, hw in CAMS.items()}
        self.pub.put(codec.encode(Observation(seq_id, self.client_id, self.rng.normal(size=6).astype(np.float32),
                                              jpegs, "task")))

    def answered(self, seq_id: int) -> bool:
        return any(c.response_to_seq_id == seq_id for c in self.chunks)

    def serve(self, seq_id: int, timeout_s: float = 10.0) -> bool:
        """Send `seq_id` (again, as best-effort observations may be lost) until a chunk answers it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.send(seq_id)
            if wait_for(lambda: self.answered(seq_id), 1.0):
                return True
        return False


def run_rounds(robots, rounds: int, timeout_s: float = 15.0, first: int = 1) -> None:
    """Every robot asks `rounds` times (seq_ids from `first`), all at once each round, each waiting
    for its chunk."""
    errors = []

    def one(robot):
        for seq in range(first, first + rounds):
            if not robot.serve(seq, timeout_s):
                errors.append((robot.client_id, seq))
                return

    threads = [threading.Thread(target=one, args=(r,)) for r in robots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"unanswered: {errors}"


class FakeEngine:
    """An engine process speaking the protocol, misbehaving on request: `mode` is "ok" (answers like a
    synthetic engine), "silent" (never answers a dispatch), "late" (answers after `delay_s`),
    "wrong_model" (answers as model version v-other); `paused` stops every answer, probes included
    (a partition); "wrong_shape" answers 7 action columns for the model's 6."""

    def __init__(self, app_key, port: int, engine_id: str, mode: str = "ok", delay_s: float = 0.0):
        self.keys = EngineKeys(app_key, engine_id)
        self.app_key = app_key
        self.mode = mode
        self.delay_s = delay_s
        self.paused = False
        self.received: list[EngineRequest] = []
        self.log: list[tuple[float, int]] = []  # (arrival, request_id) of every dispatch received
        self.status = EngineStatus(engine_id, "fake-1", app_key.model, app_key.version, "synthetic", 6, 20, 4,
                                   {1: 20.0, 4: 25.0})
        self.session = ZenohSession(loopback_settings(port)).open()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.pub = self.session.publisher(self.keys.answer, ACTION_QOS)
        self.session.subscribe(self.keys.dispatch, self._on_dispatch)
        self.session.serve(self.keys.status, lambda: None if self.paused else dispatch.encode(self.status))
        self.session.declare_token(self.keys.token)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_dispatch(self, key, payload) -> None:
        now = time.monotonic()
        self.log.append((now, dispatch.decode(payload).request_id))
        self._inbox.put((now, payload))

    def _run(self):
        pending = []
        while not self._stop.is_set():
            try:
                pending.append(self._inbox.get(timeout=0.02))
            except queue.Empty:
                pass
            now = time.monotonic()
            due = [p for p in pending if now - p[0] >= self.delay_s]
            pending = [p for p in pending if now - p[0] < self.delay_s]
            for arrived, payload in due:
                request = dispatch.decode(payload)
                self.received.append(request)
                if self.paused or self.mode == "silent":
                    continue
                version = "v-other" if self.mode == "wrong_model" else self.app_key.version
                shape = (20, 7) if self.mode == "wrong_shape" else (20, 6)
                self.pub.put(dispatch.encode(EngineAnswer(
                    request.request_id, self.keys.engine_id, self.status.incarnation, self.app_key.model, version,
                    request.edge_incarnation, request.client_id, request.seq_id, request.session_nonce,
                    actions=np.zeros(shape, np.float32), inference_ms=20.0,
                    queue_ms=max(0.0, (time.monotonic() - arrived) * 1000 - 20.0))))  # (held: it says so)

    def close(self):
        self._stop.set()
        self._thread.join()
        self.session.close()


@pytest.fixture
def ports():
    base = free_port_range(6)
    return [base + i for i in range(6)]


@pytest.fixture
def robot_session(ports):
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(ports[0],))).open()
    yield session
    session.close()


def engine_figures(server) -> dict:
    model = server.models[0]
    return model.dispatcher.figures(fresh=True)


def test_dispatch_to_engine_process(app_key, ports, robot_session):
    """Requests go to the local engine and to an engine process; each chunk says which served it;
    the engine process subscribes only to its own dispatch key."""
    engine = PolicyServer(manifest(app_key, ports[1], role="engine", engine_id="cloud0", latency_ms=30)).start()
    edge = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud0", ports[1])])).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(3)]
        run_rounds(robots, 4)
        chunks = [c for r in robots for c in r.chunks]
        assert {(c.engine_id, c.tier) for c in chunks} == {("local", "edge"), ("cloud0", "cloud")}
        assert all(c.server_id == edge.server_id for c in chunks)  # relayed: the robot's server stays the edge
        assert all(c.actions.shape == (10, 6) for c in chunks)
        figures = engine_figures(edge)
        assert figures["engine.cloud0.answered"] >= 1 and figures["engine.cloud0.rtt_ms"] > 0
        assert figures["engine.cloud0.queue_actual_ms_mean"] > 0  # at least the trip out to the engine
        assert 0 < figures["offload_share"] < 1
        # the engine process never subscribed to a robot key
        subscribed = [s.key for s in engine._worker._session._owned if hasattr(s, "key") and hasattr(s, "_on_sample")]
        assert subscribed and all("/engine/cloud0" in k for k in subscribed), subscribed
        _, per_client = edge.telemetry_figures(edge.models[0])
        assert all("served.edge" in f and "served.cloud" in f for f in per_client.values())
    finally:
        edge.stop()
        engine.stop()


def test_a_site_of_engine_processes_behind_one_scheduler(app_key, ports, robot_session):
    """No local engine: two engine processes of the edge tier (one per GPU of a site) share the robots."""
    engines = [PolicyServer(manifest(app_key, ports[1 + i], role="engine", engine_id=f"gpu{i}", latency_ms=40)).start()
               for i in range(2)]
    edge = PolicyServer(manifest(app_key, ports[0], engines=[
        {"engine_id": f"gpu{i}", "tier": "edge", "capacity": 2, "endpoint": f"tcp/127.0.0.1:{ports[1 + i]}",
         "profile": "measured"} for i in range(2)])).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(4)]
        run_rounds(robots, 3)
        assert {c.engine_id for r in robots for c in r.chunks} == {"gpu0", "gpu1"}
        assert {c.tier for r in robots for c in r.chunks} == {"edge"}
    finally:
        edge.stop()
        for engine in engines:
            engine.stop()


def test_queueing_delay_telemetry_is_admission_to_the_start_of_the_batch(app_key, ports, robot_session):
    """Four robots at once on a local engine of capacity 1 (40 ms a pass): they are served one after
    another, so the later ones wait behind 1, 2, 3 passes. `queue_actual_ms_mean` is that wait
    (admission -> start of the batch that served it), beside placement's expectation at the decision
    (`queue_estimate_ms_mean`, never later than the start); `actual_ms_mean` stays dispatch -> answer."""
    edge = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL])).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(4)]
        run_rounds(robots, 2)
        # (a robot has its chunk before the loop hears that the local engine's batch ended)
        assert wait_for(lambda: engine_figures(edge)["engine.local.answered"] >= 8, 5.0), engine_figures(edge)
        figures = engine_figures(edge)
        waited, expected = figures["engine.local.queue_actual_ms_mean"], figures["engine.local.queue_estimate_ms_mean"]
        assert waited > 15.0, figures  # 0, 40, 80, 120 ms behind the passes before: about 60 on average
        assert 0.0 < expected <= waited, figures
        assert figures["engine.local.actual_ms_mean"] >= 35.0  # one pass: dispatch -> answer
    finally:
        edge.stop()


def test_dead_engine_requests_requeued_and_served_at_the_edge(app_key, ports, robot_session):
    fake = FakeEngine(app_key, ports[1], "cloud0", mode="silent")
    edge = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud0", ports[1])])).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(3)]
        run_rounds(robots, 3)
        assert fake.received, "nothing was offloaded"
        figures = engine_figures(edge)
        assert figures["engine.cloud0.requeued"] >= 1
        assert figures["engine.cloud0.answered"] == 0
        assert all(c.engine_id == "local" for r in robots for c in r.chunks)
    finally:
        edge.stop()
        fake.close()


@pytest.mark.parametrize("max_in_flight, most", [(0, 2), (4, 4)])
def test_a_cloud_engine_holds_its_max_in_flight_and_no_more(app_key, ports, robot_session, max_in_flight, most):
    """A cloud engine of capacity 2 that answers after 0.6 s, six robots at once behind a slow edge:
    by default (Kairos) it holds one batch, 2 requests; with `max_in_flight: 4` a second batch is sent
    to wait in its inbox while the first runs, and never more than 4."""
    fake = FakeEngine(app_key, ports[1], "cloud0", mode="late", delay_s=0.6)
    # The edge is slower than the cloud's answer (2 s a pass against 0.6 s), so the cloud is the first
    # choice of every request whatever the machine's load does to the measured round trip and to when
    # the six requests arrive (at 40 ms, then at 400 ms, a loaded run let the edge start some of them
    # first, and the cloud got fewer than its limit).
    slow_edge = {**LOCAL, "profile": {1: 2000}}
    edge = PolicyServer(manifest(app_key, ports[0], engines=[slow_edge, cloud("cloud0", ports[1], capacity=2,
                                                                              max_in_flight=max_in_flight)],
                                 latency_ms=2000.0, dispatch_settings={"answer_timeout_s": 3.0})).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(6)]
        run_rounds(robots, 1)  # every robot's key is known to the edge (and answered)
        seen = len(fake.log)
        for robot in robots:
            robot.send(2)
        assert wait_for(lambda: len(fake.log) >= seen + most, 5.0), engine_figures(edge)
        first = fake.log[seen][0]
        time.sleep(0.5 - (time.monotonic() - first))  # (the subject: nothing more is sent before an answer)
        before_answer = [t for t, _ in fake.log[seen:] if t - first < 0.5]
        assert len(before_answer) == most, (len(before_answer), most)
        run_rounds(robots, 1, first=2)  # and everyone is answered
    finally:
        edge.stop()
        fake.close()


def test_a_cloud_engine_with_room_in_flight_takes_a_request_at_once_past_one_batch(app_key, ports, robot_session):
    """Cloud only, capacity 2, `max_in_flight: 4`, answers after 0.8 s. Two robots fill one batch;
    two more arriving while it runs go at once, to wait in the engine's inbox. (The scheduler's
    loop once skipped placement while a cloud engine held `capacity` requests: they waited for the
    first answers, 146 ms a request in the hybrid benchmark's cloud-only runs.)"""
    fake = FakeEngine(app_key, ports[1], "cloud0", mode="late", delay_s=0.8)
    edge = PolicyServer(manifest(app_key, ports[0], engines=[cloud("cloud0", ports[1], capacity=2, max_in_flight=4)],
                                 dispatch_settings={"answer_timeout_s": 3.0})).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(4)]
        run_rounds(robots, 1)  # every robot's key is known to the edge (and answered)
        seen = len(fake.log)
        for robot in robots[:2]:
            robot.send(2)
        assert wait_for(lambda: len(fake.log) >= seen + 2, 5.0), engine_figures(edge)
        first = fake.log[seen][0]
        for robot in robots[2:]:
            robot.send(2)
        assert wait_for(lambda: len(fake.log) >= seen + 4, 5.0), engine_figures(edge)
        late = [t - first for t, _ in fake.log[seen + 2:seen + 4]]
        assert max(late) < 0.6, late  # before any answer of the first batch (0.8 s)
        run_rounds(robots, 1, first=2)
    finally:
        edge.stop()
        fake.close()


def test_late_answer_of_a_requeued_request_is_dropped(app_key, ports, robot_session):
    """An engine answering after the bound: its request was re-queued and served at the edge; the
    late answer is counted and dropped, so each request gets exactly one chunk."""
    fake = FakeEngine(app_key, ports[1], "cloud0", mode="late", delay_s=0.8)
    edge = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud0", ports[1])],
                                 dispatch_settings={"answer_timeout_s": 0.4})).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(3)]
        run_rounds(robots, 3)
        assert wait_for(lambda: engine_figures(edge)["engine.cloud0.late"] >= 1, 5.0)
        time.sleep(0.5)  # let any further late answer land
        for robot in robots:
            per_seq = Counter(c.response_to_seq_id for c in robot.chunks)
            assert set(per_seq.values()) == {1}, (robot.client_id, per_seq)
        assert engine_figures(edge)["engine.cloud0.requeued"] >= 1
    finally:
        edge.stop()
        fake.close()


@pytest.mark.parametrize("mode", ["wrong_model", "wrong_shape"])
def test_wrong_model_answer_refused_never_served(app_key, ports, robot_session, mode):
    fake = FakeEngine(app_key, ports[1], "cloud0", mode=mode)
    edge = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud0", ports[1])])).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(3)]
        run_rounds(robots, 3)
        assert fake.received
        figures = engine_figures(edge)
        assert figures[f"engine.cloud0.refused.{mode}"] >= 1
        assert all(c.engine_id == "local" for r in robots for c in r.chunks)
        assert all(c.actions.shape == (10, 6) for r in robots for c in r.chunks)
    finally:
        edge.stop()
        fake.close()


def test_partition_degrades_to_edge_only_and_offload_resumes(app_key, ports, robot_session):
    fake = FakeEngine(app_key, ports[1], "cloud0", mode="ok")
    edge = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud0", ports[1])])).start()
    try:
        robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(3)]
        run_rounds(robots, 2)
        state = edge.models[0].dispatcher.engines["cloud0"]
        assert state.up
        fake.paused = True  # no probe, no answer: a partition
        assert wait_for(lambda: not state.up, 3.0), "partition never detected"
        assert state.down_reason == "partition"
        before = len(fake.received)
        for r in robots:
            r.chunks.clear()
        run_rounds(robots, 2, first=3)
        assert len(fake.received) == before  # nothing placed on a partitioned engine
        assert all(c.engine_id == "local" for r in robots for c in r.chunks)
        fake.paused = False
        assert wait_for(lambda: state.up, 3.0), "never back"
        for r in robots:
            r.chunks.clear()
        run_rounds(robots, 3, first=5)
        assert any(c.engine_id == "cloud0" for r in robots for c in r.chunks), "offload did not resume"
        assert engine_figures(edge)["engine.cloud0.partitions"] >= 1
    finally:
        edge.stop()
        fake.close()


def test_restarted_engine_is_reprofiled(app_key, ports, robot_session):
    engine = PolicyServer(manifest(app_key, ports[1], role="engine", engine_id="cloud0",
                                   batch_latency_ms={1: 20, 4: 30})).start()
    edge = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud0", ports[1])])).start()
    try:
        state = edge.models[0].dispatcher.engines["cloud0"]
        assert state.profile.latency_s(1) == pytest.approx(0.020, abs=0.01)
        engine.stop()
        engine = PolicyServer(manifest(app_key, ports[1], role="engine", engine_id="cloud0",
                                       batch_latency_ms={1: 80, 4: 90})).start()
        assert wait_for(lambda: state.counts["restarts"] == 1 and state.up, 10.0)
        assert state.profile.latency_s(1) == pytest.approx(0.080, abs=0.01)
    finally:
        edge.stop()
        engine.stop()


# -- manifest errors: one line naming the field ----------------------------------------------------


@pytest.mark.parametrize("engines, field, words", [
    ([LOCAL, {**LOCAL}], "engines", "duplicate engine_id 'local'"),
    ([{**LOCAL, "capacity": 0}], "engines.0.capacity", "greater than or equal to 1"),
    ([{"engine_id": "c", "tier": "cloud", "capacity": 2}], "engines.0", "has no profile"),
    ([{**LOCAL, "tier": "fog"}], "engines.0.tier", "'edge' or 'cloud'"),
    ([LOCAL, {"engine_id": "c", "tier": "cloud", "capacity": 4, "profile": {1: 9}, "max_in_flight": 2}],
     "engines.1", "max_in_flight 2 is below its capacity 4"),
    ([{**LOCAL, "max_in_flight": 8}], "engines.0", "max_in_flight is for cloud engines"),
])
def test_manifest_engine_errors(app_key, engines, field, words):
    with pytest.raises(ConfigError) as info:
        manifest(app_key, 1, engines=engines)
    message = str(info.value)
    assert field in message and words in message and "\n" not in message


def test_unreachable_engine_fails_start_naming_it(app_key, ports):
    server = PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud9", ports[2])],
                                   dispatch_settings={"start_timeout_s": 0.5}))
    with pytest.raises(ConfigError) as info:
        server.start()
    assert "engines[cloud9]" in str(info.value) and "unreachable" in str(info.value)


def test_engine_loading_another_model_fails_start(app_key, ports):
    engine = PolicyServer(manifest(app_key, ports[1], role="engine", engine_id="cloud0", action_dim=7)).start()
    try:
        with pytest.raises(ConfigError) as info:
            PolicyServer(manifest(app_key, ports[0], engines=[LOCAL, cloud("cloud0", ports[1])])).start()
        assert "engines[cloud0]" in str(info.value) and "action_dim 7" in str(info.value)
    finally:
        engine.stop()


def test_the_engines_example_of_the_server_docs_validates():
    """docs/server.md's scheduler and engine manifests ("Engines") pass the manifest's checks (its
    engine example once failed at start-up: no clients listed)."""
    import yaml

    text = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    block = "# edge.yaml" + text.split("# edge.yaml", 1)[1].split("```", 1)[0]
    edge, engine = block.split("# cloud0.yaml", 1)
    assert [e.engine_id for e in parse_manifest(yaml.safe_load(edge)).server[0].engines] == ["local", "gpu1", "cloud0"]
    assert parse_manifest(yaml.safe_load("# cloud0.yaml" + engine)).engine_id == "cloud0"


def test_engine_role_manifest_errors(app_key):
    with pytest.raises(ConfigError, match="engine_id"):
        manifest(app_key, 1, role="engine", engine_id=None)


# -- security: engines over mutual TLS, the ACL generated from the manifests -----------------------


def test_secure_init_covers_engines_and_robots_cannot_reach_engine_keys(app_key, ports, tmp_path):
    import yaml

    from lerobot_zenoh.cli import secure
    from lerobot_zenoh.security import pki
    from lerobot_zenoh.security.acl import Deployment, access_control
    from lerobot_zenoh.security.identities import PkiLayout, member_settings
    from lerobot_zenoh.server.config.manifest import load_manifest

    # The engine is dialled at an address of its own (127.0.0.2): its certificate names only that, so a
    # robot dialling the edge (127.0.0.1) would refuse it (test_security.py).
    engine_at = f"tcp/127.0.0.2:{ports[1]}"
    edge_data = manifest(app_key, ports[0], engines=[LOCAL, {**cloud("cloud0", ports[1]), "endpoint": engine_at}]
                         ).model_dump(mode="json", exclude_none=True)
    edge_data["server"][0] |= {"accept_unknown_clients": False,
                               "clients": [{"client_uuid": f"robot_{i}"} for i in range(3)]}
    edge_data["server_id"] = "edge0"
    engine_data = manifest(app_key, ports[1], role="engine", engine_id="cloud0", latency_ms=20).model_dump(
        mode="json", exclude_none=True)
    engine_data["zenoh"]["listen"] = [engine_at]
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(edge_data))
    (tmp_path / "engine.yaml").write_text(yaml.safe_dump(engine_data))
    out = tmp_path / "pki"
    assert secure.main(["init", "--manifest", str(tmp_path / "edge.yaml"), "--manifest", str(tmp_path / "engine.yaml"),
                        "--out", str(out)]) == 0
    layout = PkiLayout(out)
    assert pki.served_names((out / "cloud0.pem").read_bytes()) == ["127.0.0.2"]  # where its scheduler dials it only
    acl = access_control(Deployment.from_manifests([load_manifest(tmp_path / "edge.yaml")]))
    robot_keys = [k for r in acl["rules"] if r["id"].startswith("client/") for k in r["key_exprs"]]
    assert robot_keys and not any("/engine/" in k for k in robot_keys)
    engine_keys = [k for r in acl["rules"] if r["id"].startswith("engine/") for k in r["key_exprs"]]
    assert engine_keys and all("/engine/cloud0" in k for k in engine_keys)

    engine = PolicyServer(load_manifest(out / "cloud0.manifest.yaml")).start()
    edge = PolicyServer(load_manifest(out / "edge0.manifest.yaml")).start()  # reaches its engine over mTLS
    sessions = [ZenohSession(member_settings(layout, f"robot_{i}", [f"tls/127.0.0.1:{ports[0]}"])).open()
                for i in range(3)]
    session = sessions[1]
    try:
        robots = [Robot(s, app_key, f"robot_{i}", np.random.default_rng(i)) for i, s in enumerate(sessions)]
        run_rounds(robots, 4)
        assert {c.tier for r in robots for c in r.chunks} == {"edge", "cloud"}  # the engine answered through the ACL
        # the robot (its own certificate) tries the engine's keys: the ACL drops it
        forged = session.publisher(EngineKeys(app_key, "cloud0").dispatch, ACTION_QOS)
        before = engine._worker.stats()[EngineKeys(app_key, "cloud0").token].get("received", 0)
        for _ in range(5):
            forged.put(dispatch.encode(EngineRequest(999, "robot_1", app_key.model, app_key.version, b"x", 1, "edge-1", 5)))
        assert not session.query(EngineKeys(app_key, "cloud0").status, timeout_s=0.5)
        time.sleep(0.3)
        assert engine._worker.stats()[EngineKeys(app_key, "cloud0").token].get("received", 0) == before
    finally:
        for s in sessions:
            s.close()
        edge.stop()
        engine.stop()


# -- the wire: engine messages and the chunk's engine fields ----------------------------------------


def test_engine_messages_round_trip_and_bad_bytes_are_protocol_errors(app_key):
    from lerobot_zenoh.errors import ProtocolError
    from lerobot_zenoh.protocol.messages import ActionChunk

    request = EngineRequest(7, "r1", "m", "v1", b"\x00obs", seed=2**40, edge_incarnation="edge-1", seq_id=41,
                            session_nonce=1234, reset=True)
    assert dispatch.decode(dispatch.encode(request)) == request
    answer = EngineAnswer(7, "cloud0", "inc", "m", "v1", "edge-1", "r1", 41, 1234, actions=np.ones((20, 6), np.float32),
                          rtc_delay_steps=3, inference_ms=12.5, queue_ms=1.0, batch_size=2)
    back = dispatch.decode(dispatch.encode(answer))
    assert back.request_id == 7 and back.rtc_delay_steps == 3 and np.array_equal(back.actions, answer.actions)
    assert (back.edge_incarnation, back.client_id, back.seq_id, back.session_nonce) == ("edge-1", "r1", 41, 1234)
    status = EngineStatus("cloud0", "inc", "m", "v1", "synthetic", 6, 20, 8, {1: 40.0, 8: 60.0})
    assert dispatch.decode(dispatch.encode(status)) == status
    for bad in (b"", b"\xc1", codec.encode(ActionChunk(1, 1.0, np.zeros((2, 6), np.float32))), b"\x81\xa1a\x01"):
        with pytest.raises(ProtocolError):
            dispatch.decode(bad)
    chunk = codec.decode_action_chunk(codec.encode(ActionChunk(1, 1.0, np.zeros((2, 6), np.float32), server_id="edge0",
                                                               engine_id="cloud0", tier="cloud")))
    assert (chunk.engine_id, chunk.tier) == ("cloud0", "cloud")
    plain = codec.decode_action_chunk(codec.encode(ActionChunk(1, 1.0, np.zeros((2, 6), np.float32))))
    assert plain.engine_id is None and plain.tier is None  # absent unless a server dispatches


def test_engine_figures_export_as_labelled_prometheus_families():
    from lerobot_zenoh.telemetry.prometheus import describe

    d = describe("server", "engine.cloud0.requeued")
    assert (d.name, d.kind, dict(d.labels)) == ("lerobot_zenoh_server_engine_requeued", "counter", {"engine": "cloud0"})
    d = describe("server", "engine.cloud0.rtt_ms")
    assert (d.name, d.kind, d.scale, dict(d.labels)) == ("lerobot_zenoh_server_engine_rtt_seconds", "gauge", 1e-3,
                                                         {"engine": "cloud0"})
    assert dict(describe("server_client", "served.cloud").labels) == {"tier": "cloud"}


# -- a real WAN partition: the cloud engine in its own network namespace --------------------------------


def test_wan_partition_in_a_network_namespace_degrades_and_heals(app_key, ports, robot_session, tmp_path):
    """The cloud engine runs as a process in a namespace behind a veth; the link goes down (a dead
    WAN): the edge goes edge-only, serves every robot, and offloads again once the link is back."""
    import os
    import shutil
    import subprocess
    import sys

    import yaml

    from testbed.netns import net_pair

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    with net_pair() as pair:
        engine_manifest = manifest(app_key, ports[1], role="engine", engine_id="cloud0", latency_ms=20).model_dump(
            mode="json", exclude_none=True)
        engine_manifest["zenoh"]["listen"] = [f"tcp/{pair.peer_ip}:{ports[1]}"]
        path = tmp_path / "cloud0.yaml"
        path.write_text(yaml.safe_dump(engine_manifest))
        proc = pair.popen([sys.executable, "-m", "lerobot_zenoh.cli.server", f"--manifest={path}",
                           "--log_level=WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        edge = None
        try:
            edge = PolicyServer(manifest(app_key, ports[0], engines=[
                LOCAL, {**cloud("cloud0", ports[1]), "endpoint": f"tcp/{pair.peer_ip}:{ports[1]}"}],
                dispatch_settings={"start_timeout_s": 30.0})).start()
            state = edge.models[0].dispatcher.engines["cloud0"]
            robots = [Robot(robot_session, app_key, f"r{i}", np.random.default_rng(i)) for i in range(3)]
            run_rounds(robots, 3)
            assert any(c.tier == "cloud" for r in robots for c in r.chunks)
            subprocess.run(["ip", "link", "set", pair.host_if, "down"], check=True)
            assert wait_for(lambda: not state.up, 8.0), "partition never detected"
            for r in robots:
                r.chunks.clear()
            run_rounds(robots, 3, first=4)  # every robot still served, at the edge
            assert all(c.tier == "edge" for r in robots for c in r.chunks)
            subprocess.run(["ip", "link", "set", pair.host_if, "up"], check=True)
            assert wait_for(lambda: state.up, 20.0), "the engine never came back"
            for r in robots:
                r.chunks.clear()
            run_rounds(robots, 4, first=7)
            assert any(c.tier == "cloud" for r in robots for c in r.chunks), "offload did not resume"
        finally:
            if edge is not None:
                edge.stop()
            proc.terminate()
            proc.wait(timeout=10)
