"""The messages of the wire protocol, as plain typed records (no I/O, no msgpack here).

Field names are the wire names (docs/protocol.md §5). Images travel as JPEG bytes and arrays as
numpy arrays; `protocol/schema.py` declares how each field travels and `protocol/codec.py` turns
these records into bytes and back. Optional fields default to None/empty ("not said"), and
decoders ignore fields they do not know, so a 1.x peer talks to any other 1.x peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from lerobot_zenoh.protocol.reasons import MONITOR_LABELS, SAFETY_LABELS, OutputKind, VerdictLabel  # noqa: F401

#: (major, minor). A peer rejects a message whose major differs from its own; minors are additive.
PROTOCOL_VERSION: tuple[int, int] = (1, 5)


class MessageType(StrEnum):
    OBSERVATION = "observation"
    ACTION_CHUNK = "action_chunk"
    STATUS = "status"
    TELEMETRY = "telemetry"
    TEXT_RESULT = "text_result"
    VERDICT = "verdict"
    REFUSAL = "refusal"


#: The labels a `Verdict` may carry (a safety component's: SAFETY_LABELS, a monitor's: MONITOR_LABELS).
VERDICT_LABELS = frozenset(label.value for label in VerdictLabel)
#: `Observation.component_mask` has one bit per component of a task, so a task has at most 32.
MAX_COMPONENTS = 32
#: The longest `Observation.task`, in bytes of UTF-8 (docs/protocol.md §5.1): a sentence is under 200,
#: pi0.5's 200-token prompt under about 1,000. A longer task is refused (`task_too_long`) by its
#: length alone, before any tokenizer reads it (on arrival for an unlisted id: `codec.observation_task_bytes`).
MAX_TASK_BYTES = 2048
#: The longest `Refusal.detail`, in bytes of UTF-8: one line for a person, never an echo of what was sent.
MAX_REFUSAL_DETAIL_BYTES = 300


@dataclass(frozen=True, slots=True)
class ExecutionInfo:
    """What an execution-aware scheduler needs to know about the robot's phase (all optional).

    Durations and counts only, measured on the robot's own clock, so no clock is shared.
    """

    task_elapsed_s: float | None = None  # time since the episode (task) started
    actions_buffered: int | None = None  # actions still queued on the robot when this was sent
    control_period_s: float | None = None  # the robot's dt


@dataclass(frozen=True, slots=True, eq=False)
class HistoryFrame:
    """One earlier control step's state and camera frames (`Observation.history`)."""

    state: np.ndarray
    images: dict[str, bytes]  # camera name -> JPEG bytes, the same cameras as the observation


@dataclass(frozen=True, slots=True, eq=False)
class RtcInputs:
    """What a real-time-chunking policy needs to continue the robot's motion (optional).

    Carried by the observation itself, so that any server (a hot standby included) can answer it
    without having seen the earlier chunks.

    - `prefix`: float ``(n, action_dim)``, robot (unnormalized) units: the actions the robot will
      still execute from the step at which the observation was captured, in order. Row ``k`` is the
      action for capture step + ``k`` (row ``k`` of the chunk that answers). ``n`` may be 0 (nothing
      left: plain sampling).
    - `delay_steps`: the client's estimate of how many control steps pass between the capture and
      the chunk's arrival (queueing and inference included), ``0 <= delay_steps <= n``: the first
      `delay_steps` rows of the answer are executed from `prefix` anyway.
    """

    prefix: np.ndarray
    delay_steps: int


@dataclass(frozen=True, slots=True)
class RtcAdvert:
    """A server's real-time-chunking capability, in its status (optional; absent: no RTC).

    `execution_horizon`: the leading chunk rows the server's RTC guidance draws from the prefix
    (LeRobot's ``execution_horizon``); prefix rows beyond it are not used. None: not stated.
    """

    execution_horizon: int | None = None


@dataclass(frozen=True, slots=True)
class SharedFrames:
    """An observation's raw frames in a same-host shared-memory file (docs/protocol.md §7.1)."""

    segment: str  # file name in /dev/shm, lz-<pid>-<32 hex>-<slot>
    generation: int  # the file's generation when these frames were written (>= 1)
    frames: dict[str, tuple[int, int, int]]  # camera name -> (byte offset, height, width), RGB uint8


@dataclass(frozen=True, slots=True)
class SameHostAdvert:
    """A server's offer of the same-host path: a file in /dev/shm holding `token`."""

    probe: str  # lz-probe-<pid>-<32 hex>
    token: str  # 32 hex


@dataclass(frozen=True, slots=True)
class ObservationHeader:
    """What the server's engine reads from an observation without decoding it (docs/protocol.md §5.1.1):
    the session fields of the replay and episode checks and the `ExecutionInfo` an execution-aware
    scheduler ranks by. Carried as the Zenoh attachment of the observation's put; the observation
    itself stays authoritative (a header that disagrees with it is rejected when it is served)."""

    seq_id: int
    episode_id: str | None = None
    session_nonce: int | None = None
    execution: ExecutionInfo | None = None
    refreshes_seq_id: int | None = None
    component_mask: int | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Observation:
    """Client -> server, on `.../<client>/obs`, best effort."""

    seq_id: int
    client_uuid: str
    state: np.ndarray  # 1-D numeric, the robot's proprioceptive state in its feature order
    images: dict[str, bytes]  # camera name -> JPEG bytes
    task: str = ""
    execution: ExecutionInfo | None = None
    # The server keeps one session per client (docs/protocol.md, "Sessions"). A new `episode_id`
    # resets the session's per-episode state (observation history, scheduler task) before this
    # observation is served; a new `session_nonce` (random, drawn once per client process) marks a
    # restarted client, whose seq_ids start again.
    episode_id: str | None = None
    session_nonce: int | None = None
    # The robot's frames of the control steps just before this one, oldest first, one
    # control period (1/fps) apart, for a model that conditions on `Status.history_length` = n > 1
    # consecutive observations (send the last n - 1; within an episode, fewer at its start). Empty:
    # the server falls back to the observations it served this session (docs/policies.md).
    history: tuple[HistoryFrame, ...] = ()
    # Optional: real-time-chunking inputs, sent only to a server whose status has `rtc`.
    rtc: RtcInputs | None = None
    # Optional: cameras sent raw through same-host shared memory (sent only to a server whose
    # status has `same_host`); those cameras are then absent from `images`.
    shared_frames: SharedFrames | None = None
    # Optional: a fresh capture of a request still waiting for its answer, the request being
    # this client's observation `refreshes_seq_id` (docs/protocol.md §10.7). The server puts it in
    # the request's place in line while that request waits, and drops it (counted) otherwise.
    refreshes_seq_id: int | None = None
    # Optional: for a multi-model task (docs/pipelines.md), which of the task's components this
    # observation asks to answer: bit i = the i-th component in the task descriptor's order. The
    # observation is published once and every component's server receives it; a server whose bit is
    # clear drops it unread (from the header). None: every component that receives it.
    component_mask: int | None = None
    # Optional (1.5): this client reads `Refusal`s on its answer key, so the server may tell it why a
    # request of its session was refused (docs/protocol.md §5.7). Sent only when true.
    refusals: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class ActionChunk:
    """Server -> client, on `.../<client>/action`, reliable."""

    response_to_seq_id: int
    inference_time_ms: float  # server compute for this chunk (decode + pre + model + post)
    actions: np.ndarray  # (chunk_len, action_dim)
    server_id: str | None = None
    queue_time_ms: float | None = None  # time the observation waited in the server's slot
    execution_horizon: int | None = None  # how many leading actions the model vouches for
    # Optional: the inference delay (steps) the server's RTC guidance assumed; present exactly
    # when the chunk was conditioned on the observation's `rtc` inputs.
    rtc_delay_steps: int | None = None
    # Optional: which engine computed the chunk and on which tier ("edge" or "cloud"), when the
    # server dispatches to several engines (docs/protocol.md, "Engines"): `queue_time_ms` and
    # `inference_time_ms` are then that engine's, and the round trip to a cloud engine is in neither.
    engine_id: str | None = None
    tier: str | None = None


@dataclass(frozen=True, slots=True)
class Status:
    """The server's capabilities, answered on `.../<app>/status`."""

    model_id: str
    model_version: str
    expected_cameras: dict[str, tuple[int, int]]  # camera name -> (height, width)
    action_dim: int
    max_actions_per_chunk: int
    observation_features: dict  # LeRobotDataset-style feature dict (name -> {dtype, shape, names})
    policy_type: str = ""
    fps: int | None = None
    server_id: str = ""
    state_dim: int | None = None
    action_names: tuple[str, ...] = ()
    accepts_unknown_clients: bool = False
    # In a reply to a query naming a client (`.../status?client=<id>`), whether this server
    # serves that client id; None when the query named none.
    client_admitted: bool | None = None
    # What the model is, beyond shapes (None: not said):
    chunk_size: int | None = None  # actions the model predicts per call (>= max_actions_per_chunk)
    reads_task: bool | None = None  # the task string conditions the model (VLAs)
    history_length: int | None = None  # consecutive observations the model conditions on
    rtc: RtcAdvert | None = None  # present when observations may carry `rtc` inputs
    same_host: SameHostAdvert | None = None  # present when observations may carry `shared_frames`
    # What the server answers (an `OutputKind`): actions (ActionChunk), text (TextResult) or verdict
    # (Verdict). None: not said, i.e. actions.
    output: str | None = None
    # The server takes re-fetch refreshes (`Observation.refreshes_seq_id`, docs/protocol.md §10.7):
    # it puts one in its request's place and drops a late one unserved. None/False: not said, so a
    # client sends none to it (each would be served as a new request).
    refreshes: bool | None = None
    # The server also streams System 2 text (TextResult, on `.../<client>/text`) from the prefill
    # that computes its actions (a pi0.5 with a `language` block, docs/policies.md). None: it does not.
    streams_text: bool | None = None
    # 1.5: the most tokens of the task the model reads (a VLA's tokenizer limit; a longer task is
    # refused, `task_too_long`). None: not said (no limit, or a model that does not read the task).
    max_task_tokens: int | None = None
    # 1.5: in a reply to a query naming a task (`.../status?task=<percent-encoded task>`), the tokens
    # the model's own tokenizer makes of it, so a client checks its task without the tokenizer.
    # None: not asked, or a model that does not count tokens.
    task_tokens: int | None = None
    # 1.5: the server answers a refused request of a client that asks for it (`Observation.refusals`)
    # with a `Refusal` on the client's answer key. None/False: it does not.
    refusals: bool | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Server -> client (1.5), on the client's answer key (`.../<client>/action`, `text` or
    `verdict`), reliable: why the request `response_to_seq_id` was refused, sent only to a client
    whose observations say it reads refusals (`Observation.refusals`), at most one a second per
    session (docs/protocol.md §5.7).

    `reason`: a rejection reason (docs/protocol.md §8.2). `permanent`: every request like it will be
    refused the same way (a task over the model's token limit, cameras the model does not take), so
    the client stops and tells its user; false: this request only (a cool-down, a busy engine).
    `detail`: one line for a person, at most `MAX_REFUSAL_DETAIL_BYTES`."""

    response_to_seq_id: int
    reason: str
    detail: str = ""
    permanent: bool = False
    server_id: str | None = None


@dataclass(frozen=True, slots=True)
class Telemetry:

    """Periodic figures of one server or client, on a `.../metrics` key."""

    source: str  # "server" | "client"
    source_id: str
    seq: int
    uptime_s: float
    period_s: float
    metrics: dict[str, float | int] = field(default_factory=dict)
    per_client: dict[str, dict[str, float | int]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TextResult:
    """A System 2 component's answer (the next subtask, in words), on `.../<client>/text`, reliable.

    `partial`: the text so far of an answer still being written (a pi0.5 serving System 1 and 2 from
    one prefill streams it as it grows, docs/policies.md); the answer is the one without it. Sent only
    when true."""

    response_to_seq_id: int
    text: str
    inference_time_ms: float
    server_id: str | None = None
    queue_time_ms: float | None = None
    partial: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """A safety component's (`safe` | `unsafe`) or a task monitor's (`ongoing` | `done` |
    `failed`) answer, on `.../<client>/verdict`, reliable. `score`: the model's confidence in the
    label, 0..1, when it gives one."""

    response_to_seq_id: int
    label: str
    inference_time_ms: float
    score: float | None = None
    server_id: str | None = None
    queue_time_ms: float | None = None


Message = Observation | ActionChunk | Status | Telemetry | TextResult | Verdict | Refusal
