"""Multi-model task routing: what a model serving a component of multi-model tasks adds to serving
(docs/pipelines.md, "Serving the components"), kept off the single-model path.

A model whose manifest entry lists `pipeline` items also hears each task's observation stream
(`keys.pipeline_app`): the shell subscribes to those streams and hands each observation that
arrives there to the model's `TaskRouting`, which alone knows about tasks and components:

- `accepts(task, client_id, header, header_error)` (Zenoh callback thread): whether the
  observation asks this component, from the header admission read (`server/engine/admission.py`): its
  `component_mask` has the item's bit (or the bit of its System 2 text), or it has no mask. One that
  does not is dropped unread and counted (`observations_for_other_components`); one that does
  records the task the client was last heard on (for a reload), and is admitted with its task.
- `request(adapter, runner, client_id, obs, task)` (inference thread, from the admission step):
  the runner's request for an observation that came on `task`'s stream (its slot says which):
  only this component's cameras of the robot's,
  the task's query (prompt, labels) in its extras, and System 2 text from the same prefill when the
  item asks for it (`server/model/text_stream.py`); None when a header-less observation turns out to ask
  another component. A client heard on the model's own app gets `adapter.prepare` unchanged.
- `text_only(result)`, `advance_text(...)`: a text-only request streams its answer across frames.
- `update(streams)` (a manifest reload): the new streams, and the clients no longer heard.

A model without `pipeline` has no `TaskRouting` (`ServedModel.routing is None`): nothing here runs
for it. One gets a `TaskRouting` when a reload gives it task streams, and keeps it (and its counts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lerobot_zenoh.errors import ProtocolError
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import Observation, ObservationHeader
from lerobot_zenoh.protocol.reasons import OutputKind
from lerobot_zenoh.server.model import text_stream
from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter
from lerobot_zenoh.server.config.manifest import Manifest, ModelEntry, PipelineEntry
from lerobot_zenoh.server.runners.base import (
    COMPONENT_EXTRA,
    ComponentQuery,
    InferenceRequest,
    InferenceResult,
    PolicyRunner,
)
from lerobot_zenoh.transport.session import Publisher


@dataclass(frozen=True)
class TaskStream:
    """A multi-model task's observation stream that a model serves, and what the task asks of it."""

    key: AppKey  # the stream's app key (`keys.pipeline_app`)
    item: PipelineEntry
    query: ComponentQuery

    @property
    def bits(self) -> tuple[int, ...]:
        """The task's components this model serves: the item's, and its System 2 text's (a pi0.5
        language entry). Their observations come on keys naming them (`ClientKey.obs_for`)."""
        return (self.item.bit,) + ((self.item.text.bit,) if self.item.text is not None else ())


def task_streams(manifest: Manifest, entry: ModelEntry) -> dict[str, TaskStream]:
    """The entry's `pipeline` items by task."""
    return {item.task: TaskStream(manifest.pipeline_key(item), item,
                                  ComponentQuery(item.task, item.component, item.prompt, tuple(item.labels)))
            for item in entry.pipeline}


class TaskRouting:
    """The task streams of one model and the robots heard on them."""

    def __init__(self, streams: dict[str, TaskStream]):
        # task -> its stream and what it asks of this model. Replaced whole by a reload, never
        # changed in place (read by callbacks and the inference thread).
        self.streams = streams
        # client id -> the task whose stream it was last heard on (one dict store on the callback
        # thread), for a reload to find the clients no longer heard. What a request is served as
        # comes from its own slot (`Slot.task`). Bounded by sessions: forgotten when its session
        # closes, or when it is refused one.
        self.component_of: dict[str, str] = {}
        self.for_other_components = 0  # observations whose component_mask does not ask this model
        self.text_publishers: dict[str, Publisher] = {}  # a language runner's text (server/model/text_stream.py)

    # -- Zenoh callback thread -------------------------------------------------------------------

    def accepts(self, task: str, client_id: str, header: ObservationHeader | None,
                header_error: ProtocolError | None) -> bool:
        """Whether an observation on `task`'s stream is for this model (counted if not)."""
        stream = self.streams.get(task)
        if stream is None:
            return False  # in flight while a reload unsubscribed the task's stream
        if header_error is None and header is not None and header.component_mask is not None:
            mask, text = header.component_mask, stream.item.text
            if not (mask >> stream.item.bit & 1 or (text is not None and mask >> text.bit & 1)):
                self.for_other_components += 1  # never decoded, never in a slot
                return False
        # (no header, or a malformed one: the body is checked when served, or the header rejected)
        self.component_of[client_id] = task
        return True

    def refused(self, client_id: str) -> None:
        """The session table gave the client no session (unknown or too many): nothing will close to forget it."""
        self.component_of.pop(client_id, None)

    # -- inference thread ------------------------------------------------------------------------

    def request(self, adapter: RunnerAdapter, runner: PolicyRunner, client_id: str, obs: Observation,
                task: str | None) -> InferenceRequest | None:
        """The runner's request for `obs`, which came on `task`'s stream (None: the model's own app);
        ProtocolError when it cannot be served; None when it asks another component (a header-less
        observation: found out only now, counted)."""
        stream = None if task is None else self.streams.get(task)
        if stream is None:
            return adapter.prepare(client_id, obs)  # heard on the model's own app
        actions, text = text_stream.asked(stream.item, obs)
        if not (actions or text):
            self.for_other_components += 1
            return None
        cameras = adapter.spec.cameras
        if obs.shared_frames is None and set(obs.images) > set(cameras):
            # A component reads its own cameras of the robot's (a VLM may look through one of
            # them); the others are never decoded.
            obs = dataclasses.replace(obs, images={c: obs.images[c] for c in cameras})
        request = adapter.prepare(client_id, obs, {COMPONENT_EXTRA: stream.query})
        if text:  # System 2 from the same prefill (a pi0.5 language entry)
            request = text_stream.with_text(runner, request, stream.item, obs, actions)
        return request

    @staticmethod
    def text_only(runner: PolicyRunner, output: str, result: InferenceResult) -> bool:
        """Whether `result` answers a request that asked only for text: it streams (`advance_text`), no chunk now."""
        return result.actions is None and output == OutputKind.ACTIONS and text_stream.writes_text(runner)

    def advance_text(self, model: Any, publisher: Callable[[str], Publisher], server_id: str) -> int:
        """One frame of text for every robot of a language runner (server/model/text_stream.py); the updates
        published. `publisher(client_id)` opens a robot's text publisher, kept until it is forgotten."""
        def publish(client_id: str, payload: bytes) -> None:
            pub = self.text_publishers.get(client_id)
            if pub is None:
                pub = self.text_publishers[client_id] = publisher(client_id)
            pub.put(payload)

        return text_stream.advance(model, publish, server_id)

    def forget(self, client_id: str) -> None:
        """A closed session: its task and its text publisher."""
        self.component_of.pop(client_id, None)
        pub = self.text_publishers.pop(client_id, None)
        if pub is not None:
            pub.close()

    # -- a manifest reload ------------------------------------------------------------------------

    def update(self, streams: dict[str, TaskStream]) -> tuple[dict[str, TaskStream], set[str]]:
        """Take a reload's streams (one store: readers see the old map or the new); returns the old
        map and the clients heard only on streams no longer served (their sessions close)."""
        before, self.streams = self.streams, streams
        unheard = {cid for cid, task in dict(self.component_of).items() if task not in streams}
        return before, unheard


def stream_changes(before: dict[str, TaskStream], after: dict[str, TaskStream]) -> str:
    """The task streams a reload added, removed or changed, for its log line ('' when none)."""
    changed = sorted(t for t in before.keys() & after.keys() if before[t].item != after[t].item)
    diffs = (("+", after.keys() - before.keys()), ("-", before.keys() - after.keys()), ("~", changed))
    parts = [f"{sign}{sorted(tasks)}" for sign, tasks in diffs if tasks]
    return f", task streams {' '.join(parts)}" if parts else ""
