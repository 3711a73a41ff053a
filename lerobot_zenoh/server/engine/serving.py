"""What every executor of this process's own runner shares (`server/engine/interface.py`): the batch
path, answers, rejections, closed sessions and the action publishers.

`Serving.serve` takes a picked batch through admission (decode, route, prepare), one forward pass
and one answer per request on the client's key (`BatchExecutor`); the iteration-level decoder
(`DecodingExecutor`) publishes each answer the step it finishes; both through `deliver`. Called by
the inference thread, and by a local engine's thread for a model with `engines` (`server/dispatch/dispatcher.py`):
action publishers are created under a small lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import Topic
from lerobot_zenoh.protocol.messages import MAX_REFUSAL_DETAIL_BYTES, Refusal
from lerobot_zenoh.protocol.reasons import REPEATING_REASONS, OutputKind, Reason
from lerobot_zenoh.server.engine import admission
from lerobot_zenoh.server.model import text_stream
from lerobot_zenoh.server.model.failover import answer_check
from lerobot_zenoh.server.engine.admission import Ready
from lerobot_zenoh.server.session_table.records import Batch, Session
from lerobot_zenoh.server.runners.base import InferenceResult
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport.session import ACTION_QOS, Publisher

log = logging.getLogger(__name__)

#: How often sessions are looked at for expiry (the inference loop, and between decode steps).
EXPIRY_PERIOD_S = 0.25
#: A session is sent at most one `Refusal` this often (the first at once).
REFUSAL_PERIOD_S = 1.0

__all__ = ["Serving", "EXPIRY_PERIOD_S", "REFUSAL_PERIOD_S"]


class Serving:
    """The batch path and answers over `models`; `session` is set once Zenoh is open."""

    def __init__(self, server_id: str, models: list[ServedModel], stop: threading.Event):
        self.server_id = server_id
        self.models = models
        self.stop = stop
        self.session = None
        self._publishers_lock = threading.Lock()  # the local engine's thread publishes too

    def expire(self, model: ServedModel, now: float) -> None:
        """Log the sessions opened since, close the model's expired sessions and forget their state
        (inference thread only)."""
        for client_id, listed in model.session_table.take_opened():
            log.info("%s %s: session opened (%s)", model.app.prefix, client_id, "listed" if listed else "unknown client")
        for session in model.session_table.expire(now):
            self.forget(model, session)

    def forget(self, model: ServedModel, session: Session) -> None:
        """A closed session: drop its runner state and its action publisher (inference thread only)."""
        if model.dispatcher is not None:
            model.dispatcher.forget(session.client_id)  # the local runner's state: on its own thread
        elif model.engine is not None:
            model.engine.forget(session.client_id)
        if model.routing is not None:
            model.routing.forget(session.client_id)
        with self._publishers_lock:
            pub = model.publishers.pop(session.client_id, None)
        if pub is not None:
            model.actions_dropped_closed += pub.dropped
            pub.close()
        st = session.stats
        rejected = ", ".join(f"{n} {reason}" for reason, n in sorted(st.rejected.items())) or "none"
        log.info("%s %s: session closed (%s): received %d, superseded %d, served %d, rejected %s", model.app.prefix,
                 session.client_id, session.closed_reason, st.received, st.superseded, st.served, rejected)

    def serve(self, model: ServedModel, batch: Batch) -> None:
        """Admit each picked observation on its own, infer the valid ones together, publish each answer.

        A bad observation is rejected before batching; a batch that fails is served again one request
        at a time, so one bad request costs the others a retry, never their chunk.
        """
        t_start = time.monotonic()
        ready = admission.prepare(model, batch, lambda *r: self.reject(model, *r))
        if not batch.items:
            return
        results = model.adapter.infer([r.request for r in ready]) if ready else []
        t_done = time.monotonic()
        inference_ms = (t_done - t_start) * 1000
        published: list[tuple[Session, int, float, float]] = []
        for r, result in zip(ready, results, strict=True):
            queue_ms = (t_start - r.slot.arrival_s) * 1000
            if self.deliver(model, r, result, inference_ms, queue_ms):
                published.append((r.session, r.observation.seq_id, inference_ms, queue_ms))
        model.session_table.finish(published, [r.session.client_id for r in ready], time.monotonic(), t_done - t_start)
        if not _observations_wait(model):  # actions first: text decodes in the time they leave
            self.advance_text(model)

    def deliver(self, model: ServedModel, r: Ready, result: InferenceResult | Exception, inference_ms: float,
                queue_ms: float) -> bool:
        """Publish the answer to one request (the batch path and the iteration-level decoder);
        whether it counts as served."""
        session = r.session
        if isinstance(result, ProtocolError):  # shm_stale, decode_limit, undecodable_action_tokens
            self.reject(model, session, result.reason, str(result))
            return False
        if isinstance(result, Exception):  # a failing inference is this client's problem, not the loop's
            self.reject(model, session, Reason.INFERENCE_ERROR, f"{type(result).__name__}: {result}")
            return False
        if model.routing is not None and model.routing.text_only(model.runner, model.output, result):
            return True  # text only: it streams (`advance_text`)
        if result.silent:  # a fault-injecting runner withholds this answer
            model.answers_withheld += 1
            return False
        try:
            payload = model.adapter.answer(r.observation, result, inference_ms, queue_ms)
        except Exception as exc:  # the runner returned something that is not an answer of its kind
            self.reject(model, session, Reason.INFERENCE_ERROR, f"{type(exc).__name__}: {exc}")
            return False
        # Asked now and again by the publisher's thread as it hands the bytes to Zenoh: a freeze in
        # between (the process stopped with this answer queued) must not let it out after a standby
        # took over; refusals are counted in `answers_held` (server/model/failover.py).
        valid = answer_check(model.role, r.slot.arrival_s)
        if valid is not None and not valid():
            return False
        try:
            self._publisher(model, session.client_id).put(payload, valid=valid)
        except Exception as exc:
            self.reject(model, session, Reason.PUBLISH_ERROR, str(exc))
            return False
        model.inferences += 1
        model.answers[model.output if model.output != OutputKind.VERDICT else f"verdict.{result.label}"] += 1
        return True

    def advance_text(self, model: ServedModel) -> int:
        """A language runner's text of every robot, one frame's worth (a task's System 2, server/model/routing.py)."""
        if model.routing is None:
            return 0
        if text_stream.writes_text(model.runner):  # (a declared capability: a pi0.5 language runner)
            model.runner.yield_to_actions(lambda: _observations_wait(model))  # actions first, between steps
        return model.routing.advance_text(model, lambda client_id: self.session.publisher(
            model.app.client(client_id).topic(Topic.TEXT), ACTION_QOS), self.server_id)

    def reject(self, model: ServedModel, session: Session, reason: str, detail: str, *, cool_down: bool = True) -> None:
        """Count a rejection against a client; `cool_down=False`: not its fault (an engine's), so it
        never counts towards the client's rejection cool-down."""
        now = time.monotonic()
        n = model.session_table.reject(session, reason, now, cool_down=cool_down)
        if worth_logging(n):
            log.warning("client %s on %s: rejected (%s) %s [%d rejections]", session.client_id, model.app.prefix,
                        reason, detail, n)
        if reason != Reason.PUBLISH_ERROR:  # (a refusal would take the same failing way)
            self.refuse(model, session, reason, detail, now)

    def refuse(self, model: ServedModel, session: Session, reason: str, detail: str, now_s: float) -> bool:
        """Tell the client why its request was refused (a `Refusal` on its own answer key, protocol
        1.5), when its observations say it reads refusals; at most one every `REFUSAL_PERIOD_S` per
        session, one line of at most `MAX_REFUSAL_DETAIL_BYTES`, and only to the key of the session's
        client, so that nobody can make this server send others more than they sent it. Whether sent."""
        seq = session.last_request_seq
        if not session.reads_refusals or seq is None:
            return False
        if session.refusal_sent_s is not None and now_s - session.refusal_sent_s < REFUSAL_PERIOD_S:
            model.refusals_withheld += 1
            return False
        session.refusal_sent_s = now_s
        text = " ".join(detail[: 4 * MAX_REFUSAL_DETAIL_BYTES].split()).removeprefix(f"{reason}: ")
        if len(text.encode()) > MAX_REFUSAL_DETAIL_BYTES:
            text = text.encode()[: MAX_REFUSAL_DETAIL_BYTES - 3].decode(errors="ignore") + "..."
        refusal = Refusal(seq, str(reason)[:64], text, permanent=reason in REPEATING_REASONS, server_id=self.server_id)
        try:
            self._publisher(model, session.client_id).put(codec.encode(refusal))
        except Exception as exc:  # noqa: BLE001 - a refusal is advice: never worth failing the loop for
            log.debug("refusal to %s not sent: %s", session.client_id, exc)
            return False
        model.refusals_sent[str(reason)] += 1
        return True


    def publish(self, model: ServedModel, client_id: str, payload: bytes, *,
                valid: Callable[[], bool] | None = None) -> None:
        """Put an answer on the client's key of the model's output (raises when the publish fails);
        `valid`: asked again by the publisher's thread just before the bytes go out (`answer_check`)."""
        self._publisher(model, client_id).put(payload, valid=valid)


    def _publisher(self, model: ServedModel, client_id: str) -> Publisher:
        pub = model.publishers.get(client_id)
        if pub is None:
            with self._publishers_lock:
                pub = model.publishers.get(client_id)
                if pub is None:
                    # Chunks, texts and verdicts alike: reliable, never waited for (ACTION_QOS).
                    pub = model.publishers[client_id] = self.session.publisher(
                        model.app.client(client_id).topic(model.topic), ACTION_QOS)
        return pub


def _observations_wait(model: ServedModel) -> bool:
    """Whether an observation waits in a session's slot (the inference loop decodes text when
    `schedule` finds nothing, so text is only delayed, never lost)."""
    return model.session_table.waiting() > 0
