"""The server watch: which server serves the robot, what it offers, and what to do when it goes quiet.

It owns:

- discovery and validation at start-up (``discover``: a status query, then the robot's features
  checked against the server's, docs/client.md "Start-up");
- what the serving server's status switches on (``use_status``): real-time chunking, the same-host
  path, re-fetch, the observation history length;
- the session nonce (docs/protocol.md, "Sessions"): drawn once per client, and drawn again after
  ``new_nonce_after_unanswered`` requests in a row got no chunk (timed out, or dropped by the
  watchdog), so a robot shut out of its server session (a session poisoned by a forged observation,
  one stuck as ``replayed``) starts a fresh one by itself;
- the watchdog (``tick``, on the receiver thread): no chunk for ``watchdog_timeout_s`` while a request
  waits, or the serving server's liveliness token gone -> ``revalidating``: status queries until a
  compatible server answers, the control loop holding the robot in its fail-safe meanwhile (it reads
  ``state``), then back to ``running`` with every outstanding request forgotten.

Constructed with the session it queries (anything with ``query(key, timeout_s=, parameters=)``, as
``transport.session.ZenohSession``); times that are compared are passed in (``tick(now_s)``).
"""

from __future__ import annotations

import logging
import secrets
import threading

from lerobot_zenoh.client.config import RobotClientConfig
from lerobot_zenoh.client.discovery import RobotFeatures, compare, discover, query_status, with_flag
from lerobot_zenoh.errors import CompatibilityError
from lerobot_zenoh.protocol.messages import Refusal
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.scheduling.chunk_intake import ChunkIntake, MergeMode
from lerobot_zenoh.scheduling.send_trigger import DEFAULT_REFETCH_AFTER_S, SendTrigger
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport import same_host

log = logging.getLogger(__name__)

__all__ = ["ServerWatch"]


class ServerWatch:
    """Args:
        config: the client's config (app key, fps, timeouts, what the user allows).
        session: what status queries go through.
        features: the robot's cameras, state and action names (checked against each status).
        trigger, intake: the send rule and the chunk intake the status configures (re-fetch, RTC).
        counters: watchdog events, revalidations, session renewals are counted here.
        stop: the client's stop event (discovery and revalidation give up when it is set).
        same_host_allowed, refetch_allowed: whether the task can use them at all (a multi-model
            task sends each observation to several servers: neither).
        on_refused: ``(refusal)`` when a re-validation finds that the server no longer serves this
            client id (delisted by a reload): the client stops on it, as on a permanent Refusal.
            None: it keeps re-querying.
    """

    def __init__(self, config: RobotClientConfig, session, features: RobotFeatures, *, trigger: SendTrigger,
                 intake: ChunkIntake, counters, stop: threading.Event, same_host_allowed: bool = True,
                 refetch_allowed: bool = True, on_refused=None) -> None:
        self.config = config
        self.session = session
        self.features = features
        self.trigger = trigger
        self.intake = intake
        self.counters = counters
        self.stop = stop
        self.same_host_allowed = same_host_allowed
        self.refetch_allowed = refetch_allowed
        self.on_refused = on_refused
        self.status = None
        self.serving_server_id: str | None = None  # the server whose chunks we get (failover follows it)
        self.state = "stopped"  # stopped | running | revalidating
        self.rtc_active = False  # the server advertises RTC and config.rtc.enabled
        # Raw frames through /dev/shm (the server's probe proved one host and user), and off for good
        # once shared memory failed here.
        self.same_host_active = False
        self._same_host_failed = False
        self.refetch_ok = False  # the server takes re-fetch refreshes (Status.refreshes)
        self.refetch_auto = False  # the default threshold: 100 ms, or the model's median time if longer
        self.history_length = 0  # raw observations of earlier steps each observation carries
        # Drawn per client, not per process: each client counts seq_ids from 1 (docs/protocol.md, "Sessions").
        self.session_nonce = secrets.randbits(63)
        # When the oldest request still without any chunk after it was sent (the watchdog's clock).
        self._waiting_since_s: float | None = None
        self._server_alive = threading.Event()
        self._server_lost = threading.Event()

    # -- start-up

    def discover(self, endpoints: str) -> None:
        """Find and validate the server; raises CompatibilityError (nothing was sent)."""
        cfg = self.config
        log.info("%s: looking for %s", cfg.client_uuid, cfg.app_key.status)
        status = discover(self.session, cfg.app_key, cfg.discovery_timeout_s, self.stop, client_uuid=cfg.client_uuid)
        if status is None and self.stop.is_set():
            raise CompatibilityError("stopped (SIGINT/SIGTERM) before a server answered")
        if status is None:
            where = f"connected to {endpoints}, but" if endpoints else ""
            raise CompatibilityError(f"{where} no server answers {cfg.app_key.status} within "
                                     f"{cfg.discovery_timeout_s:.0f} s (check --cluster_uuid, --experiment_tag, "
                                     "--model_id, --model_version, --application_tag against the server's manifest)"
                                     .strip())
        if status.client_admitted is False:
            raise CompatibilityError(f"--client_uuid: server {status.server_id} does not serve client {cfg.client_uuid!r}: list it "
                                     "under the model's `clients` in the server's manifest (or set accept_unknown_clients)")
        problems = compare(status, self.features, cfg.fps)
        if problems:  # (one line, each difference naming the flag to change: the caller prints it)
            raise CompatibilityError(f"server {status.server_id} is incompatible: "
                                     + "; ".join(with_flag(p) for p in problems))
        self.use_status(status)
        log.info("%s: server %s serves %s %s (%s), chunks of up to %d, real-time chunking %s", cfg.client_uuid,
                 status.server_id, status.model_id, status.model_version, status.policy_type,
                 status.max_actions_per_chunk, "on" if self.rtc_active else
                 ("off (--rtc.enabled=false)" if status.rtc is not None else "not offered"))
        log.info("%s: frames travel %s", cfg.client_uuid, "raw through /dev/shm (same host)" if self.same_host_active
                 else "as JPEG" + (" (--same_host=false)" if status.same_host is not None and not cfg.same_host else ""))

    def use_status(self, status) -> None:
        """Serve with `status`'s server: real-time chunking, the same-host path, re-fetch and the
        observation history follow it (a replacement may offer less, or serve another history length)."""
        cfg = self.config
        self.status = status
        self.serving_server_id = status.server_id
        self.rtc_active = cfg.rtc.enabled and status.rtc is not None
        # Re-fetch only toward a server that drops late refreshes (its status says `refreshes`): another would serve each
        # refresh as a new request, an inference apiece, exactly when it is overloaded. By default
        # not with RTC either: a refresh's delay is predicted from first-send RTTs, an overestimate.
        wanted = cfg.send.refetch_after_s
        if wanted is None:
            wanted = None if self.rtc_active else DEFAULT_REFETCH_AFTER_S
        self.refetch_ok = self.refetch_allowed and bool(status.refreshes) and bool(wanted)
        self.refetch_auto = self.refetch_ok and cfg.send.refetch_after_s is None
        self.trigger.refetch_after_s = wanted if self.refetch_ok else None
        if self.refetch_allowed and cfg.send.refetch_after_s and not status.refreshes:
            log.warning("%s: server %s does not take re-fetch refreshes (its status lacks `refreshes`): --send.refetch_after_s "
                        "is off while it serves", cfg.client_uuid, status.server_id)
        self.same_host_active = (self.same_host_allowed and cfg.same_host and not self._same_host_failed
                                 and same_host.probe_ok(status.same_host))
        self.intake.mode = MergeMode.RTC if self.rtc_active else MergeMode.BLEND
        self.history_length = max((status.history_length or 1) - 1, 0)

    def same_host_failed(self) -> None:
        """Shared memory failed here: JPEG over the network from now on, whatever a status offers."""
        self._same_host_failed, self.same_host_active = True, False

    # -- events (control loop, receiver thread, Zenoh callbacks)

    @property
    def running(self) -> bool:
        return self.state == "running"

    def note_request(self, now_s: float) -> None:
        """A request left (control loop): the watchdog's clock starts if nothing was waiting."""
        if self._waiting_since_s is None:
            self._waiting_since_s = now_s

    def note_chunk(self, server_id: str | None) -> None:
        """A chunk was accepted (receiver): nothing waits now; follow whoever answered."""
        self._waiting_since_s = None
        if server_id and server_id != self.serving_server_id:
            # A standby took over, or the primary came back: follow whoever answers.
            log.info("%s: now served by %s (was %s)", self.config.client_uuid, server_id, self.serving_server_id)
            self.serving_server_id = server_id
            self.counters.server_changes += 1

    def forget_waiting(self) -> None:
        """Nothing waits any more (a reset between episodes forgot the requests)."""
        self._waiting_since_s = None

    def on_liveliness(self, key: str, alive: bool) -> None:
        """Zenoh callback: a server token appeared (wake a re-validation) or ours vanished."""
        if alive:
            self._server_alive.set()
        elif key.rsplit("/", 1)[-1] == self.serving_server_id:
            self._server_lost.set()

    # -- the watchdog (receiver thread)

    def tick(self, now_s: float) -> None:
        """Renew the session after too many unanswered requests; re-validate a silent or lost server."""
        if self.state != "running":
            return
        cfg = self.config
        limit = cfg.new_nonce_after_unanswered
        if limit and self.trigger.unanswered_in_a_row >= limit:
            self.renew_session(f"{self.trigger.unanswered_in_a_row} requests in a row got no chunk")
        waiting_since = self._waiting_since_s
        silent = waiting_since is not None and now_s - waiting_since > cfg.watchdog_timeout_s
        lost = self._server_lost.is_set()
        if not (silent or lost):
            return
        self.counters.watchdog_events += 1
        if worth_logging(self.counters.watchdog_events):  # a server cooling this client down: not every time
            log.warning("%s: %s; re-validating [%d so far]", cfg.client_uuid,
                        "server liveliness lost" if lost else f"no action chunk for {cfg.watchdog_timeout_s:.1f} s",
                        self.counters.watchdog_events)
        self.state = "revalidating"
        self.revalidate()

    def renew_session(self, why: str) -> None:
        """Draw a new session nonce: the server counts this client's seq_ids afresh (and resets its
        per-episode state); requests sent under the old nonce are forgotten."""
        old = self.session_nonce
        self.session_nonce = secrets.randbits(63)
        self.trigger.forget_outstanding()
        self.trigger.reset_unanswered()
        self._waiting_since_s = None
        self.counters.session_renewals += 1
        if worth_logging(self.counters.session_renewals):
            log.warning("%s: %s: new session nonce (was %d) [%d renewals]", self.config.client_uuid, why, old,
                        self.counters.session_renewals)

    def revalidate(self) -> None:
        """Query status until a compatible server answers; the control loop keeps holding meanwhile."""
        cfg = self.config
        shown = None  # the incompatibility last logged: each is shown once, not at every query
        while not self.stop.is_set():
            self.counters.revalidations += 1
            self._server_alive.clear()
            status = query_status(self.session, cfg.app_key, timeout_s=0.3, client_uuid=cfg.client_uuid)
            if status is not None:
                problems = compare(status, self.features, cfg.fps)
                if not problems:
                    if status.server_id != (self.status.server_id if self.status else None):
                        log.info("%s: now served by %s", cfg.client_uuid, status.server_id)
                    self.use_status(status)
                    self._server_lost.clear()
                    self._waiting_since_s = None
                    self.trigger.forget_outstanding()  # requests to a dead server will never be answered
                    self.state = "running"
                    log.info("%s: server %s valid again; resuming", cfg.client_uuid, status.server_id)
                    return
                if status.client_admitted is False and self.on_refused is not None:  # delisted: it will not change
                    self.on_refused(Refusal(0, Reason.UNKNOWN_CLIENT, f"server {status.server_id} no longer serves "
                                            f"client {cfg.client_uuid!r} (not in its manifest's clients)",
                                            permanent=True, server_id=status.server_id))
                    return
                if problems != shown:
                    shown = problems
                    log.error("%s: server %s is now incompatible: %s", cfg.client_uuid, status.server_id,
                              "; ".join(problems))
            self._server_alive.wait(0.2)  # a token appearing wakes us at once
