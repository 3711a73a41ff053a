"""The policy server with real Zenoh on loopback and the synthetic policy."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from lerobot_zenoh.errors import ConfigError, PolicyError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.config.manifest import load_manifest, parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.server.runners.synthetic import synthetic_actions
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

CAMS = {"front": (48, 64), "wrist": (48, 64)}


def manifest_dict(port, app_key, **entry):
    base = {
        "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
        "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": CAMS, "latency_ms": 5},
        "fps": 30, "actions_per_chunk": 10,
        "clients": [{"client_uuid": c} for c in ("r1", "r2", "r3", "bad")],
    }
    base.update(entry)
    return {
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [base],
    }




class FakeClient:
    """The wire side of a robot client, written against the protocol only."""

    def __init__(self, session: ZenohSession, app_key, client_id: str):
        self.key = app_key.client(client_id)
        self.client_id = client_id
        self.chunks = []
        self.sent: dict[int, tuple[np.ndarray, dict]] = {}
        session.subscribe(self.key.action, lambda k, b: self.chunks.append((k, codec.decode_action_chunk(b))))
        self.pub = session.publisher(self.key.obs, OBSERVATION_QOS)

    def send(self, seq_id, rng, cameras=CAMS, state_dim=6, client_uuid=None):
        state = rng.normal(size=state_dim).astype(np.float32)
        jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8), 90) for n, hw in cameras.items()}
        self.sent[seq_id] = (state, {n: codec.decode_jpeg(j) for n, j in jpegs.items()})
        self.pub.put(codec.encode(Observation(seq_id, client_uuid or self.client_id, state, jpegs, "task")))

    def expected(self, seq_id, actions_per_chunk=10):
        state, images = self.sent[seq_id]
        return synthetic_actions(state, images, 20, 6)[:actions_per_chunk]


@pytest.fixture
def served(port, app_key):
    server = PolicyServer(parse_manifest(manifest_dict(port, app_key))).start()
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    yield server, session
    session.close()
    server.stop()


def wait_discovered(session, app_key):
    assert wait_for(lambda: session.query(app_key.status, 0.3)), "status never answered"


def send_until_served(client, seq_id, rng, **kw):
    """Observations are best effort: resend the same seq until its chunk arrives."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        client.send(seq_id, rng, **kw)
        if wait_for(lambda: any(c.response_to_seq_id == seq_id for _, c in client.chunks), 0.5):
            return
    raise AssertionError(f"{client.client_id}: no chunk for seq {seq_id}")


def test_three_clients_each_get_only_their_own_chunks(served, app_key):
    server, session = served
    wait_discovered(session, app_key)
    clients = [FakeClient(session, app_key, c) for c in ("r1", "r2", "r3")]
    rng = np.random.default_rng(0)
    threads = [threading.Thread(target=lambda c=c, i=i: [send_until_served(c, 100 * i + s, np.random.default_rng(i * 10 + s)) for s in range(5)])
               for i, c in enumerate(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for c in clients:
        assert c.chunks, c.client_id
        for key, chunk in c.chunks:
            assert key == c.key.action
            assert chunk.response_to_seq_id in c.sent  # never another client's sequence
            np.testing.assert_allclose(chunk.actions, c.expected(chunk.response_to_seq_id), rtol=0, atol=1e-6)
            assert chunk.actions.shape == (10, 6) and chunk.server_id == "gpu0"
            assert chunk.inference_time_ms >= 5.0 and chunk.queue_time_ms >= 0
    del rng


def test_status_describes_the_served_model(served, app_key):
    server, session = served
    wait_discovered(session, app_key)
    (key, payload), = session.query(app_key.status, 1.0)
    status = codec.decode_status(payload)
    assert status.expected_cameras == CAMS
    assert (status.action_dim, status.max_actions_per_chunk, status.state_dim, status.fps) == (6, 10, 6, 30)
    assert status.policy_type == "synthetic" and status.server_id == "gpu0"
    assert status.observation_features["observation.state"]["shape"] == [6]
    assert session.alive(app_key.all_servers) == [app_key.server_token("gpu0")]


def test_a_bad_client_does_not_change_what_others_receive(served, app_key):
    server, session = served
    wait_discovered(session, app_key)
    good, bad = FakeClient(session, app_key, "r1"), FakeClient(session, app_key, "bad")
    rng = np.random.default_rng(1)
    stop = threading.Event()

    def attack():
        i = 0
        while not stop.is_set():
            i += 1
            kind = i % 5
            if kind == 0:
                bad.pub.put(b"\x93garbage")
            elif kind == 1:
                bad.send(i, rng, state_dim=3)  # wrong state shape
            elif kind == 2:
                bad.send(i, rng, cameras={"front": (48, 64), "side": (48, 64)})  # unknown camera
            elif kind == 3:
                bad.send(i, rng, cameras={"front": (96, 64), "wrist": (48, 64)})  # wrong resolution
            else:
                bad.send(i, rng, client_uuid="r1")  # impersonating r1 in the payload
            time.sleep(0.002)

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        for s in range(8):
            send_until_served(good, s, np.random.default_rng(100 + s))
    finally:
        stop.set()
        attacker.join()
    for _, chunk in good.chunks:
        np.testing.assert_allclose(chunk.actions, good.expected(chunk.response_to_seq_id), atol=1e-6)
    assert bad.chunks == []
    rejected = server.stats()[app_key.prefix]["clients"]["bad"]["rejected"]
    assert {"bad_msgpack", "wrong_state_dim", "wrong_cameras", "wrong_image_shape", "client_mismatch"} <= set(rejected), rejected
    assert server.stats()[app_key.prefix]["clients"]["r1"]["rejected"] == {}


def test_unknown_clients_are_rejected_and_counted(served, app_key):
    server, session = served
    wait_discovered(session, app_key)
    stranger = FakeClient(session, app_key, "stranger")
    rng = np.random.default_rng(2)
    assert wait_for(lambda: (stranger.send(1, rng), server.models[0].session_table.dropped["unknown_client"] > 2)[1])
    # A known client's chunk after the refusals: the server's chunks reach this session in order
    # (one reliable link), so a chunk answering the stranger would have arrived before it.
    send_until_served(FakeClient(session, app_key, "r1"), 1, rng)
    assert stranger.chunks == []
    assert server.models[0].session_table.roster.unknown_refused["stranger"] >= 3
    assert "stranger" not in server.stats()[app_key.prefix]["clients"]


def test_newest_observation_supersedes_an_unserved_one(port, app_key, monkeypatch):
    from lerobot_zenoh.server.shell import policy_server as server_module

    decoded = []
    real_decode = server_module.codec.decode_observation
    monkeypatch.setattr(server_module.codec, "decode_observation",
                        lambda data, *a, **kw: (decoded.append(1), real_decode(data, *a, **kw))[1])
    m = manifest_dict(port, app_key)
    m["server"][0]["synthetic"]["latency_ms"] = 300
    with PolicyServer(parse_manifest(m)) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        wait_discovered(session, app_key)
        c = FakeClient(session, app_key, "r1")
        rng = np.random.default_rng(3)
        send_until_served(c, 0, rng)
        for s in range(1, 6):  # five observations while the first inference of them runs
            c.send(s, rng)
            time.sleep(0.02)
        assert wait_for(lambda: any(ch.response_to_seq_id == 5 for _, ch in c.chunks), 5)
        served_seqs = [ch.response_to_seq_id for _, ch in c.chunks]
        assert len(served_seqs) < 6  # some were superseded, never queued
        stats = server.stats()[app_key.prefix]["clients"]["r1"]
        assert stats["superseded"] >= 1
        assert len(decoded) == stats["served"]  # a superseded observation is never decoded


def test_bad_manifests_fail_naming_file_and_field(tmp_path, app_key):
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent("""
        cluster_uuid: jupiter
        experiment_tag: fabio2
        server:
          - model_id: pi0
            model_version: v1
            application_tag: cookie
            pretrained_path: x
            fps: -3
            clients: [{client_uuid: a}]
    """))
    with pytest.raises(ConfigError) as err:
        load_manifest(path)
    assert str(path) in str(err.value) and "server.0.fps" in str(err.value)
    for bad, field in [
        ({"model_id": "pi/0"}, "server.0.model_id"),
        ({"scheduler": "lottery"}, "server.0.scheduler"),
        ({"colour": "red"}, "server.0.colour"),
        ({"clients": [], "accept_unknown_clients": False}, "server.0"),
        ({"pretrained_path": "x"}, "server.0"),  # both synthetic and a checkpoint
    ]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            parse_manifest(manifest_dict(1, app_key, **bad), source="m.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_manifest(tmp_path / "missing.yaml")


def test_scheduler_is_a_name_or_a_mapping_with_its_settings(app_key):
    def scheduler(value):
        return parse_manifest(manifest_dict(1, app_key, scheduler=value)).server[0].scheduler

    assert scheduler("wait_ratio") == scheduler({"type": "wait_ratio"})  # the name = the defaults
    built = scheduler("wait_ratio").build()
    assert (built.buckets, built.aging, built.first_request) == (10, 1, "literal")
    entry = scheduler({"type": "wait_ratio", "buckets": 4, "aging": 3, "first_request": "mean"})
    built = entry.build()
    assert (built.name, built.buckets, built.aging, built.first_request) == ("wait_ratio", 4, 3, "mean")
    assert scheduler({"type": "fifo"}).build().name == "fifo"
    assert parse_manifest(manifest_dict(1, app_key)).server[0].scheduler.build().name == "round_robin"


@pytest.mark.parametrize("value, field", [
    ("lottery", "server.0.scheduler"),
    ({"type": "lottery"}, "server.0.scheduler.type"),
    ({"type": "fifo", "buckets": 4}, "server.0.scheduler"),  # a setting of another type
    ({"aging": 2}, "server.0.scheduler"),  # type defaults to round_robin, which has no settings
    ({"type": "wait_ratio", "buckets": 0}, "server.0.scheduler.buckets"),
    ({"type": "wait_ratio", "buckets": True}, "server.0.scheduler.buckets"),
    ({"type": "wait_ratio", "aging": 1.5}, "server.0.scheduler.aging"),
    ({"type": "wait_ratio", "first_request": "never"}, "server.0.scheduler.first_request"),
    ({"type": "wait_ratio", "colour": "red"}, "server.0.scheduler.colour"),
    (3, "server.0.scheduler"),
])
def test_bad_scheduler_settings_fail_naming_the_field(app_key, value, field):
    with pytest.raises(ConfigError) as info:
        parse_manifest(manifest_dict(1, app_key, scheduler=value), source="m.yaml")
    assert info.value.field == field


def test_server_runs_the_wait_ratio_scheduler_with_the_manifest_settings(port, app_key):
    settings = {"buckets": 3, "aging": 2, "first_request": "lowest"}
    manifest = parse_manifest(manifest_dict(port, app_key, scheduler={"type": "wait_ratio", **settings}))
    with PolicyServer(manifest) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        scheduler = server.models[0].session_table.scheduler
        assert (scheduler.name, scheduler.buckets, scheduler.aging, scheduler.first_request) == ("wait_ratio", 3, 2, "lowest")
        wait_discovered(session, app_key)
        send_until_served(FakeClient(session, app_key, "r1"), 0, np.random.default_rng(0))
        metrics, _ = server.telemetry_figures(server.models[0])
    assert metrics["scheduler.decisions"] >= 1 and metrics["scheduler.tasks"] == 1  # that object drove the loop


def test_missing_checkpoint_stops_start_up(port, app_key, tmp_path):
    m = manifest_dict(port, app_key)
    del m["server"][0]["synthetic"]
    m["server"][0]["pretrained_path"] = str(tmp_path / "nope")
    with pytest.raises(PolicyError, match=r"pretrained_path: no folder .*nope"):
        PolicyServer(parse_manifest(m)).start()


def test_cli_exits_nonzero_on_bad_manifest_and_zero_on_sigterm(tmp_path, port, app_key):
    import yaml

    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster_uuid: [oops\n")
    r = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bad.yaml" in r.stderr

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(manifest_dict(port, app_key)))
    proc = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest", str(good)],
                            stderr=subprocess.PIPE, text=True)
    try:
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
            assert wait_for(lambda: session.query(app_key.status, 0.3), 30)
        proc.terminate()
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 3.0
    finally:
        proc.kill()



@pytest.mark.slow
def test_status_and_chunks_of_a_real_act_checkpoint(port, app_key, tmp_path):
    """The offline builder's checkpoint, loaded by the server through LeRobot's from_pretrained."""
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    joints = ("shoulder_pan.pos", "shoulder_lift.pos", "elbow_flex.pos", "wrist_flex.pos", "wrist_roll.pos", "gripper.pos")
    path = build_checkpoint(tmp_path / "act", policy_type="act", state_names=joints, action_names=joints,
                            cameras=CAMS, chunk_size=20, fps=30,
                            overrides={"dim_model": 64, "n_heads": 2, "dim_feedforward": 128, "n_encoder_layers": 1,
                                       "n_decoder_layers": 1, "n_vae_encoder_layers": 1, "latent_dim": 8})
    m = manifest_dict(port, app_key)
    del m["server"][0]["synthetic"]
    m["server"][0]["pretrained_path"] = str(path)
    with PolicyServer(parse_manifest(m)), \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        wait_discovered(session, app_key)
        (_, payload), = session.query(app_key.status, 1.0)
        status = codec.decode_status(payload)
        assert status.policy_type == "act" and status.expected_cameras == CAMS
        assert (status.action_dim, status.state_dim, status.max_actions_per_chunk, status.fps) == (6, 6, 10, 30)
        assert status.action_names == joints
        assert status.observation_features["observation.state"]["names"] == list(joints)
        assert status.observation_features["observation.images.front"]["shape"] == [48, 64, 3]
        client = FakeClient(session, app_key, "r1")
        send_until_served(client, 1, np.random.default_rng(0))
        chunk = next(c for _, c in client.chunks if c.response_to_seq_id == 1)
        assert chunk.actions.shape == (10, 6) and np.all(np.isfinite(chunk.actions))


def test_executor_passes_rtc_inputs_per_request_rejects_bad_ones_alone_and_echoes_the_delay():
    from lerobot_zenoh.errors import ProtocolError
    from lerobot_zenoh.protocol.messages import RtcInputs
    from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter
    from lerobot_zenoh.server.runners.base import RTC_EXTRA
    from lerobot_zenoh.server.runners.synthetic import SyntheticPolicy, SyntheticPolicyConfig

    def policy(rtc):
        return SyntheticPolicy(SyntheticPolicyConfig(state_dim=3, cameras={}, action_dim=2, chunk_size=12, rtc=rtc))

    rng = np.random.default_rng(0)

    def obs(client, seq, rows, delay, cols=2):
        prefix = rng.normal(size=(rows, cols)).astype(np.float32)
        return Observation(seq, client, rng.normal(size=3).astype(np.float32), {}, rtc=RtcInputs(prefix, delay))

    ex = RunnerAdapter("m", policy(rtc=True), actions_per_chunk=8, server_id="gpu0")
    good = [obs(f"r{i}", i + 1, rows=2 + i, delay=i) for i in range(4)]  # four delays in one batch
    requests = [ex.prepare(o.client_uuid, o) for o in good]
    assert all(r.extras[RTC_EXTRA].prefix.dtype == np.float32 for r in requests)
    for bad, detail in ((obs("r9", 1, rows=3, delay=1, cols=3), r"shape \(3, 3\)"),
                        (obs("r9", 2, rows=9, delay=1), "9 rows")):
        with pytest.raises(ProtocolError, match=detail) as exc:  # this request only: the others are prepared
            ex.prepare("r9", bad)
        assert exc.value.reason == "bad_rtc_prefix"
    results = ex.infer(requests)
    for o, result in zip(good, results, strict=True):
        chunk = codec.decode_action_chunk(ex.chunk(o, result, 1.0, 0.0))
        d = o.rtc.delay_steps
        assert chunk.rtc_delay_steps == d and chunk.actions.shape == (8, 2)
        np.testing.assert_array_equal(chunk.actions[:d], o.rtc.prefix[:d])  # continues its own prefix
        plain = synthetic_actions(o.state, {}, 12, 2)[:8]
        np.testing.assert_allclose(chunk.actions[d:], plain[d:])
    # A runner without RTC ignores the inputs (no check, no extras) and its chunks carry no echo.
    plain_ex = RunnerAdapter("m", policy(rtc=False), actions_per_chunk=8, server_id="gpu0")
    odd = obs("r1", 5, rows=3, delay=1, cols=3)
    request = plain_ex.prepare("r1", odd)
    assert RTC_EXTRA not in request.extras
    (result,) = plain_ex.infer([request])
    assert codec.decode_action_chunk(plain_ex.chunk(odd, result, 1.0, 0.0)).rtc_delay_steps is None


def test_status_advertises_rtc_only_for_a_runner_that_takes_it(port, app_key):
    from lerobot_zenoh.server.config.runner_loading import load_runner
    from lerobot_zenoh.server.shell.policy_server import ServedModel

    for rtc in (False, True):
        entry = {"synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": CAMS, "rtc": rtc}}
        manifest = parse_manifest(manifest_dict(port, app_key, **entry))
        model = ServedModel(manifest, manifest.server[0], load_runner(manifest, manifest.server[0]), "gpu0")
        model.adapter.close()
        assert (model.status.rtc is not None) == rtc
        assert (b"rtc" in model.status_bytes) == rtc


def test_bad_rtc_inputs_are_counted_for_that_client_and_the_others_are_served(port, app_key):
    import msgpack

    from lerobot_zenoh.protocol.messages import RtcInputs

    entry = {"synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": {}, "latency_ms": 5, "rtc": True},
             "max_batch_size": 4}
    server = PolicyServer(parse_manifest(manifest_dict(port, app_key, **entry))).start()
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    try:
        wait_discovered(session, app_key)
        good, bad = FakeClient(session, app_key, "r1"), FakeClient(session, app_key, "bad")
        prefix = np.arange(12, dtype=np.float32).reshape(2, 6)

        def bad_payloads(seq):
            wrong_dim = Observation(seq, "bad", np.zeros(6, np.float32), {}, rtc=RtcInputs(prefix[:, :4], 1))
            yield codec.encode(wrong_dim)
            for rtc in ({"prefix": codec.pack_array(prefix * np.nan), "delay_steps": 1},
                        {"prefix": codec.pack_array(prefix), "delay_steps": 3},
                        {"prefix": codec.pack_array(prefix), "delay_steps": -1}):
                raw = msgpack.unpackb(codec.encode(wrong_dim), raw=False)
                raw["rtc"] = rtc
                yield msgpack.packb(raw, use_bin_type=True)

        def rejected():
            return server.stats()[app_key.prefix]["clients"].get("bad", {}).get("rejected", {})

        seq = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not {"bad_rtc_prefix", "bad_rtc_delay"} <= set(rejected()):
            for payload in bad_payloads(seq := seq + 1):
                bad.pub.put(payload)
                time.sleep(0.01)
            good.pub.put(codec.encode(Observation(seq, "r1", np.ones(6, np.float32), {},
                                                  rtc=RtcInputs(prefix, 2))))
            wait_for(lambda s=seq: any(c.response_to_seq_id == s for _, c in good.chunks), 0.3)
        assert {"bad_rtc_prefix", "bad_rtc_delay"} <= set(rejected()), rejected()
        assert bad.chunks == [] and good.chunks
        for _, chunk in good.chunks:
            assert chunk.rtc_delay_steps == 2
            np.testing.assert_array_equal(chunk.actions[:2], prefix)
        assert server.stats()[app_key.prefix]["clients"]["r1"]["rejected"] == {}
    finally:
        session.close()
        server.stop()
