"""Admission: what the server reads of an observation, once each, and the one step every request
the session table picked goes through before it is run, whichever path runs it (docs/architecture.md,
"Server process").

- `read_header(attachment)` (Zenoh callback thread): the observation's header (protocol.md §5.1.1,
  the put's attachment: a struct unpack, no msgpack), or why it is malformed. The server's only
  read of a header: the verdict goes into the session's slot with the payload (`SessionTable.admit`),
  and task routing (`server/model/routing.py`) reads the component mask from it.
- `screen(payload, limits)` (Zenoh callback thread, for ids the manifest does not list, and a listed
  robot's for a minute after a rejection): the body's
  one read on arrival, the length of its `task` (nothing decoded): a task over the limit is refused
  there (`task_too_long`), never reaching the inference thread. The body is copied out of Zenoh's
  buffer for it, and that copy is what the slot keeps.
- `schedule(model, now_s, ...)` (inference thread): for a scheduler that ranks by `ExecutionInfo`,
  the runner adapter decodes the new observations sent without a header (nothing else tells it what they
  are), then the session table judges and picks (`SessionTable.unread`, `SessionTable.schedule`).
- `observation(model, session, slot)`: the picked observation's body, decoded once by the runner adapter
  (or the decode of a header-less one on arrival) and checked against its header; a header-less
  one not judged yet is judged now (`SessionTable.judge`). Used by every path, the remote dispatch too.
- `prepare(model, batch, reject)`: the admission step of a batch, shared by the batch path
  (`Serving.serve`, and the local engine of a model with engines) and the iteration-level
  path (`Serving.serve` of an iteration-level runner): the session table's rejections counted; each item decoded,
  routed (task streams) and prepared by the runner adapter (together: one JPEG decode for the batch); the
  runner's state of a session whose episode or client process changed dropped. A request that cannot be served is rejected with its
  reason (counted against its client) and costs the others nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES, Observation, ObservationHeader
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.protocol.schema import CodecLimits
from lerobot_zenoh.server.session_table.records import Batch, Ranking, Session, Slot
from lerobot_zenoh.server.runners.base import InferenceRequest
from lerobot_zenoh.transport.session import Payload

if TYPE_CHECKING:
    from lerobot_zenoh.server.model.served_model import ServedModel

#: reject(session, reason, detail): count a rejection against its client (`Serving.reject`).
Reject = Callable[[Session, str, str], None]


@dataclass
class Ready:
    """A picked request that passed admission: what the runner gets, and what its answer needs."""

    session: Session
    slot: Slot
    observation: Observation
    request: InferenceRequest


def read_header(attachment: bytes | None) -> tuple[ObservationHeader | None, ProtocolError | None]:
    """(header, None), or (None, why it is malformed); (None, None) without one or in a version
    this server does not read (the body is decoded on arrival instead)."""
    if attachment is None:
        return None, None
    try:
        return codec.decode_observation_header(attachment), None
    except ProtocolError as exc:
        return None, exc


def screen(payload: Payload | bytes, limits: CodecLimits) -> tuple[Payload | bytes, str | None]:
    """(what to keep of the observation, None), or (it, why it is refused) (Zenoh callback thread).

    The one read of an observation's body on arrival: its `task`'s length (`codec.observation_task_bytes`,
    nothing decoded), so a task over `MAX_TASK_BYTES` is refused (`task_too_long`) before the
    inference thread sees it. Zenoh's buffer can only be read as a copy, so the body is copied here
    once and the copy is what is kept (the decode of a picked one copies nothing more); a body over
    the size limit is neither copied nor read (`SessionTable.admit` refuses it as `too_large`).
    `Ingest` screens the observations of ids the manifest does not list (ids cost nothing to invent,
    and they share one cool-down), and those of a listed robot for a minute after one of its
    observations was rejected; an honest listed robot's body stays in Zenoh's buffer until it is
    picked (a superseded one is never copied). So the first long task of a listed robot is refused
    when it is decoded, by its length alone (before any tokenizer), and its next ones on arrival."""
    if len(payload) > limits.max_message_bytes:
        return payload, None
    data = bytes(payload)
    return data, (Reason.TASK_TOO_LONG if codec.observation_task_bytes(data, limits) > MAX_TASK_BYTES else None)


def schedule(model: ServedModel, now_s: float, **kw) -> Batch | None:
    """The session table's next batch (`SessionTable.schedule`, keyword arguments passed on), after
    the runner adapter decoded the new header-less observations."""
    _decode_unread(model)
    return model.session_table.schedule(now_s, **kw)


def rank(model: ServedModel, now_s: float, **kw) -> Ranking:
    """Every ready client in the scheduler's order (`SessionTable.rank`: rank, then `take`), after
    the runner adapter decoded the new header-less observations."""
    _decode_unread(model)
    return model.session_table.rank(now_s, **kw)


def _decode_unread(model: ServedModel) -> None:
    for slot in model.session_table.unread():
        try:
            slot.observation = model.adapter.decode(slot.payload)
        except ProtocolError as exc:
            slot.error = exc  # rejected with its reason by `schedule` / `rank`


def observation(model: ServedModel, session: Session, slot: Slot) -> Observation:
    """The slot's observation, decoded once (kept in the slot: a re-queued request is not decoded
    again) and judged; ProtocolError when it is malformed, not what its header said, or refused by
    the session rules (`replayed`, `nonce_required`, `seq_jump`: a header-less one, judged now)."""
    if slot.known is not None:
        session.last_request_seq = slot.known.seq_id  # (what a refusal of it answers, `Serving.refuse`)
    if slot.observation is None:
        slot.observation = model.adapter.decode(slot.payload, slot.header)
        session.last_request_seq = slot.observation.seq_id
    session.reads_refusals = slot.observation.refusals
    if not slot.judged:
        refused = model.session_table.judge(session, slot)
        if refused is not None:  # (docs/protocol.md §10.5)
            raise ProtocolError(*refused)
    return slot.observation


def prepare(model: ServedModel, batch: Batch, reject: Reject) -> list[Ready]:
    """The requests of `batch` that can be run, in order; the others rejected through `reject`.

    The runner adapter prepares the picked observations together (`RunnerAdapter.prepare_batch`: one JPEG decode
    for the batch); a model serving task streams (`routing`) prepares each on its own, as its route
    says."""
    for session, _slot, reason, detail in batch.rejected:
        reject(session, reason, detail)
    picked = []
    for session, slot in batch.items:
        try:
            picked.append((session, slot, observation(model, session, slot)))
        except ProtocolError as exc:
            model.session_table.release(session)  # picked, refused now: computed no longer
            reject(session, exc.reason, str(exc))
    routing = model.routing
    if routing is None:
        requests = model.adapter.prepare_batch([(session.client_id, obs, None) for session, _, obs in picked])
    else:
        requests = [_routed(model, session.client_id, obs, slot.task) for session, slot, obs in picked]
    ready = []
    for (session, slot, obs), request in zip(picked, requests, strict=True):
        if isinstance(request, ProtocolError):
            model.session_table.release(session)
            reject(session, request.reason, str(request))
            continue
        if request is None:
            model.session_table.release(session)
            continue  # it asks another component of its task
        if model.session_table.take_reset(session):
            model.runner.forget(session.client_id)  # a new episode or a restarted client
        ready.append(Ready(session, slot, obs, request))
    return ready


def _routed(model: ServedModel, client_id: str, obs: Observation, task: str | None):
    """The routed request of one observation (`Routing.request`), None, or its ProtocolError."""
    try:
        return model.routing.request(model.adapter, model.runner, client_id, obs, task)
    except ProtocolError as exc:
        return exc
