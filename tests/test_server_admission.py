"""Admission (server/engine/admission.py) and task routing (server/model/routing.py): each observation's header is
read once, whichever stream it came on, and the engine judges and schedules only what was read."""

from __future__ import annotations

import numpy as np

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import pipeline_app
from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation
from lerobot_zenoh.scheduling.request_schedulers import make_scheduler
from lerobot_zenoh.server.engine.admission import read_header
from lerobot_zenoh.server.session_table.table import REPLAYED, SessionTable, SessionTableConfig
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

TASK = "kit"


def obs(seq: int, client: str, mask: int | None = None) -> Observation:
    return Observation(seq, client, np.zeros(4, np.float32), {}, "", ExecutionInfo(seq / 30, 3, 1 / 30),
                       episode_id="e0", session_nonce=1, component_mask=mask)


def test_a_header_less_observation_waits_unannounced_until_its_body_is_read():
    """The engine decodes nothing: what it knows nothing of stays in its slot until the shell has
    the executor decode it (`SessionTable.unread`), then it is judged and scheduled like any other."""
    e = SessionTable(SessionTableConfig(listed=frozenset({"r1", "r2"})), make_scheduler("wait_ratio"))
    e.admit("r1", codec.encode(obs(1, "r1")), 0.0)  # no header
    e.admit("r2", codec.encode(obs(1, "r2")), 0.0, *read_header(codec.encode_observation_header(obs(1, "r2"))))
    batch = e.schedule(0.0)
    assert [s.client_id for s, _ in batch.items] == ["r2"] and e.sessions["r1"].slot is not None
    (slot,) = e.unread()
    slot.observation = codec.decode_observation(slot.payload)
    batch = e.schedule(0.1)
    assert [s.client_id for s, _ in batch.items] == ["r1"]
    snap = e.snapshot()
    assert (snap.headers_read, snap.decoded_on_arrival) == (1, 1)


def test_without_a_header_a_scheduler_that_does_not_rank_costs_no_decode_before_the_pick():
    """Round robin and FIFO never read ExecutionInfo: a header-less observation is announced as it
    lands, decoded only if picked (a superseded one costs nothing), and judged then."""
    e = SessionTable(SessionTableConfig(listed=frozenset({"r1"})), make_scheduler("fifo"))
    for seq in (1, 2, 3):
        e.admit("r1", codec.encode(obs(seq, "r1")), 0.0)
    assert e.unread() == []
    ((session, slot),) = e.schedule(0.0).items
    assert not slot.judged and slot.observation is None
    slot.observation = codec.decode_observation(slot.payload)
    assert e.judge(session, slot) is None and slot.judged
    e.finish([(session, 3, 1.0, 0.0)], ["r1"], 0.1, 0.1)
    e.admit("r1", codec.encode(obs(3, "r1")), 0.2)  # replayed, without a header
    ((session, slot),) = e.schedule(0.2).items
    slot.observation = codec.decode_observation(slot.payload)
    assert e.judge(session, slot)[0] == REPLAYED


def test_each_header_is_read_once_on_a_task_stream_as_on_the_models_own_app(port, app_key, monkeypatch):
    """A model serving a component of a task hears the task's stream and its own app: every
    observation's header is read once (the component-mask filter reads the same verdict the slot
    keeps), those for another component are dropped unread, and all others are admitted."""
    reads = []
    real = codec.decode_observation_header
    monkeypatch.setattr(codec, "decode_observation_header", lambda b: (reads.append(1), real(b))[1])
    m = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "srv0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False}, "telemetry_period_s": 0,
        "server": [{"model_id": "s1", "model_version": "v1", "application_tag": "act-srv",
                    "synthetic": {"state_dim": 4, "action_dim": 4, "chunk_size": 5, "cameras": {}, "latency_ms": 1},
                    "fps": 30, "clients": [{"client_uuid": "kit-r0"}, {"client_uuid": "r1"}],
                    "pipeline": [{"task": TASK, "component": "act", "bit": 0}]}],
    })
    with PolicyServer(m) as server, \
            ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
        app = m.app_key(m.server[0])
        assert wait_for(lambda: session.query(app.status, 0.3))
        stream = session.publisher(pipeline_app(app_key.cluster, app_key.experiment, TASK).client("kit-r0").obs,
                                   OBSERVATION_QOS)
        own = session.publisher(app.client("r1").obs, OBSERVATION_QOS)
        model = server.models[0]

        def heard() -> int:
            return model.session_table.snapshot().total().received + model.for_other_components

        sent = 0
        for seq in range(1, 11):
            for pub, o in ((stream, obs(seq, "kit-r0", mask=0b1)),  # asks this component
                           (stream, obs(100 + seq, "kit-r0", mask=0b10)),  # asks another one
                           (own, obs(seq, "r1"))):  # a plain robot on the model's own app
                pub.put(codec.encode(o), attachment=codec.encode_observation_header(o))
                sent += 1
                assert wait_for(lambda: heard() == sent, 5.0), (heard(), sent)
        assert model.for_other_components == 10
        assert len(reads) == sent  # one header read per observation, never two
        assert wait_for(lambda: server.stats()[app.prefix]["clients"]["r1"]["served"] >= 1, 5.0)
        assert server.stats()[app.prefix]["clients"]["kit-r0"]["served"] >= 1
