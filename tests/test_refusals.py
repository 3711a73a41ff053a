"""Refusals (protocol 1.5): a request the server refuses for a reason every request like it will meet
reaches the robot as that reason, and the client stops on it; a transient one is shown once; the
server sends them only to the client that sent, only to one that asks, at most one a second per
session and one line long (docs/protocol.md §5.7)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.chunk_receiver import ChunkReceiver
from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.reporting import ClientCounters
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import MAX_REFUSAL_DETAIL_BYTES, ExecutionInfo, Observation, Refusal
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import CAMS, make_config, make_server, wait_for

LONG_TASK = "pick up the red cube and put it in the blue box"  # 12 words: over a limit of 4


def test_a_task_over_the_models_token_limit_stops_the_client_with_the_reason(port, app_key):
    cfg = make_config(port, app_key, task=LONG_TASK)
    with make_server(port, app_key, max_task_tokens=4) as server:
        assert server.models[0].status.max_task_tokens == 4 and server.models[0].status.refusals
        client = RobotClient(cfg, make_robot_from_config(cfg.robot))
        client.start()
        runner = threading.Thread(target=client.run, kwargs={"duration_s": 30})
        t0 = time.monotonic()
        runner.start()
        try:
            assert wait_for(lambda: client.refusal is not None, 10)
            runner.join(5)
            print(f"refusal received {time.monotonic() - t0:.2f} s after the client started running")
            assert not runner.is_alive()  # stopped on it, long before its 30 s
            refusal = client.refusal
            assert refusal.reason == "task_too_long" and refusal.permanent and refusal.server_id == "gpu0"
            assert refusal.detail == "the task is 12 tokens, synthetic reads at most 4"
            assert client.counters.actions_executed == 0 and client.counters.chunks_received == 0
            assert server.models[0].refusals_sent["task_too_long"] >= 1
        finally:
            client.stop()
            runner.join(5)
            client.close()


def test_a_task_within_the_limit_is_served(port, app_key):
    cfg = make_config(port, app_key, task="pick the cube")
    with make_server(port, app_key, max_task_tokens=4) as server:
        client = RobotClient(cfg, make_robot_from_config(cfg.robot))
        client.start()
        runner = threading.Thread(target=client.run, kwargs={"duration_s": 30})
        runner.start()
        try:
            assert wait_for(lambda: client.counters.chunks_received >= 2, 15)
            assert client.refusal is None and not server.models[0].refusals_sent
        finally:
            client.stop()
            runner.join(5)
            client.close()


def observation(seq: int, client: str, task: str, *, refusals: bool) -> Observation:
    frame = np.zeros((48, 64, 3), np.uint8)
    return Observation(seq, client, np.zeros(6, np.float32), {cam: codec.encode_jpeg(frame, 80) for cam in CAMS},
                       task, ExecutionInfo(), episode_id="0", session_nonce=7, refusals=refusals)


def test_refusals_go_only_to_the_sender_that_asks_at_most_one_a_second(port, app_key):
    """A flood of refused requests gets back one refusal a second, on the sender's own key only, and
    nothing to a client whose observations do not ask for refusals (a 1.4 client)."""
    heard: dict[str, list[bytes]] = {"r1": [], "r2": [], "old": []}
    with make_server(port, app_key, max_task_tokens=4) as server:
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as peer:
            for client in heard:
                peer.subscribe(app_key.client(client).action, lambda key, payload, c=client: heard[c].append(payload))
            time.sleep(0.5)  # (a new subscription takes a moment to be matched)
            r1 = peer.publisher(app_key.client("r1").obs, OBSERVATION_QOS)
            old = peer.publisher(app_key.client("old").obs, OBSERVATION_QOS)
            t0 = time.monotonic()
            for seq in range(1, 41):
                for pub, client, asks in ((r1, "r1", True), (old, "old", False)):
                    obs = observation(seq, client, "x " * 500, refusals=asks)
                    pub.put(codec.encode(obs), attachment=codec.encode_observation_header(obs))
                time.sleep(0.025)
            assert wait_for(lambda: heard["r1"], 5)
            elapsed = time.monotonic() - t0
            time.sleep(0.3)
            stats = server.stats()[app_key.prefix]["clients"]
            refusals = [codec.decode(p) for p in heard["r1"]]
            assert all(isinstance(r, Refusal) and r.reason == "task_too_long" and r.permanent for r in refusals)
            assert 1 <= len(refusals) <= elapsed + 2, (len(refusals), elapsed)
            assert all(len(r.detail.encode()) <= MAX_REFUSAL_DETAIL_BYTES and "\n" not in r.detail for r in refusals)
            assert heard["r2"] == [] and heard["old"] == []  # never to another key, nor to a client that did not ask
            assert stats["r1"]["rejected"].get("task_too_long") and stats["old"]["rejected"].get("task_too_long")
            assert server.stats()[app_key.prefix]["refusals_sent"] == {"task_too_long": len(refusals)}
            figures, _ = server.telemetry_figures(server.models[0])  # and in telemetry, so on /metrics
            assert figures["refusals_sent.task_too_long"] == len(refusals)
            assert server.stats()[app_key.prefix]["refusals_withheld"] >= 1


def test_the_status_query_counts_a_task_with_the_models_own_count(port, app_key):
    from lerobot_zenoh.client.discovery import discover, query_status

    with make_server(port, app_key, max_task_tokens=4):
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as peer:
            assert discover(peer, app_key, 10.0) is not None
            task = "pick up; the=red cube & put it %20 there"  # selector-reserved characters travel quoted
            status = query_status(peer, app_key, timeout_s=2.0, client_uuid="r1", task=task)
            assert (status.task_tokens, status.max_task_tokens, status.client_admitted) == (9, 4, True)
            assert query_status(peer, app_key, timeout_s=2.0, client_uuid="r1").task_tokens is None
            assert query_status(peer, app_key, timeout_s=2.0, task="x " * 1500).task_tokens is None  # over 2,048 B


class _Intake:
    def __init__(self, in_flight):
        self.table = set(in_flight)


def receiver(in_flight, on_refused=None) -> ChunkReceiver:
    return ChunkReceiver(_Intake(in_flight), None, action_dim=6, watch=None, counters=ClientCounters(),
                         client_uuid="r1", mispredict_steps=2, on_refused=on_refused)


def test_a_refusal_about_no_request_in_flight_changes_nothing():
    stopped = []
    rx = receiver({5}, stopped.append)
    rx.handle(codec.encode(Refusal(9, "task_too_long", "forged", permanent=True)), 0.0)
    assert stopped == [] and rx.counters.chunks_rejected == 1 and rx.counters.refusals == 0
    rx.handle(codec.encode(Refusal(5, "task_too_long", "the task is 9 tokens", permanent=True)), 0.0)
    assert [r.response_to_seq_id for r in stopped] == [5]


def test_a_transient_refusal_is_shown_once_per_reason_and_the_client_carries_on(caplog):
    stopped = []
    rx = receiver({1, 2, 3, 4}, stopped.append)
    with caplog.at_level(logging.WARNING):
        for seq in (1, 2, 3):
            rx.handle(codec.encode(Refusal(seq, "engine_error", "engine cloud0 busy")), 0.0)
        rx.handle(codec.encode(Refusal(4, "replayed", "seq_id 4 is being decoded")), 0.0)
    shown = [r.getMessage() for r in caplog.records if "refused request" in r.getMessage()]
    assert len(shown) == 2 and "engine_error" in shown[0] and "replayed" in shown[1]
    assert stopped == [] and rx.counters.refusals == 4


def test_a_client_delisted_while_it_runs_stops_with_the_reason(port, app_key):
    """A reload that drops the client from the manifest: its observations are dropped unread (no
    Refusal can be sent), the watchdog re-validates, the status says it is not served: it stops."""
    cfg = make_config(port, app_key)
    with make_server(port, app_key, clients=["r1", "r2"]) as server:
        client = RobotClient(cfg, make_robot_from_config(cfg.robot))
        client.start()
        runner = threading.Thread(target=client.run, kwargs={"duration_s": 30})
        runner.start()
        try:
            assert wait_for(lambda: client.counters.chunks_received >= 2, 15)
            entry = server.manifest.server[0]
            delisted = server.manifest.model_copy(update={"server": [entry.model_copy(
                update={"clients": [c for c in entry.clients if c.client_uuid != "r1"]})]})
            assert server.reload(delisted) is None
            assert wait_for(lambda: client.refusal is not None, 15)
            runner.join(5)
            assert not runner.is_alive()
            assert client.refusal.reason == "unknown_client" and client.refusal.permanent
            assert "no longer serves client 'r1'" in client.refusal.detail
        finally:
            client.stop()
            runner.join(5)
            client.close()
