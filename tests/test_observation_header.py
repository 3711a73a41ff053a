"""The observation header (protocol.md §5.1.1): golden bytes, hostile bytes, and the server ranking
with wait_ratio from headers alone, decoding only the observations it serves (real Zenoh)."""

from __future__ import annotations

import os
import pathlib
import time
from dataclasses import replace

import numpy as np
import pytest

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation, ObservationHeader
from lerobot_zenoh.scheduling.request_schedulers import make_scheduler
from lerobot_zenoh.server.engine.admission import read_header
from lerobot_zenoh.server.session_table.table import REPLAYED, SessionTable, SessionTableConfig
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

GOLDEN = pathlib.Path(__file__).parent / "golden" / "observation_header_v2.bin"


EXECUTION = ExecutionInfo(1.5, 12, 0.025)


def obs(seq=7, *, episode="ep-3", nonce=42, execution=EXECUTION, client="r1"):
    return Observation(seq, client, np.zeros(4, np.float32), {}, "task", execution, episode_id=episode,
                       session_nonce=nonce)


# -- bytes -------------------------------------------------------------------------------------


def test_golden_bytes():
    """One layout (docs/protocol.md §5.1.1): 56 bytes + the episode id, absent fields zero and unflagged.
    After a deliberate change: LZ_REGEN_GOLDEN=1, a new version byte, and the doc's example."""
    full = replace(obs(), refreshes_seq_id=5, component_mask=0b101)
    header = codec.encode_observation_header(full)
    if os.environ.get("LZ_REGEN_GOLDEN"):
        GOLDEN.write_bytes(header)
    assert header == GOLDEN.read_bytes()
    assert header.hex() == ("027f" "0700000000000000" "2a00000000000000" "000000000000f83f" "0c00000000000000"
                            "9a9999999999993f" "0400" "0500000000000000" "05000000" "65702d33")
    assert codec.decode_observation_header(header) == ObservationHeader(7, "ep-3", 42, EXECUTION, 5, 0b101)
    plain = codec.encode_observation_header(obs())  # the same without a refresh and a mask
    assert plain == header[:1] + b"\x1f" + header[2:44] + bytes(12) + b"ep-3"
    assert codec.decode_observation_header(plain) == ObservationHeader(7, "ep-3", 42, EXECUTION)


@pytest.mark.parametrize("o", [obs(), obs(episode=None, nonce=None, execution=None),
                               obs(execution=ExecutionInfo(actions_buffered=0)), obs(episode="é" * 300, seq=2**64 - 1),
                               replace(obs(), refreshes_seq_id=1), replace(obs(), component_mask=1),
                               replace(obs(), refreshes_seq_id=2**64 - 1, component_mask=2**32 - 1)])
def test_round_trip_and_absent_fields_stay_absent(o):
    h = codec.decode_observation_header(codec.encode_observation_header(o))
    assert (h.seq_id, h.episode_id, h.session_nonce, h.execution, h.refreshes_seq_id, h.component_mask) == (
        o.seq_id, o.episode_id, o.session_nonce, o.execution, o.refreshes_seq_id, o.component_mask)
    assert codec.header_matches(h, o) and (o.refreshes_seq_id is None or not codec.header_matches(h, obs()))


def test_another_version_is_not_read_and_malformed_ones_are_rejected():
    good = codec.encode_observation_header(replace(obs(), refreshes_seq_id=5, component_mask=0b101))
    for other in (b"\x01" + good[1:], b"\x03" + good[1:], b"\x01short"):
        assert codec.decode_observation_header(other) is None  # the server decodes the body instead
    for bad in (b"", good[:20], good[:50], good[:-1], good + b"x", good[:1] + b"\xff" + good[2:],
                good[:1] + b"\x80" + good[2:], good[:-4] + b"\xff\xfe\xfd\xfc",
                good[:52] + bytes(4) + good[56:]):  # a component mask flagged but empty
        with pytest.raises(ProtocolError) as exc:
            codec.decode_observation_header(bad)
        assert exc.value.reason == "bad_header"
    for mask in (0, 2**32):
        with pytest.raises(ProtocolError):
            codec.encode_observation_header(replace(obs(), component_mask=mask))


# -- the session table --------------------------------------------------------------------------------


def session_table():
    return SessionTable(SessionTableConfig(listed=frozenset({"r1", "r2"})), make_scheduler("wait_ratio"))


def unread_decoded(e):
    """What the server's admission does before scheduling: decode the observations it knows nothing of."""
    slots = e.unread()
    for slot in slots:
        try:
            slot.observation = codec.decode_observation(slot.payload)
        except ProtocolError as exc:
            slot.error = exc
    return len(slots)


def test_the_engine_ranks_from_the_header_and_checks_replays_without_decoding():
    e = session_table()
    o = obs(5)
    e.admit("r1", codec.encode(o), 0.0, *read_header(codec.encode_observation_header(o)))
    assert unread_decoded(e) == 0  # the header says it all
    batch = e.schedule(0.0)
    (session, slot), = batch.items
    assert slot.header.execution == o.execution and e.scheduler._tasks["r1"].pending_since_s == 0.0
    e.finish([(session, 5, 1.0, 0.0)], ["r1"], 0.1, 0.1)
    e.admit("r1", codec.encode(o), 1.0, *read_header(codec.encode_observation_header(o)))  # a replay
    assert unread_decoded(e) == 0
    batch = e.schedule(1.0)
    assert batch.items == [] and [r[2] for r in batch.rejected] == [REPLAYED]
    assert (e.headers_read, e.decoded_on_arrival) == (2, 0)


def test_without_a_readable_header_the_engine_decodes_on_arrival_as_before():
    e = session_table()
    o = obs(1)
    e.admit("r1", codec.encode(o), 0.0)  # an older client: no attachment
    e.admit("r2", codec.encode(obs(1, client="r2")), 0.0, *read_header(b"\x09future header"))  # a version it does not read
    assert unread_decoded(e) == 2
    batch = e.schedule(0.0)
    assert len(batch.items) == 1 and (e.headers_read, e.decoded_on_arrival) == (0, 2)
    e.admit("r2", codec.encode(obs(2, client="r2")), 0.5, *read_header(b"\x02short"))
    assert unread_decoded(e) == 0
    batch = e.schedule(0.5)
    assert [r[2] for r in batch.rejected] == ["bad_header"]


# -- the server over real Zenoh ----------------------------------------------------------------


def manifest(port, app_key):
    return parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
                    "synthetic": {"state_dim": 4, "action_dim": 4, "chunk_size": 10, "cameras": {}, "latency_ms": 40},
                    "fps": 30, "scheduler": "wait_ratio", "max_batch_size": 2,
                    "clients": [{"client_uuid": f"r{i}"} for i in range(6)]}],
    })


def test_with_headers_the_server_decodes_only_what_it_serves(port, app_key, monkeypatch):
    """Six robots publish 30 Hz against a 40 ms model (most observations are superseded): every
    observation is ranked from its header; the msgpack decodes are the served ones, plus one
    header that lies about its seq_id, rejected as header_mismatch when it is served."""
    decodes = []
    real_decode = codec.decode_observation
    monkeypatch.setattr(codec, "decode_observation", lambda *a: (decodes.append(1), real_decode(*a))[1])
    with PolicyServer(manifest(port, app_key)) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        chunks = []
        pubs = {}
        for i in range(6):
            key = app_key.client(f"r{i}")
            session.subscribe(key.action, lambda k, b: chunks.append(codec.decode_action_chunk(b)))
            pubs[f"r{i}"] = session.publisher(key.obs, OBSERVATION_QOS)
        assert wait_for(lambda: session.query(app_key.status, 0.3))
        model = server.models[0]
        for seq in range(1, 31):
            for cid, pub in pubs.items():
                o = obs(seq, client=cid, execution=ExecutionInfo(seq * 0.03, 30 - seq, 1 / 30))
                pub.put(codec.encode(o), attachment=codec.encode_observation_header(o))
            time.sleep(1 / 30)  # the robots' control period, not a wait for the server
        o = obs(100, client="r0")
        pubs["r0"].put(codec.encode(o), attachment=codec.encode_observation_header(obs(101, client="r0")))
        assert wait_for(lambda: model.session_table.snapshot().sessions["r0"].stats.rejected.get("header_mismatch") == 1)
        def counts():
            snap = model.session_table.snapshot()
            return snap.total().served, snap.total().received, snap

        # the last pass may still be in flight when the rejection is counted: wait for it to finish
        assert wait_for(lambda: len(decodes) == counts()[0] + 1, 5.0), (len(decodes), counts()[:2])
        served, received, snap = counts()
        assert served >= 6 and received > 2 * served  # most were superseded: those cost no decode
        assert snap.decoded_on_arrival == 0 and snap.headers_read >= served
        assert wait_for(lambda: len(chunks) >= served)
