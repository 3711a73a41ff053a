"""Each part of the robot client alone (client/*.py), built with what it uses.

The parts that talk to the network get the smallest fake of the transport seam (`ListSession`:
puts collected in a list, status queries answered from a dict); end-to-end behaviour over real
Zenoh is tests/test_client.py's.
"""

from __future__ import annotations

import threading

import numpy as np
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.chunk_receiver import ChunkReceiver
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
from lerobot_zenoh.client.control_loop import ControlLoop
from lerobot_zenoh.client.discovery import RobotFeatures
from lerobot_zenoh.client.observation_publisher import Capture, ObservationPublisher, Outbox
from lerobot_zenoh.client.reporting import ClientCounters
from lerobot_zenoh.client.server_watch import ServerWatch
from lerobot_zenoh.client.task import Task
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import ActionChunk, ExecutionInfo, Status
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer, LatestOnlyConfig
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake
from lerobot_zenoh.scheduling.send_trigger import SendTrigger, SendTriggerConfig
from lz_testing import make_config, wait_for

APP = AppKey("c", "e", "m", "v1", "app")
CAMS = {"front": (48, 64)}


class ListSession:
    """The transport seam's smallest fake: what is put is kept, a status query is answered from `replies`."""

    def __init__(self, replies: dict[str, list[bytes]] | None = None):
        self.puts: list[tuple[str, bytes, bytes | None]] = []
        self.replies = replies or {}
        self.queries = 0

    def publisher(self, key, qos):
        session = self

        class Publisher:
            def put(self, payload, attachment=None):
                session.puts.append((key, payload, attachment))

        return Publisher()

    def query(self, key, timeout_s=1.0, parameters=None):
        self.queries += 1
        return [(key, payload) for payload in self.replies.get(key, [])]


def robot():
    r = make_robot_from_config(SimRobotConfig(cameras=dict(CAMS), fps=30))
    r.connect()
    return r


def status_for(features: RobotFeatures, server_id="gpu1") -> Status:
    return Status("m", "v1", dict(CAMS), len(features.action_names), 10, {}, fps=30, server_id=server_id,
                  state_dim=len(features.state_names), action_names=features.action_names)


def parts(session=None, **config):
    cfg = make_config(7600, APP, robot=SimRobotConfig(cameras=dict(CAMS), fps=30), **config)
    r = robot()
    features = RobotFeatures.of(r)
    trigger = SendTrigger(cfg.send, dt_s=cfg.dt_s)
    intake = ChunkIntake(trigger, cfg.dt_s)
    counters = ClientCounters()
    watch = ServerWatch(cfg, session or ListSession(), features, trigger=trigger, intake=intake,
                        counters=counters, stop=threading.Event())
    return cfg, r, features, trigger, intake, counters, watch


def test_the_observation_publisher_puts_what_the_outbox_holds_through_the_publisher_it_was_given():
    cfg, r, features, *_, counters, _watch = parts()
    session = ListSession()
    outbox = Outbox()
    publisher = ObservationPublisher(session.publisher("obs", None), outbox, features, client_uuid="r1",
                                     task_text="pick", jpeg_quality=80, counters=counters)
    stop = threading.Event()
    thread = threading.Thread(target=publisher.run, args=(stop,))
    thread.start()
    try:
        outbox.put(Capture(7, 3, 0.0, r.get_observation(), ExecutionInfo(), "0", session_nonce=42))
        assert wait_for(lambda: counters.observations_published == 1, 5)
    finally:
        stop.set()
        outbox.wake()
        thread.join(5)
    _key, payload, attachment = session.puts[0]
    obs = codec.decode_observation(payload)
    assert (obs.seq_id, obs.session_nonce, obs.episode_id, obs.task) == (7, 42, "0", "pick")
    assert set(obs.images) == {"front"} and codec.decode_observation_header(attachment).seq_id == 7


def test_the_chunk_receiver_merges_counts_and_tells_the_watch_without_a_thread_or_session():
    cfg, _r, features, trigger, intake, counters, watch = parts()
    buffer = ActionBuffer(LatestOnlyConfig())
    accepted = []
    receiver = ChunkReceiver(intake, buffer, action_dim=len(features.action_names), watch=watch,
                             counters=counters, client_uuid="r1", mispredict_steps=2,
                             on_accepted=lambda seq, t: accepted.append(seq))
    intake.on_send(1, 0, 10.0)
    dim = len(features.action_names)
    chunk = ActionChunk(1, 5.0, np.ones((8, dim), np.float32), server_id="gpu2")
    result = receiver.handle(codec.encode(chunk), 10.2)
    assert result.accepted and buffer.depth == 8 and accepted == [1]
    assert counters.chunks_received == 1 and abs(counters.rtt_ms[-1] - 200.0) < 1e-6
    assert watch.serving_server_id == "gpu2" and counters.server_changes == 1  # it follows whoever answers
    wrong = ActionChunk(2, 5.0, np.ones((8, dim + 1), np.float32))
    assert receiver.handle(codec.encode(wrong), 10.3) is None and counters.chunks_rejected == 1
    assert receiver.handle(codec.encode(ActionChunk(99, 5.0, np.ones((8, dim), np.float32))), 10.4).reason == "unknown_seq"


def test_the_server_watch_draws_a_new_nonce_after_n_unanswered_requests_in_a_row():
    cfg, _r, features, trigger, _intake, counters, watch = parts(
        send=SendTriggerConfig(request_timeout_s=1.0), new_nonce_after_unanswered=2, watchdog_timeout_s=100.0)
    watch.use_status(status_for(features))
    watch.state = "running"
    nonce = watch.session_nonce
    trigger.on_send(1, 0.0)
    trigger.outstanding(1.5)  # timed out: one unanswered
    watch.tick(1.5)
    assert watch.session_nonce == nonce
    trigger.on_send(2, 1.5)
    trigger.outstanding(3.0)  # two in a row
    watch.tick(3.0)
    assert watch.session_nonce != nonce and counters.session_renewals == 1 and trigger.unanswered_in_a_row == 0


def test_the_server_watch_revalidates_through_the_session_it_was_given():
    app = make_config(7600, APP).app_key
    cfg, _r, features, trigger, intake, counters, _ = parts()
    session = ListSession({app.status: [codec.encode(status_for(features, "gpu7"))]})
    watch = ServerWatch(cfg, session, features, trigger=trigger, intake=intake, counters=counters,
                        stop=threading.Event())
    watch.use_status(status_for(features, "gpu1"))
    watch.state = "running"
    trigger.on_send(1, 0.0)
    watch.note_request(0.0)
    watch.tick(0.5)  # within watchdog_timeout_s (1 s): nothing happens
    assert session.queries == 0
    watch.tick(1.5)  # silent for 1.5 s: re-validate, resume with whoever answers valid
    assert session.queries == 1 and watch.state == "running" and watch.serving_server_id == "gpu7"
    assert counters.watchdog_events == 1 and trigger.stats().outstanding == 0


def test_the_control_loop_alone_sends_requests_and_holds_without_chunks():
    cfg, r, features, trigger, intake, counters, watch = parts(send=SendTriggerConfig(max_in_flight=1))
    watch.use_status(status_for(features))
    watch.state = "running"
    outbox = Outbox()
    loop = ControlLoop(cfg, r, features, buffer=ActionBuffer(LatestOnlyConfig()), intake=intake, outbox=outbox,
                       watch=watch, task=Task(), counters=counters, stop=threading.Event())
    loop.run(0.3)
    first = outbox.take(0.1)
    assert first is not None and first.seq_id == 1 and first.session_nonce == watch.session_nonce
    assert counters.steps >= 5 and counters.empty_cycles == counters.steps  # no chunk: the fail-safe each step
    assert trigger.stats().sent == 1 and trigger.table.get(1).captures[1].step == 0  # one slot, its capture step


def test_undecodable_status_replies_are_skipped_and_logged_a_few_times_not_per_reply(caplog):
    """Anything on the status key may answer, every time it is asked: a retrying discovery skips
    what it cannot decode and logs the 1st, 10th, 100th (with the count), not every reply."""
    import logging

    from lerobot_zenoh.client import discovery
    from lerobot_zenoh.protocol.keys import AppKey

    class GarbageSession:
        def query(self, key, timeout_s, parameters=None):
            return [(key, b"\xc1"), (key, b"not msgpack")]

    with caplog.at_level(logging.WARNING, logger=discovery.__name__):
        for _ in range(100):
            assert discovery.query_status(GarbageSession(), AppKey("c", "e", "m", "v", "a")) is None
    lines = [r.getMessage() for r in caplog.records if "undecodable status reply" in r.getMessage()]
    assert len(lines) <= 3 and all("so far]" in line for line in lines), lines  # (the count is the process')
