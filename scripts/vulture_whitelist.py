"""Names `vulture` (the dead-code check of `make lint`) cannot see used; read by vulture, never run.

Each entry is used from outside our code: an interface another library calls, an attribute another
library reads, a name called by string. An entry marked "unread" is dead code in a file that was
being reshaped elsewhere when the check came in; remove the entry with the code. The decorators and
names vulture skips everywhere (pydantic validators, ``model_config``, ``__exit__``'s arguments,
pytest's ``pytestmark`` and fixtures) are in pyproject.toml, ``[tool.vulture]``.
"""
# ruff: noqa: F821

# LeRobot's Robot interface (client/sim_robot.py): LeRobot calls and reads these.
_.calibrate
_.calibration
_.calibration_fpath
# http.server's handler interface and server attribute (cli/monitor.py's /metrics).
_.do_GET
_.log_message
_.daemon_threads
_.request_queue_size
# Attributes set on another library's objects, which that library reads.
_.pre_tokenizer  # tokenizers.Tokenizer
_.tokenizer_name  # LeRobot's tokenizer processor steps
_.paligemma_tokenizer_name
_.trust_remote_code
_.projection_dim  # transformers' SigLIP config
_.load_vlm_weights  # LeRobot's SmolVLA config
_._attn_implementation  # transformers' model configs
_.HF_DATASETS_DISABLE_PROGRESS_BARS  # datasets.config
_.max_time_in_seconds  # OR-Tools CP-SAT parameters
_.num_workers
_.relative_gap_limit
_.bpe_tokenizer  # read by LeRobot's decode_actions_with_fast
_.get_seq_length  # transformers' Cache interface
_.must_go  # LeRobot's TimedObservation
# Benchmark workers create classes and call methods by name over their pipe (benchmarks/harness/worker.py).
_.LeRobotServer
_.LeRobotClient
_.FloorServer
_.FloorClient
_.IngestPublisher
_.take_policy_ms
_.jpeg_costs
_._ingest  # holds the subscriber declared with a callback
# pydantic reads these (lerobot_zenoh/config.py): the base-init marker and a wrap serializer.
_.__pydantic_base_init__
_._flat
# Keys of TypedDicts that schedulers' stats() return (scheduling/wait_ratio.py): read as data.
_.skipped_max
# Fields of pydantic schemas and result records that are read as data (YAML in, JSON out).
_.p95_ms  # pipelines/profiles.py: a profile's latency percentiles
_.finished_s  # server/runners/decode_batch.py: DecodeResult
_.exec_start_s  # benchmarks/studies/fleet.py: the simulator's per-request record
_.slo_pct
_.wait_mean_ms
_.latency_p95_s
_.age_p50_ms

# Unread, kept on purpose (remove with the code):
_.no_stamp  # client/config.py: read by LeRobot's own DatasetRecordConfig.stamp_repo_id
# Called by name: a family's manifest block goes to the method its runner declares
# (`RunnerCapabilities.settings_blocks`, server/config/runner_loading.py `load_runner`).
_.configure_decode
