"""Every wire change is versioned: each message's fields, which of them are required and the minor
version that set them (`since`) are kept in a golden file, so a change to any of them without a
version change fails here (docs/protocol.md §4.2), and a message older than its `since` is told
apart by its version: refused as `unsupported_version`, not as a field a broken peer left out.

After a deliberate wire change: bump `PROTOCOL_VERSION`, set `since` on every table whose required
fields changed, then `LZ_REGEN_GOLDEN=1 pytest tests/test_wire_versions.py`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest

from lerobot_zenoh.errors import VersionError
from lerobot_zenoh.protocol import codec, dispatch, schema
from lerobot_zenoh.protocol.dispatch import EngineAnswer, EngineRequest, EngineStatus
from lerobot_zenoh.protocol.messages import PROTOCOL_VERSION
from lerobot_zenoh.protocol.reasons import Reason

GOLDEN = Path(__file__).parent / "golden" / "wire_tables.json"


def _fields(record: schema.Record, prefix: str = "") -> dict[str, bool]:
    """Every field of a record and of the records inside it (by dotted path) -> whether required."""
    out = {}
    for row in record.rows:
        path = f"{prefix}{row.key}"
        out[path] = row.required
        inner = row.type
        while isinstance(inner, schema.ListOf | schema.MapOf):  # a list or map of records
            inner = inner.items if isinstance(inner, schema.ListOf) else inner.values
        if isinstance(inner, schema.Record):
            out.update(_fields(inner, f"{path}."))
    return out


def wire_tables() -> dict:
    tables = {}
    for family, declared in (("robot", codec.TABLES), ("engine", dispatch.TABLES)):
        for kind, (_, record) in declared.items():
            fields = _fields(record)
            tables[f"{family}/{kind}"] = {
                "since": f"{PROTOCOL_VERSION[0]}.{record.since}",
                "required": sorted(k for k, req in fields.items() if req),
                "optional": sorted(k for k, req in fields.items() if not req),
            }
    return {"protocol_version": f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}", "messages": tables}


def test_no_message_changes_without_a_version_change():
    now = wire_tables()
    if os.environ.get("LZ_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    for name, table in now["messages"].items():
        assert int(table["since"].split(".")[1]) <= PROTOCOL_VERSION[1], f"{name}: since is newer than the protocol"
        was = golden["messages"].get(name)
        if was is None:
            assert now["protocol_version"] != golden["protocol_version"], (
                f"{name} is a new message type: bump PROTOCOL_VERSION, then regenerate the golden file")
            continue
        if table["required"] != was["required"]:
            assert table["since"] != was["since"], (
                f"{name}: its required fields changed ({sorted(set(was['required']) ^ set(table['required']))}) "
                "without a version change: bump PROTOCOL_VERSION and set the table's `since` to it")
        if table != was:
            assert now["protocol_version"] != golden["protocol_version"], (
                f"{name}: its fields changed without a version change: bump PROTOCOL_VERSION")
    assert now == golden, f"the wire tables changed with the version: regenerate {GOLDEN.name} (LZ_REGEN_GOLDEN=1)"


def test_the_engine_messages_required_fields_are_those_of_1_5():
    assert {name: t["since"] for name, t in wire_tables()["messages"].items() if name.startswith("engine/")} == {
        "engine/engine_request": "1.5", "engine/engine_answer": "1.5", "engine/engine_status": "1.5"}


def _as_version(payload: bytes, minor: int) -> bytes:
    raw = msgpack.unpackb(payload, raw=False)
    raw["protocol_version"] = [1, minor]
    return msgpack.packb(raw, use_bin_type=True)


REQUEST = EngineRequest(7, "robot_1", "m", "v1", b"obs", 3, "edge-A", 12, session_nonce=9)
ANSWER = EngineAnswer(7, "cloud0", "eng-1", "m", "v1", "edge-A", "robot_1", 12, 9,
                      actions=np.zeros((2, 3), np.float32), inference_ms=5.0)
STATUS = EngineStatus("cloud0", "eng-1", "m", "v1", "synthetic", 3, 2, 4, {1: 5.0})


@pytest.mark.parametrize("message", [REQUEST, ANSWER, STATUS], ids=lambda m: type(m).__name__)
def test_an_engine_message_of_1_4_is_refused_by_its_version_whatever_fields_it_has(message):
    current = dispatch.encode(message)
    for minor in (5, 7):  # its own version and any later minor read as before
        assert dispatch.encode(dispatch.decode(_as_version(current, minor))) == current
    for minor in (4, 0):
        with pytest.raises(VersionError, match=rf"of protocol 1\.{minor}: its fields are those of 1\.5") as raised:
            dispatch.decode(_as_version(current, minor))
        assert raised.value.reason == Reason.UNSUPPORTED_VERSION
    # An older engine's answer lacked the binding fields: its version, not a missing field, says why.
    raw = msgpack.unpackb(current, raw=False)
    old = {k: v for k, v in raw.items() if k not in ("edge_incarnation", "client_id", "seq_id")} | {
        "protocol_version": [1, 4]}
    with pytest.raises(VersionError):
        dispatch.decode(msgpack.packb(old, use_bin_type=True))


def test_a_refusal_is_a_1_5_message_and_the_robot_messages_read_at_any_1_x():
    refusal = msgpack.unpackb(open(Path(__file__).parent / "golden" / "refusal_v1.msgpack", "rb").read(), raw=False)
    refusal["protocol_version"] = [1, 4]
    with pytest.raises(VersionError):
        codec.decode(msgpack.packb(refusal, use_bin_type=True))
    for name in ("observation_v1", "action_chunk_v1", "status_v1", "telemetry_v1"):
        raw = msgpack.unpackb((Path(__file__).parent / "golden" / f"{name}.msgpack").read_bytes(), raw=False)
        raw["protocol_version"] = [1, 0]
        codec.decode(msgpack.packb(raw, use_bin_type=True))
