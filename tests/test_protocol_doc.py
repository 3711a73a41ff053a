"""docs/protocol.md against the codec: a stranger implements from the tables, so their field names,
their order and the lists around them must be what the reference code sends and reads."""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import Topic, parse_key, pipeline_app
from lerobot_zenoh.protocol.messages import (
    ActionChunk,
    ExecutionInfo,
    HistoryFrame,
    Observation,
    Refusal,
    RtcAdvert,
    RtcInputs,
    SameHostAdvert,
    SharedFrames,
    Status,
    Telemetry,
    TextResult,
    Verdict,
)

DOC = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
IMG = codec.encode_jpeg(np.zeros((8, 8, 3), np.uint8), 80)


def section(heading: str) -> str:
    """The text of the section whose heading starts with `heading`, up to the next heading."""
    start = DOC.index(heading)
    rest = DOC[start + len(heading):]
    end = re.search(r"\n#{2,4} ", rest)
    return rest[: end.start()] if end else rest


def table_keys(text: str, first: int = 0) -> list[str]:
    """The backticked names in the first column of the `first`-th table of `text`."""
    tables = re.findall(r"((?:^\|.*\|\n)+)", text, flags=re.M)
    return re.findall(r"^\| `([^`]+)` \|", tables[first], flags=re.M)


def sent_keys(msg) -> list[str]:
    return list(msgpack.unpackb(codec.encode(msg), raw=False))


FULL = {
    "5.1 Observation": Observation(
        7, "r1", np.zeros(2, np.float32), {"front": IMG}, "t", ExecutionInfo(1.0, 2, 0.03), episode_id="e",
        session_nonce=5, history=[HistoryFrame(np.zeros(2, np.float32), {"front": IMG})],
        rtc=RtcInputs(np.zeros((1, 2), np.float32), 0), shared_frames=SharedFrames("lz-1-" + "0" * 32 + "-0", 1,
                                                                                      {"side": (0, 8, 8)}),
        refreshes_seq_id=6, component_mask=1, refusals=True),
    "5.2 ActionChunk": ActionChunk(7, 1.0, np.zeros((2, 2), np.float32), "gpu0", 0.5, 2, 1, "cloud0", "cloud"),
    "5.3 Status": Status("m", "v", {"front": (8, 8)}, 2, 10, {}, "act", 30, "gpu0", 2, ("a", "b"), True, True, 10,
                         True, 2, RtcAdvert(8), SameHostAdvert("p", "t"), "actions", True, True,
                         max_task_tokens=48, task_tokens=52, refusals=True),
    "5.4 Telemetry": Telemetry("server", "gpu0", 1, 1.0, 1.0, {"x": 1}, {"r1": {"y": 2}}, {"l": "v"}),
    "5.5 TextResult": TextResult(7, "next", 1.0, "gpu0", 0.5, partial=True),
    "5.6 Verdict": Verdict(7, "safe", 1.0, 0.9, "gpu0", 0.5),
    "5.7 Refusal": Refusal(7, "task_too_long", "the task is 145 tokens, smolvla reads at most 48", True, "gpu0"),
}


@pytest.mark.parametrize("heading", list(FULL))
def test_each_message_table_lists_every_key_in_the_order_it_is_sent(heading):
    documented = table_keys(section(f"### {heading}"))
    assert documented == sent_keys(FULL[heading]), heading


def test_the_sub_map_tables_hold_their_own_keys_only():
    text = section("### 5.1 Observation")
    execution = re.search(r"\*\*ExecutionInfo\*\*.*?(\n\|.*?)(?:\n\n)", text, flags=re.S).group(1) + "\n"
    rtc = re.search(r"\*\*RtcInputs\*\*.*?(\n\|.*?)(?:\n\n)", text, flags=re.S).group(1) + "\n"
    assert table_keys(execution) == list(msgpack.unpackb(codec.encode(FULL["5.1 Observation"]))["execution"])
    assert table_keys(rtc) == list(msgpack.unpackb(codec.encode(FULL["5.1 Observation"]))["rtc"])


def test_the_envelope_names_every_message_type():
    envelope = section("### 4.1 Envelope")
    row = next(line for line in envelope.splitlines() if line.startswith("| `type` |"))
    named = set(re.findall(r"`([a-z_]+)`", row.split("|")[3]))
    sent = {msgpack.unpackb(codec.encode(m))["type"] for m in FULL.values()}
    assert named == sent and len(sent) == 7
    assert "not one of the seven names" in DOC


def test_the_key_schema_and_its_parser_agree():
    schema = section("### 2.1 Schema")
    topic_row = next(line for line in schema.splitlines() if line.startswith("| `topic` |"))
    assert set(re.findall(r"`([a-z]+)`", topic_row.split("|")[2])) == {t.value for t in Topic}
    parsing = section("### 2.3 Chunk rules")
    for topic in Topic:
        assert f"`{topic.value}`" in parsing.split("Parsing (`parse_key`)")[1]
        assert parse_key(f"c/e/m/v/a/r1/{topic.value}").topic == topic.value
    stream = pipeline_app("c", "e", "kit")
    assert "`<cluster>/<experiment>/_pipeline/1/<task>/<robot>/obs`" in parsing
    assert parse_key(stream.client("r1").obs).client_id == "r1" and stream.prefix == "c/e/_pipeline/1/kit"


def test_what_the_prose_says_of_attachments_and_names():
    overview = section("## 1. Overview")
    assert "No Zenoh encoding, attachment" not in overview and "§5.1.1" in overview
    assert "`refresh_late`" not in DOC  # the counter is `refreshes_late`, whatever drops it
    from lerobot_zenoh.server.session_table.table import REFRESH_LATE

    assert REFRESH_LATE == "refreshes_late"


def test_the_request_seed_is_documented_as_the_executor_computes_it():
    from lerobot_zenoh.server.model.runner_adapter import request_seed

    import zlib

    text = section("### 10.2 Steady state")
    assert "`seed = (crc32(utf8(client id)) << 32) XOR (seq_id mod 2³²)`" in text and "request_seed" in text
    for client, seq in (("r1", 7), ("robot_a4b9", 2**40 + 3)):  # the formula as written
        assert request_seed(client, seq) == (zlib.crc32(client.encode()) << 32) ^ (seq % 2**32)


def test_every_doc_names_the_protocol_version_the_codec_sends():
    from lerobot_zenoh.protocol.codec import PROTOCOL_VERSION

    current = f"[{PROTOCOL_VERSION[0]}, {PROTOCOL_VERSION[1]}]"
    docs = Path(__file__).resolve().parents[1] / "docs"
    for path in docs.glob("*.md"):
        for found in re.findall(r"`protocol_version` (?:\| array \| yes \| — \| )?`(\[\d+, \d+\])`", path.read_text()):
            assert found == current, f"{path.name} says protocol_version {found}, the codec sends {current}"
    assert msgpack.unpackb(codec.encode(FULL["5.4 Telemetry"]))["protocol_version"] == list(PROTOCOL_VERSION)


def test_every_rejection_reason_is_documented_once_and_every_documented_one_exists():
    """The reasons are counter names others read: the enum and the doc's reason tables must agree."""
    from lerobot_zenoh.protocol.reasons import Reason

    tables = [t for t in re.findall(r"((?:^\|.*\|\n)+)", DOC, flags=re.M) if t.startswith("| Reason | Trigger |")]
    rows = [row.split("|")[1] for table in tables for row in table.splitlines()[2:]]
    documented = {name for cell in rows for name in re.findall(r"`([a-z_]+)`", cell)}
    assert documented == {r.value for r in Reason}


def test_output_kinds_and_verdict_labels_are_the_documented_ones():
    from lerobot_zenoh.protocol.reasons import OutputKind, VerdictLabel

    output_row = next(line for line in section("### 5.3 Status").splitlines() if line.startswith("| `output` |"))
    assert set(re.findall(r"`(actions|text|verdict)` \(", output_row)) == {k.value for k in OutputKind}
    label_row = next(line for line in section("### 5.6 Verdict").splitlines() if line.startswith("| `label` |"))
    named = set(re.findall(r"`([a-z]+)`", label_row.split("|")[5])) - {"bad_verdict"}
    assert named == {v.value for v in VerdictLabel}


def test_appendix_a_holds_the_golden_files_byte_for_byte():
    """Appendix A is what an implementer compares against: its sizes, hashes and hex are the files'."""
    import hashlib

    golden = Path(__file__).resolve().parent / "golden"
    appendix = DOC[DOC.index("## Appendix A."):]
    entries = re.findall(r"^### (\S+\.msgpack) \((\d+) bytes, sha256 `([0-9a-f]{64})`\)\n(.*?)(?=^### |\Z)", appendix,
                         flags=re.M | re.S)
    assert sorted(name for name, *_ in entries) == sorted(p.name for p in golden.glob("*.msgpack"))
    for name, size, sha, body in entries:
        data = (golden / name).read_bytes()
        assert (int(size), sha) == (len(data), hashlib.sha256(data).hexdigest()), name
        dump = re.search(r"```\n(.*?)\n```", body, flags=re.S)
        text = dump.group(1) if dump else section("### 9.1").split("```")[1]  # action_chunk: "See §9.1"
        assert bytes.fromhex("".join(line[6:] for line in text.strip().splitlines())) == data, name


def test_the_observation_header_section_shows_the_golden_header():
    text = section("#### 5.1.1 Observation header")
    dump = text.split("```")[1]
    golden = (Path(__file__).resolve().parent / "golden" / "observation_header_v2.bin").read_bytes()
    assert bytes.fromhex(dump.replace("\n", " ")) == golden
    assert f"({len(golden)} bytes;" in text and codec.OBS_HEADER_VERSION == golden[0]


@pytest.mark.parametrize("heading", list(FULL))
def test_each_message_table_marks_required_what_the_schema_requires(heading):
    from lerobot_zenoh.protocol.codec import TABLES

    table = re.findall(r"((?:^\|.*\|\n)+)", section(f"### {heading}"), flags=re.M)[0]
    documented = {row.split("|")[1].strip(" `"): row.split("|")[3].strip().startswith("yes")
                  for row in table.splitlines()[2:]}
    kind = msgpack.unpackb(codec.encode(FULL[heading]))["type"]
    declared = {f.key: f.required for f in TABLES[kind][1].rows} | {"protocol_version": True, "type": True}
    assert documented == declared, heading


def _reason_literals() -> dict[str, str]:
    """Reason names written as string literals where the package counts a refusal: the first
    argument of `ProtocolError`/`VersionError`/`_refuse`, the second of `DecodedTokens`, any
    `reason=` keyword, and `reason = "..."` assignments (the batch decoder's finish reasons)."""
    import ast

    package = Path(__file__).resolve().parents[1] / "lerobot_zenoh"
    found: dict[str, str] = {}
    position = {"ProtocolError": 0, "VersionError": 0, "_refuse": 0, "DecodedTokens": 1}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            values = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                i = position.get(name)
                if i is not None and len(node.args) > i:
                    values.append(node.args[i])
                values += [k.value for k in node.keywords if k.arg == "reason"]
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "reason" for t in node.targets):
                values.append(node.value)
            for v in values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    found.setdefault(v.value, f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_every_reason_the_code_writes_as_a_string_is_a_documented_member():
    """A refusal counted under a literal (e.g. pi0-FAST's `decode_limit`) is a counter name too: it must
    be a `Reason` member, and so (by the test above) a row of §8."""
    from lerobot_zenoh.protocol.reasons import Reason

    # The batch decoder's normal finish ("end": the end-of-action token) is no refusal.
    literals = {k: v for k, v in _reason_literals().items() if k != "end"}
    assert {"decode_limit", "undecodable_action_tokens"} <= set(literals)  # the scan sees them
    assert (Reason.DECODE_LIMIT, Reason.UNDECODABLE_ACTION_TOKENS) == ("decode_limit", "undecodable_action_tokens")
    unknown = {k: v for k, v in literals.items() if k not in {r.value for r in Reason}}
    assert not unknown, f"reasons counted but not in the Reason enum (nor in docs/protocol.md §8): {unknown}"


def test_appendix_a_captions_name_the_version_their_bytes_carry():
    """Appendix A's prose names a protocol version only where it is the one the golden files and the
    codec carry (its captions once said 1.3 over 1.4 bytes)."""
    from lerobot_zenoh.protocol.codec import PROTOCOL_VERSION

    current = "{}.{}".format(*PROTOCOL_VERSION)
    golden = Path(__file__).resolve().parent / "golden"
    for path in golden.glob("*.msgpack"):
        assert msgpack.unpackb(path.read_bytes())["protocol_version"] == list(PROTOCOL_VERSION), path.name
    appendix = DOC[DOC.index("## Appendix A."):]
    prose = re.sub(r"```.*?```", "", appendix, flags=re.S)
    named = re.findall(r"(?:[Pp]rotocol |^)(\d+\.\d+)\b", prose, flags=re.M)
    named += ["{}.{}".format(*map(int, v)) for v in re.findall(r"fixarray\(2\) `\[(\d+), (\d+)\]`", prose)]
    assert named and set(named) == {current}, f"Appendix A names {sorted(set(named))}, the codec sends {current}"
    assert DOC.startswith(f"# lerobot-zenoh wire protocol, version {current}\n")
