"""pi0.5 serving actions and language from one prefill, with language decoded across frames and robots.

pi0.5 (LeRobot ``pi05``) is a Mixture-of-Transformers: PaliGemma's language model encodes the
observation (SigLIP image tokens + the tokenized task and state) into a KV cache, and the action
expert denoises a chunk against that cache. LeRobot's ``sample_actions`` runs the prefix once and
gives each Euler step a *clone* of the cache, so after the chunk the prefix cache is still exactly the
prefill's. PaliGemma's ``lm_head`` (kept in every pi0.5 checkpoint, not tied to the embeddings) turns
that cache into text: one prefill serves System 1 (actions) and System 2 (text) of the same
observation (OxyGen's cross-task KV sharing; docs/policies.md, "pi0.5: actions and language from one
prefill").

`Pi05LanguageRunner` (a `FlowMatchingRunner`):

- ``run(requests)``: LeRobot's own ``predict_action_chunk`` for the whole call, unchanged (the same
  per-row seeded noise, RTC, refinement capture): the actions are bit for bit those of the plain
  runner. A torch forward pre-hook on the first PaliGemma decoder layer, registered only for the
  duration of a call in which some request asks for text (``extras[LANGUAGE_EXTRA]``), keeps a
  reference to the prefix cache LeRobot builds; each such row's slice is copied out and becomes that
  robot's pending generation. Nothing of LeRobot is replaced.
- ``advance()``: called after the call's actions are out (actions are the hard deadline); the text
  side lives in runners/pi05_text.py (`TextDecoder`: the generations, their budget, the decode). Pending
  generations append their prompt to their cache (one batched forward; the first token comes from
  its last position), then every unfinished generation of every robot decodes together, one token per
  step, for the frame's budget (`DecodeBudget`): cross-frame continuous batching. Returns the
  `TextUpdate`s (partial text as it grows, the final text at a stop token or the token limit).

Memory is bounded: at most `LanguageSettings.max_requests` generations and `max_cached_tokens` KV
entries (rows x columns of the batched cache, padding included); beyond them the oldest generation is
evicted (counted, no final text). One generation per robot session: an ask while one is running is
answered by the running one (counted ``busy``). `forget` (session closed, new episode) drops it.

Greedy decoding over the tokenizer's vocabulary (logits of ids the tokenizer cannot decode are
masked), in eval mode: tokens depend on the observation and prompt only, not on who else decodes in
the batch (equal to one-at-a-time decoding; tested).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from lerobot_zenoh.errors import PolicyError, ProtocolError
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.runners.base import (
    RunnerCapabilities,
    COMPONENT_EXTRA,
    InferenceRequest,
    InferenceResult,
    check_observation,
)
from lerobot_zenoh.server.runners.flow_matching import FlowMatchingRunner
from lerobot_zenoh.server.runners.pi05_text import (  # noqa: F401 (the runner's settings and messages, named here too)
    LANGUAGE_EXTRA,
    DecodeBudget,
    LanguageQuery,
    LanguageSettings,
    TextDecoder,
    TextUpdate,
)

log = logging.getLogger(__name__)


class Pi05LanguageRunner(FlowMatchingRunner):
    """pi0.5 actions + language from one prefill (module docstring)."""

    @classmethod
    def capabilities_for(cls, config: Any) -> RunnerCapabilities:
        return dataclasses.replace(super().capabilities_for(config), streams_text=True,
                                   settings_blocks=(("language", "configure_language"),))

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.policy.config.type != "pi05":
            raise PolicyError(f"{self.path}: language from the shared prefill needs a pi05 checkpoint, "
                              f"not {self.policy.config.type}")
        paligemma = self.policy.model.paligemma_with_expert.paligemma
        self._language_model = paligemma.model.language_model
        self.text = TextDecoder(self._language_model, paligemma.lm_head,
                                self.policy.model.paligemma_with_expert.embed_language_tokens, self._tokenizer,
                                self._lock)

    # The text side's state, as the runner's (tests and telemetry read these names).
    settings = property(lambda self: self.text.settings)
    budget = property(lambda self: self.text.budget)
    running = property(lambda self: self.text.running)
    vocab = property(lambda self: self.text.vocab)
    lm_head = property(lambda self: self.text.lm_head)

    @property
    def counters(self) -> dict[str, int]:
        return self.text.counters

    @counters.setter
    def counters(self, value: dict[str, int]) -> None:
        self.text.counters = value

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.text.stop_ids

    @stop_ids.setter
    def stop_ids(self, value: frozenset[int]) -> None:
        self.text.stop_ids = value

    def configure_language(self, settings: LanguageSettings) -> None:
        """Take `settings` (stop strings must each be one token: `ConfigError` naming the field)."""
        self.text.configure(settings)

    def warmup(self) -> None:
        """The plain warm-up, then one text step (prompt pass + a decode step) under a private session,
        so that a robot's first text does not pay for the decode path's first call."""
        from lerobot_zenoh.server.runners.base import dummy_observation

        super().warmup()
        state, images = dummy_observation(self.spec)
        session = "\x00warmup-text"
        try:
            self.run([InferenceRequest(session, state, images, "", 0,
                                       extras={LANGUAGE_EXTRA: LanguageQuery(max_new_tokens=2, actions=False)})])
            self.advance(max_tokens=1)
        finally:
            self.forget(session)
            self.counters = dict.fromkeys(self.counters, 0)

    # -- what the server sees ---------------------------------------------------------------------

    @property
    def language_active(self) -> int:
        """Generations pending or running (the server calls `advance` while there are any)."""
        return self.text.active

    def figures(self) -> dict[str, float]:
        """Counters for telemetry (``language.*``)."""
        return self.text.figures()

    def check_request(self, request: InferenceRequest) -> None:
        super().check_request(request)
        component = request.extras.get(COMPONENT_EXTRA)
        if component is not None and component.labels:
            raise ProtocolError(Reason.COMPONENT_NOT_SERVED, "pi0.5 serves actions and text, not verdicts")
        query = request.extras.get(LANGUAGE_EXTRA)
        if query is not None:
            self.text.prompt_ids(query)
            self.text.token_limit(query)

    def forget(self, session_id: str) -> None:
        """Drop the session's generation (pending or running): its robot left or began a new episode."""
        super().forget(session_id)
        self.text.forget(session_id)

    # -- one frame ------------------------------------------------------------------------------

    def run(self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False) -> list[InferenceResult]:
        """LeRobot's chunk for every request asking actions (the plain runner's, bit for bit); the
        requests asking text start their robot's generation from the same prefix cache (`advance`
        decodes it). A text-only request (``LanguageQuery.actions`` False) runs the prefix pass alone
        and gets a result without actions."""
        starting = []  # (index in requests, prompt ids, token limit, tag)
        for i, r in enumerate(requests):
            query = r.extras.get(LANGUAGE_EXTRA)
            if query is None:
                continue
            try:
                prompt_ids, limit = self.text.prompt_ids(query), self.text.token_limit(query)
            except ProtocolError as exc:
                raise PolicyError(f"session {r.session_id}: {exc}") from exc
            if self.text.writing(r.session_id):
                self.counters["busy"] += 1  # its robot's text is still being written: that one answers
                continue
            starting.append((i, prompt_ids, limit, query.tag))
        text_only = {i for i, r in enumerate(requests)
                     if r.extras.get(LANGUAGE_EXTRA) is not None and not r.extras[LANGUAGE_EXTRA].actions}
        act = [i for i in range(len(requests)) if i not in text_only]
        results: list[InferenceResult] = [InferenceResult() for _ in requests]
        if act:
            pos = {i: n for n, i in enumerate(act)}
            sub = [requests[i] for i in act]
            sharing = [(pos[i], *rest) for i, *rest in starting if i in pos]
            t0 = time.perf_counter()
            done = (self._run_sharing(sub, sharing, capture_updates) if sharing
                    else super().run(sub, capture_updates=capture_updates))
            self.budget.observe(action_ms=(time.perf_counter() - t0) * 1000)
            for n, i in enumerate(act):
                results[i] = done[n]
        if text_only:
            only = sorted(text_only)
            pos = {i: n for n, i in enumerate(only)}
            self._prefill([requests[i] for i in only], [(pos[i], *rest) for i, *rest in starting if i in pos])
        return results

    def _run_sharing(self, requests: Sequence[InferenceRequest], starting: list,
                     capture_updates: bool) -> list[InferenceResult]:
        """LeRobot's chunks for `requests`, keeping the prefix cache of the rows in `starting`."""
        captured: list = []

        def keep_cache(_module: Any, _args: Any, kwargs: dict) -> None:
            captured.append((kwargs.get("past_key_values"), kwargs.get("attention_mask")))

        handle = self._language_model.layers[0].register_forward_pre_hook(keep_cache, with_kwargs=True)
        try:
            results = super().run(requests, capture_updates=capture_updates)
        finally:
            handle.remove()
        if len(captured) != 1 or captured[0][0] is None or captured[0][1] is None:
            raise PolicyError(f"{self.path}: pi0.5's prefix pass was not seen ({len(captured)} passes): "
                              "LeRobot's sample_actions changed?")
        self.text.start(*captured[0], starting, requests)
        return results

    def _prefill(self, requests: Sequence[InferenceRequest], starting: list) -> None:
        """LeRobot's prefix pass alone (what ``sample_actions`` runs before denoising, with LeRobot's
        own functions) for text-only requests; their generations start from its cache."""
        import torch
        from lerobot.policies.common.vla_utils import (
            make_att_2d_masks,
            prepare_attention_masks_4d,
        )
        from lerobot.utils.constants import (
            OBS_LANGUAGE_ATTENTION_MASK,
            OBS_LANGUAGE_TOKENS,
        )

        if not starting:
            return
        for r in requests:
            check_observation(self.spec, r.state, r.images)
        model = self.policy.model
        try:
            with self._lock, torch.no_grad():
                batch = self.preprocessor(self._stack(requests))
                images, img_masks = self.policy._preprocess_images(batch)
                embs, pad, att = model.embed_prefix(images, img_masks, batch[OBS_LANGUAGE_TOKENS],
                                                    batch[OBS_LANGUAGE_ATTENTION_MASK])
                mask = prepare_attention_masks_4d(make_att_2d_masks(pad, att))
                self._language_model.config._attn_implementation = "eager"  # as sample_actions sets it
                _, cache = model.paligemma_with_expert.forward(
                    attention_mask=mask, position_ids=torch.cumsum(pad, dim=1) - 1, past_key_values=None,
                    inputs_embeds=[embs, None], use_cache=True)
        except Exception as exc:
            raise PolicyError(f"{self.path}: the prefix pass of {len(requests)} request(s) failed: {exc}") from exc
        self.text.start(cache, mask, starting, requests)

    def yield_to_actions(self, waiting: Callable[[], bool] | None) -> None:
        """`waiting()`: whether an observation waits for its actions; a frame of text then stops
        after its floor (`min_tokens_per_frame` steps), between steps (server/engine/serving.py)."""
        self.text.actions_wait = waiting

    def advance(self, max_tokens: int | None = None) -> list[TextUpdate]:
        """Decode one frame's worth of every robot's text (`TextDecoder.advance`)."""
        return self.text.advance(max_tokens)
