"""The monitor's picture of a fleet, built from Telemetry messages and liveliness events.

Pure state with an injected clock: `on_telemetry(key, msg, now_s)`, `on_liveliness(key, alive,
now_s)`, `forget(now_s)` now and then, `rows(now_s)` for the table and `samples()` for Prometheus.

What it trusts and how much it keeps (docs/telemetry.md, "What the monitor trusts"): a member is
who its key says (a server's `.../server/<id>/metrics`, a client's `.../<client>/metrics`); only a
server member's `per_client` figures become per-robot server series, so a robot cannot publish
server-side figures about itself or another robot. What a peer can make the monitor hold is bounded
in bytes as well as in counts: a message over `MAX_MESSAGE_BYTES` is refused by its length before it
is decoded (`TelemetryInbox`); the inbox holds at most `INBOX_BYTES` and takes in at most
`INTAKE_BYTES_PER_S` on average; figure names must fit the grammar `FIGURE_NAME` and
`MAX_FIGURE_CHARS`, ids and label values `MAX_ID_CHARS` (refused ones are counted by reason); each
member keeps at most `MAX_FIGURES` figures (`MAX_PER_CLIENT` robots of `MAX_CLIENT_FIGURES` each for
a server) within `SERVER_BYTES` or `CLIENT_BYTES`, and all members together `STATE_BYTES`, as
accounted (`FIGURE_BYTES` and its name's characters per figure: not less than what CPython spends on
them). At most `max_members` members are kept; a member silent or gone for `forget_after_s` is
forgotten, its series leave /metrics with it, and when the table or the state budget is full a new
member takes the place of members without a liveliness token: those heard from only once or twice
first (a flood of invented ids), then the longest-silent.

States: `up`; `SILENT` (no telemetry for `stale_periods` periods while its token is present or
unknown); `GONE` (its liveliness token vanished); for a server, `STALLED` (its token is still there
but it publishes nothing: a frozen or overloaded process); for a robot that fell silent while a
server of its app is STALLED, `UNHEARD` (its telemetry may travel through that server, so its
silence says nothing about the robot itself).
"""

from __future__ import annotations

import queue
import re
import textwrap
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache

from lerobot_zenoh.errors import KeyExprError
from lerobot_zenoh.protocol.keys import AppKey, parse_key
from lerobot_zenoh.protocol.messages import Telemetry

#: Bounds on what remote parties can make the monitor keep (docs/telemetry.md, "What the monitor trusts").
MAX_MEMBERS = 2048
MAX_FIGURES = 512  # per member
MAX_PER_CLIENT = 1024  # robots in one server's per_client figures
MAX_CLIENT_FIGURES = 96  # per robot in a server's per_client figures (its histograms included)
MAX_LABELS = 16  # a member's `labels`
MAX_FIGURE_CHARS = 128  # a figure name
MAX_ID_CHARS = 128  # a member id, a robot id in per_client, a label and its value
FIGURE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
MAX_MESSAGE_BYTES = 1 << 20  # one Telemetry message, checked before decoding
INBOX_BYTES = 4 << 20  # messages received and not yet decoded
INTAKE_BYTES_PER_S = 4 << 20  # messages taken in per second, on average (bursts up to INBOX_BYTES)
SERVER_BYTES = 4 << 20  # what one server member keeps (as accounted: FIGURE_BYTES)
CLIENT_BYTES = 64 << 10  # what one robot member keeps
STATE_BYTES = 16 << 20  # what every member together keeps
#: Accounted cost of one kept figure beyond its name's characters, of a kept robot's table, of a
#: member: about what CPython spends on a dict entry with a str key and a float value (measured with
#: tracemalloc in tests/test_telemetry.py), on an empty dict and on a Member with its key and labels.
FIGURE_BYTES = 80
TABLE_BYTES = 200
MEMBER_BYTES = 1000
FORGET_AFTER_S = 60.0
ESTABLISHED_MESSAGES = 3

#: The reasons the monitor refuses a message or a figure (own figures `rejected.<reason>` and
#: `figures_refused.<reason>`, docs/telemetry.md).
REJECT_REASONS = ("undecodable", "too_large", "inbox_full", "rate_limited", "unknown_key", "posing", "state_full")
FIGURE_REFUSALS = ("bad_name", "too_long", "not_a_number", "too_many")


class TelemetryInbox:
    """Messages handed over by Zenoh's callback, waiting to be decoded, bounded in bytes.

    Each message is at most `max_message_bytes`, checked by length before anything is copied or
    decoded; the inbox holds at most `max_bytes` (and `max_messages`); and at most `bytes_per_s` are
    taken in per second on average (a token bucket of `max_bytes`), so that a flood cannot keep the
    decoding thread, and with it the Python lock Zenoh's callbacks wait for, busy. `offer` never
    blocks; it returns the reason a message is refused (`too_large`, `inbox_full`, `rate_limited`)
    or None. Pure: the caller gives the time.
    """

    def __init__(self, max_bytes: int = INBOX_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 bytes_per_s: float = INTAKE_BYTES_PER_S, max_messages: int = 4096):
        self.max_bytes = max_bytes
        self.max_message_bytes = max_message_bytes
        self.bytes_per_s = bytes_per_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._bytes = 0
        self._count = 0
        self._max_messages = max_messages
        self._tokens = float(max_bytes)
        self._tokens_s: float | None = None

    def bytes(self) -> int:
        return self._bytes

    def offer(self, key: str, payload, arrived_s: float) -> str | None:
        """`payload`: bytes, or anything with a length that `bytes()` copies (once accepted)."""
        size = len(payload) + len(key)
        if len(payload) > self.max_message_bytes or len(key) > 8 * MAX_ID_CHARS:
            return "too_large"
        with self._lock:
            if self._tokens_s is not None:
                self._tokens = min(float(self.max_bytes), self._tokens + (arrived_s - self._tokens_s) * self.bytes_per_s)
            self._tokens_s = arrived_s
            if self._bytes + size > self.max_bytes or self._count >= self._max_messages:
                return "inbox_full"
            if size > self._tokens:
                return "rate_limited"
            self._tokens -= size
            self._bytes += size
            self._count += 1
        # Copied now, once accepted: a payload still in Zenoh's buffer can pin a whole receive batch
        # (64 KiB for a message of 1 KiB), which the byte count above would not see.
        self._queue.put((key, bytes(payload), arrived_s, size))
        return None

    def take(self, timeout_s: float | None = None) -> tuple[str, bytes, float]:
        """The oldest message as (key, bytes, arrival); queue.Empty when none came within `timeout_s`."""
        key, payload, arrived_s, size = (self._queue.get(timeout=timeout_s) if timeout_s is not None
                                         else self._queue.get_nowait())
        with self._lock:
            self._bytes -= size
            self._count -= 1
        return key, payload, arrived_s


#: Figures shown in the table, per kind: (figure name, column title with its unit; docs/telemetry.md).
SERVER_COLUMNS = [("clients", "clients"), ("inferences", "inferences"), ("inference_ms_p50", "inference p50 (ms)"),
                  ("inference_ms_p99", "inference p99 (ms)"), ("queue_ms_p50", "queue wait p50 (ms)"),
                  ("observations_superseded", "superseded obs"), ("observations_rejected", "rejected obs"),
                  ("cpu_rss_mb", "memory (MiB)")]
CLIENT_COLUMNS = [("loop_hz", "loop rate (Hz)"), ("control_period_ms_p99", "control period p99 (ms)"),
                  ("loop_overruns", "overrun steps"), ("rtt_ms_p50", "round trip p50 (ms)"),
                  ("rtt_ms_p99", "round trip p99 (ms)"), ("buffer_depth", "buffered actions"),
                  ("empty_buffer_cycles", "empty-buffer steps"), ("requests_unanswered", "unanswered requests"),
                  ("chunks_received", "chunks"), ("watchdog_events", "watchdog re-validations")]


@dataclass
class Member:
    kind: str  # "server" | "client"
    app: AppKey
    member_id: str
    alive: bool | None = None  # None: no liveliness information yet
    alive_changed_s: float | None = None  # when `alive` last changed
    last_seen_s: float | None = None  # last telemetry
    period_s: float = 1.0
    metrics: dict = field(default_factory=dict)
    per_client: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    cost: int = 0  # accounted bytes of what it keeps (FIGURE_BYTES), its key included
    created: int = 0  # order of arrival among members (older first on a /metrics over budget)
    messages: int = 0  # telemetry messages taken from it

    def established(self) -> bool:
        """Heard from a few times: kept and exported before members a flood of new ids just made."""
        return self.messages >= ESTABLISHED_MESSAGES

    def age_s(self, now_s: float) -> float | None:
        return None if self.last_seen_s is None else now_s - self.last_seen_s

    def gone(self) -> bool:
        return self.alive is False

    def silent(self, now_s: float, stale_periods: float = 3.0) -> bool:
        """Gone quiet: its token vanished, or no telemetry for `stale_periods` periods."""
        if self.alive is False:
            return True
        age = self.age_s(now_s)
        return age is None or age > stale_periods * max(self.period_s, 0.1)

    def quiet_since_s(self) -> float | None:
        """Since when nothing was heard of it (its last telemetry or token change)."""
        times = [t for t in (self.last_seen_s, self.alive_changed_s) if t is not None]
        return max(times) if times else None


@lru_cache(maxsize=8192)  # an honest member publishes the same names every period
def _name_refusal(name: str) -> str | None:
    if len(name) > MAX_FIGURE_CHARS:
        return "too_long"
    return None if FIGURE_NAME.fullmatch(name) else "bad_name"


def _bounded(figures, limit: int, refused: Counter, budget: int) -> tuple[dict, int]:
    """(the numeric figures with valid names, at most `limit` of them and `budget` accounted bytes;
    those bytes). What is left out is counted in `refused` by reason. (Runs for every figure of every
    message: kept to plain comparisons.)"""
    out: dict = {}
    cost = TABLE_BYTES
    if not isinstance(figures, dict):
        return out, cost
    kept = 0
    for i, (name, value) in enumerate(figures.items()):
        if type(value) not in _NUMBERS:
            refused["not_a_number"] += 1
            continue
        if type(name) is not str:
            refused["bad_name"] += 1
            continue
        if reason := _name_refusal(name[:MAX_FIGURE_CHARS + 1]):
            refused[reason] += 1
            continue
        c = len(name) + FIGURE_BYTES
        if kept >= limit or cost + c > budget:
            refused["too_many"] += len(figures) - i  # this one and the rest, unread
            break
        out[name] = value
        cost += c
        kept += 1
    return out, cost


_NUMBERS = (int, float)  # exact types: a bool is not a figure


def _valid_id(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


class FleetView:
    def __init__(self, stale_periods: float = 3.0, *, forget_after_s: float = FORGET_AFTER_S,
                 max_members: int = MAX_MEMBERS, state_bytes: int = STATE_BYTES):
        self.stale_periods = stale_periods
        self.forget_after_s = forget_after_s
        self.max_members = max_members
        self.max_state_bytes = state_bytes
        self._members: dict[tuple[str, str, str], Member] = {}
        self._lock = threading.Lock()
        self.messages = 0
        self.rejected_by: Counter = Counter()  # messages refused, by reason (REJECT_REASONS)
        self.figures_refused: Counter = Counter()  # figures not kept, by reason (FIGURE_REFUSALS)
        self.per_client_ignored = 0  # per-robot figures in a robot's own telemetry: not trusted, dropped
        self.members_refused = 0  # messages of new members while the table was full of live ones
        self.members_forgotten = 0
        self.state_bytes = 0  # sum of the members' accounted bytes
        self._created = 0
        self.series_dropped = 0  # series left out of scrapes for the size budget of /metrics
        self.inbox_bytes = lambda: 0  # set by the monitor to its inbox's byte count

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by.values())

    def reject(self, reason: str) -> None:
        """Count a message refused before it reached the view (too large, inbox full, undecodable)."""
        with self._lock:
            self.rejected_by[reason] += 1

    @staticmethod
    def _identify(key: str) -> tuple[str, AppKey, str] | None:
        if not isinstance(key, str) or len(key) > 8 * MAX_ID_CHARS:
            return None
        try:
            parsed = parse_key(key)
        except KeyExprError:
            return None
        if parsed.server_id is not None:
            kind, member_id = "server", parsed.server_id
        elif parsed.client_id is not None and parsed.topic == "metrics":
            kind, member_id = "client", parsed.client_id
        else:
            return None
        if not all(len(c) <= MAX_ID_CHARS for c in (*parsed.app.prefix.split("/"), member_id)):
            return None
        return kind, parsed.app, member_id

    def _make_room(self, members: int, state_bytes: int, keep: tuple | None) -> bool:
        """Forget the longest-quiet members without a live token (never `keep`) until at most `members`
        are kept and they hold at most `state_bytes`; False when that cannot be reached."""
        if len(self._members) <= members and self.state_bytes <= state_bytes:
            return True
        # Members heard from only once or twice go first (a flood of invented ids), then the quietest.
        evictable = sorted((m.established(), m.quiet_since_s() or float("-inf"), i) for i, m in self._members.items()
                           if m.alive is not True and i != keep)
        # Room for an eighth more at once when the table is full (a flood of new ids costs a sort per
        # eighth, not a scan per message); for bytes, as many as needed.
        target_members = (min(members, self.max_members - max(1, self.max_members // 8))
                          if len(self._members) > members else members)
        n_members = len(self._members)
        freed, chosen = 0, []
        for *_, i in evictable:
            if n_members - len(chosen) <= target_members and self.state_bytes - freed <= state_bytes:
                break
            chosen.append(i)
            freed += self._members[i].cost
        if n_members - len(chosen) > members or self.state_bytes - freed > state_bytes:
            return False
        for i in chosen:
            self.state_bytes -= self._members.pop(i).cost
        self.members_forgotten += len(chosen)
        return True

    def _member(self, kind: str, app: AppKey, member_id: str, key: str, extra_bytes: int = 0) -> Member | None:
        """The member, made if there is room (the longest-silent ones without a live token make room)."""
        ident = (kind, app.prefix, member_id)
        member = self._members.get(ident)
        if member is None:
            cost = MEMBER_BYTES + 2 * len(key)
            if not self._make_room(self.max_members - 1, self.max_state_bytes - cost - extra_bytes, None):
                self.members_refused += 1
                return None
            self._created += 1
            member = self._members[ident] = Member(kind, app, member_id, cost=cost, created=self._created)
            self.state_bytes += cost
        return member

    def on_telemetry(self, key: str, msg: Telemetry, now_s: float) -> None:
        ident = self._identify(key)
        with self._lock:
            if ident is None:  # a key that is no member's (or with a chunk over MAX_ID_CHARS)
                self.rejected_by["unknown_key"] += 1
                return
            if msg.source != ident[0]:  # a client posing as a server (or the reverse)
                self.rejected_by["posing"] += 1
                return
            refused: Counter = Counter()
            budget = (SERVER_BYTES if ident[0] == "server" else CLIENT_BYTES) - MEMBER_BYTES - 2 * len(key)
            labels = {k: v for k, v in list(msg.labels.items())[:MAX_LABELS] if _valid_id(k) and _valid_id(v)}
            cost = sum(FIGURE_BYTES + len(k) + len(v) for k, v in labels.items())
            metrics, metrics_cost = _bounded(msg.metrics, MAX_FIGURES, refused, budget - cost)
            cost += metrics_cost
            per_client: dict = {}
            if ident[0] == "server":
                for client_id, figures in msg.per_client.items():
                    n = len(figures) if isinstance(figures, dict) else 1
                    if not _valid_id(client_id):
                        refused["bad_name"] += n
                        continue
                    if len(per_client) >= MAX_PER_CLIENT or cost + TABLE_BYTES + len(client_id) > budget:
                        refused["too_many"] += n
                        continue
                    kept, robot_cost = _bounded(figures, MAX_CLIENT_FIGURES, refused, budget - cost - len(client_id))
                    per_client[client_id] = kept
                    cost += robot_cost + len(client_id)
            elif msg.per_client:
                self.per_client_ignored += 1  # only a server's figures about a robot are its server figures
            self.figures_refused.update(refused)
            member = self._member(*ident, key, cost)
            if member is None:
                return
            old = member.cost
            base = MEMBER_BYTES + 2 * len(key)
            if self.state_bytes - old + base + cost > self.max_state_bytes and not self._make_room(
                    self.max_members, self.max_state_bytes - (base + cost - old), (ident[0], ident[1].prefix, ident[2])):
                self.rejected_by["state_full"] += 1
                return
            self.messages += 1
            member.messages += 1
            member.last_seen_s = now_s
            member.period_s = msg.period_s or 1.0
            member.metrics, member.per_client, member.labels = metrics, per_client, labels
            member.cost = base + cost
            self.state_bytes += member.cost - old

    def on_liveliness(self, key: str, alive: bool, now_s: float) -> None:
        ident = self._identify(key)
        if ident is None:
            return
        with self._lock:
            if not alive and (ident[0], ident[1].prefix, ident[2]) not in self._members:
                return  # a token we never knew of vanished: nothing to keep
            member = self._member(*ident, key)
            if member is not None and member.alive is not alive:
                member.alive = alive
                member.alive_changed_s = now_s

    def forget(self, now_s: float) -> list[Member]:
        """Forget members gone or silent for `forget_after_s` (a member whose token is still there
        stays: a stalled server is shown, not forgotten). Returns them; their series leave /metrics."""
        with self._lock:
            due = [i for i, m in self._members.items()
                   if m.alive is not True and now_s - (m.quiet_since_s() or now_s) >= self.forget_after_s]
            gone = [self._members.pop(i) for i in due]
            self.state_bytes -= sum(m.cost for m in gone)
            self.members_forgotten += len(gone)
        return gone

    def members(self) -> list[Member]:
        with self._lock:
            return sorted(self._members.values(), key=lambda m: (m.app.prefix, m.kind != "server", m.member_id))

    def rows(self, now_s: float) -> list[dict]:
        """One dict per member: identity, state, age and the key figures of its kind."""
        out = []
        members = self.members()
        stalled_apps = {m.app.prefix for m in members if self.state(m, now_s) == "STALLED"}
        for m in members:
            columns = SERVER_COLUMNS if m.kind == "server" else CLIENT_COLUMNS
            state = self.state(m, now_s)
            if state == "SILENT" and m.kind == "client" and m.app.prefix in stalled_apps:
                state = "UNHEARD"
            if state == "up" and m.kind == "client" and m.metrics.get("revalidating"):
                state = "REVALIDATING"
            age = m.age_s(now_s)
            row = {
                "app": m.app.prefix, "kind": m.kind, "id": m.member_id, "state": state,
                "age_s": None if age is None else round(age, 1),
                **{title: m.metrics.get(name) for name, title in columns},
            }
            if m.kind == "client":
                row["slo"] = slo_summary(m.metrics)
            out.append(row)
        return out

    def state(self, m: Member, now_s: float) -> str:
        """`up`, `GONE` (token vanished), `STALLED` (a server whose token is there, no telemetry) or
        `SILENT`; `rows` also tells `UNHEARD` and `REVALIDATING` robots."""
        if m.gone():
            return "GONE"
        if not m.silent(now_s, self.stale_periods):
            return "up"
        return "STALLED" if m.kind == "server" and m.alive is True and m.last_seen_s is not None else "SILENT"

    def samples(self) -> Iterator[tuple[str, str, dict[str, str], float]]:
        """(member kind, figure name, labels, value) for every figure of every member (Prometheus),
        most trusted first, so that a byte budget on /metrics leaves out a flood's series, not the
        fleet's: the monitor's own counts, then every member's own figures (members with a live
        token first, then those heard from a few times, then by how long they have been known), then
        servers' per-robot figures.

        Member kind: "server", "client", "server_client" for a server's per-client figures, or
        "monitor" for the monitor's own counts (`own_figures`, no labels);
        `alive` is the liveliness token (1 present, 0 vanished). telemetry/prometheus.py names them.
        A generator: the labels of one member (one robot) are one shared dict, never copied per figure.
        """
        for name, value in self.own_figures().items():
            yield "monitor", name, {}, float(value)
        with self._lock:
            members = sorted(self._members.values(), key=lambda m: (m.alive is not True, not m.established(), m.created))
        own = {}
        for m in members:
            own[id(m)] = labels = {"cluster": m.app.cluster, "experiment": m.app.experiment, "model": m.app.model,
                                   "version": m.app.version, "app": m.app.app, m.kind: m.member_id}
            if m.alive is not None:
                yield m.kind, "alive", labels, 1.0 if m.alive else 0.0
            for name, value in m.metrics.items():
                yield m.kind, name, labels, float(value)
        for m in members:
            for client_id, figures in m.per_client.items():
                labels = {**own[id(m)], "client": client_id}
                for name, value in figures.items():
                    yield "server_client", name, labels, float(value)

    def series_count(self) -> int:
        """How many samples `samples()` yields now (what a /metrics answer would hold without a budget)."""
        with self._lock:
            members = list(self._members.values())
        return (len(self.own_figures()) + sum(len(m.metrics) + (m.alive is not None) for m in members)
                + sum(len(f) for m in members for f in m.per_client.values()))

    def own_figures(self) -> dict[str, int]:
        """What the monitor itself counted: accepted and refused messages (by reason), figures not
        kept (by reason), members kept, forgotten and refused, the bytes it holds (the bounds of
        "What the monitor trusts", docs/telemetry.md). Names as in telemetry/prometheus.py."""
        with self._lock:
            return {"messages": self.messages, **{f"rejected.{r}": self.rejected_by[r] for r in REJECT_REASONS},
                    **{f"figures_refused.{r}": self.figures_refused[r] for r in FIGURE_REFUSALS},
                    "per_client_ignored": self.per_client_ignored, "members": len(self._members),
                    "members_refused": self.members_refused, "members_forgotten": self.members_forgotten,
                    "state_bytes": self.state_bytes, "inbox_bytes": self.inbox_bytes(),
                    "series_dropped": self.series_dropped}

    def status_line(self) -> str:
        """The table's last line: the monitor's own counts, those that are not 0."""
        with self._lock:
            figures = {"messages": self.messages, "rejected": self.rejected, "per_client_ignored": self.per_client_ignored,
                       "figures_refused": sum(self.figures_refused.values()), "members": len(self._members),
                       "members_forgotten": self.members_forgotten, "members_refused": self.members_refused}
        words = {"messages": "messages", "rejected": "rejected", "per_client_ignored": "robot-sent per-robot figures dropped",
                 "figures_refused": "figures refused", "members": "members", "members_forgotten": "forgotten",
                 "members_refused": "refused (table full)"}
        return "monitor: " + ", ".join(f"{figures[k]} {w}" for k, w in words.items()
                                       if figures[k] or k in ("messages", "members"))


def slo_summary(metrics: dict) -> str | None:
    """A multi-model task's per-component SLO attainment (`slo.<component>.*` figures of a pipeline
    client, docs/pipelines.md) in one cell: `act 100% safety 97% (3 missed)`; None for other clients."""
    parts = []
    for key in sorted(k for k in metrics if k.startswith("slo.") and k.endswith(".requests")):
        comp = key[len("slo."):-len(".requests")]
        attainment = metrics.get(f"slo.{comp}.attainment")
        missed = metrics.get(f"slo.{comp}.missed") or 0
        cell = f"{comp} {'-' if attainment is None else f'{100 * attainment:.0f}%'}"
        parts.append(cell + (f" ({missed:.0f} missed)" if missed else ""))
    return " ".join(parts) or None


#: Titles of the rows' own fields in the table.
ROW_TITLES = {"age_s": "last report (s ago)", "slo": "SLO met (per component)"}


def format_table(rows: list[dict]) -> str:
    """A plain-text table, one block per kind (servers and clients have different columns)."""
    if not rows:
        return "(no telemetry yet)"

    def fmt(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.1f}"
        return str(v)

    blocks = []
    for kind in ("server", "client"):
        kind_rows = [r for r in rows if r["kind"] == kind]
        if not kind_rows:
            continue
        headers = [h for h in kind_rows[0] if h != "kind"]
        cells = [[fmt(r.get(h)) for h in headers] for r in kind_rows]
        titles = [ROW_TITLES.get(h, h) for h in headers]
        # Full titles with units, wrapped over up to three header lines so that a column is as wide as
        # its values or its longest word, 8 at least (the client table fits a 160-column terminal).
        widths = [max(max(len(word) for word in t.split()), *(len(c[i]) for c in cells), 8)
                  for i, t in enumerate(titles)]
        wrapped = [textwrap.wrap(t, w) for t, w in zip(titles, widths)]
        depth = max(len(w) for w in wrapped)
        lines = [f"{kind.upper()}S"]
        lines += ["  ".join((w[k] if k < len(w) else "").ljust(width) for w, width in zip(wrapped, widths)).rstrip()
                  for k in range(depth)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
