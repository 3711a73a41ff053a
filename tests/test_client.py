"""The robot client end to end: real server, real Zenoh on loopback, the simulated robot."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.client import RobotClient
from lerobot_zenoh.client.config import ClientDatasetConfig, routing_args
from lerobot_zenoh.client.config_sim_robot import SimRobotConfig
from lerobot_zenoh.errors import CompatibilityError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.scheduling.action_buffer import ActionBuffer
from lerobot_zenoh.scheduling.send_trigger import SendTrigger
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import TappedSession, make_config, make_server, wait_for


class LoggingRobot:
    """Wraps a real robot, logging every action it is sent (the robot's own view)."""

    def __init__(self, robot):
        self._robot = robot
        self.sent: list[dict] = []

    def __getattr__(self, name):
        return getattr(self._robot, name)

    def send_action(self, action):
        self.sent.append(dict(action))
        return self._robot.send_action(action)


class EventBuffer(ActionBuffer):
    """The real buffer, plus an ordered log of merges and pops for an independent replay."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events: list = []
        self._order = threading.Lock()

    def merge(self, chunk, first_step):
        with self._order:
            self.events.append(("merge", np.array(chunk, np.float32), int(first_step)))
            return super().merge(chunk, first_step)

    def pop(self):
        with self._order:
            out = super().pop()
            self.events.append(("pop", out))
            return out


def replay(events, blend):
    """Reference semantics of the buffer, written out plainly."""
    actions, next_step, popped = {}, 0, []
    for event in events:
        if event[0] == "merge":
            _, rows, first = event
            for i, row in enumerate(rows):
                step = first + i
                if step < next_step:
                    continue
                actions[step] = blend(actions[step], row) if step in actions else row
        else:
            if next_step not in actions and actions:
                next_step = min(actions)
            if next_step in actions:
                popped.append(actions.pop(next_step))
                next_step += 1
            else:
                popped.append(None)
    return popped


def run_client(client, seconds, until=None, deadline_s: float = 60.0):
    """Run `client` for `seconds`; with `until`, for at least `seconds` and then until `until()`
    holds (a busy machine serves fewer chunks in the same time) or `deadline_s`."""
    client.start()
    try:
        if until is None:
            client.run(duration_s=seconds)
        else:
            runner = threading.Thread(target=client.run)
            runner.start()
            t0 = time.monotonic()
            wait_for(lambda: time.monotonic() - t0 >= seconds and until(), deadline_s)
            client.stop()
            runner.join(10)
    finally:
        client.close()
    return client


@pytest.mark.parametrize("aggregate", ["weighted_average", "latest_only"])
def test_robot_executes_exactly_the_trimmed_and_blended_chunks(port, app_key, aggregate):
    from lerobot_zenoh.scheduling.action_buffer import make_aggregate

    agg = make_aggregate(aggregate)
    # Fixed buffer time longer than the chunk lasts minus one RTT forces overlap, hence blending.
    from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig

    cfg = make_config(port, app_key, aggregate=agg, send=SendTriggerConfig(buffer_time_s=0.6))
    with make_server(port, app_key, latency_ms=30):
        monitor_chunks = []
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as mon:
            mon.subscribe(app_key.client("r1").action, lambda k, b: monitor_chunks.append(codec.decode_action_chunk(b)))
            robot = LoggingRobot(make_robot_from_config(cfg.robot))
            client = RobotClient(cfg, robot, buffer=EventBuffer(agg))
            run_client(client, 3.0)
    merges = [e for e in client.buffer.events if e[0] == "merge"]
    pops = [e[1] for e in client.buffer.events if e[0] == "pop"]
    assert len(merges) >= 4 and client.counters.chunks_received == len(merges)
    # 1. what was merged is what the server sent, minus int(rtt/dt) leading rows (none for the first).
    rtts_s = [ms / 1000 for ms in client.counters.rtt_ms]
    for i, (_, rows, _first) in enumerate(merges):
        expired = 0 if i == 0 else int(rtts_s[i] / client.dt_s)
        np.testing.assert_array_equal(rows, monitor_chunks[i].actions[expired:])
    # 2. the buffer did what the plain reference says, and blending happened.
    expected = replay(client.buffer.events, agg.blend)
    assert len(expected) == len(pops)
    for got, want in zip(pops, expected):
        assert (got is None) == (want is None)
        if got is not None:
            np.testing.assert_allclose(got[1], want, rtol=0, atol=1e-6)
    assert client.buffer.stats().blended_steps > 0
    # 3. the robot received exactly the popped actions (fail-safe holds where the buffer was empty).
    robot_actions = robot.sent[: len(pops)]
    for sent, popped in zip(robot_actions, pops):
        if popped is not None:
            np.testing.assert_allclose(list(sent.values()), popped[1], rtol=0, atol=1e-6)


def test_trimmed_steps_follow_the_rtt(port, app_key):
    cfg = make_config(port, app_key)
    with make_server(port, app_key, latency_ms=200):
        buffer = EventBuffer(cfg.aggregate)
        steps_at_send = {}

        class StepNotingTrigger(SendTrigger):  # the buffer's step when each request leaves
            def on_send(self, seq_id, now_s, **kw):
                steps_at_send[seq_id] = buffer.next_step
                return super().on_send(seq_id, now_s, **kw)

        client = RobotClient(cfg, make_robot_from_config(cfg.robot), buffer=buffer,
                             trigger=StepNotingTrigger(cfg.send, dt_s=cfg.dt_s))
        run_client(client, 3.0)
    merges = [e for e in client.buffer.events if e[0] == "merge"]
    assert len(merges) >= 3
    rtts_s = [ms / 1000 for ms in client.counters.rtt_ms]
    assert min(rtts_s) >= 0.2
    captured = sorted(steps_at_send.values())
    exact = 0
    for i, (_, _rows, first_step) in enumerate(merges[1:], start=1):
        expired = int(rtts_s[i] / client.dt_s)
        assert expired >= 6  # 200 ms of a 33 ms period
        # row 0 was meant for the step at capture; `expired` rows are skipped unless the robot
        # executed fewer steps than that meanwhile (it held: nothing expired for it).
        trimmed = [first_step - c for c in captured if 0 <= first_step - c <= expired]
        assert trimmed, (first_step, expired, captured)
        exact += expired in trimmed
    assert exact >= 0.8 * (len(merges) - 1)
    assert client.counters.trimmed_steps >= 6 * (len(merges) - 1)


def test_control_period_holds_while_publishing_is_slow_and_without_a_server(port, app_key):
    """The control loop never waits for the network, even if a put takes 300 ms."""
    cfg = make_config(port, app_key, robot=SimRobotConfig(cameras={"front": (48, 64), "wrist": (48, 64)}, fps=30))
    server = make_server(port, app_key).start()
    congested = lambda key, payload, attachment: time.sleep(0.3)  # noqa: E731  (every put takes 300 ms)
    client = RobotClient(cfg, make_robot_from_config(cfg.robot),
                         session_factory=lambda settings: TappedSession(ZenohSession(settings).open(), congested))
    client.start()
    try:
        client.run(duration_s=2.0)
        with_server = list(client.counters.period_ms)
        server.stop()
        client.counters.period_ms.clear()
        client.run(duration_s=2.0)
        without_server = list(client.counters.period_ms)
    finally:
        client.close()
        server.stop()
    for periods in (with_server, without_server):
        assert len(periods) >= 50
        assert abs(np.median(periods) - 1000 / 30) < 3.0
        assert np.mean(np.array(periods) > 1000 / 30 * 2) < 0.05  # a rare hiccup of the test machine is not a stall
    assert client.counters.observations_published >= 1


def test_server_killed_robot_holds_revalidates_and_resumes(port, app_key, caplog):
    cfg = make_config(port, app_key, watchdog_timeout_s=0.5)
    server = make_server(port, app_key).start()
    robot = LoggingRobot(make_robot_from_config(cfg.robot))
    client = RobotClient(cfg, robot).start()
    runner = threading.Thread(target=client.run)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while client.counters.chunks_received < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.counters.chunks_received >= 3
        server.stop()  # the server dies
        deadline = time.monotonic() + 10
        while client.counters.watchdog_events == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.counters.watchdog_events >= 1 and client.state == "revalidating"
        empty_before = client.counters.empty_cycles
        deadline = time.monotonic() + 3  # the buffered chunk (30 steps, 1 s) runs out, then it holds
        while client.counters.empty_cycles < empty_before + 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.counters.empty_cycles >= empty_before + 10  # holding, not stalled
        chunks_before = client.counters.chunks_received
        server = make_server(port, app_key).start()  # a server comes back
        deadline = time.monotonic() + 10
        while client.counters.chunks_received <= chunks_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.counters.chunks_received > chunks_before and client.state == "running"
    finally:
        client.stop()
        runner.join(5)
        client.close()
        server.stop()
    hold = [a for a in robot.sent if a == {k: pytest.approx(v) for k, v in a.items()}]
    assert hold  # the robot kept receiving commands throughout
    assert any("re-validating" in r.message for r in caplog.records)


@pytest.mark.parametrize("server_kw", [{"cameras": {"front": (48, 64)}}, {"action_dim": 4}, {"cameras": {"front": (96, 64), "wrist": (48, 64)}}])
def test_mismatched_server_means_no_action_at_all(port, app_key, server_kw):
    cfg = make_config(port, app_key, discovery_timeout_s=10)
    with make_server(port, app_key, **server_kw):
        robot = LoggingRobot(make_robot_from_config(cfg.robot))
        client = RobotClient(cfg, robot)
        with pytest.raises(CompatibilityError):
            client.start()
        client.close()
    assert robot.sent == []


def test_cli_exits_nonzero_on_mismatch(port, app_key):
    with make_server(port, app_key, cameras={"front": (48, 64)}):
        r = subprocess.run([
            sys.executable, "-m", "lerobot_zenoh.cli.client", "--robot.type=zenoh_sim",
            "--robot.cameras={front: [48, 64], wrist: [48, 64]}",
            *routing_args(app_key, "r9", f"tcp/127.0.0.1:{port}"), "--discovery_timeout_s=20",
        ], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "cameras" in r.stderr


def test_no_server_at_all_fails_discovery_in_bounded_time(port, app_key):
    """A dead endpoint: nothing listens there. Told apart from "no server answers" within ~2 s."""
    cfg = make_config(port, app_key, discovery_timeout_s=15.0)
    client = RobotClient(cfg, make_robot_from_config(cfg.robot))
    t0 = time.monotonic()
    with pytest.raises(CompatibilityError, match=f"cannot connect to tcp/127.0.0.1:{port}"):
        client.start()
    client.close()
    assert time.monotonic() - t0 < 5


def test_connected_but_no_server_answers_names_the_status_key(port, app_key):
    """Something listens at the endpoint (a bare Zenoh peer), but no server serves this app."""
    cfg = make_config(port, app_key, discovery_timeout_s=1.0)
    with ZenohSession(loopback_settings(port)):
        client = RobotClient(cfg, make_robot_from_config(cfg.robot))
        t0 = time.monotonic()
        with pytest.raises(CompatibilityError) as excinfo:
            client.start()
        client.close()
    assert time.monotonic() - t0 < 5
    assert f"connected to tcp/127.0.0.1:{port}, but no server answers {app_key.status}" in str(excinfo.value)


def test_client_the_server_does_not_serve_is_refused_at_discovery(port, app_key):
    """The manifest lists only r1: r2 is refused at start-up naming both, and never moves the robot."""
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer

    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{
            "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "synthetic": {"state_dim": 6, "action_dim": 6, "chunk_size": 30, "cameras": {"front": [48, 64], "wrist": [48, 64]}},
            "fps": 30, "clients": [{"client_uuid": "r1"}],
        }],
    })
    with PolicyServer(manifest):
        robot = LoggingRobot(make_robot_from_config(make_config(port, app_key).robot))
        refused = RobotClient(make_config(port, app_key, client_uuid="r2", discovery_timeout_s=10), robot)
        with pytest.raises(CompatibilityError, match="server gpu0 does not serve client 'r2'"):
            refused.start()
        refused.close()
        admitted = RobotClient(make_config(port, app_key, client_uuid="r1", discovery_timeout_s=10),
                               make_robot_from_config(make_config(port, app_key).robot))
        admitted.start()
        admitted.close()
    assert robot.sent == []


def _load_dataset(repo_id, root):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    return LeRobotDataset(repo_id, root=root, video_backend="pyav")


def test_recording_frames_equal_steps_executed(port, app_key, tmp_path):
    from lerobot_zenoh.client.recorder import DatasetRecorder

    cfg = make_config(port, app_key, task="pick")
    with make_server(port, app_key):
        robot = make_robot_from_config(cfg.robot)
        recorder = DatasetRecorder("local/test", tmp_path / "ds", cfg.fps, robot, "pick")
        client = RobotClient(cfg, robot, recorder)
        client.start()
        recorder.start()
        try:
            client.run(duration_s=2.0)
        finally:
            client.close()
    ds = _load_dataset("local/test", tmp_path / "ds")
    assert ds.num_frames == client.counters.steps == recorder.frames_written
    assert ds.num_episodes == 1
    frame = ds[len(ds) - 1]
    assert frame["observation.images.front"].shape == (3, 48, 64)
    assert frame["action"].shape == (6,) and frame["task"] == "pick"


def test_episodes_are_separated_by_a_reset_phase_that_records_nothing(port, app_key, tmp_path, caplog):
    """--dataset.*: 2 episodes of 1 s with a 0.5 s reset between them; held frames are marked."""
    import logging

    from lerobot_zenoh.client.config import ClientDatasetConfig
    from lerobot_zenoh.client.recorder import FAILSAFE_FEATURE, DatasetRecorder

    caplog.set_level(logging.INFO)
    dataset = ClientDatasetConfig(repo_id="local/episodes", root=str(tmp_path / "ds"), episode_time_s=1.0,
                                  reset_time_s=0.5, num_episodes=2, video=False, single_task="pick")
    cfg = make_config(port, app_key, dataset=dataset)
    with make_server(port, app_key):
        robot = LoggingRobot(make_robot_from_config(cfg.robot))
        recorder = DatasetRecorder.from_config(cfg.dataset, cfg.dataset_root, robot, cfg.task_text)
        client = RobotClient(cfg, robot, recorder)
        client.start()
        recorder.start()
        try:
            t0 = time.monotonic()
            client.run()  # ends by itself after the second episode
            elapsed = time.monotonic() - t0
        finally:
            client.close()
    assert 2.3 < elapsed < 4.0
    ds = _load_dataset("local/episodes", tmp_path / "ds")
    assert ds.num_episodes == 2 and ds.num_frames == client.counters.steps == recorder.frames_written
    assert 10 <= client.counters.reset_steps <= 20  # 0.5 s at 30 Hz, recorded nowhere
    # the robot was commanded (held) at every reset step too; close() adds one fail-safe action
    assert len(robot.sent) == client.counters.steps + client.counters.reset_steps + 1
    held = [bool(ds.hf_dataset[i][FAILSAFE_FEATURE].reshape(-1)[0]) for i in range(ds.num_frames)]
    assert sum(held) == client.counters.empty_cycles >= 1  # at least the first step, before any chunk
    assert held[0] and ds[0]["task"] == "pick"
    messages = [r.getMessage() for r in caplog.records]
    assert any("episode 1/2: recording" in m for m in messages) and any("episode 2/2 done" in m for m in messages)
    assert any("reset for 0.5 s: robot held, nothing recorded" in m for m in messages)


def test_interrupted_cli_run_leaves_a_loadable_dataset(port, app_key, tmp_path):
    import json
    import signal

    summary = tmp_path / "summary.json"
    with make_server(port, app_key):
        proc = subprocess.Popen([
            sys.executable, "-m", "lerobot_zenoh.cli.client", "--robot.type=zenoh_sim",
            "--robot.cameras={front: [48, 64], wrist: [48, 64]}",
            *routing_args(app_key, "rec", f"tcp/127.0.0.1:{port}"), "--dataset.repo_id=local/interrupted",
            f"--dataset.root={tmp_path / 'ds'}", "--dataset.video=false", f"--summary_path={summary}", "--task=stack",
        ], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (tmp_path / "ds").exists():
                time.sleep(0.1)
            time.sleep(2.0)  # mid-episode
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    steps = json.loads(summary.read_text())["steps"]
    ds = _load_dataset("local/interrupted", tmp_path / "ds")
    assert steps > 10 and ds.num_frames == steps and ds.num_episodes == 1


def test_outbox_keeps_the_newest_and_counts_the_rest():
    from lerobot_zenoh.client.client import Outbox

    box = Outbox()
    assert box.take(0.01) is None
    for i in range(3):
        box.put(i)
    box.wake()
    assert box.take(0.1) == 2 and box.dropped == 2
    box.wake()
    assert box.take(0.1) is None  # a wake-up alone returns nothing


def test_observations_carry_the_episode_and_one_session_nonce_per_client(port, app_key, tmp_path):
    """Protocol 1.1: episode_id follows the client's episodes; session_nonce is fixed per RobotClient."""
    episodes = ClientDatasetConfig(repo_id="local/nonce", root=str(tmp_path / "ds"), episode_time_s=0.6,
                                   reset_time_s=0.2, num_episodes=3, video=False, single_task="pick")
    cfg = make_config(port, app_key, dataset=episodes, actions_per_chunk=5)
    seen = []
    with make_server(port, app_key, latency_ms=10):
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as mon:
            mon.subscribe(app_key.client("r1").obs, lambda k, b: seen.append(codec.decode_observation(b)))
            client = RobotClient(cfg, make_robot_from_config(cfg.robot))
            run_client(client, 5.0)
    assert len(seen) >= 5
    assert {o.session_nonce for o in seen} == {client.session_nonce}
    assert {o.task for o in seen} == {"pick"}  # --dataset.single_task is the task when --task is not given
    assert 0 <= client.session_nonce < 2**63
    episodes = [int(o.episode_id) for o in seen]
    assert episodes == sorted(episodes) and len(set(episodes)) >= 2  # a new id at each episode
    assert RobotClient(cfg, make_robot_from_config(cfg.robot)).session_nonce != client.session_nonce


# -- real-time chunking ---------------------------------------------------------------------------


class RtcEventBuffer(ActionBuffer):
    """The real buffer, plus an ordered log of leftovers taken, merges, replacements and pops."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.events: list = []
        self._order = threading.Lock()

    def leftover(self, max_rows=None):
        with self._order:
            out = super().leftover(max_rows)
            self.events.append(("leftover", out))
            return out

    def merge(self, chunk, first_step):
        with self._order:
            self.events.append(("merge",))
            return super().merge(chunk, first_step)

    def replace_from(self, chunk, first_step):
        with self._order:
            result = super().replace_from(chunk, first_step)
            self.events.append(("replace", np.array(chunk, np.float32), int(first_step), result))
            return result

    def pop(self):
        with self._order:
            out = super().pop()
            self.events.append(("pop", out))
            return out


def test_rtc_observations_carry_the_leftover_and_the_buffer_is_replaced_not_blended(port, app_key):
    from lerobot_zenoh.scheduling.chunk_intake import MergeMode

    cfg = make_config(port, app_key, actions_per_chunk=20)
    seen_obs, seen_chunks = [], {}
    with make_server(port, app_key, latency_ms=60, rtc=True):
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as mon:
            mon.subscribe(app_key.client("r1").obs, lambda k, b: seen_obs.append(codec.decode_observation(b)))
            mon.subscribe(app_key.client("r1").action,
                          lambda k, b: seen_chunks.setdefault((c := codec.decode_action_chunk(b)).response_to_seq_id, c))
            robot = LoggingRobot(make_robot_from_config(cfg.robot))
            client = RobotClient(cfg, robot, buffer=RtcEventBuffer(cfg.aggregate))
            run_client(client, 3.0, until=lambda: len(seen_obs) >= 5 and sum(
                e[0] == "replace" for e in list(client.buffer.events)) >= 5)
    assert client.status.rtc is not None and client.rtc_active and client.intake.mode is MergeMode.RTC
    events = client.buffer.events
    leftovers = [e[1] for e in events if e[0] == "leftover"]
    replaces = [e for e in events if e[0] == "replace"]
    assert len(seen_obs) >= 5 and len(replaces) >= 5
    # 1. each observation carries exactly the buffer's leftover at its capture, and a delay it can hold
    by_seq = {o.seq_id: o for o in seen_obs}
    for seq_id, (step, rows) in enumerate(leftovers, start=1):
        if seq_id not in by_seq:  # superseded in the outbox (not published)
            continue
        rtc = by_seq[seq_id].rtc
        assert rtc is not None and rtc.prefix.dtype == np.float32 and rtc.prefix.shape[1] == 6
        assert rtc.prefix.tobytes() == rows.reshape(-1, 6).tobytes()
        assert 0 <= rtc.delay_steps <= len(rows)
    assert any(len(o.rtc.prefix) > 0 and o.rtc.delay_steps > 0 for o in seen_obs)
    # 2. every chunk echoed the delay it was asked for and continued the prefix (the synthetic RTC runner)
    for seq_id, chunk in seen_chunks.items():
        rtc = by_seq[seq_id].rtc
        assert chunk.rtc_delay_steps == rtc.delay_steps
        np.testing.assert_array_equal(chunk.actions[: rtc.delay_steps], rtc.prefix[: rtc.delay_steps])
    # 3. every chunk replaced the buffer; nothing was ever blended
    assert not [e for e in events if e[0] == "merge"]
    stats = client.buffer.stats()
    assert stats.blended_steps == 0 and stats.replaced_chunks == client.counters.chunks_received == len(replaces)
    # 4. replay: from each replacement on, the robot executes that chunk's rows from its actual start
    actions, popped_expected, popped = {}, [], []
    for e in events:
        if e[0] == "replace":
            _, rows, first, result = e
            start = first + result.discarded_stale
            assert start == max(first, result.next_step)
            if result.appended:
                actions = {s: a for s, a in actions.items() if s < start}
                actions.update({start + i: rows[result.discarded_stale + i] for i in range(len(rows) - result.discarded_stale)})
        elif e[0] == "pop":
            popped.append(e[1])
            if e[1] is not None:
                popped_expected.append(actions.pop(e[1][0]))
    got = [p[1] for p in popped if p is not None]
    assert len(got) == len(popped_expected) > 30
    for a, b in zip(got, popped_expected):
        np.testing.assert_array_equal(a, b)
    # 5. predicted vs actual delay per chunk, and the wrong estimates among them, are recorded
    c = client.counters
    assert c.rtc_chunks == len(replaces) and len(c.rtc_delays) == c.rtc_chunks and c.rtc_fallback_chunks == 0
    for (_, _, first, result), (predicted, actual) in zip(replaces, c.rtc_delays):
        assert actual == result.next_step - first
    assert c.rtc_delay_mispredicted == sum(abs(a - p) >= cfg.rtc.mispredict_steps for p, a in c.rtc_delays)
    summary = client.summary()["rtc"]
    assert summary["active"] and summary["chunks"] == c.rtc_chunks
    assert sum(summary["delay_error_steps_histogram"].values()) == c.rtc_chunks
    figures, _ = client.telemetry_figures()
    assert figures["rtc_chunks"] == c.rtc_chunks and figures["rtc_delay_error_steps_p50"] is not None


def test_rtc_can_be_turned_off_and_is_off_when_not_offered(port, app_key):
    from lerobot_zenoh.client.config import RtcConfig

    for server_rtc, client_rtc in ((True, False), (False, True)):
        cfg = make_config(port, app_key, rtc=RtcConfig(enabled=client_rtc))
        seen = []
        with make_server(port, app_key, latency_ms=20, rtc=server_rtc):
            with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as mon:
                mon.subscribe(app_key.client("r1").obs, lambda k, b: seen.append(codec.decode_observation(b)))
                client = RobotClient(cfg, make_robot_from_config(cfg.robot))
                run_client(client, 1.5)
        assert (client.status.rtc is not None) == server_rtc and not client.rtc_active
        assert len(seen) >= 2 and all(o.rtc is None for o in seen)
        assert client.buffer.stats().replaced_chunks == 0 and client.counters.rtc_chunks == 0
        assert client.summary()["rtc"]["active"] is False


def test_observations_carry_the_frames_of_the_steps_before_them_when_the_model_asks(port, app_key):
    """Status.history_length = 3: each observation carries the robot's last 2 frames, one control
    period apart (what the robot saw at the 2 steps before the capture), JPEG-encoded like its own."""
    cfg = make_config(port, app_key, actions_per_chunk=5)
    robot = make_robot_from_config(cfg.robot)
    seen_states: list[np.ndarray] = []  # every state the control loop read, in order
    read = robot.get_observation

    def get_observation():
        obs = read()
        seen_states.append(np.array([obs[n] for n in robot.observation_features if not isinstance(
            robot.observation_features[n], tuple)], dtype=np.float32))
        return obs

    robot.get_observation = get_observation
    sent = []
    with make_server(port, app_key, latency_ms=10, history_length=3):
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as mon:
            mon.subscribe(app_key.client("r1").obs, lambda k, b: sent.append(codec.decode_observation(b)))
            client = RobotClient(cfg, robot)
            run_client(client, 2.5)
    assert client.status.history_length == 3 and len(sent) >= 5
    keys = [s.tobytes() for s in seen_states]
    unique = {k: i for i, k in enumerate(keys) if keys.count(k) == 1}  # (the robot holds still at first)
    checked = 0
    for obs in sent:
        i = unique.get(obs.state.tobytes())
        if i is None or i < 4:
            continue
        assert len(obs.history) == 2
        for k, frame in enumerate(obs.history):
            np.testing.assert_array_equal(frame.state, seen_states[i - 2 + k])
            assert set(frame.images) == set(cfg.robot.cameras)
            assert all(jpeg[:2] == b"\xff\xd8" for jpeg in frame.images.values())
        checked += 1
    assert checked >= 3


def test_a_robot_shut_out_of_its_session_draws_a_new_nonce_and_is_served_again(port, app_key):
    """A forged observation with the robot's nonce and a seq_id 1000 ahead (within the server's bound on
    jumps) becomes the session's newest: every later request of the robot is `replayed` and goes unanswered. After
    `new_nonce_after_unanswered` of them in a row the client draws a new nonce, and is served again."""
    from lerobot_zenoh.protocol.messages import ExecutionInfo, Observation

    cfg = make_config(port, app_key, new_nonce_after_unanswered=3)
    served = []
    with make_server(port, app_key):
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as attacker:
            attacker.subscribe(app_key.client("r1").action,
                               lambda k, b: served.append(codec.decode_action_chunk(b).response_to_seq_id))
            client = RobotClient(cfg, make_robot_from_config(cfg.robot)).start()
            runner = threading.Thread(target=client.run, kwargs={"duration_s": 30.0})
            runner.start()
            try:
                assert wait_for(lambda: client.counters.chunks_received >= 3, 10)
                nonce = client.session_nonce
                forged_seq = max(served) + 1000
                frame = np.zeros((48, 64, 3), np.uint8)
                forged = Observation(forged_seq, "r1", np.zeros(6, np.float32),
                                     {cam: codec.encode_jpeg(frame, 80) for cam in ("front", "wrist")}, "",
                                     ExecutionInfo(), episode_id=str(client.episode), session_nonce=nonce)
                attacker.publisher(app_key.client("r1").obs, OBSERVATION_QOS).put(
                    codec.encode(forged), attachment=codec.encode_observation_header(forged))
                poisoned = wait_for(lambda: forged_seq in served, 5)
                before = client.counters.chunks_received
                if poisoned:  # the robot is shut out: it must renew its session by itself
                    assert wait_for(lambda: client.counters.session_renewals >= 1, 15)
                    assert client.session_nonce != nonce
                # Renewed, or never shut out (a server that refuses the forgery): served either way.
                assert wait_for(lambda: client.counters.chunks_received >= before + 5, 15)
                summary = client.summary()
                assert summary["session_renewals"] == client.counters.session_renewals
            finally:
                client.stop()
                runner.join(10)
                client.close()


def test_a_client_uses_the_session_it_is_given_and_leaves_it_open(port, app_key):
    cfg = make_config(port, app_key)
    with make_server(port, app_key):
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))) as session:
            client = run_client(RobotClient(cfg, make_robot_from_config(cfg.robot), session=session), 1.0)
            assert client.counters.chunks_received >= 1
            # closed the client, not the session: it still answers a status query
            assert session.query(app_key.status, timeout_s=2.0)


def test_a_task_longer_than_a_server_reads_fails_at_start_up_naming_the_field(app_key):
    """A server refuses every observation whose task is over MAX_TASK_BYTES (task_too_long): the
    client says so before it starts, naming the flag that gave the task."""
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.protocol.messages import MAX_TASK_BYTES

    make_config(7447, app_key, task="ü" * (MAX_TASK_BYTES // 2)).validate()  # exactly the limit: fine
    with pytest.raises(ConfigError, match=r"^task: is 2050 bytes"):
        make_config(7447, app_key, task="ü" * (MAX_TASK_BYTES // 2) + "xx").validate()
