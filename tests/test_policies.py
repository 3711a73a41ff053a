"""Policy runners: purity across clients, LeRobot's own inference path, errors, synthetic policy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import ConfigError, PolicyError  # noqa: E402
from lerobot_zenoh.server.runners import (  # noqa: E402
    RUNNERS,
    BaseRunner,
    InferenceRequest,
    PolicyRunner,
    PolicySpec,
    RunnerCapabilities,
    load_policy_runner,
)
from lerobot_zenoh.server.runners.lerobot import FEATURES_SIDECAR_NAME  # noqa: E402
from lerobot_zenoh.server.runners.synthetic import (  # noqa: E402
    CircleMotion,
    SyntheticPolicy,
    SyntheticPolicyConfig,
    circle_actions,
    synthetic_actions,
)

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
ACTION_NAMES = ("shoulder.pos", "elbow.pos", "wrist.pos", "gripper.pos", "base.vel")
CAMERAS = {"front": (48, 64), "wrist": (48, 64)}
ACT_CHUNK = 20
DIFFUSION_CHUNK = 8
# Non-trivial action statistics, so that unnormalization of a whole chunk is actually checked.
ACTION_MEAN = [10.0, -20.0, 0.5, 3.0, 0.0]
ACTION_STD = [2.0, 0.5, 1.0, 4.0, 0.1]

TINY_OVERRIDES = {
    "act": {
        "dim_model": 64,
        "n_heads": 2,
        "dim_feedforward": 128,
        "n_encoder_layers": 1,
        "n_decoder_layers": 1,
        "n_vae_encoder_layers": 1,
        "latent_dim": 8,
    },
    "diffusion": {
        "down_dims": (32, 64),
        "num_inference_steps": 3,
        "spatial_softmax_num_keypoints": 8,
        "diffusion_step_embed_dim": 32,
        "crop_shape": (40, 56),
        "n_obs_steps": 2,
    },
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    root = tmp_path_factory.mktemp("policy_checkpoints")
    out = {}
    for policy_type, chunk in (("act", ACT_CHUNK), ("diffusion", DIFFUSION_CHUNK)):
        out[policy_type] = build_checkpoint(
            root / policy_type,
            policy_type=policy_type,
            state_names=STATE_NAMES,
            action_names=ACTION_NAMES,
            cameras=CAMERAS,
            chunk_size=chunk,
            fps=30,
            overrides=TINY_OVERRIDES[policy_type],
            stats={"action": {"mean": ACTION_MEAN, "std": ACTION_STD, "min": [-5.0] * 5, "max": [5.0] * 5}},
            seed=7,
        )
    return out


def _observation(rng: np.random.Generator) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    state = rng.normal(size=len(STATE_NAMES)).astype(np.float32)
    images = {cam: rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for cam, (h, w) in CAMERAS.items()}
    return state, images


# Three clients, each with its own observation stream; requests interleaved A1 B1 A2 C1 B2 A3 C2 B3.
_ORDER = ["A", "B", "A", "C", "B", "A", "C", "B"]


def _requests():
    rng = np.random.default_rng(1234)
    streams: dict[str, list] = {}
    requests = []
    for i, client in enumerate(_ORDER):
        state, images = _observation(rng)
        step = len(streams.setdefault(client, []))
        req = (client, state, images, f"task of {client}", 1000 * i + 17)
        streams[client].append(req)
        requests.append((client, step, req))
    return requests, streams


def _infer(runner: BaseRunner, req) -> np.ndarray:
    client, state, images, task, seed = req
    return runner.infer(client, state, images, task, seed=seed)


# --- spec ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_observation_features_equal_lerobots():
    from lerobot.utils.feature_utils import hw_to_dataset_features

    spec = PolicySpec("act", STATE_NAMES, CAMERAS, ACTION_NAMES, chunk_size=5, fps=None)
    hw = {**{n: float for n in STATE_NAMES}, **{c: (h, w, 3) for c, (h, w) in CAMERAS.items()}}
    expected = hw_to_dataset_features(hw, "observation", use_video=False)
    expected = json.loads(json.dumps(expected))  # tuples -> lists, as we promise
    assert spec.observation_features() == expected
    assert json.loads(json.dumps(spec.observation_features())) == spec.observation_features()
    assert (spec.state_dim, spec.action_dim) == (4, 5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"state_names": ()}, "state_names"),
        ({"action_names": ("a", "a")}, "action_names"),
        ({"cameras": {"front": (0, 64)}}, "cameras.front"),
        ({"cameras": {"a/b": (4, 4)}}, "cameras"),
        ({"cameras": {"shoulder": (4, 4)}}, "cameras"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"fps": 0}, "fps"),
    ],
)
def test_spec_rejects_bad_values(kwargs, field):
    base = dict(
        policy_type="act", state_names=STATE_NAMES, cameras=CAMERAS, action_names=ACTION_NAMES, chunk_size=5
    )
    with pytest.raises(ConfigError) as info:
        PolicySpec(**{**base, **kwargs})
    assert info.value.field == field


# --- synthetic ----------------------------------------------------------------------------


def test_synthetic_policy_returns_synthetic_actions():
    config = SyntheticPolicyConfig(state_dim=len(STATE_NAMES), cameras=CAMERAS, action_dim=len(ACTION_NAMES), chunk_size=7)
    policy = SyntheticPolicy(config, fps=30)
    assert isinstance(policy, PolicyRunner)
    policy.warmup()
    rng = np.random.default_rng(0)
    state, images = _observation(rng)
    out = policy.infer("A", state, images, "t", seed=3)
    assert out.dtype == np.float32 and out.shape == (7, 5)
    assert np.array_equal(out, synthetic_actions(state, images, 7, 5))
    pixel_mean = np.concatenate([i.ravel() for i in images.values()]).astype(np.float64).mean() / 255
    expected = np.float32(state[4 % 4] + 0.01 * 3 + pixel_mean)
    assert np.isclose(out[2, 4], expected, rtol=0, atol=1e-6)
    # The images count: a changed pixel changes the chunk.
    images["front"][0, 0, 0] ^= 0xFF
    assert not np.array_equal(policy.infer("B", state, images, "t", seed=3), out)


def test_synthetic_without_cameras_and_bad_inputs():
    policy = SyntheticPolicy(SyntheticPolicyConfig(state_dim=1, cameras={}, action_dim=2, chunk_size=2))
    out = policy.infer("A", np.array([1.5], np.float32), {}, "", seed=0)
    assert np.array_equal(out, np.array([[1.51, 1.51], [1.52, 1.52]], np.float32))
    with pytest.raises(PolicyError, match="state"):
        policy.infer("A", np.zeros(2, np.float32), {}, "", seed=0)
    with pytest.raises(PolicyError, match="cameras"):
        policy.infer("A", np.zeros(1, np.float32), {"front": np.zeros((2, 2, 3), np.uint8)}, "", seed=0)


def test_synthetic_declares_what_it_can_do_and_runs_one_result_per_request():
    plain = SyntheticPolicy(SyntheticPolicyConfig(state_dim=1, cameras={}, action_dim=1, chunk_size=2))
    assert plain.spec.capabilities == RunnerCapabilities(max_batch=None)
    policy = SyntheticPolicy(SyntheticPolicyConfig(state_dim=1, cameras={}, action_dim=1, chunk_size=2,
                                                   confidence_from_state=0))
    assert policy.spec.capabilities == RunnerCapabilities(max_batch=None, refinement_updates=True)
    reqs = [InferenceRequest(f"s{i}", np.array([float(i)], np.float32), {}, "", i) for i in range(3)]
    results = policy.run(reqs)  # without capture_updates: no updates
    assert len(results) == 3 and all(r.refinement_updates is None for r in results)
    for req, result in zip(reqs, results, strict=True):
        assert np.array_equal(result.actions, policy.infer(req.session_id, req.state, {}, "", seed=req.seed))


def test_synthetic_latency_profile():
    base = dict(state_dim=1, cameras={}, action_dim=1, chunk_size=1)
    assert SyntheticPolicy(SyntheticPolicyConfig(**base, latency_ms=20)).latency_s(8) == pytest.approx(0.02)
    profile = {1: 10.0, 4: 16.0, 8: 20.0}
    policy = SyntheticPolicy(SyntheticPolicyConfig(**base, latency_ms=5, batch_latency_ms=profile))
    assert policy.latency_s(1) == pytest.approx(0.010)
    assert policy.latency_s(2) == pytest.approx(0.012)
    assert policy.latency_s(6) == pytest.approx(0.018)
    assert policy.latency_s(12) == pytest.approx(0.024)
    with pytest.raises(ConfigError) as info:
        SyntheticPolicyConfig(**base, batch_latency_ms={0: 1.0})
    assert info.value.field == "batch_latency_ms.0" and "key" in str(info.value)
    with pytest.raises(ConfigError) as info:
        SyntheticPolicyConfig(**base, latency_ms=-1)
    assert info.value.field == "latency_ms"


def test_synthetic_circle_goes_round_smoothly_from_where_the_state_is():
    motion = CircleMotion(period_s=4.0, amplitude=40.0, lead_steps=0.0)
    policy = SyntheticPolicy(SyntheticPolicyConfig(state_dim=3, cameras={}, action_dim=3, chunk_size=8, circle=motion),
                             fps=30)
    out = policy.infer("A", np.array([0.0, 25.0, 7.0], np.float32), {}, "", seed=0)  # phase pi/2
    assert out.shape == (8, 3) and np.array_equal(out, circle_actions(np.array([0.0, 25.0, 7.0]), 8, 3, motion, 1 / 30))
    step = 2 * np.pi / 120
    phases = np.pi / 2 + step * np.arange(8)
    assert np.allclose(out[:, 0], 40 * np.cos(phases), atol=1e-4)
    assert np.allclose(out[:, 1], 40 * np.sin(phases), atol=1e-4)
    assert np.abs(np.diff(out, axis=0)).max() <= 40 * step + 1e-4  # smooth: at most A * w * dt per row
    with pytest.raises(ConfigError) as info:
        SyntheticPolicyConfig(state_dim=1, cameras={}, action_dim=1, chunk_size=2, circle=motion)
    assert info.value.field == "circle"
    with pytest.raises(ConfigError) as info:
        SyntheticPolicy(SyntheticPolicyConfig(state_dim=2, cameras={}, action_dim=1, chunk_size=2, circle=motion))
    assert info.value.field == "circle" and "fps" in str(info.value)
    with pytest.raises(ConfigError) as info:
        CircleMotion(period_s=0.0)
    assert info.value.field == "circle.period_s"


def test_manifest_synthetic_circle_builds_the_scripted_runner_and_names_a_bad_field():
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.config.runner_loading import load_runner

    def manifest(synthetic):
        return {"cluster_uuid": "c", "experiment_tag": "e", "server": [{
            "model_id": "m", "model_version": "v", "application_tag": "a", "fps": 30, "synthetic": synthetic,
            "accept_unknown_clients": True}]}

    parsed = parse_manifest(manifest({"state_dim": 2, "action_dim": 2, "chunk_size": 4, "cameras": {},
                                      "circle": {"period_s": 2.0, "amplitude": 10.0}}))
    runner = load_runner(parsed, parsed.server[0])
    assert runner.config.circle == CircleMotion(period_s=2.0, amplitude=10.0, lead_steps=3.0)
    state = np.array([10.0, 0.0], np.float32)
    assert np.array_equal(runner.infer("A", state, {}, "", seed=0),
                          circle_actions(state, 4, 2, runner.config.circle, 1 / 30))
    for bad, field in (({"state_dim": 1, "circle": {}}, "server.0.synthetic"),
                       ({"circle": {"period_s": 0}}, "server.0.synthetic.circle.period_s")):
        with pytest.raises(ConfigError) as info:
            parse_manifest(manifest(bad))
        assert info.value.field.startswith(field)


def test_synthetic_module_does_not_import_torch():
    code = (
        "import sys, numpy as np\n"
        "from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig\n"
        "p = SyntheticPolicy(SyntheticPolicyConfig(state_dim=1, cameras={'c': (2, 2)}, action_dim=1, chunk_size=3))\n"
        "p.warmup(); p.spec.observation_features()\n"
        "assert 'torch' not in sys.modules and 'lerobot' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- LeRobot checkpoints ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("policy_type", "chunk", "capabilities"), [
    ("act", ACT_CHUNK, RunnerCapabilities(max_batch=None)),
    ("diffusion", DIFFUSION_CHUNK, RunnerCapabilities(max_batch=None, history_length=2, refinement_updates=True)),
])
def test_load_gives_spec_from_config_and_sidecar(checkpoints, policy_type, chunk, capabilities):
    runner = load_policy_runner(checkpoints[policy_type])
    assert type(runner) is RUNNERS[policy_type]
    expected = PolicySpec(policy_type, STATE_NAMES, CAMERAS, ACTION_NAMES, chunk_size=chunk, fps=30,
                          capabilities=capabilities)
    assert runner.spec == expected
    runner.warmup()


@pytest.mark.slow
def test_load_without_sidecar_generates_names(checkpoints, tmp_path):
    folder = tmp_path / "act"
    shutil.copytree(checkpoints["act"], folder)
    (folder / FEATURES_SIDECAR_NAME).unlink()
    spec = load_policy_runner(folder).spec
    assert spec.state_names == ("state_0", "state_1", "state_2", "state_3")
    assert spec.action_names == tuple(f"action_{i}" for i in range(5))
    assert spec.cameras == CAMERAS and spec.fps is None and spec.chunk_size == ACT_CHUNK


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", ["act", "diffusion"])
def test_interleaved_clients_get_what_they_would_get_alone(checkpoints, policy_type):
    requests, streams = _requests()
    shared = load_policy_runner(checkpoints[policy_type])
    interleaved: dict[str, list[np.ndarray]] = {}
    for client, _, req in requests:
        out = _infer(shared, req)
        assert out.dtype == np.float32 and out.shape == (shared.spec.chunk_size, len(ACTION_NAMES))
        interleaved.setdefault(client, []).append(out)

    for client, stream in streams.items():
        alone = load_policy_runner(checkpoints[policy_type])  # fresh load, served only this client
        for step, req in enumerate(stream):
            assert np.array_equal(_infer(alone, req), interleaved[client][step]), (client, step)


@pytest.mark.slow
def test_diffusion_history_and_seed_are_used(checkpoints):
    rng = np.random.default_rng(5)
    obs1, obs2 = _observation(rng), _observation(rng)
    runner = load_policy_runner(checkpoints["diffusion"])
    runner.infer("A", *obs1, "", seed=1)
    with_history = runner.infer("A", *obs2, "", seed=2)
    without_history = runner.infer("B", *obs2, "", seed=2)  # B's history is [obs2, obs2]
    assert not np.array_equal(with_history, without_history)
    assert not np.array_equal(runner.infer("C", *obs2, "", seed=3), without_history)
    assert np.array_equal(runner.infer("D", *obs2, "", seed=2), without_history)
    runner.forget("A")
    assert np.array_equal(runner.infer("A", *obs2, "", seed=2), without_history)


def _lerobot_rollout_first_action(checkpoint: Path, observations, seeds) -> list[np.ndarray]:
    """What LeRobot's own synchronous rollout (`select_action`) returns, one fresh episode."""
    import torch
    from lerobot.common.control_utils import predict_action
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies import get_policy_class, make_pre_post_processors
    from lerobot.utils.feature_utils import build_dataset_frame, hw_to_dataset_features

    config = PreTrainedConfig.from_pretrained(checkpoint)
    policy = get_policy_class(config.type).from_pretrained(checkpoint, config=config)
    pre, post = make_pre_post_processors(config, pretrained_path=str(checkpoint))
    hw = {**{n: float for n in STATE_NAMES}, **{c: (h, w, 3) for c, (h, w) in CAMERAS.items()}}
    features = hw_to_dataset_features(hw, "observation", use_video=False)
    out = []
    for (state, images), seed in zip(observations, seeds, strict=True):
        values = {**dict(zip(STATE_NAMES, state.tolist(), strict=True)), **images}
        frame = build_dataset_frame(features, values, prefix="observation")
        if config.type == "diffusion":
            policy._queues["action"].clear()  # force a new chunk from the queued observation history
        else:
            policy.reset()  # ACT would pop the next action of its queued chunk instead
        torch.manual_seed(seed)  # Diffusion samples from the global RNG
        action = predict_action(frame, policy, torch.device("cpu"), pre, post, False, task="t")
        out.append(action.numpy()[0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", ["act", "diffusion"])
def test_first_action_equals_lerobots_own_rollout(checkpoints, policy_type):
    rng = np.random.default_rng(9)
    observations = [_observation(rng) for _ in range(3)]
    seeds = [11, 12, 13]
    expected = _lerobot_rollout_first_action(checkpoints[policy_type], observations, seeds)
    runner = load_policy_runner(checkpoints[policy_type])
    for (state, images), seed, first in zip(observations, seeds, expected, strict=True):
        chunk = runner.infer("A", state, images, "t", seed=seed)
        np.testing.assert_array_equal(chunk[0], first)


@pytest.mark.slow
def test_act_chunk_is_unnormalized_as_a_whole(checkpoints):
    import torch

    runner = load_policy_runner(checkpoints["act"])
    state, images = _observation(np.random.default_rng(3))
    chunk = runner.infer("A", state, images, "t", seed=0)
    with torch.inference_mode():
        raw = runner.policy.predict_action_chunk(runner._preprocess(state, images, "t"))[0].numpy()
    expected = raw * np.array(ACTION_STD) + np.array(ACTION_MEAN)
    np.testing.assert_allclose(chunk, expected, rtol=1e-6, atol=1e-5)
    assert not np.allclose(chunk, raw)


@pytest.mark.slow
def test_infer_rejects_mismatched_observation(checkpoints):
    runner = load_policy_runner(checkpoints["act"])
    state, images = _observation(np.random.default_rng(0))
    with pytest.raises(PolicyError, match="state"):
        runner.infer("A", state[:2], images, "", seed=0)
    with pytest.raises(PolicyError, match="front"):
        runner.infer("A", state, {**images, "front": images["front"][:10]}, "", seed=0)
    with pytest.raises(PolicyError, match="cameras"):
        runner.infer("A", state, {"front": images["front"]}, "", seed=0)


# --- load errors --------------------------------------------------------------------------


def test_missing_path_raises_policy_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(PolicyError, match=str(missing)):
        load_policy_runner(missing)
    with pytest.raises(PolicyError, match="config.json"):
        load_policy_runner(tmp_path)


@pytest.mark.slow
def test_a_policy_type_without_a_runner_is_refused_naming_path_type_and_supported(checkpoints, monkeypatch):
    monkeypatch.delitem(RUNNERS, "act")
    with pytest.raises(PolicyError) as info:
        load_policy_runner(checkpoints["act"])
    message = str(info.value)
    assert str(checkpoints["act"]) in message and "'act'" in message and "supported: diffusion" in message


@pytest.mark.slow
@pytest.mark.parametrize(
    ("file", "mutate", "match"),
    [
        ("model.safetensors", lambda p: p.write_bytes(b"\x00garbage" * 100), "cannot load"),
        ("model.safetensors", lambda p: p.unlink(), "cannot load"),
        ("config.json", lambda p: p.write_text("{not json"), "cannot read"),
        ("policy_preprocessor.json", lambda p: p.unlink(), "cannot load"),
        (
            "config.json",
            lambda p: p.write_text(
                json.dumps({**(d := json.loads(p.read_text())), "input_features": {
                    k: v for k, v in d["input_features"].items() if k != "observation.state"}})
            ),
            "observation.state",
        ),
        (
            FEATURES_SIDECAR_NAME,
            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "state_names": ["a"]})),
            "names do not match",
        ),
    ],
)
def test_corrupted_checkpoint_raises_policy_error(checkpoints, tmp_path, file, mutate, match):
    folder = tmp_path / "broken"
    shutil.copytree(checkpoints["act"], folder)
    mutate(folder / file)
    with pytest.raises(PolicyError, match=match) as info:
        load_policy_runner(folder)
    assert str(folder) in str(info.value)


@pytest.mark.slow
def test_a_fresh_process_loads_a_checkpoint(checkpoints):
    """Nothing else imported first (as in `lerobot-policy-server`): LeRobot's config registry must be filled."""
    code = ("import sys; from lerobot_zenoh.server.runners import load_policy_runner; "
            "print(load_policy_runner(sys.argv[1]).spec.policy_type)")
    out = subprocess.run([sys.executable, "-c", code, str(checkpoints["act"])], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "act"
