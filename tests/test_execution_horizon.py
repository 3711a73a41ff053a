"""The dynamic execution horizon end to end (Kairos 3.1): manifest, Diffusion's captured denoising
updates (and the synthetic policy's simulated ones, batched), the server's
`ActionChunk.execution_horizon`, the client cutting chunks at it.

The pure policies are tested in test_horizon.py.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.client.client import RobotClient  # noqa: E402
from lerobot_zenoh.errors import ConfigError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation  # noqa: E402
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer  # noqa: E402
from lerobot_zenoh.scheduling.horizon import DiffusionConfidenceHorizon  # noqa: E402
from lerobot_zenoh.server.config.manifest import parse_manifest  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest, InferenceResult, load_policy_runner  # noqa: E402
from lerobot_zenoh.server.shell.policy_server import PolicyServer, ServedModel  # noqa: E402
from lerobot_zenoh.server.runners.synthetic import (  # noqa: E402
    SyntheticPolicy,
    SyntheticPolicyConfig,
    synthetic_actions,
    synthetic_denoise_updates,
)
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession  # noqa: E402
from lerobot_zenoh.transport.settings import loopback_settings  # noqa: E402
from lz_testing import CAMS, make_config, wait_for  # noqa: E402

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
ACTION_NAMES = ("shoulder.pos", "elbow.pos", "wrist.pos", "gripper.pos", "base.vel")
CAMERAS = {"front": (48, 64)}
CHUNK = 8
STEPS = 6  # denoising steps: enough for the convergence test to say something


@pytest.fixture(scope="module")
def diffusion_checkpoint(tmp_path_factory):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    return build_checkpoint(
        tmp_path_factory.mktemp("horizon_ckpt") / "diffusion",
        policy_type="diffusion", state_names=STATE_NAMES, action_names=ACTION_NAMES, cameras=CAMERAS,
        chunk_size=CHUNK, fps=30,
        overrides={"down_dims": (32, 64), "num_inference_steps": STEPS, "spatial_softmax_num_keypoints": 8,
                   "diffusion_step_embed_dim": 32, "crop_shape": (40, 56), "n_obs_steps": 2},
        seed=7,
    )


def observation(rng):
    state = rng.normal(size=len(STATE_NAMES)).astype(np.float32)
    images = {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in CAMERAS.items()}
    return state, images


# -- manifest ----------------------------------------------------------------------------------


def entry_dict(**kw):
    return {"cluster_uuid": "c", "experiment_tag": "e", "server": [{
        "model_id": "m", "model_version": "v", "application_tag": "a", "synthetic": {},
        "accept_unknown_clients": True, **kw}]}


def test_manifest_horizon_defaults_to_none_and_builds_policies():
    assert parse_manifest(entry_dict()).server[0].horizon.build() is None
    static = parse_manifest(entry_dict(horizon={"type": "static", "h": 5})).server[0].horizon.build()
    assert static.horizon(50) == 5
    dc = parse_manifest(entry_dict(horizon={"type": "diffusion_confidence", "threshold": 0.2, "h_min": 3}))
    policy = dc.server[0].horizon.build()
    assert (policy.threshold, policy.h_min) == (0.2, 3)


@pytest.mark.parametrize("horizon, field", [
    ({"type": "static"}, "server.0.horizon.h"),  # required by static's config class
    ({"type": "static", "h": 0}, "server.0.horizon.h"),
    ({"type": "diffusion_confidence", "h": 4}, "server.0.horizon"),
    ({"type": "diffusion_confidence", "threshold": -1}, "server.0.horizon.threshold"),
    ({"type": "diffusion_confidence", "h_min": 0}, "server.0.horizon.h_min"),
    ({"type": "sometimes"}, "server.0.horizon.type"),
    ({"type": "static", "h": 4, "extra": 1}, "server.0.horizon.extra"),
])
def test_manifest_horizon_errors_name_the_field(horizon, field):
    with pytest.raises(ConfigError) as info:
        parse_manifest(entry_dict(horizon=horizon))
    assert info.value.field == field


# -- the Diffusion runner ------------------------------------------------------------------------


def test_diffusion_updates_come_from_the_real_loop_and_leave_the_sample_unchanged(diffusion_checkpoint):
    import torch

    runner = load_policy_runner(diffusion_checkpoint)
    assert runner.spec.capabilities.refinement_updates
    rng = np.random.default_rng(3)
    stream = [observation(rng) for _ in range(3)]
    for i, (state, images) in enumerate(stream):
        seed = 100 + i
        plain = runner.infer("plain", state, images, "t", seed=seed)
        [info] = runner.run([InferenceRequest("captured", state, images, "t", seed)], capture_updates=True)
        np.testing.assert_array_equal(info.actions, plain)  # bit for bit: capturing changes nothing
        assert info.refinement_updates.shape == (STEPS, CHUNK, len(ACTION_NAMES))
        assert np.isfinite(info.refinement_updates).all() and np.abs(info.refinement_updates).sum() > 0
        # The updates are the loop's own: initial noise + all updates = the final (normalized) sample.
        cfg = runner.policy.config
        noise = torch.randn((1, cfg.horizon, len(ACTION_NAMES)), generator=torch.Generator().manual_seed(seed))
        start = cfg.n_obs_steps - 1
        final = noise[0, start:start + CHUNK].numpy() + info.refinement_updates.sum(axis=0)
        with torch.inference_mode():
            unnormalized = runner.postprocessor(torch.from_numpy(final)[None]).numpy()[0]
        np.testing.assert_allclose(unnormalized, plain, rtol=1e-4, atol=1e-4)
        assert "step" not in vars(runner.policy.diffusion.noise_scheduler)  # the wrapper is gone afterwards
        # H as the pure policy computes it from these updates, within [h_min, chunk].
        for threshold, h_min in ((0.0, 1), (0.4, 2), (10.0, 3)):
            h = DiffusionConfidenceHorizon(threshold, h_min).horizon(CHUNK, info.refinement_updates)
            assert h_min <= h <= CHUNK


# -- server over Zenoh -----------------------------------------------------------------------------


class RecordingRunner:
    """The real runner, keeping what each `run` that captured updates returned (by seed)."""

    def __init__(self, runner):
        self._runner = runner
        self.spec = runner.spec
        self.infos: dict[int, InferenceResult] = {}

    def warmup(self):
        self._runner.warmup()

    def forget(self, session_id):
        self._runner.forget(session_id)

    def check_request(self, request):
        self._runner.check_request(request)

    def run(self, requests, *, capture_updates=False):
        results = self._runner.run(requests, capture_updates=capture_updates)
        if capture_updates:
            self.infos.update((r.seed, result) for r, result in zip(requests, results, strict=True))
        return results


def test_server_sends_the_horizon_the_policy_computes_from_the_captured_updates(
        diffusion_checkpoint, port, app_key):
    import zlib

    threshold, h_min = 0.3, 2
    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "pretrained_path": str(diffusion_checkpoint), "accept_unknown_clients": True,
                    "horizon": {"type": "diffusion_confidence", "threshold": threshold, "h_min": h_min}}],
    })
    runner = RecordingRunner(load_policy_runner(diffusion_checkpoint))
    policy = DiffusionConfidenceHorizon(threshold, h_min)
    chunks = []

    def on_chunk(key, payload):
        chunks.append(codec.decode_action_chunk(payload))

    with PolicyServer(manifest, runners={app_key.model: runner}), \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        key = app_key.client("r1")
        session.subscribe(key.action, on_chunk)
        pub = session.publisher(key.obs, OBSERVATION_QOS)
        assert wait_for(lambda: session.query(app_key.status, 0.3))
        rng = np.random.default_rng(5)
        for seq_id in range(4):
            state, images = observation(rng)
            jpegs = {c: codec.encode_jpeg(img) for c, img in images.items()}
            execution = ExecutionInfo(actions_buffered=0, control_period_s=1 / 30)
            pub.put(codec.encode(Observation(seq_id, "r1", state, jpegs, "task", execution)))
            assert wait_for(lambda s=seq_id: any(c.response_to_seq_id == s for c in chunks), 10.0)
    for chunk in chunks:
        seed = (zlib.crc32(b"r1") << 32) ^ chunk.response_to_seq_id
        info = runner.infos[seed]
        np.testing.assert_array_equal(chunk.actions, info.actions)
        assert chunk.execution_horizon is not None and h_min <= chunk.execution_horizon <= CHUNK
        assert chunk.execution_horizon == policy.horizon(CHUNK, info.refinement_updates)


# -- the synthetic policy's simulated confidence ---------------------------------------------------


def expected_h(value, chunk, h_min):
    return min(chunk, max(h_min, 1, round(value)))  # k = clip(round(state), 1, chunk), then h_min, then the chunk


@pytest.mark.parametrize("value", [-3.0, 0.0, 0.4, 1.0, 2.6, 5.0, 7.49, 8.0, 50.0])
@pytest.mark.parametrize("threshold, h_min", [(0.0, 1), (0.4, 2), (2.9, 1), (0.4, 9)])
def test_synthetic_updates_trust_round_state_actions(value, threshold, h_min):
    state = np.array([0.5, value, -1.0], np.float32)
    updates = synthetic_denoise_updates(state, 1, CHUNK, 3)
    assert updates.shape == (4, CHUNK, 3) and updates.dtype == np.float32
    h = DiffusionConfidenceHorizon(threshold, h_min).horizon(CHUNK, updates)
    assert h == expected_h(value, CHUNK, h_min)


def test_synthetic_policy_reports_updates_only_with_confidence_from_state():
    names = dict(state_dim=2, cameras={}, action_dim=1, chunk_size=CHUNK)
    plain = SyntheticPolicy(SyntheticPolicyConfig(**names))
    assert not plain.spec.capabilities.refinement_updates
    state = np.array([3.0, 0.0], np.float32)
    [info] = plain.run([InferenceRequest("c", state, {}, "", 0)], capture_updates=True)  # ignored: cannot
    assert info.refinement_updates is None
    np.testing.assert_array_equal(info.actions, plain.infer("c", state, {}, "", seed=0))
    policy = SyntheticPolicy(SyntheticPolicyConfig(**names, confidence_from_state=0))
    assert policy.spec.capabilities.refinement_updates
    [info] = policy.run([InferenceRequest("c", state, {}, "", 0)], capture_updates=True)
    np.testing.assert_array_equal(info.actions, synthetic_actions(state, {}, CHUNK, 1))
    assert DiffusionConfidenceHorizon(0.4).horizon(CHUNK, info.refinement_updates) == 3
    with pytest.raises(ConfigError) as err:
        SyntheticPolicyConfig(**names, confidence_from_state=2)
    assert err.value.field == "confidence_from_state"


def test_synthetic_batch_with_info_sleeps_once(monkeypatch):
    slept = []
    monkeypatch.setattr("lerobot_zenoh.server.runners.synthetic.time.sleep", slept.append)
    policy = SyntheticPolicy(SyntheticPolicyConfig(state_dim=1, cameras={}, action_dim=1, chunk_size=CHUNK,
                                                   batch_latency_ms={1: 10, 4: 16}, confidence_from_state=0))
    reqs = [InferenceRequest(f"c{i}", np.array([float(i + 1)], np.float32), {}, "", i) for i in range(3)]
    infos = policy.run(reqs, capture_updates=True)
    assert slept == [pytest.approx(policy.latency_s(3))]
    assert [DiffusionConfidenceHorizon(0.4).horizon(CHUNK, i.refinement_updates) for i in infos] == [1, 2, 3]


def test_manifest_confidence_from_state_must_be_a_state_index():
    ok = parse_manifest(entry_dict(synthetic={"state_dim": 3, "confidence_from_state": 2}))
    assert ok.server[0].synthetic.confidence_from_state == 2
    for bad in (3, -1, True):
        with pytest.raises(ConfigError) as info:
            parse_manifest(entry_dict(synthetic={"state_dim": 3, "confidence_from_state": bad}))
        assert info.value.field.startswith("server.0.synthetic")


class _FailsWithBad(SyntheticPolicy):
    def run(self, requests, *, capture_updates=False):
        if any(r.session_id == "bad" for r in requests):
            raise RuntimeError("bad is in this batch" if len(requests) > 1 else "bad")
        return super().run(requests, capture_updates=capture_updates)


def test_a_failing_batch_with_info_is_served_again_one_by_one():
    manifest = parse_manifest(entry_dict(horizon={"type": "diffusion_confidence", "h_min": 1}, max_batch_size=4))
    runner = _FailsWithBad(SyntheticPolicyConfig(state_dim=1, cameras={}, action_dim=1, chunk_size=CHUNK,
                                                 confidence_from_state=0))
    model = ServedModel(manifest, manifest.server[0], runner, "gpu0")
    executor = model.adapter
    assert executor.capture_updates and model.max_batch_size == 4
    reqs = [InferenceRequest(c, np.array([v], np.float32), {}, "", 0) for c, v in (("r1", 2), ("bad", 3), ("r2", 6))]
    out = executor.infer(reqs)
    assert executor.batch_fallbacks == 1 and isinstance(out[1], RuntimeError)
    assert [executor.horizon.horizon(CHUNK, out[i].refinement_updates) for i in (0, 2)] == [2, 6]
    out = executor.infer([reqs[0], reqs[2]])  # a good batch: one call, no fallback
    assert executor.batch_fallbacks == 1 and all(isinstance(o, InferenceResult) for o in out)


SYN_CHUNK = 10
SYN_CAMS = {"front": (24, 32)}


def test_server_batches_clients_and_sends_each_the_horizon_its_state_asks_for(port, app_key, monkeypatch):
    """confidence_from_state: 0 on the synthetic model: each client's H = round(state[0]) (clipped, >= h_min),
    computed from the updates of one capturing `run` call shared by several clients."""
    calls: list[list[str]] = []
    run = SyntheticPolicy.run

    def recording(self, requests, *, capture_updates=False):
        if capture_updates:
            calls.append([r.session_id for r in requests])
        return run(self, requests, capture_updates=capture_updates)

    monkeypatch.setattr(SyntheticPolicy, "run", recording)
    h_min = 2
    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "synthetic": {"state_dim": 3, "action_dim": 2, "chunk_size": SYN_CHUNK, "cameras": SYN_CAMS,
                                  "latency_ms": 40, "confidence_from_state": 0},
                    "accept_unknown_clients": True, "max_batch_size": 4,
                    "horizon": {"type": "diffusion_confidence", "threshold": 0.4, "h_min": h_min}}],
    })
    trust = {"r1": 0.0, "r2": 3.0, "r3": 5.4, "r4": 30.0}  # H: h_min, 3, 5, the whole chunk
    chunks: dict[str, list] = {c: [] for c in trust}
    rng = np.random.default_rng(2)
    with PolicyServer(manifest) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        pubs = {}
        for cid in trust:
            key = app_key.client(cid)
            session.subscribe(key.action, lambda k, b, c=cid: chunks[c].append(codec.decode_action_chunk(b)))
            pubs[cid] = session.publisher(key.obs, OBSERVATION_QOS)
        assert wait_for(lambda: session.query(app_key.status, 0.3))
        for seq_id in range(3):  # each round, every client asks at once (resending until answered)
            def answered(s=seq_id):
                return all(any(c.response_to_seq_id == s for c in chunks[cid]) for cid in trust)

            deadline = time.monotonic() + 10
            while not answered():
                assert time.monotonic() < deadline, {cid: len(c) for cid, c in chunks.items()}
                for cid, value in trust.items():
                    state = np.array([value, *rng.normal(size=2)], np.float32)
                    jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8))
                             for n, hw in SYN_CAMS.items()}
                    pubs[cid].put(codec.encode(Observation(seq_id, cid, state, jpegs, "task")))
                wait_for(answered, 1.0)
        model = server.models[0]
        assert model.adapter.capture_updates and model.adapter.batch_fallbacks == 0
    assert any(len(call) > 1 for call in calls), calls  # several clients in one pass
    for cid, value in trust.items():
        assert chunks[cid]
        for chunk in chunks[cid]:
            assert len(chunk.actions) == SYN_CHUNK
            assert chunk.execution_horizon == expected_h(value, SYN_CHUNK, h_min), (cid, chunk.execution_horizon)


# -- the client obeys H ----------------------------------------------------------------------------


class MergeLog(ActionBuffer):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.merged_rows: list[int] = []

    def merge(self, chunk, first_step):
        self.merged_rows.append(len(chunk))
        return super().merge(chunk, first_step)


def test_client_executes_at_most_h_actions_of_each_chunk(port, app_key):
    from lerobot.robots import make_robot_from_config

    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30, "cameras": CAMS,
                                  "latency_ms": 10}, "fps": 30, "accept_unknown_clients": True,
                    "horizon": {"type": "static", "h": 5}}],
    })
    chunks = []
    cfg = make_config(port, app_key)
    with PolicyServer(manifest), \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as mon:
        mon.subscribe(app_key.client("r1").action, lambda k, b: chunks.append(codec.decode_action_chunk(b)))
        client = RobotClient(cfg, make_robot_from_config(cfg.robot), buffer=MergeLog(cfg.aggregate))
        client.start()
        try:
            client.run(duration_s=2.0)
        finally:
            client.close()
    merged = client.buffer.merged_rows
    assert len(merged) >= 5, merged  # a chunk lasts 5 steps, so the client asks often
    assert max(merged) <= 5
    assert chunks and all(c.execution_horizon == 5 and len(c.actions) == 30 for c in chunks)
    assert client.counters.horizon_cut_steps == 25 * client.counters.chunks_received
