"""Compiled inference (runners/compiled.py; docs/policies.md, "Compiled inference"): the manifest's
`compile` field and its refusals, frozen parameters, and the compiled pi0 chunk against the eager one,
per-robot RTC in the batch included.

The test that compiles a model takes minutes on a small CPU (inductor compiles one graph per batch
bucket): it is marked `slow`, skipped unless LZ_TEST_COMPILE=1, and run by ``make test-compile``
(all of this file); it compiles one bucket of the smallest shapes. The others run in the default
suite (the failure tests replace the compiled graph by a function that fails: no compilation)."""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import ConfigError, PolicyError  # noqa: E402
from lerobot_zenoh.protocol.messages import RtcInputs  # noqa: E402
from lerobot_zenoh.server.config.manifest import parse_manifest  # noqa: E402
from lerobot_zenoh.server.config.runner_loading import load_runner  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest  # noqa: E402
from lerobot_zenoh.server.runners.base import RTC_EXTRA  # noqa: E402
from lerobot_zenoh.server.runners.compiled import CompileSettings, batch_buckets, check_compile  # noqa: E402

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
CAMERAS = {"front": (48, 64), "wrist": (48, 64)}
CHUNK = 10
TASKS = ("pick up the red cube", "open the drawer", "fold the towel on the table")


def manifest(**kw):
    """A one-model manifest; `kw` set the model entry's fields (None removes one)."""
    model = {"model_id": "m", "model_version": "v", "application_tag": "a", "pretrained_path": "x",
             "accept_unknown_clients": True, **kw}
    return parse_manifest({"cluster_uuid": "c", "experiment_tag": "e",
                           "server": [{k: v for k, v in model.items() if v is not None}]})


# -- the manifest field ----------------------------------------------------------------------------


def test_the_compile_field_takes_a_word_or_a_block_and_names_a_bad_value():
    assert manifest().server[0].compile == CompileSettings()
    assert not manifest().server[0].compile.enabled
    assert manifest(compile="default").server[0].compile.mode == "default"
    block = manifest(compile={"mode": "max-autotune", "buckets": [1, 4, 8], "fallback": "eager"}).server[0].compile
    assert (block.mode, block.buckets, block.fallback) == ("max-autotune", (1, 4, 8), "eager")
    for bad, field in (("fast", "server.0.compile.mode"), ({"mode": "default", "buckets": [4, 2]}, "server.0.compile.buckets"),
                       ({"mode": "default", "buckets": [0]}, "server.0.compile.buckets"),
                       ({"mode": "default", "fallback": "cpu"}, "server.0.compile.fallback"),
                       ({"mode": "default", "cache": "/tmp"}, "server.0.compile.cache")):
        with pytest.raises(ConfigError) as err:
            manifest(compile=bad)
        assert err.value.field == field and "\n" not in str(err.value)


def test_buckets_default_to_powers_of_two_up_to_the_largest_batch():
    on = CompileSettings(mode="default")
    assert batch_buckets(on, 1) == (1,)
    assert batch_buckets(on, 8) == (1, 2, 4, 8)
    assert batch_buckets(on, 6) == (1, 2, 4, 6)
    assert batch_buckets(on.replace(buckets=(2, 8)), 16) == (2, 8)


def test_cuda_graphs_on_a_cpu_is_refused_before_the_model_loads_in_one_line_naming_the_field():
    m = manifest(compile="cuda_graphs")  # pretrained_path "x" does not exist: nothing is loaded
    with pytest.raises(ConfigError) as err:
        load_runner(m, m.server[0])
    assert err.value.field == "server[m].compile" and "CUDA" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="cpu or cuda"):
        check_compile(CompileSettings(mode="default"), "mps", "server[m].compile")
    check_compile(CompileSettings(mode="cuda_graphs"), "cuda:1", "server[m].compile")  # accepted


@pytest.fixture
def cache_environment(monkeypatch):
    """The cache variables the loader sets (runners/compile_cache.py), restored after the test."""
    from lerobot_zenoh.server.runners.compile_cache import CACHE_ENVIRONMENT, REMOTE_CACHES_OFF

    for name in (*CACHE_ENVIRONMENT, *REMOTE_CACHES_OFF):
        monkeypatch.setenv(name, "unset")


@pytest.mark.usefixtures("cache_environment")
def test_the_manifests_cache_folder_is_where_inductor_reads_it(tmp_path):
    (tmp_path / "m.yaml").write_text("")
    m = parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "compile_cache_dir": "cache/inductor",
                        "server": [{"model_id": "m", "model_version": "v", "application_tag": "a",
                                    "pretrained_path": str(tmp_path / "missing"), "accept_unknown_clients": True,
                                    "compile": "default"}]}, source=str(tmp_path / "m.yaml"))
    with pytest.raises(PolicyError):  # no checkpoint there; the folder was set before loading
        load_runner(m, m.server[0])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")


@pytest.mark.usefixtures("cache_environment")
def test_a_relative_cache_folder_reaches_inductor_absolute(tmp_path, monkeypatch):
    """A manifest named by a relative path (``--manifest m.yaml``): inductor compiles C++ from another
    folder, and every compilation failed with the relative cache path it was given."""
    monkeypatch.chdir(tmp_path)
    m = parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "compile_cache_dir": "cache/inductor",
                        "server": [{"model_id": "m", "model_version": "v", "application_tag": "a",
                                    "pretrained_path": "missing", "accept_unknown_clients": True,
                                    "compile": "default"}]}, source="m.yaml")
    with pytest.raises(PolicyError):
        load_runner(m, m.server[0])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")


def test_a_model_that_is_not_compiled_refuses_the_field():
    m = manifest(pretrained_path=None, compile="default",
                 synthetic={"state_dim": 2, "action_dim": 2, "chunk_size": 4})
    with pytest.raises(ConfigError) as err:
        load_runner(m, m.server[0])
    assert err.value.field == "server[m].compile" and "synthetic" in str(err.value)


def test_a_batch_is_padded_to_its_bucket_with_its_last_row_and_a_larger_one_runs_eager():
    """The bucket logic around the graph (the graph itself replaced by a recording function: no compile)."""
    import torch

    from lerobot_zenoh.server.runners.compiled import CompiledChunk

    def fn(batch, noise):
        return batch["x"] * 2 + noise

    seen = []

    def graph(batch, noise):
        seen.append(batch["x"].clone())
        assert set(batch) == {"x"}  # the task list and placeholders are not handed to the graph
        return fn(batch, noise)

    chunk = CompiledChunk(fn, CompileSettings(mode="default"), (2, 4), device_type="cpu", name="t",
                          field="server[m].compile")
    chunk._compiled = graph
    chunk.active = chunk.serving = True
    x = torch.arange(15.0).reshape(5, 3)
    noise = torch.ones(5, 3)
    for rows, sizes in ((1, [2]), (3, [4]), (4, [4]), (5, [])):
        seen.clear()
        out = chunk({"x": x[:rows], "task": ["a"] * rows, "next.reward": 0.0}, noise=noise[:rows])
        assert torch.equal(out, fn({"x": x[:rows]}, noise[:rows]))
        assert [len(b) for b in seen] == sizes
    chunk({"x": x[:3]}, noise=noise[:3])
    assert torch.equal(seen[-1][3], x[2])  # three rows padded to four with a copy of the last
    assert chunk.eager_calls == 0

    def recompiles(batch, noise):
        raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")

    chunk._compiled = recompiles
    assert torch.equal(chunk({"x": x[:3]}, noise=noise[:3]), fn({"x": x[:3]}, noise[:3]))  # eager, counted
    assert chunk.figures() == {"compile.buckets": 2.0, "compile.eager_calls": 1.0, "compile.graph_breaks": 0.0,
                               "compile.startup_recompiles": 0.0, "compile.cudagraph_skips": 0.0,
                               "compile.cudagraph_partitions": 0.0}


@pytest.mark.slow
def test_diffusion_refuses_compile_at_load_naming_the_field(tmp_path):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    folder = build_checkpoint(tmp_path / "diffusion", policy_type="diffusion", state_names=STATE_NAMES,
                              action_names=STATE_NAMES, cameras={"front": (48, 64)}, chunk_size=8, fps=30)
    m = manifest(pretrained_path=str(folder), compile="default")
    with pytest.raises(PolicyError) as err:
        load_runner(m, m.server[0])
    assert str(err.value).startswith("server[m].compile: diffusion is not compiled") and "\n" not in str(err.value)


# -- the tiny pi0 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pi0_folder(tmp_path_factory):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("compiled") / "pi0", policy_type="pi0", state_names=STATE_NAMES,
                            action_names=STATE_NAMES, cameras=CAMERAS, chunk_size=CHUNK, fps=30,
                            overrides={"num_inference_steps": 10})


def pi0_runner(folder, **kw):
    m = manifest(pretrained_path=str(folder), rtc={"enabled": True, "execution_horizon": 8}, max_batch_size=2, **kw)
    return load_runner(m, m.server[0])


def request(session: str, task: str, seed: int, rows: int | None = None, delay: int = 0) -> InferenceRequest:
    rng = np.random.default_rng(seed)
    state = rng.normal(size=len(STATE_NAMES)).astype(np.float32)
    images = {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam, (h, w) in CAMERAS.items()}
    extras = {} if rows is None else {RTC_EXTRA: RtcInputs(rng.normal(size=(rows, 4)).astype(np.float32), delay)}
    return InferenceRequest(session, state, images, task, seed, extras=extras)


@pytest.mark.slow
def test_served_parameters_are_frozen_and_rtc_chunks_are_the_same_bit_for_bit(pi0_folder):
    runner = pi0_runner(pi0_folder)
    assert not any(p.requires_grad for p in runner.policy.parameters())
    requests = [request("a", TASKS[0], 1, rows=7, delay=2), request("b", TASKS[1], 2, rows=4, delay=1),
                request("c", TASKS[2], 3)]
    frozen = runner.run(requests)
    runner.policy.requires_grad_(True)  # as LeRobot leaves a loaded policy
    try:
        trainable = runner.run(requests)
    finally:
        runner.policy.requires_grad_(False)
    for a, b in zip(frozen, trainable, strict=True):
        assert np.array_equal(a.actions, b.actions)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(os.environ.get("LZ_TEST_COMPILE") != "1", reason="compiles with inductor for minutes: make test-compile")
def test_compiled_pi0_equals_eager_per_robot_rtc_included_and_never_recompiles(pi0_folder, caplog):
    """One bucket of 2: a lone request is padded to it, a pair fills it, three run eager."""
    import torch

    eager = pi0_runner(pi0_folder)
    compiled = pi0_runner(pi0_folder, compile={"mode": "default", "buckets": [2]})
    with caplog.at_level(logging.INFO, logger="lerobot_zenoh.server.runners.compiled"):
        compiled.warmup()  # compiles the bucket (progress lines), then the plain warm-up
    lines = [r.getMessage() for r in caplog.records]
    assert any("compiling batch bucket 2 (1/1, default)" in line for line in lines)
    assert any("batch bucket 2 compiled in" in line for line in lines)
    frames = dict(torch._dynamo.utils.counters["frames"])

    alone = [request("a", TASKS[0], 11)]
    pair = [request("a", TASKS[0], 11), request("b", TASKS[1], 12)]
    three = [*pair, request("c", TASKS[2], 13)]
    for batch, tol in ((alone, 1e-5), (pair, 1e-4), (three, 1e-4)):
        for c, e in zip(compiled.run(batch), eager.run(batch), strict=True):
            np.testing.assert_allclose(c.actions, e.actions, rtol=0, atol=tol)
    # a row is the same alone and padded into the bucket
    np.testing.assert_allclose(compiled.run(alone)[0].actions, compiled.run(pair)[0].actions, rtol=0, atol=1e-4)

    # Per-robot RTC inside a batch (the guidance in the graph, closed form) and step capture (eager).
    guided = [request("a", TASKS[0], 21, rows=7, delay=2), request("b", TASKS[1], 22, rows=3, delay=1),
              dataclasses.replace(request("c", TASKS[2], 23), extras={})]
    for c, e in zip(compiled.run(guided), eager.run(guided), strict=True):
        np.testing.assert_allclose(c.actions, e.actions, rtol=0, atol=1e-5)
    for c, e in zip(compiled.run(pair, capture_updates=True), eager.run(pair, capture_updates=True), strict=True):
        np.testing.assert_allclose(c.actions, e.actions, rtol=0, atol=1e-4)
        np.testing.assert_allclose(c.refinement_updates, e.refinement_updates, rtol=0, atol=1e-4)

    # Serving compiled nothing new and no call fell back to eager.
    assert dict(torch._dynamo.utils.counters["frames"]) == frames
    figures = compiled.figures()
    assert figures["compile.buckets"] == 1.0 and figures["compile.eager_calls"] == 0.0
    assert figures["compile.startup_recompiles"] == figures["compile.graph_breaks"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("fallback", ["refuse", "eager"])
def test_a_compile_failure_at_start_up_refuses_or_serves_eager_never_half(pi0_folder, fallback, caplog):
    runner = pi0_runner(pi0_folder, compile={"mode": "default", "buckets": [1, 2], "fallback": fallback})
    calls = []

    def broken(batch, **kwargs):  # the first bucket compiles, the second fails
        calls.append(len(batch["observation.state"]))
        if calls[-1] > 1:
            raise RuntimeError("inductor: \nC++ compile error\n(many lines)")
        return runner.policy.predict_action_chunk(batch, **kwargs)

    runner._compiled._compiled = broken
    if fallback == "refuse":
        with pytest.raises(PolicyError) as err:
            runner.warmup()
        text = str(err.value)
        assert text.startswith("server[m].compile: compiling") and "batch bucket 2" in text and "\n" not in text
    else:
        with caplog.at_level(logging.WARNING):
            runner.warmup()
        assert any("serving it eager (compile.fallback: eager)" in r.getMessage() for r in caplog.records)
    assert runner._compiled is None or not runner._compiled.active  # no bucket is used
    if fallback == "eager":
        assert runner.figures() == {}
        assert runner.run([request("a", TASKS[0], 5)])[0].actions.shape == (CHUNK, 4)


@pytest.mark.slow
def test_the_single_model_flag_names_itself_for_a_bad_or_refused_mode(tmp_path, port):
    """--policy.compile: a misspelt mode, and cuda_graphs on a CPU (refused before the model loads)."""
    import json
    import subprocess
    import sys

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"type": "act"}))
    (folder / "model.safetensors").write_bytes(b"w")
    for mode, needle in (("fast", "--policy.compile: Input should be 'off', 'default'"),
                         ("cuda_graphs", "--policy.compile: cuda_graphs needs a CUDA device (device is 'cpu')")):
        out = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.server", f"--policy.path={folder}",
                              f"--policy.compile={mode}", "--policy.device=cpu", f"--endpoint=tcp/127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert needle in lines[-1] and lines[-1].startswith("lerobot-policy-server: "), out.stderr


# -- start-up does the expensive work (the graphs replaced by fakes: no compile, no GPU) -------------


def fake_chunk(mode="default", device_type="cpu", buckets=(1, 2), dtype="float32"):
    """A CompiledChunk whose warm-up drives `run_bucket` through its own __call__ (as the runner does)."""
    import torch

    from lerobot_zenoh.server.runners.compiled import CompiledChunk

    def fn(batch):
        return batch["x"] * 2.0

    chunk = CompiledChunk(fn, CompileSettings(mode=mode), buckets, device_type=device_type, name="t",
                          field="server[m].compile", dtype=dtype)

    def run_bucket(size):
        x = torch.arange(float(size * 3)).reshape(size, 3) + 1.0
        return (chunk({"x": x}) if chunk.active else fn({"x": x})).numpy()

    return chunk, fn, run_bucket


def test_warm_compiles_then_compares_a_replay_and_with_cuda_graphs_records_first_on_one_thread():
    import threading

    import torch

    for mode, device_type, per_bucket in (("default", "cpu", 2), ("cuda_graphs", "cuda", 3)):
        chunk, fn, run_bucket = fake_chunk(mode, device_type)
        calls, threads = [], set()

        def graph(batch, fn=fn, calls=calls, threads=threads):
            calls.append(len(batch["x"]))
            threads.add(threading.current_thread().name)
            return fn(batch)

        chunk._compiled = graph
        chunk.warm(run_bucket)
        # compile (+ the graph's warm-up run), [record,] replay: every bucket before serving
        assert calls == [1] * per_bucket + [2] * per_bucket, (mode, calls)
        assert chunk.serving and chunk.active
        if mode == "cuda_graphs":
            assert threads == {"cuda-graphs:t"}  # never the caller's thread
            seen = []
            worker = threading.Thread(target=lambda: seen.append(chunk({"x": torch.ones(2, 3)})), name="inference")
            worker.start()
            worker.join(10)
            assert threads == {"cuda-graphs:t"} and torch.equal(seen[0], torch.full((2, 3), 2.0))
            chunk.close()
        else:
            assert threads == {threading.current_thread().name}


@pytest.mark.parametrize("fault", ["recompile", "cudagraph_skips", "cudagraph_partitions", "differs", "nan"])
def test_warm_refuses_what_would_silently_run_slow_or_wrong_and_counts_it(fault):
    import torch
    from torch._dynamo.utils import counters

    chunk, fn, run_bucket = fake_chunk("cuda_graphs", "cuda", buckets=(1,))
    n = []

    def graph(batch):
        n.append(1)
        if fault == "recompile" and len(n) == 2:
            raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")
        if fault.startswith("cudagraph") and len(n) == 1:
            counters["inductor"][fault] += 1
        out = fn(batch)
        if fault == "differs" and len(n) == 3:  # the replay, not the warm-up run
            out = out * 1.01
        if fault == "nan" and len(n) == 3:
            out = out * torch.nan
        return out

    chunk._compiled = graph
    with pytest.raises(PolicyError) as err:
        chunk.warm(run_bucket)
    text = str(err.value)
    assert text.startswith("server[m].compile: compiling t (cuda_graphs) failed at batch bucket 1") and "\n" not in text
    assert not chunk.active and not chunk.serving
    expected = {"recompile": "needed a recompile on its second call", "cudagraph_skips": "1 CUDA graph skip(s)",
                "cudagraph_partitions": "1 graph partition(s)", "differs": "a replay differs from the eager chunk",
                "nan": "not finite"}[fault]
    assert expected in text, text
    if fault == "recompile":
        assert chunk.figures()["compile.startup_recompiles"] == 1.0
    if fault.startswith("cudagraph"):
        assert chunk.figures()[f"compile.{fault}"] == 1.0
    chunk.close()


def test_the_equality_check_is_relative_to_the_action_scale_and_looser_in_bfloat16():
    from lerobot_zenoh.server.runners.compiled import EQUALITY_TOLERANCE

    for dtype, factor, ok in (("float32", 1.0005, True), ("float32", 1.01, False),
                              ("bfloat16", 1.05, True), ("bfloat16", 1.2, False)):
        chunk, fn, run_bucket = fake_chunk(buckets=(1,), dtype=dtype)
        chunk._compiled = lambda batch, fn=fn, factor=factor: fn(batch) * factor
        if ok:
            chunk.warm(run_bucket)
        else:
            with pytest.raises(PolicyError, match=f"of the action scale 6, {dtype}"):
                chunk.warm(run_bucket)
    assert EQUALITY_TOLERANCE["bfloat16"] > EQUALITY_TOLERANCE["float32"]


def test_tf32_is_enabled_for_bfloat16_on_cuda_only_and_said_in_the_log(caplog):
    import torch

    from lerobot_zenoh.server.runners.compiled import enable_tf32

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert not enable_tf32(torch.device("cpu"), True, "m")
        assert not enable_tf32(torch.device("cuda", 0), False, "m")
        assert not torch.backends.cuda.matmul.allow_tf32
        with caplog.at_level(logging.INFO, logger="lerobot_zenoh.server.runners.compiled"):
            assert enable_tf32(torch.device("cuda", 0), True, "m")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert any("TF32 enabled" in r.getMessage() for r in caplog.records)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_the_demo_compiles_its_model_on_request_and_names_a_bad_mode(tmp_path):
    import yaml

    from lerobot_zenoh.demo import DemoConfig, demo_manifest

    entry = yaml.safe_load(demo_manifest(DemoConfig(policy="pi0", compile="default"), tmp_path).read_text())["server"][0]
    assert entry["compile"] == "default" and entry["rtc"] == {"enabled": True}
    assert "compile" not in yaml.safe_load(demo_manifest(DemoConfig(policy="pi0"), tmp_path).read_text())["server"][0]
    with pytest.raises(ConfigError) as err:
        DemoConfig(compile="cuda_graphs")
    assert err.value.field == "compile"
