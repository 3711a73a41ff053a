"""Real-time chunking on the server: per-row guidance inside one batched forward pass for tiny
SmolVLA and pi0, equality with LeRobot's own RTC call, plain sampling without a prefix, the manifest's
`rtc` block, bad RTC inputs, and a hot standby taking over mid-episode (docs/policies.md, "Real-time
chunking").

The tiny checkpoints are built like tests/test_vla.py's (the same builder and sizes) but with 10
flow steps, as LeRobot's RTC is measured with (FACTS.md)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import ConfigError, PolicyError, ProtocolError  # noqa: E402
from lerobot_zenoh.protocol.messages import RtcInputs  # noqa: E402
from lerobot_zenoh.server.config.manifest import parse_manifest  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest, LoadOptions, RtcSettings, load_policy_runner  # noqa: E402
from lerobot_zenoh.server.runners.base import RTC_EXTRA, RTC_EXTRA_DELAY  # noqa: E402

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
CAMERAS = {"front": (48, 64), "wrist": (48, 64)}
CHUNK = 10
STEPS = 10
HORIZON = 8
ACTION_MEAN = np.array([10.0, -20.0, 0.5, 3.0], dtype=np.float32)
ACTION_STD = np.array([2.0, 0.5, 1.0, 4.0], dtype=np.float32)
TASKS = ("pick up the red cube", "open the drawer", "fold the towel on the table", "push the block left")
RTC_ON = RtcSettings(enabled=True, execution_horizon=HORIZON)


@pytest.fixture(scope="session")
def rtc_checkpoints(tmp_path_factory):
    """Tiny smolvla / pi0 checkpoints (10 flow steps), each built once per test session, lazily."""
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    root = tmp_path_factory.mktemp("rtc_checkpoints")
    built: dict[str, Path] = {}
    lock = threading.Lock()

    def get(policy_type: str, overrides: dict | None = None) -> Path:
        name = policy_type + "".join(f"-{k}" for k in sorted(overrides or {}))
        with lock:
            if name not in built:
                steps = {"num_steps": STEPS} if policy_type == "smolvla" else {"num_inference_steps": STEPS}
                built[name] = build_checkpoint(
                    root / name, policy_type=policy_type, state_names=STATE_NAMES, action_names=STATE_NAMES,
                    cameras=CAMERAS, chunk_size=CHUNK, fps=30, overrides={**steps, **(overrides or {})},
                    stats={"action": {"mean": ACTION_MEAN.tolist(), "std": ACTION_STD.tolist()}})
            return built[name]

    return get


@pytest.fixture(scope="session")
def rtc_runners(rtc_checkpoints):
    """One loaded runner per (type, RTC on/off), shared by the tests that only run it."""
    loaded = {}

    def get(policy_type: str, rtc: bool = True):
        if (policy_type, rtc) not in loaded:
            options = LoadOptions(rtc=RTC_ON if rtc else RtcSettings())
            loaded[policy_type, rtc] = load_policy_runner(rtc_checkpoints(policy_type), options=options)
        return loaded[policy_type, rtc]

    return get


def request(session: str, task: str, seed: int, rng_seed: int = 0, rows: int | None = None,
            delay: int = 0) -> InferenceRequest:
    """An observation; with `rows`, RTC inputs: a leftover of that many actions (robot units, around
    the checkpoint's action statistics) and `delay`."""
    rng = np.random.default_rng(rng_seed)
    state = (ACTION_MEAN + ACTION_STD * rng.normal(size=len(STATE_NAMES))).astype(np.float32)
    images = {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam, (h, w) in CAMERAS.items()}
    extras = {}
    if rows is not None:
        prefix = (ACTION_MEAN + ACTION_STD * rng.normal(size=(rows, len(STATE_NAMES)))).astype(np.float32)
        extras = {RTC_EXTRA: RtcInputs(prefix, delay)}
    return InferenceRequest(session, state, images, task, seed, extras=extras)


def plain(r: InferenceRequest) -> InferenceRequest:
    return dataclasses.replace(r, extras={})


def normalized(actions: np.ndarray) -> np.ndarray:
    """LeRobot's MEAN_STD normalization of `action` with the checkpoint's statistics."""
    return (actions - ACTION_MEAN) / (ACTION_STD + 1e-8)


# -- settings ---------------------------------------------------------------------------------------


def entry(**kw):
    """A one-model manifest; `kw` set (or, as None, remove) the model entry's fields."""
    model = {"model_id": "m", "model_version": "v", "application_tag": "a", "pretrained_path": "x",
             "accept_unknown_clients": True, **kw}
    return {"cluster_uuid": "c", "experiment_tag": "e", "server": [{k: v for k, v in model.items() if v is not None}]}


def test_the_manifest_rtc_block_defaults_to_lerobots_and_names_a_bad_field():
    from lerobot.policies.rtc.configuration_rtc import RTCConfig

    block = parse_manifest(entry()).server[0].rtc
    lerobot = RTCConfig()
    assert block.enabled is False
    assert (block.execution_horizon, block.max_guidance_weight, block.prefix_attention_schedule) == (
        lerobot.execution_horizon, lerobot.max_guidance_weight, lerobot.prefix_attention_schedule.value.lower())
    given = {"enabled": True, "execution_horizon": 5, "max_guidance_weight": 2.5, "prefix_attention_schedule": "exp"}
    assert parse_manifest(entry(rtc=given)).server[0].rtc == RtcSettings(**given)  # the very class
    for field, value in (("enabled", "yes"), ("execution_horizon", 0), ("execution_horizon", "3"),
                         ("execution_horizon", 2.5), ("max_guidance_weight", 0), ("max_guidance_weight", -1.0),
                         ("max_guidance_weight", float("inf")), ("prefix_attention_schedule", "cosine"),
                         ("guidance", 1.0)):
        with pytest.raises(ConfigError, match=rf"server\.0\.rtc\.{field}"):
            parse_manifest(entry(rtc={field: value}))
    for field, value in (("execution_horizon", 0), ("max_guidance_weight", 0.0),
                         ("prefix_attention_schedule", "cosine"), ("enabled", 1)):
        with pytest.raises(ConfigError, match=rf"rtc\.{field}"):
            RtcSettings(**{field: value})


@pytest.mark.slow
def test_rtc_on_a_family_that_cannot_do_it_fails_at_start_up_naming_the_field(tmp_path, rtc_checkpoints):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.config.runner_loading import load_runner

    folder = build_checkpoint(tmp_path / "act", policy_type="act", state_names=STATE_NAMES,
                              action_names=STATE_NAMES, cameras={"front": (32, 32)}, chunk_size=4,
                              overrides={"dim_model": 32, "n_heads": 2, "dim_feedforward": 32,
                                         "n_encoder_layers": 1, "n_decoder_layers": 1,
                                         "n_vae_encoder_layers": 1, "latent_dim": 4})
    with pytest.raises(PolicyError, match=r"server\[m\]\.rtc\.enabled: act cannot do real-time chunking"):
        load_policy_runner(folder, options=LoadOptions(rtc=RTC_ON, field_prefix="server[m]."))
    with pytest.raises(PolicyError, match=r"server\[m\]\.rtc\.execution_horizon: 11 is longer than .*\(10 actions\)"):
        load_policy_runner(rtc_checkpoints("smolvla"), options=LoadOptions(
            rtc=RtcSettings(enabled=True, execution_horizon=11), field_prefix="server[m]."))
    manifest = parse_manifest(entry(pretrained_path=None, rtc={"enabled": True},
                                    synthetic={"state_dim": 4, "action_dim": 4, "cameras": {}}))
    with pytest.raises(ConfigError, match=r"server\[m\]\.rtc\.enabled"):
        load_runner(manifest, manifest.server[0])


@pytest.mark.slow
def test_the_status_advertises_the_manifests_execution_horizon(rtc_checkpoints, port, app_key):
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.server.config.runner_loading import load_runner
    from lerobot_zenoh.server.shell.policy_server import ServedModel

    for rtc, advert in (({"enabled": True, "execution_horizon": 6}, 6), ({}, None)):
        manifest = parse_manifest(entry(pretrained_path=str(rtc_checkpoints("smolvla")), rtc=rtc))
        runner = load_runner(manifest, manifest.server[0])
        assert runner.spec.capabilities.rtc == (advert is not None)
        model = ServedModel(manifest, manifest.server[0], runner, "gpu0")
        model.adapter.close()
        status = codec.decode_status(model.status_bytes)
        assert (status.rtc.execution_horizon if status.rtc else None) == advert


# -- per-row guidance ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_a_batch_of_four_delays_and_prefixes_equals_each_request_alone(rtc_runners, policy_type):
    runner = rtc_runners(policy_type)
    assert runner.spec.capabilities.rtc
    # four delays, four prefix lengths (one shorter than the horizon), four tasks, four noises
    shapes = [(9, 1), (6, 3), (10, 5), (4, 4)]
    requests = [request(f"s{i}", TASKS[i], seed=500 + i, rng_seed=40 + i, rows=n, delay=d)
                for i, (n, d) in enumerate(shapes)]
    batched = runner.run(requests)
    worst = 0.0
    for r, result in zip(requests, batched, strict=True):
        (alone,) = runner.run([r])
        worst = max(worst, float(np.abs(result.actions - alone.actions).max()))
        np.testing.assert_allclose(result.actions, alone.actions, rtol=1e-4, atol=1e-4)
        assert result.extras[RTC_EXTRA_DELAY] == alone.extras[RTC_EXTRA_DELAY] == r.extras[RTC_EXTRA].delay_steps
    print(f"{policy_type}: batch of 4 with RTC vs each alone: max |diff| {worst:.2e} (robot units)")

    # A request without a prefix (and one with an empty prefix) in a guided batch: its plain chunk.
    mixed = [requests[0], request("p", TASKS[1], seed=7, rng_seed=3),
             request("z", TASKS[2], seed=8, rng_seed=4, rows=0)]
    out = runner.run(mixed)
    for r, result in zip(mixed[1:], out[1:], strict=True):
        np.testing.assert_allclose(result.actions, runner.run([plain(r)])[0].actions, rtol=1e-4, atol=1e-4)
    assert RTC_EXTRA_DELAY not in out[1].extras and out[2].extras[RTC_EXTRA_DELAY] == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_one_request_equals_lerobots_own_rtc_call(rtc_checkpoints, policy_type):
    """LeRobot's RTCProcessor, its scalar delay and its own normalization of the leftover (the
    checkpoint's action mean/std, computed here independently), against the served chunk."""
    import torch
    from lerobot.policies.rtc.modeling_rtc import RTCProcessor

    runner = load_policy_runner(rtc_checkpoints(policy_type), options=LoadOptions(rtc=RTC_ON))
    for n, d in ((7, 3), (4, 2)):  # a leftover longer and one shorter than the horizon
        r = request("a", TASKS[1], seed=900 + n, rng_seed=n, rows=n, delay=d)
        (served,) = runner.run([r])
        policy = runner.policy
        ours = policy.rtc_processor
        policy.rtc_processor = policy.model.rtc_processor = RTCProcessor(policy.config.rtc_config)
        try:
            with torch.no_grad():
                batch = runner.preprocessor(runner._stack([r]))
                leftover = torch.from_numpy(normalized(r.extras[RTC_EXTRA].prefix).astype(np.float32))
                chunk = policy.predict_action_chunk(batch, noise=runner._noise(r.seed)[None], inference_delay=d,
                                                    prev_chunk_left_over=leftover, execution_horizon=HORIZON)
                theirs = runner.postprocessor(chunk).numpy()[0]
        finally:
            policy.rtc_processor = policy.model.rtc_processor = ours
        diff = np.abs(served.actions - theirs).max()
        print(f"{policy_type} n={n} d={d}: served vs LeRobot's RTC max |diff| {diff:.2e}")
        np.testing.assert_allclose(served.actions, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_without_a_prefix_the_chunk_is_plain_sampling_bit_for_bit(rtc_runners, policy_type):
    on, off = rtc_runners(policy_type), rtc_runners(policy_type, rtc=False)
    assert not off.spec.capabilities.rtc and off.policy.config.rtc_config is None
    rs = [request(f"s{i}", TASKS[i], seed=60 + i, rng_seed=60 + i) for i in range(2)]
    reference = [result.actions for result in off.run(rs)]
    for variant in (rs, [dataclasses.replace(r, extras={RTC_EXTRA: RtcInputs(np.zeros((0, 4), np.float32), 0)})
                         for r in rs]):
        out = on.run(variant)
        for a, b in zip(out, reference, strict=True):
            assert np.array_equal(a.actions, b)
        assert np.array_equal(on.run(variant[:1])[0].actions, off.run(rs[:1])[0].actions)


@pytest.mark.slow
@pytest.mark.parametrize("policy_type", ["smolvla", "pi0"])
def test_the_first_delay_actions_follow_the_prefix(rtc_runners, policy_type):
    runner = rtc_runners(policy_type)
    rtc_err, plain_err = [], []
    for i, d in enumerate((2, 4, 6)):
        r = request(f"s{i}", TASKS[i], seed=70 + i, rng_seed=70 + i, rows=9, delay=d)
        prefix = normalized(r.extras[RTC_EXTRA].prefix[:d])
        rtc_err.append(float(np.abs(normalized(runner.run([r])[0].actions[:d]) - prefix).max()))
        plain_err.append(float(np.abs(normalized(runner.run([plain(r)])[0].actions[:d]) - prefix).max()))
    print(f"{policy_type}: first d actions vs prefix (normalized): RTC {max(rtc_err):.3f}, plain {min(plain_err):.3f}")
    assert max(rtc_err) < 0.1 and min(plain_err) > 1.0


@pytest.mark.slow
def test_relative_actions_get_a_prefix_in_the_models_own_frame(rtc_checkpoints):
    """pi0 with relative actions: the leftover (absolute) is re-expressed against the observation's
    state by the checkpoint's own relative step before normalization, so the absolute chunk
    continues it."""
    folder = rtc_checkpoints("pi0", overrides={"use_relative_actions": True, "relative_exclude_joints": []})
    runner = load_policy_runner(folder, options=LoadOptions(rtc=RTC_ON))
    r = request("a", TASKS[0], seed=3, rng_seed=5, rows=8, delay=4)
    prefix = r.extras[RTC_EXTRA].prefix
    err = np.abs(runner.run([r])[0].actions[:4] - prefix[:4]) / ACTION_STD
    free = np.abs(runner.run([plain(r)])[0].actions[:4] - prefix[:4]) / ACTION_STD
    print(f"pi0 relative: first d actions vs prefix: RTC max {err.max():.3f}, plain mean {free.mean():.3f}")
    assert err.max() < 0.1 and free.mean() > 1.0


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_bad_rtc_request_fails_alone_and_the_batch_is_served(rtc_runners):
    from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter

    runner = rtc_runners("smolvla")
    good = [request(f"s{i}", TASKS[i], seed=80 + i, rng_seed=80 + i, rows=6, delay=i + 1) for i in range(3)]
    prefix = good[0].extras[RTC_EXTRA].prefix
    bads = {"bad_rtc_prefix": [RtcInputs(prefix[:, :3], 1), RtcInputs(prefix * np.nan, 1),
                               RtcInputs(np.zeros((CHUNK + 1, 4), np.float32), 1)],
            "bad_rtc_delay": [RtcInputs(prefix, -1), RtcInputs(prefix, 7)]}
    executor = RunnerAdapter("m", runner, actions_per_chunk=CHUNK, server_id="gpu0")
    try:
        for reason, inputs in bads.items():
            for rtc in inputs:
                bad = dataclasses.replace(good[1], session_id="bad", extras={RTC_EXTRA: rtc})
                with pytest.raises(ProtocolError) as info:
                    runner.check_request(bad)
                assert info.value.reason == reason
                # Past the checks (a runner called directly): the batch fails, each request again alone.
                results = executor.infer([good[0], bad, good[2]])
                assert isinstance(results[1], PolicyError) and reason in str(results[1])
                for r, result in zip((good[0], good[2]), (results[0], results[2]), strict=True):
                    np.testing.assert_array_equal(result.actions, runner.run([r])[0].actions)
    finally:
        executor.close()


@pytest.mark.slow
def test_bad_rtc_inputs_over_zenoh_are_counted_for_that_robot_and_the_other_is_served(rtc_checkpoints, port, app_key):
    import msgpack

    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import Observation
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings
    from lz_testing import wait_for

    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "pretrained_path": str(rtc_checkpoints("smolvla")), "fps": 30, "max_batch_size": 2,
                    "rtc": {"enabled": True, "execution_horizon": HORIZON},
                    "clients": [{"client_uuid": "good"}, {"client_uuid": "bad"}]}],
    })
    server = PolicyServer(manifest).start()
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    try:
        assert wait_for(lambda: session.query(app_key.status, 0.3), 20), "status never answered"
        chunks = []
        session.subscribe(app_key.client("good").action, lambda k, b: chunks.append(codec.decode_action_chunk(b)))
        bad_chunks = []
        session.subscribe(app_key.client("bad").action, lambda k, b: bad_chunks.append(b))
        pubs = {c: session.publisher(app_key.client(c).obs, OBSERVATION_QOS) for c in ("good", "bad")}
        rng = np.random.default_rng(1)
        images = {c: codec.encode_jpeg(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), 90)
                  for c, (h, w) in CAMERAS.items()}
        prefix = (ACTION_MEAN + ACTION_STD * rng.normal(size=(6, 4))).astype(np.float32)
        state = ACTION_MEAN.copy()

        def observation(client, seq, rtc):
            return Observation(seq, client, state, images, TASKS[0], episode_id="0", session_nonce=1, rtc=rtc)

        def bad_payloads(seq):
            wrong_dim = observation("bad", seq, RtcInputs(prefix[:, :3], 1))
            yield codec.encode(wrong_dim)
            for rtc in ({"prefix": codec.pack_array(prefix * np.nan), "delay_steps": 1},
                        {"prefix": codec.pack_array(prefix), "delay_steps": 7},
                        {"prefix": codec.pack_array(prefix), "delay_steps": -1}):
                raw = msgpack.unpackb(codec.encode(wrong_dim), raw=False)
                raw["rtc"] = rtc
                yield msgpack.packb(raw, use_bin_type=True)

        def rejected():
            return server.stats()[app_key.prefix]["clients"].get("bad", {}).get("rejected", {})

        seq = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ({"bad_rtc_prefix", "bad_rtc_delay"} <= set(rejected()) and chunks):
            seq += 1
            for payload in bad_payloads(seq):
                pubs["bad"].put(payload)
            pubs["good"].put(codec.encode(observation("good", seq, RtcInputs(prefix, 3))))
            wait_for(lambda s=seq: any(c.response_to_seq_id == s for c in chunks), 1.0)
        assert {"bad_rtc_prefix", "bad_rtc_delay"} <= set(rejected()), rejected()
        assert chunks and not bad_chunks
        for chunk in chunks:
            assert chunk.rtc_delay_steps == 3
            assert np.abs(normalized(chunk.actions[:3]) - normalized(prefix[:3])).max() < 0.1
        assert server.stats()[app_key.prefix]["clients"]["good"]["rejected"] == {}
    finally:
        session.close()
        server.stop()


# -- hot standby ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_smolvla_standby_continues_the_robots_motion_from_its_first_observation(tmp_path_factory, app_key):
    """The standby never saw the primary's chunks: its first chunk continues the leftover that the
    observation carries (RTC keeps no state on the server)."""
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.client import RobotClient
    from lerobot_zenoh.client.config_sim_robot import SO101_JOINTS
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings, loopback_settings
    from lz_testing import CAMS, free_port, make_config, wait_for

    names = tuple(f"{j}.pos" for j in SO101_JOINTS)
    folder = build_checkpoint(tmp_path_factory.mktemp("standby") / "smolvla", policy_type="smolvla",
                              state_names=names, action_names=names, cameras=CAMS, chunk_size=60, fps=30,
                              overrides={"num_steps": STEPS})

    def manifest(port, server_id, standby_for=None, connect=()):
        return parse_manifest({
            "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": server_id,
            "standby_for": standby_for, "handover_grace_s": 0.3, "telemetry_period_s": 0,
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "connect": list(connect), "multicast_scouting": False},
            "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                        "pretrained_path": str(folder), "fps": 30, "accept_unknown_clients": True,
                        "rtc": {"enabled": True, "execution_horizon": 20}}],
        })

    p1, p2 = free_port(), free_port()
    primary = PolicyServer(manifest(p1, "gpu0")).start()
    standby = PolicyServer(manifest(p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"])).start()
    cfg = make_config(p1, app_key, watchdog_timeout_s=0.5, actions_per_chunk=60,
                      send=SendTriggerConfig(buffer_time_s=1.5, request_timeout_s=0.5))
    cfg.zenoh = ZenohSettings(multicast_scouting=False, connect=[f"tcp/127.0.0.1:{p2}"])
    obs, chunks = {}, []
    mon = ZenohSession(loopback_settings(None, listen=False, connect_ports=(p2,))).open()
    mon.subscribe(app_key.client("r1").obs, lambda k, b: obs.setdefault((o := codec.decode_observation(b)).seq_id, o))
    mon.subscribe(app_key.client("r1").action, lambda k, b: chunks.append(codec.decode_action_chunk(b)))
    client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
    runner = threading.Thread(target=client.run)
    runner.start()
    try:
        assert client.rtc_active
        assert wait_for(lambda: sum(1 for c in chunks if c.server_id == "gpu0") >= 3, 30)
        primary.stop()
        assert wait_for(lambda: any(c.server_id == "gpu1" for c in chunks), 20), "standby never served"
        assert wait_for(lambda: sum(1 for c in chunks if c.server_id == "gpu1") >= 2, 20)
    finally:
        client.stop()
        runner.join(5)
        client.close()
        mon.close()
        standby.stop()
        primary.stop()
    first = next(c for c in chunks if c.server_id == "gpu1")
    rtc = obs[first.response_to_seq_id].rtc
    d = first.rtc_delay_steps
    err = float(np.abs(first.actions[:d] - rtc.prefix[:d]).max()) if d else 0.0
    print(f"standby's first RTC observation: {len(rtc.prefix)} leftover actions, delay {rtc.delay_steps}; "
          f"first d rows vs leftover max |diff| {err:.3f} (std-1 action statistics)")
    assert len(rtc.prefix) > rtc.delay_steps > 0  # the robot was mid-motion
    assert d == min(rtc.delay_steps, 20)
    assert err < 0.1
    assert client.counters.rtc_fallback_chunks == 0
