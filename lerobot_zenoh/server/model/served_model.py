"""One served model: its runner, session table (sessions and whom to serve), runner adapter, status and action
publishers, and what the server counts for it. Built once per manifest entry at start-up."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import unquote

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import ANSWER_TOPICS, AppKey
from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES, RtcAdvert, SameHostAdvert, Status
from lerobot_zenoh.scheduling.batch_profile import saturation_batch_size
from lerobot_zenoh.server.model import text_stream
from lerobot_zenoh.server.session_table.records import SessionTableConfig
from lerobot_zenoh.server.session_table.table import SessionTable
from lerobot_zenoh.server.model.runner_adapter import RunnerAdapter
from lerobot_zenoh.server.model.failover import ServingRole
from lerobot_zenoh.server.session_table.rate_limit import RejectionRateLimit
from lerobot_zenoh.server.config.manifest import Manifest, ModelEntry
from lerobot_zenoh.server.model.routing import TaskRouting, task_streams
from lerobot_zenoh.server.runners.base import PolicyRunner
from lerobot_zenoh.transport.session import Publisher

log = logging.getLogger(__name__)

__all__ = ["RunsOn", "ServedModel"]

#: Builds who runs a model's requests from the model (`ServedModel(runs_on=...)`): the shell's, which
#: knows the kinds above this package (an `EngineExecutor`, or a `Dispatcher` for `engines`).
RunsOn = Callable[["ServedModel"], Any]


class ServedModel:
    """One manifest entry: its runner, session table, runner adapter, status and action publishers."""

    def __init__(self, manifest: Manifest, entry: ModelEntry, runner: PolicyRunner, server_id: str,
                 batch_profile_s: dict[int, float] | None = None,
                 codec_limits: codec.CodecLimits = codec.DEFAULT_LIMITS, same_host: SameHostAdvert | None = None,
                 *, incarnation: str | None = None, runs_on: RunsOn | None = None):
        """`incarnation`: the serving process's (its heartbeats name it); given, the model has its
        `ServingRole` (primary, or hot standby for `manifest.standby_for`), started by the shell.
        `runs_on`: who runs its requests, built from this model once everything else of it is: for
        an entry with `engines`, its dispatcher (`server/dispatch/`), else its one local executor
        (`server/engine/local.py`). Without them (a model built to test its parts) both are None."""
        self.entry = entry
        self.source = manifest.source  # (errors at start-up name the manifest file)
        self.app: AppKey = manifest.app_key(entry)
        self.runner = runner
        spec = runner.spec
        # `max_batch_size: auto`: the saturation point of the profile measured at start-up
        # (`batch_profile_s`, {batch size: seconds per pass}); 1 without a profile. A runner takes at
        # most `capabilities.max_batch` requests per call, whatever the manifest says.
        self.batch_profile_s = dict(batch_profile_s or {})
        if entry.max_batch_size == "auto":
            wanted = saturation_batch_size(self.batch_profile_s) if self.batch_profile_s else 1
        else:
            wanted = entry.max_batch_size
        cap = spec.capabilities.max_batch
        self.max_batch_size = wanted if cap is None else min(wanted, cap)
        if self.max_batch_size < wanted:
            log.warning("%s: %s runners take at most %d request(s) per pass; max_batch_size %d -> %d",
                        entry.model_id, spec.policy_type, cap, wanted, self.max_batch_size)
        actions_per_chunk = entry.actions_per_chunk or spec.chunk_size
        if actions_per_chunk > spec.chunk_size:
            raise ConfigError(
                f"server[{entry.model_id}].actions_per_chunk",
                f"{actions_per_chunk} is more than the model's chunk size {spec.chunk_size}",
                source=manifest.source,
            )
        self.actions_per_chunk = actions_per_chunk
        sessions = manifest.sessions
        # Unknown ids (`accept_unknown_clients`) share one cool-down: ids cost nothing to invent
        # (server/session_table/rate_limit.py). Listed ones are read at each call: a reload changes them.
        rate_limit = RejectionRateLimit(listed=lambda client_id: client_id in self.session_table.config.listed)
        self.session_table = SessionTable(SessionTableConfig(
            listed=frozenset(c.client_uuid for c in entry.clients),
            accept_unknown=entry.accept_unknown_clients,
            max_unknown_clients=entry.max_unknown_clients,
            idle_timeout_s=sessions.idle_timeout_s,
            liveliness_grace_s=sessions.liveliness_grace_s,
            max_message_bytes=codec_limits.max_message_bytes,
            max_batch_size=self.max_batch_size,
        ), entry.scheduler.build(f"server.{entry.model_id}.scheduler"), rate_limit)
        self.adapter = RunnerAdapter(self.app.prefix, runner, actions_per_chunk=actions_per_chunk,
                                     server_id=server_id, horizon=entry.horizon.build(spec.capabilities.refinement_kind),
                                     limits=codec_limits)
        self.status = Status(
            model_id=entry.model_id,
            model_version=entry.model_version,
            expected_cameras=dict(spec.cameras),
            action_dim=spec.action_dim,
            max_actions_per_chunk=actions_per_chunk,
            observation_features=spec.observation_features(),
            policy_type=spec.policy_type,
            fps=entry.fps,
            server_id=server_id,
            state_dim=spec.state_dim,
            action_names=tuple(spec.action_names),
            accepts_unknown_clients=entry.accept_unknown_clients,
            **spec.status_fields(),
            # Real-time chunking: observations may carry a prefix and a delay (docs/protocol.md §5.1).
            rtc=(RtcAdvert(entry.rtc.execution_horizon if entry.rtc.enabled else None) if spec.capabilities.rtc
                 else None),
            same_host=same_host,  # clients on this host and user send raw frames through /dev/shm
            refreshes=True,  # the session table keeps a refresh's place and drops a late one (protocol.md §10.7)
            streams_text=True if text_stream.writes_text(runner) else None,  # System 2 from the same prefill
            # The task's token limit of a runner that refuses a longer task (flow-matching VLAs, the
            # synthetic policy's simulation of one): a client checks it before it sends.
            max_task_tokens=getattr(runner, "max_task_tokens", None),
            refusals=True,  # a refused request of a client that asks is answered why (protocol.md §5.7)
        )
        self.status_bytes = codec.encode(self.status)
        self.publishers: dict[str, Publisher] = {}  # client id -> action publisher, closed with its session
        self.actions_dropped_closed = 0  # chunks dropped by publishers of sessions since closed
        # A query naming a client (`status?client=<id>`) learns whether this model serves it.
        self._status_for = {admitted: codec.encode(replace(self.status, client_admitted=admitted))
                            for admitted in (True, False)}
        # Primary or hot standby (server/model/failover.py), started by the shell once Zenoh is open.
        self.role: ServingRole | None = None if incarnation is None else ServingRole(
            f"{server_id}:{self.app.prefix}", manifest.standby_for, on_deactivate=self.session_table.drop_slots,
            incarnation=incarnation)
        self.standby_dropped = 0  # observations not admitted while standing by
        # Observations dropped in the Zenoh callback before the session table hears of them, by
        # reason (`client_id_too_long`); callbacks run on several Zenoh threads, hence the lock.
        self._refused_unread: Counter = Counter()
        self._refused_lock = threading.Lock()
        self.inferences = 0
        # What the model answers, on which topic (the runner's declared output, never probed).
        self.output = spec.capabilities.output
        self.topic = ANSWER_TOPICS[self.output]
        self.answers: Counter = Counter()  # answers published: "actions", "text", "verdict.<label>"
        self.answers_withheld = 0  # results the runner marked silent (fault injection)
        self.refusals_sent: Counter = Counter()  # Refusals published, by reason (Serving.refuse)
        self.refusals_withheld = 0  # refusals not sent: the session had one less than a second ago
        # Multi-model tasks (`entry.pipeline`, server/model/routing.py); None: a model of robots alone, which
        # never goes through task routing. Set (once) by a reload that gives it task streams.
        self.routing: TaskRouting | None = TaskRouting(task_streams(manifest, entry)) if entry.pipeline else None
        # The subscriptions (observations, client tokens) of its own app (None) and of each task stream.
        self.subscriptions: dict[str | None, list] = {}
        self.loop_faults = 0  # faults in its serving turn (logged with their traceback; the streak: the loop's)
        self.failed: str | None = None  # why it is no longer served (`PolicyServer._withdraw`)
        # Who runs its requests (`runs_on`, last: it is built from the finished model): for an entry
        # that lists `engines`, the dispatcher placing them across its engines; else its one local
        # executor, run by the inference thread.
        runs = runs_on(self) if runs_on is not None else None
        self.dispatcher = runs if entry.engines else None
        self.engine = None if entry.engines else runs

    def refuse_unread(self, reason: str) -> int:
        """Count an observation dropped in the callback, unread, for `reason`; returns the count so far."""
        with self._refused_lock:
            self._refused_unread[reason] += 1
            return self._refused_unread[reason]

    @property
    def refused_unread(self) -> dict[str, int]:
        """Observations dropped in the callback before the session table heard of them, by reason."""
        with self._refused_lock:
            return dict(self._refused_unread)

    @property
    def streams(self) -> dict:
        """The task streams it serves (task -> `routing.TaskStream`; empty without task routing)."""
        return self.routing.streams if self.routing is not None else {}

    @property
    def for_other_components(self) -> int:
        """Task-stream observations that asked another component (dropped unread, or once decoded)."""
        return self.routing.for_other_components if self.routing is not None else 0

    def status_reply(self, parameters: dict[str, str]) -> bytes:
        """The status bytes for a query (the status responder's thread); with `client=<id>`,
        `client_admitted` says if it is served; with `task=<percent-encoded task>`, `task_tokens` how
        many tokens the model's tokenizer makes of it (a task over `MAX_TASK_BYTES` is not counted:
        the client refuses it itself)."""
        client = parameters.get("client")
        config = self.session_table.config
        admitted = None if not client else bool(config.accept_unknown or client in config.listed)
        task = parameters.get("task")
        count = getattr(self.runner, "count_task_tokens", None)  # (runners with a task token limit)
        if task is not None and count is not None and len(task) <= 3 * MAX_TASK_BYTES:
            text = unquote(task)
            if len(text.encode()) <= MAX_TASK_BYTES:
                try:
                    tokens = int(count(text))
                except Exception as exc:  # noqa: BLE001 - a count is advice; the status still answers
                    log.debug("%s: task not counted: %s", self.app.prefix, exc)
                else:
                    return codec.encode(replace(self.status, client_admitted=admitted, task_tokens=tokens))
        if admitted is None:
            return self.status_bytes
        return self._status_for[admitted]
