"""The OpenPI front door, driven by the official openpi-client (its own venv, .venv-openpi) against a
real policy server over real Zenoh on loopback.

The client runs in a subprocess (testbed/openpi_client_driver.py) under the environment that
scripts/openpi-client-venv.sh builds from the package index (`make openpi-client-venv`); the tests
that need it skip, with the reason, when it cannot be built. The wire and mapping tests need nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
from lz_testing import wait_for

from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.openpi.mapping import KeyMapping
from lerobot_zenoh.openpi.wire import OpenPIReason, pack, unpack
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Status
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.runners.synthetic import synthetic_actions
from lerobot_zenoh.server.shell.policy_server import PolicyServer

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent.parent / "testbed" / "openpi_client_driver.py"
VENV = Path(os.environ.get("OPENPI_VENV", ROOT / ".venv-openpi"))
CAMS = {"front": (48, 64), "wrist": (48, 64)}
SHAPES = {"observation/image": (48, 64, 3), "observation/wrist_image": (3, 48, 64)}  # HWC and CHW
MAPPING = {"images": {"observation/image": "front", "observation/wrist_image": "wrist"},
           "state": "observation/state", "prompt": "prompt"}
CHUNK, ACTION_DIM = 10, 6


def status(**kw) -> Status:
    return Status(model_id="m", model_version="v1", expected_cameras=dict(CAMS), action_dim=ACTION_DIM,
                  max_actions_per_chunk=CHUNK, observation_features={}, state_dim=6, **kw)


def observation(seed: int) -> dict:
    """The driver's observation for `seed` (same generator, same order)."""
    rng = np.random.default_rng(seed)
    obs = {key: rng.integers(0, 256, size=shape, dtype=np.uint8) for key, shape in SHAPES.items()}
    obs["observation/state"] = rng.normal(size=6).astype(np.float64)
    obs["prompt"] = "pick up the cube"
    return obs


def ndarray_map(dtype: str, shape, data: bytes) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": list(shape)}


# -- the wire (no client needed) ---------------------------------------------------------------


def test_openpi_frames_decode_to_arrays_and_replies_encode_as_the_client_reads_them():
    obs = observation(1)
    frame = msgpack.packb({k: ndarray_map(v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
                           for k, v in obs.items()}, use_bin_type=True)
    got = unpack(frame, 1 << 20)
    for key, value in obs.items():
        np.testing.assert_array_equal(got[key], value)
    reply = msgpack.unpackb(pack({"actions": np.ones((2, 3), np.float32), "server_timing": {"infer_ms": 1.0}}))
    assert reply[b"actions" if b"actions" in reply else "actions"][b"dtype"] == "<f4"


@pytest.mark.parametrize("frame, reason", [
    (b"\xc1\xc1\xc1", OpenPIReason.BAD_MSGPACK),
    (msgpack.packb([1, 2]), OpenPIReason.NOT_A_MAP),
    (msgpack.packb({"x": ndarray_map("|O", (1,), b"\0" * 8)}), OpenPIReason.BAD_DTYPE),
    (msgpack.packb({"x": ndarray_map("<c16", (1,), b"\0" * 16)}), OpenPIReason.BAD_DTYPE),
    (msgpack.packb({"x": ndarray_map("[('a', '|O')]", (1,), b"\0" * 8)}), OpenPIReason.BAD_DTYPE),
    (msgpack.packb({"x": {b"__npgeneric__": True, b"data": b"x", b"dtype": "|O"}}), OpenPIReason.BAD_DTYPE),
    (msgpack.packb({"x": ndarray_map("<f4", (4,), b"\0" * 15)}), OpenPIReason.SIZE_MISMATCH),
    (msgpack.packb({"x": ndarray_map("<f4", (1, 1, 1, 1, 1), b"\0" * 4)}), OpenPIReason.BAD_ARRAY),
    (msgpack.packb({"x": msgpack.ExtType(1, b"pickle")}), OpenPIReason.BAD_MSGPACK),
    (msgpack.packb({"x": [[[[[[[[[[1]]]]]]]]]]}), OpenPIReason.TOO_DEEP),
    ("a text frame", OpenPIReason.NOT_BINARY),
    (b"\x80" + b"\0" * 64, OpenPIReason.BAD_MSGPACK),  # a map, then bytes after it
])
def test_bad_frames_are_refused_with_a_reason_and_never_make_object_arrays(frame, reason):
    with pytest.raises(ProtocolError) as exc:
        unpack(frame, 1 << 20)
    assert exc.value.reason == reason


def test_a_frame_over_the_size_limit_is_refused():
    with pytest.raises(ProtocolError, match="too_large"):
        unpack(b"\0" * 2000, 1024)


# -- the mapping -------------------------------------------------------------------------------


def test_a_mapping_that_names_a_camera_the_model_lacks_fails_naming_the_key():
    mapping = KeyMapping(images={"observation/image": "front", "observation/wrist_image": "hand"},
                         state="observation/state")
    with pytest.raises(ConfigError, match=r"mapping\.images\.observation/wrist_image.*'hand'.*front, wrist"):
        mapping.check(status())
    with pytest.raises(ConfigError, match=r"mapping\.images: the model's camera 'wrist' has no OpenPI key"):
        KeyMapping(images={"observation/image": "front"}, state="observation/state").check(status())
    with pytest.raises(ConfigError, match=r"mapping\.state"):
        KeyMapping(images=MAPPING["images"]).check(status())
    with pytest.raises(ConfigError, match="named by more than one"):
        KeyMapping(images={"a": "front", "b": "front"})


def test_the_mapping_turns_a_request_into_state_cameras_and_task():
    mapping = KeyMapping(**MAPPING)
    mapping.check(status())
    obs = observation(3)
    state, images, task = mapping.apply(obs, status())
    np.testing.assert_array_equal(state, obs["observation/state"].astype(np.float32))
    np.testing.assert_array_equal(images["wrist"], obs["observation/wrist_image"].transpose(1, 2, 0))
    assert images["front"].shape == (48, 64, 3) and task == "pick up the cube"
    nested = {"images": {"cam": obs["observation/image"]}, "observation/state": obs["observation/state"]}
    m2 = KeyMapping(images={"images/cam": "front", "w": "wrist"}, state="observation/state", ignore=("w",))
    with pytest.raises(ProtocolError, match="missing_key.*'w'"):
        m2.apply(nested, status())
    droid = KeyMapping(images=MAPPING["images"], state=["observation/joint_position", "observation/gripper_position"])
    joints = {**{k: v for k, v in obs.items() if k != "observation/state"}, "observation/joint_position": np.arange(5.0),
              "observation/gripper_position": np.array([0.5])}
    np.testing.assert_array_equal(droid.apply(joints, status())[0], [0, 1, 2, 3, 4, 0.5])
    with pytest.raises(ProtocolError, match="'observation/joint_position' \\+ 'observation/gripper_position' give 7"):
        droid.apply({**joints, "observation/gripper_position": np.array([0.5, 1.0])}, status())
    for change, reason in [({"extra": 1}, "unknown_key"), ({"observation/state": np.zeros(5)}, "bad_state"),
                           ({"observation/image": np.zeros((48, 64, 3), np.float32)}, "bad_dtype"),
                           ({"observation/image": np.zeros((64, 48, 3), np.uint8)}, "wrong_image_shape"),
                           ({"prompt": 3}, "bad_prompt")]:
        with pytest.raises(ProtocolError) as exc:
            mapping.apply({**obs, **change}, status())
        assert exc.value.reason == reason


# -- against the real client -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client_python() -> Path:
    pytest.importorskip("websockets", reason="the front door needs `websockets` (pip install 'lerobot-zenoh[openpi]')")
    # At once when it is built already (its stamp); otherwise built from the package index.
    built = subprocess.run([str(ROOT / "scripts" / "openpi-client-venv.sh"), str(VENV)], capture_output=True,
                           text=True, timeout=600)
    if built.returncode != 0:
        pytest.skip(f"openpi-client's environment could not be built (no package index?): "
                    f"{built.stderr.strip().splitlines()[-1:]}")
    return VENV / "bin" / "python"


def drive(python: Path, port: int, env: dict | None = None, **args) -> subprocess.Popen:
    return subprocess.Popen([str(python), str(DRIVER), json.dumps({"port": port, "shapes": SHAPES, **args})],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # its own packages only
                                 **(env or {})})


def result(proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def server_manifest(port, app_key, latency_ms=100, batch=8, **entry):
    return parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "synthetic": {"state_dim": 6, "action_dim": ACTION_DIM, "chunk_size": CHUNK, "cameras": CAMS,
                                  "latency_ms": latency_ms, "batch_latency_ms": {1: latency_ms, 8: latency_ms + 20}},
                    "fps": 30, "max_batch_size": batch, "accept_unknown_clients": True, **entry}],
    })


def door_config(port, app_key, **kw):
    from lerobot_zenoh.openpi.front_door import FrontDoorConfig

    return FrontDoorConfig(port=0, endpoint=f"tcp/127.0.0.1:{port}", cluster_uuid=app_key.cluster,
                           experiment_tag=app_key.experiment, model_id=app_key.model, telemetry_period_s=0,
                           mapping=MAPPING, **kw)


def expected_chunk(seed: int, quality: int = 90) -> np.ndarray:
    """What the synthetic model answers to the driver's observation `seed` sent through the front door."""
    obs = observation(seed)
    images = {"front": obs["observation/image"], "wrist": obs["observation/wrist_image"].transpose(1, 2, 0).copy()}
    decoded = {n: codec.decode_jpeg(codec.encode_jpeg(i, quality)) for n, i in images.items()}
    return synthetic_actions(obs["observation/state"].astype(np.float32), decoded, CHUNK, ACTION_DIM)


@pytest.fixture
def fleet(port, app_key):
    from lerobot_zenoh.openpi.front_door import FrontDoor

    with PolicyServer(server_manifest(port, app_key)) as server:
        with FrontDoor(door_config(port, app_key)) as door:
            yield server, door


def test_openpi_client_gets_metadata_and_the_models_chunks_through_its_broker(client_python, fleet):
    server, door = fleet
    out = result(drive(client_python, door.port, mode="broker", horizon=4, steps=8, seed=5))
    meta = out["metadata"]
    assert meta["action_dim"] == ACTION_DIM and meta["action_horizon"] == CHUNK and meta["model_id"] == "m"
    expected = expected_chunk(5)
    steps = np.array([s["actions"] for s in out["steps"]])
    np.testing.assert_allclose(steps, np.concatenate([expected[:4], expected[:4]]), atol=1e-5)
    timing = out["steps"][0]["server_timing"]
    assert timing["infer_ms"] > 0 and timing["front_door_ms"] >= 0 and "prev_total_ms" in out["steps"][4]["server_timing"]
    assert door.counters.snapshot()["requests_answered"] == 2


def test_several_openpi_clients_are_batched_and_each_answer_equals_its_answer_alone(client_python, fleet):
    server, door = fleet
    seeds = [11, 12, 13, 14]
    procs = [drive(client_python, door.port, mode="chunks", repeat=6, seed=s) for s in seeds]
    outs = [result(p) for p in procs]
    model = server.models[0]
    assert max(model.session_table.batch_sizes) > 1, model.session_table.batch_sizes
    for seed, out in zip(seeds, outs):
        for chunk in out["chunks"]:
            np.testing.assert_allclose(np.array(chunk), expected_chunk(seed), atol=1e-5)
    alone = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=12))
    np.testing.assert_array_equal(np.array(alone["chunks"][0]), np.array(outs[1]["chunks"][0]))
    # Five connections came and went: none left an entity declared on the front door's session
    # (the door's own watch of the model's servers stays).
    assert wait_for(lambda: door.counters.snapshot().get("connections_closed") == 5)
    assert door._session._owned == [door._servers_watch], door._session._owned


@pytest.mark.slow
def test_a_real_act_checkpoint_batches_openpi_clients_and_answers_each_as_alone(client_python, port, app_key, tmp_path):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.openpi.front_door import FrontDoor

    joints = tuple(f"j{i}.pos" for i in range(6))
    path = build_checkpoint(tmp_path / "act", policy_type="act", state_names=joints, action_names=joints,
                            cameras=CAMS, chunk_size=CHUNK, fps=30,
                            overrides={"dim_model": 64, "n_heads": 2, "dim_feedforward": 128, "n_encoder_layers": 1,
                                       "n_decoder_layers": 1, "n_vae_encoder_layers": 1, "latent_dim": 8})
    manifest = {
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "pretrained_path": str(path), "max_batch_size": 8, "accept_unknown_clients": True}]}
    with PolicyServer(parse_manifest(manifest)) as server, FrontDoor(door_config(port, app_key)) as door:
        seeds = [31, 32, 33]
        together = [result(p) for p in [drive(client_python, door.port, mode="chunks", repeat=15, seed=s)
                                        for s in seeds]]
        assert max(server.models[0].session_table.batch_sizes) > 1, server.models[0].session_table.batch_sizes
        for seed, out in zip(seeds, together):
            alone = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=seed))["chunks"][0]
            assert np.isfinite(alone).all()
            for chunk in out["chunks"]:
                np.testing.assert_allclose(np.array(chunk), np.array(alone), atol=1e-5)


def test_bad_requests_get_a_clear_error_on_their_socket_and_disturb_no_one(client_python, fleet):
    server, door = fleet
    good = drive(client_python, door.port, mode="chunks", repeat=8, seed=21)
    bad = result(drive(client_python, door.port, mode="bad", seed=22, requests=[
        {"observation/extra": {"shape": [2], "dtype": "float32"}},
        {"observation/state": {"shape": [5], "dtype": "float32"}},
        {"observation/image": {"shape": [48, 64, 3], "dtype": "float32"}},
        {"observation/image": {"shape": [24, 32, 3], "dtype": "uint8"}},
        {"observation/image": None},
    ]))
    errors = bad["errors"]
    assert "unknown_key" in errors[0] and "'observation/extra'" in errors[0]
    assert "bad_state" in errors[1] and "(6,)" in errors[1]
    assert "bad_dtype" in errors[2] and "uint8" in errors[2]
    assert "wrong_image_shape" in errors[3] and "(48, 64, 3)" in errors[3]
    assert "missing_key" in errors[4]
    np.testing.assert_allclose(np.array(bad["after"]), expected_chunk(22), atol=1e-5)  # the same socket goes on
    object_array = msgpack.packb({"observation/state": ndarray_map("|O", (1,), b"\0" * 8)}).hex()
    raw = result(drive(client_python, door.port, mode="raw", seed=23, requests=["c1", object_array]))
    assert "bad_msgpack" in raw["errors"][0] and "bad_dtype" in raw["errors"][1] and "object" in raw["errors"][1]
    for chunk in result(good)["chunks"]:
        np.testing.assert_allclose(np.array(chunk), expected_chunk(21), atol=1e-5)
    rejected = door.counters.rejected
    for reason in ("unknown_key", "bad_state", "bad_dtype", "wrong_image_shape", "missing_key", "bad_msgpack"):
        assert rejected[reason] >= 1, rejected
    assert server.models[0].session_table.snapshot() is not None


def test_token_healthz_size_limit_and_loopback_default(client_python, port, app_key):
    from lerobot_zenoh.openpi.front_door import FrontDoor, FrontDoorConfig

    assert FrontDoorConfig().host == "127.0.0.1"
    token = "s3cret-token-of-the-fleet"
    with PolicyServer(server_manifest(port, app_key)), \
            FrontDoor(door_config(port, app_key, token=token, max_message_bytes=64 * 1024)) as door:
        def healthy() -> bool:  # 503 until the door has seen the server's liveliness token
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{door.port}/healthz", timeout=10) as r:
                    return r.status == 200 and r.read() == b"OK\n"
            except urllib.error.HTTPError as exc:
                assert exc.code == 503, exc
                return False

        assert wait_for(healthy, 20)
        refused = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=1))
        assert "401" in refused["connect_error"]
        wrong = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=1, api_key="not-the-token"))
        assert "401" in wrong["connect_error"]
        ok = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=1, api_key=token))
        np.testing.assert_allclose(np.array(ok["chunks"][0]), expected_chunk(1), atol=1e-5)
        big = result(drive(client_python, door.port, mode="bad", seed=2, api_key=token,
                           requests=[{"observation/extra": {"shape": [64, 1024], "dtype": "float32"}}]))
        assert "1009" in big["errors"][0] or "too big" in big["errors"][0], big
        assert wait_for(lambda: door.counters.rejected["too_large"] == 1)
        assert door.counters.rejected["unauthorized"] == 2


def test_a_peer_that_keeps_sending_bad_requests_is_cooled_down_alone_across_reconnects(client_python, port, app_key):
    from lerobot_zenoh.openpi.front_door import FrontDoor

    unknown = {"observation/extra": {"shape": [1], "dtype": "uint8"}}
    with PolicyServer(server_manifest(port, app_key)), \
            FrontDoor(door_config(port, app_key, max_rejections=2, cooldown_s=60)) as door:
        bad = result(drive(client_python, door.port, mode="bad", seed=1, after=False, source="127.0.0.2",
                           requests=[unknown, unknown, unknown, {}]))
        assert all("unknown_key" in e for e in bad["errors"][:3]), bad
        assert bad["errors"][3].endswith("requests are refused for 60 s") and "rate_limited" in bad["errors"][3]
        # Reconnecting from the same address does not start afresh: refused at the handshake (429).
        again = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=2, source="127.0.0.2"))
        assert "429" in again["connect_error"], again
        other = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=2, source="127.0.0.3"))
        np.testing.assert_allclose(np.array(other["chunks"][0]), expected_chunk(2), atol=1e-5)
        assert door.counters.rejected["rate_limited"] == 2 and door.counters.rejected["unknown_key"] == 3


def test_a_request_the_fleet_never_answers_is_refused_after_its_time_out(client_python, port, app_key):
    from lerobot_zenoh.openpi.front_door import FrontDoor

    server = PolicyServer(server_manifest(port, app_key)).start()
    try:
        door = FrontDoor(door_config(port, app_key, request_timeout_s=1.0, resend_after_s=0.3)).start()
    finally:
        server.stop()
    try:
        out = result(drive(client_python, door.port, mode="bad", seed=1, after=False, requests=[{}]))
        assert "unanswered: no chunk from the fleet in 1 s" in out["errors"][0], out
        assert door.counters.rejected["unanswered"] == 1
    finally:
        door.close()


def test_the_front_door_publishes_its_counters_as_telemetry(client_python, port, app_key):
    from lerobot_zenoh.openpi.front_door import FrontDoor
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    seen = []
    with PolicyServer(server_manifest(port, app_key)), \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session, \
            FrontDoor(door_config(port, app_key).replace(telemetry_period_s=0.2)) as door:
        session.subscribe(app_key.client("openpi-door").metrics,
                          lambda key, payload: seen.append(codec.decode_telemetry(payload)))
        bad = result(drive(client_python, door.port, mode="bad", seed=1, requests=[{"prompt": None, "x": {
            "shape": [1], "dtype": "uint8"}}]))
        assert "unknown_key" in bad["errors"][0]
        assert wait_for(lambda: any(t.metrics.get("requests_answered") == 1 and t.metrics.get("rejected.unknown_key") == 1
                                    for t in seen), 20), seen[-1:]


def test_the_front_door_speaks_wss_with_a_certificate(client_python, port, app_key, tmp_path):
    from lerobot_zenoh.openpi.front_door import FrontDoor
    from lerobot_zenoh.security.pki import create_ca, issue

    ca = create_ca()
    cert = issue(ca, "openpi-door", ["127.0.0.1"], role="server")
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "door.pem").write_bytes(cert.cert_pem)
    (tmp_path / "door.key").write_bytes(cert.key_pem)
    with PolicyServer(server_manifest(port, app_key)), \
            FrontDoor(door_config(port, app_key, tls_certificate=str(tmp_path / "door.pem"),
                                  tls_private_key=str(tmp_path / "door.key"))) as door:
        ok = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=4, tls=True,
                          env={"SSL_CERT_FILE": str(tmp_path / "ca.pem")}))
        np.testing.assert_allclose(np.array(ok["chunks"][0]), expected_chunk(4), atol=1e-5)
        untrusted = result(drive(client_python, door.port, mode="chunks", repeat=1, seed=4, tls=True))
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted["connect_error"], untrusted


def test_cli_refuses_a_mapping_naming_a_camera_the_model_lacks_in_one_line(port, app_key):
    pytest.importorskip("websockets", reason="the front door needs `websockets` (pip install 'lerobot-zenoh[openpi]')")
    with PolicyServer(server_manifest(port, app_key)):
        proc = subprocess.run(
            [sys.executable, "-m", "lerobot_zenoh.cli.openpi", "--port", "0", "--endpoint", f"tcp/127.0.0.1:{port}",
             "--cluster_uuid", app_key.cluster, "--experiment_tag", app_key.experiment, "--model_id", app_key.model,
             "--image", "observation/image=front", "--image", "observation/wrist_image=hand",
             "--state", "observation/state"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "mapping.images.observation/wrist_image" in last and "'hand'" in last, proc.stderr


def test_closing_the_front_door_ends_its_connections(client_python, port, app_key):
    from lerobot_zenoh.openpi.front_door import FrontDoor

    with PolicyServer(server_manifest(port, app_key)):
        door = FrontDoor(door_config(port, app_key)).start()
        proc = drive(client_python, door.port, mode="chunks", repeat=1000, seed=3)
        assert wait_for(lambda: door.counters.snapshot().get("requests_answered", 0) >= 2, 60)
        closer = threading.Thread(target=door.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "1001" in err, err[-1000:]  # the client sees it closed: going away
        assert door.counters.snapshot()["connections_closed"] == 1
