"""Real-time chunking in the compiled path (runners/rtc.py, "The closed form"; docs/policies.md,
"Compiled inference"): per-robot guidance for a whole batch of mixed leftovers computed without
autograd, against LeRobot's own autograd guidance, for tiny pi0, pi0.5 and SmolVLA.

The default-suite tests run the runner's compiled path with the eager policy standing in for the
graph (no inductor: seconds); the test that compiles is gated by LZ_TEST_COMPILE=1 (`make test-compile`)."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.protocol.messages import RtcInputs  # noqa: E402
from lerobot_zenoh.server.config.manifest import parse_manifest  # noqa: E402
from lerobot_zenoh.server.config.runner_loading import load_runner  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest  # noqa: E402
from lerobot_zenoh.server.runners.base import RTC_EXTRA, RTC_EXTRA_DELAY  # noqa: E402

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
CAMERAS = {"front": (48, 64), "wrist": (48, 64)}
CHUNK = 10
HORIZON = 8
ACTION_MEAN = np.array([10.0, -20.0, 0.5, 3.0], dtype=np.float32)
ACTION_STD = np.array([2.0, 0.5, 1.0, 4.0], dtype=np.float32)
TASKS = ("pick up the red cube", "open the drawer", "fold the towel on the table", "push the block left")
TYPES = ("pi0", "pi05", "smolvla")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny checkpoints (10 flow steps), built once per session, lazily."""
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    root = tmp_path_factory.mktemp("compiled_rtc")
    built: dict[str, Path] = {}
    lock = threading.Lock()

    def get(policy_type: str) -> Path:
        with lock:
            if policy_type not in built:
                steps = {"num_steps": 10} if policy_type == "smolvla" else {"num_inference_steps": 10}
                built[policy_type] = build_checkpoint(
                    root / policy_type, policy_type=policy_type, state_names=STATE_NAMES, action_names=STATE_NAMES,
                    cameras=CAMERAS, chunk_size=CHUNK, fps=30, overrides=steps,
                    stats={"action": {"mean": ACTION_MEAN.tolist(), "std": ACTION_STD.tolist()}})
            return built[policy_type]

    return get


def runner_for(folder, **kw):
    model = {"model_id": "m", "model_version": "v", "application_tag": "a", "pretrained_path": str(folder),
             "accept_unknown_clients": True, "max_batch_size": 8,
             "rtc": {"enabled": True, "execution_horizon": HORIZON}, **kw}
    m = parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "server": [model]})
    return load_runner(m, m.server[0])


def request(session: str, task: str, seed: int, rows: int | None = None, delay: int = 0) -> InferenceRequest:
    rng = np.random.default_rng(seed)
    state = (ACTION_MEAN + ACTION_STD * rng.normal(size=len(STATE_NAMES))).astype(np.float32)
    images = {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam, (h, w) in CAMERAS.items()}
    extras = {}
    if rows is not None:
        prefix = (ACTION_MEAN + ACTION_STD * rng.normal(size=(rows, len(STATE_NAMES)))).astype(np.float32)
        extras = {RTC_EXTRA: RtcInputs(prefix, delay)}
    return InferenceRequest(session, state, images, task, seed, extras=extras)


def mixed_batch() -> list[InferenceRequest]:
    """Leftovers of different lengths (one shorter than the horizon, one empty), different delays,
    and rows without any."""
    return [request("a", TASKS[0], 31, rows=9, delay=1), request("b", TASKS[1], 32),
            request("c", TASKS[2], 33, rows=4, delay=4), request("d", TASKS[3], 34, rows=10, delay=5),
            request("e", TASKS[0], 35, rows=0, delay=0)]


def closed_form(runner, buckets=(8,)):
    """The runner's compiled path with the eager policy standing in for the graph: what the graph
    computes, without inductor."""
    from lerobot_zenoh.server.runners.compiled import CompiledChunk, CompileSettings

    chunk = CompiledChunk(runner.compile_target(), CompileSettings(mode="default"), buckets, device_type="cpu",
                          name="t", field="server[m].compile")
    chunk._compiled = runner.compile_target()
    chunk.active = chunk.serving = True
    return chunk


def test_the_weight_table_is_lerobots_own_for_every_delay_and_horizon_and_schedule():
    import torch
    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    from lerobot_zenoh.server.runners.rtc import RowwiseRTCProcessor, guidance_weight

    for schedule in RTCAttentionSchedule:
        p = RowwiseRTCProcessor(RTCConfig(enabled=True, prefix_attention_schedule=schedule), num_steps=10,
                                chunk_size=CHUNK)
        rows, delays, horizons = [], [], []
        for h in range(CHUNK + 1):
            for d in range(h + 1):
                rows.append(h)
                delays.append(d)
                horizons.append(h)
        prefix = torch.ones((len(rows), CHUNK, 4))
        guidance = p.row_guidance(prefix, rows, delays, horizons, width=6)
        assert guidance.prefix.shape == (len(rows), CHUNK, 6) and guidance.weights.shape == (len(rows), CHUNK, 1)
        for i, (n, d, h) in enumerate(zip(rows, delays, horizons, strict=True)):
            assert torch.equal(guidance.weights[i, :, 0], p.get_prefix_weights(d, h, CHUNK).float())
            assert guidance.prefix[i, :n, :4].eq(1).all() and guidance.prefix[i, n:].eq(0).all()
            assert guidance.prefix[i, :, 4:].eq(0).all()
    # the guidance weight of each step: LeRobot's float32 expression (the first step: its maximum)
    assert guidance_weight(1.0, 10.0) == 10.0
    assert len(p._guidance) == 10 and p._guidance[1.0] == 10.0
    assert all(0 < w <= 10.0 for w in p._guidance.values())


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", TYPES)
def test_the_closed_form_equals_lerobots_autograd_guidance_per_robot_in_a_mixed_batch(checkpoints, policy_type):
    """The runner's compiled path (the closed form, the graph's inputs padded to its bucket) against
    its eager path (LeRobot's autograd guidance, one delay per row), row by row, fp32 on the CPU."""
    runner = runner_for(checkpoints(policy_type))
    batch = mixed_batch()
    eager = runner.run(batch)
    runner._compiled = closed_form(runner)
    processor, steps = runner.policy.rtc_processor, []
    original = processor._closed_form
    processor._closed_form = lambda *a: steps.append(a[1].shape) or original(*a)  # noqa: SLF001
    try:
        served = runner.run(batch)
        assert steps == [(8, CHUNK, runner._max_action_dim)] * 10  # every Euler step, padded to the bucket
        alone = runner.run(batch[:1])  # a lone row padded to the bucket of 8
        plain = runner.run([dataclasses.replace(r, extras={}) for r in batch[:2]])  # no leftover at all
    finally:
        runner._compiled = None
        del processor._closed_form
    worst = 0.0
    for r, c, e in zip(batch, served, eager, strict=True):
        worst = max(worst, float(np.abs(c.actions - e.actions).max()))
        np.testing.assert_allclose(c.actions, e.actions, rtol=0, atol=1e-5)
        assert c.extras == e.extras
    assert served[0].extras[RTC_EXTRA_DELAY] == 1 and RTC_EXTRA_DELAY not in served[1].extras
    np.testing.assert_allclose(alone[0].actions, eager[0].actions, rtol=0, atol=1e-4)
    runner_plain = runner.run([dataclasses.replace(r, extras={}) for r in batch[:2]])  # eager, unguided
    for a, b in zip(plain, runner_plain, strict=True):
        np.testing.assert_allclose(a.actions, b.actions, rtol=0, atol=1e-5)
    print(f"{policy_type}: closed form vs LeRobot's autograd guidance, batch of 5 mixed: max |diff| {worst:.2e}")


@pytest.mark.slow
def test_smolvlas_static_shape_vision_embeddings_give_the_same_chunks_bit_for_bit(checkpoints):
    """What compiling SmolVLA installs (flow_matching.static_position_ids), eager here."""
    from lerobot_zenoh.server.runners.flow_matching import static_position_ids

    runner = runner_for(checkpoints("smolvla"))
    batch = mixed_batch()
    before = runner.run(batch)
    embeddings = runner.policy.model.vlm_with_expert.get_vlm_model().vision_model.embeddings
    assert static_position_ids(embeddings, "t") and "forward" in vars(embeddings)
    for a, b in zip(before, runner.run(batch), strict=True):
        assert np.array_equal(a.actions, b.actions)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(os.environ.get("LZ_TEST_COMPILE") != "1", reason="compiles with inductor for minutes: make test-compile")
@pytest.mark.parametrize("policy_type", TYPES)
def test_compiled_rtc_equals_eager_rtc_per_robot_in_a_mixed_batch_without_a_graph_break(checkpoints, policy_type):
    """Inductor, one bucket of 8: the mixed batch (5 rows padded to 8) through the graph against the
    eager runner's LeRobot guidance; no graph break, no recompile, no eager call."""
    import torch

    eager = runner_for(checkpoints(policy_type))
    compiled = runner_for(checkpoints(policy_type), compile={"mode": "default", "buckets": [8]})
    torch._dynamo.utils.counters.clear()
    compiled.warmup()
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    frames = dict(torch._dynamo.utils.counters["frames"])
    batch = mixed_batch()
    worst = 0.0
    for c, e in zip(compiled.run(batch), eager.run(batch), strict=True):
        worst = max(worst, float(np.abs(c.actions - e.actions).max()))
        np.testing.assert_allclose(c.actions, e.actions, rtol=0, atol=1e-5)
        assert c.extras == e.extras
    # a batch without any leftover takes the same graph (all weights zero): its plain chunk
    plain = [dataclasses.replace(r, extras={}) for r in batch[:3]]
    for c, e in zip(compiled.run(plain), eager.run(plain), strict=True):
        np.testing.assert_allclose(c.actions, e.actions, rtol=0, atol=1e-5)
    print(f"{policy_type}: compiled RTC vs eager RTC, mixed batch of 5 in a bucket of 8: max |diff| {worst:.2e}; "
          f"graph breaks {sum(breaks.values())}")
    assert not breaks, breaks  # SmolVLA's vision embeddings included (flow_matching.static_position_ids)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames  # serving compiled nothing new
    assert compiled.figures()["compile.eager_calls"] == 0
