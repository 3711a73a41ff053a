"""The pipeline client over real Zenoh on loopback, against real policy servers with synthetic
components (server/runners/synthetic.py): one observation per decision on the task's stream, every
component's server answering on its own app key, System 2's text reaching System 1 (echo_task), a
safety trip within one control period, a silent component's fallback, and SLO counters
(client/pipeline.py, docs/pipelines.md)."""

from __future__ import annotations

import time

import pytest
from lerobot.robots import make_robot_from_config

from lerobot_zenoh.client.pipeline import PipelineClient
from lerobot_zenoh.errors import CompatibilityError
from lerobot_zenoh.pipelines.descriptor import parse_task
from lerobot_zenoh.pipelines.robot_plan import RobotPlan, Route
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.scheduling.action_buffer import make_aggregate
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.runners.synthetic import task_code
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.telemetry.fleet import FleetView
from lerobot_zenoh.transport.session import ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import CAMS, free_port, make_config, wait_for

JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
SAFE_POSE = [0.0, -1.2, 1.5, 0.8, 0.0, 0.0]
SYNTH = {"state_dim": 6, "action_dim": 6, "chunk_size": 30, "cameras": {k: list(v) for k, v in CAMS.items()},
         "latency_ms": 5}
#: What each component's synthetic server answers (pserve's runners): System 1 echoes its task string's
#: code in its last action dimension, System 2 walks a script of subtasks, safety and monitor say
#: safe / ongoing unless a test scripts otherwise.
COMPONENTS = {
    "act": {"echo_task": True},
    "plan": {"output": "text", "subtasks": ["reach", "grasp", "lift", "place"]},
    "safety": {"output": "verdict", "verdicts": ["safe"]},
    "progress": {"output": "verdict", "verdicts": ["ongoing"]},
}
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
    """Two policy servers on two ports (System 1 + System 2; safety + monitor), each component on an app
    key of its own and subscribed to the task's stream (a manifest `pipeline` item), and the robot's plan."""

    def __init__(self, app_key, synthetic=None, task_over=None, robot="r1", retry=None):
        comps = {k: dict(v) for k, v in TASK.items()}
        for k, v in (task_over or {}).items():
            comps[k].update(v)
        self.task = parse_task({"name": "kit", "action_period_ms": 200,
                                "retry": retry or {"max_retries": 0, "then": "stop_episode"}, "components": comps})
        self.cluster, self.experiment, self.robot = app_key.cluster, app_key.experiment, robot
        synthetic = {k: {**COMPONENTS[k], **(synthetic or {}).get(k, {})} for k in COMPONENTS}
        self.entries, self.where = {}, {}
        for bit, (name, comp) in enumerate(self.task.components.items()):
            self.entries[name] = {
                "model_id": f"m-{name}", "model_version": "v1", "application_tag": f"{comp.kind}-srv",
                "synthetic": {**SYNTH, **synthetic[name]}, "fps": 30, "clients": [{"client_uuid": robot}],
                "pipeline": [{"task": "kit", "component": name, "bit": bit}]}
        self.groups = {"srvA": ["act", "plan"], "srvB": ["safety", "progress"]}
        self.ports = {g: free_port() for g in self.groups}

    def __enter__(self):
        self.servers, self.apps = {}, {}
        for group, names in self.groups.items():
            m = parse_manifest({"cluster_uuid": self.cluster, "experiment_tag": self.experiment, "server_id": group,
                                "zenoh": {"listen": [f"tcp/127.0.0.1:{self.ports[group]}"], "multicast_scouting": False},
                                "telemetry_period_s": 0, "server": [self.entries[n] for n in names]})
            self.servers[group] = PolicyServer(m).start()
            for name, e in zip(names, m.server):
                self.apps[name], self.where[name] = m.app_key(e), group
        return self

    def __exit__(self, *exc):
        for server in self.servers.values():
            server.stop()

    def stats(self, name):
        return self.servers[self.where[name]].stats()[self.apps[name].prefix]

    def endpoint(self, name):
        return f"tcp/127.0.0.1:{self.ports[self.where[name]]}"

    def plan(self):
        routes = {n: Route(n, self.task.components[n].kind, self.apps[n], self.endpoint(n), None)
                  for n in self.task.components}
        return RobotPlan(self.robot, self.task, self.cluster, self.experiment, routes, fps=30, actions_per_chunk=6)

    def client(self, robot, **kw):
        s1 = self.apps["act"]
        cfg = make_config(self.ports["srvA"], s1, aggregate=make_aggregate("latest_only"), actions_per_chunk=6,
                          client_uuid=self.robot, **kw)
        return PipelineClient(cfg, robot, self.plan())


class LoggingRobot:
    def __init__(self, robot):
        self._robot = robot
        self.sent: list[tuple[float, dict]] = []

    def __getattr__(self, name):
        return getattr(self._robot, name)

    def send_action(self, action):
        self.sent.append((time.perf_counter(), dict(action)))
        return self._robot.send_action(action)


def sim_robot():
    from lerobot_zenoh.client.config_sim_robot import SimRobotConfig

    return LoggingRobot(make_robot_from_config(SimRobotConfig(cameras=dict(CAMS), fps=30)))


def run(client, seconds):
    client.start()
    try:
        client.run(duration_s=seconds)
    finally:
        client.close()
    return client


def received(stats) -> int:
    """Observations a component's server took into its robot's slot (closed sessions included)."""
    return stats["totals"].get("received", 0) + sum(c["received"] for c in stats["clients"].values())


def test_all_four_components_at_their_rates_one_observation_per_decision(app_key):
    with Pipeline(app_key) as p:
        robot = sim_robot()
        client = p.client(robot)
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(p.ports["srvA"],))) as mon:
            telemetry = []
            mon.subscribe(client.stream_key.metrics, lambda k, b: telemetry.append((k, codec.decode_telemetry(b))))
            client.start()
            try:
                client.run(duration_s=3.0)
                assert wait_for(lambda: len(telemetry) >= 2, 5)
            finally:
                client.close()
        stats = {n: p.stats(n) for n in p.task.components}
    published = client.counters.observations_published
    f = client.pipeline_figures()
    asked = {n: f[f"slo.{n}.requests"] for n in p.task.components}
    assert asked["act"] >= 10
    assert abs(asked["plan"] - asked["act"] / 3) <= 1                # every 3rd System 1 request
    assert 13 <= asked["safety"] <= 17                               # 5 Hz for 3 s
    assert 5 <= asked["progress"] <= 8                               # 2 Hz for 3 s
    assert published < sum(asked.values())                           # one capture serves several components
    for n, st in stats.items():
        # one publication per decision, on the key naming the components it asks: each server hears
        # only the observations that ask it (none to drop unread)
        assert st["observations_for_other_components"] == 0, n
        assert asked[n] - 2 <= received(st) <= asked[n], n
        assert f[f"slo.{n}.missed"] == 0 and f[f"slo.{n}.attainment"] == 1.0 and f[f"slo.{n}.slo_violated"] == 0, n
        assert f[f"slo.{n}.answered"] == sum(st["answers"].values()), n
    assert stats["safety"]["answers"] == {"verdict.safe": asked["safety"]}
    assert f["pipeline.override_steps"] == 0 and client.counters.actions_executed > 60
    # the SLO figures reach a monitor, in the client's telemetry on the task's stream
    key, msg = telemetry[-1]
    assert key == f"{app_key.cluster}/{app_key.experiment}/_pipeline/1/kit/r1/metrics"
    assert msg.metrics["slo.safety.requests"] >= 5 and msg.labels["task"] == "kit"
    fleet = FleetView()
    fleet.on_telemetry(key, msg, 0.0)
    (row,) = fleet.rows(0.0)
    assert row["kind"] == "client" and "safety 100%" in row["slo"] and "act 100%" in row["slo"]


def test_system2_text_reaches_system1_conditioning(app_key):
    with Pipeline(app_key) as p:
        robot = sim_robot()
        client = run(p.client(robot), 2.5)
    # System 1 (echo_task) writes task_code(its task string) in the gripper column of every row: the
    # robot executed chunks conditioned on the prompt first, then on System 2's subtasks in order.
    executed = [a["gripper.pos"] for _, a in robot.sent]
    codes = {task_code(t): t for t in ("start", "reach", "grasp", "lift", "place")}
    seen = [codes[v] for v in executed if v in codes]
    order = [t for i, t in enumerate(seen) if i == 0 or seen[i - 1] != t]
    assert order[0] == "start" and order[1:4] == ["reach", "grasp", "lift"], order
    assert client.summary()["pipeline"]["task_text"] in ("reach", "grasp", "lift", "place")


def test_unsafe_verdict_stops_the_robot_within_one_control_period(app_key):
    with Pipeline(app_key, synthetic={"safety": {"verdict_at": {4: "unsafe", 5: "unsafe", 6: "unsafe"}}}) as p:
        robot = sim_robot()
        client = p.client(robot)
        verdicts = []  # an independent listener on the robot's verdict key: (arrival, label)
        with ZenohSession(loopback_settings(None, listen=False, connect_ports=(p.ports["srvB"],))) as mon:
            mon.subscribe(p.apps["safety"].client("r1").verdict,
                          lambda k, b: verdicts.append((time.perf_counter(), codec.decode_verdict(b).label)))
            run(client, 2.5)
    dt = client.dt_s
    t_unsafe = next(t for t, label in verdicts if label == "unsafe")
    pose = dict(zip([f"{j}.pos" for j in JOINTS], SAFE_POSE))
    first = next(t for t, a in robot.sent if t >= t_unsafe and a == pose)
    assert first - t_unsafe <= dt, f"{(first - t_unsafe) * 1000:.1f} ms > one period {dt * 1000:.1f} ms"
    assert max(client.danger_reactions_ms) <= dt * 1000
    print(f"unsafe verdict -> safe pose: {(first - t_unsafe) * 1000:.2f} ms (listener), "
          f"{max(client.danger_reactions_ms):.2f} ms (client's own arrival), period {dt * 1000:.1f} ms")
    # until a later `safe` (request 7 on), every action is the safe pose: no policy action got through
    t_safe = next(t for t, label in verdicts if t > t_unsafe and label == "safe")
    assert all(a == pose for t, a in robot.sent if first <= t < t_safe)
    assert any(a != pose for t, a in robot.sent if t > t_safe + 2 * dt)  # and the task resumes after it
    f = client.pipeline_figures()
    assert f["slo.safety.fallbacks"] >= 1 and f["slo.safety.missed"] == 0


def test_a_component_that_stops_answering_triggers_its_fallback(app_key):
    with Pipeline(app_key, synthetic={"progress": {"silent_after": 2}}) as p:
        robot = sim_robot()
        client = run(p.client(robot), 2.5)
        withheld = p.stats("progress")["answers_withheld"]
    f = client.pipeline_figures()
    assert f["slo.progress.answered"] == 2 and f["slo.progress.missed"] >= 2 and withheld >= 2
    assert f["slo.progress.fallbacks"] >= 2 and f["slo.progress.slo_violated"] == 1
    assert f["pipeline.override_steps"] > 10             # held: the monitor's on_slo_miss
    assert f["slo.safety.missed"] == 0 and f["slo.act.missed"] == 0
    # held: the last commands are the robot's measured positions, not System 1's actions
    last = [a for _, a in robot.sent[-10:]]
    assert all(a["gripper.pos"] not in {task_code(t) for t in ("start", "reach", "grasp", "lift", "place")}
               for a in last)


def test_a_violated_slo_is_counted(app_key):
    # System 1 takes 150 ms against a 100 ms deadline: every request misses; retry once, then hold.
    with Pipeline(app_key, synthetic={"act": {"latency_ms": 150}},
                  task_over={"act": {"slo": {"deadline_ms": 100}}}) as p:
        robot = sim_robot()
        client = run(p.client(robot), 2.0)
    f = client.pipeline_figures()
    assert f["slo.act.missed"] >= 3 and f["slo.act.met"] == 0 and f["slo.act.late"] >= 2
    assert f["slo.act.attainment"] == 0.0 and f["slo.act.slo_violated"] == 1
    assert f["slo.act.fallbacks"] >= 3 and f["pipeline.override_steps"] > 0


def test_a_component_server_answering_the_wrong_output_is_refused(app_key):
    # The safety route leads to a server answering text (a System 2 runner): refused at start-up.
    with Pipeline(app_key, synthetic={"safety": {"output": "text", "verdicts": []}}) as p:
        robot = sim_robot()
        client = p.client(robot)
        with pytest.raises(CompatibilityError, match="component 'safety' .*verdict.* answers text"):
            client.start()
        client.close()


def test_failed_retries_the_task_then_stops_and_done_ends_the_run(app_key):
    from lerobot_zenoh.client.config import PipelineConfig

    # The monitor says `failed` at its 2nd request of every episode: attempt 1 fails, the robot holds for
    # the reset, attempt 2 (a new episode: the server's script starts again) fails too, and the retry
    # budget (1) is spent: the run ends long before its 20 s.
    with Pipeline(app_key, synthetic={"progress": {"verdict_at": {2: "failed"}}},
                  task_over={"progress": {"on_danger": "hold"}},
                  retry={"max_retries": 1, "then": "stop_episode"}) as p:
        robot = sim_robot()
        client = p.client(robot, pipeline=PipelineConfig(reset_s=0.3))
        t0 = time.perf_counter()
        run(client, 20.0)
        elapsed = time.perf_counter() - t0
    assert elapsed < 8.0
    assert client.runtime.attempt == 2 and client.runtime.failures == 2 and client.episode == 1
    assert client.counters.reset_steps >= 5                  # the reset between the attempts
    # `done` ends the run as a success after one attempt
    with Pipeline(app_key, synthetic={"progress": {"verdict_at": {3: "done"}}}) as p:
        robot = sim_robot()
        client = p.client(robot)
        t0 = time.perf_counter()
        run(client, 20.0)
        assert time.perf_counter() - t0 < 6.0
    assert client.runtime.outcome.kind == "done" and client.runtime.attempt == 1 and client.runtime.failures == 0


def test_re_fetch_is_refused_at_start_up_for_a_multi_model_task(app_key):
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.scheduling.send_trigger import SendTriggerConfig

    with Pipeline(app_key) as p:
        with pytest.raises(ConfigError, match="send.refetch_after_s"):
            p.client(sim_robot(), send=SendTriggerConfig(refetch_after_s=0.1))
