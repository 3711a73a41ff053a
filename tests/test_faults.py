"""Fault tests on real networks: a server in its own network namespace, the robot client here or in
a namespace of its own, a veth link between them (partitions: iptables; delay: netem or the
benchmarks' TUN delay line; loss: iptables' statistic match). Every test prints and saves its
figures (outputs/reliability/<test>.json) for docs/reliability.md.

Run alone with `make test-faults`; they are part of `make test` too (about a minute).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.config import routing_args
from lerobot_zenoh.client.task import Task
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings
from lz_testing import CAMS, make_config, wait_for
from testbed.netns import lan, lan_unavailable_reason, net_pair, netns_unavailable_reason

_reason = netns_unavailable_reason()
_lan_reason = lan_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.netns]
#: the tests built on `net_pair` (partitions are iptables rules)
needs_iptables = pytest.mark.skipif(_reason is not None, reason=f"fault tests need network namespaces: {_reason}")
#: the tests built on `lan` (only ip, tc and ss)
needs_lan = pytest.mark.skipif(_lan_reason is not None, reason=f"needs network namespaces: {_lan_reason}")

OUT = Path(__file__).resolve().parents[1] / "outputs" / "reliability"
PORT = 7447


def record(name: str, figures: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(figures, indent=2))
    print(f"\n{name}: {json.dumps(figures)}")


def server_manifest(tmp_path: Path, app_key, listen: str, server_id: str = "gpu0", standby_for: str | None = None,
                    mode: str = "peer", connect: list[str] | None = None, latency_ms: float = 20) -> Path:
    data = {
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": server_id,
        "telemetry_period_s": 0, "handover_grace_s": 0.3,
        "zenoh": {"mode": mode, "listen": [listen] if listen else [], "connect": connect or [],
                  "multicast_scouting": False},
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30,
                                  "cameras": {k: list(v) for k, v in CAMS.items()}, "latency_ms": latency_ms},
                    "fps": 30, "accept_unknown_clients": True}],
    }
    if standby_for:
        data["standby_for"] = standby_for
    path = tmp_path / f"{server_id}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Whatever a test fails on, no server it started outlives it."""
    yield
    while ServerProcess.started:
        proc = ServerProcess.started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


class ServerProcess:
    started: list[subprocess.Popen] = []

    def __init__(self, pair, manifest: Path, log: Path):
        self.log_path = log
        self._log = open(log, "w")
        cmd = [sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest", str(manifest)]
        self.proc = pair.popen(cmd, stdout=self._log, stderr=subprocess.STDOUT) if pair else \
            subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        ServerProcess.started.append(self.proc)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()
        return self.log_path.read_text()


def wait_status(endpoint: str, app_key, timeout_s: float = 60) -> float:
    """Block until the status queryable answers through `endpoint`; return when (monotonic)."""
    with ZenohSession(ZenohSettings(connect=[endpoint], multicast_scouting=False)) as s:
        assert wait_for(lambda: s.query(app_key.status, 0.3), timeout_s), f"no server at {endpoint}"
        return time.monotonic()


class RunningClient:
    def __init__(self, cfg, task=None):
        self.client = RobotClient(cfg, make_robot_from_config(cfg.robot), task=task).start()
        self.thread = threading.Thread(target=self.client.run, daemon=True)
        self.thread.start()

    def chunks(self) -> int:
        return self.client.counters.chunks_received

    def close(self) -> dict:
        self.client.stop()
        self.thread.join(10)
        self.client.close()
        return self.client.summary()


def periods_ok(summary: dict) -> dict:
    return {"control_period_ms_p50": summary["control_period_ms_p50"], "control_period_ms_p99": summary["control_period_ms_p99"],
            "loop_overruns": summary["loop_overruns"], "steps": summary["steps"]}


@needs_iptables
def test_kill9_client_holds_revalidates_and_resumes(tmp_path, app_key):
    with net_pair() as pair:
        endpoint = f"tcp/{pair.peer_ip}:{PORT}"
        manifest = server_manifest(tmp_path, app_key, endpoint)
        server = ServerProcess(pair, manifest, tmp_path / "server1.log")
        wait_status(endpoint, app_key)
        cfg = make_config(PORT, app_key, endpoint=endpoint, watchdog_timeout_s=0.5)
        rc = RunningClient(cfg)
        try:
            assert wait_for(lambda: rc.chunks() >= 3, 15)
            c = rc.client.counters
            empty_at_kill = c.empty_cycles
            server.kill9()
            t_kill = time.monotonic()
            assert wait_for(lambda: c.empty_cycles > empty_at_kill, 5), "the buffer never ran dry"
            t_dry = time.monotonic()
            assert wait_for(lambda: c.watchdog_events >= 1, 5)
            held = c.empty_cycles
            time.sleep(1.0)  # the measured window: 30 periods at 30 Hz, of which >= 25 must be held
            assert c.empty_cycles >= held + 25  # holding every period once dry, not stalled
            chunks_before = rc.chunks()
            server = ServerProcess(pair, manifest, tmp_path / "server2.log")
            t_back = wait_status(endpoint, app_key)
            assert wait_for(lambda: rc.chunks() > chunks_before, 10), "never resumed"
            t_resumed = time.monotonic()
        finally:
            summary = rc.close()
            server.stop()
    figures = {"kill_to_buffer_dry_s": round(t_dry - t_kill, 3), "server_back_to_first_chunk_s": round(t_resumed - t_back, 3),
               "watchdog_events": summary["watchdog_events"], "empty_buffer_cycles": summary["empty_buffer_cycles"],
               **periods_ok(summary)}
    record("kill9_restart", figures)  # (how soon it resumed is a figure for docs/reliability.md, not a
    # pass mark: it took 2.1 s with a second test process on the same 2 cores; "never resumed" is the failure)


@needs_iptables
def test_kill9_with_hot_standby_measures_the_gap(tmp_path, app_key):
    with net_pair() as pair:
        ep1, ep2 = f"tcp/{pair.peer_ip}:{PORT}", f"tcp/{pair.peer_ip}:{PORT + 1}"
        primary = ServerProcess(pair, server_manifest(tmp_path, app_key, ep1, "gpu0"), tmp_path / "primary.log")
        wait_status(ep1, app_key)
        standby = ServerProcess(pair, server_manifest(tmp_path, app_key, ep2, "gpu1", standby_for="gpu0", connect=[ep1]),
                                tmp_path / "standby.log")
        # "ready" is logged once the standby is pre-warmed and has looked for the primary's token.
        assert wait_for(lambda: "ready" in (tmp_path / "standby.log").read_text(), 60)
        cfg = make_config(PORT, app_key, endpoint=ep1, watchdog_timeout_s=0.5)
        cfg.zenoh = ZenohSettings(connect=[ep2], multicast_scouting=False)
        arrivals = []

        class NotingTask(Task):  # the plain task, noting when each accepted chunk arrived
            def on_chunk(self, seq_id, arrived_s):
                arrivals.append((arrived_s, seq_id))

        rc = RunningClient(cfg, NotingTask())
        try:
            assert wait_for(lambda: rc.chunks() >= 3 and rc.client.serving_server_id == "gpu0", 15)
            n = len(arrivals)
            primary.kill9()
            t_kill = time.perf_counter()
            assert wait_for(lambda: rc.client.serving_server_id == "gpu1" and len(arrivals) > n, 10), \
                "standby never took over"
            last_primary = arrivals[n - 1][0]
            first_standby = arrivals[n][0]
        finally:
            summary = rc.close()
            standby_log = standby.stop()
            primary.stop()
    figures = {"last_primary_chunk_to_first_standby_chunk_s": round(first_standby - last_primary, 3),
               "kill_to_first_standby_chunk_s": round(first_standby - t_kill, 3),
               "empty_buffer_cycles": summary["empty_buffer_cycles"], **periods_ok(summary)}
    record("kill9_standby", figures)
    assert "taking over" in standby_log


@needs_iptables
def test_loss_and_delay_every_chunk_arrives_and_the_loop_keeps_its_period(tmp_path, app_key):
    """10 % loss and 50 ms one-way delay between a robot namespace and a server namespace.

    The delay comes from `tc netem` where the kernel has it, else from the benchmarks' TUN delay line
    (this CI kernel has no sch_netem); the loss from iptables' statistic match in the server
    namespace, both directions. Robot and server are the real console scripts.
    """
    from testbed.netns import LinkShape, Network

    summary_path = tmp_path / "client.json"
    net = Network(str(tmp_path))
    try:
        net.start()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # e.g. no /dev/net/tun
        net.close()
        pytest.skip(f"no shaped link: neither netem nor the TUN delay line works here ({exc})")
    try:
        if not net.has_link:
            pytest.skip(f"no shaped link: {net.reason}")
        link = LinkShape("fault", 50.0, None, "50 ms one way")
        net.shape(link)
        host = net.server_host(link)
        endpoint = f"tcp/{host}:{PORT}"
        log = open(tmp_path / "server.log", "w")
        server = subprocess.Popen([*net.prefix("server"), sys.executable, "-m", "lerobot_zenoh.cli.server",
                                   "--manifest", str(server_manifest(tmp_path, app_key, endpoint))],
                                  stdout=log, stderr=subprocess.STDOUT)
        ServerProcess.started.append(server)
        dev = net.server_iface(link)
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            subprocess.run([*net.prefix("server"), "iptables", "-A", chain, flag, dev, "-m", "statistic", "--mode",
                            "random", "--probability", "0.1", "-j", "DROP"], check=True, capture_output=True)
        # The robot connects only (no retry at start-up): the server must be listening first.
        assert wait_for(lambda: "ready" in (tmp_path / "server.log").read_text(), 60), "the server never started"
        client = subprocess.run([*net.prefix("client"), sys.executable, "-m", "lerobot_zenoh.cli.client",
                                 "--robot.type=zenoh_sim", "--robot.cameras={front: [48, 64], wrist: [48, 64]}",
                                 *routing_args(app_key, "r1", endpoint), "--discovery_timeout_s=60", "--watchdog_timeout_s=2.0", "--duration_s=12",
                                 # 10 % loss can drop the handshake's packets past the 2 s a dead endpoint
                                 # is reported in: wait for the link as a user on a lossy link would
                                 "--zenoh.connect_timeout_s=30",
                                 "--telemetry_period_s=0", f"--summary_path={summary_path}"],
                                capture_output=True, text=True, timeout=180)
        # The server closes r1's session (logging its totals) once the robot's token is gone: every
        # chunk it answered is counted by then. Stopping it closes the session anyway.
        wait_for(lambda: " r1: session closed" in (tmp_path / "server.log").read_text(), 15)
        server.send_signal(signal.SIGINT)
        server.wait(20)
        log.close()
        stats = net.delay_line_stats()
    finally:
        net.close()
    assert client.returncode == 0, client.stdout[-2000:] + client.stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    # Every session of r1 (on a lossy link its token may vanish for longer than the grace, and its
    # session closes and reopens: each closed one logs its own count).
    served = sum(int(line.split("served ")[1].split(",")[0]) for line in (tmp_path / "server.log").read_text().splitlines()
                 if " r1: session closed" in line)
    figures = {"link": f"{net.method}, 50 ms one way, 10 % loss each way (iptables)",
               "chunks_sent_by_server": served,
               "chunks_received": summary["chunks_received"] + summary["chunks_rejected"],
               "requests_outstanding_at_exit": summary["requests_outstanding_at_exit"],
               "observations_published": summary["observations_published"], "rtt_ms_p50": summary["rtt_ms_p50"],
               "rtt_ms_p99": summary["rtt_ms_p99"], "empty_buffer_cycles": summary["empty_buffer_cycles"],
               "delay_line": stats, **periods_ok(summary)}
    record("loss10_delay50", figures)
    # Reliable: every chunk the server sent arrived, except one answering a request still in flight
    # when the robot's run ended (max_in_flight = 1).
    in_flight = summary["requests_outstanding_at_exit"]
    assert served > 3 and figures["chunks_received"] <= served <= figures["chunks_received"] + in_flight
    assert summary["rtt_ms_p50"] >= 100  # the 2 x 50 ms really was on the path
    assert abs(summary["control_period_ms_p50"] - 1000 / 30) < 3


@needs_iptables
def test_five_second_partition_holds_then_resumes_without_restart(tmp_path, app_key):
    with net_pair() as pair:
        endpoint = f"tcp/{pair.peer_ip}:{PORT}"
        server = ServerProcess(pair, server_manifest(tmp_path, app_key, endpoint), tmp_path / "server.log")
        wait_status(endpoint, app_key)
        cfg = make_config(PORT, app_key, endpoint=endpoint, watchdog_timeout_s=0.5)
        rc = RunningClient(cfg)
        c = rc.client.counters
        try:
            assert wait_for(lambda: rc.chunks() >= 3, 15)
            pair.partition()
            t_cut = time.monotonic()
            assert wait_for(lambda: c.watchdog_events >= 1, 5), "watchdog never fired"
            t_watchdog = time.monotonic()
            time.sleep(max(0.0, 5.0 - (time.monotonic() - t_cut)))  # the partition under test lasts 5 s
            held = c.empty_cycles
            chunks_before = rc.chunks()
            pair.clear()
            t_heal = time.monotonic()
            assert wait_for(lambda: rc.chunks() > chunks_before, 15), "never resumed after the partition"
            t_resumed = time.monotonic()
        finally:
            summary = rc.close()
            server.stop()
    figures = {"partition_to_watchdog_s": round(t_watchdog - t_cut, 3), "heal_to_first_chunk_s": round(t_resumed - t_heal, 3),
               "empty_cycles_during_partition": held, **periods_ok(summary)}
    record("partition_5s", figures)
    assert held > 60  # it held for most of the 5 s


@needs_iptables
def test_router_restart_service_resumes_without_restarting_anyone(tmp_path, app_key):
    """Robots here, the server in its namespace, a Zenoh router between; both sides in client mode."""
    with net_pair() as pair:
        router_ep = f"tcp/{pair.host_ip}:{PORT}"
        router_cmd = [sys.executable, "-m", "lerobot_zenoh.cli.router", "--listen", router_ep, "--no-scouting"]
        router = subprocess.Popen(router_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ServerProcess.started.append(router)
        assert wait_for(lambda: _port_open(pair.host_ip, PORT) or router.poll() is not None, 30) and router.poll() is None
        server = ServerProcess(pair, server_manifest(tmp_path, app_key, "", mode="client", connect=[router_ep]),
                               tmp_path / "server.log")
        wait_status(router_ep, app_key)
        cfg = make_config(PORT, app_key, endpoint=router_ep, watchdog_timeout_s=0.5)
        cfg.zenoh = ZenohSettings(mode="client", multicast_scouting=False)
        rc = RunningClient(cfg)
        try:
            assert wait_for(lambda: rc.chunks() >= 3, 15)
            router.send_signal(signal.SIGKILL)
            router.wait(10)
            t_down = time.monotonic()
            time.sleep(2.0)  # the outage under test: the router stays down 2 s
            chunks_before = rc.chunks()
            router = subprocess.Popen(router_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ServerProcess.started.append(router)
            t_up = time.monotonic()
            assert wait_for(lambda: rc.chunks() > chunks_before, 30), "service never resumed through the new router"
            t_resumed = time.monotonic()
        finally:
            summary = rc.close()
            server.stop()
            router.kill()
    figures = {"router_down_s": round(t_up - t_down, 3), "router_restart_to_first_chunk_s": round(t_resumed - t_up, 3),
               "watchdog_events": summary["watchdog_events"], **periods_ok(summary)}
    record("router_restart", figures)
    assert summary["steps"] > 0 and np.isfinite(figures["router_restart_to_first_chunk_s"])


# -- a robot whose link stalls ---------------------------------------------------------------------

PROBE = Path(__file__).resolve().parent / "lz_probe_robot.py"


def _port_open(ip: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((ip, port)) == 0
PERIOD_S = 1 / 30


def _latencies(path: Path, t0: float, t1: float) -> tuple[int, list[float]]:
    """(observations sent in [t0, t1), latencies in ms of those answered) from a probe's file."""
    data = json.loads(path.read_text())
    first: dict[int, float] = {}
    for t, seq in data["chunks"]:
        first.setdefault(seq, t)
    sent = {int(k): v for k, v in data["sent"].items() if t0 <= v < t1}
    return len(sent), [(first[s] - t) * 1000 for s, t in sent.items() if s in first]


@needs_lan
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stall, topology", [("freeze", "peer"), ("downlink", "peer"), ("downlink", "router")])
def test_a_stalled_robot_delays_no_other_robot_and_recovers(tmp_path, app_key, stall, topology):
    """Robots A and B stream observations at 30 Hz to a real lerobot-policy-server (synthetic policy,
    5 ms, chunks of 50 x 32: a VLA-sized 6.4 KB); A's link stalls for 6 s: `freeze` loses every packet
    both ways, `downlink` loses the data sent to A while A's own packets still flow (so the server
    keeps answering A into a link that takes nothing). B's chunks must not wait more than one control
    period longer than before; A must be served again once its link is back.

    With congestion control BLOCK on actions (the former ACTION_QOS) this failed: B got 31 of 181
    chunks during a `downlink` stall (the inference thread was blocked in A's put); with BLOCK behind
    the per-client publishing queue, through a router, B's chunks waited up to 5 s (p99 4.9 s: the
    router blocked on A's link). docs/reliability.md.
    """
    with lan("server", "ra", "rb", "router") as (server, ra, rb, router):
        procs: list[subprocess.Popen] = []
        if topology == "router":
            endpoint = f"tcp/{router.ip}:{PORT}"
            procs.append(router.popen([sys.executable, "-m", "lerobot_zenoh.cli.router", "--listen", endpoint,
                                       "--no-scouting"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ServerProcess.started.append(procs[-1])
            zenoh = {"connect": [endpoint]}
        else:
            endpoint = f"tcp/{server.ip}:{PORT}"
            zenoh = {"listen": [endpoint], "multicast_scouting": False}
        manifest = tmp_path / "m.yaml"
        manifest.write_text(yaml.safe_dump({
            "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
            "telemetry_period_s": 0, "zenoh": zenoh,
            "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                        "synthetic": {"state_dim": 6, "action_dim": 32, "chunk_size": 50,
                                      "cameras": {"front": [48, 64], "wrist": [48, 64]}, "latency_ms": 5},
                        "fps": 30, "accept_unknown_clients": True}]}))
        server_log = tmp_path / "server.log"
        with open(server_log, "w") as log:
            procs.append(server.popen([sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest", str(manifest)],
                                      stdout=log, stderr=subprocess.STDOUT))
        ServerProcess.started.append(procs[-1])
        app = "/".join((app_key.cluster, app_key.experiment, app_key.model, app_key.version, app_key.app))
        probes = {name: host.popen([sys.executable, str(PROBE), "--endpoint", endpoint, "--app", app, "--client", name,
                                    "--period-s", str(PERIOD_S), "--duration-s", "24", "--out", str(tmp_path / f"{name}.json")])
                  for name, host in (("ra", ra), ("rb", rb))}
        ServerProcess.started.extend(probes.values())
        try:
            assert wait_for(lambda: "ready" in server_log.read_text(), 60), server_log.read_text()[-2000:]
            serving = [tmp_path / f"{name}.json.serving" for name in probes]  # a probe served for a second
            assert wait_for(lambda: all(path.exists() for path in serving), 60), "a probe was never served"
            time.sleep(5)  # B's baseline: the 5 s before the stall are measured below
            t_stall = time.monotonic()
            (ra.freeze if stall == "freeze" else ra.freeze_downlink)()
            time.sleep(6)  # the stall under test lasts 6 s
            ra.thaw()
            t_back = time.monotonic()
            for proc in probes.values():
                assert proc.wait(120) == 0
        finally:
            ra.thaw()
            for proc in reversed(procs):
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    b_before_sent, b_before = _latencies(tmp_path / "rb.json", t_stall - 5, t_stall)
    b_stall_sent, b_stall = _latencies(tmp_path / "rb.json", t_stall, t_back)
    a_stall_sent, a_stall = _latencies(tmp_path / "ra.json", t_stall, t_back)
    a_chunks = json.loads((tmp_path / "ra.json").read_text())["chunks"]
    first_after = min((t for t, _ in a_chunks if t > t_back), default=None)
    # after a full freeze TCP's retransmission back-off decides when A's link carries data again
    # (0.6 to 3.2 s measured); from then on A is served as before
    a_after_sent, a_after = _latencies(tmp_path / "ra.json", (first_after or t_back) + 0.5, (first_after or t_back) + 3.5)
    assert b_before and len(b_before) >= 0.95 * b_before_sent, "B was not served before the stall"
    allowed_ms = float(np.percentile(b_before, 99)) + PERIOD_S * 1000
    late = [ms for ms in b_stall if ms > allowed_ms]
    figures = {
        "stall": stall, "topology": topology, "stall_s": round(t_back - t_stall, 2),
        "b_before": {"sent": b_before_sent, "answered": len(b_before), "p99_ms": round(float(np.percentile(b_before, 99)), 1)},
        "b_during_stall": {"sent": b_stall_sent, "answered": len(b_stall),
                           "p99_ms": round(float(np.percentile(b_stall, 99)), 1) if b_stall else None,
                           "max_ms": round(max(b_stall), 1) if b_stall else None, "later_than_allowed": len(late)},
        "allowed_ms": round(allowed_ms, 1),
        "a_during_stall": {"sent": a_stall_sent, "answered": len(a_stall)},
        "a_link_back_to_first_chunk_s": round(first_after - t_back, 2) if first_after else None,
        "a_after": {"sent": a_after_sent, "answered": len(a_after)},
    }
    record(f"stalled_robot_{stall}_{topology}", figures)
    # B kept being answered, no later than one control period beyond its own p99 before the stall.
    # A stall that reached B would make most of its ~180 round trips late or lost; a loaded machine
    # makes a few (2 of 182 late, 4 of 181 lost, seen with both cores busy): the margins tell them apart.
    assert len(b_stall) >= 0.97 * b_stall_sent, figures
    assert len(late) <= max(2, 0.02 * b_stall_sent), figures
    assert first_after is not None and first_after - t_back < 5.0, figures  # A is served again
    assert len(a_after) >= 0.9 * a_after_sent, figures


@needs_lan
@pytest.mark.timeout(180)
def test_kill9_of_the_primary_a_connect_only_robot_fails_over_to_the_standby(tmp_path, app_key):
    """The robot with the default settings (a Zenoh client: one link, to the first endpoint that
    answers) given both servers' endpoints, server and robot in their own namespaces: the primary
    is killed, the standby serves, the robot follows without restarting."""
    with lan("server", "robot") as (server, robot):
        ep1, ep2 = f"tcp/{server.ip}:{PORT}", f"tcp/{server.ip}:{PORT + 1}"
        primary = ServerProcess(server, server_manifest(tmp_path, app_key, ep1, "gpu0", latency_ms=5), tmp_path / "p.log")
        assert wait_for(lambda: "ready" in (tmp_path / "p.log").read_text(), 60)
        standby = ServerProcess(server, server_manifest(tmp_path, app_key, ep2, "gpu1", standby_for="gpu0",
                                                        connect=[ep1], latency_ms=5), tmp_path / "s.log")
        assert wait_for(lambda: "ready" in (tmp_path / "s.log").read_text(), 60)
        summary = tmp_path / "robot.json"
        robot_log = open(tmp_path / "robot.log", "w")
        client = robot.popen([sys.executable, "-m", "lerobot_zenoh.cli.client", "--robot.type=zenoh_sim",
                              "--robot.cameras={front: [48, 64], wrist: [48, 64]}", *routing_args(app_key, "r1", ep1),
                              f"--zenoh.connect=[{ep2}]", "--duration_s=14", "--watchdog_timeout_s=0.5",
                              "--discovery_timeout_s=60", "--telemetry_period_s=0", f"--summary_path={summary}"],
                             stdout=robot_log, stderr=subprocess.STDOUT)
        ServerProcess.started.append(client)
        try:
            assert wait_for(lambda: any(f":{PORT}" in s or f":{PORT + 1}" in s for s in robot.sockets("-tn")), 60)
            assert wait_for(lambda: "server gpu0 serves" in (tmp_path / "robot.log").read_text(), 60)
            assert robot.sockets("-ltn") == []  # connect-only
            primary.kill9()
            assert client.wait(90) == 0
        finally:
            standby_log = standby.stop()
            primary.stop()
            robot_log.close()
    result = json.loads(summary.read_text())
    record("kill9_standby_connect_only", {k: result[k] for k in ("server_id", "chunks_received", "empty_buffer_cycles",
                                                                  "watchdog_events", "loop_overruns")})
    assert "taking over" in standby_log
    assert result["server_id"] == "gpu1" and result["chunks_received"] > 5
    assert result["empty_buffer_cycles"] < 60  # under 2 s without actions
