"""VLAs (SmolVLA, pi0, pi0.5): tiny checkpoints built offline and served through the same
from_pretrained path as a user's; task conditioning, purity, batching, refused weights and assets,
task_too_long, and two robots over real Zenoh (docs/policies.md, "VLAs")."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import ConfigError, PolicyError, ProtocolError  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest, LoadOptions, load_policy_runner  # noqa: E402
from lerobot_zenoh.server.runners.lerobot import FEATURES_SIDECAR_NAME  # noqa: E402

pytestmark = pytest.mark.slow

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
CAMERAS = {"front": (48, 64), "wrist": (48, 64)}
CHUNK = 10
ACTION_MEAN = [10.0, -20.0, 0.5, 3.0]
ACTION_STD = [2.0, 0.5, 1.0, 4.0]
TASKS = ("pick up the red cube", "open the drawer", "fold the towel on the table", "push the block left")


@pytest.fixture(scope="session")
def vla_checkpoints(tmp_path_factory):
    """Tiny smolvla / pi0 / pi05 checkpoints, each built once per test session, lazily."""
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    root = tmp_path_factory.mktemp("vla_checkpoints")
    built: dict[str, Path] = {}
    lock = threading.Lock()

    def get(policy_type: str) -> Path:
        with lock:
            if policy_type not in built:
                built[policy_type] = build_checkpoint(
                    root / policy_type, policy_type=policy_type, state_names=STATE_NAMES,
                    action_names=STATE_NAMES, cameras=CAMERAS, chunk_size=CHUNK, fps=30,
                    overrides={"num_steps": 3} if policy_type == "smolvla" else {"num_inference_steps": 3},
                    stats={"action": {"mean": ACTION_MEAN, "std": ACTION_STD}},
                )
            return built[policy_type]

    return get


@pytest.fixture(scope="session")
def vla_runners(vla_checkpoints):
    """One loaded runner per type, shared by the tests that only run it."""
    loaded = {}

    def get(policy_type: str):
        if policy_type not in loaded:
            loaded[policy_type] = load_policy_runner(vla_checkpoints(policy_type))
        return loaded[policy_type]

    return get


def request(session: str, task: str, seed: int, rng_seed: int = 0) -> InferenceRequest:
    rng = np.random.default_rng(rng_seed)
    state = rng.normal(size=len(STATE_NAMES)).astype(np.float32)
    images = {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam, (h, w) in CAMERAS.items()}
    return InferenceRequest(session, state, images, task, seed)


def copy_checkpoint(src: Path, dst: Path, *, skip=()) -> Path:
    """A copy whose large files are links (the weights are only read)."""
    dst.mkdir()
    for item in src.iterdir():
        if item.name in skip:
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
        elif item.suffix == ".safetensors":
            os.symlink(item, dst / item.name)
        else:
            shutil.copy(item, dst / item.name)
    return dst


@pytest.mark.parametrize("policy_type", ["smolvla", "pi0", "pi05"])
def test_tiny_vla_loads_and_reads_the_task(vla_runners, policy_type):
    runner = vla_runners(policy_type)
    spec = runner.spec
    assert spec.policy_type == policy_type
    assert spec.state_names == STATE_NAMES and spec.action_names == STATE_NAMES
    assert spec.cameras == CAMERAS and spec.chunk_size == CHUNK
    caps = spec.capabilities
    assert caps.reads_task and caps.max_batch is None and caps.history_length == 1 and not caps.rtc

    base = request("a", TASKS[0], seed=7)
    first = runner.run([base])[0].actions
    assert first.shape == (CHUNK, len(STATE_NAMES)) and first.dtype == np.float32
    assert np.all(np.isfinite(first))
    again = runner.run([base])[0].actions
    other_task = runner.run([dataclasses.replace(base, task=TASKS[1])])[0].actions
    other_seed = runner.run([dataclasses.replace(base, seed=8)])[0].actions
    assert np.array_equal(first, again)  # same task, same noise: the same chunk bit for bit
    assert not np.allclose(first, other_task, atol=1e-6)  # the task conditions the model
    assert not np.allclose(first, other_seed, atol=1e-6)  # the seed is the noise


@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_interleaved_sessions_equal_each_alone(vla_checkpoints, vla_runners, policy_type):
    shared = vla_runners(policy_type)
    a = [request("a", TASKS[0], seed=100 + i, rng_seed=i) for i in range(3)]
    b = [request("b", TASKS[1], seed=200 + i, rng_seed=10 + i) for i in range(3)]
    interleaved = {}
    for ra, rb in zip(a, b, strict=True):
        interleaved[ra.seed] = shared.run([ra])[0].actions
        interleaved[rb.seed] = shared.run([rb])[0].actions
    alone = load_policy_runner(vla_checkpoints(policy_type))  # fresh load, served only this client
    for ra in a:
        assert np.array_equal(alone.run([ra])[0].actions, interleaved[ra.seed])


@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_batch_of_four_with_different_tasks_equals_one_at_a_time(vla_runners, policy_type):
    runner = vla_runners(policy_type)
    requests = [request(f"s{i}", TASKS[i], seed=300 + i, rng_seed=20 + i) for i in range(4)]
    batched = runner.run(requests)
    for r, result in zip(requests, batched, strict=True):
        alone = runner.run([r])[0].actions
        np.testing.assert_allclose(result.actions, alone, rtol=1e-4, atol=1e-5)
    # unnormalized with the checkpoint's action statistics: far from the normalized N(0, 1) scale
    assert abs(float(np.mean([r.actions[:, 1].mean() for r in batched])) - ACTION_MEAN[1]) < 10


def test_task_longer_than_the_tokenizer_reads_is_refused(vla_runners):
    runner = vla_runners("smolvla")
    runner.check_request(request("a", TASKS[0], seed=1))
    long_task = " ".join(["pick up the red cube"] * 40)
    with pytest.raises(ProtocolError) as info:
        runner.check_request(request("a", long_task, seed=1))
    assert info.value.reason == "task_too_long" and str(runner.max_task_tokens) in str(info.value)
    # the status query's count (another thread, another tokenizer instance) is the refusal's
    n = runner.count_task_tokens(long_task)
    assert n > runner.max_task_tokens and f"the task is {n} tokens" in str(info.value)
    assert runner.count_task_tokens(TASKS[0]) <= runner.max_task_tokens


def test_missing_weights_are_refused_naming_the_file(vla_checkpoints, tmp_path):
    folder = copy_checkpoint(vla_checkpoints("pi0"), tmp_path / "pi0", skip={"model.safetensors"})
    with pytest.raises(PolicyError, match=r"model\.safetensors: missing: cannot load"):
        load_policy_runner(folder)


@pytest.mark.parametrize("policy_type", ["pi0", "smolvla"])
def test_mismatched_weights_are_refused_naming_the_file(vla_checkpoints, tmp_path, policy_type):
    """pi0's from_pretrained prints a warning and returns random weights here; the server refuses."""
    from safetensors.torch import load_file, save_file

    src = vla_checkpoints(policy_type)
    folder = copy_checkpoint(src, tmp_path / policy_type, skip={"model.safetensors"})
    tensors = load_file(src / "model.safetensors")
    key = next(k for k, t in tensors.items() if "action_out_proj.weight" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()  # one column short
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PolicyError, match=r"model\.safetensors: the weights did not load"):
        load_policy_runner(folder)

    dropped = dict(load_file(src / "model.safetensors"))
    del dropped[key]
    (folder / "model.safetensors").unlink()
    save_file(dropped, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PolicyError, match=r"missing .*action_out_proj"):
        load_policy_runner(folder)


def test_assets_missing_offline_name_the_manifest_field(vla_checkpoints, tmp_path):
    # pi0: the processor names PaliGemma's tokenizer, which is neither local nor cached here.
    src = vla_checkpoints("pi0")
    folder = copy_checkpoint(src, tmp_path / "pi0")
    sidecar = json.loads((folder / FEATURES_SIDECAR_NAME).read_text())
    del sidecar["assets"]
    (folder / FEATURES_SIDECAR_NAME).write_text(json.dumps(sidecar))
    with pytest.raises(PolicyError, match=r"google/paligemma-3b-pt-224.*set server\[pi\]\.tokenizer_path"):
        load_policy_runner(folder, options=LoadOptions(field_prefix="server[pi]."))
    runner = load_policy_runner(folder, options=LoadOptions(tokenizer_path=src / "tokenizer"))
    assert runner.run([request("a", TASKS[0], seed=3)])[0].actions.shape == (CHUNK, len(STATE_NAMES))
    with pytest.raises(PolicyError, match=r"server\[pi\]\.tokenizer_path: .* does not hold a tokenizer"):
        load_policy_runner(folder, options=LoadOptions(tokenizer_path=tmp_path, field_prefix="server[pi]."))

    # SmolVLA: its VLM config and processor, named by a hub id only.
    folder = copy_checkpoint(vla_checkpoints("smolvla"), tmp_path / "smolvla", skip={"vlm", "tokenizer"})
    config = json.loads((folder / "config.json").read_text())
    config["vlm_model_name"] = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    (folder / "config.json").write_text(json.dumps(config))
    sidecar = json.loads((folder / FEATURES_SIDECAR_NAME).read_text())
    del sidecar["assets"]
    (folder / FEATURES_SIDECAR_NAME).write_text(json.dumps(sidecar))
    with pytest.raises(PolicyError, match=r"VLM config and processor 'HuggingFaceTB/.*set server\[s\]\.vlm_path"):
        load_policy_runner(folder, options=LoadOptions(field_prefix="server[s]."))
    runner = load_policy_runner(folder, options=LoadOptions(vlm_path=vla_checkpoints("smolvla") / "vlm"))
    assert runner.spec.policy_type == "smolvla"


def test_tiny_checkpoints_build_their_sizes_without_modifying_lerobot(vla_checkpoints, vla_runners):
    from lerobot.policies.pi0 import modeling_pi0

    names = ("get_gemma_config", "PaliGemmaForConditionalGenerationWithPiGemma", "PI0Pytorch",
             "PaliGemmaWithExpertModel", "PI0Policy")
    before = {name: getattr(modeling_pi0, name) for name in names}
    runner = vla_runners("pi0")
    assert {name: getattr(modeling_pi0, name) for name in names} == before
    assert modeling_pi0.get_gemma_config("gemma_2b").width == 2048  # LeRobot's own sizes
    # The tiny model is an instance of the builder's subclass, sized as its sidecar declares.
    assert type(runner.policy) is not modeling_pi0.PI0Policy
    assert isinstance(runner.policy, modeling_pi0.PI0Policy)
    assert runner.policy.model.paligemma_with_expert.paligemma.config.text_config.hidden_size == 32


def test_a_checkpoint_without_a_test_architecture_loads_through_lerobots_own_class(vla_checkpoints, tmp_path):
    from lerobot.configs import PreTrainedConfig
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy
    from lerobot.policies.pi0_fast.modeling_pi0_fast import PI0FastPolicy

    from lerobot_zenoh.server.runners.flow_matching import FlowMatchingRunner
    from lerobot_zenoh.server.runners.pi0_fast import Pi0FastRunner

    folder = copy_checkpoint(vla_checkpoints("pi0"), tmp_path / "pi0")
    config = PreTrainedConfig.from_pretrained(folder, local_files_only=True)
    assert FlowMatchingRunner.policy_class(folder, config) is not PI0Policy  # as the builder wrote it
    sidecar = json.loads((folder / FEATURES_SIDECAR_NAME).read_text())
    del sidecar["test_architecture"]
    (folder / FEATURES_SIDECAR_NAME).write_text(json.dumps(sidecar))
    # A user's checkpoint: LeRobot's class, which builds LeRobot's sizes (4 B parameters: not built here).
    assert FlowMatchingRunner.policy_class(folder, config) is PI0Policy
    assert Pi0FastRunner.policy_class(folder, types.SimpleNamespace(type="pi0_fast")) is PI0FastPolicy


def test_dtype_and_device_are_checked_at_start_up(vla_checkpoints):
    import torch

    from lerobot_zenoh.server.config.manifest import parse_manifest

    entry = {"model_id": "m", "model_version": "v", "application_tag": "a", "pretrained_path": "x",
             "accept_unknown_clients": True}
    with pytest.raises(ConfigError, match=r"server\.0\.dtype"):
        parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "server": [{**entry, "dtype": "float16"}]})
    if not torch.cuda.is_available():
        with pytest.raises(PolicyError, match=r"server\[m\]\.device: 'cuda' but CUDA is not available"):
            load_policy_runner(vla_checkpoints("smolvla"),
                               options=LoadOptions(device="cuda", field_prefix="server[m]."))

@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_bf16_serves_close_to_fp32(vla_checkpoints, vla_runners, policy_type):
    import torch

    runner = load_policy_runner(vla_checkpoints(policy_type), options=LoadOptions(dtype="bf16"))
    assert torch.bfloat16 in {p.dtype for p in runner.policy.parameters()}
    r = request("a", TASKS[0], seed=4)
    actions = runner.run([r])[0].actions
    assert actions.dtype == np.float32
    fp32 = vla_runners(policy_type).run([r])[0].actions
    np.testing.assert_allclose(actions, fp32, atol=0.05 * float(np.abs(fp32).max()))


def test_bf16_is_refused_for_families_that_cannot_serve_it(tmp_path):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    folder = build_checkpoint(tmp_path / "act", policy_type="act", state_names=STATE_NAMES,
                              action_names=STATE_NAMES, cameras={"front": (32, 32)}, chunk_size=4,
                              overrides={"dim_model": 32, "n_heads": 2, "dim_feedforward": 32,
                                         "n_encoder_layers": 1, "n_decoder_layers": 1,
                                         "n_vae_encoder_layers": 1, "latent_dim": 4})
    with pytest.raises(PolicyError, match=r"server\[m\]\.dtype: 'bf16' is not supported for act"):
        load_policy_runner(folder, options=LoadOptions(dtype="bf16", field_prefix="server[m]."))


# -- two robots over real Zenoh --------------------------------------------------------------------


class TaskRobot:
    """The wire side of a client with its own task string: one observation at a time."""

    def __init__(self, session, app_key, client_id: str, task: str):
        from lerobot_zenoh.protocol import codec
        from lerobot_zenoh.transport.session import OBSERVATION_QOS

        self.codec = codec
        self.key = app_key.client(client_id)
        self.client_id, self.task = client_id, task
        self.chunks: dict[int, object] = {}
        self.arrived = threading.Condition()
        session.subscribe(self.key.action, self._on_chunk)
        self.pub = session.publisher(self.key.obs, OBSERVATION_QOS)
        self.rng = np.random.default_rng(abs(hash(client_id)) % 2**32)

    def _on_chunk(self, key, payload):
        chunk = self.codec.decode_action_chunk(payload)
        with self.arrived:
            self.chunks[chunk.response_to_seq_id] = chunk
            self.arrived.notify_all()

    def request(self, seq_id: int, timeout_s: float = 60.0, task: str | None = None):
        from lerobot_zenoh.protocol.messages import Observation

        state = self.rng.normal(size=len(STATE_NAMES)).astype(np.float32)
        images = {cam: self.codec.encode_jpeg(self.rng.integers(0, 255, (h, w, 3), dtype=np.uint8), 90)
                  for cam, (h, w) in CAMERAS.items()}
        payload = self.codec.encode(Observation(seq_id, self.client_id, state, images, task or self.task,
                                                episode_id="0", session_nonce=1))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pub.put(payload)
            with self.arrived:
                if self.arrived.wait_for(lambda: seq_id in self.chunks, timeout=1.0):
                    return self.chunks[seq_id]
        return None


@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_server_serves_a_vla_to_two_robots_with_different_tasks(vla_checkpoints, port, app_key, policy_type):
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings
    from lz_testing import wait_for

    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{
            "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "pretrained_path": str(vla_checkpoints(policy_type)), "fps": 30, "max_batch_size": 2,
            "clients": [{"client_uuid": "left"}, {"client_uuid": "right"}],
        }],
    })
    server = PolicyServer(manifest).start()
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    try:
        assert wait_for(lambda: session.query(app_key.status, 0.3), 20), "status never answered"
        left = TaskRobot(session, app_key, "left", TASKS[0])
        right = TaskRobot(session, app_key, "right", TASKS[1])
        results = {}
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r.client_id, r.request(1)))
                   for r in (left, right)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        for name in ("left", "right"):
            chunk = results.get(name)
            assert chunk is not None, f"{name} got no chunk"
            assert chunk.actions.shape == (CHUNK, len(STATE_NAMES)) and chunk.actions.dtype == np.float32
        assert not np.allclose(results["left"].actions, results["right"].actions)

        # A task over the tokenizer's length is a counted rejection; the other robot is still served.
        assert left.request(2, timeout_s=3.0, task=" ".join(["open the drawer"] * 60)) is None
        assert wait_for(lambda: server.stats()[app_key.prefix]["clients"]["left"]["rejected"].get("task_too_long"), 10)
        assert right.request(2) is not None
        assert left.request(3) is not None
    finally:
        session.close()
        server.stop()


@pytest.mark.parametrize("policy_type", ["vqbet", "tdmpc"])
def test_a_refused_lerobot_type_is_refused_with_its_reason(tmp_path, policy_type):
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies import make_policy_config

    from lerobot_zenoh.server.runners import REFUSED

    config = make_policy_config(
        policy_type, device="cpu",
        input_features={"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(4,))},
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(4,))})
    config.save_pretrained(tmp_path)
    with pytest.raises(PolicyError) as info:
        load_policy_runner(tmp_path)
    assert f"{policy_type!r} is not served: {REFUSED[policy_type]}" in str(info.value)


def test_every_lerobot_policy_type_is_served_or_refused_with_a_reason():
    import lerobot.policies  # noqa: F401 - registers the config types
    from lerobot.configs import PreTrainedConfig

    from lerobot_zenoh.server.runners import REFUSED, RUNNERS

    known = set(PreTrainedConfig.get_known_choices())
    assert known <= set(RUNNERS) | set(REFUSED), sorted(known - set(RUNNERS) - set(REFUSED))
    assert not set(RUNNERS) & set(REFUSED)


def test_the_status_advertises_what_a_vla_client_must_know(vla_runners):
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import Status

    spec = vla_runners("smolvla").spec
    status = Status(model_id="m", model_version="v", expected_cameras=dict(spec.cameras),
                    action_dim=spec.action_dim, max_actions_per_chunk=spec.chunk_size,
                    observation_features=spec.observation_features(), policy_type=spec.policy_type,
                    action_names=spec.action_names, **spec.status_fields())
    back = codec.decode_status(codec.encode(status))
    assert (back.policy_type, back.chunk_size, back.reads_task, back.history_length, back.rtc) == (
        "smolvla", CHUNK, True, 1, None)
    assert back.observation_features["observation.state"]["names"] == list(STATE_NAMES)
    assert back.expected_cameras == CAMERAS and back.action_names == STATE_NAMES
