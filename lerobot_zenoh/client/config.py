"""The robot client's configuration (seed 002 section 12.2, plus what the behaviour needs).

A draccus dataclass, so the CLI follows LeRobot's conventions::

    lerobot-robot-client --robot.type=zenoh_sim --client_uuid=robot_1 \
        --cluster_uuid=local --experiment_tag=demo --model_id=act --model_version=v1 \
        --application_tag=pick --endpoint=tcp/127.0.0.1:7447 --aggregate.type=weighted_average
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lerobot.robots import RobotConfig

from lerobot_zenoh.errors import ConfigError, KeyExprError
from lerobot_zenoh.protocol.keys import AppKey, ClientKey
from lerobot_zenoh.scheduling.action_buffer import AggregateConfig, WeightedAverageConfig
from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig
from lerobot_zenoh.transport.settings import ZenohSettings

FAILSAFE_MODES = ("auto", "hold", "zero_velocity")


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
class RobotClientConfig:
    # The robot, any type LeRobot knows (plugins included): --robot.type=so101_follower ...
    robot: RobotConfig
    # Routing: cluster/experiment/model/version/app/client (seed 002 section 6.1).
    client_uuid: str = "robot_0"
    cluster_uuid: str = "local"
    experiment_tag: str = "default"
    model_id: str = "act"
    model_version: str = "v1"
    application_tag: str = "default"
    # Where the server (or a Zenoh router) listens, e.g. tcp/192.168.1.50:7447 (added to
    # zenoh.connect). Empty: rely on scouting or on zenoh.connect.
    endpoint: str | None = None
    # The Zenoh session (transport/settings.py, the same block as a manifest's `zenoh:`). With an
    # endpoint and the defaults: client mode, no listener, no scouting.
    zenoh: ZenohSettings = field(default_factory=ZenohSettings)
    # Control.
    fps: int = 30
    actions_per_chunk: int = 50  # leading actions of each chunk used (the server may send fewer)
    aggregate: AggregateConfig = field(default_factory=WeightedAverageConfig)
    jpeg_quality: int = 90
    send: SendTriggerConfig = field(default_factory=SendTriggerConfig)
    # Real-time chunking: on when the server advertises it, unless --rtc.enabled=false.
    rtc: RtcConfig = field(default_factory=RtcConfig)
    # Fail-safe: what an empty buffer sends. hold: the measured position; zero_velocity: zeros;
    # auto: zero_velocity when every action is a velocity (`*.vel`), else hold.
    failsafe: str = "auto"
    max_empty_cycles_before_warning: int = 10
    # No chunk for this long while requests are out (or the server's token vanished): re-validate.
    watchdog_timeout_s: float = 1.0
    # How long to retry the status query before giving up at start-up.
    discovery_timeout_s: float = 15.0
    # Episodes: None runs until SIGINT.
    episode_time_s: float | None = None
    num_episodes: int = 1
    # Dataset recording (G7): None disables it. The root defaults to outputs/datasets/<repo_id>
    # and must not exist yet. Images as PNG by default: AV1 videos cost less CPU per frame but their
    # encoders stall a 2-core machine for ~100 ms at each episode boundary (docs/client.md).
    dataset_repo_id: str | None = None
    dataset_root: str | None = None
    dataset_use_videos: bool = False
    task: str = ""
    # Telemetry on .../<client>/metrics every this many seconds; 0 turns it off.
    telemetry_period_s: float = 1.0
    # Write a JSON summary of the run here at exit.
    summary_path: str | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        try:
            self.client_key  # validates every chunk, naming it
        except KeyExprError as exc:
            raise ConfigError(exc.field, str(exc)) from None
        if not 1 <= self.fps <= 1000:
            raise ConfigError("fps", f"must be in 1..1000, got {self.fps}")
        if self.actions_per_chunk < 1:
            raise ConfigError("actions_per_chunk", f"must be >= 1, got {self.actions_per_chunk}")
        if not 1 <= self.jpeg_quality <= 100:
            raise ConfigError("jpeg_quality", f"must be in 1..100, got {self.jpeg_quality}")
        if self.failsafe not in FAILSAFE_MODES:
            raise ConfigError("failsafe", f"{self.failsafe!r} is not one of {', '.join(FAILSAFE_MODES)}")
        if self.watchdog_timeout_s <= 0 or self.discovery_timeout_s <= 0:
            raise ConfigError("watchdog_timeout_s", "timeouts must be positive")
        if self.episode_time_s is not None and self.episode_time_s <= 0:
            raise ConfigError("episode_time_s", f"must be positive, got {self.episode_time_s}")
        if self.num_episodes < 1:
            raise ConfigError("num_episodes", f"must be >= 1, got {self.num_episodes}")
        self.rtc.validate("rtc")
        self.zenoh.validate("zenoh")

    @property
    def app_key(self) -> AppKey:
        return AppKey(self.cluster_uuid, self.experiment_tag, self.model_id, self.model_version, self.application_tag)

    @property
    def client_key(self) -> ClientKey:
        return ClientKey(self.app_key, self.client_uuid)

    @property
    def dt_s(self) -> float:
        return 1.0 / self.fps

    def zenoh_settings(self) -> ZenohSettings:
        """The session settings: `zenoh`, with `endpoint` added to its connect list (so, by default,
        a connect-only Zenoh client with scouting off: transport/settings.py)."""
        return self.zenoh.with_connect(self.endpoint)


def routing_args(app: AppKey, client_uuid: str, endpoint: str | None = None, *, scouting: bool = False) -> list[str]:
    """The `lerobot-robot-client` flags that route one client to an app (for scripts that start
    clients: the demo, the soak, tests)."""
    args = [f"--client_uuid={client_uuid}", f"--cluster_uuid={app.cluster}", f"--experiment_tag={app.experiment}",
            f"--model_id={app.model}", f"--model_version={app.version}", f"--application_tag={app.app}",
            f"--zenoh.multicast_scouting={str(scouting).lower()}"]
    return args + ([f"--endpoint={endpoint}"] if endpoint else [])
