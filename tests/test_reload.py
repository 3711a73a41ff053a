"""A running server takes a changed client list (and task streams) without a restart (docs/server.md,
"Reloading the client list"): over real Zenoh in-process (`PolicyServer.reload`) and through SIGHUP to
`lerobot-policy-server` (the path lerobot-zenoh-admit uses)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import yaml

from lerobot_zenoh.client.discovery import query_status
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import pipeline_app
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

CAMS = {"front": (16, 16)}


def manifest_data(port, app_key, clients, **entry) -> dict:
    base = {"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 10, "cameras": CAMS, "latency_ms": 2},
            "fps": 30, "clients": [{"client_uuid": c} for c in clients]}
    base.update(entry)
    return {"cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
            "server": [base]}


def connect(port) -> ZenohSession:
    return ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()


class Robot:
    """The wire side of one client: sends an observation (resent while unanswered) and waits for its chunk.

    With `task`, it is a robot of that multi-model task: it publishes on the task's stream (with its
    header, asking the components of `mask`) and declares its token there; the chunk still comes on
    the server's own app key."""

    def __init__(self, session: ZenohSession, app_key, client_id: str, task: str | None = None, mask: int = 1):
        self.key = app_key.client(client_id)
        self.client_id = client_id
        self.seq = 0
        self.mask = mask if task is not None else None
        self.answered: set[int] = set()
        self.arrived = threading.Condition()
        session.subscribe(self.key.action, self._on_chunk)
        source = pipeline_app(app_key.cluster, app_key.experiment, task).client(client_id) if task else self.key
        self.pub = session.publisher(source.obs, OBSERVATION_QOS)
        self.token = session.declare_token(source.metrics) if task else None
        self.rng = np.random.default_rng(7)

    def _on_chunk(self, key, payload):
        chunk = codec.decode_action_chunk(payload)
        with self.arrived:
            self.answered.add(chunk.response_to_seq_id)
            self.arrived.notify_all()

    def served(self, timeout_s: float = 2.0) -> bool:
        self.seq += 1
        seq = self.seq
        images = {n: codec.encode_jpeg(self.rng.integers(0, 255, (*hw, 3), dtype=np.uint8), 90) for n, hw in CAMS.items()}
        obs = Observation(seq, self.client_id, self.rng.normal(size=6).astype(np.float32), images, "task",
                          episode_id="0", session_nonce=1, component_mask=self.mask)
        payload = codec.encode(obs)
        header = codec.encode_observation_header(obs) if self.mask is not None else None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.pub.put(payload, header)
            with self.arrived:
                if self.arrived.wait_for(lambda: seq in self.answered, timeout=0.2):
                    return True
        return False


def admitted(session, app_key, client_id) -> bool | None:
    status = query_status(session, app_key, timeout_s=1.0, client_uuid=client_id)
    return None if status is None else status.client_admitted


def snapshot(server, app_key):
    return server.models[0].session_table.snapshot()


def test_a_client_added_by_reload_is_served_and_one_removed_is_closed(port, app_key):
    """Clients [a]: b is refused (unknown clients are not accepted). After the reload to [a, b], b is
    served on a listed place; after the reload to [b], a's session closes like an expired one."""
    server = PolicyServer(parse_manifest(manifest_data(port, app_key, ["a"]))).start()
    session = connect(port)
    try:
        assert wait_for(lambda: admitted(session, app_key, "a") is True), "status never answered"
        a, b = Robot(session, app_key, "a"), Robot(session, app_key, "b")
        assert a.served()
        assert not b.served(timeout_s=0.5)
        assert server.stats()[app_key.prefix]["unknown_rejected"] > 0 and admitted(session, app_key, "b") is False

        assert server.reload(parse_manifest(manifest_data(port, app_key, ["a", "b"]))) is None
        assert admitted(session, app_key, "b") is True
        assert b.served() and a.served()
        snap = snapshot(server, app_key)
        assert snap.sessions["b"].listed and snap.unknown_open == 0

        assert server.reload(parse_manifest(manifest_data(port, app_key, ["b"]))) is None
        assert wait_for(lambda: snapshot(server, app_key).sessions_closed.get("delisted") == 1, 5)
        assert "a" not in snapshot(server, app_key).sessions and admitted(session, app_key, "a") is False
        assert not a.served(timeout_s=0.5) and b.served()
    finally:
        session.close()
        server.stop()


def test_a_client_served_as_unknown_keeps_its_session_on_a_reserved_place_once_listed(port, app_key):
    """One unknown place: b holds it, so c is refused (too_many_clients). Listing b moves its open
    session to a reserved place (not reopened), which frees the unknown place for c."""
    data = manifest_data(port, app_key, ["a"], accept_unknown_clients=True, max_unknown_clients=1)
    server = PolicyServer(parse_manifest(data)).start()
    session = connect(port)
    try:
        assert wait_for(lambda: admitted(session, app_key, "a") is True), "status never answered"
        b, c = Robot(session, app_key, "b"), Robot(session, app_key, "c")
        assert b.served()
        assert not c.served(timeout_s=0.5)
        assert server.stats()[app_key.prefix]["dropped"].get("too_many_clients", 0) > 0
        opened = snapshot(server, app_key).sessions_opened

        data["server"][0]["clients"].append({"client_uuid": "b"})
        assert server.reload(parse_manifest(data)) is None
        snap = snapshot(server, app_key)
        assert snap.sessions["b"].listed and snap.unknown_open == 0 and snap.sessions_opened == opened
        assert c.served() and b.served()
    finally:
        session.close()
        server.stop()


def test_a_reload_that_changes_another_field_is_refused_and_logged(port, app_key, caplog):
    data = manifest_data(port, app_key, ["a"], max_batch_size=1)
    server = PolicyServer(parse_manifest(data)).start()
    session = connect(port)
    try:
        assert wait_for(lambda: admitted(session, app_key, "a") is True), "status never answered"
        changed = manifest_data(port, app_key, ["a", "b"], max_batch_size=1, fps=15)
        with caplog.at_level(logging.ERROR, logger="lerobot_zenoh.server"):
            assert server.reload(parse_manifest(changed)) == "server.0.fps changed"
        refusals = [r.getMessage() for r in caplog.records if "reload refused" in r.getMessage()]
        assert len(refusals) == 1 and "server.0.fps changed" in refusals[0] and "\n" not in refusals[0]
        assert server.manifest.server[0].fps == 30 and admitted(session, app_key, "b") is False  # nothing applied
        assert "b" not in server.models[0].session_table.config.listed

        # The planned batch size is reloaded with the client list (admission may change it).
        assert server.reload(parse_manifest(manifest_data(port, app_key, ["a", "b"], max_batch_size=2))) is None
        assert server.models[0].session_table.config.max_batch_size == 2 and admitted(session, app_key, "b") is True
        assert "auto" in server.reload(parse_manifest(manifest_data(port, app_key, ["a"], max_batch_size="auto")))
    finally:
        session.close()
        server.stop()


def test_a_reload_adding_a_task_stream_serves_a_robot_publishing_on_it(port, app_key, caplog):
    """Placement-preserving admission gives a System 1 server that serves task `pick` a robot of task
    `kit`: the reload subscribes to kit's stream (and its robots' tokens), so the robot is served there;
    a changed bit takes effect; a stream no longer listed is unsubscribed and its robot's session closed."""
    pick = [{"task": "pick", "component": "act", "bit": 0}]
    server = PolicyServer(parse_manifest(manifest_data(port, app_key, ["pick-r0"], pipeline=pick))).start()
    session = connect(port)
    try:
        assert wait_for(lambda: admitted(session, app_key, "pick-r0") is True), "status never answered"
        picker, kitter = Robot(session, app_key, "pick-r0", task="pick"), Robot(session, app_key, "kit-r0", task="kit")
        assert picker.served()
        assert not kitter.served(timeout_s=0.5)  # neither listed nor heard
        assert server.stats()[app_key.prefix]["unknown_rejected"] == 0  # never reached the server

        kit = {"task": "kit", "component": "act", "bit": 0, "prompt": "assemble the kit"}
        with caplog.at_level(logging.INFO, logger="lerobot_zenoh.server"):
            assert server.reload(parse_manifest(manifest_data(port, app_key, ["pick-r0", "kit-r0"],
                                                              pipeline=[*pick, kit]))) is None
        assert any("task streams +['kit']" in r.getMessage() for r in caplog.records)
        assert admitted(session, app_key, "kit-r0") is True
        assert kitter.served() and picker.served()
        assert server.models[0].routing.component_of["kit-r0"] == "kit"
        assert server.models[0].streams["kit"].query.prompt == "assemble the kit"

        # The task now asks this model as its component 1: an observation asking component 0 only is
        # dropped from its header; one asking component 1 is served.
        moved = {**kit, "bit": 1}
        assert server.reload(parse_manifest(manifest_data(port, app_key, ["pick-r0", "kit-r0"],
                                                          pipeline=[*pick, moved]))) is None
        other = server.models[0].for_other_components
        assert not kitter.served(timeout_s=0.5) and server.models[0].for_other_components > other
        kitter.mask = 0b10
        assert kitter.served()
        # On the keys naming the components (what the pipeline client sends): the changed bit's key is
        # subscribed now, the old one no longer is (not even heard to be dropped).
        stream = pipeline_app(app_key.cluster, app_key.experiment, "kit").client("kit-r0")
        kitter.pub = session.publisher(stream.obs_for(0b10), OBSERVATION_QOS)
        assert kitter.served()
        kitter.pub, kitter.mask = session.publisher(stream.obs_for(0b01), OBSERVATION_QOS), 0b01
        other = server.models[0].for_other_components
        assert not kitter.served(timeout_s=0.5) and server.models[0].for_other_components == other
        kitter.pub, kitter.mask = session.publisher(stream.obs, OBSERVATION_QOS), 0b10

        # kit is no longer listed: its stream is unsubscribed and kit-r0's session closes.
        assert server.reload(parse_manifest(manifest_data(port, app_key, ["pick-r0", "kit-r0"], pipeline=pick))) is None
        assert wait_for(lambda: snapshot(server, app_key).sessions_closed.get("delisted") == 1, 5)
        assert "kit-r0" not in snapshot(server, app_key).sessions and "kit" not in server.models[0].streams
        received = server.stats()[app_key.prefix]["totals"].get("received", 0)
        assert not kitter.served(timeout_s=0.5) and picker.served()
        assert "kit-r0" not in snapshot(server, app_key).sessions  # not heard: no session reopened
        assert server.stats()[app_key.prefix]["totals"].get("received", 0) == received
        assert len(server.models[0].subscriptions) == 2 and set(server.models[0].subscriptions) == {None, "pick"}
    finally:
        session.close()
        server.stop()


def test_sighup_makes_the_server_process_reread_its_client_list(tmp_path, port, app_key):
    """`lerobot-policy-server --pid_file`: SIGHUP takes the new client list; a manifest that changes
    another field, or does not parse, is refused in one log line and the running one stays."""
    path, pid_file, log_file = tmp_path / "m.yaml", tmp_path / "run" / "srv.pid", tmp_path / "server.log"
    path.write_text(yaml.safe_dump(manifest_data(port, app_key, ["a"])))
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.server", f"--manifest={path}",
                                 f"--pid_file={pid_file}"], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    session = connect(port)
    try:
        assert wait_for(lambda: pid_file.is_file(), 60), log_file.read_text()[-2000:]
        assert int(pid_file.read_text()) == proc.pid
        assert wait_for(lambda: admitted(session, app_key, "a") is True, 10)
        assert admitted(session, app_key, "b") is False

        path.write_text(yaml.safe_dump(manifest_data(port, app_key, ["a", "b"])))
        os.kill(proc.pid, signal.SIGHUP)
        assert wait_for(lambda: admitted(session, app_key, "b") is True, 10), log_file.read_text()[-2000:]

        path.write_text(yaml.safe_dump(manifest_data(port, app_key, ["a"], fps=15)))
        os.kill(proc.pid, signal.SIGHUP)
        assert wait_for(lambda: "reload refused: server.0.fps changed" in log_file.read_text(), 10)
        path.write_text("cluster_uuid: [")
        os.kill(proc.pid, signal.SIGHUP)
        assert wait_for(lambda: log_file.read_text().count("reload refused") == 2, 10)
        assert admitted(session, app_key, "b") is True  # the running manifest stayed in force
        refused = [line for line in log_file.read_text().splitlines() if "reload refused" in line]
        assert "not valid YAML" in refused[1]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert not pid_file.exists()
    finally:
        session.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
