"""Re-fetch of stale observations over real Zenoh (docs/protocol.md §10.7): a request that waits is
served with the fresher capture its client published meanwhile; a refresh that lands after its
request was picked is counted and never served; the reference client refreshes its waiting requests
without costing an inference per refresh."""

from __future__ import annotations

import threading

import numpy as np
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import CAMS, make_config, make_server, wait_for


class Wire:
    """The wire side of a client: publishes observations with their headers, collects chunks."""

    def __init__(self, session: ZenohSession, app_key, client_id: str):
        key = app_key.client(client_id)
        self.client_id = client_id
        self.chunks: dict[int, object] = {}
        self.arrived = threading.Condition()
        session.subscribe(key.action, self._on_chunk)
        self.pub = session.publisher(key.obs, OBSERVATION_QOS)
        grey = codec.encode_jpeg(np.full((*CAMS["front"], 3), 128, np.uint8), 90)
        self.images = dict.fromkeys(CAMS, grey)

    def _on_chunk(self, key, payload):
        chunk = codec.decode_action_chunk(payload)
        with self.arrived:
            self.chunks[chunk.response_to_seq_id] = chunk
            self.arrived.notify_all()

    def put(self, seq_id: int, state: float, refreshes: int | None = None) -> None:
        obs = Observation(seq_id, self.client_id, np.full(6, state, np.float32), self.images, "task",
                          ExecutionInfo(actions_buffered=0, control_period_s=1 / 30), episode_id="0",
                          session_nonce=5, refreshes_seq_id=refreshes)
        self.pub.put(codec.encode(obs), attachment=codec.encode_observation_header(obs))

    def wait_chunk(self, timeout_s: float = 10.0):
        with self.arrived:
            assert self.arrived.wait_for(lambda: self.chunks, timeout=timeout_s), f"{self.client_id}: no chunk"
            return dict(self.chunks)


def test_a_waiting_request_is_served_with_its_refresh_and_a_late_refresh_is_counted_not_served(port, app_key):
    server = make_server(port, app_key, latency_ms=800).start()  # one request at a time (max_batch_size 1)
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    try:
        assert wait_for(lambda: session.query(app_key.status, 0.3)), "status never answered"
        engine = server.models[0].session_table
        busy, robot = Wire(session, app_key, "busy"), Wire(session, app_key, "robot")
        busy.put(1, 0.0)
        assert wait_for(lambda: "busy" in engine.sessions and engine.sessions["busy"].last_picked is not None)
        # While busy's 800 ms inference runs, robot's request 1 waits; its client refreshes it.
        robot.put(1, 0.0)
        robot.put(2, 10.0, refreshes=1)
        chunks = robot.wait_chunk()
        assert list(chunks) == [2]  # answered once, with the fresher capture (state 10, not 0)
        assert chunks[2].actions[0, 0] > 9.0
        assert wait_for(lambda: server.inferences == 2)
        # A refresh of request 1 that lands now (its request was served) is dropped on arrival.
        robot.put(3, 20.0, refreshes=1)
        clients = lambda: server.stats()[app_key.prefix]["clients"]  # noqa: E731
        assert wait_for(lambda: clients()["robot"]["refreshes_late"] == 1)
        assert clients()["robot"]["refreshes"] == 1 and clients()["robot"]["served"] == 1
        assert server.inferences == 2 and engine.sessions["robot"].slot is None  # nothing left to serve
        metrics, _ = server.telemetry_figures(server.models[0])
        assert (metrics["observations_refreshes"], metrics["refreshes_late"]) == (1, 1)
        # The next request is served as usual.
        robot.put(4, 30.0)
        assert wait_for(lambda: 4 in robot.chunks) and 3 not in robot.chunks
    finally:
        session.close()
        server.stop()


def test_reference_clients_refresh_waiting_requests_without_an_inference_per_refresh(port, app_key):
    """Two clients on a server whose inference (250 ms) is longer than the re-fetch threshold
    (100 ms), each using 10 actions per chunk (more than the server can serve): their requests wait
    for each other, are refreshed and served with the fresher capture."""
    with make_server(port, app_key, latency_ms=250) as server:
        clients = [RobotClient(cfg, make_robot_from_config(cfg.robot)) for cfg in (
            make_config(port, app_key, client_uuid=cid, actions_per_chunk=10,
                        send=SendTriggerConfig(refetch_after_s=0.1))
            for cid in ("r1", "r2"))]
        for client in clients:
            client.start()
        runs = [threading.Thread(target=c.run, kwargs={"duration_s": 4.0}) for c in clients]
        for t in runs:
            t.start()
        for t in runs:
            t.join(15)
        for client in clients:
            client.close()
        stats = server.stats()[app_key.prefix]["clients"]
    refreshes = sum(s["refreshes"] for s in stats.values())
    late = sum(s["refreshes_late"] for s in stats.values())
    sent = [c.trigger.stats() for c in clients]
    assert refreshes > 0 and late > 0, stats  # some served in their request's place, some too late
    assert sum(s.refreshes for s in sent) >= refreshes + late  # (the last ones may be in flight at exit)
    # One inference per request, however many refreshes it had.
    assert sum(s["served"] for s in stats.values()) <= sum(s.sent for s in sent)
    for client in clients:
        summary = client.summary()
        assert summary["chunks_received"] > 0 and summary["refreshes_sent"] > 0
        assert 0 < summary["observation_age_ms_p50"] < summary["rtt_ms_p50"]
        print(client.config.client_uuid, stats[client.config.client_uuid], {k: summary[k] for k in (
            "chunks_received", "refreshes_sent", "observation_age_ms_p50", "rtt_ms_p50")})


def test_no_refresh_goes_to_a_server_that_does_not_say_it_takes_them(port, app_key):
    """A server before 1.3 would serve each refresh as a new request: toward one whose status lacks
    `refreshes`, the client sends none, whatever --send.refetch_after_s says."""
    from dataclasses import replace

    with make_server(port, app_key, latency_ms=250) as server:
        from lerobot_zenoh.protocol import codec

        for model in server.models:  # answer status queries as a 1.2 server does
            model.status = replace(model.status, refreshes=None)
            model.status_bytes = codec.encode(model.status)
            model._status_for = {a: codec.encode(replace(model.status, client_admitted=a)) for a in (True, False)}
        cfg = make_config(port, app_key, client_uuid="r1", actions_per_chunk=10,
                          send=SendTriggerConfig(refetch_after_s=0.1))
        client = RobotClient(cfg, make_robot_from_config(cfg.robot))
        client.start()
        try:
            client.run(duration_s=1.5)
        finally:
            client.close()
        assert client.summary()["chunks_received"] > 0
        assert client.summary()["refreshes_sent"] == 0
        assert server.stats()[app_key.prefix]["clients"]["r1"]["refreshes"] == 0


def test_re_fetch_defaults_to_100_ms_toward_a_server_that_takes_refreshes_and_0_turns_it_off(port, app_key):
    from lerobot_zenoh.scheduling.send_trigger import DEFAULT_REFETCH_AFTER_S

    with make_server(port, app_key, latency_ms=5) as server:
        assert server.models[0].status.refreshes is True
        for cid, send, expected in (("d", SendTriggerConfig(), DEFAULT_REFETCH_AFTER_S),
                                    ("off", SendTriggerConfig(refetch_after_s=0), None),
                                    ("set", SendTriggerConfig(refetch_after_s=0.25), 0.25)):
            cfg = make_config(port, app_key, client_uuid=cid, send=send)
            client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
            try:
                assert client.trigger.refetch_after_s == expected, cid
            finally:
                client.close()


def test_the_default_threshold_is_never_below_the_models_own_time(port, app_key):
    """A 250 ms model: a request younger than that may be in inference, so the default waits at least
    the model's median time before refreshing (an explicit setting is kept as given)."""
    with make_server(port, app_key, latency_ms=250):
        cfg = make_config(port, app_key, client_uuid="slow", actions_per_chunk=10)
        client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
        try:
            client.run(duration_s=1.5)
            assert client.summary()["chunks_received"] > 0
            assert client.trigger.refetch_after_s >= 0.25
        finally:
            client.close()
