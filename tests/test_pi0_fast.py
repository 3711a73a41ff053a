"""pi0-FAST: a tiny checkpoint built offline and served through LeRobot's from_pretrained with no
code from the checkpoint run; iteration-level batching whose every chunk equals the request decoded
alone (bit for bit); the decode limit, undecodable tokens, a bad action tokenizer and RTC refused
with their reasons; bounded KV slots (docs/policies.md, "pi0-FAST")."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import PolicyError, ProtocolError  # noqa: E402
from lerobot_zenoh.server.runners import InferenceRequest, LoadOptions, RtcSettings, load_policy_runner  # noqa: E402

pytestmark = pytest.mark.slow

STATE_NAMES = ("shoulder", "elbow", "wrist_flex", "gripper")
CAMERAS = {"front": (48, 64)}
CHUNK = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("pi0_fast") / "tiny", policy_type="pi0_fast",
                            state_names=STATE_NAMES, action_names=STATE_NAMES, cameras=CAMERAS, chunk_size=CHUNK,
                            fps=30, overrides={"max_decoding_steps": 64}, stats={"action": {"mean": [1.0, -2.0, 0.5, 3.0], "std": [2.0, 0.5, 1.0, 4.0]}})


@pytest.fixture(scope="module")
def runner(checkpoint):
    return load_policy_runner(checkpoint)


def request(session: str, rng_seed: int, task: str = "pick up the red cube") -> InferenceRequest:
    rng = np.random.default_rng(rng_seed)
    state = rng.normal(0, 0.5, len(STATE_NAMES)).astype(np.float32)
    images = {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam, (h, w) in CAMERAS.items()}
    return InferenceRequest(session, state, images, task, 0)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("model.safetensors"))
    os.symlink(src / "model.safetensors", dst / "model.safetensors")
    return dst


def decoder(runner, **kw):
    from lerobot_zenoh.server.runners.decode_batch import BatchDecoder

    kw.setdefault("n_slots", 8)
    kw.setdefault("max_new_tokens", runner.max_new_tokens)
    return BatchDecoder(runner.policy.model, end_token=runner._end, max_prefix_len=runner.prefix_len(), **kw)


def alone(runner, req, *, with_reason: bool = False):
    (res,) = decoder(runner, n_slots=1).run_all([runner.prefix(req, 0)])
    return (res.tokens, res.reason) if with_reason else res.tokens


def test_tiny_pi0_fast_serves_chunks_and_runs_no_code_from_the_checkpoint(checkpoint, tmp_path):
    # A FAST folder as the hub ships it: a Python module that AutoProcessor(trust_remote_code=True)
    # would import. Loading must decode the format with the project's code and never import it.
    copy = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    marker = tmp_path / "code_ran"
    fast = copy / "fast_tokenizer"
    (fast / "processing_action_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nclass UniversalActionProcessor: pass\n")
    proc = json.loads((fast / "processor_config.json").read_text())
    proc.update(processor_class="UniversalActionProcessor",
                auto_map={"AutoProcessor": "processing_action_tokenizer.UniversalActionProcessor"})
    (fast / "processor_config.json").write_text(json.dumps(proc))
    config = json.loads((copy / "config.json").read_text())
    config["action_tokenizer_name"] = str(fast)
    config["text_tokenizer_name"] = str(copy / "tokenizer")
    (copy / "config.json").write_text(json.dumps(config))

    runner = load_policy_runner(copy)
    assert runner.spec.policy_type == "pi0_fast" and runner.spec.chunk_size == CHUNK
    assert runner.spec.capabilities.reads_task and not runner.spec.capabilities.rtc
    results = runner.run([request("a", 1), request("b", 2)])
    for res in results:
        assert not isinstance(res, Exception), res
        assert res.actions.shape == (CHUNK, len(STATE_NAMES)) and res.actions.dtype == np.float32
        assert res.extras["action_tokens"] > 0
    assert not marker.exists(), "code shipped in the checkpoint ran"
    # LeRobot's own names are untouched: the policy's config still names the FAST folder.
    assert runner.policy.config.action_tokenizer_name == str(fast)


def test_the_decode_equals_lerobots_own_and_the_chunk_lerobots_detokenization(runner):
    import torch
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    req = request("a", 3)
    ours = alone(runner, req)
    batch = runner._preprocess(req.state, req.images, req.task)
    images, masks = runner.policy._preprocess_images(batch)
    with torch.no_grad():
        theirs = runner.policy.model.sample_actions_fast_kv_cache(
            images, masks, batch[OBS_LANGUAGE_TOKENS], batch[OBS_LANGUAGE_ATTENTION_MASK],
            max_decoding_steps=runner.max_new_tokens)[0].tolist()
    assert theirs[: len(ours) + 1] == [*ours, runner._end]
    # LeRobot's detokenize_actions (through the adapter over the same FAST data) gives the same chunk.
    lerobot_chunk = runner.policy.detokenize_actions(torch.tensor(theirs), CHUNK, len(STATE_NAMES)).numpy()
    np.testing.assert_allclose(runner.decode_tokens(ours).chunk, lerobot_chunk, rtol=0, atol=1e-5)


@pytest.mark.parametrize("join", ["separate", "packed"])
def test_each_robots_tokens_equal_decoding_it_alone_bit_for_bit(runner, join):
    reqs = [request(f"r{i}", 10 + i) for i in range(6)]
    reference = [alone(runner, r, with_reason=True) for r in reqs]
    assert len({len(t) for t, _ in reference}) > 1, "the probe requests should end at different steps"
    eng = decoder(runner, join=join)
    # Two start together; the others join one at a time at later token boundaries.
    for i in (0, 1):
        eng.submit(runner.prefix(reqs[i], i))
    done = {}
    steps = 0
    while eng.busy or len(done) < len(reqs):
        if 2 <= steps < 2 + 4 * 3 and steps % 3 == 2:
            i = 2 + (steps - 2) // 3
            eng.submit(runner.prefix(reqs[i], i))
        for res in eng.step():
            done[res.key] = res
        steps += 1
    for i, (tokens, reason) in enumerate(reference):
        assert done[i].tokens == tokens, f"request {i} differs from decoding it alone"
        assert done[i].reason == reason
    if join == "packed":
        assert eng.times.packed > 0


def test_the_runner_batch_equals_one_at_a_time_bit_for_bit(runner):
    reqs = [request(f"s{i}", 20 + i, task=t) for i, t in enumerate(["pick the cube", "open the drawer",
                                                                    "fold the towel", "push the block"])]
    together = runner.run(reqs)
    for req, res in zip(reqs, together, strict=True):
        (single,) = runner.run([req])
        assert np.array_equal(res.actions, single.actions)


def test_finished_requests_leave_at_once_and_free_their_slot(runner):
    reqs = [request(f"r{i}", 10 + i) for i in range(6)]
    reference = [alone(runner, r, with_reason=True) for r in reqs]
    # The step a request is answered: its end token comes one step after its last token (the first
    # token comes with the prefill); at the limit, with its last token.
    steps = [len(t) + (reason == "end") for t, reason in reference]
    short, long_ = int(np.argmin(steps)), int(np.argmax(steps))
    eng = decoder(runner, n_slots=2)
    eng.submit(runner.prefix(reqs[short], "short"))
    eng.submit(runner.prefix(reqs[long_], "long"))
    finished_at = {}
    step = 0
    while eng.busy:
        step += 1
        for res in eng.step():
            finished_at[res.key] = step
            if res.key == "short":
                assert eng.kv.free == 1 and eng.running == 1
    assert finished_at == {"short": steps[short], "long": steps[long_]}


def test_a_decode_without_the_end_token_stops_at_the_limit_with_a_counted_reason(runner):
    limit, runner.max_new_tokens, runner._decoder = runner.max_new_tokens, 3, None  # config's max_decoding_steps
    try:
        before = runner.refusals.get("decode_limit", 0)
        (result,) = runner.run([request("a", 1)])
        assert isinstance(result, ProtocolError) and result.reason == "decode_limit"
        assert runner.refusals["decode_limit"] == before + 1
        assert runner.decoder().stats()["finished_limit"] == 1
        # ... and the runner's telemetry figures carry the KV slots and the batch decoder's counters
        figures = runner.figures()
        assert figures["decode.finished_limit"] == 1 and figures["decode.kv_allocations"] >= 1
        assert figures["decode.decode_rows"] >= figures["decode.decode_steps"] >= 2
        assert figures["decode.slots"] == runner.slots and figures["decode.kv_bytes"] > 0
    finally:
        runner.max_new_tokens, runner._decoder = limit, None


def test_a_task_that_would_be_cut_is_refused(runner):
    runner.check_request(request("a", 1))
    with pytest.raises(ProtocolError) as info:
        runner.check_request(request("a", 1, task=" ".join(["open the drawer"] * 30)))
    assert info.value.reason == "task_too_long"


def test_tokens_that_are_not_fast_tokens_make_no_chunk(runner):
    assert runner.decode_tokens([]).reason == "undecodable_action_tokens"
    bad = runner.decode_tokens([5, 6, 7])  # ordinary text ids
    assert bad.chunk is None and bad.reason == "undecodable_action_tokens" and "not FAST tokens" in bad.detail
    prefix_only = runner.decode_tokens(runner._prefix_ids)
    assert prefix_only.chunk is None


def test_an_action_tokenizer_that_does_not_decode_is_refused_naming_the_field(checkpoint, tmp_path):
    # Fitted on another horizon.
    copy = copy_checkpoint(checkpoint, tmp_path / "horizon")
    proc = json.loads((copy / "fast_tokenizer" / "processor_config.json").read_text())
    proc["time_horizon"] = CHUNK + 5
    (copy / "fast_tokenizer" / "processor_config.json").write_text(json.dumps(proc))
    with pytest.raises(PolicyError, match="action_tokenizer_name.*fitted on chunks of 15 steps"):
        load_policy_runner(copy)
    # A vocabulary that is not FAST's (the text tokenizer's, far larger than the FAST id range).
    copy = copy_checkpoint(checkpoint, tmp_path / "vocab")
    shutil.copy(checkpoint / "tokenizer" / "tokenizer.json", copy / "fast_tokenizer" / "tokenizer.json")
    with pytest.raises(PolicyError, match="action_tokenizer_name"):
        load_policy_runner(copy)
    # Not the FAST format's byte-level BPE.
    copy = copy_checkpoint(checkpoint, tmp_path / "decoder")
    tok = json.loads((copy / "fast_tokenizer" / "tokenizer.json").read_text())
    tok["decoder"] = None
    (copy / "fast_tokenizer" / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(PolicyError, match="action_tokenizer_name.*byte-level"):
        load_policy_runner(copy)


def test_a_text_tokenizer_that_declares_code_is_refused(checkpoint, tmp_path):
    copy = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    cfg = json.loads((copy / "tokenizer" / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (copy / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(PolicyError, match="auto_map"):
        load_policy_runner(copy)


def test_rtc_is_refused_at_start_up(checkpoint):
    with pytest.raises(PolicyError, match="rtc.enabled"):
        load_policy_runner(checkpoint, options=LoadOptions(rtc=RtcSettings(enabled=True), field_prefix="server[m]."))


def test_kv_slots_bound_the_batch_and_evictions_are_counted(runner):
    eng = decoder(runner, n_slots=2)
    for i in range(3):
        eng.submit(runner.prefix(request(f"r{i}", 30 + i), f"r{i}"))
    eng.step()
    assert eng.running == 2 and eng.waiting == 1 and eng.kv.free == 0
    assert eng.cancel("r0")  # its session went away mid-decode
    assert eng.kv.evictions == 1 and eng.kv.free == 1
    eng.step()
    assert eng.running == 2 and eng.waiting == 0
    with pytest.raises(PolicyError, match="already being decoded"):
        eng.submit(runner.prefix(request("r1", 31), "r1"))


def test_the_scheduler_decides_who_joins_when_the_batch_is_full(runner):
    class Last:
        picks = []

        def on_arrival(self, key, now_s, execution=None):
            pass

        def pick(self, ready, now_s, max_batch=1):
            self.picks.append(list(ready))
            return list(ready)[-max_batch:]

        def on_served(self, keys, now_s, duration_s):
            pass

        def forget(self, key):
            pass

    sched = Last()
    eng = decoder(runner, n_slots=1, scheduler=sched)
    for i in range(3):
        eng.submit(runner.prefix(request(f"r{i}", 40 + i), f"r{i}"))
    order = []
    while eng.busy:
        order += [r.key for r in eng.step()]
    assert order == ["r2", "r1", "r0"] and sched.picks[0] == ["r0", "r1", "r2"]


class Robot:
    """The wire side of a client: one observation at a time, waiting for its chunk."""

    def __init__(self, session, app_key, client_id: str):
        import threading

        from lerobot_zenoh.protocol import codec
        from lerobot_zenoh.transport.session import OBSERVATION_QOS

        self.codec = codec
        self.key = app_key.client(client_id)
        self.client_id = client_id
        self.chunks: dict[int, object] = {}
        self.arrived = threading.Condition()
        session.subscribe(self.key.action, self._on_chunk)
        self.pub = session.publisher(self.key.obs, OBSERVATION_QOS)
        self.rng = np.random.default_rng(sum(map(ord, client_id)))

    def _on_chunk(self, key, payload):
        chunk = self.codec.decode_action_chunk(payload)
        with self.arrived:
            self.chunks[chunk.response_to_seq_id] = chunk
            self.arrived.notify_all()

    def send(self, seq_id: int) -> None:
        from lerobot_zenoh.protocol.messages import Observation

        state = self.rng.normal(0, 0.5, len(STATE_NAMES)).astype(np.float32)
        images = {cam: self.codec.encode_jpeg(self.rng.integers(0, 255, (h, w, 3), dtype=np.uint8), 90)
                  for cam, (h, w) in CAMERAS.items()}
        self.pub.put(self.codec.encode(Observation(seq_id, self.client_id, state, images, "pick up the cube",
                                                   episode_id="0", session_nonce=1)))

    def wait(self, seq_id: int, timeout_s: float):
        with self.arrived:
            self.arrived.wait_for(lambda: seq_id in self.chunks, timeout=timeout_s)
            return self.chunks.get(seq_id)


def test_the_server_streams_chunks_to_robots_joining_a_running_decode(checkpoint, port, app_key):
    from lz_testing import wait_for

    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings

    manifest = parse_manifest({
        "cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment, "server_id": "gpu0",
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{
            "model_id": app_key.model, "model_version": app_key.version, "application_tag": app_key.app,
            "pretrained_path": str(checkpoint), "fps": 30, "max_batch_size": 4,
            "clients": [{"client_uuid": c} for c in ("a", "b", "c")],
            "decode": {"slots": 2},  # three robots, two KV slots: one waits for a free slot
        }],
    })
    server = PolicyServer(manifest).start()
    assert server.models[0].runner.slots == 2
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    try:
        assert wait_for(lambda: session.query(app_key.status, 0.3), 60), "status never answered"
        robots = [Robot(session, app_key, c) for c in ("a", "b", "c")]
        for r in robots:
            r.send(1)
        for r in robots:  # (observations are best effort: one lost on a busy machine is sent again)
            chunk = r.wait(1, 10)
            deadline = time.monotonic() + 120
            while chunk is None and time.monotonic() < deadline:
                r.send(1)
                chunk = r.wait(1, 10)
            assert chunk is not None, f"{r.client_id} got no chunk"
            assert chunk.actions.shape == (CHUNK, len(STATE_NAMES)) and chunk.actions.dtype == np.float32
        # A decode that reaches the limit is a counted rejection; the others are still served.
        model = server.models[0]
        limit, model.runner.max_new_tokens, model.runner._decoder = model.runner.max_new_tokens, 2, None
        robots[0].send(2)
        assert wait_for(lambda: server.stats()[app_key.prefix]["clients"]["a"]["rejected"].get("decode_limit"), 60)
        model.runner.max_new_tokens, model.runner._decoder = limit, None
        robots[1].send(2)
        assert robots[1].wait(2, 120) is not None
    finally:
        session.close()
        server.stop()


@pytest.mark.parametrize(("field", "value"), [("use_relative_actions", True), ("temperature", 0.7)])
def test_settings_that_would_mix_robots_or_sample_are_refused(checkpoint, tmp_path, field, value):
    copy = copy_checkpoint(checkpoint, tmp_path / "ckpt")
    config = json.loads((copy / "config.json").read_text())
    config[field] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(PolicyError, match=field):
        load_policy_runner(copy)


def test_the_decode_block_sets_slots_and_join_and_fails_at_start_up_naming_the_field(checkpoint):
    from lerobot_zenoh.errors import ConfigError
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.config.runner_loading import load_runner

    def manifest(**entry):
        return parse_manifest({"cluster_uuid": "c", "experiment_tag": "e", "server": [{
            "model_id": "m", "model_version": "v1", "application_tag": "a", "fps": 30,
            "clients": [{"client_uuid": "r"}], **entry}]})

    m = manifest(pretrained_path=str(checkpoint), decode={"slots": 3, "join": "packed"})
    runner = load_runner(m, m.server[0])
    assert (runner.slots, runner.join_mode) == (3, "packed")
    runner.run([request("a", 1)])
    assert runner.figures()["decode.slots"] == 3
    for decode, field in (({"slots": 0}, "server.0.decode.slots"), ({"join": "zip"}, "server.0.decode.join"),
                          ({"slot": 4}, "server.0.decode.slot")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            manifest(pretrained_path=str(checkpoint), decode=decode)
    with pytest.raises(ConfigError, match="decode needs pretrained_path"):
        manifest(synthetic={"state_dim": 2, "action_dim": 2}, decode={"slots": 2})
