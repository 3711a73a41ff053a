"""pi0.5 serving actions and language from one prefill (server/runners/pi05_language.py): actions bit
for bit LeRobot's with or without text, tokens equal to a fresh prefill's and to one-at-a-time
decoding, cross-frame batching, the decode budget, stop tokens and limits, refusals, eviction, and the
builder's presets (docs/policies.md, "pi0.5: actions and language from one prefill")."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lerobot_zenoh.errors import ConfigError, PolicyError, ProtocolError
from lerobot_zenoh.server.runners.base import (
    COMPONENT_EXTRA,
    ComponentQuery,
    InferenceRequest,
)
from lerobot_zenoh.server.runners.pi05_language import (
    LANGUAGE_EXTRA,
    DecodeBudget,
    LanguageQuery,
    LanguageSettings,
)

pytestmark = pytest.mark.slow

STATE = ("a", "b", "c", "d")
CAMERAS = {"front": (48, 64), "wrist": (48, 64)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("pi05") / "tiny", policy_type="pi05", state_names=STATE,
                            action_names=STATE, cameras=CAMERAS, chunk_size=10, fps=30,
                            overrides={"num_inference_steps": 3})


def _load(path, settings=None):
    from lerobot_zenoh.server.runners.lerobot import LoadOptions, read_config
    from lerobot_zenoh.server.runners.pi05_language import Pi05LanguageRunner

    runner = Pi05LanguageRunner.from_checkpoint(path, read_config(path), LoadOptions())
    if settings is not None:
        runner.configure_language(settings)
    return runner


@pytest.fixture(scope="module")
def runner(checkpoint):
    return _load(checkpoint)


def _request(i: int, *, text: bool = True, task: str = "pick up the red cube", **query) -> InferenceRequest:
    rng = np.random.default_rng(i)
    state = rng.standard_normal(len(STATE)).astype(np.float32)
    images = {c: rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for c, (h, w) in CAMERAS.items()}
    extras = {LANGUAGE_EXTRA: LanguageQuery(tag=i, **query)} if text else {}
    return InferenceRequest(f"robot{i}", state, images, task, seed=100 + i, extras=extras)


def _finish(runner, max_frames: int = 100) -> dict[str, str]:
    """Advance until no generation is left; the final text of each session."""
    final = {}
    for _ in range(max_frames):
        if not runner.language_active:
            return final
        final |= {u.session_id: u.text for u in runner.advance() if u.final}
    raise AssertionError("generations did not finish")


def _fresh_prefill_tokens(runner, request: InferenceRequest, n: int) -> list[int]:
    """Greedy tokens without any cache: every step re-encodes prefix + prompt + tokens so far with
    LeRobot's own embedding and masks (prefix bidirectional, the rest causal)."""
    import torch
    from lerobot.policies.common.vla_utils import (
        make_att_2d_masks,
        prepare_attention_masks_4d,
    )
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    policy = runner.policy
    with torch.no_grad():
        batch = runner.preprocessor(runner._stack([request]))
        images, img_masks = policy._preprocess_images(batch)
        prefix, pad, att = policy.model.embed_prefix(images, img_masks, batch[OBS_LANGUAGE_TOKENS],
                                                     batch[OBS_LANGUAGE_ATTENTION_MASK])
        seq = list(runner._tokenizer(runner.settings.prompt, add_special_tokens=False)["input_ids"])
        out: list[int] = []
        for _ in range(n):
            ids = torch.tensor([seq + out])
            embs = torch.cat([prefix, policy.model.paligemma_with_expert.embed_language_tokens(ids)], dim=1)
            pads = torch.cat([pad, torch.ones_like(ids, dtype=torch.bool)], dim=1)
            atts = torch.cat([att, torch.ones_like(ids, dtype=torch.bool)], dim=1)
            mask = prepare_attention_masks_4d(make_att_2d_masks(pads, atts))
            lm = policy.model.paligemma_with_expert.paligemma.model.language_model
            hidden = lm.forward(inputs_embeds=embs, attention_mask=mask, position_ids=torch.cumsum(pads, 1) - 1,
                                use_cache=False).last_hidden_state
            logits = runner.lm_head(hidden[:, -1])
            out.append(int(logits[0, : runner.vocab].argmax()))
    return out


def test_actions_bit_identical_with_and_without_language(checkpoint, runner):
    from lerobot_zenoh.server.runners import load_policy_runner

    plain = load_policy_runner(checkpoint)
    requests = [_request(i, text=i != 1) for i in range(3)]
    with_text = runner.run(requests)
    assert runner.language_active == 2
    without = plain.run([_request(i, text=False) for i in range(3)])
    for a, b in zip(with_text, without, strict=True):
        assert np.array_equal(a.actions, b.actions)
    _finish(runner)
    # Nothing of LeRobot stays changed: the cache hook lives for the call only.
    assert not runner._language_model.layers[0]._forward_pre_hooks
    # And the language runner without text asked: the same again.
    again = runner.run([_request(i, text=False) for i in range(3)])
    for a, b in zip(again, without, strict=True):
        assert np.array_equal(a.actions, b.actions)


def test_tokens_equal_a_fresh_prefill_and_one_at_a_time(runner):
    settings = LanguageSettings(max_new_tokens=6, tokens_per_frame=2)
    runner.configure_language(settings)
    requests = [_request(i) for i in range(3)]
    alone = {}
    for r in requests:
        runner.run([r])
        alone |= _finish(runner)
    runner.run(requests)
    together = _finish(runner)
    assert together == alone
    # Cross-frame: robots joining at different frames decode in one batch with the running ones.
    runner.run(requests[:1])
    runner.advance()
    runner.run(requests[1:2])
    runner.advance()
    runner.run(requests[2:])
    assert _finish(runner) == alone
    # The shared prefix cache (after the action's denoising) gives a fresh prefill's tokens.
    runner.run(requests[:1])
    gen = []
    while runner.language_active:
        for u in runner.advance():
            gen = u
    expected = _fresh_prefill_tokens(runner, requests[0], 6)
    assert runner._tokenizer.decode(expected, skip_special_tokens=True).strip() == gen.text
    runner.configure_language(LanguageSettings())


def test_budget_partial_text_then_final(runner):
    runner.configure_language(LanguageSettings(max_new_tokens=7, tokens_per_frame=3))
    runner.run([_request(0)])
    seen = []
    while runner.language_active:
        updates = runner.advance()
        assert len(updates) == 1
        seen.append(updates[0])
    # 1 token from the prompt pass + 3 per frame: 4, 7 (the limit).
    assert [u.tokens for u in seen] == [4, 7]
    assert [u.final for u in seen] == [False, True] and seen[-1].reason == "limit"
    assert seen[-1].text.startswith(seen[0].text[:1]) and seen[-1].tag == 0
    # A per-request limit below the setting.
    runner.run([_request(1, max_new_tokens=2)])
    (u,) = runner.advance()
    assert u.final and u.tokens == 2
    runner.configure_language(LanguageSettings())



def test_text_yields_to_waiting_actions_after_its_floor(runner):
    """While an observation waits for its actions, a frame of text stops after min_tokens_per_frame
    steps; the text goes on in later frames, to the same tokens."""
    runner.configure_language(LanguageSettings(max_new_tokens=7, tokens_per_frame=3, min_tokens_per_frame=1))
    try:
        runner.yield_to_actions(lambda: True)
        runner.run([_request(0)])
        (u,) = runner.advance()
        assert u.tokens == 2 and not u.final  # the prompt pass's token + the floor's one step
        shrunk = runner.counters["budget_shrunk"]
        runner.yield_to_actions(lambda: False)
        seen = [u]
        while runner.language_active:
            seen += runner.advance()
        assert [x.tokens for x in seen] == [2, 5, 7] and seen[-1].final and runner.counters["budget_shrunk"] == shrunk
    finally:
        runner.yield_to_actions(None)
        runner.configure_language(LanguageSettings())

def test_a_prompt_pass_reads_each_prompts_last_logits_only(runner):
    """A prompt pass runs lm_head (257,152 rows) on one position per joining generation, the last of
    its prompt, not on every prompt position: that was most of a pass's cost (a pass of 16 took
    ~130 ms on the reference CPU, ~20 ms since), and an observation arriving meanwhile waited for all
    of it. Prompts of different lengths (right-padded) still give a fresh prefill's tokens."""
    runner.configure_language(LanguageSettings(max_new_tokens=4, tokens_per_frame=4))
    seen = []
    handle = runner.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    try:
        runner.run([_request(0), _request(1, prompt="what is the next subtask of this task?")])
        runner.advance(max_tokens=0)  # the prompt pass alone
        assert seen == [(2, 1, runner.lm_head.weight.shape[1])]
        final = _finish(runner)
    finally:
        handle.remove()
        runner.configure_language(LanguageSettings())
    expected = _fresh_prefill_tokens(runner, _request(0), 4)
    assert final["robot0"] == runner._tokenizer.decode(expected, skip_special_tokens=True).strip()


def test_stop_token_ends_the_generation(checkpoint):
    runner = _load(checkpoint, LanguageSettings(max_new_tokens=5, tokens_per_frame=5))
    ids = _fresh_prefill_tokens(runner, _request(0), 5)
    # Random weights never say end-of-sequence: make the third token a stop token. (A stop string
    # is one token of the tokenizer; this one may be a byte that decodes to nothing printable.)
    runner.stop_ids = runner.stop_ids | {ids[2]}
    runner.run([_request(0)])
    (u,) = runner.advance()
    assert u.final and u.reason == "stop" and u.tokens == ids.index(ids[2])
    assert runner.counters["finished.stop"] == 1
    with pytest.raises(ConfigError, match="language.stop"):
        runner.configure_language(LanguageSettings(stop=("pick up the red cube and place it",)))


def test_refusals_are_per_request_with_a_reason(runner):
    runner.configure_language(LanguageSettings(max_new_tokens=8, max_prompt_tokens=12))
    with pytest.raises(ProtocolError) as exc:
        runner.check_request(_request(0, max_new_tokens=9))
    assert exc.value.reason == "text_over_token_limit"
    with pytest.raises(ProtocolError) as exc:
        runner.check_request(_request(0, prompt="describe every object on the table in great detail please"))
    assert exc.value.reason == "prompt_too_long"
    verdict = InferenceRequest("r", *(_request(0).state, _request(0).images), "t", 0,
                               extras={COMPONENT_EXTRA: ComponentQuery("t", "safety", "safe?", ("safe", "unsafe"))})
    with pytest.raises(ProtocolError) as exc:
        runner.check_request(verdict)
    assert exc.value.reason == "component_not_served"
    runner.check_request(_request(0))  # within the limits
    # A bad query that reaches run anyway fails the call (the executor then serves one at a time).
    with pytest.raises(PolicyError):
        runner.run([_request(0, max_new_tokens=99)])
    assert runner.language_active == 0
    runner.configure_language(LanguageSettings())


def test_one_generation_per_robot_forget_and_eviction(checkpoint):
    runner = _load(checkpoint, LanguageSettings(max_new_tokens=20, tokens_per_frame=1, max_requests=2))
    runner.run([_request(0)])
    runner.run([_request(0)])  # its text is still being written: that one answers
    assert runner.counters["busy"] == 1 and runner.language_active == 1
    runner.forget("robot0")  # session closed / new episode
    assert runner.language_active == 0 and runner.counters["forgotten"] == 1
    for i in range(3):  # a third robot over max_requests: the oldest is evicted
        runner.run([_request(i)])
        runner.advance()
    assert runner.counters["evicted"] == 1 and runner.language_active == 2
    assert {g.session_id for g in runner.running.rows} == {"robot1", "robot2"}
    # The KV cap: room for one generation only.
    width = runner.running.width
    small = _load(checkpoint, LanguageSettings(max_new_tokens=20, tokens_per_frame=1,
                                               max_cached_tokens=width + 8))
    small.run([_request(0)])
    small.advance()
    small.run([_request(1)])
    small.advance()
    assert small.counters["evicted"] >= 1 and small.language_active == 1
    assert small.running.cached_tokens() <= width + 8


def test_decode_budget_shrinks_near_the_action_slo():
    s = LanguageSettings(tokens_per_frame=8, min_tokens_per_frame=1, action_slo_ms=100)
    budget = DecodeBudget(s, margin=0.1, alpha=1.0)
    assert budget.tokens() == 8  # nothing measured yet
    budget.observe(action_ms=30, step_ms=5)
    assert budget.tokens() == 8  # (90 - 30) / 5 = 12 -> capped
    budget.observe(action_ms=60, step_ms=5)
    assert budget.tokens() == 6
    budget.observe(action_ms=95, step_ms=5)
    assert budget.tokens() == 1  # the floor
    assert DecodeBudget(LanguageSettings(tokens_per_frame=3)).tokens() == 3  # no SLO: fixed


def test_a_frame_of_text_fits_the_action_slo_prompt_passes_included():
    """Under an SLO a frame of text may take the SLO less its margin less the slowest recent action
    call; prompt passes are admitted only as far as they fit (one to measure, one when nothing runs)."""
    s = LanguageSettings(tokens_per_frame=8, min_tokens_per_frame=1, action_slo_ms=100)
    budget = DecodeBudget(s, margin=0.1)
    assert budget.frame_ms() is None and budget.admits(5, 0) == 5  # nothing measured: as without an SLO
    budget.observe(action_ms=20)
    budget.observe(action_ms=40)
    budget.observe(action_ms=30)
    assert budget.frame_ms() == 50  # 90 - the slowest (40), not the mean
    assert budget.admits(5, 3) == 1  # one, to measure a prompt pass
    budget.observe(admit_ms=10, step_ms=5)
    assert budget.admits(5, 3) == 4  # (50 - 1 floor step x 5) / 10
    budget.observe(action_ms=89)
    assert budget.admits(5, 3) == 0 and budget.admits(5, 0) == 1  # no room: only when nothing runs
    assert DecodeBudget(LanguageSettings(tokens_per_frame=3)).admits(7, 2) == 7  # no SLO: all
    with pytest.raises(ConfigError):
        LanguageSettings(min_tokens_per_frame=5, tokens_per_frame=4)
    with pytest.raises(ConfigError):
        LanguageSettings(prompt="")


def test_builder_presets_and_usable_lm_head(checkpoint, tmp_path):
    from safetensors import safe_open

    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.checkpoint_builder.tiny_pi import TINY_PI_ARCHITECTURE

    sidecar = json.loads((checkpoint / "lerobot_zenoh_features.json").read_text())
    assert sidecar["test_architecture"] == TINY_PI_ARCHITECTURE
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        head = f.get_tensor("model.paligemma_with_expert.paligemma.lm_head.weight")
    vocab = len(json.loads((checkpoint / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"])
    assert head.shape[0] == 257152 and float(head[vocab + 10:].abs().sum()) == 0.0
    assert float(head[:vocab].abs().sum()) > 0
    with pytest.raises(ConfigError, match="architecture"):
        build_checkpoint(tmp_path / "x", policy_type="pi05", state_names=STATE, action_names=STATE,
                         cameras=CAMERAS, chunk_size=10, architecture="huge")
    with pytest.raises(ConfigError, match="architecture"):
        build_checkpoint(tmp_path / "y", policy_type="act", state_names=STATE, action_names=STATE,
                         cameras=CAMERAS, chunk_size=10, architecture="small")


def test_text_only_request_runs_the_prefix_pass_alone(runner):
    runner.configure_language(LanguageSettings(max_new_tokens=5, tokens_per_frame=5))
    shared = runner.run([_request(0)])
    (u_shared,) = runner.advance()
    mixed = runner.run([_request(0, actions=False), _request(1, text=False)])
    assert mixed[0].actions is None and mixed[1].actions is not None
    (u_alone,) = runner.advance()
    assert u_alone.text == u_shared.text and u_alone.final and shared[0].actions is not None
    runner.configure_language(LanguageSettings())


def test_vlm_text_batched_equals_one_at_a_time(tmp_path):
    """The VLM runner's iteration-level batching: rows leave at their last token; the text of each
    robot equals transformers' generate on it alone (different prompts batch apart)."""
    from lerobot_zenoh.checkpoint_builder.build import build_tiny_vlm
    from lerobot_zenoh.server.runners.vlm import VlmRunner, VlmSettings

    cams = {"front": (48, 64)}
    path = build_tiny_vlm(tmp_path / "vlm")
    runner = VlmRunner.from_pretrained(path, VlmSettings(output="text", prompt="next subtask?", max_new_tokens=8,
                                                         state_dim=4, cameras=cams))
    rng = np.random.default_rng(3)
    requests = []
    for j in range(5):
        extras = {COMPONENT_EXTRA: ComponentQuery("t", "plan", "what now?")} if j == 4 else {}
        requests.append(InferenceRequest(f"r{j}", np.zeros(4, np.float32),
                                         {"front": rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)}, "", j,
                                         extras=extras))
    together = runner.run(requests)
    alone = runner.run_one_at_a_time(requests)
    assert [r.text for r in together] == [r.text for r in alone]
    assert runner.batches == 2  # two prompt shapes
    eos = runner.model.generation_config.eos_token_id
    # A stop token that some rows reach early: the first token of robot 1's text.
    first = runner.processor.tokenizer(alone[1].text, add_special_tokens=False)["input_ids"][0]
    runner.model.generation_config.eos_token_id = first
    try:
        early = runner.run(requests)
        assert [r.text for r in early] == [r.text for r in runner.run_one_at_a_time(requests)]
        assert len(early[1].text) < len(alone[1].text)  # it stopped at its first token
    finally:
        runner.model.generation_config.eos_token_id = eos


# -- served over real Zenoh: one pipeline item, System 1 and System 2 of a task ---------------------

def test_served_actions_and_streamed_text_from_one_entry(checkpoint, port, app_key):
    """A pi05 entry with `language` serving `act` (bit 0) and `plan` (bit 1) of task `kit` from one
    prefill: a chunk on .../action, partial text then the final one on .../text; text-only and
    actions-only masks; a bad text request refused per request (counted); the robot's language state
    freed when its session closes."""
    import threading

    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.keys import pipeline_app
    from lerobot_zenoh.protocol.messages import Observation
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import OBSERVATION_QOS, ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings
    from lz_testing import wait_for

    robot = "kit-r0"

    def entry(model_id, *items):
        return {"model_id": model_id, "model_version": "v1", "application_tag": f"{model_id}-srv",
                "pretrained_path": str(checkpoint), "fps": 30,
                "clients": [{"client_uuid": c} for c in (robot, "kit-r3", "kit-r4")],
                "language": {"max_new_tokens": 40, "tokens_per_frame": 2, "max_prompt_tokens": 12},
                "pipeline": [{"task": task, "component": "act", "bit": 0, **item,
                              "text": {"component": "plan", "bit": 1, **text}} for task, item, text in items]}

    def manifest(*entries):
        return parse_manifest({"cluster_uuid": app_key.cluster, "experiment_tag": app_key.experiment,
                               "server_id": "srv0", "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"],
                                                              "multicast_scouting": False},
                               "telemetry_period_s": 0, "sessions": {"liveliness_grace_s": 0.2}, "server": list(entries)})

    # A text item whose token limit is over language.max_new_tokens would have every request refused
    # (text_over_token_limit): it fails at start-up instead, naming the item.
    with pytest.raises(ConfigError, match="text.max_new_tokens 99 is over language.max_new_tokens 40"):
        manifest(entry("bad", ("kit3", {}, {"max_new_tokens": 99})))
    m = manifest(entry("pi", ("kit", {}, {"max_new_tokens": 6})),
                 # two ways to ask what this model refuses, one task stream each
                 entry("bad", ("kit2", {}, {"prompt": "describe every object on the table in detail"}),
                       ("kit4", {"labels": ["safe", "unsafe"]}, {})))  # a verdict
    server = PolicyServer(m).start()
    session = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    got: dict[str, list] = {"action": [], "text": []}
    lock = threading.Lock()
    try:
        apps = {e.model_id: m.app_key(e) for e in m.server}
        for topic, decode in (("action", codec.decode_action_chunk), ("text", codec.decode_text_result)):
            session.subscribe(apps["pi"].client(robot).topic(topic),
                              lambda key, payload, t=topic, d=decode: (lock.acquire(), got[t].append(d(payload)),
                                                                       lock.release()))
        for app in apps.values():
            assert wait_for(lambda a=app: session.query(a.status, 0.3)), "status never answered"
        # The status says it streams text from the prefill of its actions (what a pipeline client checks).
        assert codec.decode_status(session.query(apps["pi"].status, 2.0)[0][1]).streams_text is True
        # A robot belongs to one task: each refused task has a robot of its own.
        who = {"kit": robot, "kit2": robot, "kit4": "kit-r4"}
        streams = {t: pipeline_app(app_key.cluster, app_key.experiment, t).client(who[t]) for t in who}
        pubs: dict = {}  # observation key -> publisher
        token = session.declare_token(streams["kit"].metrics)
        rng = np.random.default_rng(0)

        def send(seq_id, mask, task="kit", episode="e0"):
            images = {c: codec.encode_jpeg(rng.integers(0, 255, (*hw, 3), dtype=np.uint8), 90) for c, hw in CAMERAS.items()}
            obs = Observation(seq_id, who[task], np.zeros(len(STATE), np.float32), images, "pick up the red cube",
                              episode_id=episode, session_nonce=1, component_mask=mask)
            # On the key naming the components it asks, as a pipeline client publishes it.
            key = streams[task].obs_for(mask)
            if key not in pubs:
                pubs[key] = session.publisher(key, OBSERVATION_QOS)
            pubs[key].put(codec.encode(obs), codec.encode_observation_header(obs))

        def texts(seq_id):
            with lock:
                return [t for t in got["text"] if t.response_to_seq_id == seq_id]

        def chunks(seq_id):
            with lock:
                return [c for c in got["action"] if c.response_to_seq_id == seq_id]

        send(1, 0b11)
        assert wait_for(lambda: chunks(1) and any(not t.partial for t in texts(1)), 30)
        # Asking both of its components, it matched both of the server's subscriptions: admitted once.
        assert server.stats()[apps["pi"].prefix]["clients"][robot]["received"] == 1
        stream = texts(1)
        assert stream[-1].partial is False and all(t.partial for t in stream[:-1]) and len(stream) >= 2
        assert all(stream[-1].text.startswith(t.text[:1]) for t in stream)
        send(2, 0b10)  # System 2 alone: text, no chunk
        assert wait_for(lambda: any(not t.partial for t in texts(2)), 30)
        send(3, 0b01)  # System 1 alone: a chunk, no text
        assert wait_for(lambda: chunks(3), 30)
        assert not chunks(2) and not texts(3)
        runner = server.models[0].runner
        assert runner.counters["started"] == 2 and server.stats()[apps["pi"].prefix]["answers"]["text"] == 2
        # The other entry refuses per request, each counted under its reason: a prompt over its
        # max_prompt_tokens, a verdict (pi0.5 writes text). (A token limit over language.max_new_tokens
        # fails at start-up, above; the runner's own refusal of one is tested alone.)
        def rejected():
            counts: dict = {}
            for c in server.stats()[apps["bad"].prefix]["clients"].values():
                for reason, n in c.get("rejected", {}).items():
                    counts[reason] = counts.get(reason, 0) + n
            return counts

        for seq_id, task, reason in ((4, "kit2", "prompt_too_long"), (7, "kit4", "component_not_served")):
            send(seq_id, 0b11, task=task)
            assert wait_for(lambda r=reason: rejected().get(r) == 1, 30), rejected()
        assert server.models[1].runner.counters["started"] == 0  # nothing of them was decoded
        # A robot that disappears frees its language state.
        # (A budget of 0 tokens per frame once actions are over their SLO: the text stays unfinished.)
        runner.configure_language(dataclasses_replace(runner.settings, min_tokens_per_frame=0, action_slo_ms=0.001))
        send(5, 0b11)
        assert wait_for(lambda: texts(5), 30) and runner.language_active == 1
        # A new episode frees it (its text is of the old one) ...
        send(8, 0b01, episode="e1")
        assert wait_for(lambda: chunks(8), 30) and runner.language_active == 0 and runner.counters["forgotten"] == 1
        send(9, 0b11, episode="e1")
        assert wait_for(lambda: texts(9), 30) and runner.language_active == 1
        # ... and so does the robot disappearing (its session closes with its token).
        token.undeclare()
        assert wait_for(lambda: runner.language_active == 0 and runner.counters["forgotten"] == 2, 30)
    finally:
        session.close()
        server.stop()


def dataclasses_replace(obj, **changes):
    return obj.replace(**changes)  # LanguageSettings: a validated copy


# -- the planner: a model serving two components from one stream --------------------------------------

def _talk_factory(robots: int) -> dict:
    return {
        "cluster_uuid": "factory", "experiment_tag": "talk",
        "servers": {"count": 4, "hardware": "synthetic-H200", "host": "127.0.0.1", "port_base": 8250, "device": "cpu"},
        "models": {"pi05-lang": {"model_id": "pi05lang", "pretrained_path": "checkpoints/pi05",
                                 "language": {"max_new_tokens": 16}}},
        "fleet": [{"task": "talk", "robots": robots, "weight": 1.0, "min_throughput_hz": 1}],
        "tasks": {"talk": {"action_period_ms": 200, "components": {
            "act": {"kind": "system1", "model": "pi05-lang", "prompt": "", "invocation": "per_chunk",
                    "slo": {"percentile": 99, "deadline_ms": 300}, "on_slo_miss": "hold", "inputs": ["plan"]},
            "plan": {"kind": "system2", "model": "pi05-lang", "prompt": "next subtask?",
                     "invocation": {"every_n_chunks": 4}, "slo": {"percentile": 99, "deadline_ms": 3000},
                     "on_slo_miss": "use_last"}}}},
    }


def _lang_profiles(two: bool):
    from lerobot_zenoh.pipelines.profiles import ModelProfile, Profiles, ServiceModel, synthetic_profile

    prof = synthetic_profile(ServiceModel(base_ms=60.0, per_item_ms=8.0), [1, 2, 4, 8])
    if two:
        points = [p.model_copy(update={"text_mean_ms": p.mean_ms * 4}) for p in prof.points]
        prof = ModelProfile(components=["system1", "system2"], points=points)
    return Profiles(hardware="synthetic-H200", models={"pi05-lang": prof})


def test_planner_serves_both_components_of_a_two_component_model_on_one_server():
    from lerobot_zenoh.pipelines.descriptor import parse_factory
    from lerobot_zenoh.pipelines.planner import plan

    factory = parse_factory(_talk_factory(8))
    joint = plan(factory, _lang_profiles(two=True), time_budget_s=10)
    assert all(r["act"] == r["plan"] for r in joint.routing.values()) and len(joint.routing) == 8
    kinds = {(sh.stream.kind, sh.stream.text_component) for s in joint.servers for sh in s.shares}
    assert kinds == {("system1", "plan")}  # one stream: System 2 rides on System 1's prefill
    # The same model without the two-component profile: System 2 is a stream of its own (its own
    # prefill per request, possibly on other servers).
    apart = plan(factory, _lang_profiles(two=False), time_budget_s=10)
    assert any(sh.stream.kind == "system2" for s in apart.servers for sh in s.shares)


def test_two_component_profiles_need_text_latency():
    from lerobot_zenoh.pipelines.profiles import parse_profiles

    point = {"batch_size": 1, "rate_hz": 1.0, "mean_ms": 50.0, "p99_ms": 60.0}
    with pytest.raises(ConfigError, match="text_mean_ms"):
        parse_profiles({"models": {"m": {"components": ["system1", "system2"], "points": [point]}}})
    with pytest.raises(ConfigError, match="components"):
        parse_profiles({"models": {"m": {"components": ["system1"], "points": [point]}}})
    ok = parse_profiles({"models": {"m": {"components": ["system1", "system2"],
                                          "points": [{**point, "text_mean_ms": 400.0}]}}})
    assert ok.get("m").serves_both and ok.get("m").latency_ms(1, 1.0, "text_mean") == 400.0


def test_text_result_partial_round_trips_and_is_sent_only_when_true():
    import msgpack

    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.messages import TextResult

    partial = TextResult(7, "pick up", 12.5, "srv", partial=True)
    assert codec.decode_text_result(codec.encode(partial)) == partial
    final = TextResult(7, "pick up the cube", 12.5, "srv")
    assert "partial" not in msgpack.unpackb(codec.encode(final))  # as before: older readers see no change
    assert codec.decode_text_result(codec.encode(final)).partial is False


def test_deployment_writes_the_text_item_and_admission_keeps_one_stream(tmp_path):
    """A planned combined pi0.5: its manifest serves System 1 with System 2 as the item's `text` (and
    the factory's `language` block), every robot's two routes name the same app, and an admitted
    robot joins System 1's stream on that server for both components (no System 2 stream)."""
    from lerobot_zenoh.pipelines.fleet_admission import admit
    from lerobot_zenoh.pipelines.deployment import apply_admission, load_deployment, write_deployment
    from lerobot_zenoh.pipelines.descriptor import parse_factory
    from lerobot_zenoh.pipelines.planner import plan
    from lerobot_zenoh.server.config.manifest import load_manifest

    factory = parse_factory(_talk_factory(4))
    profiles = _lang_profiles(two=True)
    result = plan(factory, profiles, time_budget_s=10)
    out = write_deployment(factory, result, tmp_path / "deploy", profiles)
    doc = json.loads((out / "plan.json").read_text())
    for s in result.servers:
        (entry,) = load_manifest(out / "manifests" / f"srv{s.index}.yaml").server
        assert entry.application_tag == f"system1+system2-srv{s.index}"
        assert entry.language is not None and entry.language.max_new_tokens == 16
        (item,) = entry.pipeline
        assert (item.component, item.bit, item.text.component, item.text.bit, item.text.prompt) == (
            "act", 0, "plan", 1, "next subtask?")
    for routes in doc["robots"].values():
        act, plan_ = routes["routes"]["act"], routes["routes"]["plan"]
        assert act["application_tag"] == plan_["application_tag"] and plan_["kind"] == "system2"
        assert plan_["rate_hz"] == pytest.approx(act["rate_hz"] / 4, rel=1e-5)
    f2, p2, state = load_deployment(out)
    a = admit(f2, p2, state, "talk")
    assert a.admitted, a.reason
    assert a.routes["act"] == a.routes["plan"] and list(a.routes) == ["act", "plan"]
    assert all(sh.stream.kind == "system1" and sh.stream.text_component == "plan"
               for s in a.plan.servers for sh in s.shares)
    changed = apply_admission(f2, state, a.plan, a.robot, out)
    (entry,) = load_manifest(out / "manifests" / f"srv{a.routes['act']}.yaml").server
    assert changed and a.robot in {c.client_uuid for c in entry.clients} and entry.pipeline[0].text.component == "plan"


def test_a_combined_model_without_language_or_named_for_system2_alone_is_refused():
    from lerobot_zenoh.pipelines.descriptor import parse_factory
    from lerobot_zenoh.pipelines.planner import plan

    data = _talk_factory(2)
    del data["models"]["pi05-lang"]["language"]
    with pytest.raises(ConfigError, match="models.pi05-lang.language"):
        plan(parse_factory(data), _lang_profiles(two=True), time_budget_s=5)
    data = _talk_factory(2)
    data["models"]["act-only"] = {"model_id": "act", "synthetic": {"latency_ms": 10}}
    data["tasks"]["talk"]["components"]["act"]["model"] = "act-only"
    profiles = _lang_profiles(two=True)
    profiles = profiles.model_copy(update={"models": {**profiles.models, "act-only": _lang_profiles(False).get("pi05-lang")}})
    with pytest.raises(ConfigError, match="name 'pi05-lang' for both"):
        plan(parse_factory(data), profiles, time_budget_s=5)


# -- end to end: planned, admitted, started as written, a pipeline robot client --------------------

SO101 = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
SIM_CAMERAS = {"front": (96, 128), "wrist": (96, 128)}  # zenoh_sim's default cameras


def test_planned_combined_deployment_runs_end_to_end(tmp_path_factory, capsys):
    """lerobot-zenoh-plan writes a deployment with one pi0.5 serving `act` and `plan` from one
    prefill; lerobot-zenoh-admit admits a second robot; the server starts from the generated manifest
    (behind the deployment's router, as servers.sh starts it); the admitted robot's client line, run
    as written, gets chunks and System 2's final text from that server, while a listener sees the
    text stream (partial, then final) on the same app."""
    import shlex
    import subprocess
    import sys
    import threading

    import yaml

    from lerobot_zenoh.cli import admit as admit_cli
    from lerobot_zenoh.cli import plan as plan_cli
    from lerobot_zenoh.pipelines.profiles import dump_profiles
    from lerobot_zenoh.protocol import codec
    from lerobot_zenoh.protocol.keys import AppKey
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint
    from lerobot_zenoh.server.config.manifest import load_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import ZenohSettings
    from lz_testing import free_port, wait_for

    root = tmp_path_factory.mktemp("e2e")
    ckpt = build_checkpoint(root / "pi05", policy_type="pi05", state_names=SO101, action_names=SO101,
                            cameras=SIM_CAMERAS, chunk_size=10, fps=30, overrides={"num_inference_steps": 2})
    data = _talk_factory(1)
    data["servers"].update(count=1, port_base=free_port())
    data["models"]["pi05-lang"] = {"model_id": "pi05lang", "pretrained_path": str(ckpt),
                                   "language": {"max_new_tokens": 6, "tokens_per_frame": 2}}
    comps = data["tasks"]["talk"]["components"]
    comps["act"]["slo"] = {"percentile": 99, "deadline_ms": 5000}
    comps["plan"].update(slo={"percentile": 99, "deadline_ms": 30000}, invocation={"every_n_chunks": 2})
    (root / "factory.yaml").write_text(yaml.safe_dump(data))
    (root / "profiles.yaml").write_text(dump_profiles(_lang_profiles(two=True)))
    out = root / "deploy"
    assert plan_cli.main([f"--factory={root / 'factory.yaml'}", f"--profiles={root / 'profiles.yaml'}",
                          f"--output={out}", "--time_budget_s=10"]) == 0
    assert admit_cli.main([f"--deployment={out}", "--task=talk", "--confirm_s=0"]) == 0
    capsys.readouterr()
    (entry,) = load_manifest(out / "manifests" / "srv0.yaml").server
    assert {c.client_uuid for c in entry.clients} == {"talk-r0", "talk-r1"} and entry.pipeline[0].text.bit == 1
    line = next(ln for ln in (out / "admitted.sh").read_text().splitlines() if ln.startswith("lerobot-robot-client"))
    argv = shlex.split(line.removesuffix(" &"))
    assert "--client_uuid=talk-r1" in argv

    endpoint = f"tcp/127.0.0.1:{data['servers']['port_base']}"
    router = ZenohSession(ZenohSettings(mode="router", listen=[endpoint], multicast_scouting=False)).open()
    server = PolicyServer(load_manifest(out / "manifests" / "srv0.yaml")).start()
    listener = ZenohSession(ZenohSettings(mode="client", connect=[endpoint], multicast_scouting=False)).open()
    texts: list = []
    lock = threading.Lock()
    app = AppKey(data["cluster_uuid"], data["experiment_tag"], "pi05lang", "v1", entry.application_tag)
    listener.subscribe(app.client("talk-r1").topic("text"),
                       lambda key, payload: (lock.acquire(), texts.append(codec.decode_text_result(payload)),
                                             lock.release()))
    summary = root / "summary.json"
    try:
        proc = subprocess.run([sys.executable, "-m", "lerobot_zenoh.cli.client", *argv[1:], "--duration_s=12",
                               f"--summary_path={summary}"], capture_output=True, text=True, timeout=240,
                              check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert wait_for(lambda: any(not t.partial for t in texts), 10)
        stats = server.stats()[app.prefix]
    finally:
        listener.close()
        server.stop()
        router.close()
    done = json.loads(summary.read_text())
    pipe = done["pipeline"]
    assert done["chunks_received"] > 0 and pipe["slo.act.answered"] > 0
    assert pipe["slo.plan.answered"] >= 1, pipe  # System 2's final text, booked by the robot
    with lock:
        assert any(t.partial for t in texts) and any(not t.partial for t in texts)
    assert stats["answers"]["text"] >= 1 and stats["answers"]["actions"] > 0
    assert "talk-r1: component plan (system2) served by srv0 from System 1's prefill" in proc.stderr


def test_profile_the_combined_runner_then_plan_with_it(checkpoint, tmp_path, capsys):
    """lerobot-zenoh-profile --task: the clients ask actions every request and text every 2nd on the
    task's stream; the rows are the actions' latencies with text_mean_ms and the decode cost (from
    the server's telemetry), under components [system1, system2]; the planner reads them and puts
    both components of a task naming the model on one stream."""
    from lerobot_zenoh.cli.profile import main
    from lerobot_zenoh.pipelines.descriptor import parse_factory
    from lerobot_zenoh.pipelines.planner import plan
    from lerobot_zenoh.pipelines.profiles import load_profiles
    from lerobot_zenoh.server.config.manifest import parse_manifest
    from lerobot_zenoh.server.shell.policy_server import PolicyServer
    from lerobot_zenoh.transport.session import ZenohSession
    from lerobot_zenoh.transport.settings import loopback_settings
    from lz_testing import free_port

    port = free_port()
    server = PolicyServer(parse_manifest({
        "cluster_uuid": "prof", "experiment_tag": f"t{port}", "server_id": "gpu0", "telemetry_period_s": 0.3,
        "zenoh": {"listen": [f"tcp/127.0.0.1:{port}"], "multicast_scouting": False},
        "server": [{"model_id": "pi05", "model_version": "v1", "application_tag": "both", "pretrained_path": str(checkpoint),
                    "fps": 30, "accept_unknown_clients": True, "max_batch_size": 2,
                    "language": {"max_new_tokens": 4, "tokens_per_frame": 2},
                    "pipeline": {"task": "kit", "component": "act", "bit": 0,
                                 "text": {"component": "plan", "bit": 1, "prompt": "next?"}}}],
    })).start()
    out = tmp_path / "profiles.yaml"
    # The clients' observations are keyed by the components they ask (only their server hears them).
    listener = ZenohSession(loopback_settings(None, listen=False, connect_ports=(port,))).open()
    seen: dict[str, int] = {}
    listener.subscribe(f"prof/t{port}/**/obs/**", lambda key, payload: seen.update(
        {key.split("/obs")[1]: seen.get(key.split("/obs")[1], 0) + 1}))
    try:
        rc = main([f"--endpoint=tcp/127.0.0.1:{port}", f"--output={out}", "--profile_name=pi05-lang",
                   "--cluster_uuid=prof", f"--experiment_tag=t{port}", "--model_id=pi05", "--application_tag=both",
                   "--batch_size=2", "--clients=2", "--saturation_s=2", "--seconds_per_rate=3", "--timeout_s=30",
                   "--fractions=[0.5]", "--task=kit", "--text_every=2", "--hardware=synthetic-H200"])
        stats = server.stats()
    finally:
        listener.close()
        server.stop()
    assert rc == 0, capsys.readouterr().err
    assert set(seen) == {"/c0", "/c0/c1"}, seen  # none on the plain key
    prof = load_profiles(out).models["pi05-lang"]
    assert prof.serves_both and len(prof.points) == 1
    (p,) = prof.points
    assert p.batch_size == 2 and p.text_mean_ms > 0 and p.mean_ms > 0
    assert p.decode_ms_per_token > 0 and p.decode_step_ms > 0 and p.decode_batch_mean >= 1
    (model,) = stats.values()
    assert model["answers"]["text"] >= 1 and model["answers"]["actions"] >= 1
    # The planner reads the measured file: both components of `talk` on one stream.
    data = _talk_factory(1)
    comps = data["tasks"]["talk"]["components"]
    comps["act"]["slo"]["deadline_ms"] = 60_000
    comps["plan"]["slo"]["deadline_ms"] = 600_000
    result = plan(parse_factory(data), load_profiles(out), time_budget_s=10)
    assert [(sh.stream.component, sh.stream.text_component) for s in result.servers for sh in s.shares] == [("act", "plan")]


def _choice_factory(servers: int) -> dict:
    data = _talk_factory(4)
    data["servers"]["count"] = servers
    data["models"].update({"pi05": {"model_id": "pi05", "pretrained_path": "checkpoints/pi05"},
                           "vlm": {"model_id": "vlm", "pretrained_path": "checkpoints/vlm", "vlm": {}}})
    comps = data["tasks"]["talk"]["components"]
    comps["act"]["model"], comps["plan"]["model"] = "pi05", "vlm"
    comps["act"]["slo"]["deadline_ms"] = 2000
    comps["plan"]["slo"]["deadline_ms"] = 20_000
    data["tasks"]["talk"]["combined_model"] = "pi05-lang"
    return data


def _choice_profiles(combined_ms: float, text_ms: float):
    from lerobot_zenoh.pipelines.profiles import ModelProfile, Profiles, ServiceModel, synthetic_profile

    act = synthetic_profile(ServiceModel(base_ms=60.0, per_item_ms=8.0), [1, 2, 4, 8])
    vlm = synthetic_profile(ServiceModel(base_ms=600.0, per_item_ms=6.0), [8], "continuous")
    both = synthetic_profile(ServiceModel(base_ms=combined_ms, per_item_ms=8.0), [1, 2, 4, 8])
    both = ModelProfile(components=["system1", "system2"],
                        points=[p.model_copy(update={"text_mean_ms": text_ms}) for p in both.points])
    return Profiles(hardware="synthetic-H200", models={"pi05": act, "vlm": vlm, "pi05-lang": both})


def test_the_planner_prefers_the_combined_model_when_its_profile_says_it_is_cheaper(tmp_path, capsys):
    """A task whose System 1 (pi05) and System 2 (a VLM) may instead come from one stream of a
    combined pi0.5: planned both ways, the better kept and said (objective, servers, rate of each
    way); the deployment is written as chosen (factory.yaml too, for admission)."""
    from lerobot_zenoh.cli import plan as plan_cli
    from lerobot_zenoh.pipelines.deployment import load_deployment, write_deployment
    from lerobot_zenoh.pipelines.descriptor import parse_factory
    from lerobot_zenoh.pipelines.planner import plan
    from lerobot_zenoh.pipelines.profiles import dump_profiles
    from lerobot_zenoh.server.config.manifest import load_manifest

    factory = parse_factory(_choice_factory(2))
    cheap = _choice_profiles(combined_ms=70.0, text_ms=300.0)  # one prefill, text 300 ms: one stream wins
    result = plan(factory, cheap, time_budget_s=20)
    assert result.combined == {"talk": True}
    why = result.choices["talk"]
    assert why.startswith("act+plan from one stream of pi05-lang (objective") and why.endswith(": a higher objective")
    assert "rather than act on pi05, plan on vlm (objective" in why
    assert {s.model for s in result.servers} == {"pi05-lang"}
    out = write_deployment(factory, result, tmp_path / "one", cheap)
    (entry,) = load_manifest(out / "manifests" / "srv0.yaml").server
    assert entry.model_id == "pi05lang" and entry.pipeline[0].text.component == "plan"
    f2, _, state = load_deployment(out)
    assert f2.tasks["talk"].combined_model is None and f2.tasks["talk"].components["plan"].model == "pi05-lang"
    assert state.choices == result.choices
    # A slow combined model (a 400 ms prefill, 8 s to its text): the two models as named.
    slow = _choice_profiles(combined_ms=400.0, text_ms=8000.0)
    apart = plan(factory, slow, time_budget_s=20)
    assert apart.combined == {"talk": False} and apart.choices["talk"].startswith(
        "act on pi05, plan on vlm (objective")
    assert {s.model for s in apart.servers} == {"pi05", "vlm"}
    # The command line says it.
    (tmp_path / "f.yaml").write_text(json.dumps(_choice_factory(2)))
    (tmp_path / "p.yaml").write_text(dump_profiles(cheap))
    assert plan_cli.main([f"--factory={tmp_path / 'f.yaml'}", f"--profiles={tmp_path / 'p.yaml'}",
                          "--time_budget_s=20"]) == 0
    captured = capsys.readouterr()
    assert "lerobot-zenoh-plan: task talk: act+plan from one stream of pi05-lang" in captured.err
    assert json.loads(captured.out)["choices"]["talk"].startswith("act+plan from one stream of pi05-lang")
    # Too slow for System 1's SLO: that way is infeasible, and said so.
    data = _choice_factory(2)
    data["tasks"]["talk"]["components"]["act"]["slo"]["deadline_ms"] = 300
    apart = plan(parse_factory(data), slow, time_budget_s=20)
    assert apart.combined == {"talk": False} and "pi05-lang is infeasible (" in apart.choices["talk"]
    # A combined_model profiled as one component is refused naming the field.
    one = _choice_profiles(70.0, 300.0)
    one = one.model_copy(update={"models": {**one.models, "pi05-lang": one.get("pi05")}})
    with pytest.raises(ConfigError, match="tasks.talk.combined_model"):
        plan(factory, one, time_budget_s=5)


def test_the_client_takes_system2_on_system1s_server_only_from_a_pi05_answering_actions():
    from lerobot_zenoh.client.pipeline import PipelineTask
    from lerobot_zenoh.errors import CompatibilityError
    from lerobot_zenoh.protocol.messages import Status

    def status(policy_type, output, streams_text=True):
        return Status("m", "v1", {}, 6, 10, {}, policy_type=policy_type, server_id="srv0", output=output,
                      streams_text=streams_text)

    PipelineTask._check_shared_prefill("plan", status("pi05", "actions"))
    PipelineTask._check_shared_prefill("plan", status("pi05", None))  # `output` not said: actions
    with pytest.raises(CompatibilityError, match="component 'plan' .* planned on System 1's server srv0 .* serves act "
                                                 "answering actions and streaming no text"):
        PipelineTask._check_shared_prefill("plan", status("act", "actions", None))
    # A pi0.5 without a `language` block answers actions only: the status says so, not its policy type.
    with pytest.raises(CompatibilityError, match="a pi0.5 with a `language` block.* serves pi05 answering actions and "
                                                 "streaming no text"):
        PipelineTask._check_shared_prefill("plan", status("pi05", "actions", None))
    with pytest.raises(CompatibilityError, match="answering text"):
        PipelineTask._check_shared_prefill("plan", status("pi05", "text"))
