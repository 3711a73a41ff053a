"""The names the protocol gives to rejections and to what a server answers.

Each `Reason` is the `reason` of a `ProtocolError`, the key of a per-reason counter
(`rejected.<reason>` in telemetry, the `reason` label in Prometheus) and a row of docs/protocol.md
§8.2 (or §7.1, §8.3); `tests/test_protocol_doc.py` keeps the enum and the doc's tables equal. They are
`StrEnum`s, so a member *is* its string: it compares, hashes, formats and serializes as the name on
the wire and in metrics.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a message (or an answer to one) was refused. Documented in docs/protocol.md §8."""

    # -- the codec (protocol/codec.py): bytes that are not a valid message
    NOT_BYTES = "not_bytes"
    TOO_LARGE = "too_large"
    BAD_MSGPACK = "bad_msgpack"
    TOO_DEEP = "too_deep"
    MISSING_VERSION = "missing_version"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    WRONG_TYPE = "wrong_type"
    MISSING_FIELD = "missing_field"
    BAD_FIELD = "bad_field"
    BAD_ARRAY = "bad_array"
    BAD_DTYPE = "bad_dtype"
    BAD_SHAPE = "bad_shape"
    SIZE_MISMATCH = "size_mismatch"
    BAD_STATE = "bad_state"
    BAD_ACTIONS = "bad_actions"
    BAD_HISTORY = "bad_history"
    BAD_RTC_PREFIX = "bad_rtc_prefix"
    BAD_RTC_DELAY = "bad_rtc_delay"
    BAD_SHARED_FRAMES = "bad_shared_frames"
    BAD_VERDICT = "bad_verdict"
    MALFORMED = "malformed"
    BAD_JPEG = "bad_jpeg"
    WRONG_IMAGE_SHAPE = "wrong_image_shape"
    BAD_IMAGE = "bad_image"  # the encoder's: an image it cannot make a JPEG of
    BAD_HEADER = "bad_header"
    # -- the server's checks of a decoded observation
    CLIENT_MISMATCH = "client_mismatch"
    WRONG_STATE_DIM = "wrong_state_dim"
    WRONG_CAMERAS = "wrong_cameras"
    SHM_GONE = "shm_gone"
    SHM_UNREADABLE = "shm_unreadable"
    SHM_TRUNCATED = "shm_truncated"
    SHM_STALE = "shm_stale"
    TASK_TOO_LONG = "task_too_long"
    PROMPT_TOO_LONG = "prompt_too_long"
    TEXT_OVER_TOKEN_LIMIT = "text_over_token_limit"
    COMPONENT_NOT_SERVED = "component_not_served"
    REPLAYED = "replayed"
    NONCE_REQUIRED = "nonce_required"
    SEQ_JUMP = "seq_jump"
    HEADER_MISMATCH = "header_mismatch"
    INFERENCE_ERROR = "inference_error"
    PUBLISH_ERROR = "publish_error"
    WRONG_MODEL = "wrong_model"  # an engine asked for another model (docs/protocol.md §11)
    ENGINE_ERROR = "engine_error"  # an engine answered an error the protocol does not name (§11)
    # -- an autoregressive runner's (pi0-FAST) decode that yields no chunk
    DECODE_LIMIT = "decode_limit"  # no end-of-action token within max_decoding_steps
    UNDECODABLE_ACTION_TOKENS = "undecodable_action_tokens"  # tokens that are no valid FAST action sequence
    # -- dropped in the server's Zenoh callback, never decoded
    UNKNOWN_CLIENT = "unknown_client"
    TOO_MANY_CLIENTS = "too_many_clients"
    RATE_LIMITED = "rate_limited"
    CLIENT_ID_TOO_LONG = "client_id_too_long"  # the key's client id is over MAX_CLIENT_ID_BYTES (protocol/keys.py)
    # -- a server's refusals of another server's heartbeat of served work (server/model/failover.py)
    NOT_A_HEARTBEAT = "not_a_heartbeat"  # telemetry of something other than a server
    HEARTBEAT_IDENTITY = "heartbeat_identity"  # its source_id is not the server id of the key it came on
    HEARTBEAT_OUT_OF_RANGE = "heartbeat_out_of_range"  # a count or turn time not finite, negative, or too large
    HEARTBEAT_KEY = "heartbeat_key"  # a key that is no server's heartbeat key
    HEARTBEAT_SENDERS = "heartbeat_senders"  # more senders between two heartbeat ticks than a server keeps
    # -- the client's refusals of an answer
    ACTION_SHAPE = "action_shape"
    NON_FINITE = "non_finite"
    UNKNOWN_SEQ = "unknown_seq"
    SUPERSEDED = "superseded"


#: Refusals that every request like the refused one gets again, whatever the server's load: the
#: client's configuration (its task, its cameras, its state) is what the model cannot take. A client
#: told one of these (`Refusal.permanent`, docs/protocol.md §5.7) stops and says why; any other refusal
#: (a cool-down, a busy engine, a replay) concerns that request only.
REPEATING_REASONS: frozenset[str] = frozenset({
    Reason.TASK_TOO_LONG, Reason.PROMPT_TOO_LONG, Reason.TEXT_OVER_TOKEN_LIMIT, Reason.WRONG_STATE_DIM,
    Reason.WRONG_CAMERAS, Reason.WRONG_IMAGE_SHAPE, Reason.CLIENT_MISMATCH, Reason.NONCE_REQUIRED,
    Reason.COMPONENT_NOT_SERVED,
})


class OutputKind(StrEnum):
    """What a server answers an observation with (`Status.output`, docs/protocol.md §5.3)."""

    ACTIONS = "actions"  # an ActionChunk
    TEXT = "text"  # a TextResult
    VERDICT = "verdict"  # a Verdict


class VerdictLabel(StrEnum):
    """The labels a `Verdict` may carry (docs/protocol.md §5.6)."""

    SAFE = "safe"  # a safety component's
    UNSAFE = "unsafe"
    ONGOING = "ongoing"  # a task monitor's
    DONE = "done"
    FAILED = "failed"


# Plain strings (the members' values): these tuples end up in YAML files, which cannot hold an enum.
SAFETY_LABELS: tuple[str, ...] = (VerdictLabel.SAFE.value, VerdictLabel.UNSAFE.value)
MONITOR_LABELS: tuple[str, ...] = (VerdictLabel.ONGOING.value, VerdictLabel.DONE.value, VerdictLabel.FAILED.value)
