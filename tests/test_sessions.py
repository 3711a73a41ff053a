"""Client sessions over real Zenoh: reserved places under a forged-id flood, expiry by liveliness,
replays, restarts and episodes (docs/architecture.md, "Sessions")."""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import pytest

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.model.runner_adapter import request_seed
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

TINY_CAMS = {"front": (16, 16)}


def manifest(port, app_key, *, sessions=None, **entry):
    base = {
        "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
        "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 10, "cameras": TINY_CAMS, "latency_ms": 2},
        "fps": 30, "clients": [{"client_uuid": "robot"}],
    }
    base.update(entry)
    out = {
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [base],
    }
    if sessions:
        out["sessions"] = sessions
    return out


def connect(port) -> ZenohSession:
    return ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()


class Robot:
    """The wire side of a client: one observation at a time, waits for its chunk."""

    def __init__(self, session: ZenohSession, app_key, client_id: str, *, nonce: int | None = 1, token: bool = False,
                 cameras=TINY_CAMS, header: bool = False):
        self.key = app_key.client(client_id)
        self.client_id, self.nonce, self.cameras, self.header = client_id, nonce, cameras, header
        self.chunks: dict[int, object] = {}
        self.arrived = threading.Condition()
        session.subscribe(self.key.action, self._on_chunk)
        self.pub = session.publisher(self.key.obs, OBSERVATION_QOS)
        self.token = session.declare_token(self.key.metrics) if token else None
        self.rng = np.random.default_rng(abs(hash(client_id)) % 2**32)

    def _on_chunk(self, key, payload):
        chunk = codec.decode_action_chunk(payload)
        with self.arrived:
            self.chunks[chunk.response_to_seq_id] = chunk
            self.arrived.notify_all()

    def observation(self, seq_id: int, episode: str = "0", state=None, images=None) -> Observation:
        state = self.rng.normal(size=6).astype(np.float32) if state is None else state
        images = images or {n: codec.encode_jpeg(self.rng.integers(0, 255, (*hw, 3), dtype=np.uint8), 90)
                            for n, hw in self.cameras.items()}
        return Observation(seq_id, self.client_id, state, images, "task", episode_id=episode, session_nonce=self.nonce)

    def payload(self, seq_id: int, **kw) -> bytes:
        return codec.encode(self.observation(seq_id, **kw))

    def send(self, seq_id: int, **kw) -> None:
        """One put, with the observation header as its attachment when `header` (protocol.md §5.1.1)."""
        o = self.observation(seq_id, **kw)
        self.pub.put(codec.encode(o), codec.encode_observation_header(o) if self.header else None)

    def request(self, seq_id: int, timeout_s: float = 2.0, **kw) -> float | None:
        """Send (resending while unanswered: best effort) and wait; the round trip in seconds, or None."""
        o = self.observation(seq_id, **kw)
        payload, attachment = codec.encode(o), codec.encode_observation_header(o) if self.header else None
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            self.pub.put(payload, attachment)
            with self.arrived:
                if self.arrived.wait_for(lambda: seq_id in self.chunks, timeout=0.3):
                    return time.monotonic() - t0
        return None


def wait_serving(session, app_key):
    assert wait_for(lambda: session.query(app_key.status, 0.3)), "status never answered"


def test_forged_id_flood_does_not_starve_a_listed_robot(port, app_key):
    """200 invented ids flood the server; the listed robot still gets a chunk for every request."""
    server = PolicyServer(parse_manifest(manifest(port, app_key, accept_unknown_clients=True,
                                                  max_unknown_clients=40))).start()
    robot_session, attacker = connect(port), connect(port)
    try:
        wait_serving(robot_session, app_key)
        robot = Robot(robot_session, app_key, "robot")
        quiet = [robot.request(seq) for seq in range(1, 11)]
        assert all(q is not None for q in quiet)

        stop = threading.Event()
        forged = [Robot(attacker, app_key, f"forged{i:03d}") for i in range(200)]
        payloads = [f.payload(1) for f in forged]

        def flood():
            seq = 0
            while not stop.is_set():
                seq += 1
                for f, p in zip(forged, payloads, strict=True):
                    f.pub.put(p)
                stop.wait(0.01)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            assert wait_for(lambda: server.stats()[app_key.prefix]["dropped"].get("too_many_clients", 0) > 200, 10)
            loaded = [robot.request(seq) for seq in range(11, 41)]
        finally:
            stop.set()
            flooder.join(5)
        assert all(rt is not None for rt in loaded), f"{sum(rt is None for rt in loaded)} of 30 requests unanswered"
        stats = server.stats()[app_key.prefix]
        unknown = [c for c in stats["clients"] if c != "robot"]
        assert len(unknown) == 40  # the pool is full, and bounded
        print(f"robot RTT p50 quiet {statistics.median(quiet) * 1000:.1f} ms, "
              f"under the flood {statistics.median(loaded) * 1000:.1f} ms")
    finally:
        robot_session.close()
        attacker.close()
        server.stop()


def test_unknown_place_is_reusable_after_the_clients_token_goes(port, app_key):
    server = PolicyServer(parse_manifest(manifest(
        port, app_key, accept_unknown_clients=True, max_unknown_clients=1,
        sessions={"liveliness_grace_s": 0.3, "idle_timeout_s": 600}))).start()
    first, second = connect(port), connect(port)
    try:
        wait_serving(first, app_key)
        a = Robot(first, app_key, "visitor_a", token=True)
        assert a.request(1) is not None
        b = Robot(second, app_key, "visitor_b", token=True)
        assert b.request(1, timeout_s=1.0) is None  # no place left
        assert server.stats()[app_key.prefix]["dropped"]["too_many_clients"] >= 1
        first.close()  # visitor_a's token goes with its session
        assert wait_for(lambda: "visitor_a" not in server.stats()[app_key.prefix]["clients"], 5)
        assert b.request(2) is not None
        assert server.stats()[app_key.prefix]["sessions_closed"] == {"liveliness": 1}
    finally:
        second.close()
        server.stop()


def test_invented_ids_without_a_token_do_not_hold_the_unknown_pool_for_the_idle_timeout(port, app_key):
    """The pool (2 places) is taken by ids that never declare a liveliness token; a real visitor (with
    its token) gets a place within the grace, not after the 600 s idle timeout."""
    server = PolicyServer(parse_manifest(manifest(
        port, app_key, accept_unknown_clients=True, max_unknown_clients=2,
        sessions={"liveliness_grace_s": 0.5, "idle_timeout_s": 600}))).start()
    attacker, visitor_session = connect(port), connect(port)
    try:
        wait_serving(attacker, app_key)
        invented = [Robot(attacker, app_key, f"invented{i}") for i in range(2)]
        for r in invented:
            assert r.request(1) is not None
        visitor = Robot(visitor_session, app_key, "visitor", token=True)
        t0 = time.monotonic()
        rt = visitor.request(1, timeout_s=5.0)
        waited = time.monotonic() - t0
        print(f"a visitor with a token found the pool held by 2 token-less ids: served after {waited:.2f} s")
        assert rt is not None
        assert server.stats()[app_key.prefix]["sessions_closed"].get("no_token", 0) >= 1
    finally:
        attacker.close()
        visitor_session.close()
        server.stop()


def test_replays_are_dropped_and_a_restarted_client_is_served(port, app_key):
    server = PolicyServer(parse_manifest(manifest(port, app_key))).start()
    session = connect(port)
    try:
        wait_serving(session, app_key)
        robot = Robot(session, app_key, "robot", nonce=11)
        for seq in (1, 2, 3):
            assert robot.request(seq) is not None
        served = server.stats()[app_key.prefix]["clients"]["robot"]["served"]
        old = [robot.payload(seq) for seq in (1, 2, 3)]
        for _ in range(100):
            for p in old:
                robot.pub.put(p)
        assert wait_for(lambda: server.stats()[app_key.prefix]["clients"]["robot"]["rejected"].get("replayed", 0) >= 3, 30)
        assert server.stats()[app_key.prefix]["clients"]["robot"]["served"] == served  # no extra inference
        # The robot's process restarts: a new nonce, seq_ids from 1 again. Served from its first one.
        restarted = Robot(session, app_key, "robot", nonce=12)
        assert restarted.request(1) is not None
        assert restarted.request(2) is not None
    finally:
        session.close()
        server.stop()


# -- a forger on the robot's key (plain mode: anyone may put there; docs/security.md) -----------------


def rejected(server, app_key, client="robot") -> dict:
    return server.stats()[app_key.prefix]["clients"][client]["rejected"]


@pytest.mark.parametrize("header", [True, False])
def test_one_forged_packet_with_seq_2_64_minus_1_and_no_nonce_does_not_starve_the_robot(port, app_key, header):
    """The audit's packet, sent from another session on the robot's key while it runs: refused as
    `nonce_required`; the robot's every later request is answered."""
    server = PolicyServer(parse_manifest(manifest(port, app_key))).start()
    robot_session, attacker = connect(port), connect(port)
    try:
        wait_serving(robot_session, app_key)
        robot = Robot(robot_session, app_key, "robot", nonce=0x5EED, header=header)
        assert all(robot.request(seq) is not None for seq in range(1, 6))
        forger = Robot(attacker, app_key, "robot", nonce=None, header=header)
        forger.send(2**64 - 1, episode="forged")
        assert wait_for(lambda: rejected(server, app_key).get("nonce_required", 0) == 1, 5)
        after = [robot.request(seq, timeout_s=1.0) for seq in range(6, 36)]
        answered = sum(rt is not None for rt in after)
        print(f"after one forged 2**64-1 packet (header={header}): {answered}/30 requests answered")
        assert answered == 30
    finally:
        robot_session.close()
        attacker.close()
        server.stop()


def test_a_client_restarting_without_a_nonce_is_served_at_once(port, app_key):
    """A protocol 1.0 client (no session_nonce) restarts, counting from 1 again: its new process is
    served from its first request (its liveliness token went and came back), not refused as replayed."""
    server = PolicyServer(parse_manifest(manifest(port, app_key, sessions={"idle_timeout_s": 600}))).start()
    first = connect(port)
    try:
        wait_serving(first, app_key)
        robot = Robot(first, app_key, "robot", nonce=None, token=True)
        assert all(robot.request(seq) is not None for seq in range(1, 21))
        first.close()
        second = connect(port)
        try:
            wait_serving(second, app_key)
            again = Robot(second, app_key, "robot", nonce=None, token=True)
            rts = [again.request(seq, timeout_s=1.0) for seq in range(1, 11)]
            print(f"restart without a nonce: {sum(rt is not None for rt in rts)}/10 answered, first in "
                  f"{(rts[0] or float('nan')) * 1000:.1f} ms")
            assert all(rt is not None for rt in rts)
            assert "replayed" not in rejected(server, app_key)
        finally:
            second.close()
    finally:
        server.stop()


def test_forged_nonce_ful_streams_moved_ahead_do_not_shut_the_robot_out(port, app_key):
    """A forger streams seq ids far ahead: with a made-up nonce it costs the robot a reset per
    switch, never its service; with the robot's own nonce (read off the wire) a jump past the bound
    is refused (`seq_jump`)."""
    server = PolicyServer(parse_manifest(manifest(port, app_key))).start()
    robot_session, attacker = connect(port), connect(port)
    stop = threading.Event()
    try:
        wait_serving(robot_session, app_key)
        robot = Robot(robot_session, app_key, "robot", nonce=21, header=True)
        assert all(robot.request(seq) is not None for seq in range(1, 6))
        made_up = Robot(attacker, app_key, "robot", nonce=666, header=True)
        own = Robot(attacker, app_key, "robot", nonce=21, header=True)

        def forge():
            seq = 1_000_000
            while not stop.is_set():
                seq += 1
                made_up.send(seq)
                own.send(2**64 - 1 - seq)
                stop.wait(0.02)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        assert wait_for(lambda: rejected(server, app_key).get("seq_jump", 0) > 5, 5)
        after = [robot.request(seq, timeout_s=1.0) for seq in range(6, 36)]
        answered = sum(rt is not None for rt in after)
        print(f"under forged streams 50/s ahead (made-up nonce and the robot's own): {answered}/30 answered")
        assert answered == 30
    finally:
        stop.set()
        robot_session.close()
        attacker.close()
        server.stop()


TINY_DIFFUSION = {"down_dims": (32, 64), "num_inference_steps": 3, "spatial_softmax_num_keypoints": 8,
                  "diffusion_step_embed_dim": 32, "crop_shape": (40, 56), "n_obs_steps": 2}


@pytest.mark.slow
def test_diffusion_history_is_empty_at_the_start_of_the_second_episode(port, app_key, tmp_path):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.runners import load_policy_runner

    cams = {"front": (48, 64)}
    path = build_checkpoint(tmp_path / "diffusion", policy_type="diffusion",
                            state_names=[f"j{i}" for i in range(6)], action_names=[f"a{i}" for i in range(6)],
                            cameras=cams, chunk_size=8, fps=30, overrides=TINY_DIFFUSION, seed=3)
    entry = {"pretrained_path": str(path), "synthetic": None, "actions_per_chunk": None}
    server = PolicyServer(parse_manifest(manifest(port, app_key, **entry))).start()
    session = connect(port)
    try:
        wait_serving(session, app_key)
        robot = Robot(session, app_key, "robot", cameras=cams)
        rng = np.random.default_rng(0)
        frames = [({"front": codec.encode_jpeg(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), 95)},
                   rng.normal(size=6).astype(np.float32)) for _ in range(2)]
        (img_a, state_a), (img_b, state_b) = frames
        assert robot.request(1, episode="0", state=state_a, images=img_a) is not None
        assert robot.request(2, episode="0", state=state_b, images=img_b) is not None
        assert robot.request(3, episode="1", state=state_b, images=img_b) is not None

        fresh = load_policy_runner(path)
        decoded_b = {n: codec.decode_jpeg(j) for n, j in img_b.items()}
        alone_2 = fresh.infer("other", state_b, decoded_b, "task", seed=request_seed("robot", 2))
        alone_3 = fresh.infer("other3", state_b, decoded_b, "task", seed=request_seed("robot", 3))
        # Within an episode the history counts (seq 2 saw frame a before b) ...
        assert not np.allclose(robot.chunks[2].actions, alone_2, atol=1e-5)
        # ... and a new episode starts with none: seq 3 is what frame b alone gives.
        np.testing.assert_allclose(robot.chunks[3].actions, alone_3, rtol=0, atol=1e-5)
    finally:
        session.close()
        server.stop()
