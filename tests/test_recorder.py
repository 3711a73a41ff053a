"""Dataset recording from the simulated robot: episodes, reload, drops, a writer that stalls."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from lerobot.datasets.lerobot_dataset import LeRobotDataset

from lerobot_zenoh.client.recorder import FAILSAFE_FEATURE, DatasetRecorder
from lerobot_zenoh.client.sim_robot import SimRobot, SimRobotConfig
from lerobot_zenoh.errors import ConfigError

REPO_ID = "local/zenoh_sim_test"
FPS = 30


@pytest.fixture
def robot():
    robot = SimRobot(SimRobotConfig(cameras={"front": (48, 64), "wrist": (48, 64)}, fps=FPS))
    robot.connect()
    yield robot
    robot.disconnect()


def run_steps(robot: SimRobot, recorder: DatasetRecorder, n: int, start: int = 0, held=()) -> list[dict]:
    actions = []
    for k in range(start, start + n):
        obs = robot.get_observation()
        sent = robot.send_action({key: 40.0 * np.sin(k / 10 + i) for i, key in enumerate(robot.action_features)})
        assert recorder.record(obs, sent, failsafe=k in held)
        actions.append(sent)
    return actions


def load(root) -> LeRobotDataset:
    return LeRobotDataset(REPO_ID, root=root, video_backend="pyav")


@pytest.mark.parametrize(
    ("use_videos", "streaming"), [(True, True), (False, False), (True, False)], ids=["video-streaming", "images", "video-at-save"]
)
def test_two_episodes_round_trip(tmp_path, robot, use_videos, streaming):
    root = tmp_path / "ds"
    recorder = DatasetRecorder(REPO_ID, root, FPS, robot, "pick the cube", use_videos=use_videos, streaming_encoding=streaming)
    assert not root.exists()  # the constructor does no I/O
    with recorder:
        actions = run_steps(robot, recorder, 20)
        recorder.end_episode()
        actions += run_steps(robot, recorder, 15, start=20)
        recorder.end_episode()
    assert (recorder.frames_written, recorder.episodes_saved, recorder.dropped) == (35, 2, 0)
    assert recorder.stats().write_errors == 0

    dataset = load(root)
    assert dataset.num_frames == 35 and dataset.num_episodes == 2
    frame = dataset[25]
    assert int(frame["episode_index"]) == 1 and int(frame["frame_index"]) == 5
    assert frame["task"] == "pick the cube"
    np.testing.assert_allclose(frame["action"].numpy(), list(actions[25].values()), rtol=1e-6)
    assert tuple(frame["observation.images.front"].shape) == (3, 48, 64)
    assert tuple(frame["observation.state"].shape) == (6,)


def test_closed_mid_episode_leaves_a_loadable_dataset(tmp_path, robot):
    root = tmp_path / "ds"
    recorder = DatasetRecorder(REPO_ID, root, FPS, robot, "t", use_videos=False)
    recorder.start()
    run_steps(robot, recorder, 10)
    recorder.end_episode()
    run_steps(robot, recorder, 7, start=10)
    recorder.close()  # the second episode is in progress
    recorder.close()  # idempotent
    dataset = load(root)
    assert dataset.num_frames == 17 and dataset.num_episodes == 2
    with pytest.raises(RuntimeError):
        recorder.start()


def test_empty_episodes_are_not_saved(tmp_path, robot):
    root = tmp_path / "ds"
    with DatasetRecorder(REPO_ID, root, FPS, robot, "t", use_videos=False) as recorder:
        recorder.end_episode()
        run_steps(robot, recorder, 5)
        recorder.end_episode()
        recorder.end_episode()
    assert recorder.episodes_saved == 1
    assert load(root).num_episodes == 1


def test_stalled_writer_drops_frames_instead_of_blocking(tmp_path, robot):
    root = tmp_path / "ds"
    recorder = DatasetRecorder(REPO_ID, root, FPS, robot, "t", max_queued_frames=5, use_videos=False)
    recorder.start()
    release, entered = threading.Event(), threading.Event()
    add_frame = recorder.dataset.add_frame

    def stalled_add_frame(frame):
        entered.set()
        assert release.wait(30)
        add_frame(frame)

    recorder.dataset.add_frame = stalled_add_frame
    obs, action = robot.get_observation(), robot.send_action({})
    assert recorder.record(obs, action)
    assert entered.wait(30)  # the writer holds frame 1; the queue can take 5 more
    accepted = [recorder.record(robot.get_observation(), robot.send_action({})) for _ in range(8)]
    assert accepted == [True] * 5 + [False] * 3
    assert recorder.stats().queued == 5 and recorder.dropped == 3
    release.set()
    recorder.close()
    assert recorder.frames_written == 6
    assert load(root).num_frames == 6


def test_bad_frame_is_skipped_and_counted(tmp_path, robot):
    root = tmp_path / "ds"
    with DatasetRecorder(REPO_ID, root, FPS, robot, "t", use_videos=False) as recorder:
        run_steps(robot, recorder, 3)
        recorder.record(robot.get_observation(), {"nope": 1.0})  # missing action keys
        run_steps(robot, recorder, 3)
    assert recorder.stats().write_errors == 1
    assert recorder.frames_written == 6
    assert load(root).num_frames == 6


def test_record_outside_start_close_is_dropped(tmp_path, robot):
    recorder = DatasetRecorder(REPO_ID, tmp_path / "ds", FPS, robot, "t")
    assert not recorder.record(robot.get_observation(), robot.send_action({}))
    recorder.close()  # never started: nothing to do
    assert recorder.dropped == 1


def test_existing_root_is_refused(tmp_path, robot):
    (tmp_path / "ds").mkdir()
    with pytest.raises(ConfigError) as excinfo:
        DatasetRecorder(REPO_ID, tmp_path / "ds", FPS, robot, "t").start()
    assert excinfo.value.field == "dataset.root" and "--resume" in str(excinfo.value)


def test_held_frames_are_marked_and_video_is_the_default(tmp_path, robot):
    """The `failsafe` feature is True exactly where the client held the robot; cameras are videos."""
    root = tmp_path / "ds"
    with DatasetRecorder(REPO_ID, root, FPS, robot, "t") as recorder:
        run_steps(robot, recorder, 12, held={0, 1, 7})
    dataset = load(root)
    assert dataset.meta.features[FAILSAFE_FEATURE]["dtype"] == "bool"
    assert dataset.meta.video_keys == ["observation.images.front", "observation.images.wrist"]
    held = [bool(dataset[i][FAILSAFE_FEATURE].reshape(-1)[0]) for i in range(dataset.num_frames)]
    assert [i for i, h in enumerate(held) if h] == [0, 1, 7]


def test_resume_appends_episodes_and_refuses_what_does_not_match(tmp_path, robot):
    from lerobot_zenoh.client.config import ClientDatasetConfig

    root = tmp_path / "ds"
    cfg = ClientDatasetConfig(repo_id=REPO_ID, fps=FPS, video=False)
    with DatasetRecorder.from_config(cfg, root, robot, "first") as recorder:
        run_steps(robot, recorder, 8)
    with pytest.raises(ConfigError, match="dataset.root"):
        DatasetRecorder.from_config(cfg, root, robot, "again").start()  # no --resume: refused
    with DatasetRecorder.from_config(cfg, root, robot, "second", resume=True) as recorder:
        run_steps(robot, recorder, 5)
    dataset = load(root)
    assert dataset.num_episodes == 2 and dataset.num_frames == 13
    assert dataset[10]["task"] == "second" and int(dataset[10]["episode_index"]) == 1

    other = SimRobot(SimRobotConfig(cameras={"front": (48, 64)}, fps=FPS))
    with pytest.raises(ConfigError, match="does not match this robot") as excinfo:
        DatasetRecorder.from_config(cfg, root, other, "t", resume=True).start()
    assert excinfo.value.field == "resume"
    with pytest.raises(ConfigError, match="no dataset") as excinfo:
        DatasetRecorder.from_config(cfg, tmp_path / "none", robot, "t", resume=True).start()
