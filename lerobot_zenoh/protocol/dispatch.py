"""The edge scheduler <-> engine messages and keys (docs/protocol.md, "Engines").

An edge scheduler (`server/dispatch/dispatcher.py`) hands a request it placed on another engine process as an
`EngineRequest` on that engine's own dispatch key; the engine (`server/shell/engine_worker.py`) answers
on its answer key with an `EngineAnswer`; the scheduler relays the chunk to the robot. An engine's
`EngineStatus` (its queryable, also the scheduler's round-trip probe) says what it serves and its
batch-latency profile. Keys, under the model's app prefix::

    <app>/engine/<engine_id>/dispatch     EngineRequest   scheduler -> engine   reliable
    <app>/engine/<engine_id>/answer       EngineAnswer    engine -> scheduler   reliable
    <app>/engine/<engine_id>/status       EngineStatus    queryable (the scheduler's probe)
    <app>/engine/<engine_id>              liveliness token of the engine

Same MessagePack conventions as the robot protocol (`protocol/codec.py`): a map with
`protocol_version` and `type`, arrays as {dtype, shape, data}, the fields declared in one table per
message (`TABLES`, as `protocol/schema.py` declares the robot's). Decoding raises only ProtocolError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec, schema
from lerobot_zenoh.protocol.keys import AppKey, validate_chunk
from lerobot_zenoh.protocol.reasons import Reason

ENGINE = "engine"

ENGINE_REQUEST = "engine_request"
ENGINE_ANSWER = "engine_answer"
ENGINE_STATUS = "engine_status"


@dataclass(frozen=True)
class EngineKeys:
    """The keys of one engine of one app."""

    app: AppKey
    engine_id: str

    def __post_init__(self) -> None:
        validate_chunk("engine_id", self.engine_id)

    @property
    def token(self) -> str:
        return f"{self.app.prefix}/{ENGINE}/{self.engine_id}"

    @property
    def dispatch(self) -> str:
        return f"{self.token}/dispatch"

    @property
    def answer(self) -> str:
        return f"{self.token}/answer"

    @property
    def status(self) -> str:
        return f"{self.token}/status"


@dataclass(frozen=True)
class EngineRequest:
    """Scheduler -> engine: one request to run, with everything the runner needs.

    `observation` is the robot's Observation bytes as the scheduler received them (its RTC prefix and
    delay, its history frames and its task travel inside); `seed` is the sampling seed the scheduler
    chose (`runner_adapter.request_seed`), so an answer does not depend on which engine ran it; `reset`
    asks the engine to drop the client's per-episode runner state first. `model_id`/`model_version`
    name what the scheduler serves: an engine loading something else refuses (`wrong_model`).

    `edge_incarnation` (new at every start of the scheduler's process), `client_id`, `session_nonce`
    and `seq_id` name exactly which robot request this is; the engine echoes them in its answer and
    the scheduler delivers an answer only to the outstanding request they name (`request_id` alone
    restarts at 1 in every scheduler process)."""

    request_id: int
    client_id: str
    model_id: str
    model_version: str
    observation: bytes
    seed: int
    edge_incarnation: str
    seq_id: int
    session_nonce: int | None = None
    reset: bool = False


@dataclass(frozen=True)
class EngineAnswer:
    """Engine -> scheduler: the result of one `EngineRequest`, or why there is none (`error`).

    `inference_ms` is the engine's forward pass of the batch the request ran in (`batch_size`),
    `queue_ms` how long it waited at the engine before it; the scheduler subtracts both from its
    dispatch-to-answer time to measure the network. `incarnation` changes when the engine restarts.
    `edge_incarnation`, `client_id`, `session_nonce` and `seq_id` are the request's, echoed."""

    request_id: int
    engine_id: str
    incarnation: str
    model_id: str
    model_version: str
    edge_incarnation: str
    client_id: str
    seq_id: int
    session_nonce: int | None = None
    actions: np.ndarray | None = None
    refinement_updates: np.ndarray | None = None
    rtc_delay_steps: int | None = None
    inference_ms: float = 0.0
    queue_ms: float = 0.0
    batch_size: int = 1
    error: str | None = None  # a rejection reason (e.g. wrong_model, bad_observation, inference_error)
    detail: str = ""


@dataclass(frozen=True)
class EngineStatus:
    """What an engine serves and how fast (its answer to a status query)."""

    engine_id: str
    incarnation: str
    model_id: str
    model_version: str
    policy_type: str
    action_dim: int
    chunk_size: int
    capacity: int  # most requests it runs in one pass
    profile_ms: dict[int, float] = field(default_factory=dict)  # measured at its start-up: {batch size: ms}


class ProfilePoints(schema.WireType):
    """`EngineStatus.profile_ms`: batch size (a decimal string on the wire) -> ms per pass."""

    what = "a map of decimal batch sizes to numbers"

    def encode(self, value: Any) -> dict:
        return {str(int(b)): float(t) for b, t in value.items()}

    def decode(self, value: Any, name: str, limits: codec.CodecLimits) -> dict[int, float]:
        out = {}
        for b, t in schema.MapOf(schema.NUMBER).decode(value, name, limits).items():
            if not b.isdecimal():
                raise ProtocolError(Reason.BAD_FIELD, f"{name} key {b!r} is not a batch size"[:200])
            out[int(b)] = t
        return out


STR, UINT64, NUMBER, BOOL = schema.STR, schema.UINT64, schema.NUMBER, schema.BOOL
Field = schema.Field

#: The engine messages' required fields are those of protocol 1.5, which made a request's binding
#: (`edge_incarnation`, `client_id`, `seq_id`) required: an engine or scheduler of 1.4 is refused as
#: `unsupported_version`, counted by reason, rather than as a `missing_field` of a broken peer.
BINDING_SINCE = 5

#: The wire tables of the engine messages (docs/protocol.md §11), as `protocol/schema.py` declares the robot's.
TABLES: dict[str, tuple[type, schema.Record]] = {
    ENGINE_REQUEST: (EngineRequest, schema.Record(EngineRequest, [
        Field("request_id", UINT64, required=True),
        Field("client_id", STR, required=True),
        Field("model_id", STR, required=True),
        Field("model_version", STR, required=True),
        Field("observation", schema.Bin(), required=True),
        Field("seed", UINT64, required=True),
        Field("edge_incarnation", STR, required=True),
        Field("seq_id", UINT64, required=True),
        Field("session_nonce", UINT64),
        Field("reset", BOOL),
    ], since=BINDING_SINCE)),
    ENGINE_ANSWER: (EngineAnswer, schema.Record(EngineAnswer, [
        Field("request_id", UINT64, required=True),
        Field("engine_id", STR, required=True),
        Field("incarnation", STR, required=True),
        Field("model_id", STR, required=True),
        Field("model_version", STR, required=True),
        Field("edge_incarnation", STR, required=True),
        Field("client_id", STR, required=True),
        Field("seq_id", UINT64, required=True),
        Field("session_nonce", UINT64),
        Field("inference_ms", NUMBER, required=True),
        Field("queue_ms", NUMBER, required=True),
        Field("batch_size", UINT64, required=True),
        Field("detail", STR),
        Field("actions", schema.NdArray()),
        Field("refinement_updates", schema.NdArray()),
        Field("rtc_delay_steps", UINT64),
        Field("error", STR),
    ], since=BINDING_SINCE)),
    ENGINE_STATUS: (EngineStatus, schema.Record(EngineStatus, [
        Field("engine_id", STR, required=True),
        Field("incarnation", STR, required=True),
        Field("model_id", STR, required=True),
        Field("model_version", STR, required=True),
        Field("policy_type", STR, required=True),
        Field("action_dim", UINT64, required=True),
        Field("chunk_size", UINT64, required=True),
        Field("capacity", UINT64, required=True),
        Field("profile_ms", ProfilePoints(), required=True),
    ], since=BINDING_SINCE)),
}
_KIND_OF = {cls: (kind, table) for kind, (cls, table) in TABLES.items()}


def encode(msg: EngineRequest | EngineAnswer | EngineStatus) -> bytes:
    try:
        kind, table = _KIND_OF[type(msg)]
    except KeyError:
        raise TypeError(f"not an engine message: {type(msg).__name__}") from None
    return codec.encode_map(kind, table, msg)


def decode(data: bytes, limits: codec.CodecLimits = codec.DEFAULT_LIMITS) -> EngineRequest | EngineAnswer | EngineStatus:
    """Bytes -> engine message; only ever raises ProtocolError."""
    return codec.decode_map(data, TABLES, None, limits)


@dataclass(frozen=True)
class AnswerHeader:
    """What an engine answer names, read without decoding it (`answer_header`)."""

    request_id: int
    engine_id: str
    edge_incarnation: str
    is_answer: bool  # its `type` is engine_answer


_HEADER_NAMES = frozenset({"type", "request_id", "engine_id", "edge_incarnation"})
#: An answer's map holds the envelope and its table's fields; twice as many leaves room for fields a
#: later minor version adds (the decoder ignores those), more is not an answer.
_ANSWER_ENTRIES = 2 * (2 + len(TABLES[ENGINE_ANSWER][1].rows))


def answer_header(data: bytes) -> AnswerHeader | None:
    """The request, engine and scheduler process an engine answer names, read in place
    (`codec.header_fields`: the map's keys walked, every other value skipped unread), so a
    scheduler's Zenoh callback can drop an answer to no request of its own before it is queued.
    None when those fields cannot be read (not a map, truncated, missing, of another type)."""
    fields = codec.header_fields(data, _HEADER_NAMES, _ANSWER_ENTRIES)
    if fields is None:
        return None
    request_id, engine_id, incarnation = (fields.get(k) for k in ("request_id", "engine_id", "edge_incarnation"))
    if type(request_id) is not int or type(engine_id) is not str or type(incarnation) is not str:
        return None
    return AnswerHeader(request_id, engine_id, incarnation, fields.get("type") == ENGINE_ANSWER)
