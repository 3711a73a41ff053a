"""Serving the components of a multi-model task over real Zenoh (docs/pipelines.md): one observation
published once on the task's stream reaches System 1, System 2 and safety servers, each answers on its
own topic, and an observation whose component_mask does not ask a component is dropped unread."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from lerobot_zenoh.errors import ConfigError
from lerobot_zenoh.protocol import codec
from lerobot_zenoh.protocol.keys import AppKey, pipeline_app
from lerobot_zenoh.protocol.messages import Observation
from lerobot_zenoh.server.config.manifest import parse_manifest
from lerobot_zenoh.server.runners.synthetic import task_code
from lerobot_zenoh.server.shell.policy_server import PolicyServer
from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
from lerobot_zenoh.transport.settings import loopback_settings
from lz_testing import wait_for

CAMS = {"front": (16, 16)}
TASK = "kit"
ROBOT = "kit-r0"
SYNTH = {"state_dim": 6, "action_dim": 6, "chunk_size": 5, "cameras": CAMS, "latency_ms": 1}


def entry(app_key, model_id, *, bit, component, **synthetic):
    return {"model_id": model_id, "model_version": "v1", "application_tag": f"{component}-srv",
            "synthetic": {**SYNTH, **synthetic}, "fps": 30, "clients": [{"client_uuid": ROBOT}],
            "pipeline": [{"task": TASK, "component": component, "bit": bit}]}


def manifest(port, app_key, entries, **top):
    return {"cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "srv0",
            "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
            "server": entries, **top}


@contextlib.contextmanager
def one_server(port, m):
    """The server of manifest `m`, and a session of the robot's side that has heard its first entry's
    status: (server, session, that entry's app key)."""
    with PolicyServer(m) as server:
        session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
        try:
            app = m.app_key(m.server[0])
            assert wait_for(lambda: session.query(app.status, 0.3))
            yield server, session, app
        finally:
            session.close()


class PipelineRobot:
    """The wire side of a pipeline client: publishes each observation once on the task's stream (with
    its header as attachment) and collects whatever each component's server answers."""

    def __init__(self, session: ZenohSession, app_key: AppKey, apps: dict[str, AppKey], token: bool = True):
        stream = pipeline_app(app_key.cluster, app_key.experiment, TASK).client(ROBOT)
        self.session, self.stream, self.keyed = session, stream, {}
        self.pub = session.publisher(stream.obs, OBSERVATION_QOS)
        self.token = session.declare_token(stream.metrics) if token else None
        self.answers: dict[str, dict[int, object]] = {name: {} for name in apps}
        self.arrived = threading.Condition()
        decoders = {"action": codec.decode_action_chunk, "text": codec.decode_text_result,
                    "verdict": codec.decode_verdict}
        for name, app in apps.items():
            for topic, decode in decoders.items():
                session.subscribe(app.client(ROBOT).topic(topic),
                                  lambda key, payload, n=name, d=decode: self._on_answer(n, d(payload)))
        self.rng = np.random.default_rng(0)

    def _on_answer(self, name, message):
        with self.arrived:
            self.answers[name][message.response_to_seq_id] = message
            self.arrived.notify_all()

    def send(self, seq_id: int, mask: int | None, task: str = "", header: bool = True, keyed: bool = False) -> None:
        """`keyed`: on the key naming the components asked (`ClientKey.obs_for`, what the pipeline
        client does), else on the stream's plain observation key (the mask in the header only)."""
        images = {n: codec.encode_jpeg(self.rng.integers(0, 255, (*hw, 3), dtype=np.uint8), 90) for n, hw in CAMS.items()}
        obs = Observation(seq_id, ROBOT, np.zeros(6, np.float32), images, task, episode_id="e0", session_nonce=1,
                          component_mask=mask)
        pub = self.pub
        if keyed:
            key = self.stream.obs_for(mask)
            pub = self.keyed.get(key) or self.keyed.setdefault(key, self.session.publisher(key, OBSERVATION_QOS))
        pub.put(codec.encode(obs), codec.encode_observation_header(obs) if header else None)

    def wait(self, name: str, seq_id: int, timeout_s: float = 5.0):
        with self.arrived:
            self.arrived.wait_for(lambda: seq_id in self.answers[name], timeout=timeout_s)
            return self.answers[name].get(seq_id)

    def ask(self, name: str, seq_id: int, mask: int | None, task: str = "", timeout_s: float = 5.0):
        """Send (again while unanswered: best effort) until `name` answers `seq_id`."""
        deadline = threading.Event()
        timer = threading.Timer(timeout_s, deadline.set)
        timer.start()
        try:
            while not deadline.is_set():
                self.send(seq_id, mask, task)
                got = self.wait(name, seq_id, 0.3)
                if got is not None:
                    return got
            return None
        finally:
            timer.cancel()


@pytest.fixture
def served(port, app_key):
    """One server, three components of task `kit` (bits 0, 1, 2), and a robot on its stream."""
    entries = [
        entry(app_key, "s1", bit=0, component="act", echo_task=True),
        entry(app_key, "s2", bit=1, component="plan", output="text", subtasks=["reach", "grasp", "lift"]),
        entry(app_key, "guard", bit=2, component="safety", output="verdict", verdict_at={3: "unsafe"}, score=0.75,
              silent_after=4),
    ]
    m = parse_manifest(manifest(port, app_key, entries, telemetry_period_s=0))
    server = PolicyServer(m).start()
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    apps = {name: m.app_key(e) for name, e in zip(("s1", "s2", "guard"), m.server)}
    try:
        for app in apps.values():
            assert wait_for(lambda a=app: session.query(a.status, 0.3)), "status never answered"
        yield server, session, PipelineRobot(session, app_key, apps), apps
    finally:
        session.close()
        server.stop()


def stats(server, app):
    return server.stats()[app.prefix]


def test_each_component_answers_on_its_own_topic_and_advertises_it(served):
    server, session, robot, apps = served
    outputs = {name: codec.decode_status(session.query(app.status, 1.0)[0][1]).output for name, app in apps.items()}
    assert outputs == {"s1": "actions", "s2": "text", "guard": "verdict"}
    # System 2's script advances per request of the session; System 1's chunk carries the task it read.
    texts = [robot.ask("s2", seq, 0b010).text for seq in (1, 2, 3, 4)]
    assert texts == ["reach", "grasp", "lift", "reach"]
    chunk = robot.ask("s1", 5, 0b001, task=texts[1])
    assert chunk.actions.shape == (5, 6) and np.all(chunk.actions[:, -1] == np.float32(task_code("grasp")))
    verdicts = [robot.ask("guard", seq, 0b100) for seq in (6, 7, 8, 9)]
    assert [v.label for v in verdicts] == ["safe", "safe", "unsafe", "safe"]
    assert {v.score for v in verdicts} == {0.75} and verdicts[0].server_id == "srv0"
    # silent_after: 4 -> the fifth request of the session is served but never answered.
    robot.send(10, 0b100)
    assert wait_for(lambda: stats(server, apps["guard"])["answers_withheld"] == 1, 5.0)
    assert robot.wait("guard", 10, 0.3) is None
    assert stats(server, apps["guard"])["answers"] == {"verdict.safe": 3, "verdict.unsafe": 1}
    assert stats(server, apps["s2"])["answers"] == {"text": 4}


def test_one_observation_for_every_component_and_masked_ones_are_dropped_unread(served):
    server, session, robot, apps = served
    # No mask: every component answers the one observation (sent once: a resend would race the counts below).
    robot.send(1, None)
    for name in apps:
        assert robot.wait(name, 1, 5.0) is not None, name
    # Only System 2 asked, from the header: System 1 and safety drop it without taking it in.
    received = {n: stats(server, a)["clients"][robot_id()]["received"] for n, a in apps.items()}
    rejected = {n: sum(stats(server, a)["clients"][robot_id()]["rejected"].values()) for n, a in apps.items()}
    assert robot.ask("s2", 2, 0b010) is not None
    for name in ("s1", "guard"):
        assert wait_for(lambda a=apps[name]: stats(server, a)["observations_for_other_components"] >= 1, 5.0)
        figures = stats(server, apps[name])
        assert figures["clients"][robot_id()]["received"] == received[name]  # never in a slot: never decoded
        assert sum(figures["clients"][robot_id()]["rejected"].values()) == rejected[name]  # not an error either
        assert robot.wait(name, 2, 0.1) is None
    # Proof that it is not decoded: a body that cannot be decoded, under a header asking System 2 only,
    # is a rejection for System 2 (which decodes it) and nothing at all for the others.
    junk = Observation(50, ROBOT, np.zeros(6, np.float32), {}, "", episode_id="e0", session_nonce=1,
                       component_mask=0b010)
    others = {n: stats(server, apps[n])["observations_for_other_components"] for n in ("s1", "guard")}
    robot.pub.put(b"\xc1 not msgpack", codec.encode_observation_header(junk))
    assert wait_for(lambda: stats(server, apps["s2"])["clients"][ROBOT]["rejected"].get("bad_msgpack", 0) >= 1, 5.0)
    for name in ("s1", "guard"):
        assert wait_for(lambda n=name: stats(server, apps[n])["observations_for_other_components"] == others[n] + 1, 5.0)
        assert "bad_msgpack" not in stats(server, apps[name])["clients"][ROBOT]["rejected"]
    # Without a header the mask is read from the observation itself when it is served: still not answered.
    before = stats(server, apps["s1"])["observations_for_other_components"]
    robot.send(3, 0b010, header=False)
    assert wait_for(lambda: stats(server, apps["s1"])["observations_for_other_components"] > before, 5.0)
    assert robot.wait("s1", 3, 0.1) is None
    # Telemetry names the count.
    metrics, _ = server.telemetry_figures(server.models[0])
    assert metrics["observations_for_other_components"] >= 2 and metrics["answers.actions"] >= 1


def test_on_keys_naming_components_each_server_hears_only_what_asks_it(served):
    """Published as the pipeline client does (`.../obs/c<i>/...`), an observation reaches only the
    subscriptions of the components it asks: the others never see it (not even to drop it)."""
    server, _, robot, apps = served
    robot.send(1, 0b001, keyed=True)
    assert robot.wait("s1", 1, 5.0) is not None
    robot.send(2, 0b101, keyed=True)  # System 1 and safety
    assert robot.wait("s1", 2, 5.0) is not None and robot.wait("guard", 2, 5.0) is not None
    robot.send(3, 0b010, keyed=True)
    assert robot.wait("s2", 3, 5.0) is not None
    heard = {n: stats(server, a)["clients"].get(ROBOT, {}).get("received", 0) for n, a in apps.items()}
    assert heard == {"s1": 2, "s2": 1, "guard": 1}, heard
    assert all(stats(server, a)["observations_for_other_components"] == 0 for a in apps.values())


def robot_id():
    return ROBOT


def test_a_robot_whose_token_goes_on_the_task_stream_loses_its_session(port, app_key):
    entries = [entry(app_key, "s2", bit=1, component="plan", output="text")]
    m = parse_manifest(manifest(port, app_key, entries, telemetry_period_s=0,
                                sessions={"liveliness_grace_s": 0.2, "idle_timeout_s": 60}))
    with one_server(port, m) as (server, session, app):
        robot = PipelineRobot(session, app_key, {"s2": app})
        assert robot.ask("s2", 1, None).text == "subtask 0"
        robot.token.undeclare()
        assert wait_for(lambda: stats(server, app)["sessions_closed"].get("liveliness") == 1, 10.0)


def test_forged_ids_on_a_task_stream_leave_nothing_behind(port, app_key):
    """200 unlisted ids publishing on the task stream (no unknown clients accepted): each is dropped
    and counted, and the server keeps no per-id state for them (bounded by its sessions)."""
    entries = [entry(app_key, "s2", bit=1, component="plan", output="text")]
    m = parse_manifest(manifest(port, app_key, entries, telemetry_period_s=0))
    with one_server(port, m) as (server, session, app):
        stream = pipeline_app(app_key.cluster, app_key.experiment, TASK)
        pubs = [session.publisher(stream.client(f"forged-{i}").obs, OBSERVATION_QOS) for i in range(200)]
        dropped = lambda: server.models[0].session_table.dropped["unknown_client"]  # noqa: E731
        for seq in range(1, 11):  # best effort: under load a round may be lost in part; send it again
            for i, pub in enumerate(pubs):
                obs = Observation(seq, f"forged-{i}", np.zeros(6, np.float32), {}, "", session_nonce=1,
                                  component_mask=2)
                pub.put(codec.encode(obs), codec.encode_observation_header(obs))
            if wait_for(lambda: dropped() >= 150, 2.0):
                break
        assert dropped() >= 150, dropped()
        assert PipelineRobot(session, app_key, {"s2": app}).ask("s2", 1, None).text == "subtask 0"
        assert set(server.models[0].routing.component_of) == {ROBOT}


def test_a_robot_that_moves_to_another_task_is_served_as_that_task(port, app_key):
    """One safety model serves two tasks with different label sets. A robot heard first on task
    `kit` and then on `kit2` (and then on the model's own app) is answered with each task's labels:
    what a request is served as comes with its observation, not from the robot's first task."""
    guard = entry(app_key, "guard", bit=0, component="safety", output="verdict")
    guard["pipeline"] = [{"task": TASK, "component": "safety", "bit": 0, "labels": ["unsafe", "safe"]},
                         {"task": "kit2", "component": "safety", "bit": 0, "labels": ["done", "failed", "ongoing"]}]
    m = parse_manifest(manifest(port, app_key, [guard], telemetry_period_s=0))
    with one_server(port, m) as (server, session, app):
        robot = PipelineRobot(session, app_key, {"guard": app})
        assert robot.ask("guard", 1, 0b1).label == "unsafe"
        stream = pipeline_app(app_key.cluster, app_key.experiment, "kit2").client(ROBOT)
        robot.pub = session.publisher(stream.obs, OBSERVATION_QOS)  # the same robot, now on kit2
        assert robot.ask("guard", 2, 0b1).label == "done"
        assert server.models[0].routing.component_of[ROBOT] == "kit2"
        robot.pub = session.publisher(app.client(ROBOT).obs, OBSERVATION_QOS)  # and on the model's own app
        assert robot.ask("guard", 3, None).label == "safe"


@pytest.mark.parametrize("change, field, words", [
    ({"pipeline": [{"task": TASK, "component": "plan", "bit": 32}]}, "server.0.pipeline.0.bit", "less than 32"),
    ({"pipeline": [{"task": TASK, "component": "plan", "bit": 1, "labels": ["maybe"]}]},
     "server.0.pipeline.0.labels", "'maybe' is not a verdict label"),
    ({"pipeline": [{"task": TASK, "component": "a", "bit": 0}, {"task": TASK, "component": "b", "bit": 1}]},
     "server.0", "task 'kit' is listed twice"),
    ({"pipeline": {"task": "bad/task", "component": "plan", "bit": 1}}, "server.0.pipeline.0.task", "reserves"),
    ({"synthetic": {**SYNTH, "output": "verdict", "subtasks": ["x"]}}, "server.0.synthetic.subtasks",
     "does not apply to output 'verdict'"),
    ({"synthetic": {**SYNTH, "output": "verdict", "verdict_at": {0: "unsafe"}}}, "server.0.synthetic.verdict_at",
     "request numbers start at 1"),
    ({"synthetic": {**SYNTH, "output": "verdict", "verdicts": ["safe", "oops"]}}, "server.0.synthetic.verdicts",
     "'oops' is not a verdict label"),
    ({"synthetic": {**SYNTH, "output": "words"}}, "server.0.synthetic.output", "'actions', 'text' or 'verdict'"),
    ({"synthetic": {**SYNTH, "echo_task": True, "output": "text"}}, "server.0.synthetic.echo_task", "does not apply"),
    ({"synthetic": {**SYNTH, "silent_after": -1}}, "server.0.synthetic.silent_after", "greater than or equal to 0"),
])
def test_bad_component_settings_fail_at_start_up_naming_the_field(app_key, change, field, words):
    base = entry(app_key, "s2", bit=1, component="plan")
    with pytest.raises(ConfigError) as info:
        parse_manifest(manifest(7447, app_key, [{**base, **change}]))
    message = str(info.value)
    assert f"{field}:" in message and words in message and "\n" not in message, message


def test_a_single_pipeline_mapping_is_a_list_of_one(app_key):
    m = parse_manifest(manifest(7447, app_key, [{**entry(app_key, "s2", bit=1, component="plan"),
                                                 "pipeline": {"task": TASK, "component": "plan", "bit": 1}}]))
    (item,) = m.server[0].pipeline
    assert (item.task, item.component, item.bit) == (TASK, "plan", 1)
    assert m.pipeline_key(item).all_observations == f"{app_key.cluster}/{app_key.experiment}/_pipeline/1/kit/*/obs"


# -- the tiny VLM component (transformers, CPU) -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from lerobot_zenoh.cli.build_checkpoint import main

    folder = tmp_path_factory.mktemp("vlm") / "smolvlm"
    assert main([f"--output={folder}", "--policy_type=smolvlm"]) == 0  # what `make checkpoint POLICY=smolvlm` runs
    return folder


def vlm_entry(folder, **vlm):
    return {"model_id": "vlm", "model_version": "v1", "application_tag": "comp", "pretrained_path": str(folder),
            "vlm": {"state_dim": 6, "cameras": {"front": [48, 64], "wrist": [48, 64]}, **vlm},
            "fps": 30, "accept_unknown_clients": True}


def test_the_tiny_vlm_generates_text_and_picks_a_verdict_with_a_score(tiny_vlm, app_key):
    from lerobot_zenoh.server.config.runner_loading import load_runner
    from lerobot_zenoh.server.runners.base import COMPONENT_EXTRA, ComponentQuery, InferenceRequest

    m = parse_manifest(manifest(7447, app_key, [
        vlm_entry(tiny_vlm, output="text", prompt="next subtask?", max_new_tokens=6),
        {**vlm_entry(tiny_vlm, output="verdict", labels=["safe", "unsafe"]), "model_id": "guard"}]))
    text_runner, verdict_runner = (load_runner(m, e) for e in m.server)
    assert (text_runner.spec.capabilities.output, verdict_runner.spec.capabilities.output) == ("text", "verdict")
    rng = np.random.default_rng(0)
    images = {c: rng.integers(0, 255, (48, 64, 3), dtype=np.uint8) for c in ("front", "wrist")}
    request = InferenceRequest("r", np.zeros(6, np.float32), images, "", 0)
    (text,) = text_runner.run([request])
    assert isinstance(text.text, str) and text.text == text_runner.run([request])[0].text  # greedy: pure
    ids = text_runner.processor.tokenizer(text.text, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 6 + 2  # at most max_new_tokens (decoding and re-encoding may re-split a few bytes)
    (verdict,) = verdict_runner.run([request])
    assert verdict.label in ("safe", "unsafe") and 0.5 <= verdict.score <= 1.0
    # The component's labels (its task descriptor's) replace the configured ones; one label is certain.
    asked = InferenceRequest("r", request.state, images, "", 0, extras={
        COMPONENT_EXTRA: ComponentQuery("kit", "progress", "ongoing, done or failed?", ("ongoing", "done", "failed"))})
    assert verdict_runner.run([asked])[0].label in ("ongoing", "done", "failed")
    only = InferenceRequest("r", request.state, images, "", 0, extras={
        COMPONENT_EXTRA: ComponentQuery("kit", "safety", "", ("unsafe",))})
    assert verdict_runner.run([only])[0].label == "unsafe" and verdict_runner.run([only])[0].score == pytest.approx(1.0)


@pytest.mark.parametrize("vlm, field, words", [
    ({"output": "verdict"}, "server.0", "vlm.labels: a verdict VLM needs labels"),
    ({"output": "text", "labels": ["safe"]}, "server.0.vlm", "labels apply to output 'verdict' only"),
    ({"output": "verdict", "labels": ["maybe"]}, "server.0.vlm.labels", "'maybe' is not a verdict label"),
    ({"output": "actions"}, "server.0.vlm.output", "'text' or 'verdict'"),
    ({"output": "text", "max_new_tokens": 0}, "server.0.vlm.max_new_tokens", "greater than or equal to 1"),
])
def test_bad_vlm_settings_fail_at_start_up_naming_the_field(app_key, vlm, field, words):
    with pytest.raises(ConfigError) as info:
        parse_manifest(manifest(7447, app_key, [vlm_entry("somewhere", **vlm)]))
    message = str(info.value)
    assert f"{field}:" in message and words in message and "\n" not in message, message


def test_a_vlm_folder_without_weights_is_refused_naming_it(tiny_vlm, app_key, tmp_path):
    import shutil

    from lerobot_zenoh.errors import PolicyError
    from lerobot_zenoh.server.config.runner_loading import load_runner

    broken = tmp_path / "noweights"
    shutil.copytree(tiny_vlm, broken)
    (broken / "model.safetensors").unlink()
    m = parse_manifest(manifest(7447, app_key, [vlm_entry(broken, output="text")]))
    with pytest.raises(PolicyError, match="noweights"):
        load_runner(m, m.server[0])


def test_a_vlm_verdict_server_answers_the_task_stream(tiny_vlm, port, app_key):
    e = {**vlm_entry(tiny_vlm, output="verdict"), "vlm": {"output": "verdict", "state_dim": 6, "cameras": CAMS},
         "accept_unknown_clients": False, "clients": [{"client_uuid": ROBOT}],
         "pipeline": [{"task": TASK, "component": "safety", "bit": 2, "prompt": "is it safe?",
                       "labels": ["safe", "unsafe"]}]}
    m = parse_manifest(manifest(port, app_key, [e], telemetry_period_s=0))
    with one_server(port, m) as (server, session, app):
        assert codec.decode_status(session.query(app.status, 1.0)[0][1]).output == "verdict"
        robot = PipelineRobot(session, app_key, {"guard": app})
        verdict = robot.ask("guard", 1, 0b100, timeout_s=20.0)
        assert verdict.label in ("safe", "unsafe") and 0.5 <= verdict.score <= 1.0
        assert verdict.inference_time_ms > 0 and stats(server, app)["answers"] == {f"verdict.{verdict.label}": 1}


def test_answer_counts_are_one_prometheus_family_labelled_by_output_and_label():
    from lerobot_zenoh.telemetry.prometheus import describe

    d = describe("server", "answers.verdict.unsafe")
    assert (d.name, d.kind) == ("lerobot_zenoh_server_answers", "counter")
    assert dict(d.labels) == {"output": "verdict", "label": "unsafe"}
    assert dict(describe("server", "answers.text").labels) == {"output": "text"}
    assert describe("server", "observations_for_other_components").kind == "counter"


def test_the_example_manifest_serves_four_components_of_one_task():
    from pathlib import Path

    from lerobot_zenoh.server.config.manifest import load_manifest

    m = load_manifest(Path(__file__).resolve().parent.parent / "manifests" / "pipeline.yaml")
    assert [(e.pipeline[0].component, e.pipeline[0].bit, e.synthetic.output) for e in m.server] == [
        ("act", 0, "actions"), ("plan", 1, "text"), ("safety", 2, "verdict"), ("progress", 3, "verdict")]
    assert {m.pipeline_key(e.pipeline[0]).prefix for e in m.server} == {"local/dryrun/_pipeline/1/assemble_kit"}
