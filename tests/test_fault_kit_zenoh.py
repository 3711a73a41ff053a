"""The fault kit's Zenoh floods (`testbed.fault_kit.zenoh`) against every subscriber that takes input from
other processes, each beside an honest robot (or an honest server, for the monitor):

- the server's observation subscriber (ids the manifest does not list);
- an edge scheduler's engine answer subscriber;
- the heartbeat subscriber of a hot standby pair;
- status: the robot's status queries (hostile replies beside the real server's) and the monitor's
  telemetry subscriber.

Each payload kind (random bytes, truncated MessagePack, deeply nested MessagePack, a message over
the limit, valid-looking messages with wrong ids) floods for `FLOOD_S` seconds with congestion
control BLOCK, so every put reaches the subscriber and the test checks that every one was counted
and that the honest robot is still served. Nothing here asserts on timing. `LZ_FAULTS_LONG=1`
(`make test-faults-zenoh`) floods at line rate (congestion control DROP) for `LZ_FAULTS_FLOOD_S`
seconds (10 by default) after a control window of the same length with the same robot, and prints
the robot's service in both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from lz_testing import free_port, wait_for
from testbed.fault_kit.zenoh import (PAYLOADS, Flood, FloodProcess, HonestRobot, HostileReplies, Service, forged,
                                     payload)

from lerobot_zenoh.server.model.failover import TAKEOVER_AFTER_S
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer

pytestmark = pytest.mark.slow

LONG = os.environ.get("LZ_FAULTS_LONG") == "1"
FLOOD_S = float(os.environ.get("LZ_FAULTS_FLOOD_S", "10" if LONG else "0.6"))
CAMS = {"front": (48, 64)}
SYN = {"state_dim": 6, "action_dim": 6, "chunk_size": 30, "cameras": CAMS, "latency_ms": 10}


def model(app_key, **extra) -> dict:
    return {"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "synthetic": dict(SYN), "fps": 15, "actions_per_chunk": 6, **extra}  # (a chunk every 0.4 s)


def server_manifest(app_key, port, server_id="gpu0", connect=(), entry=None, **top):
    return parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": server_id,
        "telemetry_period_s": 0,
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "connect": [f"tcp/127.0.0.1:{p}" for p in connect],
                  "multicast_scouting": False},
        "server": [entry or model(app_key, accept_unknown_clients=True)], **top})


def flood(port: int, key: str, kind: str, *, forged_kind: str, limit_bytes: int, key_template: str | None = None):
    """One flood of `FLOOD_S` seconds: on a thread with congestion control BLOCK (every put arrives,
    so counts are exact), or under `LZ_FAULTS_LONG` at line rate from a process of its own."""
    if LONG:
        return FloodProcess(port, key, kind, seconds=FLOOD_S, forged_kind=forged_kind, key_template=key_template,
                            limit_bytes=limit_bytes)
    key_of = (lambda i: key_template.format(i=i)) if key_template else None
    return Flood(port, key, payload(kind, key, forged_kind=forged_kind, limit_bytes=limit_bytes), seconds=FLOOD_S,
                 block=True, key_of=key_of)  # (started by `with`)


def flood_every_kind(port: int, key: str, robot: HonestRobot, counted, *, forged_kind: str, limit_bytes: int,
                     key_template: str | None = None, kinds=PAYLOADS,
                     exact: bool = True) -> dict[str, tuple[int, int, Service]]:
    """Each payload kind flooded on `key` in turn beside `robot`: {kind: (sent, counted, service)}.
    `counted()`: the subscriber's own count of what it refused. `exact`: every put must be counted
    (unless `LONG`: at line rate Zenoh drops what the link cannot carry before it arrives)."""
    out = {}
    control = None
    if LONG:
        robot.window()
        time.sleep(FLOOD_S)  # the control window: the same robot, nothing flooding
        control = robot.service()
    for kind in kinds:
        before = counted()
        robot.window()
        with flood(port, key, kind, forged_kind=forged_kind, limit_bytes=limit_bytes, key_template=key_template) as f:
            f.wait(FLOOD_S + 60)
        service = robot.service()
        assert f.error is None, f.error
        assert f.sent > 0
        if exact and not LONG:
            assert wait_for(lambda: counted() - before >= f.sent, 15), (kind, f.sent, counted() - before)
        out[kind] = (f.sent, counted() - before, service)
        if control is not None:
            print(f"{key.rsplit('/', 2)[-2]}/{key.rsplit('/', 1)[-1]} {kind}: {f.sent} puts in "
                  f"{f.elapsed_s:.1f} s, {counted() - before} counted; {service.beside(control)}")
    robot.window()
    assert wait_for(lambda: robot.service().chunks >= 3, 15), "the honest robot is no longer served"
    return out


# ----------------------------------------------------------------------------- observations


def test_observation_floods_from_unlisted_ids_are_each_counted_and_the_listed_robot_is_served(app_key):
    """Floods on fresh client ids the manifest does not list: each one dropped on arrival and
    counted (`observations_rejected`); the listed robot keeps being served."""
    port = free_port()
    entry = model(app_key, accept_unknown_clients=False, clients=[{"client_uuid": "honest"}])
    server = PolicyServer(server_manifest(app_key, port, entry=entry)).start()
    try:
        served = server.models[0]

        def counted() -> int:
            return server.telemetry_figures(served)[0]["observations_rejected"]

        with HonestRobot(port, app_key) as robot:
            assert wait_for(lambda: robot.client.counters.chunks_received >= 3, 15)
            flood_every_kind(port, app_key.client("x").obs, robot, counted, forged_kind="observation",
                             limit_bytes=served.adapter.limits.max_message_bytes,
                             key_template=app_key.client("intruder{i}").obs)
        figures = server.telemetry_figures(served)[0]
        assert figures.get("rejected.unknown_client", 0) > 0 and server.models[0].failed is None
    finally:
        server.stop()


# ----------------------------------------------------------------------------- engine answers


def engine_manifests(app_key, ports):
    engine = server_manifest(app_key, ports[1], "engine0", entry=model(app_key, accept_unknown_clients=True),
                             role="engine", engine_id="cloud0")
    edge_entry = model(app_key, accept_unknown_clients=True, engines=[
        {"engine_id": "cloud0", "tier": "edge", "capacity": 2, "endpoint": f"tcp/127.0.0.1:{ports[1]}",
         "profile": "measured"}],
        dispatch={"answer_timeout_s": 1.0, "probe_period_s": 0.2, "probes_lost": 3, "start_timeout_s": 5.0})
    return engine, server_manifest(app_key, ports[0], "edge0", entry=edge_entry)


def test_engine_answer_floods_are_dropped_unread_counted_and_the_robot_is_served(app_key):
    """Floods on an engine's answer key (plain mode: anyone can put there): every answer that names
    no request of this scheduler in flight on that engine is dropped in the callback and counted
    (`engine.cloud0.refused.*`, `late`); the robot served through that engine is still served."""
    ports = (free_port(), free_port())
    engine_manifest, edge_manifest = engine_manifests(app_key, ports)
    engine = PolicyServer(engine_manifest).start()
    edge = PolicyServer(edge_manifest).start()
    try:
        dispatcher = edge.models[0].dispatcher

        def counted() -> int:
            figures = dispatcher.figures(fresh=True)
            return (figures["engine.cloud0.refused"] + figures["engine.cloud0.late"]
                    + figures["engine.cloud0.answers_dropped_full"])

        key = dispatcher.engines["cloud0"].keys.answer
        with HonestRobot(ports[0], app_key) as robot:
            assert wait_for(lambda: robot.client.counters.chunks_received >= 3, 15)
            result = flood_every_kind(ports[0], key, robot, counted, forged_kind="answer",
                                      limit_bytes=dispatcher.max_bytes)
            before = counted()
            # What a peer reading the dispatch key can forge: this scheduler's incarnation, made-up ids.
            with Flood(ports[0], key, forged("answer", key, edge_incarnation=dispatcher.table.edge_incarnation),
                       seconds=min(FLOOD_S, 2.0), block=True) as made_up:
                made_up.wait(FLOOD_S + 60)
            assert wait_for(lambda: counted() - before >= made_up.sent, 15)
        figures = dispatcher.figures(fresh=True)
        assert figures["engine.cloud0.answers_dropped_full"] == 0
        assert figures["engine.cloud0.refused.unknown_request"] >= made_up.sent
        if not LONG:  # (at line rate Zenoh drops some puts before they arrive)
            assert figures["engine.cloud0.refused.stale_incarnation"] >= result["wrong_ids"][0]
            assert figures["engine.cloud0.refused.too_large"] >= result["huge"][0]
            assert figures["engine.cloud0.refused.bad_header"] >= sum(result[k][0] for k in ("random", "nested"))
        assert figures["engine.cloud0.answered"] > 0 and edge.models[0].failed is None
    finally:
        edge.stop()
        engine.stop()


# ----------------------------------------------------------------------------- heartbeats


def test_heartbeat_floods_are_counted_and_the_standby_keeps_hearing_its_primary(app_key):
    """Floods on a third server's heartbeat key beside a primary and its standby, a robot served by
    the primary: every beat the standby cannot read is counted (`heartbeats_refused`), and the
    standby never takes over a primary that keeps serving."""
    p1, p2 = free_port(), free_port()
    primary = PolicyServer(server_manifest(app_key, p1, "gpu0", handover_grace_s=0.3)).start()
    standby = PolicyServer(server_manifest(app_key, p2, "gpu1", connect=(p1,), standby_for="gpu0",
                                           handover_grace_s=0.3)).start()
    try:
        role = standby.models[0].role

        def counted() -> int:  # refused, or replaced unread by a newer beat of the same key
            return role.heartbeats_refused + role.heartbeats_superseded

        with HonestRobot(p1, app_key, also_connect=(p2,)) as robot:
            assert wait_for(lambda: robot.client.counters.chunks_received >= 3, 15)
            assert wait_for(lambda: standby._heartbeats.heard_primary(0), 10)
            key = app_key.server_heartbeat("intruder")
            # At line rate for longer than a standby waits before it takes over a silent primary.
            with Flood(p1, key, payload("random", key), seconds=2.5 * TAKEOVER_AFTER_S) as flood:
                flood.wait(60)
            assert role.takeovers == 0 and not role.active.is_set(), f"taken over during a flood of {flood.sent}"
            # (wrong_ids: valid beats of invented servers, read and ignored: not refusals)
            # Counted at the standby, so flooded on its own port: a flood through the primary's reaches
            # the standby only once gossip has linked the flooder to it (puts before that never arrive).
            flood_every_kind(p2, app_key.server_heartbeat("intruder"), robot, counted, forged_kind="beat",
                             limit_bytes=4096, kinds=[k for k in PAYLOADS if k != "wrong_ids"])
            flood_every_kind(p2, app_key.server_heartbeat("intruder"), robot, counted, forged_kind="beat",
                             limit_bytes=4096, kinds=["wrong_ids"], exact=False)
            assert robot.client.serving_server_id == "gpu0"
        assert role.takeovers == 0 and not role.active.is_set()
    finally:
        standby.stop()
        primary.stop()


# ----------------------------------------------------------------------------- status


def test_hostile_status_replies_beside_the_servers_do_not_stop_a_robot_starting(app_key):
    """A hostile queryable on the status key answers every query with junk of each kind (three
    replies each) beside the real server: the robot's discovery skips what it cannot decode, starts
    on the real server's status and is served. (A valid-looking status of another model from such a
    peer is a forgery plain mode cannot tell apart: TLS and access control, docs/security.md.)"""
    port = free_port()
    server = PolicyServer(server_manifest(app_key, port)).start()
    try:
        for kind in [k for k in PAYLOADS if k != "wrong_ids"]:
            with HostileReplies(port, app_key.status, payload(kind, app_key.status, limit_bytes=16 << 20),
                                count=3) as hostile:
                with HonestRobot(port, app_key, client_uuid=f"honest_{kind}") as robot:
                    assert wait_for(lambda: robot.client.counters.chunks_received >= 2, 15), kind
                    assert robot.client.serving_server_id == "gpu0"
                assert hostile.queries >= 1
    finally:
        server.stop()


def test_telemetry_floods_on_the_monitor_are_counted_and_an_honest_server_stays_in_view(app_key):
    """The real monitor (`lerobot-zenoh-monitor --json --prometheus_port`) beside a server
    publishing telemetry ten times a second; each payload kind floods a third server's metrics key.
    The monitor refuses and counts what it cannot read (`messages_rejected{reason}`), stays up and
    answers /metrics, and the honest server's telemetry keeps reaching it."""
    port, http_port = free_port(), free_port()
    server = PolicyServer(server_manifest(app_key, port, telemetry_period_s=0.1)).start()
    monitor = subprocess.Popen(
        [sys.executable, "-m", "lerobot_zenoh.cli.monitor", f"--endpoint=tcp/127.0.0.1:{port}",
         "--zenoh.multicast_scouting=false", "--json=true", f"--prometheus_port={http_port}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    honest_seen = []

    def read_lines() -> None:
        for line in monitor.stdout:
            try:
                if json.loads(line).get("source_id") == "gpu0":
                    honest_seen.append(time.monotonic())
            except ValueError:
                pass

    threading.Thread(target=read_lines, daemon=True).start()

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()

    def rejected() -> int:
        try:
            body = scrape()
        except OSError:
            return -1
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                       if line.startswith("lerobot_zenoh_monitor_messages_rejected_total{")))

    try:
        assert wait_for(lambda: len(honest_seen) >= 3 and rejected() >= 0, 20)
        key = app_key.server_metrics("intruder")
        for kind in PAYLOADS:
            before, seen_before = rejected(), len(honest_seen)
            with flood(port, key, kind, forged_kind="telemetry", limit_bytes=1 << 20) as f:
                f.wait(FLOOD_S + 60)
            assert f.error is None and monitor.poll() is None, kind
            if kind != "wrong_ids":  # (valid telemetry of an invented server is a member, not a refusal)
                assert wait_for(lambda: rejected() > before, 10), kind
            assert wait_for(lambda: len(honest_seen) >= seen_before + 3, 15), f"{kind}: the honest server left the view"
            if LONG:
                print(f"monitor {kind}: {f.sent} puts in {f.elapsed_s:.1f} s, {rejected() - before} rejected, "
                      f"honest telemetry seen {len(honest_seen) - seen_before} in the window (10 a second published)")
        assert 'server="gpu0"' in scrape()
    finally:
        monitor.terminate()
        monitor.wait(10)
        server.stop()
