"""The monitor's picture of a fleet, built from Telemetry messages and liveliness events.

Pure state with an injected clock: `on_telemetry(key, msg, now_s)`, `on_liveliness(key, alive,
now_s)`, `forget(now_s)` now and then, `rows(now_s)` for the table and `samples()` for Prometheus.

What it trusts and how much it keeps (docs/telemetry.md, "What the monitor trusts"): a member is
who its key says (a server's `.../server/<id>/metrics`, a client's `.../<client>/metrics`); only a
server member's `per_client` figures become per-robot server series, so a robot cannot publish
server-side figures about itself or another robot. At most `max_members` members are kept, each
with at most `MAX_FIGURES` figures and (a server) `MAX_PER_CLIENT` robots; a member silent or gone
for `forget_after_s` is forgotten, its series leave /metrics with it, and when the table is full a
new member takes the place of the longest-silent one that has no liveliness token.

States: `up`; `SILENT` (no telemetry for `stale_periods` periods while its token is present or
unknown); `GONE` (its liveliness token vanished); for a server, `STALLED` (its token is still there
but it publishes nothing: a frozen or overloaded process); for a robot that fell silent while a
server of its app is STALLED, `UNHEARD` (its telemetry may travel through that server, so its
silence says nothing about the robot itself).
"""

from __future__ import annotations

import textwrap
import threading
from dataclasses import dataclass, field

from lerobot_zenoh.errors import KeyExprError
from lerobot_zenoh.protocol.keys import AppKey, parse_key
from lerobot_zenoh.protocol.messages import Telemetry

#: Bounds on what remote parties can make the monitor keep (docs/telemetry.md).
MAX_MEMBERS = 2048
MAX_FIGURES = 256  # per member, and per robot in a server's per_client figures
MAX_PER_CLIENT = 1024  # robots in one server's per_client figures
FORGET_AFTER_S = 60.0

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


def _bounded(figures: dict, limit: int = MAX_FIGURES) -> dict:
    """Numeric figures only, at most `limit` of them."""
    out = {}
    for name, value in figures.items():
        if len(out) >= limit:
            break
        if isinstance(name, str) and isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
    return out


class FleetView:
    def __init__(self, stale_periods: float = 3.0, *, forget_after_s: float = FORGET_AFTER_S,
                 max_members: int = MAX_MEMBERS):
        self.stale_periods = stale_periods
        self.forget_after_s = forget_after_s
        self.max_members = max_members
        self._members: dict[tuple[str, str, str], Member] = {}
        self._lock = threading.Lock()
        self.messages = 0
        self.rejected = 0
        self.per_client_ignored = 0  # per-robot figures in a robot's own telemetry: not trusted, dropped
        self.members_refused = 0  # messages of new members while the table was full of live ones
        self.members_forgotten = 0

    @staticmethod
    def _identify(key: str) -> tuple[str, AppKey, str] | None:
        try:
            parsed = parse_key(key)
        except KeyExprError:
            return None
        if parsed.server_id is not None:
            return "server", parsed.app, parsed.server_id
        if parsed.client_id is not None and parsed.topic == "metrics":
            return "client", parsed.app, parsed.client_id
        return None

    def _member(self, kind: str, app: AppKey, member_id: str, now_s: float) -> Member | None:
        """The member, made if there is room (the longest-silent one without a live token makes room)."""
        ident = (kind, app.prefix, member_id)
        member = self._members.get(ident)
        if member is None:
            if len(self._members) >= self.max_members:
                # Make room for an eighth at once (a flood of new ids costs a sort per eighth, not a
                # scan per message), taking the longest-quiet members that have no live token.
                evictable = sorted((m.quiet_since_s() or float("-inf"), i) for i, m in self._members.items()
                                   if m.alive is not True)[:max(1, self.max_members // 8)]
                if not evictable:
                    self.members_refused += 1
                    return None
                for _, i in evictable:
                    del self._members[i]
                self.members_forgotten += len(evictable)
            member = self._members[ident] = Member(kind, app, member_id)
        return member

    def on_telemetry(self, key: str, msg: Telemetry, now_s: float) -> None:
        ident = self._identify(key)
        with self._lock:
            if ident is None or msg.source != ident[0]:  # a key that is no member's, or a client posing as a server
                self.rejected += 1
                return
            member = self._member(*ident, now_s)
            if member is None:
                return
            self.messages += 1
            member.last_seen_s = now_s
            member.period_s = msg.period_s or 1.0
            member.metrics = _bounded(msg.metrics)
            if member.kind == "server":
                member.per_client = {k: _bounded(v) for k, v in list(msg.per_client.items())[:MAX_PER_CLIENT]
                                     if isinstance(v, dict)}
            elif msg.per_client:
                self.per_client_ignored += 1  # only a server's figures about a robot are its server figures
            member.labels = dict(list(msg.labels.items())[:MAX_FIGURES])

    def on_liveliness(self, key: str, alive: bool, now_s: float) -> None:
        ident = self._identify(key)
        if ident is None:
            return
        with self._lock:
            if not alive and (ident[0], ident[1].prefix, ident[2]) not in self._members:
                return  # a token we never knew of vanished: nothing to keep
            member = self._member(*ident, now_s)
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

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]:
        """(member kind, figure name, labels, value) for every figure of every member (Prometheus).

        Member kind: "server", "client", "server_client" for a server's per-client figures, or
        "monitor" for the monitor's own counts (`own_figures`, no labels);
        `alive` is the liveliness token (1 present, 0 vanished). telemetry/prometheus.py names them.
        """
        out = []
        for m in self.members():
            base = {"cluster": m.app.cluster, "experiment": m.app.experiment, "model": m.app.model,
                    "version": m.app.version, "app": m.app.app}
            own = {**base, m.kind: m.member_id}
            for name, value in m.metrics.items():
                out.append((m.kind, name, own, float(value)))
            for client_id, figures in m.per_client.items():
                for name, value in figures.items():
                    out.append(("server_client", name, {**own, "client": client_id}, float(value)))
            if m.alive is not None:
                out.append((m.kind, "alive", own, 1.0 if m.alive else 0.0))
        out.extend(("monitor", name, {}, float(value)) for name, value in self.own_figures().items())
        return out

    def own_figures(self) -> dict[str, int]:
        """What the monitor itself counted: accepted and refused messages, members kept, forgotten
        and refused (the bounds of "What the monitor trusts", docs/telemetry.md)."""
        with self._lock:
            return {"messages": self.messages, "rejected": self.rejected, "per_client_ignored": self.per_client_ignored,
                    "members": len(self._members), "members_refused": self.members_refused,
                    "members_forgotten": self.members_forgotten}

    def status_line(self) -> str:
        """The table's last line: the monitor's own counts, those that are not 0."""
        figures = self.own_figures()
        words = {"messages": "messages", "rejected": "rejected", "per_client_ignored": "robot-sent per-robot figures dropped",
                 "members": "members", "members_forgotten": "forgotten", "members_refused": "refused (table full)"}
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
