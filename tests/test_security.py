"""Security (docs/security.md): mutual TLS, the access control generated from the manifest, resource limits.

Real certificates are generated here with `security.pki`, and every Zenoh session is real, on
127.0.0.1. The secured server enforces the ACL in its own session (peer-to-peer deployment);
clients and monitors connect to it in `client` mode, as `lerobot-zenoh-secure` configures them.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from lerobot_zenoh.errors import CompatibilityError, ConfigError, TlsRefusedError, TransportError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.security import pki
from lerobot_zenoh.security.acl import AppGrant, Deployment, access_control, write_acl
from lerobot_zenoh.security.identities import (
    RX_MAX_MESSAGE_BYTES, PkiLayout, connect_endpoint, member_settings, server_settings,
)
from lerobot_zenoh.server.config.manifest import load_manifest, parse_manifest
from lerobot_zenoh.server.session_table.rate_limit import RejectionRateLimit
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings, loopback_settings
from lz_testing import CAMS, free_port, wait_for

pytestmark = pytest.mark.timeout(60)


# -- fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> PkiLayout:
    """A development CA with a server, two robots and a monitor; `other/` holds a foreign CA's robA."""
    root = tmp_path_factory.mktemp("pki")
    ca = pki.create_ca()
    pki.save_ca(ca, root)
    for name, role in (("gpu0", "server"), ("robA", "client"), ("robB", "client"), ("mon", "monitor")):
        pki.write_identity(ca, name, root, role=role)
    other = pki.create_ca("some other CA")
    pki.save_ca(other, root / "other")
    pki.write_identity(other, "robA", root / "other")
    return PkiLayout(root)


def observation(seq_id: int, client_uuid: str, rng, cameras=CAMS) -> bytes:
    state = rng.normal(size=6).astype(np.float32)
    jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8), 90) for n, hw in cameras.items()}
    return codec.encode(Observation(seq_id, client_uuid, state, jpegs, "task"))


class Robot:
    """The wire side of a client (or of an attacker holding that client's certificate)."""

    def __init__(self, session: ZenohSession, app_key, client_id: str):
        self.session, self.app_key, self.client_id = session, app_key, client_id
        self.chunks: list = []
        self.pubs: dict = {}
        session.subscribe(app_key.client(client_id).action,
                          lambda k, b: self.chunks.append(codec.decode_action_chunk(b)))

    def put(self, seq_id: int, rng, on_key_of: str | None = None, client_uuid: str | None = None) -> None:
        target = on_key_of or self.client_id
        if target not in self.pubs:
            self.pubs[target] = self.session.publisher(self.app_key.client(target).obs, OBSERVATION_QOS)
        self.pubs[target].put(observation(seq_id, client_uuid or target, rng))

    def served(self, seq_id: int) -> bool:
        return any(c.response_to_seq_id == seq_id for c in self.chunks)

    def send_until_served(self, seq_id: int, rng, timeout_s: float = 8.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.put(seq_id, rng)
            if wait_for(lambda: self.served(seq_id), 0.3):
                return
        raise AssertionError(f"{self.client_id}: no chunk for seq {seq_id}")


def secured_manifest(port, app_key, layout: PkiLayout, acl_path, **entry) -> dict:
    settings = server_settings(layout, "gpu0", [f"tls/127.0.0.1:{port}"])
    settings = dataclasses.replace(settings, access_control_file=str(acl_path))
    model = {
        "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
        "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": CAMS, "latency_ms": 2},
        "fps": 30, "clients": [{"client_uuid": "robA"}, {"client_uuid": "robB"}],
    }
    model.update(entry)
    return {"cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
            "zenoh": dataclasses.asdict(settings), "server": [model], "telemetry_period_s": 0.2}


@pytest.fixture
def secured(port, app_key, layout, tmp_path):
    """A PolicyServer over mutual TLS enforcing the ACL generated from its own manifest."""
    manifest = parse_manifest(secured_manifest(port, app_key, layout, tmp_path / "acl.json5"))
    write_acl(access_control(Deployment.from_manifests([manifest], monitors=["mon"])), tmp_path / "acl.json5")
    server = PolicyServer(manifest).start()
    sessions: list[ZenohSession] = []

    def connect(name: str, **changes) -> ZenohSession:
        settings = dataclasses.replace(member_settings(layout, name, [f"tls/127.0.0.1:{port}"]), **changes)
        session = ZenohSession(settings)
        sessions.append(session)
        return session.open()

    def spy(client_id: str) -> list[int]:
        """seq_ids of the observations on `client_id`'s key that reach the server's node."""
        seen: list[int] = []
        server._session.subscribe(app_key.client(client_id).obs,
                                  lambda k, b: seen.append(codec.decode_observation(b).seq_id))
        return seen

    yield server, connect, spy
    for session in sessions:
        session.close()
    server.stop()


def wait_status(session, app_key, timeout_s: float = 8.0) -> None:
    assert wait_for(lambda: session.query(app_key.status, 0.3), timeout_s), "status never answered"


# -- certificates, ACL and settings, without a network --------------------------------------------


def test_issued_certificates_name_the_identity_and_keys_are_private(layout):
    pem = layout.cert("robA").read_bytes()
    assert pki.common_name(pem) == "robA"
    from cryptography import x509

    server_pem = layout.cert("gpu0").read_bytes()
    assert pki.host_names(server_pem)[:2] == ["localhost", "127.0.0.1"] and pki.can_serve_tls(server_pem)
    for client_only in ("robA", "mon"):  # robots and monitors: clientAuth only, no host name
        assert pki.host_names(layout.cert(client_only).read_bytes()) == []
        assert not pki.can_serve_tls(layout.cert(client_only).read_bytes())
    cert = x509.load_pem_x509_certificate(pem)
    assert cert.issuer == x509.load_pem_x509_certificate(layout.ca_cert.read_bytes()).subject
    for key in (layout.key("robA"), layout.ca_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    ca = pki.load_ca(layout.ca_cert, layout.ca_key)  # a CA brought back from files signs again
    assert pki.common_name(pki.issue(ca, "robC").cert_pem) == "robC"
    with pytest.raises(ConfigError, match="ca_key"):
        pki.load_ca(layout.ca_cert, layout.root / "other" / "ca.key")
    with pytest.raises(ConfigError, match="not a CA"):
        pki.load_ca(layout.cert("robA"), layout.key("robA"))
    with pytest.raises(ConfigError, match="common_name"):
        pki.issue(ca, "a/b")
    with pytest.raises(ConfigError, match="hosts"):
        pki.issue(ca, "robC", ["robot-host"], role="client")
    with pytest.raises(ConfigError, match="role"):
        pki.issue(ca, "robC", role="admin")


def test_acl_grants_each_identity_only_its_own_keys(app_key):
    grant = AppGrant(app_key, ("robA", "robB"), ("gpu0",))
    acl = access_control(Deployment((grant,), ("mon",)))
    assert acl["enabled"] and acl["default_permission"] == "deny"
    rules = {r["id"]: r for r in acl["rules"]}
    policy = {p["subjects"][0]: p["rules"] for p in acl["policies"]}
    subjects = {s["id"]: s["cert_common_names"] for s in acl["subjects"]}
    assert subjects == {"cn/gpu0": ["gpu0"], "cn/robA": ["robA"], "cn/robB": ["robB"], "cn/mon": ["mon"]}

    def grants(name, flow, message):
        return {k for rid in policy[f"cn/{name}"] for k in rules[rid]["key_exprs"]
                if flow in rules[rid]["flows"] and message in rules[rid]["messages"]}

    a = app_key.client("robA")
    assert grants("robA", "ingress", "put") == {a.obs, a.metrics}
    assert grants("robA", "ingress", "declare_subscriber") == {a.action}
    assert grants("robA", "ingress", "query") == {app_key.status}
    assert grants("robA", "ingress", "liveliness_token") == {a.metrics}
    assert grants("robA", "egress", "put") == {a.action}
    assert grants("robA", "ingress", "declare_queryable") == set()
    assert grants("gpu0", "ingress", "put") == {f"{app_key.prefix}/*/action", app_key.server_metrics("gpu0"),
                                                app_key.server_heartbeat("gpu0")}
    # servers of one app hear each other's heartbeats of served work (a hot standby's watch); a robot does not
    assert grants("gpu0", "ingress", "declare_subscriber") >= {app_key.all_server_heartbeats}
    assert grants("gpu0", "egress", "put") >= {app_key.all_server_heartbeats}
    assert app_key.all_server_heartbeats not in grants("robA", "egress", "put")
    assert grants("gpu0", "ingress", "liveliness_token") == {app_key.server_token("gpu0")}
    assert grants("mon", "ingress", "declare_subscriber") == {"**/metrics"}
    assert grants("mon", "ingress", "put") == set()
    assert all(r["permission"] == "allow" for r in acl["rules"])
    with pytest.raises(ConfigError, match="one role"):
        Deployment((AppGrant(app_key, ("gpu0",), ("gpu0",)),))


def test_tls_settings_map_to_zenoh_and_fail_naming_the_field(layout, tmp_path):
    settings = member_settings(layout, "robA", ["tls/127.0.0.1:7447"])
    config = settings.to_zenoh_config()
    assert config.get_json("transport/link/tls/root_ca_certificate") == f'"{layout.ca_cert}"'
    assert config.get_json("transport/link/tls/connect_certificate") == f'"{layout.cert("robA")}"'
    assert config.get_json("transport/link/tls/listen_private_key") == f'"{layout.key("robA")}"'
    assert config.get_json("transport/link/tls/enable_mtls") == "true"
    assert config.get_json("transport/link/protocols") == '["tls"]'
    assert config.get_json("listen/endpoints") == "[]"  # never the tcp/[::]:0 default of a peer
    assert RX_MAX_MESSAGE_BYTES > codec.DEFAULT_LIMITS.max_message_bytes
    assert connect_endpoint("tcp/0.0.0.0:7447", "10.0.0.2") == "tls/10.0.0.2:7447"
    cases = [
        (dict(connect=["tcp/127.0.0.1:7447"]), "zenoh.connect"),
        (dict(tls_private_key=None), "zenoh.tls_private_key"),
        (dict(tls_certificate=None, tls_private_key=None), "zenoh.tls_certificate"),
        (dict(tls_root_ca=None), "zenoh.tls_root_ca"),
        (dict(tls_root_ca=str(tmp_path / "missing.pem")), "zenoh.tls_root_ca"),
        (dict(access_control_file=str(tmp_path / "missing.json5")), "zenoh.access_control_file"),
    ]
    for change, field in cases:
        with pytest.raises(ConfigError) as info:
            dataclasses.replace(settings, **change).to_zenoh_config()
        assert info.value.field == field, change
    bad = tmp_path / "bad.json5"
    bad.write_text("{enabled: true, rules: [")
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(settings, access_control_file=str(bad)).to_zenoh_config()
    assert info.value.field == "zenoh.access_control_file"
    assert ZenohSettings().tls_enabled is False  # plain TCP stays the default


def test_rejection_rate_limit_cools_down_one_client_only():
    limit = RejectionRateLimit(max_rejections=3, window_s=1.0, cooldown_s=5.0)
    assert not any(limit.on_rejection("bad", t) for t in (0.0, 0.1, 0.2))
    assert not limit.blocked("bad", 0.3)
    assert limit.on_rejection("bad", 0.3)  # the 4th within 1 s
    assert limit.blocked("bad", 0.4) and limit.blocked("bad", 5.2) and not limit.blocked("bad", 5.31)
    assert not limit.blocked("good", 0.4)
    assert not any(limit.on_rejection("slow", t) for t in (0.0, 1.0, 2.0, 3.0, 4.0))  # spread out: never


# -- mutual TLS and the ACL on real sessions -------------------------------------------------------


def test_authorised_clients_are_served_over_mutual_tls(secured, app_key):
    server, connect, _ = secured
    a = Robot(connect("robA"), app_key, "robA")
    wait_status(a.session, app_key)
    rng = np.random.default_rng(0)
    for seq in (1, 2, 3):
        a.send_until_served(seq, rng)
    assert a.session.alive(app_key.all_servers) == [app_key.server_token("gpu0")]
    stats = server.stats()[app_key.prefix]["clients"]["robA"]
    assert stats["served"] >= 3 and not stats["rejected"]


@pytest.mark.parametrize("mode", ["client", "peer"])
def test_a_robot_certificate_cannot_pose_as_the_server(layout, app_key, port, tmp_path, mode):
    """robA's certificate listens on the server's address (the server is down), answers status and
    sends robB forged chunks: robB refuses the listener (0 chunks); the real server is then accepted."""
    from lerobot_zenoh.protocol.messages import ActionChunk

    rogue_settings = dataclasses.replace(server_settings(layout, "gpu0", [f"tls/127.0.0.1:{port}"]),
                                         tls_certificate=str(layout.cert("robA")),
                                         tls_private_key=str(layout.key("robA")),
                                         access_control_file=None, json5_overrides={})
    forged: list[int] = []
    with ZenohSession(rogue_settings) as rogue:
        chunk_pub = rogue.publisher(app_key.client("robB").action, OBSERVATION_QOS)
        status = codec.encode(_status(app_key))
        rogue.serve(app_key.status, lambda: status)

        def answer(key, payload):
            obs = codec.decode_observation(payload)
            forged.append(obs.seq_id)
            chunk_pub.put(codec.encode(ActionChunk(obs.seq_id, 1.0, np.full((10, 6), 5.0, np.float32), "gpu0")))

        rogue.subscribe(app_key.client("robB").obs, answer)
        b_settings = dataclasses.replace(member_settings(layout, "robB", [f"tls/127.0.0.1:{port}"]), mode=mode,
                                         connect_timeout_s=2.0)
        if mode == "client":  # the handshake fails, so the connect-only session never opens, and says why
            with pytest.raises(TlsRefusedError, match="its TLS certificate is refused"):
                ZenohSession(b_settings).open()
        else:
            with ZenohSession(b_settings) as b_session:
                b = Robot(b_session, app_key, "robB")
                rng = np.random.default_rng(9)
                deadline = time.monotonic() + 2.0
                seq = 0
                while time.monotonic() < deadline:
                    seq += 1
                    b.put(seq, rng)
                    assert b_session.query(app_key.status, 0.1) == []
                assert b.chunks == [] and forged == []
                assert not b_session.raw.info.peers_zid()
    # the real server on the same address: robB is served
    manifest = parse_manifest(secured_manifest(port, app_key, layout, tmp_path / "acl.json5"))
    write_acl(access_control(Deployment.from_manifests([manifest], monitors=["mon"])), tmp_path / "acl.json5")
    with PolicyServer(manifest), ZenohSession(member_settings(layout, "robB", [f"tls/127.0.0.1:{port}"])) as bs:
        b = Robot(bs, app_key, "robB")
        wait_status(bs, app_key)
        b.send_until_served(1, np.random.default_rng(10))
        assert all(not np.any(c.actions == 5.0) for c in b.chunks)


@pytest.mark.parametrize("mode", ["client", "peer"])
def test_a_robot_whose_server_certificate_is_refused_says_so(layout, app_key, port, mode):
    """A listener with a certificate the robot refuses (robA's: a client certificate, no host name)
    on the server's address: the robot's start-up names the certificate, not a dead address, in
    client mode (the session does not open) and in peer mode (the link never comes); with nothing
    listening it says that nothing answers."""
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.client.client import RobotClient
    from lerobot_zenoh.client.config import RobotClientConfig
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig

    def robot_client(endpoint):
        settings = dataclasses.replace(member_settings(layout, "robB", [endpoint]), connect=[], mode=mode)
        cfg = RobotClientConfig(robot=SimRobotConfig(cameras=dict(CAMS), fps=30), client_uuid="robB",
                                cluster_uuid=app_key.cluster, experiment_tag=app_key.experiment,
                                model_id=app_key.model, model_version=app_key.version,
                                application_tag=app_key.app, endpoint=endpoint, zenoh=settings, fps=30,
                                discovery_timeout_s=2.0)
        return RobotClient(cfg, make_robot_from_config(cfg.robot))

    rogue_settings = dataclasses.replace(server_settings(layout, "gpu0", [f"tls/127.0.0.1:{port}"]),
                                         tls_certificate=str(layout.cert("robA")),
                                         tls_private_key=str(layout.key("robA")), access_control_file=None)
    with ZenohSession(rogue_settings):
        client = robot_client(f"tls/127.0.0.1:{port}")
        with pytest.raises(CompatibilityError) as refused:
            client.start()
        client.close()
    message = str(refused.value)
    print(message)
    assert "certificate is refused" in message and "nothing answers" not in message
    client = robot_client(f"tls/127.0.0.1:{free_port()}")
    with pytest.raises(CompatibilityError, match="nothing answers there"):
        client.start()
    client.close()


def test_a_plain_session_refuses_a_too_large_message_cheaply(port):
    """Every session, plain included, reassembles at most `max_message_bytes` (16 MiB + 64 KiB): a
    50 MB reliable put is dropped as it arrives, costing the receiver about the limit, not 50 MB;
    a 1 MiB put after it arrives."""
    from lerobot_zenoh.transport.settings import MAX_MESSAGE_BYTES

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    settings = loopback_settings(port)
    assert settings.max_message_bytes == MAX_MESSAGE_BYTES and settings.tls_enabled is False
    # a plain server manifest's session gets it too (not only a secured one's)
    plain = parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "server_id": "gpu0",
                            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"]},
                            "server": [{"model_id": "m", "model_version": "v", "application_tag": "a",
                                        "synthetic": {"state_dim": 6, "action_dim": 6},
                                        "clients": [{"client_uuid": "r1"}]}]})
    assert plain.zenoh_settings().to_zenoh_config().get_json("transport/link/rx/max_message_size") == str(
        MAX_MESSAGE_BYTES)
    assert settings.to_zenoh_config().get_json("transport/link/rx/max_message_size") == str(MAX_MESSAGE_BYTES)
    got: list[int] = []
    with ZenohSession(settings) as receiver:
        receiver.subscribe("big/**", lambda key, payload: got.append(len(payload)))
        before = rss_mb()
        sender = (  # another process, so that its own 50 MB does not count here
            "import sys, time, zenoh; sys.path.insert(0, '.')\n"
            "from lerobot_zenoh.transport.session import ZenohSession\n"
            "from lerobot_zenoh.transport.settings import loopback_settings\n"
            f"s = ZenohSession(loopback_settings(None, listen=False, connect_ports=({port},))).open()\n"
            "time.sleep(0.5)\n"
            "s.raw.put('big/50mb', b'x' * (50 * 2**20), congestion_control=zenoh.CongestionControl.BLOCK)\n"
            "s.raw.put('big/1mb', b'y' * 2**20, congestion_control=zenoh.CongestionControl.BLOCK)\n"
            "time.sleep(1.5)\n")
        subprocess.run([sys.executable, "-c", sender], check=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
        assert wait_for(lambda: got == [2**20], 5), got
        grown = rss_mb() - before
    print(f"a 50 MB put to a plain session: dropped; the receiver grew {grown:.1f} MB")
    assert grown < 35


def _status(app_key):
    from lerobot_zenoh.protocol.messages import Status

    return Status(app_key.model, app_key.version, dict(CAMS), 6, 10, {}, "act", 30, "gpu0", 6)


def test_a_robot_cannot_forge_another_robots_observations_or_read_its_actions(secured, app_key):
    server, connect, spy = secured
    seen_on_b = spy("robB")
    a_session = connect("robA")
    a = Robot(a_session, app_key, "robA")
    b = Robot(connect("robB"), app_key, "robB")
    stolen: list = []  # what robA's certificate can read of robB's chunks, by any subscription
    for selector in (app_key.client("robB").action, f"{app_key.prefix}/*/action", "**"):
        a_session.subscribe(selector, lambda k, _, sel=selector: stolen.append((sel, k)) if k.endswith("robB/action") else None)
    wait_status(b.session, app_key)
    rng = np.random.default_rng(1)
    a.send_until_served(1, rng)  # robA's own traffic goes through
    b_sent = set()
    for seq in range(1, 6):
        # Interleave: a perfectly valid observation for robB, published with robA's certificate.
        a.put(900_000 + seq, rng, on_key_of="robB", client_uuid="robB")
        b.send_until_served(seq, rng)
        b_sent.add(seq)
    # robA's next observation, served, comes after its forged ones on the same link: had those been
    # let through, they would have reached the server first.
    a.send_until_served(2, rng)
    assert wait_for(lambda: server.stats()[app_key.prefix]["clients"]["robB"]["received"] == len(seen_on_b), 5.0)
    stats = server.stats()[app_key.prefix]["clients"]
    assert all(c.response_to_seq_id in b_sent for c in b.chunks)  # robB's actions are its own
    assert set(seen_on_b) <= b_sent and b_sent <= set(seen_on_b)  # the forged ones never reached the server
    assert not stats["robB"]["rejected"]
    assert stolen == []  # robB's chunks (the local echoes of robA's own forged puts excluded) never reach robA


@pytest.mark.parametrize("mode", ["client", "peer"])
@pytest.mark.parametrize("who", ["no certificate", "another CA", "plain tcp"])
def test_a_peer_without_a_valid_certificate_cannot_connect(secured, app_key, layout, port, mode, who):
    server, connect, spy = secured
    seen = spy("robA")
    other = layout.root / "other"
    changes = {
        "no certificate": dict(tls_certificate=None, tls_private_key=None, tls_mtls=False),
        "another CA": dict(tls_root_ca=str(other / "ca.pem"), tls_certificate=str(other / "robA.pem"),
                           tls_private_key=str(other / "robA.key")),
        "plain tcp": dict(tls_root_ca=None, tls_certificate=None, tls_private_key=None,
                          connect=[f"tcp/127.0.0.1:{port}"], json5_overrides={"listen/endpoints": "[]"}),
    }[who]
    if mode == "client":  # a client must reach its router/peer at open: the TLS handshake fails, so does open
        expected = (TransportError, "could not open") if who == "plain tcp" else (
            TlsRefusedError, {"no certificate": "the listener may refuse this node's certificate",
                              "another CA": "its TLS certificate is refused"}[who])
        with pytest.raises(expected[0], match=expected[1]):  # (after 2 s, not the 30 s default), saying why
            connect("robA", mode="client", connect_timeout_s=2.0, **changes)
        return
    # A peer opens without any connection; it then never gets through to the server.
    session = connect("robA", mode="peer", **changes)
    rng = np.random.default_rng(2)
    pub = session.publisher(app_key.client("robA").obs, OBSERVATION_QOS)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        pub.put(observation(1, "robA", rng))
        assert session.query(app_key.status, 0.2) == []
    assert seen == [] and session.alive(app_key.all_servers, 0.2) == []
    assert not session.raw.info.peers_zid() and not session.raw.info.routers_zid()
    assert "robA" not in server.stats()[app_key.prefix]["clients"]


def test_the_monitor_reads_metrics_but_cannot_publish_observations(secured, app_key):
    server, connect, spy = secured
    seen = spy("robA")
    a = Robot(connect("robA"), app_key, "robA")
    monitor = connect("mon")
    metrics: list[tuple[str, str]] = []
    monitor.subscribe("**/metrics", lambda k, b: metrics.append((k, codec.decode_telemetry(b).source)))
    a_metrics = a.session.publisher(app_key.client("robA").metrics, OBSERVATION_QOS)
    wait_status(a.session, app_key)
    assert wait_for(lambda: (app_key.server_metrics("gpu0"), "server") in metrics, 5.0)
    from lerobot_zenoh.protocol.messages import Telemetry

    robot_figures = codec.encode(Telemetry("client", "robA", 1, 0.1, 1.0, {"steps": 1}, {}, {}))
    assert wait_for(lambda: (a_metrics.put(robot_figures), (app_key.client("robA").metrics, "client") in metrics)[1], 5.0)
    assert app_key.server_token("gpu0") in monitor.alive("**")  # liveliness: who is up
    forged = monitor.publisher(app_key.client("robA").obs, OBSERVATION_QOS)
    rng = np.random.default_rng(3)
    for seq in range(20):
        forged.put(observation(seq, "robA", rng))
        time.sleep(0.02)  # paced: a burst of best-effort puts could be dropped before the ACL sees them
    assert monitor.query(app_key.status, 0.5) == []  # status is for the app's clients only
    # A liveliness round trip to the server's node, behind the forged puts on the same link.
    assert app_key.server_token("gpu0") in monitor.alive("**")
    assert seen == [] and "robA" not in server.stats()[app_key.prefix]["clients"]


# -- resource limits against a hostile peer --------------------------------------------------------


def plain_manifest(port, app_key, **entry) -> dict:
    model = {
        "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
        "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 20, "cameras": CAMS, "latency_ms": 2},
        "fps": 30, "clients": [{"client_uuid": c} for c in ("good", "flood")],
    }
    model.update(entry)
    return {"cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "server": [model],
            "telemetry_period_s": 0}


def test_a_flood_of_bad_observations_is_rate_limited_without_starving_others(port, app_key):
    with PolicyServer(parse_manifest(plain_manifest(port, app_key))) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        model = server.models[0]
        model.session_table.rate_limit = RejectionRateLimit(max_rejections=5, window_s=2.0, cooldown_s=30.0)
        good = Robot(session, app_key, "good")
        wait_status(session, app_key)
        flood_pub = session.publisher(app_key.client("flood").obs, OBSERVATION_QOS)
        stop = threading.Event()

        def flood():
            while not stop.is_set():
                flood_pub.put(b"\xc1 not msgpack")
                time.sleep(0.0005)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        try:
            rng = np.random.default_rng(4)
            for seq in range(1, 9):
                good.send_until_served(seq, rng)
            assert wait_for(lambda: server.stats()[app_key.prefix]["clients"]["flood"]["dropped"].get("rate_limited", 0) > 50, 5.0)
        finally:
            stop.set()
            flooder.join(2.0)
        stats = server.stats()[app_key.prefix]["clients"]
        flood_rejected = dict(stats["flood"]["rejected"])  # drops during a cool-down are not rejections
        rate_limited = stats["flood"]["dropped"]["rate_limited"]
        # Decoded (and rejected) max_rejections + 1 times, plus at most the one slot taken before the cool-down.
        assert sum(flood_rejected.values()) <= 7
        assert rate_limited > 50 and stats["flood"]["served"] == 0
        assert stats["good"]["served"] >= 8 and not stats["good"]["rejected"]
        figures, per_client = server.telemetry_figures(model)
        assert per_client["flood"]["observations_rate_limited"] == rate_limited
        assert "rejected.rate_limited" not in per_client["flood"]


def test_an_oversize_observation_is_rejected_before_it_takes_a_slot(port, app_key):
    limits = dataclasses.replace(codec.DEFAULT_LIMITS, max_message_bytes=64 * 1024)
    server = PolicyServer(parse_manifest(plain_manifest(port, app_key)), codec_limits=limits)
    with server, ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        model = server.models[0]
        key = app_key.client("flood").obs
        server.ingest.on_observation(model, key, b"\x00" * (64 * 1024 + 1))  # the callback, as Zenoh calls it
        assert model.session_table.sessions["flood"].slot is None
        assert server.stats()[app_key.prefix]["clients"]["flood"]["rejected"] == {"too_large": 1}
        session.publisher(key, OBSERVATION_QOS).put(b"\x00" * 200_000)  # and over the network
        assert wait_for(lambda: server.stats()[app_key.prefix]["clients"]["flood"]["rejected"]["too_large"] == 2, 5.0)
        good = Robot(session, app_key, "good")
        good.send_until_served(1, np.random.default_rng(5))  # a normal observation still fits


def test_distinct_unknown_client_ids_are_bounded_and_counted(port, app_key):
    manifest = plain_manifest(port, app_key, clients=[], accept_unknown_clients=True, max_unknown_clients=2)
    with PolicyServer(parse_manifest(manifest)) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        wait_status(session, app_key)
        rng = np.random.default_rng(6)
        first, second = Robot(session, app_key, "r1"), Robot(session, app_key, "r2")
        first.send_until_served(1, rng)
        second.send_until_served(1, rng)
        invented = [Robot(session, app_key, f"x{i}") for i in range(5)]
        model = server.models[0]

        def refused() -> bool:  # observations are best effort: on a starved link some never arrive
            for robot in invented:
                robot.put(0, rng)
            return wait_for(lambda: server.stats()[app_key.prefix]["dropped"].get("too_many_clients", 0) >= 5, 0.3)

        assert wait_for(refused, 10.0)
        # The admitted ones are still served; this chunk also comes after every invented robot's
        # observation on the one link, so none of theirs is still on its way.
        first.send_until_served(2, rng)
        stats = server.stats()[app_key.prefix]
        assert set(stats["clients"]) == {"r1", "r2"}  # nothing else is tracked
        assert not any(r.chunks for r in invented)
        figures, _ = server.telemetry_figures(model)
        assert figures["rejected.too_many_clients"] == stats["dropped"]["too_many_clients"]


# -- the command: manifest in, deployment out ------------------------------------------------------


def write_plain_manifest(path, port, app_key, clients=("robot_1", "robot_2")) -> None:
    manifest = plain_manifest(port, app_key, clients=[{"client_uuid": c} for c in clients])
    manifest["telemetry_period_s"] = 0.2
    path.write_text(yaml.safe_dump(manifest))


def test_secure_init_writes_a_deployment_that_serves_a_real_client_over_mtls(port, app_key, tmp_path, capsys):
    from lerobot.robots import make_robot_from_config

    from lerobot_zenoh.cli import client as client_cli
    from lerobot_zenoh.cli import monitor as monitor_cli
    from lerobot_zenoh.cli import secure
    from lerobot_zenoh.client.client import RobotClient

    write_plain_manifest(tmp_path / "m.yaml", port, app_key)
    out = tmp_path / "pki"
    assert secure.main(["init", "--manifest", str(tmp_path / "m.yaml"), "--out", str(out), "--monitor", "ops"]) == 0
    names = {p.name for p in out.iterdir()}
    for ident in ("gpu0", "robot_1", "robot_2", "ops"):
        assert {f"{ident}.pem", f"{ident}.key"} <= names
    assert {"ca.pem", "ca.key", "acl.json5", "gpu0.manifest.yaml", "robot_1.flags", "ops.flags", "README.md"} <= names
    assert secure.main(["init", "--manifest", str(tmp_path / "m.yaml"), "--out", str(out)]) == 2  # keeps its CA

    manifest = load_manifest(out / "gpu0.manifest.yaml")
    assert manifest.zenoh_settings().listen == [f"tls/127.0.0.1:{port}"]
    flags = (out / "robot_1.flags").read_text().split()
    cfg = client_cli.parse_config([
        "--robot.type=zenoh_sim", f"--robot.cameras={CAMS}".replace("(", "[").replace(")", "]"),
        "--client_uuid=robot_1", f"--cluster_uuid={app_key.cluster}", f"--experiment_tag={app_key.experiment}",
        f"--model_id={app_key.model}", f"--model_version={app_key.version}", f"--application_tag={app_key.app}",
        "--telemetry_period_s=0.2", "--discovery_timeout_s=8", *flags])
    assert cfg.zenoh_settings().connect == [f"tls/127.0.0.1:{port}"] and cfg.zenoh.tls_mtls
    with PolicyServer(manifest):
        client = RobotClient(cfg, make_robot_from_config(cfg.robot))
        client.start()
        try:
            counters = client.run(duration_s=1.5)
        finally:
            client.close()
        capsys.readouterr()
        monitor_flags = (out / "ops.flags").read_text().split()
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:  # the monitor installs its own SIGINT/SIGTERM handlers
            assert monitor_cli.main([*monitor_flags, "--json=true", "--duration_s=1.0", "--refresh_s=0.2"]) == 0
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert counters.chunks_received >= 3 and counters.chunks_rejected == 0
    assert any(line["source"] == "server" and line["source_id"] == "gpu0" for line in lines)

    assert secure.main(["acl", "--manifest", str(tmp_path / "m.yaml"), "--monitor", "ops", "--certs", str(out),
                        "--out", str(tmp_path / "again.json5")]) == 0
    assert secure.main(["acl", "--manifest", str(tmp_path / "m.yaml"), "--monitor", "nobody", "--certs", str(out),
                        "--out", str(tmp_path / "never.json5")]) == 2
    assert not (tmp_path / "never.json5").exists()


def test_secure_init_with_a_router_enforces_the_acl_there(app_key, tmp_path):
    from lerobot_zenoh.cli import secure
    router_port, server_port = free_port(), free_port()
    write_plain_manifest(tmp_path / "m.yaml", server_port, app_key, clients=("robA", "robB"))
    out = tmp_path / "pki"
    assert secure.main(["init", "--manifest", str(tmp_path / "m.yaml"), "--out", str(out), "--router", "zr",
                        "--router_endpoint", f"tls/127.0.0.1:{router_port}"]) == 0
    layout = PkiLayout(out)
    manifest = load_manifest(out / "gpu0.manifest.yaml")
    assert manifest.zenoh_settings().mode == "client" and manifest.zenoh_settings().access_control_file is None
    # The generated router file, served by the project's router command (zenohd -c would load it too).
    router = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.router", "--config", str(out / "zr.zenoh.json5")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: _port_open(router_port) or router.poll() is not None, 30) and router.poll() is None, \
            router.stderr.read() if router.poll() is not None else ""
        with PolicyServer(manifest) as server:
            seen: list[int] = []
            server._session.subscribe(app_key.client("robB").obs, lambda k, b: seen.append(codec.decode_observation(b).seq_id))
            connect = [f"tls/127.0.0.1:{router_port}"]
            with ZenohSession(member_settings(layout, "robA", connect)) as sa, \
                    ZenohSession(member_settings(layout, "robB", connect)) as sb:
                a, b = Robot(sa, app_key, "robA"), Robot(sb, app_key, "robB")
                wait_status(sa, app_key)
                rng = np.random.default_rng(7)
                a.send_until_served(1, rng)
                for seq in (1, 2, 3):
                    a.put(900 + seq, rng, on_key_of="robB", client_uuid="robB")
                    b.send_until_served(seq, rng)
                a.send_until_served(2, rng)  # after robA's forged puts on the same link
                assert set(seen) == {1, 2, 3}
                assert all(c.response_to_seq_id in {1, 2, 3} for c in b.chunks)
    finally:
        router.terminate()
        router.wait(10)


def test_secure_init_with_two_meshed_routers_serves_through_either(app_key, tmp_path):
    """`init --router za=… --router zb=…`: both routers enforce the ACL and connect to each other, the
    server and the robots are given both (the robots' lists start at different routers). robA on
    za and robB on zb are both served by the server (on za) across the mesh; after kill -9 of za,
    both are served through zb."""
    from lerobot_zenoh.cli import client as client_cli
    from lerobot_zenoh.cli import secure

    ports = {"za": free_port(), "zb": free_port()}
    write_plain_manifest(tmp_path / "m.yaml", free_port(), app_key, clients=("robA", "robB"))
    out = tmp_path / "pki"
    assert secure.main(["init", "--manifest", str(tmp_path / "m.yaml"), "--out", str(out),
                        *(f"--router={name}=tls/127.0.0.1:{port}" for name, port in ports.items())]) == 0
    ep = {name: f"tls/127.0.0.1:{port}" for name, port in ports.items()}
    manifest = load_manifest(out / "gpu0.manifest.yaml")
    assert manifest.zenoh_settings().connect == [ep["za"], ep["zb"]]
    acl = json.loads((out / "acl.json5").read_text().split("\n", 3)[3])
    assert {"cn/za", "cn/zb"} <= {s["id"] for s in acl["subjects"]}

    def robot(name):
        cfg = client_cli.parse_config([
            "--robot.type=zenoh_sim", f"--client_uuid={name}", f"--cluster_uuid={app_key.cluster}",
            f"--experiment_tag={app_key.experiment}", f"--model_id={app_key.model}",
            f"--model_version={app_key.version}", f"--application_tag={app_key.app}",
            *(out / f"{name}.flags").read_text().split()])
        return cfg.zenoh_settings()

    assert robot("robA").connect == [ep["za"], ep["zb"]] and robot("robB").connect == [ep["zb"], ep["za"]]
    routers = {name: subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.router", "--config",
                                       str(out / f"{name}.zenoh.json5")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True) for name in ports}
    try:
        for name, port in ports.items():
            proc = routers[name]
            assert wait_for(lambda: _port_open(port) or proc.poll() is not None, 30) and proc.poll() is None, \
                proc.stderr.read() if proc.poll() is not None else ""
        with PolicyServer(manifest), ZenohSession(robot("robA")) as sa, ZenohSession(robot("robB")) as sb:
            a, b = Robot(sa, app_key, "robA"), Robot(sb, app_key, "robB")
            wait_status(sb, app_key, timeout_s=15)  # robB on zb reaches the server on za: the mesh
            rng = np.random.default_rng(3)
            a.send_until_served(1, rng)
            b.send_until_served(1, rng)
            routers["za"].send_signal(signal.SIGKILL)
            routers["za"].wait(10)
            a.send_until_served(2, rng, timeout_s=20)  # robA and the server moved to zb
            b.send_until_served(2, rng, timeout_s=20)
    finally:
        for proc in routers.values():
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("extra, named", [
    (["--host", "robot_1"], "'robot_1'"),              # a server host name that is a robot's id
    (["--monitor", "localhost"], "'localhost'"),        # a monitor id that is a server host name
    (["--monitor", "robot_1"], "'robot_1'"),            # one id, two roles
    (["--monitor", "gpu0"], "'gpu0'"),                  # a monitor id equal to the server id
    (["--host", "0.0.0.0"], "'0.0.0.0'"),               # a wildcard is no host a client dials
    (["--host", "*.lab"], "'*.lab'"),
    (["--router", "robot_2", "--router_endpoint", "tls/127.0.0.1:7447"], "'robot_2'"),
    (["--router", "za"], "router_endpoint: router 'za' has no endpoint"),
    (["--router", "za=tls/127.0.0.1:7447", "--router_endpoint", "tls/127.0.0.1:7448"], "router_endpoint: "),
    (["--router", "za", "--router", "zb", "--router_endpoint", "tls/127.0.0.1:7448"], "router_endpoint: "),
    (["--router", "za=tls/0.0.0.0:7447", "--router", "zb=tls/127.0.0.1:7448"], "router: router 'za'"),
])
def test_secure_init_refuses_names_that_collide_with_a_role_in_one_line(tmp_path, app_key, capsys, extra, named):
    from lerobot_zenoh.cli import secure

    write_plain_manifest(tmp_path / "m.yaml", free_port(), app_key, clients=("robot_1", "robot_2"))
    out = tmp_path / "pki"
    assert secure.main(["init", "--manifest", str(tmp_path / "m.yaml"), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not out.exists()  # nothing written


# -- roles cannot be borrowed: only a server's certificate answers where a robot dials ---------------


def write_edge_and_engine(tmp_path, app_key, port: int, engine_endpoint: str) -> list[str]:
    """An edge scheduler `edge0` (robots robot_1, robot_2) dispatching to engine `cloud0` at
    `engine_endpoint`, and the engine's own manifest listening there: the `--manifest` arguments."""
    engines = [{"engine_id": "local", "tier": "edge", "capacity": 1, "local": True, "profile": {1: 5}},
               {"engine_id": "cloud0", "tier": "cloud", "capacity": 2, "endpoint": engine_endpoint, "profile": {1: 5}}]
    edge = plain_manifest(port, app_key, clients=[{"client_uuid": c} for c in ("robot_1", "robot_2")], engines=engines)
    edge["server_id"] = "edge0"
    engine = plain_manifest(port, app_key, clients=[], accept_unknown_clients=True)
    del engine["server_id"]
    engine |= {"role": "engine", "engine_id": "cloud0",
               "zenoh": {"listen": [engine_endpoint.replace("tls/", "tcp/")], "multicast_scouting": False}}
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(edge))
    (tmp_path / "cloud0.yaml").write_text(yaml.safe_dump(engine))
    return ["--manifest", str(tmp_path / "edge.yaml"), "--manifest", str(tmp_path / "cloud0.yaml")]


@pytest.mark.parametrize("holder, accepted", [("cloud0", False), ("robot_2", False), ("ops", False), ("edge0", True)])
def test_a_robot_accepts_only_the_servers_certificate_where_it_dials_the_server(tmp_path, app_key, capsys,
                                                                               holder, accepted):
    """`init` for an edge scheduler and its engine (dialled at 127.0.0.2). A listener on the server's
    address holding the engine's, another robot's or the monitor's certificate: robot_1, with its
    generated flags (mutual TLS, name check), refuses the link; holding the server's, it is accepted.
    With the former engine certificates (serverAuth and every server host name) the engine's was
    accepted."""
    from lerobot_zenoh.cli import client as client_cli
    from lerobot_zenoh.cli import secure

    port, engine_port = free_port(), free_port()
    out = tmp_path / "pki"
    assert secure.main(["init", *write_edge_and_engine(tmp_path, app_key, port, f"tcp/127.0.0.2:{engine_port}"),
                        "--out", str(out), "--monitor", "ops"]) == 0
    printed = capsys.readouterr().out
    serves = {line.split()[1]: line.split(None, 2)[2] for line in printed.splitlines() if line.startswith("  ")}
    assert serves == {"edge0": "localhost, 127.0.0.1, ::1", "cloud0": "127.0.0.2 (to its scheduler only)",
                      "robot_1": "nothing: client only",
                      "robot_2": "nothing: client only", "ops": "nothing: client only"}, printed
    layout = PkiLayout(out)
    assert pki.served_names(layout.cert("cloud0").read_bytes()) == ["127.0.0.2"]

    flags = (out / "robot_1.flags").read_text().split()
    cfg = client_cli.parse_config([
        "--robot.type=zenoh_sim", "--client_uuid=robot_1", f"--cluster_uuid={app_key.cluster}",
        f"--experiment_tag={app_key.experiment}", f"--model_id={app_key.model}",
        f"--model_version={app_key.version}", f"--application_tag={app_key.app}", *flags])
    robot = dataclasses.replace(cfg.zenoh_settings(), connect_timeout_s=1.0)
    assert robot.connect == [f"tls/127.0.0.1:{port}"] and robot.tls_mtls and robot.tls_verify_name
    rogue = ZenohSettings(mode="peer", listen=[f"tls/127.0.0.1:{port}"], multicast_scouting=False, **layout.tls(holder))
    with ZenohSession(rogue) as listener:
        if accepted:
            with ZenohSession(robot) as session:
                assert str(listener.zid) in [str(z) for z in session.raw.info.peers_zid()]
        else:
            with pytest.raises(TlsRefusedError, match="its TLS certificate is refused"):
                ZenohSession(robot).open()


def test_secure_init_refuses_an_engine_dialled_at_a_server_name_in_one_line(tmp_path, app_key, capsys):
    """An engine dialled at 127.0.0.1 (a name every server certificate carries) would get a certificate
    a robot dialling the server accepts: init refuses it, naming the field, and writes nothing."""
    from lerobot_zenoh.cli import secure

    out = tmp_path / "pki"
    manifests = write_edge_and_engine(tmp_path, app_key, free_port(), f"tcp/127.0.0.1:{free_port()}")
    assert secure.main(["init", *manifests, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "server.0.engines.1.endpoint" in err and "'127.0.0.1'" in err, err
    assert "'cloud0'" in err and "edge.yaml" in err, err
    assert not out.exists()
    # the engine's own address, or a host name no server carries, is accepted
    manifests = write_edge_and_engine(tmp_path, app_key, free_port(), "tcp/gpu-engine.lan:7448")
    assert secure.main(["init", *manifests, "--out", str(out)]) == 0
    assert pki.served_names((out / "cloud0.pem").read_bytes()) == ["gpu-engine.lan"]


# -- no stray listeners: a robot and a monitor on a LAN of network namespaces -----------------------

SCOUT_AND_CONNECT = r"""
import json, socket, sys, time, zenoh
robot_ip, ports = sys.argv[1], [int(p) for p in sys.argv[2].split(",") if p]
hellos = []
config = zenoh.Config()
scout = zenoh.scout(lambda hello: hellos.append([str(hello.zid), [str(l) for l in hello.locators]]),
                    what="peer|router", config=config)
time.sleep(3.0)
scout.stop()
reached = []
for port in ports + [7447]:
    try:
        socket.create_connection((robot_ip, port), timeout=1.0).close()
        reached.append(port)
    except OSError:
        pass
print(json.dumps({"hellos": hellos, "reached": reached}))
"""


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(180)
def test_a_robot_and_a_monitor_open_no_listener_and_a_lan_peer_cannot_reach_them(tmp_path, app_key):
    """Server, robot, monitor and an attacker, each in its own namespace on one LAN. The robot and the
    monitor run with the default Zenoh settings and only an endpoint given."""
    from testbed.netns import lan, lan_unavailable_reason

    reason = lan_unavailable_reason()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    with lan("server", "robot", "monitor", "attacker") as (server, robot, monitor, attacker):
        endpoint = f"tcp/{server.ip}:7447"
        manifest = plain_manifest(7447, app_key, clients=[{"client_uuid": "robot_1"}])
        manifest["zenoh"] = {"listen": [endpoint]}  # a server on the LAN; scouting at its default (on)
        (tmp_path / "m.yaml").write_text(yaml.safe_dump(manifest))
        procs = []
        try:
            procs.append(server.popen([sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest",
                                       str(tmp_path / "m.yaml")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            summary = tmp_path / "robot.json"
            robot_log = tmp_path / "robot.log"
            procs.append(robot.popen([
                sys.executable, "-m", "lerobot_zenoh.cli.client", "--robot.type=zenoh_sim",
                "--robot.cameras={front: [48, 64], wrist: [48, 64]}", "--client_uuid=robot_1",
                f"--cluster_uuid={app_key.cluster}", f"--experiment_tag={app_key.experiment}",
                f"--model_id={app_key.model}", f"--model_version={app_key.version}",
                f"--application_tag={app_key.app}", f"--endpoint={endpoint}", "--duration_s=20",
                "--discovery_timeout_s=60", "--zenoh.connect_timeout_s=60",  # (the server may still be starting)
                f"--summary_path={summary}"],
                stdout=subprocess.DEVNULL, stderr=robot_log.open("w")))
            # (it runs until stopped below, and waits for the server as the robot does: on a loaded
            # machine the server can take longer to listen than the default connect timeout)
            monitor_log = tmp_path / "monitor.log"
            procs.append(monitor.popen([sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint={endpoint}",
                                        "--json=true", "--zenoh.connect_timeout_s=60"], stdout=subprocess.DEVNULL,
                                       stderr=monitor_log.open("w")))
            # running: the robot has its own session open (it checks its endpoint before it loads
            # LeRobot, with a short-lived link) and its link to the server, the monitor its own
            assert wait_for(lambda: "asking the server for its status" in robot_log.read_text(), 120), \
                robot_log.read_text()
            assert wait_for(lambda: any(f"{server.ip}:7447" in s for s in robot.sockets("-tn")), 90), "robot never connected"
            assert wait_for(lambda: any(f"{server.ip}:7447" in s for s in monitor.sockets("-tn")), 90), \
                monitor_log.read_text()[-2000:]
            assert any(":7447" in s for s in server.sockets("-ltnp"))  # `ss` does see a listener where there is one
            listening = {name: host.sockets("-ltnp") + host.sockets("-lunp") for name, host in
                         (("robot", robot), ("monitor", monitor))}
            robot_ports = [s.split()[3].rsplit(":", 1)[1] for s in robot.sockets("-tn")]
            probe = attacker.run([sys.executable, "-c", SCOUT_AND_CONNECT, robot.ip, ",".join(robot_ports)], timeout=60)
            seen = json.loads(probe.stdout.strip().splitlines()[-1])
            # The robot checks its endpoint before it loads LeRobot, so its link shows before it runs:
            # let it finish its --duration_s (it writes its summary then) instead of stopping it early.
            procs[1].wait(timeout=180)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGINT)
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(json.dumps({"listening": listening, "scout": seen, "robot_ports": robot_ports}))
    assert listening == {"robot": [], "monitor": []}, listening  # no TCP listener, no UDP socket (no scouting)
    assert seen["reached"] == [], seen  # not its connection's port, not 7447
    assert [h for h in seen["hellos"] if any(robot.ip in loc for loc in h[1])] == []
    assert any(server.ip in loc for h in seen["hellos"] for loc in h[1])  # the scout works: the server answers
    assert json.loads(summary.read_text())["chunks_received"] > 0  # and the robot was being served


# -- shared memory ---------------------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def _serve_one(endpoint: str, app_key, seq: int, rng, **settings) -> None:
    """One short same-host session: connect, get one observation answered, close."""
    with ZenohSession(ZenohSettings(connect=[endpoint], **settings)) as session:
        Robot(session, app_key, "good").send_until_served(seq, rng)


def _server_process(tmp_path, port, app_key, zenoh: dict, prefix: list[str] = ()) -> tuple[subprocess.Popen, object]:
    manifest = plain_manifest(port, app_key)
    manifest["zenoh"].update(zenoh)
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(manifest))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest",
                                 str(tmp_path / "m.yaml")], stdout=out, stderr=subprocess.STDOUT)
    assert wait_for(lambda: "ready" in log.read_text() or proc.poll() is not None, 60) and proc.poll() is None, \
        log.read_text()[-2000:]
    return proc, log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shared_memory_is_off_by_default_and_the_server_stays_flat_over_100_sessions(tmp_path, port, app_key):
    """eclipse-zenoh 1.10.2 with shared memory on left 16 MiB mapped in the server per same-host
    session (12 sessions: 391 -> 586 MB, FACTS.md). With the defaults: flat over 100."""
    assert ZenohSettings().shared_memory is False
    assert ZenohSettings().to_zenoh_config().get_json("transport/shared_memory/enabled") == "false"
    proc, _ = _server_process(tmp_path, port, app_key, {})  # the manifest leaves shared_memory at its default
    endpoint = f"tcp/127.0.0.1:{port}"
    rng = np.random.default_rng(11)
    try:
        for seq in range(1, 11):  # warm-up: imports, first allocations
            _serve_one(endpoint, app_key, seq, rng)
        rss_start = _rss_mb(proc.pid)
        for seq in range(11, 111):
            _serve_one(endpoint, app_key, seq, rng)
        rss_end = _rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    print(f"\nserver RSS over 100 short same-host sessions: {rss_start:.1f} -> {rss_end:.1f} MB")
    assert rss_end - rss_start < 32, (rss_start, rss_end)  # one leaked segment per session would be 1600 MB


def test_shared_memory_without_memory_lock_falls_back_with_a_warning(monkeypatch, caplog, port):
    from lerobot_zenoh.transport import session as session_module

    monkeypatch.setattr(session_module, "memory_lock_available", lambda: False)
    settings = ZenohSettings(listen=[f"tcp/127.0.0.1:{port}"], multicast_scouting=False, shared_memory=True)
    with caplog.at_level("WARNING"), ZenohSession(settings) as s:
        assert s.shared_memory_fallback
        assert s.effective_settings.shared_memory is False and s.settings.shared_memory is True
    assert "cannot lock memory" in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_that_cannot_lock_memory_serves_every_same_host_observation(tmp_path, port, app_key):
    """The failure upstream: shared memory on, a server without CAP_IPC_LOCK served the first
    observation of a same-host client and silently lost the rest. Here it falls back, warns, and
    serves all of them (the client keeps shared memory on)."""
    import os
    import resource
    import shutil

    if shutil.which("capsh") is None or os.geteuid() != 0:
        pytest.skip("needs root and capsh to start a server without CAP_IPC_LOCK")
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY:
        pytest.skip("RLIMIT_MEMLOCK is unlimited here: dropping CAP_IPC_LOCK does not take the privilege away")
    inner = " ".join([sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest", str(tmp_path / "m.yaml")])
    manifest = plain_manifest(port, app_key)
    manifest["zenoh"]["shared_memory"] = True
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(manifest))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["capsh", "--drop=cap_ipc_lock", "--", "-c", f"exec {inner}"], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: "ready" in log.read_text() or proc.poll() is not None, 60) and proc.poll() is None, \
            log.read_text()[-2000:]
        with ZenohSession(ZenohSettings(connect=[f"tcp/127.0.0.1:{port}"], shared_memory=True)) as session:
            assert not session.shared_memory_fallback  # this side may lock memory: it offers shared memory
            good = Robot(session, app_key, "good")
            rng = np.random.default_rng(12)
            for seq in range(1, 11):  # each observation ~6 KB: over Zenoh's 3 KB shared-memory threshold
                good.send_until_served(seq, rng, timeout_s=5.0)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    assert "cannot lock memory" in log.read_text()


# -- what an independent client found (docs/protocol.md says so now) -------------------------------


def _with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    import struct

    tiff = (b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
            + struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack("<I", 0))
    app1 = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpeg[2:]


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_an_exif_orientation_is_ignored_the_pixels_are_used_as_stored(orientation):
    import cv2

    image = np.zeros((48, 64, 3), np.uint8)
    image[:8, :16] = 255  # a bright top-left corner
    jpeg = _with_exif_orientation(codec.encode_jpeg(image), orientation)
    if orientation in (6, 8):  # a decoder that applies the tag would swap H and W
        assert cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR).shape[:2] == (64, 48)
    decoded = codec.decode_jpeg(jpeg, (48, 64))
    assert decoded.shape == (48, 64, 3) and decoded[:8, :16].mean() > 200 and decoded[-8:, -16:].mean() < 50


def test_a_task_component_over_mutual_tls_answers_each_robot_on_its_own_stream_only(port, app_key, layout, tmp_path):
    """The ACL of a System 2 server that serves a task's observation stream (docs/pipelines.md): each
    robot publishes on its own stream key (robA on the key naming the component it asks, robB on
    the plain one) and reads its own text; one robot's certificate cannot publish on another's
    stream key, with or without component chunks."""
    from lerobot_zenoh.protocol.keys import pipeline_app

    acl_path = tmp_path / "acl.json5"
    manifest = parse_manifest(secured_manifest(
        port, app_key, layout, acl_path,
        synthetic={"state_dim": 6, "action_dim": 6, "chunk_size": 1, "cameras": CAMS, "latency_ms": 2,
                   "output": "text", "subtasks": ["reach", "grasp"]},
        pipeline={"task": "kit", "component": "plan", "bit": 1}))
    write_acl(access_control(Deployment.from_manifests([manifest])), acl_path)
    stream = pipeline_app(app_key.cluster, app_key.experiment, "kit")
    sessions = []
    with PolicyServer(manifest) as server:
        try:
            texts: dict[str, list] = {"robA": [], "robB": []}
            pubs = {}
            for name in texts:
                session = ZenohSession(member_settings(layout, name, [f"tls/127.0.0.1:{port}"])).open()
                sessions.append(session)
                session.subscribe(app_key.client(name).text,
                                  lambda k, b, n=name: texts[n].append(codec.decode_text_result(b)))
                session.declare_token(stream.client(name).metrics)
                key = stream.client(name).obs_for(0b10) if name == "robA" else stream.client(name).obs
                pubs[name] = session.publisher(key, OBSERVATION_QOS)
            wait_status(sessions[0], app_key)
            rng = np.random.default_rng(3)
            forged = [sessions[0].publisher(k, OBSERVATION_QOS)  # robA's certificate
                      for k in (stream.client("robB").obs, stream.client("robB").obs_for(0b10))]
            for seq in range(1, 4):
                for pub in forged:
                    pub.put(observation(900 + seq, "robB", rng))
            for name in ("robA", "robB"):
                deadline = time.monotonic() + 8.0
                while not texts[name] and time.monotonic() < deadline:
                    pubs[name].put(observation(1, name, rng))
                    wait_for(lambda n=name: bool(texts[n]), 0.3)
                assert [t.text for t in texts[name]][:1] == ["reach"], name
            clients = server.stats()[app_key.prefix]["clients"]
            assert not clients["robB"]["rejected"] and all(t.response_to_seq_id == 1 for t in texts["robB"])
        finally:
            for session in sessions:
                session.close()
