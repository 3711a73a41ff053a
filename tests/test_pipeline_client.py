"""The pipeline client over real Zenoh on loopback: one observation per decision on the task's stream,
component servers answering on their own app keys (fake ones here: real Zenoh sessions that publish
ActionChunk / TextResult / Verdict), System 2's text reaching System 1, a safety trip within one
control period, a silent component's fallback, and SLO counters (client/pipeline.py)."""

from __future__ import annotations

import queue
import threading
import time
import zlib

import numpy as np
import pytest
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.pipeline import PipelineClient
from lerobot_zenoh.errors import CompatibilityError
from lerobot_zenoh.pipelines.descriptor import parse_task
from lerobot_zenoh.pipelines.robot_plan import RobotPlan, Route
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey
from lerobot_zenoh.protocol.messages import ActionChunk, Status, TextResult, Verdict
from lerobot_zenoh.scheduling.action_buffer import make_aggregate
from lerobot_zenoh.telemetry.fleet import FleetView
from lerobot_zenoh.transport.session import ACTION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import CAMS, free_port, make_config, wait_for

JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
SAFE_POSE = [0.0, -1.2, 1.5, 0.8, 0.0, 0.0]
TOPIC = {"system1": "action", "system2": "text", "safety": "verdict", "monitor": "verdict"}
OUTPUT = {"system1": "actions", "system2": "text", "safety": "verdict", "monitor": "verdict"}


def echo(task: str) -> float:
    """What the echo System 1 puts in every cell of its chunk: a hash of its task string."""
    return (zlib.crc32(task.encode()) % 1000) / 1000.0


class FakeComponent:
    """A component server on its own Zenoh session (listening on its own port): answers status on its
    app key with `output`, reads the task's observation stream, drops observations whose mask bit is
    clear, and answers the others after `latency_s` with `answer(observation, k)` (k = 1, 2, ...; None:
    stay silent)."""

    def __init__(self, name, kind, bit, app, stream, answer, latency_s=0.01):
        self.name, self.kind, self.bit, self.app, self.stream = name, kind, bit, app, stream
        self.answer, self.latency_s = answer, latency_s
        self.output = OUTPUT[kind]
        self.port = free_port()
        self.seen = 0          # observations on the stream (every one, whatever its mask)
        self.asked = []        # (seq_id, task) of those whose bit was set
        self.sent_at = {}      # seq_id -> perf_counter when its answer was published
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()

    @property
    def endpoint(self):
        return f"tcp/127.0.0.1:{self.port}"

    def __enter__(self):
        self.session = ZenohSession(loopback_settings(self.port)).open()
        status = Status(model_id=self.app.model, model_version=self.app.version, expected_cameras=dict(CAMS),
                        action_dim=6, max_actions_per_chunk=30, server_id=self.name, state_dim=6, fps=30,
                        observation_features={"observation.state": {"dtype": "float32", "shape": [6]}},
                        policy_type="fake", accepts_unknown_clients=True, output=self.output)
        self.session.serve(self.app.status, lambda params: codec.encode(
            Status(**{**{f: getattr(status, f) for f in status.__slots__}, "client_admitted": True})),
            with_parameters=True)
        self.session.subscribe(self.stream.all_observations, self._on_obs, with_attachment=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(2)
        self.session.close()

    def _on_obs(self, key, payload, attachment):
        self.seen += 1
        header = codec.decode_observation_header(attachment) if attachment else None
        if header is not None and header.component_mask is not None and not header.component_mask >> self.bit & 1:
            return
        self._inbox.put((key, payload, time.perf_counter()))

    def _run(self):
        pubs = {}
        while (item := self._inbox.get()) is not None:
            key, payload, arrived = item
            obs = codec.decode_observation(payload)
            self.asked.append((obs.seq_id, obs.task))
            if self._stop.wait(max(0.0, arrived + self.latency_s - time.perf_counter())):
                return
            msg = self.answer(obs, len(self.asked))
            if msg is None:
                continue
            out_key = f"{self.app.prefix}/{obs.client_uuid}/{TOPIC[self.kind]}"
            if out_key not in pubs:
                pubs[out_key] = self.session.publisher(out_key, ACTION_QOS)
            self.sent_at[obs.seq_id] = time.perf_counter()
            pubs[out_key].put(codec.encode(msg))


def echo_system1(obs, k):
    return ActionChunk(obs.seq_id, 1.0, np.full((30, 6), echo(obs.task), np.float32), server_id="s1")


def plan_text(obs, k):
    return TextResult(obs.seq_id, f"subtask-{k}", 5.0, server_id="s2")


def safe(obs, k):
    return Verdict(obs.seq_id, "safe", 1.0, score=0.9)


def ongoing(obs, k):
    return Verdict(obs.seq_id, "ongoing", 1.0)


TASK = {
    "act": {"kind": "system1", "model": "m1", "prompt": "start", "invocation": "per_chunk",
            "slo": {"deadline_ms": 400}, "on_slo_miss": {"action": "retry", "max_retries": 1, "then": "hold"},
            "inputs": ["plan"]},
    "plan": {"kind": "system2", "model": "m2", "invocation": {"every_n_chunks": 3},
             "slo": {"deadline_ms": 1000}, "on_slo_miss": "use_last"},
    "safety": {"kind": "safety", "model": "m3", "invocation": {"rate_hz": 5}, "slo": {"deadline_ms": 300},
               "on_slo_miss": "zero_velocity", "on_danger": {"action": "safe_pose", "pose": SAFE_POSE}},
    "progress": {"kind": "monitor", "model": "m2", "invocation": {"rate_hz": 2}, "slo": {"deadline_ms": 300},
                 "on_slo_miss": "hold", "on_danger": "stop_episode"},
}


class Pipeline:
    """Four fake component servers, each on its own port and app key, and the robot's plan."""

    def __init__(self, app_key, answers, latencies=None, task_over=None):
        comps = {k: dict(v) for k, v in TASK.items()}
        for k, v in (task_over or {}).items():
            comps[k].update(v)
        self.task = parse_task({"name": "kit", "action_period_ms": 200,
                                "retry": {"max_retries": 0, "then": "stop_episode"}, "components": comps})
        self.cluster, self.experiment = app_key.cluster, app_key.experiment
        self.fakes = {}
        for bit, (name, comp) in enumerate(self.task.components.items()):
            app = AppKey(self.cluster, self.experiment, f"model-{name}", "v1", f"{comp.kind}-srv{bit}")
            stream = AppKey(self.cluster, self.experiment, "_pipeline", "1", "kit")
            self.fakes[name] = FakeComponent(name, comp.kind, bit, app, stream, answers[name],
                                             (latencies or {}).get(name, 0.01))

    def __enter__(self):
        for f in self.fakes.values():
            f.__enter__()
        return self

    def __exit__(self, *exc):
        for f in self.fakes.values():
            f.__exit__(*exc)

    def plan(self, robot="r1"):
        routes = {n: Route(n, f.kind, f.app, f.endpoint, None) for n, f in self.fakes.items()}
        return RobotPlan(robot, self.task, self.cluster, self.experiment, routes, fps=30, actions_per_chunk=30)

    def client(self, robot, **kw):
        plan = self.plan()
        s1 = self.fakes["act"]
        cfg = make_config(s1.port, s1.app, aggregate=make_aggregate("latest_only"), actions_per_chunk=6, **kw)
        return PipelineClient(cfg, robot, plan)


class LoggingRobot:
    def __init__(self, robot):
        self._robot = robot
        self.sent: list[tuple[float, dict]] = []

    def __getattr__(self, name):
        return getattr(self._robot, name)

    def send_action(self, action):
        self.sent.append((time.perf_counter(), dict(action)))
        return self._robot.send_action(action)


def sim_robot(cfg_maker=make_config):
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig

    return LoggingRobot(make_robot_from_config(SimRobotConfig(cameras=dict(CAMS), fps=30)))


def run(client, seconds):
    client.start()
    try:
        client.run(duration_s=seconds)
    finally:
        client.close()
    return client


ANSWERS = {"act": echo_system1, "plan": plan_text, "safety": safe, "progress": ongoing}


def test_all_four_components_at_their_rates_one_observation_per_decision(app_key):
    with Pipeline(app_key, ANSWERS) as p:
        robot = sim_robot()
        client = p.client(robot)
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(p.fakes["act"].port,))) as mon:
            telemetry = []
            mon.subscribe(f"{client.stream_key.metrics}", lambda k, b: telemetry.append((k, codec.decode_telemetry(b))))
            client.start()
            try:
                client.run(duration_s=3.0)
                assert wait_for(lambda: len(telemetry) >= 2, 5)
            finally:
                client.close()
    published = client.counters.observations_published
    f = client.pipeline_figures()
    # one publication per decision, seen by every component's server, whatever the component count
    for fake in p.fakes.values():
        assert published - 2 <= fake.seen <= published
    asked = {n: len(fake.asked) for n, fake in p.fakes.items()}
    assert asked["act"] >= 8
    assert abs(asked["plan"] - asked["act"] / 3) <= 1.5            # every 3rd System 1 request
    assert 13 <= asked["safety"] <= 17                               # 5 Hz for 3 s
    assert 5 <= asked["progress"] <= 8                               # 2 Hz for 3 s
    assert published < sum(asked.values())                           # captures are shared
    for n in p.fakes:
        assert f[f"slo.{n}.requests"] >= asked[n] - 1 and f[f"slo.{n}.missed"] == 0, n
        assert f[f"slo.{n}.attainment"] == 1.0 and f[f"slo.{n}.slo_violated"] == 0
    assert f["pipeline.override_steps"] == 0 and client.counters.actions_executed > 60
    # the SLO figures reach a monitor, in the client's telemetry on the task's stream
    key, msg = telemetry[-1]
    assert key == f"{app_key.cluster}/{app_key.experiment}/_pipeline/1/kit/r1/metrics"
    assert msg.metrics["slo.safety.requests"] >= 5 and msg.labels["task"] == "kit"
    fleet = FleetView()
    fleet.on_telemetry(key, msg, 0.0)
    (row,) = fleet.rows(0.0)
    assert row["kind"] == "client" and "safety 100%" in row["slo"]


def test_system2_text_reaches_system1_conditioning(app_key):
    with Pipeline(app_key, ANSWERS) as p:
        robot = sim_robot()
        client = run(p.client(robot), 2.5)
        s1_tasks = [t for _, t in p.fakes["act"].asked]
    assert s1_tasks[0] == "start"                       # before System 2 answered: the prompt
    plans = {t for t in s1_tasks if t.startswith("subtask-")}
    assert len(plans) >= 2                               # the plan moves on every 3rd chunk
    # the robot executed the actions System 1 computed from System 2's text
    executed = {round(a["shoulder_pan.pos"], 4) for _, a in robot.sent}
    assert any(round(echo(t), 4) in executed for t in plans)
    assert client.summary()["pipeline"]["task_text"].startswith("subtask-")


def test_unsafe_verdict_stops_the_robot_within_one_control_period(app_key):
    def unsafe_from_4(obs, k):
        return Verdict(obs.seq_id, "unsafe" if k >= 4 else "safe", 1.0)

    with Pipeline(app_key, {**ANSWERS, "safety": unsafe_from_4}) as p:
        robot = sim_robot()
        client = run(p.client(robot), 2.0)
        safety = p.fakes["safety"]
    dt = client.dt_s
    unsafe_seq = safety.asked[3][0]
    t_verdict = safety.sent_at[unsafe_seq]               # published by the server (same process clock)
    pose = dict(zip([f"{j}.pos" for j in JOINTS], SAFE_POSE))
    first = next(t for t, a in robot.sent if t >= t_verdict and a == pose)
    assert first - t_verdict <= dt, f"{(first - t_verdict) * 1000:.1f} ms > one period {dt * 1000:.1f} ms"
    assert max(client.danger_reactions_ms) <= dt * 1000
    # and it stays there: every later action is the safe pose (no policy action got through), the one
    # sent at exit included
    assert all(a == pose for t, a in robot.sent if t >= first)
    f = client.pipeline_figures()
    assert f["slo.safety.fallbacks"] >= 1 and f["pipeline.mode"] == 3


def test_a_component_that_stops_answering_triggers_its_fallback(app_key):
    def silent_after_2(obs, k):
        return ongoing(obs, k) if k <= 2 else None

    with Pipeline(app_key, {**ANSWERS, "progress": silent_after_2}) as p:
        robot = sim_robot()
        client = run(p.client(robot), 2.5)
    f = client.pipeline_figures()
    assert f["slo.progress.answered"] == 2 and f["slo.progress.missed"] >= 2
    assert f["slo.progress.fallbacks"] >= 2 and f["slo.progress.slo_violated"] == 1
    assert f["pipeline.override_steps"] > 10             # held (the monitor's on_slo_miss)
    assert f["slo.safety.missed"] == 0 and f["slo.act.missed"] == 0
    # held: the commands after the first miss are the robot's measured positions, not System 1's echo
    s1_value = round(echo("start"), 4)
    late = [a for t, a in robot.sent[-10:]]
    assert all(round(a["shoulder_pan.pos"], 4) != s1_value for a in late)


def test_a_violated_slo_is_counted(app_key):
    # System 1 takes 150 ms against a 100 ms deadline: every request misses; retry once, then hold.
    with Pipeline(app_key, ANSWERS, latencies={"act": 0.15},
                  task_over={"act": {"slo": {"deadline_ms": 100}}}) as p:
        robot = sim_robot()
        client = run(p.client(robot), 2.0)
    f = client.pipeline_figures()
    assert f["slo.act.missed"] >= 3 and f["slo.act.met"] == 0 and f["slo.act.late"] >= 2
    assert f["slo.act.attainment"] == 0.0 and f["slo.act.slo_violated"] == 1
    assert f["slo.act.latency_ms_p50"] is None or f["slo.act.latency_ms_p50"] > 100
    assert f["slo.act.fallbacks"] >= 3 and f["pipeline.override_steps"] > 0


def test_a_component_server_answering_the_wrong_output_is_refused(app_key):
    with Pipeline(app_key, ANSWERS) as p:
        p.fakes["safety"].output = "text"  # its status now says it answers text
        p.fakes["safety"].session.close()
        p.fakes["safety"].__enter__()
        robot = sim_robot()
        client = p.client(robot)
        with pytest.raises(CompatibilityError, match="component 'safety' .*verdict.* answers text"):
            client.start()
        client.close()
