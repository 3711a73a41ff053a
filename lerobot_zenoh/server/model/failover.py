"""Hot standby (docs/reliability.md; after Rosa section 3.4.4): whether this server serves a model right now.

A primary serves from start-up. A standby (manifest `standby_for: <primary server_id>`) pre-warms
the same models and announces itself with its own liveliness token, but serves nobody (it drops
observations and stays silent on status queries) while its primary is up and serving.

At start-up a standby judges nothing from one early query (a liveliness `get` can be answered from
its own session's incomplete view before the transport routes): `StartupJudge` stands it by until
the primary is heard (its heartbeat or its token: stand by), or the transport is shown to route (a
robot's observation or another server's heartbeat reached it) and the primary stayed silent for
`TAKEOVER_AFTER_S` since, or `STARTUP_GRACE_S` passed; only then may it take over. And a standby
that serves while its primary's heartbeat says it serves too steps back at its next heartbeat tick
(`primary_found_serving`), so two servers never keep answering one robot.

It takes over:

- when the primary's liveliness token vanishes (process killed, host or network gone, lease
  expired), at once; it steps back when the token reappears;
- when the primary stops serving while its token stays: frozen (SIGSTOP, a hung host), a stuck
  inference loop, a dead GPU. Every server publishes a heartbeat of served work (`Beat`, ten a
  second, `<app>/server/<id>/heartbeat`): the work it has waiting and a counter of its serving turns
  that did work. `ServedWorkWatch` (pure) calls the primary stalled when work is pending and
  nothing has been served for `TAKEOVER_AFTER_S`, or for `SLOW_TURN_SLACK` times its slowest recent
  turn if that is longer (a slow model is not a stuck one). A frozen process sends no heartbeat at
  all (a slow batch does: the heartbeat has its own thread); then robots' observations reaching the
  standby are the pending work. An idle primary is never taken over: no work pending, nothing to
  prove. A standby that never heard a heartbeat (an older primary, an ACL that does not pass them)
  decides by the token alone.

Exactly one server serves at a time, so a client never gets two chunks for one observation:
- a primary that starts while other servers of its app are alive waits `handover_grace_s` before
  serving, long enough for the standby to see it and stop;
- a standby that replaced a stalled primary names it (server and incarnation) in its heartbeat; the
  replaced primary, on hearing it, withdraws (token undeclared, `failed`; its supervisor restarts
  it) and the standby ignores that incarnation's token and heartbeats. It steps back only for a new
  incarnation: a restarted primary;
- a primary that finds it was frozen (its own heartbeat thread missed `TAKEOVER_AFTER_S`) holds its
  answers for `RESUME_HOLD_S`, and until it has heard again every server it heard before the freeze
  (at most `RESUME_HOLD_MAX_S`): long enough to hear the standby that may have replaced it. It never
  publishes an answer to an observation that arrived before the freeze, its own runner's or one its
  remote engines computed (`answer_check`, the one rule for both: `ServingRole.may_publish`, asked
  again by the publisher's thread just before the bytes go to Zenoh), and it believes a
  replacement claim for `CLAIM_WINDOW_S` after a freeze or a stall, so one heard late (a link that
  reconnects after the freeze) still withdraws it.

A heartbeat's sender is the `<server_id>` of the key it arrived on (the key the access control lets
only that server put on), never the `source_id` written in it: a beat whose `source_id` differs from
its key is refused and counted (`heartbeats_refused.heartbeat_identity`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from lerobot_zenoh.errors import ProtocolError, TransportError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import HEARTBEAT, parse_key
from lerobot_zenoh.protocol.messages import Telemetry
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.telemetry.publisher import worth_logging
from lerobot_zenoh.transport.session import METRICS_QOS

log = logging.getLogger(__name__)

#: How often every server publishes its heartbeat (and a standby judges its primary).
HEARTBEAT_PERIOD_S = 0.1
#: Work pending and nothing served for this long (or no heartbeat for this long): the primary is stalled.
TAKEOVER_AFTER_S = 1.0
#: ... or for this many times the primary's slowest recent serving turn, when that is longer.
SLOW_TURN_SLACK = 3.0
#: A primary that was frozen longer than TAKEOVER_AFTER_S holds its answers at least this long on
#: waking, and until it has heard again the servers it heard before (at most RESUME_HOLD_MAX_S).
RESUME_HOLD_S = 0.5
RESUME_HOLD_MAX_S = 3.0
#: Servers heard this long before a freeze are waited for on waking.
PEER_RECENT_S = 2.0
#: A replacement claim is believed this long after this server froze or stalled (a link that reconnects
#: after a freeze past the Zenoh lease, 10 s by default, brings the standby's claim late).
CLAIM_WINDOW_S = 30.0
#: A standby that neither heard its primary nor saw its transport route judges after this long anyway.
STARTUP_GRACE_S = 3.0
#: Serving turns whose duration gives the slowest recent turn.
TURN_WINDOW = 32
#: Senders whose newest heartbeat is kept between two ticks (each model; its primary's always is).
MAX_SENDERS = 32
#: A heartbeat is a few hundred bytes; a larger one is not decoded. A slowest turn over this is not believed.
MAX_BEAT_BYTES = 4096
MAX_TURN_S = 600.0


class StartupJudge:
    """A standby's first judgement of its primary (pure; times passed in).

    One liveliness query at start-up cannot tell "no primary" from "my transport does not route
    yet": Zenoh can answer it from the session's own, still empty, view. So the standby waits for
    evidence: the primary heard (a heartbeat, or its token) means stand by; otherwise the
    transport must have been seen to route (`on_routed`: a robot's observation or another server's
    heartbeat reached this standby) and the primary must have stayed unheard for `quiet_s` since —
    ten of its heartbeat periods — or the start-up grace `grace_s` must have passed."""

    def __init__(self, started_s: float, grace_s: float = STARTUP_GRACE_S, quiet_s: float = TAKEOVER_AFTER_S):
        self.started_s = started_s
        self.grace_s = grace_s
        self.quiet_s = quiet_s
        self.routed_s: float | None = None  # first evidence that the transport routes

    def on_routed(self, now_s: float) -> None:
        if self.routed_s is None:
            self.routed_s = now_s

    def verdict(self, now_s: float, primary_heard: bool, token: bool | None) -> str | None:
        """`standby` (the primary is there), `gone: <why>` (take over), or None (not yet).

        `primary_heard`: a heartbeat of the primary reached this standby; `token`: its liveliness
        token as last reported (None: never reported; False: it vanished)."""
        if primary_heard or token:
            return "standby"
        if token is False:
            return "gone: its liveliness token vanished"
        if self.routed_s is not None and now_s - self.routed_s >= self.quiet_s:
            return f"gone: not heard for {now_s - self.routed_s:.2f} s while the transport routes"
        if now_s - self.started_s >= self.grace_s:
            return f"gone: not heard in the {self.grace_s:.1f} s start-up grace"
        return None


class ServingRole:
    def __init__(self, name: str, standby_for: str | None, on_deactivate: Callable[[], None] = lambda: None,
                 incarnation: str = ""):
        self.name = name
        self.standby_for = standby_for
        self.incarnation = incarnation  # this process's: new at every start
        self.active = threading.Event()
        self.takeovers = 0
        self.takeovers_stalled = 0  # of those, of a primary whose token was there but that served no more
        self.stepped_back = 0
        self.primary_found_serving = 0  # of those, on hearing the primary's heartbeat say it serves too
        self._on_deactivate = on_deactivate
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.failed = False  # its server can no longer serve it: it never serves again
        # Set when this standby took over a stalled primary: "<server_id>/<incarnation>" of the one replaced.
        self.replaced: str | None = None
        # A standby's first judgement, until it is made (`start_standby`, `judge_startup`); None: judged.
        self.startup: StartupJudge | None = None
        self.startup_judged_s: float | None = None  # how long the first judgement took
        self.primary_token: bool | None = None  # the primary's token as last reported (None: never)
        # Served work, for the heartbeat: turns of the inference loop that did work, their durations.
        self.served_turns = 0
        self._turn_s: deque[float] = deque(maxlen=TURN_WINDOW)
        self.hold_until_s = 0.0  # (monotonic) answers held until then: woken from a freeze
        self.woke_s = -math.inf  # (monotonic) when this process was last found to have been frozen
        self.stalled_s = -math.inf  # (monotonic) when it was last frozen or stalled: a replacement claim may be true
        self.replacement_claims_ignored = 0  # heartbeats saying a standby replaced this server, which had not stalled
        self.heartbeats_refused = 0  # other servers' heartbeats refused (all reasons)
        self.heartbeats_refused_by: Counter[str] = Counter()  # ... by reason
        self.heartbeats_superseded = 0  # beats replaced by their sender's newer one before a tick read them
        self._beats_counted = threading.Lock()  # (Zenoh's threads and the heartbeat thread count at once)
        self.beat_tick_s: float | None = None  # last tick of the heartbeat thread (None: none runs)
        self.answers_held = 0  # computed answers not published: woken from a freeze, or replaced meanwhile

    @property
    def is_standby(self) -> bool:
        return self.standby_for is not None

    def refuse_heartbeat(self, reason: str) -> None:
        with self._beats_counted:
            self.heartbeats_refused += 1
            self.heartbeats_refused_by[reason] += 1

    def supersede_heartbeat(self) -> None:
        with self._beats_counted:
            self.heartbeats_superseded += 1

    # -- served work ------------------------------------------------------------------------

    def note_turn(self, duration_s: float | None = None) -> None:
        """The inference loop did work for this model (a batch served: its duration)."""
        self.served_turns += 1
        if duration_s is not None:
            self._turn_s.append(duration_s)

    @property
    def slowest_turn_s(self) -> float:
        return max(self._turn_s, default=0.0)

    def may_serve(self, now_s: float) -> bool:
        """Whether answers may go out now: active, not held after a freeze, and the heartbeat thread
        has ticked recently (the inference thread may wake from a SIGSTOP before it)."""
        if not self.active.is_set() or now_s < self.hold_until_s:
            return False
        tick = self.beat_tick_s
        return tick is None or now_s - tick <= TAKEOVER_AFTER_S

    def may_publish(self, arrival_s: float, now_s: float) -> bool:
        """Whether the answer to an observation that arrived at `arrival_s` may go out now: `may_serve`,
        and the observation arrived after this process last woke from a freeze (an answer computed
        before a freeze is stale: a standby may have served that robot since). Checked when the answer
        is ready and again by the publisher's thread just before it hands the bytes to Zenoh; a
        refusal is counted in `answers_held`."""
        if self.may_serve(now_s) and arrival_s > self.woke_s:
            return True
        self.answers_held += 1
        return False

    def woke(self, now_s: float, hold_until_s: float) -> None:
        """The heartbeat thread found that this process did not run for longer than a standby waits."""
        self.woke_s = self.stalled_s = now_s
        self.hold_until_s = hold_until_s

    # -- primary ----------------------------------------------------------------------------

    def start_primary(self, others_alive: bool, grace_s: float) -> None:
        if not others_alive or grace_s <= 0:
            self.active.set()
            return
        log.info("%s: other servers are up; serving in %.2f s (hand-over grace)", self.name, grace_s)
        self._timer = threading.Timer(grace_s, self._activate)
        self._timer.daemon = True
        self._timer.start()

    def _activate(self) -> None:
        with self._lock:
            if not self.failed:
                self.active.set()

    def fail(self) -> None:
        """This server can no longer serve (its loop failed, or it was replaced): stop now and never serve again."""
        with self._lock:
            self.failed = True
            if self._timer is not None:
                self._timer.cancel()
            self.active.clear()
            self._on_deactivate()

    # -- standby ----------------------------------------------------------------------------

    def start_standby(self, now_s: float) -> None:
        """Stand by until the first judgement (`judge_startup`, from the heartbeat thread)."""
        with self._lock:
            self.startup = StartupJudge(now_s)

    def judge_startup(self, now_s: float, primary_heard: bool) -> None:
        """The first judgement, once there is evidence (`StartupJudge`): stand by, or take over."""
        with self._lock:
            judge = self.startup
            if judge is None or self.failed:
                return
            verdict = judge.verdict(now_s, primary_heard, self.primary_token)
            if verdict is None:
                return
            self.startup = None
            self.startup_judged_s = now_s - judge.started_s
            if verdict == "standby":
                log.info("%s: primary %s is up (judged in %.2f s); standing by", self.name, self.standby_for,
                         self.startup_judged_s)
                return
            self.active.set()
            self.takeovers += 1
            log.warning("%s: primary %s is %s (judged in %.2f s); taking over", self.name, self.standby_for,
                        verdict, self.startup_judged_s)

    def on_primary(self, alive: bool) -> None:
        """A standby learns that its primary's token appeared (alive) or vanished."""
        with self._lock:
            self.primary_token = alive
            if self.failed or self.startup is not None:  # (before the first judgement: evidence only)
                return
            if alive and self.active.is_set():
                if self.replaced is not None:
                    log.info("%s: the token of %s is back, but this standby replaced that process (stalled);"
                             " serving until a restarted primary is heard", self.name, self.replaced)
                    return
                self._step_back(f"primary {self.standby_for} is back")
            elif not alive and not self.active.is_set():
                self.active.set()
                self.takeovers += 1
                log.warning("%s: primary %s is gone; taking over", self.name, self.standby_for)

    def take_over_stalled(self, incarnation: str, why: str) -> None:
        """The primary's token is there but it serves no more (`ServedWorkWatch`): serve in its place."""
        with self._lock:
            if self.failed or self.active.is_set() or self.startup is not None:
                return
            self.replaced = f"{self.standby_for}/{incarnation}"
            self.active.set()
            self.takeovers += 1
            self.takeovers_stalled += 1
            log.warning("%s: primary %s stalled (%s); taking over", self.name, self.standby_for, why)

    def on_primary_incarnation(self, incarnation: str) -> None:
        """A heartbeat of the primary: a new incarnation (a restart) takes back what a stalled one lost."""
        with self._lock:
            if (self.replaced is not None and self.active.is_set() and not self.failed
                    and self.replaced != f"{self.standby_for}/{incarnation}"):
                self._step_back(f"primary {self.standby_for} restarted")

    def on_primary_serving(self) -> None:
        """A heartbeat of the primary says it serves while this standby serves too (it took over one it
        could not hear yet, or across a partition): two servers answer every robot, so step back now.
        Not for the process this standby replaced (it withdraws on hearing this standby), nor for beats
        still in flight from a primary whose token vanished (it is dead)."""
        with self._lock:
            if self.active.is_set() and self.replaced is None and not self.failed and self.primary_token is not False:
                self.primary_found_serving += 1
                self._step_back(f"primary {self.standby_for} is serving ({self.primary_found_serving} such "
                                "step-backs so far)")

    def _step_back(self, why: str) -> None:
        self.active.clear()
        self.replaced = None
        self.stepped_back += 1
        log.warning("%s: %s; standing by", self.name, why)
        self._on_deactivate()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def answer_check(role: ServingRole | None, arrival_s: float,
                 clock: Callable[[], float] = time.monotonic) -> Callable[[], bool] | None:
    """The one rule for every answer this server publishes, its own runner's and its remote engines'
    relayed (`server/dispatch/answer_relay.py`): the answer to an observation that arrived at
    `arrival_s` (on `clock`, the monotonic clock) goes out only while `role.may_publish` says so.
    Ask the check when the answer is ready, then hand it to the publisher as `valid`: the
    publisher's thread asks again just before the bytes go to Zenoh, so a freeze in between lets
    nothing stale out. None: no role (a model built without one): nothing to check."""
    if role is None:
        return None
    return lambda: role.may_publish(arrival_s, clock())


@dataclass(frozen=True)
class Beat:
    """One heartbeat of one server for one model: what it serves and how its work goes."""

    server_id: str
    incarnation: str
    serving: bool
    served: int  # turns of its inference loop that did work (a counter)
    waiting: int  # observations waiting or being computed
    slowest_turn_s: float  # of its recent serving turns
    replaces: str | None = None  # "<server_id>/<incarnation>" of a stalled primary this standby replaced

    def encode(self, seq: int, uptime_s: float) -> bytes:
        labels = {"incarnation": self.incarnation}
        if self.replaces is not None:
            labels["replaces"] = self.replaces
        return codec.encode(Telemetry(
            "server", self.server_id, seq, uptime_s, HEARTBEAT_PERIOD_S,
            metrics={"serving": int(self.serving), "served": self.served, "waiting": self.waiting,
                     "slowest_turn_s": self.slowest_turn_s}, labels=labels))

    @staticmethod
    def decode(payload: bytes, sender: str | None = None) -> Beat:
        """The beat in `payload`; `sender`: the server id of the key it arrived on, which must be the
        one the beat names (`identity`: the access control lets each server put on its own key only,
        so the key, not what a sender writes, says who sent it)."""
        if len(payload) > MAX_BEAT_BYTES:
            raise ProtocolError(Reason.TOO_LARGE, f"a heartbeat of {len(payload)} bytes (at most {MAX_BEAT_BYTES})")
        msg = codec.decode_telemetry(payload)
        if msg.source != "server":
            raise ProtocolError(Reason.NOT_A_HEARTBEAT, f"telemetry of a {msg.source[:32]!r}, not of a server")
        if sender is not None and msg.source_id != sender:
            raise ProtocolError(Reason.HEARTBEAT_IDENTITY, f"a heartbeat naming {msg.source_id[:64]!r} on the key of {sender!r}")
        m = msg.metrics

        def number(name: str) -> float:  # (a NaN or an infinity would raise in int(): never past here)
            value = m.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ProtocolError(Reason.HEARTBEAT_OUT_OF_RANGE, f"a heartbeat's {name} is not a finite number")
            return float(value)

        beat = Beat(msg.source_id, msg.labels.get("incarnation", ""), bool(number("serving")), int(number("served")),
                    int(number("waiting")), number("slowest_turn_s"), msg.labels.get("replaces"))
        if not (beat.served >= 0 and beat.waiting >= 0 and 0.0 <= beat.slowest_turn_s <= MAX_TURN_S):
            raise ProtocolError(Reason.HEARTBEAT_OUT_OF_RANGE, f"a heartbeat out of range (served {beat.served}, waiting {beat.waiting}, "
                                f"slowest turn {beat.slowest_turn_s} s)")
        return beat


class ServedWorkWatch:
    """A standby's judgement of its primary from its heartbeats and the work it sees (pure; times passed in).

    Stalled, when the primary serves (its last heartbeat said so) and
    - its heartbeats stopped for `takeover_after_s` while work is pending (it said it had work
      waiting, or an observation reached the standby since): frozen, or cut off; a slow batch does not
      stop heartbeats;
    - or its heartbeats go on, it has work waiting, and its served counter has not moved for
      `max(takeover_after_s, slack * slowest recent turn)`: a stuck loop or a dead device.
    Work waiting is counted from the last heartbeat that showed progress or nothing waiting."""

    def __init__(self, takeover_after_s: float = TAKEOVER_AFTER_S, slack: float = SLOW_TURN_SLACK):
        self.takeover_after_s = takeover_after_s
        self.slack = slack
        self.last: Beat | None = None  # the primary's last heartbeat (None: never heard one)
        self.last_beat_s = 0.0
        self.progress_s = 0.0  # when progress (or nothing waiting) was last seen
        self.work_seen_s: float | None = None  # an observation reached the standby after the last heartbeat

    def on_beat(self, beat: Beat, now_s: float) -> None:
        last = self.last
        if (last is None or beat.incarnation != last.incarnation or beat.served != last.served
                or beat.waiting == 0 or not beat.serving):
            self.progress_s = now_s
        self.last, self.last_beat_s, self.work_seen_s = beat, now_s, None

    def forget(self) -> None:
        """Start afresh (a standby that stepped back): what was heard before it served is stale, and
        would judge a restarted primary stalled before its first heartbeat."""
        self.last, self.work_seen_s = None, None

    def on_work(self, now_s: float) -> None:
        """An observation reached the standby (and was dropped: it stands by)."""
        if self.work_seen_s is None:
            self.work_seen_s = now_s

    def verdict(self, now_s: float) -> str | None:
        """Why the primary counts as stalled now; None while it is not (or cannot be judged)."""
        beat = self.last
        if beat is None or not beat.serving:
            return None  # never heard (judged by its token alone), or not serving (hand-over grace)
        silent_s = now_s - self.last_beat_s
        if silent_s > self.takeover_after_s:
            if beat.waiting > 0 or self.work_seen_s is not None:
                return f"no heartbeat for {silent_s:.2f} s with work pending"
            return None  # idle: nothing to prove
        limit_s = max(self.takeover_after_s, self.slack * beat.slowest_turn_s)
        stuck_s = now_s - self.progress_s
        if beat.waiting > 0 and stuck_s > limit_s:
            return f"{beat.waiting} waiting and nothing served for {stuck_s:.2f} s (limit {limit_s:.2f} s)"
        return None


class Heartbeats:
    """The heartbeat thread of a server: publishes each model's `Beat`, reads the others', and acts.

    `models`: the served models (each with `app`, `role`, `session_table`, `standby_dropped`);
    `withdraw(model, why)`: ends this server's service of a model (a replaced primary)."""

    def __init__(self, session, server_id: str, models: list, withdraw: Callable[[object, str], None],
                 period_s: float = HEARTBEAT_PERIOD_S):
        self.session = session
        self.server_id = server_id
        self.models = models
        self.withdraw = withdraw
        self.period_s = period_s
        # Each sender's newest heartbeat since the last tick, per model (its key's server id -> payload):
        # a beat is a snapshot, so a flood on one key replaces that key's beat and crowds out no other's.
        self._latest: list[dict[str, bytes]] = [{} for _ in models]
        self._latest_lock = threading.Lock()
        self._watches = [ServedWorkWatch() for _ in models]
        self._dropped_seen = [0] * len(models)
        self._was_active = [False] * len(models)
        self._turns_seen = [0] * len(models)
        self._progress_s = [time.monotonic()] * len(models)  # when each model was last idle or served
        self._peers_s: list[dict[str, float]] = [{} for _ in models]  # other servers heard: when last
        self._awaited: list[set[str]] = [set() for _ in models]  # woken from a freeze: servers not heard again yet
        self._hold_min_s = [0.0] * len(models)  # ... and the shortest hold
        self._primary_heard = [False] * len(models)  # (a standby before its first judgement)
        self._publishers = []
        self._subscriptions = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._seq = 0
        self._t0 = time.monotonic()
        self._last_tick_s: float | None = None

    def start(self) -> Heartbeats:
        for i, model in enumerate(self.models):
            self._publishers.append(self.session.publisher(model.app.server_heartbeat(self.server_id), METRICS_QOS))
            self._subscriptions.append(self.session.subscribe(
                model.app.all_server_heartbeats, lambda key, payload, i=i: self._on_beat(i, key, payload)))
        self._thread.start()
        return self

    def _on_beat(self, i: int, key: str, payload: bytes) -> None:
        """Zenoh callback: keep a heartbeat as its sender's newest (the sender is the server id of its
        key) for the heartbeat thread; one larger than any heartbeat, on a key that is no heartbeat
        key, or from a sender beyond `MAX_SENDERS` (its primary's never) is dropped here, counted; one a newer
        beat of its sender replaces before the tick reads it is counted as superseded (not refused)."""
        role = self.models[i].role
        if len(payload) > MAX_BEAT_BYTES:
            role.refuse_heartbeat(Reason.TOO_LARGE)
            return
        sender = _sender(key)
        if sender is None:
            role.refuse_heartbeat(Reason.HEARTBEAT_KEY)
            return
        with self._latest_lock:
            latest = self._latest[i]
            unread = sender in latest
            kept = unread or len(latest) < MAX_SENDERS or sender == role.standby_for
            if kept:
                latest[sender] = payload
        if not kept:
            role.refuse_heartbeat(Reason.HEARTBEAT_SENDERS)
        elif unread:  # the beat it replaced came before the tick read it: dropped unread, not refused
            role.supersede_heartbeat()

    def _may_have_stalled(self, i: int, now_s: float) -> bool:
        """Whether a standby could rightly have replaced this server's model `i`: this process froze or
        work waited with no turn served for as long as a standby waits before it takes over
        (`ServedWorkWatch`), now or within `CLAIM_WINDOW_S`."""
        role = self.models[i].role
        return now_s < role.hold_until_s or self._stalled(i, now_s) or now_s - role.stalled_s <= CLAIM_WINDOW_S

    def _stalled(self, i: int, now_s: float) -> bool:
        role = self.models[i].role
        return now_s - self._progress_s[i] >= max(TAKEOVER_AFTER_S, SLOW_TURN_SLACK * role.slowest_turn_s)

    def heard_primary(self, i: int) -> bool:
        """Whether model `i`'s standby has heard its primary's heartbeat (it then decides by served work)."""
        return self._watches[i].last is not None

    def close(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        for sub in self._subscriptions:
            sub.close()
        for model in self.models:
            model.role.beat_tick_s = None

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period_s):
                try:
                    self.tick(time.monotonic())
                except (TransportError, OSError) as exc:
                    log.warning("heartbeat: %s", exc)
        except BaseException:
            log.exception("the heartbeat thread died; failover falls back to liveliness alone")
            for model in self.models:
                model.role.beat_tick_s = None  # answers must not wait on a thread that is gone
            raise

    def tick(self, now_s: float) -> None:
        """One period: notice a freeze of this process, read the heartbeats received, judge the
        primary (standby), publish this server's heartbeats."""
        last_tick_s = self._last_tick_s
        frozen_s = None if last_tick_s is None else now_s - last_tick_s
        self._last_tick_s = now_s
        for i, model in enumerate(self.models):
            if frozen_s is not None and frozen_s > TAKEOVER_AFTER_S and model.role.active.is_set():
                self._awaited[i] = {s for s, t in self._peers_s[i].items() if last_tick_s - t <= PEER_RECENT_S}
                self._hold_min_s[i] = now_s + RESUME_HOLD_S
                model.role.woke(now_s, now_s + RESUME_HOLD_MAX_S)
                log.warning("%s: this process did not run for %.2f s (frozen?); answers to what arrived before are "
                            "dropped, the others held until %s heard again (at most %.1f s)", model.role.name,
                            frozen_s, sorted(self._awaited[i]) or "no other server", RESUME_HOLD_MAX_S)
            model.role.beat_tick_s = now_s
        with self._latest_lock:
            received, self._latest = self._latest, [{} for _ in self.models]
        for i, sender, payload in ((i, s, p) for i, latest in enumerate(received) for s, p in latest.items()):
            if sender == self.server_id:
                continue  # its own
            try:
                beat = Beat.decode(bytes(payload), sender)
            except ProtocolError as exc:  # another version's, not a heartbeat, out of range, another's name
                self.models[i].role.refuse_heartbeat(str(exc.reason))
                if worth_logging(self.models[i].role.heartbeats_refused):
                    log.warning("%s: a heartbeat refused on the key of %s: %s (%d refused so far)",
                                self.models[i].role.name, sender, exc, self.models[i].role.heartbeats_refused)
                continue
            self._heard(i, beat, now_s)
        for i, model in enumerate(self.models):
            role = model.role
            if now_s < role.hold_until_s and not self._awaited[i] and now_s >= self._hold_min_s[i]:
                role.hold_until_s = now_s  # every server heard before the freeze was heard again
            active = role.active.is_set()
            if self._was_active[i] and not active:
                self._watches[i].forget()  # stepped back: judged afresh from the primary's next heartbeat
            self._was_active[i] = active
            if role.is_standby and not active and not role.failed:
                if model.standby_dropped != self._dropped_seen[i]:
                    self._watches[i].on_work(now_s)
                    if role.startup is not None:
                        role.startup.on_routed(now_s)  # a robot's observation reached this standby
                if role.startup is not None:
                    role.judge_startup(now_s, self._primary_heard[i])
                else:
                    why = self._watches[i].verdict(now_s)
                    if why is not None:
                        role.take_over_stalled(self._watches[i].last.incarnation, why)
            self._dropped_seen[i] = model.standby_dropped
            self._seq += 1
            waiting = model.session_table.waiting(computing=True)
            if waiting == 0 or role.served_turns != self._turns_seen[i]:
                self._progress_s[i] = now_s  # idle, or serving: nothing a standby could have replaced
            elif self._stalled(i, now_s):
                role.stalled_s = now_s
            self._turns_seen[i] = role.served_turns
            beat = Beat(self.server_id, role.incarnation, role.active.is_set(), role.served_turns,
                        waiting, role.slowest_turn_s, role.replaced)
            self._publishers[i].put(beat.encode(self._seq, now_s - self._t0))

    def _heard(self, i: int, beat: Beat, now_s: float) -> None:
        model, watch = self.models[i], self._watches[i]
        role = model.role
        self._peers_s[i][beat.server_id] = now_s
        self._awaited[i].discard(beat.server_id)
        if role.startup is not None:
            role.startup.on_routed(now_s)  # another server's heartbeat reached this standby
        if beat.serving and beat.replaces == f"{self.server_id}/{role.incarnation}" and not role.failed:
            if self._may_have_stalled(i, now_s):
                self.withdraw(model, f"replaced by standby {beat.server_id} after this server stalled")
            else:  # this process ran and served: a forged or mistaken claim costs it nothing
                role.replacement_claims_ignored += 1
                if worth_logging(role.replacement_claims_ignored):
                    log.warning("%s: %s says it replaced this server, which has not stalled; ignored (%d so far)",
                                role.name, beat.server_id[:64], role.replacement_claims_ignored)
            return
        if role.standby_for != beat.server_id:
            return
        if role.replaced == f"{beat.server_id}/{beat.incarnation}":
            return  # the stalled process it replaced, woken: it withdraws on hearing this standby
        self._primary_heard[i] = True
        watch.on_beat(beat, now_s)
        role.on_primary_incarnation(beat.incarnation)
        if beat.serving:
            role.on_primary_serving()


def _sender(key: str) -> str | None:
    """The server id of a heartbeat key, `<app>/server/<server_id>/heartbeat` (None for another key)."""
    try:
        parsed = parse_key(key)
    except ValueError:
        return None
    return parsed.server_id if parsed.topic == HEARTBEAT else None
