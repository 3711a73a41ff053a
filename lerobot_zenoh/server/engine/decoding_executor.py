"""The iteration-level executor (`server/engine/interface.py`): this process's runner decoding step
by step (pi0-FAST; docs/server.md, "Iteration-level serving"), on the inference thread.

The picked observations start decoding; between decode steps the executor asks the scheduler for
the next observations of its model (`admission.schedule`), which join the running batch; each
answer is published the step its request finishes (`Serving.deliver`). Fair admission: a robot has
at most one request decoding, and a free slot goes to the next robot by the scheduler's rank, never
to a robot whose request is still decoding. `submit` returns when nothing of its model is left to
decode, or the server stops taking new requests (stopping, or other models waiting for the thread).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lerobot_zenoh.server.engine import admission
from lerobot_zenoh.server.runners.base import InferenceRequest, InferenceResult
from lerobot_zenoh.server.engine.serving import EXPIRY_PERIOD_S
from lerobot_zenoh.server.session_table.records import Batch
from lerobot_zenoh.server.session_table.table import REPLAYED

if TYPE_CHECKING:
    from lerobot_zenoh.server.engine.admission import Ready
    from lerobot_zenoh.server.engine.interface import Work
    from lerobot_zenoh.server.engine.request_table import InFlight
    from lerobot_zenoh.server.model.served_model import ServedModel
    from lerobot_zenoh.server.engine.serving import Serving

__all__ = ["DecodingExecutor"]

Key = tuple[str, int]  # (client id, seq_id): one request decoding


class DecodingExecutor:
    """`submit` decodes the batch and whatever joins it, on the calling thread."""

    def __init__(self, serving: Serving, model: ServedModel):
        self.serving, self.model = serving, model

    def submit(self, work: Work) -> list[InFlight]:
        for client_id in work.reset:
            self.model.runner.forget(client_id)
        _Decode(self.serving, self.model).run(work.batch)
        return []

    def forget(self, client_id: str) -> None:
        self.model.runner.forget(client_id)

    def stop(self, timeout_s: float) -> bool:
        return True


class _Decode:
    """One run of the decoder: the requests decoding (`in_flight`) and the runner's callbacks."""

    def __init__(self, serving: Serving, model: ServedModel):
        self.serving, self.model = serving, model
        self.in_flight: dict[Key, tuple[Ready, float]] = {}
        self.started = self.next_expiry = time.monotonic()

    def run(self, batch: Batch) -> None:
        self.model.adapter.stream(self.prepare(batch), self.join, self.emit)

    def prepare(self, picked: Batch | None) -> list[tuple[Key, InferenceRequest]]:
        if picked is None:
            return []
        model, serving = self.model, self.serving
        out = []
        for r in admission.prepare(model, picked, lambda *rej: serving.reject(model, *rej)):
            key = (r.session.client_id, r.observation.seq_id)
            if key in self.in_flight:
                serving.reject(model, r.session, REPLAYED, f"seq_id {key[1]} is being decoded")
                continue
            self.in_flight[key] = (r, time.monotonic())
            out.append((key, r.request))
        return out

    def join(self) -> list[tuple[Key, InferenceRequest]]:
        """Between decode steps: the loop's chores (sessions expire), then the next robots' requests."""
        serving = self.serving
        now = time.monotonic()
        if now >= self.next_expiry:
            self.next_expiry = now + EXPIRY_PERIOD_S
            for other in serving.models:
                serving.expire(other, now)
        # Stop taking new requests when stopping, or after a while when other models wait for the
        # inference thread (the running batch then drains and the loop serves them).
        if serving.stop.is_set() or (len(serving.models) > 1 and now - self.started > EXPIRY_PERIOD_S):
            return []
        return self.prepare(admission.schedule(self.model, now, exclude={client for client, _ in self.in_flight}))

    def emit(self, key: Key, result: InferenceResult | Exception) -> None:
        r, t_start = self.in_flight.pop(key)
        t_done = time.monotonic()
        inference_ms = (t_done - t_start) * 1000
        queue_ms = (t_start - r.slot.arrival_s) * 1000
        published = []
        if self.serving.deliver(self.model, r, result, inference_ms, queue_ms):
            published.append((r.session, r.observation.seq_id, inference_ms, queue_ms))
        self.model.session_table.finish(published, [r.session.client_id], t_done, t_done - t_start)
