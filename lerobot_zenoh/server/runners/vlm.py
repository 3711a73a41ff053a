"""A vision-language model as a task component: System 2 text, or a safety / monitor verdict.

Loads a Hugging Face image-text-to-text checkpoint folder (SmolVLM / Idefics3 family, or any model
`AutoModelForImageTextToText` and `AutoProcessor` load, with an ``<image>`` token in its processor)
with ``from_pretrained``, as a user's fine-tuned VLM is loaded; `checkpoint.build_tiny_vlm` writes a
tiny random-weight one offline for tests. One request's input is the prompt after one ``<image>`` per
camera (the spec's camera order); the robot's state is checked and ignored.

- ``output: text``: greedy generation of up to `max_new_tokens` tokens; the text is the new tokens,
  decoded without special tokens and stripped.
- ``output: verdict``: the label whose tokens are the most likely continuation of image + prompt
  (the sum of the label tokens' log-probabilities, each label after one space), among the labels the
  component asks for (its task descriptor's, `ComponentQuery.labels`) or else the configured ones;
  `score` is that label's softmax probability over the candidates' log-likelihoods.

The prompt is the component's (`ComponentQuery.prompt`, from the task descriptor) when it gives one,
else the configured one. Greedy and no dropout: a result depends on its request only (pure).

Text is generated with iteration-level batching (docs/policies.md, "VLM components"): the requests of
a call whose inputs have the same token length (the same prompt and cameras: every robot of a
component) are prefilled in one forward pass, then decode one token per step together; a row that
reaches an end-of-sequence token or `max_new_tokens` leaves the batch at that token boundary (its
cache rows are dropped), so a long answer never makes the others wait and a finished one costs
nothing more. Without padding, each row's tokens are those of ``generate`` on it alone (tested).
Verdicts are scored one request at a time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from lerobot_zenoh.config import Settings, VerdictLabels
from lerobot_zenoh.errors import PolicyError
from lerobot_zenoh.protocol.messages import SAFETY_LABELS
from lerobot_zenoh.server.runners.base import (
    COMPONENT_EXTRA,
    BaseRunner,
    ComponentQuery,
    InferenceRequest,
    InferenceResult,
    PolicySpec,
    RunnerCapabilities,
    check_observation,
)
from lerobot_zenoh.protocol.reasons import OutputKind

log = logging.getLogger(__name__)


class VlmSettings(Settings):
    """What a VLM component answers and how: the manifest entry's `vlm` block (docs/server.md), whose
    `pretrained_path` is then a transformers image-text-to-text folder (e.g. SmolVLM), not a LeRobot
    policy.

    ``output: text`` (System 2) generates up to `max_new_tokens`; ``output: verdict`` (safety, monitor)
    answers the most likely of `labels` (or of the pipeline item's labels) with its probability.
    `prompt` is used when the pipeline item gives none. `state_dim` and `cameras` are the robot's
    observation the server checks (the state is ignored; each camera is one image of the prompt)."""

    config_prefix = "vlm"

    output: Literal["text", "verdict"]
    prompt: str = ""
    max_new_tokens: int = Field(16, ge=1, le=1024, strict=True)
    labels: VerdictLabels = ()
    state_dim: int = Field(6, ge=1)
    cameras: dict[str, tuple[int, int]] = Field(default_factory=lambda: {"front": (96, 128)}, min_length=1)

    @model_validator(mode="after")
    def _labels_fit_output(self):
        if self.labels and self.output != OutputKind.VERDICT:
            raise ValueError("labels apply to output 'verdict' only")
        return self


class VlmRunner(BaseRunner):
    """A `PolicyRunner` answering text or verdicts with a transformers VLM (module docstring)."""

    def __init__(self, model, processor, settings: VlmSettings, *, fps: int | None = None, device: str = "cpu"):
        self.model = model
        self.processor = processor
        self.settings = settings
        self.device = device
        cameras = dict(settings.cameras)  # at least one (VlmSettings)
        self.spec = PolicySpec(
            policy_type="vlm",
            state_names=tuple(f"state_{i}" for i in range(settings.state_dim)),
            cameras=cameras,
            action_names=("none",),  # no actions: the status' action fields are placeholders
            chunk_size=1,
            fps=fps,
            capabilities=RunnerCapabilities(max_batch=None, output=settings.output),
        )
        self.image_token = getattr(processor, "image_token", None) or "<image>"
        self._label_ids: dict[str, list[int]] = {}
        self.batches = 0  # prefill batches of text generation (one per input shape per call)
        self.decode_steps = 0  # batched decode steps

    def figures(self) -> dict[str, float]:
        """``vlm.*``: batched prefills and decode steps of text generation (docs/telemetry.md)."""
        return {"vlm.prefill_batches": self.batches, "vlm.decode_steps": self.decode_steps}

    @classmethod
    def from_pretrained(cls, path: str | Path, settings: VlmSettings, *, fps: int | None = None,
                        device: str = "cpu", dtype: str = "float32", field_prefix: str = "") -> VlmRunner:
        """Load the VLM folder `path` (model + processor, as ``save_pretrained`` wrote them); PolicyError
        naming the path when it cannot be loaded or lacks weights."""
        path = Path(path)
        try:
            import torch
            from transformers import AutoModelForImageTextToText, AutoProcessor

            torch_dtype = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
            model, info = AutoModelForImageTextToText.from_pretrained(
                path, dtype=torch_dtype, output_loading_info=True)
            processor = AutoProcessor.from_pretrained(path)
        except Exception as exc:  # a folder transformers cannot read as an image-text-to-text model
            raise PolicyError(f"{path}: not a loadable VLM folder ({field_prefix}pretrained_path): "
                              f"{type(exc).__name__}: {exc}") from exc
        missing = list(info.get("missing_keys") or ())
        if missing:  # transformers warns and initialises them at random: refuse instead
            raise PolicyError(f"{path}: the VLM's weights lack {len(missing)} tensors (e.g. {missing[0]}); "
                              "is model.safetensors there?")
        model.to(device).eval().requires_grad_(False)  # served, never trained (no autograd records)
        return cls(model, processor, settings, fps=fps, device=device)

    # -- the seam -------------------------------------------------------------------------------

    def warmup(self) -> None:
        """One dummy inference; a verdict VLM whose labels come from its pipeline items only is warmed
        up on the safety labels (the cost is the same per label)."""
        from lerobot_zenoh.server.runners.base import dummy_observation

        state, images = dummy_observation(self.spec)
        extras = {}
        if self.settings.output == OutputKind.VERDICT and not self.settings.labels:
            extras[COMPONENT_EXTRA] = ComponentQuery("", "", "", SAFETY_LABELS)
        self.run([InferenceRequest("\x00warmup", state, images, "", 0, extras=extras)])

    def run(self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False) -> list[InferenceResult]:
        for r in requests:
            check_observation(self.spec, r.state, r.images)
        if self.settings.output != OutputKind.TEXT:
            return [self._one(r) for r in requests]
        inputs = [self._inputs(r) for r in requests]
        groups: dict[tuple, list[int]] = {}  # same input shapes: one batch without padding
        for i, x in enumerate(inputs):
            groups.setdefault(tuple((k, tuple(v.shape)) for k, v in sorted(x.items())), []).append(i)
        results: list[InferenceResult | None] = [None] * len(requests)
        for rows in groups.values():
            for i, text in zip(rows, self._generate([inputs[i] for i in rows]), strict=True):
                results[i] = InferenceResult.of_text(text)
        self.batches += len(groups)
        return results  # type: ignore[return-value]

    def run_one_at_a_time(self, requests: Sequence[InferenceRequest]) -> list[InferenceResult]:
        """Each request alone with transformers' ``generate`` (what `run` did before batching; the
        reference its tokens are tested and benchmarked against)."""
        for r in requests:
            check_observation(self.spec, r.state, r.images)
        return [self._one(r) for r in requests]

    def _prompt(self, request: InferenceRequest) -> str:
        component = request.extras.get(COMPONENT_EXTRA)
        return component.prompt if component is not None and component.prompt else self.settings.prompt

    def _inputs(self, request: InferenceRequest) -> dict:
        images = [request.images[cam] for cam in self.spec.cameras]
        inputs = self.processor(text=[self.image_token * len(images) + self._prompt(request)], images=[images],
                                return_tensors="pt")
        return {k: v.to(self.device) for k, v in inputs.items()}

    def _generate(self, inputs: list[dict]) -> list[str]:
        """Greedy text for same-shaped inputs: one prefill for all, then one decode step per token for
        the rows still generating; a finished row leaves the batch (and its cache) at once."""
        import torch

        eos = self.model.generation_config.eos_token_id
        stop = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        batch = {k: torch.cat([x[k] for x in inputs]) for k in inputs[0]}
        n = len(inputs)
        tokens: list[list[int]] = [[] for _ in range(n)]
        alive = list(range(n))  # request index of each batch row
        with torch.no_grad():
            out = self.model(**batch, use_cache=True)
            cache, mask = out.past_key_values, batch["attention_mask"]
            logits = out.logits[:, -1]
            for _ in range(self.settings.max_new_tokens):
                nxt = logits.argmax(dim=-1)
                keep = []
                for row, (i, t) in enumerate(zip(alive, nxt.tolist(), strict=True)):
                    tokens[i].append(t)
                    if t not in stop and len(tokens[i]) < self.settings.max_new_tokens:
                        keep.append(row)
                if not keep:
                    break
                if len(keep) < len(alive):  # finished rows leave at this token boundary
                    idx = torch.tensor(keep, device=mask.device)
                    cache.batch_select_indices(idx)
                    mask, nxt = mask.index_select(0, idx), nxt.index_select(0, idx)
                    alive = [alive[r] for r in keep]
                mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1]
                self.decode_steps += 1
        decode = self.processor.tokenizer.decode
        return [decode(t, skip_special_tokens=True).strip() for t in tokens]

    def _one(self, request: InferenceRequest) -> InferenceResult:
        import torch

        component = request.extras.get(COMPONENT_EXTRA)
        inputs = self._inputs(request)
        with torch.no_grad():
            if self.settings.output == OutputKind.TEXT:
                out = self.model.generate(**inputs, max_new_tokens=self.settings.max_new_tokens, do_sample=False)
                new = out[0, inputs["input_ids"].shape[1]:]
                return InferenceResult.of_text(self.processor.tokenizer.decode(new, skip_special_tokens=True).strip())
            labels = (component.labels if component is not None and component.labels else self.settings.labels)
            if not labels:
                raise PolicyError("no labels to choose from (vlm.labels, or the pipeline item's labels)")
            scores = [self._log_likelihood(inputs, label) for label in labels]
        best = int(np.argmax(scores))
        top = max(scores)
        probs = [math.exp(s - top) for s in scores]
        return InferenceResult.of_verdict(labels[best], probs[best] / sum(probs))

    def _log_likelihood(self, inputs: dict, label: str) -> float:
        """log P(label tokens | image + prompt): one forward pass over the prompt followed by the label."""
        import torch

        ids = self._label_ids.get(label)
        if ids is None:
            ids = self._label_ids[label] = self.processor.tokenizer(" " + label, add_special_tokens=False)["input_ids"]
        label_ids = torch.tensor([ids], dtype=inputs["input_ids"].dtype, device=self.device)
        full = dict(inputs)
        full["input_ids"] = torch.cat([inputs["input_ids"], label_ids], dim=1)
        full["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(label_ids)], dim=1)
        logits = self.model(**full).logits[0].float()
        n = inputs["input_ids"].shape[1]
        logp = torch.log_softmax(logits[n - 1: n - 1 + len(ids)], dim=-1)
        return float(logp[torch.arange(len(ids)), label_ids[0]].sum())
