"""A batch's JPEG frames decoded at once (server/model/jpeg_batch.py) and the device image path
(runners/device_images.py): the pixels and the rejections of the per-frame decode, headers checked
before any pixel, the CPU chosen without a device, the device path's fallback, and the device path's
tensors equal to LeRobot's rollout path (on the CPU; the GPU tests run only where CUDA is)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import ConfigError, PolicyError, ProtocolError  # noqa: E402
from lerobot_zenoh.protocol import codec  # noqa: E402
from lerobot_zenoh.protocol.messages import HistoryFrame, Observation  # noqa: E402
from lerobot_zenoh.server.model import jpeg_batch  # noqa: E402
from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter  # noqa: E402
from lerobot_zenoh.server.model.jpeg_batch import JpegBatchDecoder  # noqa: E402
from lerobot_zenoh.server.runners import RunnerCapabilities  # noqa: E402
from lerobot_zenoh.server.runners.base import PolicySpec, check_observation  # noqa: E402
from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig  # noqa: E402

SHAPES = {"front": (48, 64), "wrist": (48, 64), "top": (32, 40)}


def scene(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = np.zeros((h, w, 3), np.uint8)
    img[:] = rng.integers(0, 255, 3)
    img[h // 4: h // 2, w // 4: w // 2] = rng.integers(0, 255, 3)
    img[::3, ::5] = rng.integers(0, 255, (len(range(0, h, 3)), len(range(0, w, 5)), 3))
    return img


def frames(seed: int, shapes=SHAPES) -> dict[str, bytes]:
    return {cam: codec.encode_jpeg(scene(h, w, seed * 10 + k)) for k, (cam, (h, w)) in enumerate(shapes.items())}


# Hostile or wrong frames, each with the reason the per-frame decode gives it.
BAD = {
    "not bytes": 12345,
    "no start-of-image": b"\x00\x01garbage",
    "garbage after the marker": b"\xff\xd8" + b"\x13" * 64,
    "wrong size": codec.encode_jpeg(scene(32, 32, 1)),
    "over the pixel limit": codec.encode_jpeg(scene(48, 64, 1)),
    "cut short (the header reads, the pixels do not)": (lambda d: d[: len(d) // 2])(codec.encode_jpeg(scene(48, 64, 5))),
}


CUT = "cut short (the header reads, the pixels do not)"


def reason_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except ProtocolError as exc:
        return exc.reason
    return None


@pytest.fixture
def many_cores(monkeypatch):
    """Frames of any size decoded on every thread asked for, whatever this machine's cores."""
    monkeypatch.setattr(jpeg_batch, "_usable_cores", lambda: 8)
    monkeypatch.setattr(jpeg_batch, "PARALLEL_MIN_PIXELS", 0)


@pytest.mark.usefixtures("many_cores")
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("batch", [1, 8])
def test_every_frame_is_the_per_frame_decode_bit_for_bit(threads, batch):
    decoder = JpegBatchDecoder(threads=threads)
    assert decoder.threads == threads
    try:
        sets = [frames(seed) for seed in range(batch)]
        results = decoder.decode(sets, SHAPES)
        assert len(results) == batch
        for frames_, images in zip(sets, results, strict=True):
            assert list(images) == list(SHAPES)  # the spec's camera order
            for cam, image in images.items():
                assert image.dtype == np.uint8 and image.shape == (*SHAPES[cam], 3)
                assert np.array_equal(image, codec.decode_jpeg(frames_[cam], SHAPES[cam]))
    finally:
        decoder.close()


def test_a_small_batch_decodes_on_the_calling_thread_and_threads_stay_within_the_cores(monkeypatch):
    import threading

    threads = []
    real = codec.decode_checked_jpeg
    monkeypatch.setattr(codec, "decode_checked_jpeg",
                        lambda data, h, w: threads.append(threading.current_thread().name) or real(data, h, w))
    decoder = JpegBatchDecoder(threads=3)
    assert decoder.threads == min(3, jpeg_batch._usable_cores())
    sets = [frames(seed) for seed in range(8)]  # 8 x (2 x 48x64 + 32x40) pixels: under the threshold
    assert sum(h * w for h, w in SHAPES.values()) * 8 < jpeg_batch.PARALLEL_MIN_PIXELS
    decoder.decode(sets, SHAPES)
    assert threads == [threading.current_thread().name] * 24
    decoder.close()


def test_a_subset_of_the_cameras_and_memoryviews_decode_too():
    decoder = JpegBatchDecoder(threads=2)
    sent = frames(3)
    (images,) = decoder.decode([{"wrist": memoryview(sent["wrist"])}], SHAPES)
    assert list(images) == ["wrist"] and np.array_equal(images["wrist"], codec.decode_jpeg(sent["wrist"]))
    assert decoder.decode([], SHAPES) == []
    decoder.close()


@pytest.mark.usefixtures("many_cores")
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_frame_is_rejected_with_the_per_frame_reason_and_costs_the_others_nothing(bad, threads):
    limits = dataclasses.replace(codec.DEFAULT_LIMITS, max_image_pixels=48 * 64 - 1) if "limit" in bad else codec.DEFAULT_LIMITS
    shapes = {"front": (48, 64), "wrist": (48, 64)}
    decoder = JpegBatchDecoder(threads=threads, limits=limits)
    good = frames(1, shapes)
    hostile = {**frames(2, shapes), "wrist": BAD[bad]}
    expected = reason_of(codec.decode_jpeg, BAD[bad], shapes["wrist"], limits)
    assert expected in ("bad_jpeg", "wrong_image_shape")
    results = decoder.decode([good, hostile, good], shapes)
    assert isinstance(results[1], ProtocolError) and results[1].reason == expected
    for images in (results[0], results[2]):
        if "limit" in bad:  # every frame is over that limit
            assert isinstance(images, ProtocolError) and images.reason == "bad_jpeg"
        else:
            assert np.array_equal(images["front"], codec.decode_jpeg(good["front"]))
    decoder.close()


def test_the_first_bad_camera_in_the_specs_order_gives_the_reason():
    shapes = {"front": (48, 64), "wrist": (48, 64)}
    decoder = JpegBatchDecoder(threads=2)
    (result,) = decoder.decode([{"front": BAD["wrong size"], "wrist": BAD["garbage after the marker"]}], shapes)
    assert result.reason == "wrong_image_shape"
    (result,) = decoder.decode([{"wrist": BAD["wrong size"], "front": BAD["garbage after the marker"]}], shapes)
    assert result.reason == "bad_jpeg"
    decoder.close()


def test_every_header_is_checked_before_any_pixel_is_decoded(monkeypatch):
    decoded = []
    real = codec.decode_checked_jpeg
    monkeypatch.setattr(codec, "decode_checked_jpeg", lambda data, h, w: decoded.append(bytes(data)) or real(data, h, w))
    shapes = {"front": (48, 64), "wrist": (48, 64)}
    good, bad = frames(1, shapes), {**frames(2, shapes), "wrist": BAD["wrong size"]}
    decoder = JpegBatchDecoder(threads=1)
    results = decoder.decode([bad, good], shapes)
    assert results[0].reason == "wrong_image_shape" and set(results[1]) == set(shapes)
    assert sorted(decoded) == sorted(good.values())  # not even the bad set's good camera
    decoder.close()


def test_without_a_device_the_cpu_decodes(monkeypatch):
    from lerobot_zenoh.server.runners import device_images

    monkeypatch.setattr(device_images, "decode_on_device", lambda *a: pytest.fail("decoded on a device"))
    decoder = JpegBatchDecoder(threads=2)
    (images,) = decoder.decode([frames(1)], SHAPES)
    assert all(isinstance(image, np.ndarray) for image in images.values())
    decoder.close()


def test_on_a_device_the_batch_decodes_in_one_call_and_falls_back_to_the_cpu(monkeypatch):
    """The device path's dispatch, with nvJPEG replaced by a fake (no GPU here)."""
    from lerobot_zenoh.server.runners import device_images

    calls = []

    def fake(data, device, stream):
        calls.append((len(data), device, stream))
        if any(bytes(d) == BAD[CUT] for d in data):
            raise RuntimeError("nvjpeg: the fake could not decode it")
        return [codec.decode_jpeg(d)[::-1] for d in data]  # marked: flipped, so it is told apart

    monkeypatch.setattr(device_images, "decode_on_device", fake)
    monkeypatch.setattr(device_images, "decode_stream", lambda device: f"stream on {device}")
    shapes = {"front": (48, 64), "wrist": (48, 64)}
    decoder = JpegBatchDecoder(threads=2, device="cuda:0")
    sets = [frames(seed, shapes) for seed in range(3)] + [{**frames(9, shapes), "wrist": BAD["wrong size"]}]
    results = decoder.decode(sets, shapes)
    assert calls == [(6, "cuda:0", "stream on cuda:0")]  # one call for every checked frame, on the decoder's stream
    assert results[3].reason == "wrong_image_shape"
    for frames_, images in zip(sets[:3], results[:3], strict=True):
        assert np.array_equal(images["front"], codec.decode_jpeg(frames_["front"])[::-1])

    # nvJPEG refuses a frame: the whole batch decodes on the CPU, with the CPU path's reasons
    sets[1] = {**sets[1], "front": BAD[CUT]}
    results = decoder.decode(sets, shapes)
    assert decoder.device_fallbacks == 1
    assert results[1].reason == reason_of(codec.decode_jpeg, BAD[CUT]) == "bad_jpeg"
    assert np.array_equal(results[0]["wrist"], codec.decode_jpeg(sets[0]["wrist"]))
    decoder.close()


def test_jpeg_batch_imports_no_torch():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(jpeg_batch))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("torch" in ast.unparse(n) for n in top)


# ----------------------------------------------------------------------------- the executor


def executor(history_length: int = 1, cameras=None) -> RunnerAdapter:
    cameras = {"front": (48, 64), "wrist": (48, 64)} if cameras is None else cameras
    runner = SyntheticPolicy(SyntheticPolicyConfig(state_dim=3, action_dim=2, cameras=cameras, chunk_size=4,
                                                   history_length=history_length))
    return RunnerAdapter("m", runner, actions_per_chunk=4, server_id="s")


def observation(client: str, seq: int, images: dict, history=()) -> Observation:
    return Observation(seq_id=seq, client_uuid=client, state=np.zeros(3, np.float32), images=images,
                       history=tuple(history))


def test_prepare_batch_decodes_each_request_as_alone_and_refuses_only_the_bad_one():
    ex = executor()
    shapes = ex.spec.cameras
    items = [(f"c{i}", observation(f"c{i}", i, frames(i, shapes)), None) for i in range(4)]
    items[2] = ("c2", observation("c2", 2, {**frames(2, shapes), "front": BAD["wrong size"]}), None)
    items.append(("c5", observation("not-c5", 5, frames(5, shapes)), None))
    out = ex.prepare_batch(items)
    assert [r.reason if isinstance(r, ProtocolError) else None for r in out] == [
        None, None, "wrong_image_shape", None, "client_mismatch"]
    for (client, obs, _), request in zip(items, out, strict=True):
        if isinstance(request, ProtocolError):
            with pytest.raises(ProtocolError, match=request.reason):
                ex.prepare(client, obs)
            continue
        alone = ex.prepare(client, obs)
        assert list(request.images) == list(shapes)
        for cam in shapes:
            assert np.array_equal(request.images[cam], alone.images[cam])
            assert np.array_equal(request.images[cam], codec.decode_jpeg(obs.images[cam], shapes[cam]))
    ex.close()


def test_history_frames_decode_in_the_same_batch_and_keep_their_reasons():
    ex = executor(history_length=3)
    shapes = ex.spec.cameras

    def past(seed, images=None):
        return HistoryFrame(state=np.full(3, seed, np.float32), images=images or frames(seed, shapes))

    good = observation("a", 1, frames(1, shapes), [past(10), past(11), past(12)])  # the first is ignored
    bad_frame = observation("b", 2, frames(2, shapes), [past(20), past(21, {**frames(21, shapes), "wrist": b"\xff\xd8"})])
    bad_state = observation("c", 3, frames(3, shapes), [HistoryFrame(np.zeros(2, np.float32), frames(30, shapes)), past(31)])
    out = ex.prepare_batch([("a", good, None), ("b", bad_frame, None), ("c", bad_state, None)])
    assert out[1].reason == "bad_jpeg" and out[2].reason == "bad_history"
    request = out[0]
    assert [float(state[0]) for state, _ in request.history] == [11.0, 12.0]
    for (_, images), frame in zip(request.history, good.history[1:], strict=True):
        for cam in shapes:
            assert np.array_equal(images[cam], codec.decode_jpeg(frame.images[cam]))
    ex.close()


def test_a_model_without_cameras_prepares_its_history_too():
    ex = executor(history_length=2, cameras={})
    past = HistoryFrame(state=np.ones(3, np.float32), images={})
    (request,) = ex.prepare_batch([("a", observation("a", 1, {}, [past]), None)])
    assert request.images == {} and len(request.history) == 1 and request.history[0][1] == {}
    ex.close()


# ----------------------------------------------------------------------------- the device path


def test_check_observation_takes_tensors_only_on_the_declared_device():
    torch = pytest.importorskip("torch")
    spec = PolicySpec("x", ("s",), {"front": (4, 6)}, ("a",), chunk_size=2)
    state, frame = np.zeros(1, np.float32), torch.zeros((4, 6, 3), dtype=torch.uint8)
    with pytest.raises(PolicyError, match="must be uint8"):
        check_observation(spec, state, {"front": frame})
    on_cpu = dataclasses.replace(spec, capabilities=RunnerCapabilities(image_device="cpu"))
    check_observation(on_cpu, state, {"front": frame})
    check_observation(on_cpu, state, {"front": frame.numpy()})
    for wrong in (frame.float(), torch.zeros((6, 4, 3), dtype=torch.uint8)):
        with pytest.raises(PolicyError, match="must be uint8"):
            check_observation(on_cpu, state, {"front": wrong})
    with pytest.raises(PolicyError, match="must be uint8"):
        check_observation(dataclasses.replace(spec, capabilities=RunnerCapabilities(image_device="cuda:0")),
                          state, {"front": frame})


def test_observation_tensors_equal_lerobots_rollout_path_bit_for_bit():
    torch = pytest.importorskip("torch")
    from lerobot.policies import prepare_observation_for_inference
    from lerobot.utils.feature_utils import build_dataset_frame

    from lerobot_zenoh.server.runners.device_images import observation_tensors

    spec = PolicySpec("x", ("s0", "s1", "s2"), {"front": (48, 64), "wrist": (32, 40)}, ("a",), chunk_size=2)
    rng = np.random.default_rng(4)
    states = [rng.normal(size=3).astype(np.float32) for _ in range(3)]
    images = [{cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam, (h, w) in spec.cameras.items()}
              for _ in range(3)]
    features = spec.observation_features()
    rows = []
    for state, imgs in zip(states, images, strict=True):
        values = {name: float(state[i]) for i, name in enumerate(spec.state_names)} | {c: i.copy() for c, i in imgs.items()}
        rows.append(prepare_observation_for_inference(build_dataset_frame(features, values, prefix="observation"),
                                                      torch.device("cpu"), "t", None))
    # numpy frames, and frames already on the device (here the CPU) as the nvJPEG path leaves them
    mixed = [images[0], {c: torch.from_numpy(i) for c, i in images[1].items()}, images[2]]
    for given in (images, mixed):
        got = observation_tensors(spec, states, given, torch.device("cpu"))
        assert list(got) == [k for k in rows[0] if k not in ("task", "robot_type")]
        for key, tensor in got.items():
            expected = torch.cat([row[key] for row in rows])
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape
            assert torch.equal(tensor, expected), key


def test_images_on_device_needs_a_cuda_device():
    from lerobot_zenoh.server.config.manifest import parse_manifest

    base = {"cluster_uuid": "c", "experiment_tag": "e", "server": [{
        "model_id": "m", "model_version": "v1", "application_tag": "a", "pretrained_path": "ckpt",
        "accept_unknown_clients": True, "images_on_device": True}]}
    with pytest.raises(ConfigError, match="images_on_device needs a CUDA device"):
        parse_manifest(base)
    base["server"][0]["device"] = "cuda:1"
    assert parse_manifest(base).server[0].images_on_device


@pytest.mark.slow
def test_a_runner_taking_its_images_on_the_device_serves_the_same_chunks(tmp_path):
    """The runners' device branch (`_preprocess`, `_stack`), taken on the CPU: bit for bit the
    chunks of LeRobot's rollout path, for numpy frames and for frames already on the device."""
    torch = pytest.importorskip("torch")
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.runners import InferenceRequest, LoadOptions, load_policy_runner

    cameras = {"front": (48, 64), "wrist": (32, 40)}
    names = ("s0", "s1", "s2", "s3")
    overrides = {"act": {"dim_model": 64, "n_heads": 2, "dim_feedforward": 128, "n_encoder_layers": 1,
                         "n_decoder_layers": 1, "n_vae_encoder_layers": 1, "latent_dim": 8},
                 "pi0": {"num_inference_steps": 3}}
    rng = np.random.default_rng(7)
    requests = [InferenceRequest(f"c{i}", rng.normal(size=4).astype(np.float32),
                                 {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in cameras.items()},
                                 "pick up the cube", seed=i) for i in range(3)]
    for policy_type, override in overrides.items():
        path = build_checkpoint(tmp_path / policy_type, policy_type=policy_type, state_names=names,
                                action_names=names, cameras=cameras, chunk_size=8, fps=30, overrides=override,
                                stats={"action": {"mean": [1.0] * 4, "std": [2.0] * 4}}, seed=3)
        host = load_policy_runner(path)
        with pytest.raises(PolicyError, match="images_on_device: decoding images on the device needs a CUDA"):
            load_policy_runner(path, options=LoadOptions(images_on_device=True))
        device = load_policy_runner(path)
        device.spec = dataclasses.replace(device.spec, capabilities=dataclasses.replace(
            device.spec.capabilities, image_device="cpu"))
        tensors = [dataclasses.replace(r, images={c: torch.from_numpy(i) for c, i in r.images.items()}) for r in requests]
        for batch in (requests[:1], requests):
            expected = [r.actions for r in host.run(batch)]
            for given in (batch, tensors[: len(batch)]):
                got = [r.actions for r in device.run(given)]
                for e, g in zip(expected, got, strict=True):
                    assert np.array_equal(e, g), policy_type


# ----------------------------------------------------------------------------- on a GPU only

def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")


@cuda
def test_nvjpeg_decodes_a_batch_close_to_libjpeg_turbo():
    import torch

    from lerobot_zenoh.server.runners.device_images import decode_on_device

    sets = [frames(seed) for seed in range(4)]
    data = [f for s in sets for f in s.values()]
    stream = torch.cuda.Stream("cuda:0")
    images = decode_on_device(data, "cuda:0", stream)
    for frame, image in zip(data, images, strict=True):
        cpu = codec.decode_jpeg(frame)
        assert image.device.type == "cuda" and image.dtype == torch.uint8 and tuple(image.shape) == cpu.shape
        # nvJPEG's IDCT and upsampling are not libjpeg-turbo's: close, not equal
        assert np.abs(image.cpu().numpy().astype(int) - cpu).mean() < 2.0
    (alone,) = decode_on_device(data[3:4], "cuda:0", stream)
    assert torch.equal(alone, images[3])  # a frame in a batch decodes as it does alone


@cuda
def test_pinned_copies_to_the_gpu_give_lerobots_values_bit_for_bit():
    import torch

    from lerobot_zenoh.server.runners.device_images import observation_tensors

    spec = PolicySpec("x", ("s0",), {"front": (48, 64)}, ("a",), chunk_size=2)
    rng = np.random.default_rng(1)
    images = [{"front": rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)} for _ in range(4)]
    states = [np.zeros(1, np.float32)] * 4
    on_gpu = observation_tensors(spec, states, images, torch.device("cuda:0"))
    on_cpu = observation_tensors(spec, states, images, torch.device("cpu"))
    assert torch.equal(on_gpu["observation.images.front"].cpu(), on_cpu["observation.images.front"])


@cuda
def test_nvjpeg_never_writes_into_memory_the_callers_queued_kernels_still_read():
    """pytorch/vision#9606's reproduction, through the server's decoder: tensors the size of a decoded
    frame are freed while kernels queued on the caller's stream (behind a long sleep) are still to read
    them; the decode must not be handed their blocks (runners/device_images.py, "Stream order")."""
    import torch

    shapes = {"front": (48, 64), "wrist": (48, 64)}
    sets = [frames(seed, shapes) for seed in range(4)]
    decoder = JpegBatchDecoder(device="cuda:0")
    elements = 48 * 64 * 3 // 4  # float32 tensors of a decoded frame's bytes: the same allocator blocks
    corrupted = 0
    for _ in range(20):
        victims = [torch.full((elements,), float(k + 1), device="cuda:0") for k in range(8)]
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # keeps the reads below queued while the decode is called
        sums = [v.sum() for v in victims]
        del victims  # freed on the caller's stream, their reads still queued
        results = decoder.decode(sets, shapes)
        torch.cuda.synchronize()
        corrupted += sum(float(s) != elements * (k + 1) for k, s in enumerate(sums))
        assert all(not isinstance(r, Exception) for r in results)
    decoder.close()
    assert decoder.device_fallbacks == 0 and corrupted == 0
