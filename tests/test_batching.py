"""Cross-client batching: runners' `run` on several requests, and the server serving several clients per pass."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.runners import InferenceRequest, RunnerCapabilities
from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig, synthetic_actions
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

CAMS = {"front": (24, 32)}
CLIENTS = ("r1", "r2", "r3", "r4", "bad")


def synthetic_config(**kw):
    return SyntheticPolicyConfig(state_dim=4, cameras=CAMS, action_dim=4, chunk_size=10, **kw)


def request(client_id, seed, rng, cameras=CAMS):
    state = rng.normal(size=4).astype(np.float32)
    images = {n: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for n, hw in cameras.items()}
    return InferenceRequest(client_id, state, images, "task", seed)


# -- runners ------------------------------------------------------------------------------------


def test_synthetic_batch_sleeps_once_for_the_batch_and_answers_each_request(monkeypatch):
    slept = []
    monkeypatch.setattr("lerobot_zenoh.server.runners.synthetic.time.sleep", slept.append)
    policy = SyntheticPolicy(synthetic_config(batch_latency_ms={1: 60, 16: 200}))
    assert policy.spec.capabilities.max_batch is None
    rng = np.random.default_rng(0)
    reqs = [request(f"c{i}", i, rng) for i in range(4)]
    out = policy.run(reqs)
    assert slept == [pytest.approx(policy.latency_s(4))]
    for r, result in zip(reqs, out, strict=True):
        np.testing.assert_array_equal(result.actions, synthetic_actions(r.state, r.images, 10, 4))


class FlakyPolicy(SyntheticPolicy):
    """Fails every batch that contains client 'bad', and 'bad' alone; counts the calls."""

    def __init__(self, config):
        super().__init__(config)
        self.batches: list[list[str]] = []

    def run(self, requests, *, capture_updates=False):
        self.batches.append([r.session_id for r in requests])
        if any(r.session_id == "bad" for r in requests):
            raise PolicyError("bad is in this batch" if len(requests) > 1 else "bad")
        return super().run(requests, capture_updates=capture_updates)


class LoopOnlyPolicy(SyntheticPolicy):
    """A runner that takes one request per call (`capabilities.max_batch` 1), as third-party runners may."""

    def __init__(self, config):
        super().__init__(config)
        self.spec = dataclasses.replace(self.spec, capabilities=RunnerCapabilities(max_batch=1))

    def run(self, requests, *, capture_updates=False):
        assert len(requests) == 1, len(requests)  # the server keeps to the declared max_batch
        return super().run(requests, capture_updates=capture_updates)


# -- the server ---------------------------------------------------------------------------------


def manifest(port, app_key, **entry):
    return parse_manifest(manifest_dict(port, app_key, **entry))


def manifest_dict(port, app_key, **entry):
    base = {
        "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
        "synthetic": {"state_dim": 4, "action_dim": 4, "chunk_size": 10, "cameras": CAMS,
                      "latency_ms": 150, "batch_latency_ms": {1: 150, 8: 180}},
        "fps": 30, "max_batch_size": 4, "clients": [{"client_uuid": c} for c in CLIENTS],
    }
    base.update(entry)
    return {
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "telemetry_period_s": 0, "server": [base],
    }


class Robot:
    def __init__(self, session, app_key, client_id):
        self.client_id = client_id
        self.key = app_key.client(client_id)
        self.chunks = []
        self.sent = {}
        session.subscribe(self.key.action, lambda k, b: self.chunks.append(codec.decode_action_chunk(b)))
        self.pub = session.publisher(self.key.obs, OBSERVATION_QOS)

    def send(self, seq_id, rng, state_dim=4, buffered=10):
        state = rng.normal(size=state_dim).astype(np.float32)
        jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8)) for n, hw in CAMS.items()}
        self.sent[seq_id] = (state, {n: codec.decode_jpeg(j) for n, j in jpegs.items()})
        execution = ExecutionInfo(actions_buffered=buffered, control_period_s=1 / 30)
        self.pub.put(codec.encode(Observation(seq_id, self.client_id, state, jpegs, "task", execution)))

    def answered_round(self, rnd):
        return any(c.response_to_seq_id // ATTEMPTS == rnd for c in self.chunks)

    def check(self):
        for chunk in self.chunks:
            state, images = self.sent[chunk.response_to_seq_id]
            np.testing.assert_allclose(chunk.actions, synthetic_actions(state, images, 10, 4), atol=1e-6)




ATTEMPTS = 100  # seq_id = round * ATTEMPTS + attempt


def run_rounds(server, session, app_key, robots, rounds, sender=None, first=0):
    """Each round, every robot sends one observation, resending until answered (best effort). A
    resend is a new observation with a new seq_id, as a client's is: the server drops a seq_id it
    has served already (`replayed`), so resending the same one after a late chunk would never be
    answered."""
    assert wait_for(lambda: session.query(app_key.status, 0.3))
    rng = np.random.default_rng(7)
    for rnd in range(first, first + rounds):
        deadline = time.monotonic() + 10
        pending = list(robots)
        attempt = 0
        while pending and time.monotonic() < deadline and attempt < ATTEMPTS:
            for robot in pending:
                (sender or Robot.send)(robot, rnd * ATTEMPTS + attempt, rng)
            attempt += 1
            wait_for(lambda: all(r.answered_round(rnd) for r in pending), 1.0)
            pending = [r for r in pending if not r.answered_round(rnd)]
        assert not pending, [r.client_id for r in pending]


@pytest.fixture
def session(port):
    with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as s:
        yield s


@pytest.mark.parametrize("scheduler", ["fifo", "round_robin", "wait_ratio"])
def test_clients_are_batched_and_each_gets_exactly_its_own_chunk(port, app_key, session, scheduler):
    with PolicyServer(manifest(port, app_key, scheduler=scheduler)) as server:
        robots = [Robot(session, app_key, c) for c in ("r1", "r2", "r3", "r4")]
        run_rounds(server, session, app_key, robots, 4)
        for robot in robots:
            robot.check()
        model = server.models[0]
        assert max(model.session_table.batch_sizes) > 1 and max(model.session_table.batch_sizes) <= 4
        metrics, _ = server.telemetry_figures(model)
        assert metrics["batch_size_mean"] > 1.0
        assert metrics["inferences"] == sum(model.session_table.batch_sizes)


def test_a_failing_batch_is_served_again_one_by_one(port, app_key, session):
    runner = FlakyPolicy(synthetic_config(latency_ms=100))
    with PolicyServer(manifest(port, app_key), runners={app_key.model: runner}) as server:
        robots = [Robot(session, app_key, c) for c in ("r1", "r2", "r3")]
        bad = Robot(session, app_key, "bad")
        stop = threading.Event()

        def keep_bad_waiting():
            rng, i = np.random.default_rng(1), 0
            while not stop.is_set():
                bad.send(i, rng)
                i += 1
                time.sleep(0.01)

        t = threading.Thread(target=keep_bad_waiting)
        t.start()
        mixed = lambda: any("bad" in b and len(b) > 1 for b in runner.batches)  # noqa: E731
        try:
            run_rounds(server, session, app_key, robots, 3)
            # Whether bad's observation lands in the same pass as the robots' is a race (the passes can
            # phase-lock into [r1, r2, r3], [bad], ...); keep going, round by round, until it has.
            rounds = 3
            while not mixed() and rounds < 30:
                run_rounds(server, session, app_key, robots, 1, first=rounds)
                rounds += 1
        finally:
            stop.set()
            t.join()
        for robot in robots:
            robot.check()
        assert bad.chunks == []
        assert mixed(), runner.batches
        assert server.models[0].adapter.batch_fallbacks >= 1
        clients = server.stats()[app_key.prefix]["clients"]
        assert clients["bad"]["rejected"].get("inference_error", 0) >= 1
        assert all(clients[c]["rejected"] == {} for c in ("r1", "r2", "r3"))


def test_bad_observations_are_rejected_before_batching(port, app_key, session):
    with PolicyServer(manifest(port, app_key, scheduler="wait_ratio")) as server:
        robots = [Robot(session, app_key, c) for c in ("r1", "r2")]
        bad = Robot(session, app_key, "bad")

        def send_with_garbage(robot, seq_id, rng):
            Robot.send(robot, seq_id, rng)
            bad.pub.put(b"\x93garbage")
            Robot.send(bad, seq_id, rng, state_dim=3)

        run_rounds(server, session, app_key, robots, 3, sender=send_with_garbage)
        for robot in robots:
            robot.check()
        rejected = server.stats()[app_key.prefix]["clients"]["bad"]["rejected"]
        assert {"bad_msgpack", "wrong_state_dim"} & set(rejected), rejected
        assert bad.chunks == []


def test_a_runner_that_cannot_batch_serves_one_at_a_time(port, app_key, session):
    runner = LoopOnlyPolicy(synthetic_config(latency_ms=20))
    with PolicyServer(manifest(port, app_key), runners={app_key.model: runner}) as server:
        assert server.models[0].max_batch_size == 1
        robots = [Robot(session, app_key, c) for c in ("r1", "r2", "r3")]
        run_rounds(server, session, app_key, robots, 2)
        for robot in robots:
            robot.check()
        assert set(server.models[0].session_table.batch_sizes) == {1}


def test_max_batch_size_defaults_to_one_and_is_validated(port, app_key):
    m = manifest_dict(port, app_key)
    entry = m["server"][0]
    entry.pop("max_batch_size")
    assert parse_manifest(m).server[0].max_batch_size == 1
    entry["max_batch_size"] = 0
    with pytest.raises(ConfigError, match="max_batch_size"):
        parse_manifest(m)


# -- ACT and Diffusion: batched equals one at a time ---------------------------------------------

TINY = {
    "act": {"dim_model": 64, "n_heads": 2, "dim_feedforward": 128, "n_encoder_layers": 1,
            "n_decoder_layers": 1, "n_vae_encoder_layers": 1, "latent_dim": 8},
    "diffusion": {"down_dims": (32, 64), "num_inference_steps": 3, "spatial_softmax_num_keypoints": 8,
                  "diffusion_step_embed_dim": 32, "crop_shape": (40, 56), "n_obs_steps": 2},
}
MODEL_CAMS = {"front": (48, 64)}


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", ["act", "diffusion"])
def test_lerobot_batched_inference_equals_per_request(tmp_path, policy_type):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.runners import load_policy_runner

    path = build_checkpoint(tmp_path / policy_type, policy_type=policy_type, state_names=("s0", "s1", "s2", "s3"),
                            action_names=("a0", "a1", "a2", "a3"), cameras=MODEL_CAMS, chunk_size=8, fps=30,
                            overrides=TINY[policy_type],
                            stats={"action": {"mean": [1.0, -2.0, 0.5, 3.0], "std": [2.0, 0.5, 1.0, 4.0],
                                              "min": [-5.0] * 4, "max": [5.0] * 4}}, seed=3)
    batched, alone = load_policy_runner(path), load_policy_runner(path)
    rng = np.random.default_rng(11)
    for step in range(2):  # twice, so that Diffusion's per-client history is exercised
        reqs = [request(f"c{i}", 100 * step + i, rng, MODEL_CAMS) for i in range(5)]
        out = [result.actions for result in batched.run(reqs)]
        assert len(out) == 5
        for r, chunk in zip(reqs, out, strict=True):
            expected = alone.infer(r.session_id, r.state, r.images, r.task, seed=r.seed)
            assert chunk.shape == expected.shape == (8, 4) and chunk.dtype == np.float32
            np.testing.assert_allclose(chunk, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(PolicyError):
        bad = request("x", 0, rng, MODEL_CAMS)
        batched.run([reqs[0], InferenceRequest("x", bad.state[:2], bad.images, "", 0)])
