"""The execution horizon of flow-matching VLAs: the runner captures each Euler step's update through
LeRobot's per-step hook (bit for bit the same chunk, per row in a batch, RTC-guided steps as taken),
and the server turns them into `ActionChunk.execution_horizon` (docs/policies.md, "Refinement
(denoising) updates"; docs/scheduling.md, "Execution horizon").

Tiny SmolVLA / pi0 / pi0.5 checkpoints built offline like tests/test_rtc_server.py's, with fewer flow
steps."""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.protocol.messages import RtcInputs  # noqa: E402
from lerobot_zenoh.scheduling.horizon import DiffusionConfidenceHorizon  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest, LoadOptions, RtcSettings, load_policy_runner  # noqa: E402
from lerobot_zenoh.server.runners.base import RTC_EXTRA  # noqa: E402

pytestmark = pytest.mark.slow

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
CAMERAS = {"front": (48, 64)}
CHUNK = 10
STEPS = 5
ACTION_MEAN = np.array([10.0, -20.0, 0.5, 3.0], dtype=np.float32)
ACTION_STD = np.array([2.0, 0.5, 1.0, 4.0], dtype=np.float32)
TASKS = ("pick up the red cube", "open the drawer")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny smolvla / pi0 / pi05 checkpoints, built once per module, lazily."""
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    root, lock, built = tmp_path_factory.mktemp("fm_horizon"), threading.Lock(), {}

    def get(policy_type: str) -> Path:
        with lock:
            if policy_type not in built:
                steps = {"num_steps": STEPS} if policy_type == "smolvla" else {"num_inference_steps": STEPS}
                built[policy_type] = build_checkpoint(
                    root / policy_type, policy_type=policy_type, state_names=STATE_NAMES, action_names=STATE_NAMES,
                    cameras=CAMERAS, chunk_size=CHUNK, fps=30, overrides=steps,
                    stats={"action": {"mean": ACTION_MEAN.tolist(), "std": ACTION_STD.tolist()}})
            return built[policy_type]

    return get


@pytest.fixture(scope="module")
def checkpoint(checkpoints) -> Path:
    return checkpoints("smolvla")


@pytest.fixture(scope="module")
def runners(checkpoints):
    lock, loaded = threading.Lock(), {}

    def get(rtc: bool, policy_type: str = "smolvla"):
        with lock:
            if (policy_type, rtc) not in loaded:
                options = LoadOptions(rtc=RtcSettings(enabled=True, execution_horizon=8) if rtc else RtcSettings())
                loaded[policy_type, rtc] = load_policy_runner(checkpoints(policy_type), options=options)
            return loaded[policy_type, rtc]

    return get


def test_diffusion_confidence_defaults_to_the_threshold_of_the_models_kind_of_steps():
    from lerobot_zenoh.scheduling.horizon import DEFAULT_THRESHOLDS
    from lerobot_zenoh.server.config.manifest import parse_manifest

    def built(horizon, kind):
        manifest = parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "server": [
            {"model_id": "m", "model_version": "v", "application_tag": "a", "pretrained_path": "x",
             "accept_unknown_clients": True, "horizon": horizon}]})
        return manifest.server[0].horizon.build(kind)

    assert DEFAULT_THRESHOLDS == {"denoising": 0.4, "flow_matching": 0.6}
    assert built({"type": "diffusion_confidence"}, "denoising").threshold == 0.4
    assert built({"type": "diffusion_confidence"}, "flow_matching").threshold == 0.6
    explicit = built({"type": "diffusion_confidence", "threshold": 0.25, "h_min": 3}, "flow_matching")
    assert (explicit.threshold, explicit.h_min) == (0.25, 3)  # a set threshold wins


def request(session: str, task: str, seed: int, rows: int | None = None, delay: int = 0) -> InferenceRequest:
    rng = np.random.default_rng(seed)
    state = (ACTION_MEAN + ACTION_STD * rng.normal(size=len(STATE_NAMES))).astype(np.float32)
    images = {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam, (h, w) in CAMERAS.items()}
    extras = {}
    if rows is not None:
        prefix = (ACTION_MEAN + ACTION_STD * rng.normal(size=(rows, len(STATE_NAMES)))).astype(np.float32)
        extras = {RTC_EXTRA: RtcInputs(prefix, delay)}
    return InferenceRequest(session, state, images, task, seed, extras=extras)


def final_sample(runner, seed: int, updates: np.ndarray) -> np.ndarray:
    """The loop's start (the request's noise) + every captured update, unnormalized: the chunk."""
    import torch

    noise = runner._noise(seed)[:, : len(STATE_NAMES)].numpy()
    with torch.no_grad():
        return runner.postprocessor(torch.from_numpy(noise + updates.sum(axis=0))[None]).numpy()[0]


@pytest.mark.parametrize("policy_type", ["smolvla", "pi0", "pi05"])
@pytest.mark.parametrize("rtc", [False, True], ids=["plain", "rtc"])
def test_capture_leaves_a_batch_bit_for_bit_and_gives_each_row_its_own_steps(runners, rtc, policy_type):
    runner = runners(rtc, policy_type)
    caps = runner.spec.capabilities
    assert caps.refinement_updates and caps.refinement_kind == "flow_matching" and caps.rtc == rtc
    # Two rows with different tasks, noise and (with RTC) different prefixes and delays.
    rs = [request("a", TASKS[0], seed=11, rows=9 if rtc else None, delay=2),
          request("b", TASKS[1], seed=12, rows=6 if rtc else None, delay=5)]
    plain = runner.run(rs)
    captured = runner.run(rs, capture_updates=True)
    for p, c, r in zip(plain, captured, rs, strict=True):
        assert p.refinement_updates is None
        np.testing.assert_array_equal(c.actions, p.actions)  # capture changes nothing
        assert c.refinement_updates.shape == (STEPS, CHUNK, len(STATE_NAMES))
        assert c.refinement_updates.dtype == np.float32 and np.isfinite(c.refinement_updates).all()
        # The steps as the loop took them (guided ones included): they add up to the chunk.
        np.testing.assert_allclose(final_sample(runner, r.seed, c.refinement_updates), c.actions, rtol=1e-5, atol=1e-4)
        # Each row's own steps: the row alone gives the same.
        [alone] = runner.run([r], capture_updates=True)
        np.testing.assert_allclose(alone.refinement_updates, c.refinement_updates, rtol=1e-4, atol=1e-5)
        h = DiffusionConfidenceHorizon(0.4).horizon(CHUNK, c.refinement_updates)
        assert 1 <= h <= CHUNK
    assert not np.allclose(captured[0].refinement_updates, captured[1].refinement_updates)
    # The hook is off again: the processor records nothing outside a capturing call.
    assert not runner.policy.model.rtc_processor.is_debug_enabled()


def test_rtc_guided_steps_differ_from_plain_ones(runners):
    """With a prefix, the captured steps are the guided ones (not the model's raw velocity)."""
    r = request("a", TASKS[0], seed=21, rows=9, delay=3)
    [guided] = runners(True).run([r], capture_updates=True)
    [unguided] = runners(False).run([InferenceRequest(r.session_id, r.state, r.images, r.task, r.seed)],
                                    capture_updates=True)
    assert np.abs(guided.refinement_updates[:, :3] - unguided.refinement_updates[:, :3]).max() > 0.1


def test_the_server_sends_the_horizon_of_a_vlas_captured_steps(checkpoint, port, app_key):
    """Over Zenoh: a SmolVLA served with `diffusion_confidence`; each chunk's H is the policy's H of
    the updates the runner captured for that request."""
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import Observation
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings
    from lz_testing import wait_for

    threshold = 0.1  # low: some chunks get H < chunk on random weights
    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "pretrained_path": str(checkpoint), "accept_unknown_clients": True, "max_batch_size": 4,
                    "horizon": {"type": "diffusion_confidence", "threshold": threshold}}],
    })
    runner = load_policy_runner(checkpoint)
    captured: dict[int, np.ndarray] = {}
    run = runner.run

    def recording(requests, *, capture_updates=False):
        results = run(requests, capture_updates=capture_updates)
        if capture_updates:
            captured.update((r.seed, result.refinement_updates) for r, result in zip(requests, results, strict=True))
        return results

    runner.run = recording  # the real runner, keeping what it captured
    chunks = []
    with PolicyServer(manifest, runners={app_key.model: runner}) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        executor = server.models[0].adapter
        assert executor.capture_updates and executor.horizon.threshold == threshold
        key = app_key.client("r1")
        session.subscribe(key.action, lambda _k, payload: chunks.append(codec.decode_action_chunk(payload)))
        pub = session.publisher(key.obs, OBSERVATION_QOS)
        assert wait_for(lambda: session.query(app_key.status, 0.3))
        for seq_id in range(3):
            r = request("r1", TASKS[0], seed=30 + seq_id)
            jpegs = {c: codec.encode_jpeg(img) for c, img in r.images.items()}
            pub.put(codec.encode(Observation(seq_id, "r1", r.state, jpegs, r.task)))
            assert wait_for(lambda s=seq_id: any(c.response_to_seq_id == s for c in chunks), 30.0)
    policy = DiffusionConfidenceHorizon(threshold)
    for chunk in chunks:
        updates = captured[(zlib.crc32(b"r1") << 32) ^ chunk.response_to_seq_id]
        assert chunk.execution_horizon == policy.horizon(CHUNK, updates)
