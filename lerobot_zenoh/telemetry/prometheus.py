"""Telemetry figures as Prometheus metric families: names, types, base units and help texts.

Pure: :func:`families` turns `FleetView.samples()` into `(name, type, help, [(labels, value)])`,
following Prometheus' naming rules (what `promtool check metrics` checks): counts that only grow
are counters named `..._total`; times are in seconds and memory in bytes, the unit last in the
name; every family has a HELP text. The monitor serves them (cli/monitor.py); docs/telemetry.md
lists them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "lerobot_zenoh"

#: Figures that only grow (reset when their process restarts): exported as counters.
COUNTERS = {
    "observations_received": "Observations put into a client slot",
    "observations_superseded": "Observations replaced in their slot by a newer one before being served",
    "observations_rejected": "Observations rejected, for any reason",
    "inferences": "Action chunks published",
    "takeovers": "Times this standby server took over from its primary",
    "standby_dropped": "Observations dropped unseen while standing by",
    "observations_for_other_components": "Task-stream observations whose component_mask does not ask this model (dropped unread)",
    "answers_withheld": "Answers a fault-injecting runner withheld (synthetic silent_after)",
    "loop_overruns": "Control steps that ended after their deadline",
    "trimmed_steps": "Leading chunk steps dropped as already expired",
    "empty_buffer_cycles": "Control steps without an action (the fail-safe action was sent)",
    "chunks_received": "Action chunks merged into the action buffer",
    "chunks_rejected": "Action chunks refused (malformed, wrong size, unanswered)",
    "observations_published": "Observations sent to the server",
    "observations_same_host": "Observations sent with raw frames in the same-host ring",
    "observations_dropped_in_outbox": "Observations replaced by a newer one before they could be sent",
    "watchdog_events": "Times the watchdog started a search for a server",
    "session_renewals": "New session nonces drawn after requests in a row went unanswered",
    "steps": "Control steps executed",
    "dataset_frames": "Frames written to the LeRobotDataset",
    "shm_rings_opened": "Same-host frame rings mapped since start (a ring is mapped once)",
    "shm_orphans_removed": "Shared-memory files of dead clients removed",
}

#: A pipeline client's per-component SLO counts (`slo.<component>.<figure>`, label `component`).
SLO_COUNTERS = {
    "requests": "Observations that asked the task component",
    "answered": "Answers of the task component to them, in time or late",
    "met": "Task component answers within the SLO deadline",
    "missed": "Task component requests not answered by their SLO deadline",
    "late": "Task component answers after their deadline",
    "fallbacks": "Fallbacks taken for the task component (on_slo_miss, on_danger)",
    "rejected": "Task component answers to nothing asked or with a label that does not fit",
}

#: A pipeline client's own figures: (type, help).
PIPELINE = {
    "pipeline.attempt": ("gauge", "Attempts at the task so far"),
    "pipeline.failures": ("counter", "Failed attempts at the task"),
    "pipeline.mode": ("gauge", "The robot's mode: 0 the policy's actions, 1 hold, 2 zero velocity, 3 safe pose"),
    "pipeline.override_steps": ("counter", "Control steps whose action came from a fallback or danger mode"),
    "pipeline.results_dropped": ("counter", "Text and verdict answers dropped for a full inbox"),
    "pipeline.results_rejected": ("counter", "Undecodable text and verdict answers"),
}

#: An edge scheduler's per-engine counts (`engine.<id>.<figure>`, label `engine`; docs/server.md).
ENGINE_COUNTERS = {
    "dispatched": "Requests placed on this engine",
    "answered": "Requests this engine answered and the scheduler served",
    "requeued": "Requests taken back from this engine (no answer in time, partition, restart, refusal)",
    "late": "Answers of requests already taken back from this engine (dropped)",
    "refused": "Answers or statuses of this engine refused (wrong model, version or shape)",
    "restarts": "Restarts of this engine seen by the scheduler (it was re-profiled)",
    "partitions": "Times this engine was taken out for unanswered probes or a lost liveliness token",
}
ENGINE_GAUGES = {
    "up": "1 while the scheduler places requests on this engine",
    "in_flight": "Requests on this engine not answered yet",
    "offload_share": "This engine's share of the requests answered",
    "rtt_ms": "Measured round trip to this engine (smallest of its last probes; -1: not measured)",
    "bandwidth_mbps": "Measured bandwidth towards this engine (largest recent sample; negative: not measured)",
    "estimate_ms_mean": "Placement's latency estimate for requests placed on this engine, mean of the last 256",
    "actual_ms_mean": "Dispatch to answer of requests placed on this engine, mean of the last 256",
    "queue_estimate_ms_mean": "Queueing delay placement expected (admission to batch start) on this engine, mean of the last 256",
    "queue_actual_ms_mean": "Queueing delay that happened (admission to batch start) on this engine, mean of the last 256",
}

#: The monitor's own figures (FleetView.own_figures): (type, help).
MONITOR = {
    "messages": ("counter", "Telemetry messages the monitor accepted"),
    "rejected": ("counter", "Telemetry messages refused: undecodable, on a key that is no member's, a client posing "
                            "as a server, or dropped for a full inbox"),
    "per_client_ignored": ("counter", "Robot telemetry messages whose per-robot figures were dropped (only a "
                                      "server's are trusted)"),
    "members": ("gauge", "Servers and robots the monitor keeps now"),
    "members_refused": ("counter", "Messages of new members refused while every kept member had a live token"),
    "members_forgotten": ("counter", "Members forgotten: gone or silent for forget_after_s, or displaced when "
                                     "the table was full"),
}

#: Help texts of the gauges (figures not listed get a generic one).
GAUGES = {
    "clients": "Clients with an admitted observation so far",
    "serving": "1 while this server serves (a hot standby reports 0 while its primary is up)",
    "batch_size_mean": "Observations per forward pass, mean of the last 256 passes",
    "max_batch_size": "Most observations per forward pass in use",
    "shm_rings_mapped": "Same-host frame rings mapped now",
    "buffer_depth": "Actions buffered on the robot now",
    "revalidating": "1 while the client looks for a valid server",
    "loop_hz": "Control steps per second over the last telemetry period",
    "inference_ms": "Server compute time per action chunk",
    "queue_ms": "Age of an observation in its slot when the inference loop took it",
    "control_period_ms": "Measured control period",
    "rtt_ms": "Round trip: observation captured to its action chunk received",
    "cpu_rss_mb": "Resident memory of the server process",
    "gpu_allocated_mb": "CUDA memory allocated by the server process",
    "gpu_reserved_mb": "CUDA memory reserved by the server process",
    "batch_profile": "One forward pass over batch_size observations, measured at start-up",
    "alive": "1 while its liveliness token is present, 0 once it vanished",
}

#: Figure names whose Prometheus name is not the figure name with its unit converted.
RENAMES = {"loop_hz": "control_loop_rate_hertz", "buffer_depth": "buffered_actions", "alive": "up",
           "cpu_rss_mb": "resident_memory_bytes"}


@dataclass
class Family:
    name: str  # counters without the `_total` the exposition adds
    kind: str  # "counter" | "gauge"
    help: str
    samples: list[tuple[dict[str, str], float]]


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def describe(member_kind: str, figure: str) -> tuple[str, str, str, float, dict[str, str]]:
    """(family name, type, help, scale to base units, extra labels) of one telemetry figure.

    `member_kind`: "server", "client", "server_client" (a server's per-client figure) or "monitor"
    (the monitor's own counts).
    """
    base = f"{PREFIX}_{member_kind}"
    extra: dict[str, str] = {}
    if member_kind == "monitor" and figure in MONITOR:
        kind, help_text = MONITOR[figure]
        return f"{base}_{figure}", kind, help_text, 1.0, extra
    if figure.startswith("rejected."):
        return (f"{base}_observations_rejected_by_reason", "counter", "Observations rejected, by reason",
                1.0, {"reason": figure.split(".", 1)[1]})
    if figure.startswith("answers."):  # answers.actions, answers.text, answers.verdict.<label>
        output, _, label = figure.split(".", 1)[1].partition(".")
        return (f"{base}_answers", "counter", "Answers published, by output (and verdict label)", 1.0,
                {"output": output, **({"label": label} if label else {})})
    if m := re.fullmatch(r"slo\.([^.]+)\.(.+)", figure):  # a pipeline client's per-component SLO figures
        component, what = m.groups()
        labels = {"component": component}
        if what in SLO_COUNTERS:
            return f"{base}_slo_{what}", "counter", SLO_COUNTERS[what], 1.0, labels
        if q := re.fullmatch(r"latency_ms_p(\d+)", what):
            return (f"{base}_slo_latency_p{q.group(1)}_seconds", "gauge",
                    f"Task component latency, capture to answer, {q.group(1)}th percentile", 1e-3, labels)
        if what == "slo_violated":
            return (f"{base}_slo_violated", "gauge", "1 when fewer than the SLO's percentile of the task component's "
                    "last 200 decided requests were answered in time", 1.0, labels)
        if what == "attainment":
            return f"{base}_slo_attainment_ratio", "gauge", "Task component requests answered within the SLO deadline, of those decided", 1.0, labels
        return f"{base}_slo_{_sanitize(what)}", "gauge", f"Task component figure {what} (docs/telemetry.md)", 1.0, labels
    if m := re.fullmatch(r"engine\.([^.]+)\.(.+)", figure):  # an edge scheduler's engines (docs/server.md)
        engine, what = m.groups()
        labels = {"engine": engine}
        if what.startswith("refused."):
            return (f"{base}_engine_refused_by_reason", "counter", "Engine answers refused, by reason", 1.0,
                    {**labels, "reason": what.split(".", 1)[1]})
        if what in ENGINE_COUNTERS:
            return f"{base}_engine_{what}", "counter", ENGINE_COUNTERS[what], 1.0, labels
        if what.endswith("_ms") or what.endswith("_ms_mean"):
            stem = what.removesuffix("_mean").removesuffix("_ms")
            return (f"{base}_engine_{_sanitize(stem)}_seconds", "gauge", ENGINE_GAUGES.get(what, f"Engine figure {what}"),
                    1e-3, labels)
        if what == "bandwidth_mbps":
            return f"{base}_engine_bandwidth_bytes_per_second", "gauge", ENGINE_GAUGES[what], 1e6 / 8, labels
        return f"{base}_engine_{_sanitize(what)}", "gauge", ENGINE_GAUGES.get(what, f"Engine figure {what}"), 1.0, labels
    if m := re.fullmatch(r"served\.(edge|cloud)", figure):  # a robot's chunks by the tier that computed them
        return f"{base}_served_chunks", "counter", "Action chunks of this client, by the tier that computed them", 1.0, {
            "tier": m.group(1)}
    if figure == "pipeline.danger_reaction_ms_max":
        return (f"{base}_pipeline_danger_reaction_max_seconds", "gauge",
                "Longest time from a verdict's arrival to the robot's first command in the mode it set", 1e-3, extra)
    if figure in PIPELINE:
        kind, help_text = PIPELINE[figure]
        return f"{base}_{_sanitize(figure)}", kind, help_text, 1.0, extra
    if m := re.fullmatch(r"batch_profile\.(\d+)_ms", figure):
        return f"{base}_batch_profile_seconds", "gauge", GAUGES["batch_profile"], 1e-3, {"batch_size": m.group(1)}
    if figure.startswith("scheduler."):
        key = figure.split(".", 1)[1]
        return (f"{base}_scheduler_{_sanitize(key)}", "gauge",
                f"Request scheduler figure {key} (docs/scheduling.md)", 1.0, extra)
    if figure in COUNTERS:
        return f"{base}_{figure}", "counter", COUNTERS[figure], 1.0, extra
    if member_kind == "client" and figure == "inference_ms_p50":
        return f"{base}_server_inference_p50_seconds", "gauge", "Server compute time per action chunk, as reported to this client, median", 1e-3, extra
    if figure in RENAMES:
        return f"{base}_{RENAMES[figure]}", "gauge", GAUGES.get(figure, figure), 2.0**20 if figure.endswith("_mb") else 1.0, extra
    if m := re.fullmatch(r"(.+)_ms_p(\d+)", figure):
        stem, q = m.groups()
        what = GAUGES.get(f"{stem}_ms", f"Figure {stem}")
        return f"{base}_{_sanitize(stem)}_p{q}_seconds", "gauge", f"{what}, {q}th percentile", 1e-3, extra
    if m := re.fullmatch(r"(.+)_ms", figure):
        return f"{base}_{_sanitize(m.group(1))}_seconds", "gauge", GAUGES.get(figure, f"Figure {figure}"), 1e-3, extra
    if m := re.fullmatch(r"(.+)_mb", figure):
        return f"{base}_{_sanitize(m.group(1))}_bytes", "gauge", GAUGES.get(figure, f"Figure {figure}"), 2.0**20, extra
    return f"{base}_{_sanitize(figure)}", "gauge", GAUGES.get(figure, f"Telemetry figure {figure} (docs/telemetry.md)"), 1.0, extra


def families(samples: list[tuple[str, str, dict[str, str], float]]) -> list[Family]:
    """Group `(member kind, figure, labels, value)` samples into metric families, sorted by name."""
    out: dict[str, Family] = {}
    for member_kind, figure, labels, value in samples:
        name, kind, help_text, scale, extra = describe(member_kind, figure)
        family = out.get(name)
        if family is None:
            family = out[name] = Family(name, kind, help_text, [])
        elif family.kind != kind:  # two figures would share a name with different types: keep the first
            continue
        family.samples.append(({**labels, **extra}, float(value) * scale))
    return [out[k] for k in sorted(out)]
