"""Recording what the robot saw and did into a local LeRobotDataset.

The control loop must never wait for the disk or a video encoder, so :meth:`DatasetRecorder.record`
only hands ``(observation, action)`` to a queue and returns; a writer thread builds the frame
(``build_dataset_frame``, the same helper ``lerobot-record`` uses, so the dataset matches one
recorded by LeRobot), calls ``add_frame``, and saves episodes when asked. If the writer falls
more than ``max_queued_frames`` behind, whole frames are dropped (and counted) rather than
blocking the loop or growing memory without bound. A dropped frame is missing from the table
and the images/videos alike; LeRobot timestamps frames as ``frame_index / fps``, so the episode's
time axis just gets shorter (check ``dropped`` before trusting timing). With streaming video,
LeRobot's encoder can still drop a frame from the video alone if it falls ``2 * fps`` frames
behind for 0.1 s; it logs a warning when it does.

Videos or images. Cameras are stored as AV1 videos by default, as ``lerobot-record`` does
(``use_videos=True``), encoded while recording (``streaming_encoding=True``): about 1.4 ms of writer
time per frame of two 96x128 cameras on a 2-core CPU, and files far smaller than PNG (a PNG dataset
also loaded 18x slower for training). On that 2-core CPU the AV1 encoders flush and restart at each
episode boundary and take both cores for ~100 ms (5-9 overrun periods of up to ~140 ms right after
the boundary, measured with a 30 Hz loop); the client's reset phase between episodes, in which the
robot is held and nothing is recorded, absorbs them. PNG images (``use_videos=False``) never
disturbed the loop at 96x128 but cost ~270 ms per frame at 2x480x640 (the writer falls behind and
frames are dropped once ``max_queued_frames`` is reached; the loop is not disturbed).

Frames where the client held the robot because it had no action from the policy (the fail-safe
action) are recorded with the boolean feature ``failsafe`` set (shape (1,)); filter them out
before training if you want only policy-driven frames (docs/client.md, "Recording").

Episodes are saved and encoded in the writer thread (``parallel_encoding=False``): LeRobot's parallel path forks
worker processes, which is unsafe in a process that runs Zenoh's threads.

Lifecycle: the constructor does no I/O; :meth:`start` creates the dataset (``root`` must not
exist yet) or, with ``resume=True``, opens the existing one to append episodes, and starts the thread; :meth:`end_episode` closes an episode; :meth:`close` saves the episode
in progress if it has frames, finalizes the dataset (required before it can be read) and joins.
A closed recorder cannot be restarted.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lerobot.robots import Robot
from lerobot.utils.constants import ACTION, OBS_STR
from lerobot.utils.feature_utils import build_dataset_frame, hw_to_dataset_features

from lerobot_zenoh.client.options import check_dataset_root
from lerobot_zenoh.errors import ConfigError

__all__ = ["FAILSAFE_FEATURE", "DatasetRecorder", "RecorderStats"]

#: Boolean feature (shape (1,)): True where the robot was held because no policy action was available.
FAILSAFE_FEATURE = "failsafe"

logger = logging.getLogger(__name__)

_END_EPISODE = object()
_CLOSE = object()


@dataclass(frozen=True)
class RecorderStats:
    frames_written: int  # frames added to the dataset
    episodes_saved: int
    dropped: int  # frames not recorded: queue full, or record() outside start()..close()
    write_errors: int  # frames or episodes the dataset refused (logged)
    queued: int  # frames waiting for the writer


class DatasetRecorder:
    """Records raw observations and executed actions of `robot` without blocking the caller.

    Args:
        repo_id: dataset id, e.g. ``"local/so101_cookie"``.
        root: folder of the dataset; must not exist yet.
        fps: control rate; frame timestamps are ``frame_index / fps``.
        robot: provides ``observation_features``, ``action_features`` and ``name`` (nothing else
            is called on it).
        task: the task string stored with every frame (can be changed between episodes).
        use_videos: cameras as AV1 videos (default, as lerobot-record), or as PNG images.
        streaming_encoding: with videos, encode while recording (default) rather than at episode end.
        resume: append episodes to the dataset at ``root`` (it must exist and have the same features).
        rgb_encoder: LeRobot's video encoder settings (codec, quality, ...); ``None``: LeRobot's defaults.
        max_queued_frames: frames the writer may fall behind before frames are dropped
            (default ``10 * fps``: ten seconds).
        encoder_threads: threads per video encoder (``None``: the codec decides).
        join_timeout_s: how long :meth:`close` waits for the writer to save and finalize.
    """

    def __init__(
        self,
        repo_id: str,
        root: str | Path,
        fps: int,
        robot: Robot,
        task: str,
        *,
        use_videos: bool = True,
        streaming_encoding: bool = True,
        resume: bool = False,
        rgb_encoder=None,
        max_queued_frames: int | None = None,
        encoder_threads: int | None = None,
        join_timeout_s: float = 120.0,
        quiet: bool = True,
    ) -> None:
        if fps <= 0:
            raise ConfigError("fps", f"must be positive, got {fps}")
        if max_queued_frames is not None and max_queued_frames < 1:
            raise ConfigError("dataset.max_queued_frames", f"must be at least 1, got {max_queued_frames}")
        self.repo_id = repo_id
        self.root = Path(root)
        self.fps = fps
        self.task = task
        self.use_videos = use_videos
        self.streaming_encoding = streaming_encoding
        self.resume = resume
        self.rgb_encoder = rgb_encoder
        self.max_queued_frames = max_queued_frames if max_queued_frames is not None else 10 * fps
        self.encoder_threads = encoder_threads
        self.join_timeout_s = join_timeout_s
        self.quiet = quiet
        self._robot_type = robot.name
        self.features: dict[str, dict] = {
            **hw_to_dataset_features(robot.observation_features, OBS_STR, use_video=use_videos),
            **hw_to_dataset_features(robot.action_features, ACTION, use_video=use_videos),
            FAILSAFE_FEATURE: {"dtype": "bool", "shape": (1,), "names": None},
        }
        self._queue: queue.Queue[Any] = queue.Queue()  # unbounded: frames are bounded in record()
        self._queued_frames = 0  # frames in the queue (markers excluded)
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._closed = False
        self.dataset = None  # LeRobotDataset once started
        self._frames_written = 0
        self._episodes_saved = 0
        self._dropped = 0
        self._write_errors = 0

    @classmethod
    def from_config(cls, dataset, root: str | Path, robot: Robot, task: str, *, resume: bool = False,
                    quiet: bool = True) -> DatasetRecorder:
        """From LeRobot's recording configuration (`DatasetRecordConfig`, the client's `--dataset.*`)."""
        return cls(dataset.repo_id, root, dataset.fps, robot, task, use_videos=dataset.video,
                   streaming_encoding=dataset.streaming_encoding, resume=resume, rgb_encoder=dataset.rgb_encoder,
                   encoder_threads=dataset.encoder_threads, quiet=quiet)

    # -- lifecycle

    def start(self) -> None:
        """Create the dataset on disk and start the writer thread."""
        if self._closed:
            raise RuntimeError("a closed DatasetRecorder cannot be restarted")
        if self._thread is not None:
            return
        from lerobot.datasets.lerobot_dataset import LeRobotDataset  # heavy: datasets, pyarrow, av

        common = dict(
            video_backend="pyav",  # torchcodec needs system FFmpeg libraries; PyAV bundles its own
            streaming_encoding=self.streaming_encoding,
            encoder_queue_maxsize=2 * self.fps,
            encoder_threads=self.encoder_threads,
            rgb_encoder=self.rgb_encoder,
        )
        self.check_root()
        if self.quiet:
            quiet_encoders()
        try:
            if self.resume:
                self.dataset = LeRobotDataset.resume(self.repo_id, root=self.root, **common)
                self._check_resumable(self.dataset)
            else:
                self.dataset = LeRobotDataset.create(
                    self.repo_id, self.fps, self.features, root=self.root, robot_type=self._robot_type,
                    use_videos=self.use_videos, **common)
        except OSError as exc:  # a disk that filled up or a folder made read-only since the check
            raise ConfigError("dataset.root", f"cannot write the dataset at {self.root}: "
                                              f"{exc.strerror or exc}") from exc
        self._thread = threading.Thread(target=self._run, name="dataset-recorder", daemon=True)
        self._accepting = True
        self._thread.start()

    def check_root(self) -> None:
        """Raise ConfigError unless `root` is free (a new dataset) or holds a dataset (resume), and writable."""
        check_dataset_root(self.root, self.resume)

    def _check_resumable(self, dataset) -> None:
        """The existing dataset must record the same features at the same rate as this robot."""
        problems = []
        if dataset.fps != self.fps:
            problems.append(f"it records at {dataset.fps} fps, the client runs at {self.fps}")
        theirs = {k: (v["dtype"], tuple(v["shape"])) for k, v in dataset.features.items() if k in self.features or
                  k.startswith(("observation", "action"))}
        ours = {k: (v["dtype"], tuple(v["shape"])) for k, v in self.features.items()}
        for key in sorted(set(theirs) | set(ours)):
            if theirs.get(key) != ours.get(key):
                problems.append(f"{key}: dataset {theirs.get(key)}, robot {ours.get(key)}")
        if problems:
            raise ConfigError("resume", f"{self.root} does not match this robot: " + "; ".join(problems[:3]))

    def close(self) -> None:
        """Save the episode in progress (if it has frames), finalize the dataset, join the writer."""
        if self._closed:
            return
        self._closed = True
        self._accepting = False
        if self._thread is None:
            return
        self._queue.put(_CLOSE)
        self._thread.join(self.join_timeout_s)
        if self._thread.is_alive():
            logger.error("dataset writer did not finish within %.0f s; %s may be incomplete", self.join_timeout_s, self.root)

    def __enter__(self) -> DatasetRecorder:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- control-loop side (never blocks)

    def record(self, observation: dict[str, Any], action: dict[str, Any], failsafe: bool = False) -> bool:
        """Queue one frame: the robot's raw observation and the action it executed.

        `failsafe`: the action was the client's fail-safe (no policy action was available); stored
        in the ``failsafe`` feature.

        Takes ownership of the arrays in `observation` (they must not be modified afterwards;
        the dicts themselves are copied). Returns ``False`` if the frame was dropped.
        """
        with self._count_lock:
            if not self._accepting or self._queued_frames >= self.max_queued_frames:
                self._dropped += 1
                dropped = self._dropped
            else:
                self._queued_frames += 1
                dropped = 0
        if dropped:
            if dropped == 1 or dropped % 100 == 0:
                logger.warning("dataset recorder dropped %d frame(s) (writer behind or not running)", dropped)
            return False
        self._queue.put((dict(observation), dict(action), self.task, failsafe))
        return True

    def end_episode(self) -> None:
        """Close the current episode; frames recorded afterwards start the next one."""
        if self._accepting:
            self._queue.put(_END_EPISODE)

    # -- counters

    @property
    def frames_written(self) -> int:
        return self._frames_written

    @property
    def episodes_saved(self) -> int:
        return self._episodes_saved

    @property
    def dropped(self) -> int:
        return self._dropped

    def stats(self) -> RecorderStats:
        with self._count_lock:
            return RecorderStats(
                frames_written=self._frames_written,
                episodes_saved=self._episodes_saved,
                dropped=self._dropped,
                write_errors=self._write_errors,
                queued=self._queued_frames,
            )

    # -- writer thread

    def _run(self) -> None:
        dataset = self.dataset
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                break
            if item is _END_EPISODE:
                self._save_episode()
                continue
            observation, action, task, failsafe = item
            with self._count_lock:
                self._queued_frames -= 1
            try:
                frame = {
                    **build_dataset_frame(dataset.features, observation, prefix=OBS_STR),
                    **build_dataset_frame(dataset.features, action, prefix=ACTION),
                    FAILSAFE_FEATURE: np.array([failsafe], dtype=bool),
                    "task": task,
                }
                dataset.add_frame(frame)
            except Exception:
                # One bad frame (a missing key, a wrong shape) must not end the recording.
                self._write_errors += 1
                logger.exception("dataset recorder could not add a frame; frame skipped")
                continue
            self._frames_written += 1
        self._save_episode()
        try:
            dataset.finalize()
        except Exception:
            self._write_errors += 1
            logger.exception("dataset recorder could not finalize %s", self.root)

    def _save_episode(self) -> None:
        dataset = self.dataset
        if not dataset.has_pending_frames():
            return
        try:
            dataset.save_episode(parallel_encoding=False)
        except Exception:
            self._write_errors += 1
            logger.exception("dataset recorder could not save an episode; it is discarded")
            try:
                dataset.clear_episode_buffer()
            except Exception:
                logger.exception("dataset recorder could not clear the failed episode")
            return
        self._episodes_saved += 1
        logger.info("saved episode %d (%d frames so far) in %s", dataset.num_episodes - 1, self._frames_written, self.root)


def quiet_encoders() -> None:
    """Silence what video encoding prints at each episode (docs/client.md, "Recording"): SVT-AV1's
    banner (~20 lines per camera and episode, written by the C library to stderr), FFmpeg's notes, the
    `datasets` progress bars and LeRobot's "Using video codec" line. Errors still show; the client's
    --log_level=DEBUG keeps everything. SVT_LOG set by the user is kept."""
    import os

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1: errors only (it reads this when an encoder opens)
    try:
        import av.logging

        # FFmpeg's own threshold: it holds through LeRobot's restore_default_callback() calls.
        av.logging.set_libav_level(av.logging.ERROR)
    except ImportError:
        pass
    try:
        import importlib
        import warnings

        datasets_tqdm = importlib.import_module("datasets.utils.tqdm")  # the module (the package exports a class)

        # What HF_DATASETS_DISABLE_PROGRESS_BARS=1 does (read at import): LeRobot re-enables the bars after
        # each of its own silenced loads, and only that setting outranks it (its warning then is noise).
        datasets_tqdm.HF_DATASETS_DISABLE_PROGRESS_BARS = True
        datasets_tqdm.disable_progress_bars()
        warnings.filterwarnings("ignore", message="Cannot enable progress bars")
    except (ImportError, AttributeError):  # another datasets version: its bars show, nothing breaks
        logger.debug("could not silence the datasets progress bars", exc_info=True)
    for name in ("lerobot.configs.video", "lerobot.datasets.video_utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
