"""The monitor's picture of a fleet, built from Telemetry messages and liveliness events.

Pure state with an injected clock: `on_telemetry(key, msg, now_s)`, `on_liveliness(key, alive,
now_s)`, then `rows(now_s)` for the table and `samples()` for Prometheus.
"""

from __future__ import annotations

import textwrap
import threading
from dataclasses import dataclass, field

from lerobot_zenoh.errors import KeyExprError
from lerobot_zenoh.protocol.keys import AppKey, parse_key
from lerobot_zenoh.protocol.messages import Telemetry

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
    last_seen_s: float | None = None
    period_s: float = 1.0
    metrics: dict = field(default_factory=dict)
    per_client: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)

    def age_s(self, now_s: float) -> float | None:
        return None if self.last_seen_s is None else now_s - self.last_seen_s

    def silent(self, now_s: float, stale_periods: float = 3.0) -> bool:
        """Gone quiet: its token vanished, or no telemetry for `stale_periods` periods."""
        if self.alive is False:
            return True
        age = self.age_s(now_s)
        return age is None or age > stale_periods * max(self.period_s, 0.1)


class FleetView:
    def __init__(self, stale_periods: float = 3.0):
        self.stale_periods = stale_periods
        self._members: dict[tuple[str, str, str], Member] = {}
        self._lock = threading.Lock()
        self.messages = 0
        self.rejected = 0

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

    def _member(self, kind: str, app: AppKey, member_id: str) -> Member:
        ident = (kind, app.prefix, member_id)
        member = self._members.get(ident)
        if member is None:
            member = self._members[ident] = Member(kind, app, member_id)
        return member

    def on_telemetry(self, key: str, msg: Telemetry, now_s: float) -> None:
        ident = self._identify(key)
        with self._lock:
            if ident is None:
                self.rejected += 1
                return
            self.messages += 1
            member = self._member(*ident)
            member.last_seen_s = now_s
            member.period_s = msg.period_s or 1.0
            member.metrics = dict(msg.metrics)
            member.per_client = {k: dict(v) for k, v in msg.per_client.items()}
            member.labels = dict(msg.labels)

    def on_liveliness(self, key: str, alive: bool, now_s: float) -> None:
        ident = self._identify(key)
        if ident is None:
            return
        with self._lock:
            self._member(*ident).alive = alive

    def members(self) -> list[Member]:
        with self._lock:
            return sorted(self._members.values(), key=lambda m: (m.app.prefix, m.kind != "server", m.member_id))

    def rows(self, now_s: float) -> list[dict]:
        """One dict per member: identity, state, age and the key figures of its kind."""
        out = []
        for m in self.members():
            columns = SERVER_COLUMNS if m.kind == "server" else CLIENT_COLUMNS
            state = "SILENT" if m.silent(now_s, self.stale_periods) else "up"
            if m.kind == "client" and m.metrics.get("revalidating"):
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

    def samples(self) -> list[tuple[str, str, dict[str, str], float]]:
        """(member kind, figure name, labels, value) for every figure of every member (Prometheus).

        Member kind: "server", "client", or "server_client" for a server's per-client figures;
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
        return out


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
