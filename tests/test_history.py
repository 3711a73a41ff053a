"""Observation history sent by the client (Observation.history, protocol 1.1): the wire, the
executor's checks, and Diffusion conditioning on the robot's own frames 1/fps apart rather than on
the observations the server happened to serve (docs/policies.md, "Observation history")."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import ProtocolError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.messages import HistoryFrame, Observation  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest  # noqa: E402

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
CAMERAS = {"front": (48, 64), "wrist": (48, 64)}


def frame(rng) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    state = rng.normal(size=len(STATE_NAMES)).astype(np.float32)
    return state, {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in CAMERAS.items()}


def jpegs(images):
    return {c: codec.encode_jpeg(img, 90) for c, img in images.items()}


def test_history_round_trips_and_is_omitted_when_empty():
    rng = np.random.default_rng(0)
    past = [HistoryFrame(*(lambda s, i: (s, jpegs(i)))(*frame(rng))) for _ in range(2)]
    obs = Observation(5, "robot", np.zeros(4, np.float32), {}, "t", history=tuple(past))
    back = codec.decode_observation(codec.encode(obs))
    assert len(back.history) == 2
    for a, b in zip(back.history, past, strict=True):
        assert np.array_equal(a.state, b.state) and a.images == b.images
    plain = codec.encode(Observation(5, "robot", np.zeros(4, np.float32), {}, "t"))
    assert b"history" not in plain


def test_malformed_history_is_a_counted_reason():
    good = codec.encode(Observation(1, "r", np.zeros(2, np.float32), {}, "t",
                                    history=(HistoryFrame(np.zeros(2, np.float32), {}),) * 17))
    with pytest.raises(ProtocolError) as info:
        codec.decode_observation(good)
    assert info.value.reason == "bad_history"


@pytest.fixture(scope="module")
def diffusion(tmp_path_factory):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.runners import load_policy_runner

    folder = build_checkpoint(
        tmp_path_factory.mktemp("history") / "diffusion", policy_type="diffusion", state_names=STATE_NAMES,
        action_names=STATE_NAMES, cameras=CAMERAS, chunk_size=8, fps=30,
        overrides={"down_dims": (32, 64), "num_inference_steps": 3, "spatial_softmax_num_keypoints": 8,
                   "diffusion_step_embed_dim": 32, "crop_shape": (40, 56), "n_obs_steps": 2})
    return lambda: load_policy_runner(folder)


@pytest.mark.slow
def test_diffusion_with_client_history_equals_the_frames_served_one_step_apart(diffusion):
    """A session fed frames f0, f1 one control step apart gives, at f1, the chunk that a request
    carrying f1 and history [f0] gives, whatever that second session was served before."""
    rng = np.random.default_rng(1)
    f0, f1, other = frame(rng), frame(rng), frame(rng)
    runner = diffusion()
    assert runner.spec.capabilities.history_length == 2
    runner.run([InferenceRequest("stepwise", *f0, "t", seed=1)])
    expected = runner.run([InferenceRequest("stepwise", *f1, "t", seed=9)])[0].actions

    fresh = diffusion()
    fresh.run([InferenceRequest("sparse", *other, "t", seed=2)])  # a frame k steps earlier, served
    got = fresh.run([InferenceRequest("sparse", *f1, "t", seed=9, history=(f0,))])[0].actions
    assert np.array_equal(got, expected)
    # without history the same session conditions on what it was served: another chunk
    served = diffusion()
    served.run([InferenceRequest("sparse", *other, "t", seed=2)])
    assert not np.array_equal(served.run([InferenceRequest("sparse", *f1, "t", seed=9)])[0].actions, expected)


@pytest.mark.slow
def test_executor_decodes_the_last_frames_a_model_needs_and_rejects_bad_ones(diffusion):
    from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter

    runner = diffusion()
    executor = RunnerAdapter("m", runner, actions_per_chunk=8, server_id="s")
    try:
        rng = np.random.default_rng(2)
        frames = [frame(rng) for _ in range(4)]
        history = tuple(HistoryFrame(s, jpegs(i)) for s, i in frames[:3])
        state, images = frames[3]
        request = executor.prepare("robot", Observation(3, "robot", state, jpegs(images), "t", history=history))
        assert len(request.history) == 1  # n_obs_steps 2: the last frame before this one
        assert np.array_equal(request.history[0][0], frames[2][0])
        assert request.history[0][1]["front"].shape == (48, 64, 3)

        bad = (HistoryFrame(frames[2][0], {"front": jpegs(frames[2][1])["front"]}),)
        with pytest.raises(ProtocolError) as info:
            executor.prepare("robot", Observation(4, "robot", state, jpegs(images), "t", history=bad))
        assert info.value.reason == "bad_history"
        bad = (HistoryFrame(np.zeros(3, np.float32), jpegs(frames[2][1])),)
        with pytest.raises(ProtocolError, match="bad_history"):
            executor.prepare("robot", Observation(5, "robot", state, jpegs(images), "t", history=bad))
    finally:
        executor.close()


@pytest.mark.slow
def test_a_robot_sending_its_history_over_zenoh_gets_the_stepwise_chunk(diffusion, port, app_key, tmp_path):
    """Over real Zenoh: a robot that asks only every few steps but sends its previous frame gets the
    chunk of a model fed both frames one step apart, not the one of the frames it was served."""
    import threading
    import time

    from lerobot_zenoh.server.model.runner_adapter import request_seed
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings
    from lz_testing import wait_for

    runner = diffusion()
    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "s0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": app_key.model, "model_version": app_key.version,
                    "application_tag": app_key.app, "pretrained_path": str(runner.path), "fps": 30,
                    "clients": [{"client_uuid": "robot"}]}],
    })
    server = PolicyServer(manifest).start()
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    chunks, arrived = {}, threading.Condition()

    def on_chunk(_key, payload):
        chunk = codec.decode_action_chunk(payload)
        with arrived:
            chunks[chunk.response_to_seq_id] = chunk
            arrived.notify_all()

    def request(obs):
        pub.put(codec.encode(obs))
        deadline = time.monotonic() + 60
        with arrived:
            while obs.seq_id not in chunks and time.monotonic() < deadline:
                if not arrived.wait(timeout=1.0):
                    pub.put(codec.encode(obs))
        return chunks.get(obs.seq_id)

    try:
        key = app_key.client("robot")
        session.subscribe(key.action, on_chunk)
        pub = session.publisher(key.obs, OBSERVATION_QOS)
        assert wait_for(lambda: session.query(app_key.status, 0.3), 20)
        rng = np.random.default_rng(5)
        (s_old, i_old), (s0, i0), (s1, i1) = frame(rng), frame(rng), frame(rng)
        j_old, j0, j1 = jpegs(i_old), jpegs(i0), jpegs(i1)
        assert request(Observation(1, "robot", s_old, j_old, "t", episode_id="0", session_nonce=1)) is not None
        got = request(Observation(2, "robot", s1, j1, "t", episode_id="0", session_nonce=1,
                                  history=(HistoryFrame(s0, j0),)))
        assert got is not None

        decoded = lambda j: {c: codec.decode_jpeg(b) for c, b in j.items()}  # noqa: E731
        stepwise = diffusion()
        stepwise.run([InferenceRequest("x", s0, decoded(j0), "t", seed=0)])
        expected = stepwise.run([InferenceRequest("x", s1, decoded(j1), "t", seed=request_seed("robot", 2))])[0]
        np.testing.assert_allclose(got.actions, expected.actions[: len(got.actions)], rtol=0, atol=1e-5)
    finally:
        session.close()
        server.stop()
