"""When the robot client sends its next observation, and the RTT bookkeeping behind it.

docs/client.md, "Timing: send trigger, RTT and trimming", describes the behaviour.

Pure decision objects with an injected clock: every method that depends on time takes ``now_s``
(seconds from one process's ``time.perf_counter()``), and nothing here reads a clock, sleeps or
does I/O. Both classes are shared by the thread that sends observations and the thread that
receives action chunks, so each guards its state with a lock held only for a few dictionary
operations.

Requests in flight (``scheduling/in_flight.py``)
    One table, seq_id -> request record (first send, last publication, captures, refreshes, nonce),
    behind one lock. The trigger writes it (``on_send``, ``on_refresh``), frees slots in it (``receive``,
    time-outs) and reads it (how many are outstanding, which is due for a refresh); the RTT estimate
    and the chunk intake read the same :meth:`SendTrigger.receive` answer.

RTT (:class:`RttTracker`)
    A chunk answering ``response_to_seq_id`` resolves exactly that key to its request and yields the
    round trip from the request's first send. Older keys are kept: with best-effort transport replies
    can arrive out of order, and forgetting every key ``<=`` the one received would make their RTT
    unmeasurable. The last ``window`` samples give p50/p90/p99. Pass the time the
    observation was *captured* as ``now_s`` of ``on_send`` if you want the RTT to cover everything
    between sensing and acting.

Stale steps (:func:`expired_steps`)
    ``int(rtt_s / dt_s)``, and 0 before the first RTT (the first chunk is applied whole;
    docs/client.md).

The send rule (:class:`SendTrigger`)
    Send when ``queue_size * dt_s < buffer_time_s`` and fewer than ``max_in_flight`` requests
    are outstanding (and, with ``max_rate_hz``, at least ``1 / max_rate_hz`` after the last send: a
    planned request rate the robot keeps even when its server is faster than planned). ``queue_size * dt_s`` is how long the buffered actions last; the next chunk
    needs one round trip to arrive, so the buffer must still hold about one RTT of actions when
    the observation leaves.

    ``buffer_time_s``
        fixed when ``SendTriggerConfig.buffer_time_s`` is set; otherwise automatic::

            buffer_time_s = quantile(RTT over the last `window` replies, rtt_quantile) + margin_steps * dt_s

        and ``initial_buffer_time_s`` until the first reply. ``rtt_quantile`` is 0.9 by default:
        p90 rather than the mean so that ordinary jitter does not run the buffer dry; 0.99 asks
        earlier, for a fleet whose stall budget is tighter than its RTT tail (docs/benchmarks.md,
        "Fleet over real Zenoh"). The margin covers the control period in which the send decision
        is taken.

    A request is outstanding from ``on_send`` until its reply (``receive``) or until it is
    presumed lost, ``request_timeout_s`` after it was sent. The timeout is fixed when
    ``SendTriggerConfig.request_timeout_s`` is set; otherwise::

            request_timeout_s = max(timeout_rtt_factor * p90 RTT, min_request_timeout_s)

    (``min_request_timeout_s`` before the first reply), so one dropped best-effort observation
    delays sending by at most one timeout instead of stalling it forever. A reply that comes
    after its request was presumed lost still yields an RTT sample and its actions are still
    merged (the action buffer discards what is stale); it just no longer holds a slot.
    ``unanswered_in_a_row`` counts requests presumed lost (timed out or forgotten) since the last answer: the client draws a
    new session nonce when it reaches ``RobotClientConfig.new_nonce_after_unanswered`` (docs/client.md).

Re-fetch (docs/protocol.md §10.7; ``SendTriggerConfig.refetch_after_s``; off here until the client sets it)
    A request still unanswered ``refetch_after_s`` after it was last published is due for a refresh
    (:meth:`SendTrigger.refresh_due`): the client captures again and publishes the capture as a new
    observation that names the request (``refreshes_seq_id``), :meth:`SendTrigger.on_refresh`; then
    again every ``refetch_after_s`` until a chunk answers one of them or the request times out (the
    time-out still counts from the first send). A refresh holds no slot of its own and starts no
    RTT: a chunk answering a refresh (``response_to_seq_id`` = the refresh's seq_id) answers its
    request, and the round trip is measured from the request's first send, so the send rule keeps
    seeing the whole wait.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.scheduling.in_flight import Answer, InFlightTable

__all__ = [
    "RttTracker",
    "SendDecision",
    "SendTrigger",
    "SendTriggerConfig",
    "SendTriggerStats",
    "expired_steps",
]


def expired_steps(rtt_s: float | None, dt_s: float) -> int:
    """How many leading steps of a chunk expired during the round trip: ``int(rtt_s / dt_s)``.

    0 when there is no RTT yet (the first chunk is applied whole) or the RTT is negative.
    """
    if dt_s <= 0:
        raise ValueError(f"dt_s must be positive, got {dt_s}")
    if rtt_s is None or rtt_s <= 0:
        return 0
    return int(rtt_s / dt_s)


class RttTracker:
    """The RTT estimate: a rolling window of round trips and its quantiles.

    Samples come from the in-flight table (``scheduling/in_flight.py``): :meth:`take` reads the round
    trip of an :class:`~lerobot_zenoh.scheduling.in_flight.Answer`. Standing alone (a benchmark, a
    test), ``on_send`` / ``on_receive`` keep send times in a table of its own.

    Args:
        max_in_flight: most send times its own table keeps; the oldest is dropped (and counted) beyond it.
        window: how many recent RTT samples the percentiles are taken over.
        table: the in-flight table ``on_send`` / ``on_receive`` use (a trigger passes its own).
    """

    def __init__(self, *, max_in_flight: int = 256, window: int = 100, table: InFlightTable | None = None) -> None:
        if max_in_flight <= 0:
            raise ConfigError("rtt.max_in_flight", f"must be positive, got {max_in_flight}")
        if window <= 0:
            raise ConfigError("rtt.window", f"must be positive, got {window}")
        self._lock = threading.Lock()
        self._max_in_flight = max_in_flight
        self._table = table
        self._samples_s: deque[float] = deque(maxlen=window)
        # Quantiles of the window by q, valid until the next sample: the send rule asks for p90 twice
        # per control period, and np.quantile costs tens of microseconds, far more than the rule itself.
        self._quantiles_s: dict[float, float] = {}
        self._last_rtt_s: float | None = None
        self.unknown_responses = 0  # replies to a seq_id not in the table (evicted, duplicate, never sent)
        self.measured = 0  # RTT samples taken in total

    @property
    def table(self) -> InFlightTable:
        if self._table is None:  # made on first use: a tracker fed by a trigger's table never needs one
            self._table = InFlightTable(max_requests=self._max_in_flight, max_age_s=None)
        return self._table

    def take(self, answer: Answer) -> float | None:
        """Record the round trip of `answer` (None: its request was unknown, counted)."""
        if answer.rtt_s is None:
            with self._lock:
                self.unknown_responses += 1
            return None
        with self._lock:
            self._samples_s.append(answer.rtt_s)
            self._quantiles_s.clear()
            self._last_rtt_s = answer.rtt_s
            self.measured += 1
        return answer.rtt_s

    def on_send(self, seq_id: int, now_s: float) -> None:
        self.table.add_request(seq_id, now_s)

    def on_receive(self, response_to_seq_id: int, now_s: float) -> float | None:
        """The RTT of `response_to_seq_id`, or ``None`` if its send time is unknown.

        Forgets only that key. Raises ``ValueError`` if ``now_s`` precedes the send
        time, which only happens when two clocks are mixed.
        """
        return self.take(self.table.answer(response_to_seq_id, now_s))

    def forget(self, seq_id: int) -> bool:
        """Drop a send time without measuring it. Returns whether it was there."""
        return self.table.remove(seq_id)

    def is_in_flight(self, seq_id: int) -> bool:
        return seq_id in self.table

    @property
    def in_flight(self) -> int:
        """How many send times are kept (replies not received, not evicted)."""
        return len(self.table)

    @property
    def evicted(self) -> int:
        """Send times dropped because the table was full."""
        return self.table.evicted

    @property
    def last_rtt_s(self) -> float | None:
        with self._lock:
            return self._last_rtt_s

    def quantile_s(self, q: float) -> float | None:
        """The `q` quantile (0..1, linear interpolation) of the window, or ``None`` with no sample."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be within [0, 1], got {q}")
        with self._lock:
            if not self._samples_s:
                return None
            cached = self._quantiles_s.get(q)
            if cached is not None:
                return cached
            measured_then = self.measured
            samples = np.fromiter(self._samples_s, dtype=np.float64, count=len(self._samples_s))
        value = float(np.quantile(samples, q))
        with self._lock:
            if self.measured == measured_then:  # no sample came in meanwhile
                self._quantiles_s[q] = value
        return value

    @property
    def p50_s(self) -> float | None:
        return self.quantile_s(0.5)

    @property
    def p90_s(self) -> float | None:
        return self.quantile_s(0.9)

    @property
    def p99_s(self) -> float | None:
        return self.quantile_s(0.99)


def _optional_positive(field_name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"send_trigger.{field_name}", f"must be a positive number or None, got {value}")


@dataclass
class SendTriggerConfig:
    """When to send observations; see the module docstring for the exact rules."""

    buffer_time_s: float | None = field(
        default=None,
        metadata={"help": "Send when the buffered actions last less than this. None: follow the measured RTT."},
    )
    max_in_flight: int = field(
        default=1, metadata={"help": "Most observations awaiting their action chunk at once."}
    )
    request_timeout_s: float | None = field(
        default=None,
        metadata={"help": "An unanswered observation frees its slot after this. None: from the measured RTT."},
    )
    initial_buffer_time_s: float = field(
        default=0.5, metadata={"help": "Automatic buffer_time_s before the first RTT is measured."}
    )
    margin_steps: float = field(
        default=1.0, metadata={"help": "Automatic buffer_time_s adds this many control periods to the RTT quantile."}
    )
    rtt_quantile: float = field(
        default=0.9,
        metadata={"help": "Automatic buffer_time_s follows this quantile of recent RTTs (0.9: p90; 0.99 for a tighter stall budget)."},
    )
    timeout_rtt_factor: float = field(
        default=3.0, metadata={"help": "Automatic request_timeout_s: this many p90 RTTs, at least min_request_timeout_s."}
    )
    min_request_timeout_s: float = field(
        default=1.0, metadata={"help": "Lower bound of automatic request_timeout_s, and its value before any RTT."}
    )
    rtt_window: int = field(default=100, metadata={"help": "RTT samples the percentiles are taken over."})
    refetch_after_s: float | None = field(
        default=None,
        metadata={"help": "Re-fetch: a request unanswered this long is refreshed with a new capture, every this "
                          "many seconds until answered or timed out (docs/protocol.md, section 10.7), only toward a server whose "
                          "status says it takes refreshes. None (default): 0.1 s or the model's median inference time if "
                          "longer, but off with real-time chunking and for a multi-model task; 0: off."},
    )
    max_rate_hz: float | None = field(
        default=None,
        metadata={"help": "Send at most this many observations per second (a planned request rate). None: no cap."},
    )

    def __post_init__(self) -> None:
        _optional_positive("buffer_time_s", self.buffer_time_s)
        if self.refetch_after_s is not None and not (math.isfinite(self.refetch_after_s) and self.refetch_after_s >= 0):
            raise ConfigError("send_trigger.refetch_after_s", f"must be >= 0 (0: off) or None, got {self.refetch_after_s}")
        _optional_positive("request_timeout_s", self.request_timeout_s)
        _optional_positive("initial_buffer_time_s", self.initial_buffer_time_s)
        _optional_positive("timeout_rtt_factor", self.timeout_rtt_factor)
        _optional_positive("min_request_timeout_s", self.min_request_timeout_s)
        _optional_positive("max_rate_hz", self.max_rate_hz)
        if self.max_in_flight < 1:
            raise ConfigError("send_trigger.max_in_flight", f"must be at least 1, got {self.max_in_flight}")
        if not (math.isfinite(self.margin_steps) and self.margin_steps >= 0):
            raise ConfigError("send_trigger.margin_steps", f"must be >= 0, got {self.margin_steps}")
        if not (math.isfinite(self.rtt_quantile) and 0.5 <= self.rtt_quantile <= 1.0):
            raise ConfigError("send_trigger.rtt_quantile", f"must be within [0.5, 1], got {self.rtt_quantile}")
        if self.rtt_window < 1:
            raise ConfigError("send_trigger.rtt_window", f"must be at least 1, got {self.rtt_window}")


@dataclass(frozen=True)
class SendDecision:
    """Whether to send now, and why (``buffer_low``, ``buffer_ok``, ``in_flight_full`` or ``rate_cap``)."""

    send: bool
    reason: str
    buffered_s: float
    buffer_time_s: float
    outstanding: int

    def __bool__(self) -> bool:
        return self.send


@dataclass(frozen=True)
class SendTriggerStats:
    sent: int
    answered: int
    presumed_lost: int
    late_replies: int  # replies to requests already presumed lost
    outstanding: int
    buffer_time_s: float
    request_timeout_s: float
    rtt_last_s: float | None
    rtt_p50_s: float | None
    rtt_p90_s: float | None
    rtt_p99_s: float | None
    refreshes: int = 0  # fresh captures published for requests still waiting (re-fetch)
    unanswered_in_a_row: int = 0  # requests presumed lost since the last answer


#: The reference client's re-fetch threshold when `refetch_after_s` is None, toward a server that
#: takes refreshes: measured on the real stack (docs/benchmarks.md, "Re-fetch over real Zenoh"), 100 ms
#: bounded the served observation's age near the threshold wherever requests queued (actions/s
#: +17 to +69 %, stalls cut 2 to 12x) and beat 200 ms everywhere, while costing 0.08-0.18 refreshes
#: per request where they did not (nearly all dropped on arrival, never an inference).
DEFAULT_REFETCH_AFTER_S = 0.1


class SendTrigger:
    """Decides when the next observation goes out, from the in-flight table and the RTT estimate.

    Args:
        config: the rules' settings.
        dt_s: the control period (``1 / fps``).
        rtt: an RTT estimate to share (kept across triggers, say one per task); a new one
            (``config.rtt_window``) by default.
        table: the in-flight table (``scheduling/in_flight.py``) to keep requests in; a new one by
            default. The chunk intake reads the same table through :meth:`receive`.
    """

    def __init__(self, config: SendTriggerConfig | None = None, *, dt_s: float, rtt: RttTracker | None = None,
                 table: InFlightTable | None = None):
        if not (math.isfinite(dt_s) and dt_s > 0):
            raise ConfigError("fps", f"control period must be positive, got dt_s={dt_s}")
        self.config = config if config is not None else SendTriggerConfig()
        #: Re-fetch threshold in force (None: off). The config's value (None and 0: off) until the
        #: client sets it from the server's status (None there means the default, DEFAULT_REFETCH_AFTER_S).
        self.refetch_after_s: float | None = self.config.refetch_after_s or None
        self.dt_s = dt_s
        self.table = table if table is not None else InFlightTable()
        self.rtt = rtt if rtt is not None else RttTracker(window=self.config.rtt_window, table=self.table)
        self._lock = threading.Lock()  # the counters below; the table has its own
        self._sent = 0
        self._answered = 0
        self._presumed_lost = 0
        self._late_replies = 0
        self._refreshes = 0
        self._unanswered_in_a_row = 0  # requests presumed lost since the last answer (a shut-out session)
        self._last_send_s: float | None = None  # for max_rate_hz

    # -- calibrated thresholds

    def buffer_time_s(self) -> float:
        """The current threshold: fixed, or the RTT quantile + margin (``initial_buffer_time_s`` before any RTT)."""
        cfg = self.config
        if cfg.buffer_time_s is not None:
            return cfg.buffer_time_s
        rtt_s = self.rtt.quantile_s(cfg.rtt_quantile)
        if rtt_s is None:
            return cfg.initial_buffer_time_s
        return rtt_s + cfg.margin_steps * self.dt_s

    def request_timeout_s(self) -> float:
        """The current timeout: fixed, or max(factor * p90 RTT, minimum)."""
        cfg = self.config
        if cfg.request_timeout_s is not None:
            return cfg.request_timeout_s
        p90_s = self.rtt.p90_s
        if p90_s is None:
            return cfg.min_request_timeout_s
        return max(cfg.timeout_rtt_factor * p90_s, cfg.min_request_timeout_s)

    # -- decisions and events

    def decide(self, queue_size: int, now_s: float) -> SendDecision:
        """Whether to send an observation now, given how many actions are buffered.

        Presumes lost (and frees the slot of) every outstanding request older than the timeout.
        """
        buffered_s = max(queue_size, 0) * self.dt_s
        threshold_s = self.buffer_time_s()
        outstanding = self._expire(now_s)
        with self._lock:
            if buffered_s >= threshold_s:
                send, reason = False, "buffer_ok"
            elif outstanding >= self.config.max_in_flight:
                send, reason = False, "in_flight_full"
            elif (self.config.max_rate_hz is not None and self._last_send_s is not None
                  and now_s - self._last_send_s < 1.0 / self.config.max_rate_hz):
                send, reason = False, "rate_cap"
            else:
                send, reason = True, "buffer_low"
        return SendDecision(send, reason, buffered_s, threshold_s, outstanding)

    def should_send(self, queue_size: int, now_s: float) -> bool:
        return self.decide(queue_size, now_s).send

    def on_send(self, seq_id: int, now_s: float, *, step: int | None = None,
                predicted_delay_steps: int | None = None, nonce: int | None = None) -> None:
        """Request `seq_id` left (or was captured) at `now_s`: it holds a slot until answered. `step`
        and `predicted_delay_steps` are what the chunk intake aligns its answer to."""
        self.table.add_request(seq_id, now_s, step=step, predicted_delay_steps=predicted_delay_steps, nonce=nonce)
        with self._lock:
            self._sent += 1
            self._last_send_s = now_s

    def refresh_due(self, now_s: float) -> int | None:
        """Re-fetch: the seq_id of the oldest outstanding request last published at least
        ``refetch_after_s`` ago (after presuming timed-out ones lost), or None (also when re-fetch is off)."""
        after_s = self.refetch_after_s
        if after_s is None:
            return None
        self._expire(now_s)
        return self.table.refresh_due(now_s, after_s)

    def on_refresh(self, refresh_seq_id: int, request_seq_id: int, now_s: float, *, step: int | None = None,
                   predicted_delay_steps: int | None = None) -> bool:
        """A fresh capture `refresh_seq_id` of the outstanding request `request_seq_id` leaves at `now_s`.

        False (nothing recorded: do not publish it) when the request is no longer outstanding, i.e.
        it was answered or timed out since :meth:`refresh_due` named it.
        """
        if not self.table.add_refresh(refresh_seq_id, request_seq_id, now_s, step=step,
                                      predicted_delay_steps=predicted_delay_steps):
            return False
        with self._lock:
            self._refreshes += 1
        return True

    def request_of(self, seq_id: int) -> int:
        """The request an observation stands for: the one it refreshes, else itself."""
        return self.table.request_of(seq_id)

    def receive(self, response_to_seq_id: int, now_s: float) -> Answer:
        """A chunk answering `response_to_seq_id` arrived: resolve it in the in-flight table (a chunk
        answering a refresh answers its request), free the slot, sample the RTT from the request's
        first send. The answer also carries the capture the chunk is aligned to (the chunk intake's)."""
        answer = self.table.answer(response_to_seq_id, now_s)
        self.rtt.take(answer)
        with self._lock:
            if answer.slot == "answered":
                self._answered += 1
            elif answer.slot == "late":
                self._late_replies += 1
            if answer.slot != "unknown":
                self._unanswered_in_a_row = 0
        return answer

    def on_receive(self, response_to_seq_id: int, now_s: float) -> float | None:
        """:meth:`receive`, returning the RTT only (``None`` when the request was unknown)."""
        return self.receive(response_to_seq_id, now_s).rtt_s

    def outstanding(self, now_s: float) -> int:
        """Requests awaiting a reply at `now_s` (after presuming the timed-out ones lost)."""
        return self._expire(now_s)

    def forget_outstanding(self) -> int:
        """Presume every outstanding request lost now (e.g. the server was replaced). Returns how many.

        Counters and the RTT history are kept, so a trigger shared between threads need not be
        rebuilt (rebuilding it would race with the thread that is using the old one).
        """
        forgotten = len(self.table.forget_outstanding())
        with self._lock:
            self._presumed_lost += forgotten
            self._unanswered_in_a_row += forgotten
        return forgotten

    @property
    def unanswered_in_a_row(self) -> int:
        """Requests presumed lost (timed out or forgotten) since the last answer (0 after :meth:`reset_unanswered`)."""
        with self._lock:
            return self._unanswered_in_a_row

    def reset_unanswered(self) -> None:
        """Start counting unanswered requests afresh (the client drew a new session nonce)."""
        with self._lock:
            self._unanswered_in_a_row = 0

    def stats(self) -> SendTriggerStats:
        buffer_time_s, timeout_s = self.buffer_time_s(), self.request_timeout_s()
        rtt = self.rtt
        rtt_last_s, rtt_p50_s, rtt_p90_s, rtt_p99_s = rtt.last_rtt_s, rtt.p50_s, rtt.p90_s, rtt.p99_s
        outstanding = self.table.outstanding
        with self._lock:
            return SendTriggerStats(
                sent=self._sent,
                answered=self._answered,
                presumed_lost=self._presumed_lost,
                late_replies=self._late_replies,
                outstanding=outstanding,
                buffer_time_s=buffer_time_s,
                request_timeout_s=timeout_s,
                rtt_last_s=rtt_last_s,
                rtt_p50_s=rtt_p50_s,
                rtt_p90_s=rtt_p90_s,
                rtt_p99_s=rtt_p99_s,
                refreshes=self._refreshes,
                unanswered_in_a_row=self._unanswered_in_a_row,
            )

    def _expire(self, now_s: float) -> int:
        """Presume timed-out requests lost; returns how many are still outstanding."""
        lost = self.table.expire(now_s, self.request_timeout_s())
        if lost:
            with self._lock:
                self._presumed_lost += len(lost)
                self._unanswered_in_a_row += len(lost)
        return self.table.outstanding
