"""A hot-standby fleet over mutual TLS behind a router enforcing the ACL, as docs/reliability.md and
docs/security.md deploy it: `lerobot-zenoh-secure init` writes the certificates, the ACL and the
secured manifests; the router is the project's `lerobot-zenoh-router` process (tests/test_failover_tls.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.security.identities import PkiLayout, member_settings
from lerobot_zenoh.server.config.manifest import load_manifest
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lz_testing import CAMS, free_port, wait_for

ROBOT = "robA"


def plain_manifest(app_key, server_id: str, standby_for: str | None = None, latency_ms: float = 10) -> dict:
    return {
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": server_id,
        "standby_for": standby_for, "handover_grace_s": 0.3, "telemetry_period_s": 0,
        "zenoh": {"listen": [f"tcp/127.0.0.1:{free_port()}"], "multicast_scouting": False},
        "server": [{
            "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30, "cameras": CAMS,
                          "latency_ms": latency_ms},
            "fps": 30, "clients": [{"client_uuid": ROBOT}],
        }],
    }


class TlsFleet:
    """`init` for gpu0 (primary), gpu1 (`standby_for: gpu0`) and gpu2 (a third server of the app,
    its own certificate), one robot; `start_router()` runs the router; `manifest(id)` is the secured one."""

    def __init__(self, app_key, root: Path, latency_ms: float = 10):
        from lerobot_zenoh.cli import secure

        self.app_key = app_key
        self.root = root
        self.router_port = free_port()
        paths = []
        for sid, standby_for in (("gpu0", None), ("gpu1", "gpu0"), ("gpu2", None)):
            path = root / f"{sid}.plain.yaml"
            path.write_text(yaml.safe_dump(plain_manifest(app_key, sid, standby_for, latency_ms)))
            paths.append(path)
        self.out = root / "pki"
        args = ["init", *(f"--manifest={p}" for p in paths), "--out", str(self.out), "--router", "zr",
                "--router_endpoint", f"tls/127.0.0.1:{self.router_port}"]
        with open(root / "secure-init.log", "w") as log, _redirect(log):
            assert secure.main(args) == 0
        self.layout = PkiLayout(self.out)
        self.router: subprocess.Popen | None = None

    def manifest_path(self, server_id: str) -> Path:
        return self.out / f"{server_id}.manifest.yaml"

    def manifest(self, server_id: str):
        return load_manifest(self.manifest_path(server_id))

    def member(self, name: str) -> ZenohSession:
        return ZenohSession(member_settings(self.layout, name, [f"tls/127.0.0.1:{self.router_port}"]))

    def start_router(self) -> None:
        self.router = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.router", "--config",
                                        str(self.out / "zr.zenoh.json5")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert wait_for(lambda: _port_open(self.router_port) or self.router.poll() is not None, 30) \
            and self.router.poll() is None, self.router.stderr.read() if self.router.poll() is not None else ""

    def stop_router(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(10)


class RobotWire:
    """The robot's side on the wire: observations of `ROBOT` at 30 Hz (its own certificate), and
    every chunk it receives as (arrival, server_id, seq, t_sent of that observation)."""

    def __init__(self, fleet: TlsFleet, period_s: float = 1 / 30):
        self.session = fleet.member(ROBOT).open()
        key = fleet.app_key.client(ROBOT)
        self.chunks: list[tuple[float, str, int]] = []
        self.sent_s: dict[int, float] = {}
        self.session.subscribe(key.action, lambda k, b: self.chunks.append(
            (time.monotonic(), (c := codec.decode_action_chunk(b)).server_id, c.response_to_seq_id)))
        self._pub = self.session.publisher(key.obs, OBSERVATION_QOS)
        rng = np.random.default_rng(0)
        self._jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8)) for n, hw in CAMS.items()}
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, name="robot-wire", daemon=True)

    def start(self) -> RobotWire:
        self._thread.start()
        return self

    def _send(self) -> None:
        seq = 0
        while not self._stop.wait(self._period_s):
            seq += 1
            self.sent_s[seq] = time.monotonic()
            self._pub.put(codec.encode(Observation(seq, ROBOT, np.zeros(6, np.float32), self._jpegs, "t",
                                                   session_nonce=1)))

    def duplicates(self) -> list[int]:
        seqs = [q for _, _, q in self.chunks]
        return sorted({q for q in seqs if seqs.count(q) > 1})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.session.close()


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class _redirect:
    """stdout into `to` (init prints what it wrote)."""

    def __init__(self, to):
        self.to = to

    def __enter__(self):
        self.saved, sys.stdout = sys.stdout, self.to

    def __exit__(self, *exc_info):
        sys.stdout = self.saved
