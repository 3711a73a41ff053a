"""What reaches the server from the robots: its subscriptions and Zenoh callbacks, hand-over only.

`on_observation` checks the length of the key's client id (`client_id_too_long`, before anything
else is read or kept of the key), parses the key (once: parsed keys are cached, bounded in number
and in bytes), reads the observation's small header (`admission.read_header`, a struct unpack;
nothing is decoded), for an id the manifest does not list (or a listed one rejected in the last
minute) the length of its task (`admission.screen`:
a task over the limit is refused here, never on the inference thread; the body is copied once out
of Zenoh's buffer for it), and calls `engine.admit` (the body and those verdicts go into the
session's newest-only slot); `on_client_token`
tells the engine a client's liveliness token appeared or vanished. Both take only the engine's
short lock. A model serving a component of multi-model tasks (`pipeline` in its manifest entry)
also subscribes to each task's observation stream (and its robots' tokens there):
`on_task_observation` asks the model's task routing (`server/model/routing.py`) first. `reload` takes a
re-read manifest's client lists, batch sizes and task streams (SIGHUP): a model's streams are one
dict replaced whole, so the callbacks and the inference thread read either the old map or the new one.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time

from lerobot_zenoh.errors import KeyExprError, TransportError
from lerobot_zenoh.protocol.keys import (MAX_CLIENT_ID_BYTES, AppKey, Topic, client_chunk_too_long, names_components,
                                         parse_client_key)
from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.engine import admission
from lerobot_zenoh.server.session_table.table import RATE_LIMITED, TOO_MANY_CLIENTS, UNKNOWN_CLIENT
from lerobot_zenoh.server.config.manifest import Manifest
from lerobot_zenoh.server.model.routing import TaskRouting, TaskStream, stream_changes, task_streams
from lerobot_zenoh.server.model.served_model import ServedModel
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport.session import Payload

log = logging.getLogger(__name__)

#: Parsed observation keys kept (one per client and model), and the memory they may take (keys and
#: ids, as Python holds them); beyond either, the oldest are forgotten (and parsed again if they come back).
MAX_CACHED_KEYS = 4096
MAX_CACHED_KEY_BYTES = 2**20
#: A listed robot's observations are screened on arrival (`admission.screen`) for this long after one
#: of its observations was rejected (an honest robot's never are: its bodies stay in Zenoh's buffer).
SCREEN_AFTER_REJECTION_S = 60.0
#: A key longer than this is never cached, nor looked up (hashing a 60 kB key costs 16 us): the five
#: chunks of an app prefix, a client id of at most MAX_CLIENT_ID_BYTES and `obs` fit in it.
MAX_CACHED_KEY_CHARS = 1024

__all__ = ["Ingest", "KeyCache", "MAX_CACHED_KEYS", "MAX_CACHED_KEY_BYTES", "MAX_CACHED_KEY_CHARS", "SCREEN_AFTER_REJECTION_S"]


class KeyCache:
    """Observation key -> client id, for keys that parsed as client observation keys, bounded in
    entries and in bytes (`sys.getsizeof` of the key and of the id, so a key of wide characters
    counts what it takes); the oldest entries go first. Keys over `max_key_chars` are neither kept
    nor looked up. Callbacks run on several Zenoh threads: one lock, held for dictionary work only."""

    def __init__(self, max_keys: int = MAX_CACHED_KEYS, max_bytes: int = MAX_CACHED_KEY_BYTES,
                 max_key_chars: int = MAX_CACHED_KEY_CHARS):
        self.max_keys, self.max_bytes, self.max_key_chars = max_keys, max_bytes, max_key_chars
        self._entries: dict[str, tuple[str, int]] = {}  # key -> (client id, its bytes with the key's)
        self.bytes = 0
        self.evicted = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> str | None:
        if len(key) > self.max_key_chars:
            return None
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: str, client_id: str) -> None:
        size = sys.getsizeof(key) + sys.getsizeof(client_id)
        if len(key) > self.max_key_chars or size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            while self._entries and (len(self._entries) >= self.max_keys or self.bytes + size > self.max_bytes):
                _, freed = self._entries.pop(next(iter(self._entries)))
                self.bytes -= freed
                self.evicted += 1
            self._entries[key] = (client_id, size)
            self.bytes += size


def _screened(table, client_id: str, now_s: float) -> bool:
    """Whether an observation's task is read on arrival (`admission.screen`): an id anyone can invent
    that the server would admit, or a listed one refused lately; never one `SessionTable.admit`
    drops anyway (an unknown id the manifest refuses, a client cooling down), which costs no copy."""
    config, limit = table.config, table.rate_limit
    if limit.blocked(client_id, now_s):
        return False
    if client_id in config.listed:
        return limit.rejected_since(client_id, now_s - SCREEN_AFTER_REJECTION_S)
    return config.accept_unknown


class Ingest:
    """The subscriptions and callbacks of `models`; `session` is set once Zenoh is open."""

    def __init__(self, models: list[ServedModel], wake: threading.Event):
        self.models = models
        self.wake = wake
        self.session = None
        # Observation key -> client id, for keys that parsed as client observation keys: parsing
        # (split, AppKey, chunk validation) cost 12 us per sample, a dict hit 0.1 us (docs/benchmarks.md,
        # "Server ingest"). Bounded in keys and in bytes; ids are at most MAX_CLIENT_ID_BYTES.
        self.keys = KeyCache()
        self._refused_on_arrival = itertools.count(1)  # bodies refused by `admission.screen`, for the log

    def reload(self, manifest: Manifest) -> str | None:
        """Take a re-read manifest's task streams, client lists and batch sizes; None when applied,
        else why not (nothing applied). New task streams are subscribed before any client is listed,
        so a robot that the status query says is served is heard on its stream."""
        streams = [task_streams(manifest, entry) for entry in manifest.server]
        opened: list[tuple[ServedModel, str, list]] = []
        try:
            for model, new in zip(self.models, streams, strict=True):
                # New streams, and those whose components (bits) changed: their keys did.
                for task in sorted(t for t in new if t not in model.streams or model.streams[t].bits != new[t].bits):
                    opened.append((model, task, []))
                    self.subscribe(model, new[task], task, opened[-1][2])
        except TransportError as exc:
            for *_, subscriptions in opened:
                for sub in subscriptions:
                    sub.close()
            return f"a task stream could not be subscribed: {exc}"
        for model, task, subscriptions in opened:
            for sub in model.subscriptions.pop(task, []):  # a stream whose bits changed: its old keys
                sub.close()
            model.subscriptions[task] = subscriptions
        for model, entry, new in zip(self.models, manifest.server, streams, strict=True):
            before_streams, unheard = {}, set()
            if model.routing is not None:
                before_streams, unheard = model.routing.update(new)
            elif new:
                model.routing = TaskRouting(new)  # (until now its new streams' observations were dropped)
            for task in before_streams.keys() - new.keys():
                for sub in model.subscriptions.pop(task, []):
                    sub.close()
            cap = model.runner.spec.capabilities.max_batch
            batch = entry.max_batch_size if entry.max_batch_size != "auto" else model.max_batch_size
            before = model.session_table.config.listed
            listed = frozenset(c.client_uuid for c in entry.clients)
            model.entry, model.max_batch_size = entry, batch if cap is None else min(batch, cap)
            closed = model.session_table.update_clients(listed, model.max_batch_size, close=unheard)
            log.info("%s: clients reloaded: +%s -%s (sessions closed: %s), max_batch_size %d%s", model.app.prefix,
                     sorted(listed - before) or "none", sorted(before - listed) or "none", closed or "none",
                     model.max_batch_size, stream_changes(before_streams, new))
        return None

    def subscribe(self, model: ServedModel, source: AppKey | TaskStream, task: str | None, into: list) -> None:
        """Subscribe `model` to the observations of `source` (its own app, or the stream of `task`) and
        to the liveliness tokens of the clients there; each subscription is appended to `into`.

        On a task stream it subscribes to the observations whose key names one of the components it
        serves there (`AppKey.component_observations`: a router sends it no other), and to those
        whose key names none (a client that sends the mask in the header only, protocol.md §2.2)."""
        bits = source.bits if isinstance(source, TaskStream) else ()
        app = source.key if isinstance(source, TaskStream) else source

        if task is None:
            def on_observation(key, payload, attachment, m=model):
                self.on_observation(m, key, payload, attachment)
        else:
            def on_observation(key, payload, attachment, m=model, t=task):
                self.on_task_observation(m, t, key, payload, attachment)

        def subscribe(selector: str, callback) -> None:
            # copy=False: kept in Zenoh's buffer, copied once when decoded, never if superseded
            into.append(self.session.subscribe(selector, callback, with_attachment=True, copy=False))

        subscribe(app.all_observations, on_observation)
        for i, bit in enumerate(bits):
            # An observation that asks two of its components matches two subscriptions: the first serves it.
            def on_component(key, payload, attachment, earlier=bits[:i]):
                if not names_components(key, earlier):
                    on_observation(key, payload, attachment)

            subscribe(app.component_observations(bit), on_component)
        # Each client declares a token on its metrics key: its session closes when the token goes.
        into.append(self.session.watch_liveliness(
            app.all_client_tokens, lambda key, alive, m=model: self.on_client_token(m, key, alive)))

    def on_observation(self, model: ServedModel, key: str, payload: Payload | bytes,
                        attachment: bytes | None = None) -> None:
        """An observation on the model's own app: its header read once, then admitted."""
        client_id = self.client_of(model, key)
        if client_id is not None:
            self.admit(model, client_id, payload, *admission.read_header(attachment))

    def on_task_observation(self, model: ServedModel, task: str, key: str, payload: Payload | bytes,
                             attachment: bytes | None = None) -> None:
        """An observation on a multi-model task's stream: admitted when the task routing says it asks this model."""
        client_id = self.client_of(model, key)
        if client_id is None:
            return
        header, header_error = admission.read_header(attachment)
        routing = model.routing
        if routing is None or not routing.accepts(task, client_id, header, header_error):
            return
        if self.admit(model, client_id, payload, header, header_error, task) in (UNKNOWN_CLIENT, TOO_MANY_CLIENTS):
            routing.refused(client_id)

    def client_of(self, model: ServedModel, key: str) -> str | None:
        """The client whose observation key `key` is; None when it is none, or while standing by."""
        if not model.role.active.is_set():  # a standby drops observations unseen
            model.standby_dropped += 1
            return None
        client_id = self.keys.get(key)  # (only keys whose id was checked are kept; long keys are not looked up)
        if client_id is not None:
            return client_id
        # The id's length before anything else, found without reading the key past it: nothing of a
        # key naming a longer id is parsed or kept (a key is as long as its publisher wants).
        if client_chunk_too_long(key):
            n = model.refuse_unread(Reason.CLIENT_ID_TOO_LONG)
            if worth_logging(n):
                log.warning("dropped observation(s) on %s whose key names a client id over %d bytes (%d so far)",
                            model.app.prefix, MAX_CLIENT_ID_BYTES, n)
            return None
        try:
            _, client_id = parse_client_key(key, Topic.OBS)
        except KeyExprError:
            return None  # the wildcard only matches .../*/obs; a reserved id like "server" ends here
        self.keys.put(key, client_id)
        return client_id

    def admit(self, model: ServedModel, client_id: str, payload: Payload | bytes, header, header_error,
               task: str | None = None) -> str | None:
        now, table, refused = time.monotonic(), model.session_table, None
        if _screened(table, client_id, now):
            payload, refused = admission.screen(payload, model.adapter.limits)
        dropped = table.admit(client_id, payload, now, header, header_error, task, refused)
        if dropped is None:
            self.wake.set()
        elif dropped == refused:
            n = next(self._refused_on_arrival)
            if worth_logging(n):
                log.warning("rejected observation(s) from %r on %s on arrival (%s: a task over %d bytes of "
                            "UTF-8) [%d so far]", client_id, model.app.prefix, refused, MAX_TASK_BYTES, n)
        elif dropped == RATE_LIMITED and client_id not in table.sessions:
            n = table.dropped[RATE_LIMITED]
            if worth_logging(n):
                log.warning("dropped observation(s) from new unknown clients on %s: their shared rejection cool-down "
                            "runs [%d so far]", model.app.prefix, n)
        elif dropped == UNKNOWN_CLIENT:
            n = model.session_table.dropped[UNKNOWN_CLIENT]
            if n in (1, 10, 100, 1000):
                log.warning("rejected observation(s) from unknown client %r on %s (%d so far)",
                            client_id, model.app.prefix, n)
        elif dropped == TOO_MANY_CLIENTS:
            n = model.session_table.dropped[TOO_MANY_CLIENTS]
            if worth_logging(n):
                log.warning("dropped observation(s) from %r on %s: %d unknown clients already have a session "
                            "(max_unknown_clients) [%d so far]", client_id, model.app.prefix,
                            model.entry.max_unknown_clients, n)
        return dropped

    def on_client_token(self, model: ServedModel, key: str, alive: bool) -> None:
        try:
            _, client_id = parse_client_key(key, Topic.METRICS)
        except KeyExprError:
            return
        model.session_table.on_token(client_id, alive, time.monotonic())
