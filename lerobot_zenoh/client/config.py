"""The robot client's configuration: its own options (client/options.py), the robot and the dataset.

A draccus dataclass, so the CLI follows LeRobot's conventions::

    lerobot-robot-client --robot.type=zenoh_sim --client_uuid=robot_1 \
        --cluster_uuid=local --experiment_tag=demo --model_id=act --model_version=v1 \
        --application_tag=pick --endpoint=tcp/127.0.0.1:7447 --aggregate.type=weighted_average

Importing this module imports LeRobot (its robot and recording configurations, and torch with
them); the console script checks the options of client/options.py first, without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lerobot.configs.dataset import DatasetRecordConfig
from lerobot.robots import RobotConfig

from lerobot_zenoh.client.options import (  # noqa: F401  (re-exported: importers name them from here)
    FAILSAFE_MODES,
    ClientOptions,
    PipelineConfig,
    RtcConfig,
    check_task_bytes,
    default_dataset_root,
    routing_args,
)
from lerobot_zenoh.errors import ConfigError

#: The dataset feature that marks frames where the client held the robot because it had no action
#: from the policy (its fail-safe action was sent and recorded): bool, shape (1,).
FAILSAFE_FEATURE = "failsafe"


@dataclass
class ClientDatasetConfig(DatasetRecordConfig):
    """LeRobot's own recording configuration (`lerobot-record --dataset.*`), reused field for field.

    Only these defaults differ from lerobot-record, each for a reason:
    """

    # Upload to the Hugging Face hub at the end. Off: the client records locally (upload it with
    # `huggingface-cli upload` or LeRobotDataset.push_to_hub once you have checked it).
    push_to_hub: bool = False
    # Encode videos while recording rather than at each episode's end: the recorder's writer thread
    # keeps up without ever blocking the control loop, and saving an episode is then near-instant.
    streaming_encoding: bool = True
    # Use --dataset.repo_id as given, so that LeRobotDataset(repo_id) finds it. lerobot-record appends
    # a date-time to it unless this is set; set it to false for that behaviour.
    no_stamp: bool = True


@dataclass(kw_only=True)
class RobotClientConfig(ClientOptions):
    # The robot, any type LeRobot knows (plugins included): --robot.type=so101_follower --robot.port=...
    robot: RobotConfig
    # Record a LeRobotDataset, as lerobot-record does: --dataset.repo_id=<user>/<name> turns it on;
    # --dataset.root (default $HF_LEROBOT_HOME/<repo_id>), --dataset.num_episodes,
    # --dataset.episode_time_s, --dataset.reset_time_s (the robot is held, nothing is recorded),
    # --dataset.video, --dataset.single_task. The dataset records at --fps.
    dataset: ClientDatasetConfig | None = None

    def validate(self) -> None:
        super().validate()
        if self.resume and self.dataset is None:
            raise ConfigError("resume", "needs --dataset.repo_id (and --dataset.root if not the default)")
        if self.dataset is not None:
            self._validate_dataset(self.dataset)
        check_task_bytes("dataset.single_task" if not self.task else "task", self.task_text)

    def _validate_dataset(self, ds: ClientDatasetConfig) -> None:
        if not ds.repo_id or "/" not in ds.repo_id:
            raise ConfigError("dataset.repo_id", f"expected <user>/<name>, e.g. local/pick_cube, got {ds.repo_id!r}")
        if ds.fps != self.fps:
            if ds.fps != ClientDatasetConfig.fps:  # set on purpose to another rate
                raise ConfigError("dataset.fps", f"the dataset records at the control rate: set --fps={ds.fps} "
                                                 f"instead (now --fps={self.fps})")
            ds.fps = self.fps
        if ds.num_episodes < 1:
            raise ConfigError("dataset.num_episodes", f"must be >= 1, got {ds.num_episodes}")
        if ds.episode_time_s <= 0:
            raise ConfigError("dataset.episode_time_s", f"must be positive, got {ds.episode_time_s}")
        if ds.reset_time_s < 0:
            raise ConfigError("dataset.reset_time_s", f"must be >= 0, got {ds.reset_time_s}")
        if ds.push_to_hub:
            raise ConfigError("dataset.push_to_hub", "this client records locally; upload the finished dataset "
                                                      "with LeRobotDataset(...).push_to_hub()")
        if self.task and ds.single_task and self.task != ds.single_task:
            raise ConfigError("task", f"differs from --dataset.single_task ({ds.single_task!r}); give one of them")

    @property
    def task_text(self) -> str:
        """The task sent with observations and stored with frames."""
        return self.task or (self.dataset.single_task if self.dataset is not None else "")

    @property
    def dataset_root(self) -> Path | None:
        """Where the dataset lives: --dataset.root, or $HF_LEROBOT_HOME/<repo_id> as lerobot-record."""
        if self.dataset is None:
            return None
        if self.dataset.root:
            return Path(self.dataset.root).expanduser()
        return default_dataset_root(self.dataset.repo_id)
