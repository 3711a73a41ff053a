"""The robot client's own options: everything but `--robot.*` and `--dataset.*`.

They import neither LeRobot nor torch, so that `lerobot-robot-client` reads and checks them (and
answers `--help`) in well under a second, before LeRobot is imported (cli/client.py).
`client.config.RobotClientConfig` adds the robot and the dataset to them: the configuration the
client runs with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lerobot_zenoh.errors import ConfigError, KeyExprError
from lerobot_zenoh.protocol.keys import APP_FIELDS, AppKey, ClientKey, validate_chunk, validate_client_id
from lerobot_zenoh.scheduling.action_buffer import AggregateConfig, WeightedAverageConfig
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig
from lerobot_zenoh.transport.settings import ZenohSettings

FAILSAFE_MODES = ("auto", "hold", "zero_velocity")
#: The simulated robot's cameras when --robot.cameras is not given (`SimRobotConfig`): name -> (H, W).
SIM_CAMERAS = {"front": (96, 128), "wrist": (96, 128)}


def check_task_bytes(flag: str, task: str) -> None:
    """ConfigError naming `flag` when `task` is over `MAX_TASK_BYTES` of UTF-8: every server refuses
    each observation that carries it (task_too_long), so it is refused here, before anything is sent."""
    from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES

    n = len(task.encode())
    if n > MAX_TASK_BYTES:
        raise ConfigError(flag, f"is {n} bytes of UTF-8; a server reads at most {MAX_TASK_BYTES} (task_too_long)")


@dataclass
class RtcConfig:
    """Real-time chunking on the client (docs/client.md, "Real-time chunking")."""

    enabled: bool = field(
        default=True,
        metadata={"help": "Use real-time chunking when the server's status advertises it (false: always blend)."},
    )
    initial_delay_steps: int = field(
        default=3, metadata={"help": "Inference delay (control steps) predicted before the first RTT is measured."}
    )
    delay_quantile: float | None = field(
        default=None,
        metadata={"help": "RTT quantile the delay is predicted from, ceil(q / dt). None: --send.rtt_quantile."},
    )
    mispredict_steps: int = field(
        default=2, metadata={"help": "A chunk whose delay differs from the prediction by this many steps is a wrong estimate."}
    )

    def validate(self, prefix: str = "rtc") -> None:
        if isinstance(self.initial_delay_steps, bool) or not isinstance(self.initial_delay_steps, int) \
                or self.initial_delay_steps < 0:
            raise ConfigError(f"{prefix}.initial_delay_steps", f"must be an integer >= 0, got {self.initial_delay_steps!r}")
        q = self.delay_quantile
        if q is not None and not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
            raise ConfigError(f"{prefix}.delay_quantile", f"must be within [0, 1] or None, got {q!r}")
        if isinstance(self.mispredict_steps, bool) or not isinstance(self.mispredict_steps, int) \
                or self.mispredict_steps < 1:
            raise ConfigError(f"{prefix}.mispredict_steps", f"must be an integer >= 1, got {self.mispredict_steps!r}")


@dataclass
class PipelineConfig:
    """Run a multi-model task (docs/pipelines.md, "Running a task over Zenoh")."""

    plan: str | None = field(
        default=None,
        metadata={"help": "plan.json written by lerobot-zenoh-plan: this robot (--client_uuid) runs its planned task, "
                          "routes and rates (the routing flags, --fps and --actions_per_chunk come from the plan)."},
    )
    reset_s: float = field(
        default=1.0,
        metadata={"help": "Without --dataset: how long the robot stays in its reset mode before retrying a failed task."},
    )

    def validate(self, prefix: str = "pipeline") -> None:
        if not (isinstance(self.reset_s, (int, float)) and 0 <= self.reset_s <= 3600):
            raise ConfigError(f"{prefix}.reset_s", f"must be within [0, 3600] s, got {self.reset_s!r}")


# Every option of the robot client but the robot and the dataset (no docstring: --help would print it).
@dataclass
class ClientOptions:
    # This robot's id, unique in the fleet; the server's manifest must list it (or accept unknown clients).
    client_uuid: str = "robot_0"
    # The next five name the server's application (its manifest's cluster_uuid, experiment_tag,
    # model_id, model_version, application_tag). Any left unset is taken from what the endpoint serves
    # when exactly one application there fits the others (`--list` shows them; docs/client.md,
    # "Finding the server"). The cluster the server belongs to.
    cluster_uuid: str | None = None
    # The experiment the server belongs to (manifest: experiment_tag).
    experiment_tag: str | None = None
    # The model the server serves (manifest: model_id; a single-model server: its checkpoint's name).
    model_id: str | None = None
    # The model version (manifest: model_version).
    model_version: str | None = None
    # The application (manifest: application_tag).
    application_tag: str | None = None
    # Where the server (or a Zenoh router) listens: tcp/192.168.1.50:7447, or host:port (tcp); added
    # to zenoh.connect. Empty: rely on scouting or on zenoh.connect.
    endpoint: str | None = None
    # LeRobot's async-inference name for the same thing: --server_address=192.168.1.50:7447.
    server_address: str | None = None
    # The Zenoh session (transport/settings.py, the same block as a manifest's `zenoh:`). With an
    # endpoint and the defaults: client mode, no listener, no scouting.
    zenoh: ZenohSettings = field(default_factory=ZenohSettings)
    # Control rate in steps per second; must equal the server's fps.
    fps: int = 30
    # How many leading actions of each chunk the robot uses (the server may send fewer).
    actions_per_chunk: int = 50
    # How overlapping actions of two chunks are blended: weighted_average, latest_only, average,
    # conservative, weighted (with --aggregate.new_weight), or your own (--plugins).
    aggregate: AggregateConfig = field(default_factory=WeightedAverageConfig)
    # JPEG quality (1-100) of the camera images sent to the server.
    jpeg_quality: int = 90
    # Send raw frames through /dev/shm instead of JPEG when the server runs on this machine as the
    # same user and offers it (its status has `same_host`); falls back to JPEG with one warning if
    # shared memory stops working (docs/protocol.md, "The same-host path").
    same_host: bool = True
    # When to send the next observation (docs/client.md, "Timing").
    send: SendTriggerConfig = field(default_factory=SendTriggerConfig)
    # Real-time chunking: on when the server advertises it, unless --rtc.enabled=false.
    rtc: RtcConfig = field(default_factory=RtcConfig)
    # A multi-model task: --pipeline.plan=<plan.json> (docs/pipelines.md).
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # What the robot does when it has no action: hold (command its measured position),
    # zero_velocity (command zeros), or auto (zero_velocity if every action is a *.vel, else hold).
    failsafe: str = "auto"
    # Warn after this many control steps in a row without an action (then every 10 s).
    max_empty_cycles_before_warning: int = 10
    # Seconds without an action chunk (while waiting for one) before the client looks for a server again.
    watchdog_timeout_s: float = 1.0
    # Draw a new session nonce after this many requests in a row got no chunk (timed out, or dropped by
    # the watchdog): a robot shut out of its server session recovers by itself (docs/client.md,
    # "Failures"). 0: never.
    new_nonce_after_unanswered: int = 5
    # Seconds to keep asking for a server at start-up before giving up (exit code 3).
    discovery_timeout_s: float = 15.0
    # Stop after this many seconds. Unset: run until Ctrl-C (or, when recording, until the last episode).
    duration_s: float | None = None
    # Natural-language task sent with every observation (VLAs read it) and stored in the dataset.
    # Unset: --dataset.single_task.
    task: str = ""
    # Append episodes to the existing dataset at --dataset.root instead of creating a new one.
    resume: bool = False
    # Publish this client's figures on .../<client>/metrics every this many seconds; 0 turns it off.
    telemetry_period_s: float = 1.0
    # Write a JSON summary of the run (steps, round trips, chunks, ...) to this file at exit.
    summary_path: str | None = None
    # Logging level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from lerobot_zenoh.command_line import check_log_level

        try:
            validate_client_id("client_uuid", self.client_uuid)
            for name in APP_FIELDS:
                if getattr(self, name) is not None:
                    validate_chunk(name, getattr(self, name))
        except KeyExprError as exc:
            raise ConfigError(exc.field, str(exc)) from None
        from lerobot_zenoh.client.discovery import as_endpoint

        if self.endpoint and self.server_address and as_endpoint(self.server_address) != as_endpoint(self.endpoint):
            raise ConfigError("server_address", f"differs from --endpoint ({self.endpoint}); give one of them")
        for name in ("endpoint", "server_address"):
            value = getattr(self, name)
            if value and "," in value:
                raise ConfigError(name, f"{value!r}: one endpoint here; give several routers with --zenoh.connect "
                                        "(once per endpoint, or as a list)")
            if value and as_endpoint(value) is None:
                raise ConfigError(name, f"{value!r} is neither a Zenoh endpoint (tcp/HOST:PORT) nor HOST:PORT")
        if not 1 <= self.fps <= 1000:
            raise ConfigError("fps", f"must be in 1..1000, got {self.fps}")
        if self.actions_per_chunk < 1:
            raise ConfigError("actions_per_chunk", f"must be >= 1, got {self.actions_per_chunk}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ConfigError("jpeg_quality", f"must be in 1..100, got {self.jpeg_quality}")
        if self.failsafe not in FAILSAFE_MODES:
            raise ConfigError("failsafe", f"{self.failsafe!r} is not one of {', '.join(FAILSAFE_MODES)}")
        for name in ("watchdog_timeout_s", "discovery_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.new_nonce_after_unanswered < 0:
            raise ConfigError("new_nonce_after_unanswered", f"must be >= 0 (0: never), got {self.new_nonce_after_unanswered}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError("duration_s", f"must be positive, got {self.duration_s}")
        check_task_bytes("task", self.task)
        check_log_level(self.log_level)
        self.rtc.validate("rtc")
        self.pipeline.validate("pipeline")
        self.zenoh.validate("zenoh")

    @property
    def routing_given(self) -> dict[str, str]:
        """The routing fields set (the others are found by asking the endpoint)."""
        return {n: getattr(self, n) for n in APP_FIELDS if getattr(self, n) is not None}

    @property
    def app_key(self) -> AppKey:
        missing = [n for n in APP_FIELDS if getattr(self, n) is None]
        if missing:
            raise ConfigError(missing[0], "not set, and not found yet from what the endpoint serves "
                                          "(discovery.resolve_app fills it in)")
        return AppKey(self.cluster_uuid, self.experiment_tag, self.model_id, self.model_version, self.application_tag)

    def use_app(self, app: AppKey) -> None:
        """Take the routing fields from `app` (found at the endpoint)."""
        self.cluster_uuid, self.experiment_tag, self.model_id = app.cluster, app.experiment, app.model
        self.model_version, self.application_tag = app.version, app.app

    @property
    def client_key(self) -> ClientKey:
        return ClientKey(self.app_key, self.client_uuid)

    @property
    def dt_s(self) -> float:
        return 1.0 / self.fps

    def zenoh_settings(self) -> ZenohSettings:
        """The session settings: `zenoh`, with `endpoint` added to its connect list (so, by default,
        a connect-only Zenoh client with scouting off: transport/settings.py)."""
        from lerobot_zenoh.client.discovery import as_endpoint

        return self.zenoh.with_connect(as_endpoint(self.endpoint or self.server_address or "") or None)



def routing_args(app: AppKey, client_uuid: str, endpoint: str | None = None, *, scouting: bool = False) -> list[str]:
    """The `lerobot-robot-client` flags that route one client to an app (for scripts that start
    clients: the demo, the soak, tests)."""
    args = [f"--client_uuid={client_uuid}", f"--cluster_uuid={app.cluster}", f"--experiment_tag={app.experiment}",
            f"--model_id={app.model}", f"--model_version={app.version}", f"--application_tag={app.app}",
            f"--zenoh.multicast_scouting={str(scouting).lower()}"]
    return args + ([f"--endpoint={endpoint}"] if endpoint else [])


def default_dataset_root(repo_id: str) -> Path:
    """Where lerobot-record puts a dataset without --dataset.root: $HF_LEROBOT_HOME/<repo_id>, where
    HF_LEROBOT_HOME defaults to $HF_HOME/lerobot (as LeRobot's lerobot.utils.constants, whose import
    brings in torch, says)."""
    import os

    from huggingface_hub.constants import HF_HOME

    return Path(os.getenv("HF_LEROBOT_HOME", Path(HF_HOME) / "lerobot")).expanduser() / repo_id


def check_dataset_root(root: Path, resume: bool) -> None:
    """Raise ConfigError (one line, naming the flag) unless a dataset can be written at `root`: free
    for a new dataset, holding one to resume, and its folder writable by this process. Probes by
    creating and removing a temporary folder, so it holds for root and read-only mounts alike."""
    import os
    import tempfile

    root = Path(root)
    where = "--dataset.root (the default is $HF_LEROBOT_HOME/<repo_id>)"
    if resume and not (root / "meta" / "info.json").is_file():
        raise ConfigError("resume", f"no dataset at {root} to resume; drop --resume to create one")
    if not resume and root.exists():
        raise ConfigError("dataset.root", f"{root} already exists; add --resume=true to append episodes "
                                          "to it, or choose another --dataset.root")
    probe_in = root if resume else next((p for p in root.parents if p.exists()), Path("/"))
    if not probe_in.is_dir():
        raise ConfigError("dataset.root", f"cannot create {root}: {probe_in} is not a folder; choose another {where}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lerobot-zenoh-probe-", dir=probe_in))
    except OSError as exc:
        raise ConfigError("dataset.root", f"cannot write under {probe_in}: {exc.strerror or exc}; choose another "
                                          f"{where}") from None
