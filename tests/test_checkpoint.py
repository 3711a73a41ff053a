"""Offline checkpoint builder and its console script."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.cli.build_checkpoint import main as cli_main  # noqa: E402
from lerobot_zenoh.errors import ConfigError  # noqa: E402
from lerobot_zenoh.checkpoint_builder.build import build_checkpoint  # noqa: E402
from lerobot_zenoh.server.runners import PolicySpec, RunnerCapabilities, load_policy_runner  # noqa: E402
from lerobot_zenoh.server.runners.lerobot import FEATURES_SIDECAR_NAME  # noqa: E402

# Every test here builds or loads a torch model.
pytestmark = pytest.mark.slow

TINY_ACT = {
    "dim_model": 32,
    "n_heads": 2,
    "dim_feedforward": 64,
    "n_encoder_layers": 1,
    "n_vae_encoder_layers": 1,
}
TINY_DIFFUSION = {"down_dims": (16, 32), "num_inference_steps": 2, "spatial_softmax_num_keypoints": 4}
CAMERAS = {"front": (32, 40)}


def _build(path: Path, **kwargs) -> Path:
    args = dict(
        policy_type="act",
        state_names=("a", "b", "c"),
        action_names=("a", "b", "c"),
        cameras=CAMERAS,
        chunk_size=10,
        fps=25,
        overrides=TINY_ACT,
    )
    args.update(kwargs)
    return build_checkpoint(path, **args)


@pytest.fixture(scope="session")
def act_checkpoint(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("ckpt") / "act")


def test_act_checkpoint_is_a_lerobot_checkpoint(act_checkpoint):
    from lerobot.configs import PreTrainedConfig

    names = {p.name for p in act_checkpoint.iterdir()}
    lerobot_files = {"config.json", "model.safetensors"}
    lerobot_files |= {"policy_preprocessor.json", "policy_postprocessor.json"}
    assert lerobot_files <= names
    assert FEATURES_SIDECAR_NAME in names
    assert not [p for p in act_checkpoint.parent.iterdir() if p.name.startswith(".")]  # no staging left
    config = PreTrainedConfig.from_pretrained(act_checkpoint)
    assert config.type == "act" and config.pretrained_backbone_weights is None
    assert (config.chunk_size, config.n_action_steps, config.dim_model) == (10, 10, 32)
    runner = load_policy_runner(act_checkpoint)
    assert runner.spec == PolicySpec("act", ("a", "b", "c"), CAMERAS, ("a", "b", "c"), chunk_size=10, fps=25,
                                     capabilities=RunnerCapabilities(max_batch=None))
    runner.warmup()


def test_diffusion_horizon_fits_chunk_and_history(tmp_path):
    from lerobot.configs import PreTrainedConfig

    path = _build(tmp_path / "d", policy_type="diffusion", chunk_size=9, overrides=TINY_DIFFUSION)
    config = PreTrainedConfig.from_pretrained(path)
    # 9 actions + (n_obs_steps - 1) past steps = 10, rounded up to the U-Net factor 2**2.
    assert (config.n_obs_steps, config.n_action_steps, config.horizon) == (2, 9, 12)
    runner = load_policy_runner(path)
    state = np.zeros(3, np.float32)
    out = runner.infer("x", state, {"front": np.zeros((32, 40, 3), np.uint8)}, "", seed=0)
    assert out.shape == (9, 3)


def test_seed_fixes_weights_and_leaves_global_rng_alone(tmp_path):
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(99)
    expected_next = torch.rand(3)
    torch.manual_seed(99)
    a = _build(tmp_path / "a", seed=1)
    assert torch.equal(torch.rand(3), expected_next)
    b = _build(tmp_path / "b", seed=1)
    c = _build(tmp_path / "c", seed=2)
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_existing_folder_needs_force_and_must_hold_a_checkpoint(tmp_path):
    path = _build(tmp_path / "ck", chunk_size=4)
    with pytest.raises(ConfigError) as info:
        _build(path)
    assert info.value.field == "output_dir"
    _build(path, chunk_size=6, force=True)
    assert json.loads((path / FEATURES_SIDECAR_NAME).read_text())["chunk_size"] == 6

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no checkpoint"):
        _build(other, force=True)
    assert (other / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _build(empty) == empty and (empty / "config.json").is_file()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy_type": "vqbet"}, "policy_type"),
        ({"cameras": {}}, "cameras"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"state_names": ("a", "a")}, "state_names"),
        ({"overrides": {"no_such_field": 1}}, "overrides.no_such_field"),
        ({"overrides": {"chunk_size": 5}}, "overrides.chunk_size"),
        ({"overrides": {"dim_model": "wide"}}, "overrides.dim_model"),
        ({"overrides": {"n_heads": 7}}, "overrides"),
        ({"stats": {"action": {"mean": [0.0]}}}, "stats.action.mean"),
        ({"stats": {"action": {"std": [1.0, 0.0, 1.0]}}}, "stats.action.std"),
        ({"stats": {"observation.images.front": {}}}, "stats.observation.images.front"),
        (
            {
                "policy_type": "diffusion",
                "cameras": {"a": (32, 40), "b": (32, 32)},
                "overrides": TINY_DIFFUSION,
            },
            "cameras",
        ),
        ({"policy_type": "diffusion", "overrides": {**TINY_DIFFUSION, "horizon": 8}}, "overrides.horizon"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ConfigError) as info:
        _build(tmp_path / "x", **kwargs)
    assert info.value.field == field
    assert not (tmp_path / "x").exists()


# --- console script -----------------------------------------------------------------------


def test_cli_builds_and_prints_path(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = [f"--output={out}", "--state_names=j0,j1", "--action_dim=3", "--cameras=top:32x40"]
    argv += ["--chunk_size=5", "--fps=15", "--overrides={dim_model: 32, n_heads: 2, dim_feedforward: 64, "
             "n_encoder_layers: 1, n_vae_encoder_layers: 1}"]
    assert cli_main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    spec = load_policy_runner(out).spec
    actions = ("action_0", "action_1", "action_2")
    assert spec == PolicySpec("act", ("j0", "j1"), {"top": (32, 40)}, actions, chunk_size=5, fps=15,
                              capabilities=RunnerCapabilities(max_batch=None))


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--state_dim=0"], "--state_dim"),
        (["--state_dim=2", "--cameras=top:32"], "--cameras"),
        (["--state_dim=2", "--overrides=dim_model"], "--overrides"),
        (["--state_dim=2", "--overrides={nope: 1}"], "--overrides"),
        (["--state_names=a,,b"], "--state_names"),
        (["--state_dim=2", "--chunk_size=0"], "--chunk_size"),
        (["--state_dim=2", "--policy_type=vqbet"], "--policy_type"),
        (["--cameras=top:32x40"], "--state_names"),
        (["--state_dim=two"], "--state_dim"),
        (["--state_dim=2", "--sate_dim=2"], "unknown flag --sate_dim=2"),
    ],
)
def test_cli_bad_arguments_exit_2_naming_the_option(tmp_path, capsys, extra, option):
    with pytest.raises(SystemExit) as info:
        cli_main([f"--output={tmp_path / 'x'}", *extra])
    assert info.value.code == 2
    assert option in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_refuses_existing_folder_without_force(act_checkpoint, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main([f"--output={act_checkpoint}", "--state_dim=3"])
    assert info.value.code == 2
    assert "--output" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real size, without building it


def test_full_pi_architectures_are_lerobots_own_sizes_counted_on_the_meta_device():
    """`--architecture=full`: LeRobot 0.6.1's default variants (gemma_2b + gemma_300m expert, SigLIP
    so400m), counted on a model built on the meta device (no 16 GB of weights made)."""
    from lerobot_zenoh.checkpoint_builder.in_memory import parameter_counts

    pi05, pi0 = parameter_counts("pi05", "full"), parameter_counts("pi0", "full")
    # SigLIP so400m/14 at 224 px: 1152 wide x 27 layers (its 1152 -> 2048 projector is in neither part)
    assert pi05["vision_tower"] == pi0["vision_tower"] == 412_442_352
    # gemma_2b: 2048 wide x 18 layers + the 257,152-entry vocabulary table; lm_head untied, same size as it
    assert pi05["language_model"] == pi0["language_model"] == 2_508_531_712
    assert pi05["lm_head"] == 257_152 * 2048
    # gemma_300m expert: pi0.5's adaptive norms make it larger than pi0's
    assert pi0["action_expert"] == 574_788_608 and pi05["action_expert"] == 691_256_320
    assert pi05["total"] == 4_143_404_816 and pi0["total"] == 4_028_019_472
    assert parameter_counts("pi05", "tiny")["total"] < 30e6  # the test preset stays tiny


def test_full_checkpoint_without_weights_declares_lerobots_sizes_and_a_server_refuses_it(tmp_path):
    from lerobot.configs import PreTrainedConfig

    from lerobot_zenoh.errors import PolicyError

    folder = build_checkpoint(tmp_path / "pi05", policy_type="pi05", state_names=("a", "b"), action_names=("a", "b"),
                              cameras={"front": (224, 224)}, chunk_size=50, architecture="full", weights=False)
    assert not (folder / "model.safetensors").exists()
    config = PreTrainedConfig.from_pretrained(folder, local_files_only=True)
    assert (config.paligemma_variant, config.action_expert_variant) == ("gemma_2b", "gemma_300m")
    assert tuple(config.image_resolution) == (224, 224)
    assert "test_architecture" not in json.loads((folder / FEATURES_SIDECAR_NAME).read_text())
    with pytest.raises(PolicyError, match="model.safetensors: missing"):
        load_policy_runner(folder)
    with pytest.raises(ConfigError, match="architecture"):
        build_checkpoint(tmp_path / "fast", policy_type="pi0_fast", state_names=("a",), action_names=("a",),
                         cameras=CAMERAS, chunk_size=10, architecture="full")


def test_in_memory_runner_serves_what_the_saved_checkpoint_serves(tmp_path):
    """The same seed on the same device draws the same weights: the runner built in memory answers as
    the runner loaded from the written checkpoint does (the server's path but for the weights)."""
    from lerobot_zenoh.checkpoint_builder.in_memory import load_in_memory
    from lerobot_zenoh.server.runners import LoadOptions

    cameras = {"front": (32, 32)}
    folder = build_checkpoint(tmp_path / "pi0", policy_type="pi0", state_names=("a", "b"), action_names=("a", "b"),
                              cameras=cameras, chunk_size=8, seed=3)
    saved = load_policy_runner(folder)
    in_memory = load_in_memory(folder, LoadOptions(device="cpu"), seed=3)
    state = np.array([0.1, -0.2], dtype=np.float32)
    images = {"front": np.full((32, 32, 3), 90, dtype=np.uint8)}
    expected = saved.infer("s", state, images, "pick", seed=5)
    assert np.array_equal(in_memory.infer("s", state, images, "pick", seed=5), expected)
    other = load_in_memory(folder, LoadOptions(device="cpu"), seed=4)
    assert not np.array_equal(other.infer("s", state, images, "pick", seed=5), expected)
