"""The edge scheduler <-> engine messages and keys (docs/protocol.md, "Engines").

An edge scheduler (`server/dispatch.py`) hands a request it placed on another engine process as an
`EngineRequest` on that engine's own dispatch key; the engine (`server/engine_worker.py`) answers
on its answer key with an `EngineAnswer`; the scheduler relays the chunk to the robot. An engine's
`EngineStatus` (its queryable, also the scheduler's round-trip probe) says what it serves and its
batch-latency profile. Keys, under the model's app prefix::

    <app>/engine/<engine_id>/dispatch     EngineRequest   scheduler -> engine   reliable
    <app>/engine/<engine_id>/answer       EngineAnswer    engine -> scheduler   reliable
    <app>/engine/<engine_id>/status       EngineStatus    queryable (the scheduler's probe)
    <app>/engine/<engine_id>              liveliness token of the engine

Same MessagePack conventions as the robot protocol (`protocol/codec.py`): a map with
`protocol_version` and `type`, arrays as {dtype, shape, data}. Decoding raises only ProtocolError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from lerobot_zenoh.errors import ProtocolError, VersionError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey, validate_chunk
from lerobot_zenoh.protocol.messages import PROTOCOL_VERSION

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


def all_engine_keys(app: AppKey) -> str:
    """Every key of every engine of `app` (the ACL's engine subtree)."""
    return f"{app.prefix}/{ENGINE}/**"


@dataclass(frozen=True)
class EngineRequest:
    """Scheduler -> engine: one request to run, with everything the runner needs.

    `observation` is the robot's Observation bytes as the scheduler received them (its RTC prefix and
    delay, its history frames and its task travel inside); `seed` is the sampling seed the scheduler
    chose (`executor.request_seed`), so an answer does not depend on which engine ran it; `reset`
    asks the engine to drop the client's per-episode runner state first. `model_id`/`model_version`
    name what the scheduler serves: an engine loading something else refuses (`wrong_model`)."""

    request_id: int
    client_id: str
    model_id: str
    model_version: str
    observation: bytes
    seed: int
    reset: bool = False


@dataclass(frozen=True)
class EngineAnswer:
    """Engine -> scheduler: the result of one `EngineRequest`, or why there is none (`error`).

    `inference_ms` is the engine's forward pass of the batch the request ran in (`batch_size`),
    `queue_ms` how long it waited at the engine before it; the scheduler subtracts both from its
    dispatch-to-answer time to measure the network. `incarnation` changes when the engine restarts."""

    request_id: int
    engine_id: str
    incarnation: str
    model_id: str
    model_version: str
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


def _head(kind: str) -> dict[str, Any]:
    return {"protocol_version": list(PROTOCOL_VERSION), "type": kind}


def encode(msg: EngineRequest | EngineAnswer | EngineStatus) -> bytes:
    if isinstance(msg, EngineRequest):
        d = _head(ENGINE_REQUEST) | {"request_id": int(msg.request_id), "client_id": msg.client_id,
                                     "model_id": msg.model_id, "model_version": msg.model_version,
                                     "observation": bytes(msg.observation), "seed": int(msg.seed),
                                     "reset": bool(msg.reset)}
    elif isinstance(msg, EngineAnswer):
        d = _head(ENGINE_ANSWER) | {"request_id": int(msg.request_id), "engine_id": msg.engine_id,
                                    "incarnation": msg.incarnation, "model_id": msg.model_id,
                                    "model_version": msg.model_version, "inference_ms": float(msg.inference_ms),
                                    "queue_ms": float(msg.queue_ms), "batch_size": int(msg.batch_size),
                                    "detail": msg.detail}
        if msg.actions is not None:
            d["actions"] = codec.pack_array(np.asarray(msg.actions))
        if msg.refinement_updates is not None:
            d["refinement_updates"] = codec.pack_array(np.asarray(msg.refinement_updates))
        if msg.rtc_delay_steps is not None:
            d["rtc_delay_steps"] = int(msg.rtc_delay_steps)
        if msg.error is not None:
            d["error"] = msg.error
    elif isinstance(msg, EngineStatus):
        d = _head(ENGINE_STATUS) | {"engine_id": msg.engine_id, "incarnation": msg.incarnation,
                                    "model_id": msg.model_id, "model_version": msg.model_version,
                                    "policy_type": msg.policy_type, "action_dim": int(msg.action_dim),
                                    "chunk_size": int(msg.chunk_size), "capacity": int(msg.capacity),
                                    "profile_ms": {str(int(b)): float(t) for b, t in msg.profile_ms.items()}}
    else:
        raise TypeError(f"not an engine message: {type(msg).__name__}")
    return msgpack.packb(d, use_bin_type=True)


def decode(data: bytes, limits: codec.CodecLimits = codec.DEFAULT_LIMITS) -> EngineRequest | EngineAnswer | EngineStatus:
    """Bytes -> engine message; only ever raises ProtocolError."""
    try:
        return _decode(data, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # whatever a hostile byte string does, it is a protocol error
        raise ProtocolError("malformed", f"{type(exc).__name__}: {exc}") from exc


def _decode(data: bytes, limits: codec.CodecLimits):
    if len(data) > limits.max_message_bytes:
        raise ProtocolError("too_large", f"{len(data)} B > limit {limits.max_message_bytes} B")
    d = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, ext_hook=codec._reject_ext,
                        max_bin_len=limits.max_message_bytes, max_str_len=limits.max_str_bytes,
                        max_array_len=limits.max_container_len, max_map_len=limits.max_container_len)
    if not isinstance(d, dict):
        raise ProtocolError("bad_msgpack", "top level must be a map")
    version = d.get("protocol_version")
    if not (isinstance(version, list) and len(version) == 2 and all(type(v) is int for v in version)):
        raise ProtocolError("missing_version", "protocol_version must be [major, minor]")
    if version[0] != PROTOCOL_VERSION[0]:
        raise VersionError("unsupported_version", f"engine message is protocol {version[0]}.{version[1]}")
    kind = d.get("type")
    req, opt = codec._require, codec._optional
    if kind == ENGINE_REQUEST:
        return EngineRequest(request_id=codec._uint(d, "request_id"), client_id=req(d, "client_id", str),
                             model_id=req(d, "model_id", str), model_version=req(d, "model_version", str),
                             observation=req(d, "observation", bytes), seed=codec._uint(d, "seed"),
                             reset=bool(opt(d, "reset", bool)))
    if kind == ENGINE_ANSWER:
        actions = d.get("actions")
        updates = d.get("refinement_updates")
        return EngineAnswer(
            request_id=codec._uint(d, "request_id"), engine_id=req(d, "engine_id", str),
            incarnation=req(d, "incarnation", str), model_id=req(d, "model_id", str),
            model_version=req(d, "model_version", str),
            actions=None if actions is None else codec.unpack_array(actions, "actions", limits),
            refinement_updates=None if updates is None else codec.unpack_array(updates, "refinement_updates", limits),
            rtc_delay_steps=codec._uint(d, "rtc_delay_steps", required=False),
            inference_ms=req(d, "inference_ms", (int, float)), queue_ms=req(d, "queue_ms", (int, float)),
            batch_size=codec._uint(d, "batch_size"), error=opt(d, "error", str), detail=opt(d, "detail", str) or "")
    if kind == ENGINE_STATUS:
        profile = codec._str_map("profile_ms", req(d, "profile_ms", dict), (int, float))
        return EngineStatus(
            engine_id=req(d, "engine_id", str), incarnation=req(d, "incarnation", str),
            model_id=req(d, "model_id", str), model_version=req(d, "model_version", str),
            policy_type=req(d, "policy_type", str), action_dim=codec._uint(d, "action_dim"),
            chunk_size=codec._uint(d, "chunk_size"), capacity=codec._uint(d, "capacity"),
            profile_ms={int(b): float(t) for b, t in profile.items()})
    raise ProtocolError("unknown_type", repr(kind)[:64])
