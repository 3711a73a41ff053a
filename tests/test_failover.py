"""Hot standby on loopback: the standby takes over a dead primary's clients and steps back."""

from __future__ import annotations

import threading
import time

import numpy as np

from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import ZenohSettings, loopback_settings
from lz_testing import CAMS, free_port, make_config, wait_for

import pytest


def manifest(app_key, port, server_id, standby_for=None, connect=(), rtc=False, chunk_size=30):
    return parse_manifest(manifest_dict(app_key, port, server_id, standby_for, connect, rtc, chunk_size))


def manifest_dict(app_key, port, server_id, standby_for=None, connect=(), rtc=False, chunk_size=30):
    return ({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": server_id,
        "standby_for": standby_for, "handover_grace_s": 0.3, "telemetry_period_s": 0,
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "connect": list(connect), "multicast_scouting": False},
        "server": [{
            "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": chunk_size, "cameras": CAMS,
                          "latency_ms": 10, "rtc": rtc},
            "fps": 30, "accept_unknown_clients": True,
        }],
    })


def _send_observations(pub, stop: threading.Event, period_s: float = 1 / 30) -> threading.Thread:
    """A robot's observations of r1 (one session nonce, seq 1, 2, ...) on `pub`, one per `period_s`, until `stop`."""
    rng = np.random.default_rng(0)
    jpegs = {n: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8)) for n, hw in CAMS.items()}

    def send():
        seq = 0
        while not stop.wait(period_s):
            seq += 1
            pub.put(codec.encode(Observation(seq, "r1", np.zeros(6, np.float32), jpegs, "t", session_nonce=1)))

    sender = threading.Thread(target=send)
    sender.start()
    return sender


def _running_robot(app_key, p1: int, p2: int):
    """A robot client running against the primary on `p1` (also connected to `p2`, the standby), and a
    watcher on `p2` that records (arrival, server_id, seq) of every chunk on the wire."""
    cfg = make_config(p1, app_key, watchdog_timeout_s=0.5)
    cfg.zenoh = ZenohSettings(multicast_scouting=False, connect=[f"tcp/127.0.0.1:{p2}"])
    seen = []
    mon = ZenohSession(loopback_settings(None, listen=False, connect_ports=(p2,))).open()
    mon.subscribe(app_key.client("r1").action, lambda k, b: seen.append(
        (time.monotonic(), (c := codec.decode_action_chunk(b)).server_id, c.response_to_seq_id)))
    client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
    runner = threading.Thread(target=client.run)
    runner.start()
    return client, runner, mon, seen


def test_standby_takes_over_and_steps_back_without_duplicates(app_key):
    p1, p2 = free_port(), free_port()
    primary = PolicyServer(manifest(app_key, p1, "gpu0")).start()
    standby = PolicyServer(manifest(app_key, p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"])).start()
    client, runner, mon, seen = _running_robot(app_key, p1, p2)
    try:
        assert client.serving_server_id == "gpu0"
        assert standby.models[0].role.active.is_set() is False
        assert wait_for(lambda: sum(1 for _, s, _ in seen if s == "gpu0") >= 3, 10)

        empty_before = client.counters.empty_cycles
        t_kill = time.monotonic()
        primary.stop()  # the primary dies
        assert wait_for(lambda: any(s == "gpu1" for _, s, _ in seen), 10), "standby never served"
        last_primary = max(t for t, s, _ in seen if s == "gpu0")
        first_standby = min(t for t, s, _ in seen if s == "gpu1")
        gap_s = first_standby - last_primary
        print(f"failover: last gpu0 chunk -> first gpu1 chunk {gap_s * 1000:.0f} ms; "
              f"primary stopped -> first gpu1 chunk {(first_standby - t_kill) * 1000:.0f} ms; "
              f"empty-buffer cycles meanwhile {client.counters.empty_cycles - empty_before}; "
              f"watchdog {client.counters.watchdog_events} revalidations {client.counters.revalidations}")
        assert standby.models[0].role.takeovers == 1
        assert wait_for(lambda: client.serving_server_id == "gpu1", 5)

        primary = PolicyServer(manifest(app_key, p1, "gpu0")).start()  # the primary comes back
        n_before = len(seen)
        assert wait_for(lambda: any(s == "gpu0" for _, s, _ in seen[n_before:]), 10), "primary never served again"
        assert standby.models[0].role.stepped_back == 1 and not standby.models[0].role.active.is_set()
        # A window of further chunks from the primary, in which a duplicate answer would show.
        n_back = len(seen)
        assert wait_for(lambda: sum(1 for _, s, _ in seen[n_back:] if s == "gpu0") >= 10, 10)
    finally:
        client.stop()
        runner.join(5)
        client.close()
        mon.close()
        standby.stop()
        primary.stop()
    seqs = [q for _, _, q in seen]
    assert len(seqs) == len(set(seqs)), "an observation was answered twice"
    assert client.counters.chunks_received >= len(seen) - 1  # every chunk on the wire reached the client


def test_standby_alone_serves_and_stays_silent_while_primary_is_up(app_key):
    p1, p2 = free_port(), free_port()
    with PolicyServer(manifest(app_key, p1, "gpu0")) as primary, \
            PolicyServer(manifest(app_key, p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"])) as standby, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(p1, p2))) as s:
        assert wait_for(lambda: s.query(app_key.status, 0.3), 10)
        # The standby has seen the primary's token (had the link come up after its start-up check,
        # it served until then and steps back on seeing it).
        assert wait_for(lambda: not standby.models[0].role.active.is_set(), 10)
        replies = s.query(app_key.status, 0.5)
        assert [codec.decode_status(p).server_id for _, p in replies] == ["gpu0"]  # only the primary answers
        tokens = [app_key.server_token("gpu0"), app_key.server_token("gpu1")]
        assert wait_for(lambda: sorted(s.alive(app_key.all_servers)) == tokens, 10)
        assert primary.models[0].role.active.is_set()


def test_standby_for_itself_is_a_config_error(app_key):
    with pytest.raises(ConfigError, match="standby_for"):
        manifest(app_key, 1, "gpu0", standby_for="gpu0")


def test_a_standby_continues_the_robots_motion_from_the_first_rtc_observation_it_serves(app_key):
    """Real-time chunking keeps no state on the server: the standby, which never saw the primary's
    chunks, answers its first observation with a chunk that continues the leftover that observation
    carries, and the client replaces its buffer with it (RTC stays on across the failover)."""
    import numpy as np

    from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig

    p1, p2 = free_port(), free_port()
    primary = PolicyServer(manifest(app_key, p1, "gpu0", rtc=True, chunk_size=60)).start()
    standby = PolicyServer(manifest(app_key, p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"],
                                    rtc=True, chunk_size=60)).start()
    # Ask early (a long buffer) so that the robot still has actions left when the standby answers.
    cfg = make_config(p1, app_key, watchdog_timeout_s=0.3, actions_per_chunk=60,
                      send=SendTriggerConfig(buffer_time_s=1.5, request_timeout_s=0.3))
    cfg.zenoh = ZenohSettings(multicast_scouting=False, connect=[f"tcp/127.0.0.1:{p2}"])
    obs, chunks = {}, []  # seq -> observation; chunks in arrival order
    mon = ZenohSession(loopback_settings(None, listen=False, connect_ports=(p2,))).open()
    mon.subscribe(app_key.client("r1").obs, lambda k, b: obs.setdefault((o := codec.decode_observation(b)).seq_id, o))
    mon.subscribe(app_key.client("r1").action, lambda k, b: chunks.append(codec.decode_action_chunk(b)))
    client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
    runner = threading.Thread(target=client.run)
    runner.start()
    try:
        assert client.rtc_active
        assert wait_for(lambda: sum(1 for c in chunks if c.server_id == "gpu0") >= 3, 10)
        primary.stop()
        assert wait_for(lambda: any(c.server_id == "gpu1" for c in chunks), 10), "standby never served"
        assert wait_for(lambda: client.counters.rtc_chunks >= 5 and client.serving_server_id == "gpu1", 10)
    finally:
        client.stop()
        runner.join(5)
        client.close()
        mon.close()
        standby.stop()
        primary.stop()
    first = next(c for c in chunks if c.server_id == "gpu1")
    rtc = obs[first.response_to_seq_id].rtc
    print(f"standby's first RTC observation: {len(rtc.prefix)} leftover actions, delay {rtc.delay_steps}")
    assert len(rtc.prefix) > rtc.delay_steps > 0  # the robot was mid-motion
    assert first.rtc_delay_steps == rtc.delay_steps
    np.testing.assert_array_equal(first.actions[: rtc.delay_steps], rtc.prefix[: rtc.delay_steps])
    assert client.rtc_active and client.counters.rtc_fallback_chunks == 0
    assert client.counters.rtc_chunks == client.counters.chunks_received


def test_a_serving_loop_that_keeps_failing_is_withdrawn_and_the_standby_serves_within_2_s(app_key):
    """An injected fault in the primary's serving turn: after three in a row it stops being served
    visibly (token and status withdrawn, `failed: 1`), so the hot standby takes over."""

    from lerobot_zenoh.transport.session import OBSERVATION_QOS

    p1, p2 = free_port(), free_port()
    primary = PolicyServer(manifest(app_key, p1, "gpu0")).start()
    standby = PolicyServer(manifest(app_key, p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"])).start()
    seen = []  # (arrival, server_id) of every chunk
    robot = ZenohSession(loopback_settings(None, listen=False, connect_ports=(p1, p2))).open()
    try:
        robot.subscribe(app_key.client("r1").action, lambda k, b: seen.append(
            (time.monotonic(), codec.decode_action_chunk(b).server_id)))
        pub = robot.publisher(app_key.client("r1").obs, OBSERVATION_QOS)
        stop = threading.Event()
        sender = _send_observations(pub, stop)
        assert wait_for(lambda: any(s == "gpu0" for _, s in seen), 10)
        assert wait_for(lambda: not standby.models[0].role.active.is_set(), 10)

        def broken(*args, **kwargs):
            raise RuntimeError("injected fault")

        primary.models[0].session_table.schedule = broken  # every turn of the primary's loop now fails
        t_fault = time.monotonic()
        assert wait_for(lambda: any(s == "gpu1" and t > t_fault for t, s in seen), 2.0), "the standby did not serve within 2 s"
        took = min(t for t, s in seen if s == "gpu1") - t_fault
        print(f"injected fault -> first chunk of the standby: {took * 1000:.0f} ms")
        stop.set()
        sender.join()
        model = primary.models[0]
        figures, _ = primary.telemetry_figures(model)
        assert figures["serving"] == 0 and figures["failed"] == 1 and figures["loop_faults"] >= 3
        assert primary.failed.is_set()  # nothing left to serve: the console script exits 1
        assert app_key.server_token("gpu0") not in robot.alive(app_key.all_servers, timeout_s=0.5)
        assert [codec.decode_status(p).server_id for _, p in robot.query(app_key.status, 0.5)] == ["gpu1"]
    finally:
        robot.close()
        standby.stop()
        primary.stop()


def test_a_frozen_primary_is_taken_over_by_served_work_and_withdraws_when_it_wakes(app_key, tmp_path):
    """SIGSTOP of a real primary process: its token stays (the Zenoh lease is 10 s), but its
    heartbeat of served work stops while the robot waits, so the standby takes over; woken with
    SIGCONT, the primary holds its answers, hears that it was replaced, and withdraws (exit 1).
    No observation is answered twice."""
    import signal
    import subprocess
    import sys

    import yaml

    p1, p2 = free_port(), free_port()
    path = tmp_path / "primary.yaml"
    path.write_text(yaml.safe_dump(manifest_dict(app_key, p1, "gpu0")))
    log_path = tmp_path / "primary.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lerobot_zenoh.cli.server", "--manifest", str(path)],
                                stdout=out, stderr=subprocess.STDOUT)
    standby = client = runner = mon = None
    try:
        assert wait_for(lambda: "ready" in log_path.read_text() or proc.poll() is not None, 90), log_path.read_text()
        standby = PolicyServer(manifest(app_key, p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"])).start()
        client, runner, mon, seen = _running_robot(app_key, p1, p2)
        role = standby.models[0].role
        assert wait_for(lambda: sum(1 for _, s, _ in seen if s == "gpu0") >= 3, 20)
        assert wait_for(lambda: standby.heard_primary() and not role.active.is_set(), 10)

        empty_before = client.counters.empty_cycles
        t_stop = time.monotonic()
        proc.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: any(s == "gpu1" for _, s, _ in seen), 15), "the standby never served"
        took_s = min(t for t, s, _ in seen if s == "gpu1") - t_stop
        assert role.replaced is not None and role.replaced.startswith("gpu0/")  # by served work, not the token
        assert wait_for(lambda: sum(1 for _, s, _ in seen if s == "gpu1") >= 3, 10)
        print(f"SIGSTOP -> first chunk of the standby {took_s * 1000:.0f} ms; empty ticks meanwhile "
              f"{client.counters.empty_cycles - empty_before}")

        proc.send_signal(signal.SIGCONT)  # it wakes: replaced, so it withdraws and exits 1
        assert proc.wait(30) == 1, log_path.read_text()[-3000:]
        n = len(seen)
        assert wait_for(lambda: sum(1 for _, s, _ in seen[n:] if s == "gpu1") >= 5, 10)
        assert role.active.is_set() and role.replaced is not None  # it never stepped back for the replaced one
        assert "replaced by standby gpu1" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
        if client is not None:
            client.stop()
            runner.join(5)
            client.close()
        if mon is not None:
            mon.close()
        if standby is not None:
            standby.stop()
    seqs = [q for _, _, q in seen]
    assert len(seqs) == len(set(seqs)), "an observation was answered twice"


def test_a_stuck_inference_is_taken_over_and_the_stuck_primary_withdraws(app_key):
    """The primary's inference never returns (a hung device): its heartbeats go on, but with work
    waiting and nothing served, the standby takes over; the primary hears it was replaced and
    withdraws; the answer of the stuck batch, when it finally returns, is never published."""

    from lerobot_zenoh.transport.session import OBSERVATION_QOS

    p1, p2 = free_port(), free_port()
    primary = PolicyServer(manifest(app_key, p1, "gpu0")).start()
    standby = PolicyServer(manifest(app_key, p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"])).start()
    seen = []  # (arrival, server_id, seq) of every chunk
    robot = ZenohSession(loopback_settings(None, listen=False, connect_ports=(p1, p2))).open()
    release = threading.Event()
    stop = threading.Event()
    sender = None
    try:
        robot.subscribe(app_key.client("r1").action, lambda k, b: seen.append(
            (time.monotonic(), (c := codec.decode_action_chunk(b)).server_id, c.response_to_seq_id)))
        pub = robot.publisher(app_key.client("r1").obs, OBSERVATION_QOS)
        sender = _send_observations(pub, stop)
        assert wait_for(lambda: any(s == "gpu0" for _, s, _ in seen), 10)
        role = standby.models[0].role
        assert wait_for(lambda: standby.heard_primary() and not role.active.is_set(), 10)
        executor = primary.models[0].adapter
        infer = executor.infer
        executor.infer = lambda requests: (release.wait(30), infer(requests))[1]  # hangs until released
        t_hang = time.monotonic()
        assert wait_for(lambda: any(s == "gpu1" for _, s, _ in seen), 15), "the standby never served"
        print(f"inference hung -> first chunk of the standby: {(min(t for t, s, _ in seen if s == 'gpu1') - t_hang) * 1000:.0f} ms")
        assert role.replaced is not None
        assert wait_for(lambda: primary.models[0].failed is not None, 5)  # replaced: withdrawn
        assert "replaced" in primary.models[0].failed
        release.set()  # the stuck batch returns: its answer is held, not published
        assert wait_for(lambda: primary.models[0].role.answers_held >= 1, 10)
        n = len(seen)
        assert wait_for(lambda: sum(1 for _, s, _ in seen[n:] if s == "gpu1") >= 5, 10)
        assert all(s == "gpu1" for _, s, _ in seen[n:])
    finally:
        release.set()
        stop.set()
        if sender is not None:
            sender.join()
        robot.close()
        standby.stop()
        primary.stop()
    seqs = [q for _, _, q in seen]
    assert len(seqs) == len(set(seqs)), "an observation was answered twice"


def test_a_primary_slow_on_long_batches_is_not_taken_over(app_key):
    """Passes of 1.3 s, longer than the 1 s takeover limit: its heartbeats go on during each pass
    and its slowest turn (3 x 1.3 s) sets the limit, so the standby stays standing by."""

    from lerobot_zenoh.transport.session import OBSERVATION_QOS

    p1, p2 = free_port(), free_port()
    slow = manifest_dict(app_key, p1, "gpu0")
    slow["server"][0]["synthetic"]["latency_ms"] = 1300
    primary = PolicyServer(parse_manifest(slow)).start()
    standby = PolicyServer(manifest(app_key, p2, "gpu1", standby_for="gpu0", connect=[f"tcp/127.0.0.1:{p1}"])).start()
    seen = []
    robot = ZenohSession(loopback_settings(None, listen=False, connect_ports=(p1, p2))).open()
    stop = threading.Event()
    sender = None
    try:
        robot.subscribe(app_key.client("r1").action, lambda k, b: seen.append(codec.decode_action_chunk(b).server_id))
        pub = robot.publisher(app_key.client("r1").obs, OBSERVATION_QOS)
        sender = _send_observations(pub, stop, 0.1)
        assert wait_for(lambda: len(seen) >= 3, 30)
        assert seen == ["gpu0"] * len(seen)
        assert standby.models[0].role.takeovers == 0 and standby.heard_primary()
    finally:
        stop.set()
        if sender is not None:
            sender.join()
        robot.close()
        standby.stop()
        primary.stop()


def test_a_forged_replacement_claim_does_not_withdraw_a_primary_that_did_not_stall(app_key):
    """Anyone who can put on the heartbeat keys (plain mode) can claim to have replaced a primary,
    naming the incarnation its own heartbeat shows. A primary that ran and had nothing waiting, or
    served, ignores the claim and counts it; only one that froze or stalled withdraws."""
    from lerobot_zenoh.server.model.failover import Beat
    from lerobot_zenoh.transport.session import METRICS_QOS

    p1 = free_port()
    with PolicyServer(manifest(app_key, p1, "gpu0")) as primary:
        beats = []
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(p1,))) as forger:
            forger.subscribe(app_key.server_heartbeat("gpu0"), lambda k, b: beats.append(Beat.decode(bytes(b))))
            assert wait_for(lambda: beats, 10), "the primary published no heartbeat"
            forged = Beat("gpu1", "x", True, 0, 0, 0.0, replaces=f"gpu0/{beats[-1].incarnation}")
            pub = forger.publisher(app_key.server_heartbeat("gpu1"), METRICS_QOS)
            pub.put(forged.encode(1, 1.0))
            role = primary.models[0].role
            assert wait_for(lambda: role.replacement_claims_ignored >= 1, 10)
        assert not role.failed and role.active.is_set() and not primary.failed.is_set()
