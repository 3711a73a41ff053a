"""Telemetry figures as Prometheus metric families, typed by one declared table.

Servers and robots publish flat figure names (`inferences`, `sessions_closed.idle`,
`engine.cloud0.requeued`, ...; docs/telemetry.md); this module is where each one gets its type, its
Prometheus name, its base unit and its labels. :data:`METRICS` declares them: one :class:`Metric`
per figure pattern, where `<label>` chunks of the pattern become labels (reasons, outcomes, engines,
components: labels, never parts of a metric name). Prometheus' conventions (what `promtool check
metrics` checks and more): a count that only grows is a counter, exported as `..._total`; times are
in seconds and memory in bytes with the unit last in the name; every family has a HELP text.

A figure the table does not declare (a newer server's, or a forged one) is exported as `untyped`
under a sanitised name: the monitor does not guess a type. The test of a running fleet fails when a
real server or robot publishes a figure that is not declared. Names are checked against
Prometheus' grammar and :data:`MAX_NAME_CHARS` before they are exported (`valid_metric_name`).

Latencies are histograms as well (:data:`HISTOGRAMS`): a member's `<name>_hist.*` figures
(telemetry/histogram.py) become one `_bucket{le}`/`_sum`/`_count` series in seconds, with every
declared bound, so that the series of several servers add up in PromQL.

Pure: :func:`families` turns `FleetView.samples()` into :class:`Family` records and :func:`render`
writes them as Prometheus' text format within a byte budget; the monitor serves them (cli/monitor.py). :func:`reference_rows` renders the table for docs/telemetry.md (a test keeps
the two equal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from lerobot_zenoh.telemetry.histogram import HANDOVER_BOUNDS_S, LATENCY_BOUNDS_S, SUFFIX, parse_bound

PREFIX = "lerobot_zenoh"

#: Longest metric or label name exported, and longest label value (characters).
MAX_NAME_CHARS = 200
MAX_LABEL_VALUE_CHARS = 256

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

SERVER, SERVER_CLIENT, CLIENT, MONITOR = "server", "server_client", "client", "monitor"
_SERVERS = frozenset({SERVER, SERVER_CLIENT})

_FAMILY_PREFIX = {SERVER: "server", SERVER_CLIENT: "server_client", CLIENT: "client", MONITOR: "monitor"}


@dataclass(frozen=True)
class Metric:
    """One declared figure pattern and the Prometheus family it becomes.

    `figure`: the figure name as published, `<name>` standing for one dot-free chunk that becomes
    label `name`. `name`: the family name after `lerobot_zenoh_<kind>_`, counters without the
    `_total` the exposition adds. `unit`: the base unit of the exported value (`1` for a plain count).
    `scale`: multiplies the published value into that unit (ms -> s: 1e-3). `fixed`: labels every
    sample of it carries.
    """

    figure: str
    name: str
    kind: str  # "counter" | "gauge"
    unit: str
    help: str
    kinds: frozenset = _SERVERS
    scale: float = 1.0
    fixed: tuple[tuple[str, str], ...] = ()
    pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = "".join(f"(?P<{p[1:-1]}>[^.]+)" if p.startswith("<") else re.escape(p)
                        for p in re.split(r"(<[a-z_]+>)", self.figure) if p)
        object.__setattr__(self, "pattern", re.compile(regex))

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.fixed) + tuple(self.pattern.groupindex)


def _c(figure: str, name: str, help_text: str, kinds=_SERVERS, unit: str = "1", scale: float = 1.0,
       fixed: dict | None = None) -> Metric:
    return Metric(figure, name, "counter", unit, help_text, frozenset(kinds), scale, tuple((fixed or {}).items()))


def _g(figure: str, name: str, help_text: str, kinds=_SERVERS, unit: str = "1", scale: float = 1.0,
       fixed: dict | None = None) -> Metric:
    return Metric(figure, name, "gauge", unit, help_text, frozenset(kinds), scale, tuple((fixed or {}).items()))


S, SC, C, M = {SERVER}, {SERVER_CLIENT}, {CLIENT}, {MONITOR}
MS = 1e-3
MIB = 2.0**20


def _percentiles(figure: str, name: str, help_text: str, kinds, qs=("50", "99"), unit: str = "seconds",
                 scale: float = MS) -> list[Metric]:
    return [_g(figure.format(q=q), name.format(q=q), f"{help_text}, {q}th percentile", kinds, unit, scale)
            for q in qs]


#: Every figure servers, robots and the monitor publish, typed (docs/telemetry.md, "Metric reference").
METRICS: list[Metric] = [
    # -- a server's model (and, SC, its per-robot copies) --------------------------------------------------
    _g("clients", "clients", "Client sessions open now", S),
    _g("sessions_open", "sessions_open", "Client sessions open now", S),
    _g("sessions_unknown_open", "sessions_unknown_open", "Open sessions of clients not listed in the manifest", S),
    _c("sessions_opened", "sessions_opened", "Client sessions opened since start", S),
    _c("sessions_closed.<reason>", "sessions_closed", "Client sessions closed, by reason", S),
    _c("observations_received", "observations_received", "Observations put into a client slot"),
    _c("observations_superseded", "observations_superseded",
       "Observations replaced in their slot by a newer one before being served"),
    _c("observations_rejected", "observations_rejected", "Observations rejected, for any reason"),
    _c("rejected.<reason>", "observations_rejected_by_reason", "Observations rejected, by reason"),
    _c("observations_rate_limited", "observations_rate_limited",
       "Observations dropped during a client's cool-down after repeated rejections"),
    _c("observations_refreshes", "observations_refreshes",
       "Re-fetch refreshes put into their waiting request's slot"),
    _c("refreshes_late", "refreshes_late", "Re-fetch refreshes dropped on arrival: their request no longer waited"),
    _c("inferences", "inferences", "Action chunks published"),
    _c("actions_dropped", "actions_dropped", "Chunks never handed to Zenoh: the client's action queue was full"),
    _c("served.<tier>", "served_chunks", "Action chunks of this client, by the tier that computed them", SC),
    *_percentiles("inference_ms_p{q}", "inference_p{q}_seconds", "Server compute time per action chunk", _SERVERS),
    *_percentiles("queue_ms_p{q}", "queue_p{q}_seconds",
                  "Age of an observation in its slot when the inference loop took it", _SERVERS),
    _g("serving", "serving", "1 while this server serves (a hot standby reports 0 while its primary is up)", S),
    _c("takeovers", "takeovers", "Times this standby server took over from its primary", S),
    _c("takeovers_stalled", "takeovers_stalled",
       "Takeovers of a primary still alive that served no more (frozen, stuck loop, dead device)", S),
    _g("failed", "failed", "1 once the model's serving turns kept failing and it was withdrawn (no longer served)", S),
    _c("loop_faults", "loop_faults", "Faults in the model's serving turns (each logged with its traceback)", S),
    _c("standby_dropped", "standby_dropped", "Observations dropped unseen while standing by", S),
    _c("answers_held", "answers_held", "Computed answers not published: woken from a freeze, or replaced meanwhile", S),
    _c("stepped_back", "stepped_back", "Times this standby server stopped serving for its primary", S),
    _c("primary_found_serving", "primary_found_serving",
       "Step-backs of this standby on hearing its primary's heartbeat say it serves too", S),
    _c("heartbeats_refused", "heartbeats_refused",
       "Other servers' heartbeats refused: too large, unreadable, out of range or naming another server than their key", S),
    _c("heartbeats_refused.<reason>", "heartbeats_refused_by_reason", "Other servers' heartbeats refused, by reason", S),
    _c("heartbeats_superseded", "heartbeats_superseded",
       "Other servers' heartbeats replaced by their sender's newer one before they were read (only the newest is read)", S),
    _c("replacement_claims_ignored", "replacement_claims_ignored",
       "Heartbeats claiming a standby replaced this server, which had not stalled (ignored)", S),
    _c("observations_for_other_components", "observations_for_other_components",
       "Task-stream observations whose component_mask does not ask this model (dropped unread)", S),
    _c("answers_withheld", "answers_withheld", "Answers a fault-injecting runner withheld (synthetic silent_after)", S),
    _c("answers.verdict.<label>", "answers", "Answers published, by output (and verdict label)", S,
       fixed={"output": "verdict"}),
    _c("answers.<output>", "answers", "Answers published, by output (and verdict label)", S),
    _c("refusals_sent.<reason>", "refusals_sent", "Refusals published to the clients that read them, by reason", S),
    _g("telemetry.per_client_shed", "telemetry_per_client_shed",
       "Present when the last message was over the monitor's limit: 1 per-robot histograms left out, 2 every per-robot figure", S),
    _g("batch_size_mean", "batch_size_mean", "Observations per forward pass, mean of the last 256 passes", S),
    _g("max_batch_size", "max_batch_size", "Most observations per forward pass in use", S),
    _c("batch_fallbacks", "batch_fallbacks", "Batches that failed and were served again one request at a time", S),
    _c("jpeg_device_fallbacks", "jpeg_device_fallbacks",
       "Batches whose JPEG frames nvJPEG could not decode, decoded on the CPU instead (images_on_device)", S),
    _g("compile.buckets", "compile_buckets", "Batch sizes served by a compiled graph (0: eager)", S),
    _c("compile.eager_calls", "compile_eager_calls",
       "Calls of a compiled model run eager instead (a shape no graph was compiled for)", S),
    _g("batch_profile.<batch_size>_ms", "batch_profile_seconds",
       "One forward pass over batch_size observations, measured at start-up", S, "seconds", MS),
    _g("shm_rings_mapped", "shm_rings_mapped", "Same-host frame rings mapped now", S),
    _c("shm_rings_opened", "shm_rings_opened", "Same-host frame rings mapped since start", S),
    _c("shm_orphans_removed", "shm_orphans_removed", "Shared-memory files of dead clients removed", S),
    _g("cpu_rss_mb", "resident_memory_bytes", "Resident memory of the server process", S, "bytes", MIB),
    _g("gpu_allocated_mb", "gpu_allocated_bytes", "CUDA memory allocated by the server process", S, "bytes", MIB),
    _g("gpu_reserved_mb", "gpu_reserved_bytes", "CUDA memory reserved by the server process", S, "bytes", MIB),
    # request schedulers' own figures (docs/scheduling.md)
    _g("scheduler.clients", "scheduler_clients", "Clients in the round-robin order", S),
    _g("scheduler.waiting", "scheduler_waiting", "Clients with an observation waiting to be served", S),
    _g("scheduler.tasks", "scheduler_tasks", "Tasks the wait-ratio scheduler follows", S),
    _g("scheduler.skipped_max", "scheduler_skipped_max", "Most consecutive decisions a waiting task was skipped", S),
    _c("scheduler.decisions", "scheduler_decisions", "Scheduling decisions made", S),
    # a pi0.5 serving text from its action prefill (docs/policies.md)
    *[_c(f"language.{k}", f"language_{k}", h, S) for k, h in (
        ("tokens", "Text tokens generated"), ("decode_steps", "Batched text decode steps"),
        ("step_rows", "Rows summed over text decode steps"), ("started", "Text generations started"),
        ("evicted", "Text generations evicted"), ("forgotten", "Text generations forgotten (their robot went)"),
        ("busy", "Text requests answered busy: the robot's text was still being written"),
        ("budget_shrunk", "Text decode steps whose token budget was shrunk to keep the action SLO"))],
    _c("language.finished.<reason>", "language_finished", "Text generations finished, by reason (stop, limit)", S),
    _c("language.decode_ms", "language_decode_seconds", "Time spent decoding text", S, "seconds", MS),
    _c("language.step_ms", "language_step_seconds", "Time spent in text decode steps, overhead included", S,
       "seconds", MS),
    _g("language.active", "language_active", "Text generations pending or running", S),
    _g("language.cached_tokens", "language_cached_tokens", "Tokens held in the text generations' KV caches", S),
    # pi0-FAST's continuous batching
    _g("decode.slots", "decode_slots", "KV cache slots", S),
    _g("decode.running", "decode_running", "Requests decoding now", S),
    _g("decode.waiting", "decode_waiting", "Requests waiting for a KV slot", S),
    _g("decode.kv_bytes", "decode_kv_bytes", "Bytes of the KV cache", S, "bytes"),
    _c("decode.kv_allocations", "decode_kv_allocations", "KV cache allocations", S),
    _c("decode.kv_evictions", "decode_kv_evictions", "KV cache evictions", S),
    _c("decode.finished_<reason>", "decode_finished", "Decodes finished, by reason (end, limit)", S),
    _c("decode.prefills", "decode_prefills", "Prefills run", S),
    _c("decode.prefill_ms", "decode_prefill_seconds", "Time spent in prefills", S, "seconds", MS),
    _c("decode.decode_steps", "decode_steps", "Decode steps run", S),
    _c("decode.decode_rows", "decode_rows", "Rows summed over decode steps", S),
    _c("decode.decode_ms", "decode_seconds", "Time spent in decode steps", S, "seconds", MS),
    _c("decode.packed_steps", "decode_packed_steps", "Joins packed into a decode step", S),
    _c("decode.packed_ms", "decode_packed_seconds", "Time spent in packed decode steps", S, "seconds", MS),
    # a VLM component
    _c("vlm.prefill_batches", "vlm_prefill_batches", "Prefill batches of text generation", S),
    _c("vlm.decode_steps", "vlm_decode_steps", "Batched text-generation decode steps", S),
    # an edge scheduler's engines (docs/server.md)
    _g("engine.<engine>.up", "engine_up", "1 while the scheduler places requests on this engine", S),
    _g("engine.<engine>.in_flight", "engine_in_flight", "Requests on this engine not answered yet", S),
    _c("engine.<engine>.dispatched", "engine_dispatched", "Requests placed on this engine", S),
    _c("engine.<engine>.answered", "engine_answered", "Requests this engine answered and the scheduler served", S),
    _c("engine.<engine>.requeued", "engine_requeued",
       "Requests taken back from this engine (no answer in time, partition, restart, refusal)", S),
    _c("engine.<engine>.late", "engine_late", "Answers of requests already taken back from this engine (dropped)", S),
    _c("engine.<engine>.refused", "engine_refused", "Answers or statuses of this engine refused, every reason", S),
    _c("engine.<engine>.refused.<reason>", "engine_refused_by_reason", "Answers or statuses of this engine refused, by reason", S),
    _c("engine.<engine>.requeued.<reason>", "engine_requeued_by_reason",
       "Requests taken back from this engine, by reason (timeout, partition, gone, restart, bad_status, ...)", S),
    _c("engine.<engine>.errors.<reason>", "engine_errors_by_reason",
       "Error answers of this engine, by reason (a protocol reason, else engine_error); never a robot's cool-down", S),
    _c("engine.<engine>.answers_dropped_full", "engine_answers_dropped_full",
       "Answers of this engine dropped before decoding: the scheduler's answer queue was full", S),
    _g("engine.<engine>.suspect", "engine_suspect",
       "1 while this engine is suspect: a request timed out on it, nothing placed until it answers again", S),
    _c("engine.<engine>.restarts", "engine_restarts", "Restarts of this engine seen by the scheduler (it was re-profiled)", S),
    _c("engine.<engine>.partitions", "engine_partitions",
       "Times this engine was taken out for unanswered probes or a lost liveliness token", S),
    _g("engine.<engine>.offload_share", "engine_offload_share_ratio", "This engine's share of the requests answered", S, "ratio"),
    _g("engine.<engine>.rtt_ms", "engine_rtt_seconds",
       "Measured round trip to this engine (smallest of its last probes; negative: not measured)", S, "seconds", MS),
    _g("engine.<engine>.bandwidth_mbps", "engine_bandwidth_bytes_per_second",
       "Measured bandwidth towards this engine (largest recent sample; negative: not measured)", S, "bytes/s", 1e6 / 8),
    _g("engine.<engine>.estimate_ms_mean", "engine_estimate_seconds",
       "Placement's latency estimate for requests placed on this engine, mean of the last 256", S, "seconds", MS),
    _g("engine.<engine>.actual_ms_mean", "engine_actual_seconds",
       "Dispatch to answer of requests placed on this engine, mean of the last 256", S, "seconds", MS),
    _g("engine.<engine>.queue_estimate_ms_mean", "engine_queue_estimate_seconds",
       "Queueing delay placement expected (admission to batch start) on this engine, mean of the last 256", S,
       "seconds", MS),
    _g("engine.<engine>.queue_actual_ms_mean", "engine_queue_actual_seconds",
       "Queueing delay that happened (admission to batch start) on this engine, mean of the last 256", S,
       "seconds", MS),
    _g("offload_share", "offload_share_ratio", "Share of the requests answered by cloud engines", S, "ratio"),
    _c("dispatch.requeue_superseded", "dispatch_requeue_superseded",
       "Requests taken back while a newer observation of their robot waited (it stands for them)", S),
    _c("dispatch.answers_closed", "dispatch_answers_closed", "Engine answers for sessions closed meanwhile", S),
    _c("dispatch.event_errors", "dispatch_event_errors", "Engine events whose handling failed (logged; the loop went on)", S),
    # -- a robot client ------------------------------------------------------------------------------------
    _g("loop_hz", "control_loop_rate_hertz", "Control steps per second over the last telemetry period", C, "hertz"),
    *_percentiles("control_period_ms_p{q}", "control_period_p{q}_seconds", "Measured control period", C),
    *_percentiles("rtt_ms_p{q}", "rtt_p{q}_seconds", "Round trip: observation captured to its action chunk received", C),
    *_percentiles("observation_age_ms_p{q}", "observation_age_p{q}_seconds",
                  "Capture-to-inference age of the observations answered", C),
    _g("inference_ms_p50", "server_inference_p50_seconds",
       "Server compute time per action chunk, as reported to this client, median", C, "seconds", MS),
    _g("buffer_depth", "buffered_actions", "Actions buffered on the robot now", C, "actions"),
    _g("revalidating", "revalidating", "1 while the client looks for a valid server", C),
    _c("loop_overruns", "loop_overruns", "Control steps that ended after their deadline", C),
    _c("trimmed_steps", "trimmed_steps", "Leading chunk steps dropped as already expired", C),
    _c("empty_buffer_cycles", "empty_buffer_cycles", "Control steps without an action (the fail-safe action was sent)", C),
    _c("chunks_received", "chunks_received", "Action chunks merged into the action buffer", C),
    _c("chunks_rejected", "chunks_rejected", "Action chunks refused (malformed, wrong size, unanswered)", C),
    _c("observations_published", "observations_published", "Observations sent to the server", C),
    _c("observations_same_host", "observations_same_host", "Observations sent with raw frames in the same-host ring", C),
    _c("observations_dropped_in_outbox", "observations_dropped_in_outbox",
       "Observations replaced by a newer one before they could be sent", C),
    _c("requests_unanswered", "requests_unanswered", "Observations that got no chunk within the request timeout", C),
    # an OpenPI front door (docs/openpi.md): one client member for all its connections
    _g("connections", "openpi_connections", "OpenPI websocket connections open now", C),
    _c("connections_opened", "openpi_connections_opened", "OpenPI websocket connections accepted", C),
    _c("connections_closed", "openpi_connections_closed", "OpenPI websocket connections closed", C),
    _c("requests_answered", "openpi_requests_answered", "OpenPI requests answered with an action chunk", C),
    _c("observations_resent", "openpi_observations_resent", "Observations the front door sent again (lost on the way)", C),
    _c("internal_errors", "openpi_internal_errors", "OpenPI requests that failed inside the front door", C),
    _c("rejected.<reason>", "openpi_requests_rejected", "OpenPI requests refused, by reason", C),
    *_percentiles("front_door_ms_p{q}", "openpi_front_door_p{q}_seconds", "The front door's own time per request", C),
    _c("refreshes_sent", "refreshes_sent", "Re-fetch refreshes published", C),
    _c("session_renewals", "session_renewals", "New session nonces drawn after requests in a row went unanswered", C),
    _c("watchdog_events", "watchdog_events", "Times the watchdog started a search for a server", C),
    _c("steps", "steps", "Control steps executed", C),
    _c("dataset_frames", "dataset_frames", "Frames written to the LeRobotDataset", C),
    _g("rtc_active", "rtc_active", "1 while real-time chunking is on", C),
    _c("rtc_chunks", "rtc_chunks", "RTC chunks that replaced the buffer", C),
    _c("rtc_fallback_chunks", "rtc_fallback_chunks", "Chunks answering an RTC observation without its delay (blended)", C),
    _c("rtc_delay_mispredicted", "rtc_delay_mispredicted",
       "RTC chunks whose actual delay differed from the prediction by at least rtc.mispredict_steps", C),
    _c("rtc_delay_overridden", "rtc_delay_overridden", "RTC chunks for which the server assumed another delay", C),
    *_percentiles("rtc_delay_predicted_steps_p{q}", "rtc_delay_predicted_p{q}_steps",
                  "Predicted inference delay of the last 512 RTC chunks", C, ("50",), "steps", 1.0),
    *_percentiles("rtc_delay_actual_steps_p{q}", "rtc_delay_actual_p{q}_steps",
                  "Actual inference delay of the last 512 RTC chunks", C, ("50",), "steps", 1.0),
    *_percentiles("rtc_delay_error_steps_p{q}", "rtc_delay_error_p{q}_steps",
                  "Actual minus predicted delay of the last 512 RTC chunks", C, ("10", "50", "90"), "steps", 1.0),
    # a pipeline client: per component of its task (docs/pipelines.md)
    *[_c(f"slo.<component>.{k}", f"slo_{k}", h, C) for k, h in (
        ("requests", "Observations that asked the task component"),
        ("answered", "Answers of the task component to them, in time or late"),
        ("met", "Task component answers within the SLO deadline"),
        ("missed", "Task component requests not answered by their SLO deadline"),
        ("late", "Task component answers after their deadline"),
        ("fallbacks", "Fallbacks taken for the task component (on_slo_miss, on_danger)"),
        ("rejected", "Task component answers to nothing asked or with a label that does not fit"))],
    *_percentiles("slo.<component>.latency_ms_p{q}", "slo_latency_p{q}_seconds",
                  "Task component latency, capture to answer", C),
    _g("slo.<component>.attainment", "slo_attainment_ratio",
       "Task component requests answered within the SLO deadline, of those decided", C, "ratio"),
    _g("slo.<component>.slo_violated", "slo_violated",
       "1 when fewer than the SLO's percentile of the task component's last 200 decided requests were answered in time", C),
    _g("pipeline.attempt", "pipeline_attempt", "Attempts at the task so far", C),
    _c("pipeline.failures", "pipeline_failures", "Failed attempts at the task", C),
    _g("pipeline.mode", "pipeline_mode", "The robot's mode: 0 the policy's actions, 1 hold, 2 zero velocity, 3 safe pose", C),
    _c("pipeline.override_steps", "pipeline_override_steps", "Control steps whose action came from a fallback or danger mode", C),
    _c("pipeline.results_dropped", "pipeline_results_dropped", "Text and verdict answers dropped for a full inbox", C),
    _c("pipeline.results_rejected", "pipeline_results_rejected", "Undecodable text and verdict answers", C),
    _g("pipeline.danger_reaction_ms_max", "pipeline_danger_reaction_max_seconds",
       "Longest time from a verdict's arrival to the robot's first command in the mode it set", C, "seconds", MS),
    # -- both: the liveliness token ------------------------------------------------------------------------
    _g("alive", "up", "1 while its liveliness token is present, 0 once it vanished", {SERVER, CLIENT}),
    # -- the monitor's own (FleetView.own_figures) -----------------------------------------------------------
    _c("messages", "messages", "Telemetry messages the monitor accepted", M),
    _c("rejected.<reason>", "messages_rejected",
       "Telemetry messages refused, by reason: undecodable, too_large (over the size limit, not decoded), "
       "inbox_full (over the inbox's byte budget), rate_limited (over its intake in bytes per second), unknown_key (no member's key), posing (a client on a server's "
       "key), state_full (the state's byte budget "
       "held by members with a live token)", M),
    _c("per_client_ignored", "per_client_ignored",
       "Robot telemetry messages whose per-robot figures were dropped (only a server's are trusted)", M),
    _c("figures_refused.<reason>", "figures_refused",
       "Figures not kept, by reason: bad_name (not a valid name), too_long (name over the limit), not_a_number, "
       "too_many (over a member's figure count or byte budget)", M),
    _g("members", "members", "Servers and robots the monitor keeps now", M),
    _c("members_refused", "members_refused", "Messages of new members refused while every kept member had a live token", M),
    _c("members_forgotten", "members_forgotten",
       "Members forgotten: gone or silent for forget_after_s, or displaced when the table or the state budget was full", M),
    _g("state_bytes", "state_bytes", "Bytes of figures, labels and names the monitor keeps (as it accounts them)", M, "bytes"),
    _g("inbox_bytes", "inbox_bytes", "Bytes of telemetry waiting in the monitor's inbox", M, "bytes"),
    _c("series_dropped", "series_dropped",
       "Series left out of a scrape because /metrics reached its size budget", M),
]


@dataclass(frozen=True)
class Histogram:
    """One latency histogram (telemetry/histogram.py): figures `<figure>_hist.le_<µs>`, `.sum_s`,
    `.count` of a member become family `lerobot_zenoh_<kind>_<name>` with `_bucket{le}`, `_sum`,
    `_count` in seconds, every bound of `bounds_s` present so that series of several servers add up."""

    figure: str
    name: str
    help: str
    kinds: frozenset
    bounds_s: tuple[float, ...] = LATENCY_BOUNDS_S


#: Every latency exported as a histogram, besides the percentile gauges the live table shows.
HISTOGRAMS: list[Histogram] = [
    Histogram("inference", "inference_seconds", "Server compute time per action chunk", _SERVERS),
    Histogram("queue", "queue_seconds", "Age of an observation in its slot when the inference loop took it", _SERVERS),
    Histogram("rtt", "rtt_seconds", "Round trip: observation captured to its action chunk received", frozenset(C)),
    Histogram("handover", "handover_seconds",
              "Time the control loop was held handing an observation to its publisher", frozenset(C), HANDOVER_BOUNDS_S),
]
_HIST_BY_KIND: dict[str, dict[str, Histogram]] = {k: {h.figure + SUFFIX: h for h in HISTOGRAMS if k in h.kinds}
                                                  for k in _FAMILY_PREFIX}

#: The declared figures of each member kind, in the table's order (the first that fits a figure wins).
_BY_KIND: dict[str, list[Metric]] = {k: [m for m in METRICS if k in m.kinds] for k in _FAMILY_PREFIX}


@dataclass(frozen=True)
class Described:
    name: str  # the family name (counters without `_total`)
    kind: str  # "counter" | "gauge" | "untyped" | "histogram"
    help: str
    scale: float
    labels: tuple[tuple[str, str], ...]  # labels of the figure itself (reason, engine, ...)
    declared: bool
    valid: bool = True  # its name and its labels' names pass Prometheus' grammar and MAX_NAME_CHARS


@dataclass
class Family:
    name: str  # counters without the `_total` the exposition adds
    kind: str  # "counter" | "gauge" | "untyped" | "histogram"
    help: str
    samples: list[tuple[dict[str, str], float]]
    # a histogram's: (labels, [(bound in s, cumulative count)] ending with +inf, sum in s)
    histograms: list[tuple[dict[str, str], list[tuple[float, float]], float]] = field(default_factory=list)


class _HistogramSeries:
    """One member's (one robot's) figures of one histogram, gathered before they become buckets."""

    def __init__(self, spec: Histogram, labels: dict[str, str]):
        self.spec = spec
        self.labels = labels
        self.bins: dict[float, float] = {}
        self.sum_s = 0.0
        self.valid = True

    def add(self, part: str, value: float) -> None:
        if not (value >= 0 and value != float("inf")):  # negative, NaN or infinite: no histogram
            self.valid = False
        elif part == "sum_s":
            self.sum_s = value
        elif part != "count":  # the count is the +Inf bucket's (they must be equal)
            bound = parse_bound(part)
            if bound is None or len(self.bins) >= 64:
                self.valid = False
            else:
                self.bins[bound] = value

    def buckets(self) -> list[tuple[float, float]]:
        bounds = sorted({*self.spec.bounds_s, *self.bins, float("inf")})
        out, total = [], 0.0
        for b in bounds:
            total += self.bins.get(b, 0.0)
            out.append((b, total))
        return out


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def valid_metric_name(name: str) -> bool:
    """Prometheus' metric name grammar, and at most MAX_NAME_CHARS characters."""
    return len(name) <= MAX_NAME_CHARS and _METRIC_NAME.fullmatch(name) is not None


@lru_cache(maxsize=256)  # a handful of label names, checked for every sample
def valid_label_name(name: str) -> bool:
    """Prometheus' label name grammar (`__` names are reserved), and at most MAX_NAME_CHARS characters."""
    return len(name) <= MAX_NAME_CHARS and not name.startswith("__") and _LABEL_NAME.fullmatch(name) is not None


@lru_cache(maxsize=4096)  # figure names are validated and bounded before they get here (FleetView)
def describe(member_kind: str, figure: str) -> Described:
    """The family one figure of a member of `member_kind` belongs to ("server", "client",
    "server_client": a server's per-robot figure, or "monitor")."""
    base = f"{PREFIX}_{_FAMILY_PREFIX[member_kind]}"
    head, _, part = figure.partition(".")
    if part and (hist := _HIST_BY_KIND[member_kind].get(head)) is not None:  # one part of a histogram (families)
        name = f"{base}_{hist.name}"
        return Described(name, "histogram", hist.help, 1.0, (), True, valid_metric_name(name))
    for metric in _BY_KIND[member_kind]:
        if m := metric.pattern.fullmatch(figure):
            labels = metric.fixed + tuple((k, v) for k, v in m.groupdict().items())
            name = f"{base}_{metric.name}"
            valid = valid_metric_name(name) and all(len(v) <= MAX_LABEL_VALUE_CHARS for _, v in labels)
            return Described(name, metric.kind, metric.help, metric.scale, labels, True, valid)
    name = f"{base}_{_sanitize(figure)}"
    return Described(name, "untyped", f"Undeclared telemetry figure {_sanitize(figure)} (not in docs/telemetry.md)",
                     1.0, (), False, valid_metric_name(name))


def families(samples, max_bytes: int | None = None) -> tuple[list[Family], int]:
    """Group `(member kind, figure, labels, value)` samples into metric families, sorted by name.

    A name or label name that fails Prometheus' grammar or MAX_NAME_CHARS, or a label value over
    MAX_LABEL_VALUE_CHARS, leaves its sample out. `max_bytes`: samples are taken in the order given
    (FleetView.samples: most trusted first) while their exposition lines fit in about that many bytes;
    the rest are left out, unread. Returns (families, samples taken).
    """
    out: dict[str, Family] = {}
    series: dict[tuple[str, int], _HistogramSeries] = {}
    taken = 0
    size = 0
    for member_kind, figure, labels, value in samples:
        if max_bytes is not None and size >= max_bytes:
            break  # over budget: the rest is not even read
        head, _, part = figure.partition(".")
        spec = _HIST_BY_KIND[member_kind].get(head) if part else None
        if spec is not None:
            name = f"{PREFIX}_{_FAMILY_PREFIX[member_kind]}_{spec.name}"
            one = series.get((name, id(labels)))
            if one is None:
                if not all(valid_label_name(k) and len(v) <= MAX_LABEL_VALUE_CHARS for k, v in labels.items()):
                    continue
                if max_bytes is not None:  # its bucket lines, _sum and _count, as render() writes them
                    cost = (len(spec.bounds_s) + 3) * (len(name) + 48 + sum(len(k) + len(v) + 4 for k, v in labels.items()))
                    if size + cost > max_bytes:
                        break
                    size += cost
                one = series[(name, id(labels))] = _HistogramSeries(spec, labels)
            one.add(part, float(value))
            taken += 1
            continue
        d = describe(member_kind, figure)
        all_labels = {**labels, **dict(d.labels)} if d.labels else labels
        if not d.valid or not all(valid_label_name(k) and len(v) <= MAX_LABEL_VALUE_CHARS for k, v in labels.items()):
            continue
        family = out.get(d.name)
        if max_bytes is not None:  # the sample's line as render() writes it (a value of up to 24 characters)
            cost = len(d.name) + 32 + sum(len(k) + len(v) + 4 for k, v in all_labels.items())
            if family is None:
                cost += 2 * len(d.name) + len(d.help) + 40  # its HELP and TYPE lines
            if size + cost > max_bytes:
                break
            size += cost
        if family is None:
            family = out[d.name] = Family(d.name, d.kind, d.help, [])
        elif family.kind != d.kind:  # two figures would share a name with different types: keep the first
            continue
        family.samples.append((all_labels, float(value) * d.scale))
        taken += 1
    for (name, _), one in series.items():
        if not one.valid:
            continue
        family = out.get(name)
        if family is None:
            family = out[name] = Family(name, "histogram", one.spec.help + " (seconds)", [])
        elif family.kind != "histogram":
            continue
        family.histograms.append((one.labels, one.buckets(), one.sum_s))
    return [out[k] for k in sorted(out)], taken


def _value(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _bound(b: float) -> str:
    """A bucket's `le`: the same text for the same bound on every member (series add up by `le`)."""
    return "+Inf" if b == float("inf") else repr(float(b))


def _escape(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def render(fams: list[Family], max_bytes: int | None = None) -> tuple[str, int]:
    """The text exposition (format 0.0.4) of `fams`, at most `max_bytes` long (UTF-8): samples that do
    not fit are left out, families in the order given. Returns (text, samples left out)."""
    parts: list[str] = []
    size = 0
    left_out = 0
    label_texts: dict[int, str] = {}  # a member's labels are one dict shared by its samples: written once
    for fam in fams:
        name = fam.name + "_total" if fam.kind == "counter" else fam.name
        help_text = fam.help.replace("\\", r"\\").replace("\n", r"\n")
        head = f"# HELP {name} {help_text}\n# TYPE {name} {fam.kind}\n"
        lines = []
        for labels, buckets, sum_s in fam.histograms:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            sep = "," if label_text else ""
            block = [f'{name}_bucket{{{label_text}{sep}le="{_bound(b)}"}} {_value(n)}\n' for b, n in buckets]
            block.append(f"{name}_sum{{{label_text}}} {_value(sum_s)}\n" if label_text else f"{name}_sum {_value(sum_s)}\n")
            count = buckets[-1][1]
            block.append(f"{name}_count{{{label_text}}} {_value(count)}\n" if label_text else f"{name}_count {_value(count)}\n")
            cost = sum(len(line.encode()) for line in block) + (0 if lines else len(head))
            if max_bytes is not None and size + cost > max_bytes:
                left_out += 1
                continue
            size += cost
            lines.extend(block)
        for labels, value in fam.samples:
            label_text = label_texts.get(id(labels))
            if label_text is None:
                label_text = label_texts[id(labels)] = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
            line = f"{name}{{{label_text}}} {_value(value)}\n" if label_text else f"{name} {_value(value)}\n"
            cost = len(line.encode()) + (0 if lines else len(head))
            if max_bytes is not None and size + cost > max_bytes:
                left_out += 1
                continue
            size += cost
            lines.append(line)
        if lines:
            parts.append(head)
            parts.extend(lines)
    return "".join(parts), left_out


def reference_rows() -> list[str]:
    """docs/telemetry.md's metric reference: one Markdown row per declared figure."""
    rows = ["| figure | Prometheus family | type | unit | labels |", "|---|---|---|---|---|"]
    for member_kind in (SERVER, SERVER_CLIENT, CLIENT, MONITOR):
        for metric in _BY_KIND[member_kind]:
            name = f"{PREFIX}_{_FAMILY_PREFIX[member_kind]}_{metric.name}" + ("_total" if metric.kind == "counter" else "")
            labels = ", ".join(f"`{k}`" for k in metric.labels) or "—"
            figure = metric.figure if member_kind != SERVER_CLIENT else f"per_client[<client>].{metric.figure}"
            rows.append(f"| `{figure}` | `{name}` | {metric.kind} | {metric.unit} | {labels} |")
        for hist in HISTOGRAMS:
            if member_kind in hist.kinds:
                name = f"{PREFIX}_{_FAMILY_PREFIX[member_kind]}_{hist.name}"
                figure = f"{hist.figure}{SUFFIX}.*"
                figure = figure if member_kind != SERVER_CLIENT else f"per_client[<client>].{figure}"
                rows.append(f"| `{figure}` | `{name}` (`_bucket`, `_sum`, `_count`) | histogram | seconds | `le` |")
    return rows
