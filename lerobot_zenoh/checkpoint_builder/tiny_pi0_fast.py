"""What the checkpoint builder needs to make a pi0-FAST offline: its two tokenizers and its shapes.

- `save_paligemma_style_tokenizer`: a byte-level BPE trained with `tokenizers` on a few sentences
  (with ``Action:``, ``|``, digits: what pi0-FAST's prompts and answers contain), padded with unused
  entries to PaliGemma's 257,152 ids, because LeRobot maps FAST token ``t`` to text id
  ``vocab_size - 1 - fast_skip_tokens - t`` (the last ids of the vocabulary).
- `synthetic_chunks`: smooth random ``(T, D)`` chunks in normalized units, what the FAST tokenizer
  (`fast_tokens.train_fast_tokenizer`) is fitted on.
- `PI0_FAST_SHAPES`: the ``tiny`` (tests) and ``small`` (measurements) architectures, applied at
  construction by `tiny_pi.tiny_policy_class` (LeRobot fixes the Gemma sizes by variant name)
  and recorded in the checkpoint sidecar's ``test_architecture``.

Builder-only: the runner never imports this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PALIGEMMA_VOCAB_SIZE = 257_152

_GEMMA = ("gemma_2b", "gemma_300m")

#: name -> (test_architecture for `tiny_pi`, config fields). ``tiny``: Gemma 32 wide x 2 layers, SigLIP
#: 32 wide x 1 layer on 56x56 (16 image tokens per camera), prompts of 48 tokens. ``small``: Gemma 256
#: wide x 6 layers (8 heads of 32), SigLIP 128 wide x 2 layers at 224 px (256 image tokens per camera),
#: prompts of 200 tokens (LeRobot's default).
PI0_FAST_SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny": (
        {"gemma": {v: {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 8, "num_kv_heads": 1, "head_dim": 8}
                   for v in _GEMMA},
         "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "patch_size": 14, "image_size": 56},
         "image_resolution": [56, 56]},
        {"image_resolution": (56, 56), "tokenizer_max_length": 48},
    ),
    "small": (
        {"gemma": {v: {"width": 256, "depth": 6, "mlp_dim": 1024, "num_heads": 8, "num_kv_heads": 1,
                       "head_dim": 32} for v in _GEMMA},
         "vision": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "patch_size": 14, "image_size": 224},
         "image_resolution": [224, 224]},
        {"image_resolution": (224, 224), "tokenizer_max_length": 200},
    ),
}

_CORPUS = (
    "Task: pick up the red cube and place it in the bowl, State: 12 40 255 0 7 128;\n",
    "Task: open the drawer then close it, State: 3 99 101 250 31 64;\n",
    "Task: fold the towel on the table, State: 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20;\n",
    "Task: push the green block to the left, State: 21 22 23 24 25 26 27 28 29 30 0 1 2;\n",
    "Action: |",
)


def save_paligemma_style_tokenizer(folder: Path) -> Any:
    """Train the text tokenizer, pad it to 257,152 ids, save it (transformers fast tokenizer) to
    `folder` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(_CORPUS) * 4, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), PALIGEMMA_VOCAB_SIZE):  # unused entries up to PaliGemma's size
        vocab[f"<unused{i}>"] = i
    padded = Tokenizer.from_str(json.dumps(data))
    fast = PreTrainedTokenizerFast(tokenizer_object=padded, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    if fast.vocab_size != PALIGEMMA_VOCAB_SIZE:
        raise RuntimeError(f"padded tokenizer has {fast.vocab_size} ids, expected {PALIGEMMA_VOCAB_SIZE}")
    fast.save_pretrained(folder)
    return fast


def synthetic_chunks(time_horizon: int, action_dim: int, n: int = 3000, seed: int = 0) -> list[np.ndarray]:
    """`n` smooth random chunks (offset + one sinusoid per dimension + a little noise), normalized units."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 1.0, time_horizon)[:, None]
    out = []
    for _ in range(n):
        offset = rng.normal(0, 0.5, (1, action_dim))
        amp = rng.normal(0, 0.5, (1, action_dim))
        freq = rng.uniform(0.2, 1.5, (1, action_dim))
        phase = rng.uniform(0, 1, (1, action_dim))
        out.append(offset + amp * np.sin(2 * np.pi * (freq * t + phase)) + rng.normal(0, 0.02, (time_horizon,
                                                                                               action_dim)))
    return out


def script_end_of_action(policy: Any, preprocessor: Any, spec: Any, *, end_token: int, fast_tokens: Any,
                         target_tokens: float = 36.0, probe_steps: int = 120, probes: int = 8, seed: int = 0) -> float:
    """Arrange a random-weight pi0-FAST so that greedy decoding speaks the FAST grammar: FAST tokens,
    then the end-of-action token after ~`target_tokens` of them (observation-dependent lengths).

    Random weights alone never emit ``|`` and wander over the whole 257,152-entry vocabulary, so every
    request would end at the decode limit. Here the LM head rows of every id outside the FAST range
    (and ``|``), and of FAST tokens that are not plain ASCII bytes (so that every sequence is valid
    UTF-8), are scaled by 0.01, so the argmax is such a FAST token, and the ``|`` row is set to the
    probes' mean hidden direction times the factor that makes them stop after `target_tokens` tokens
    on average. That factor is found without trial decodes: with ``|`` suppressed, the trajectory up
    to the stop does not depend on it, so one probe decode records, per step, the factor above which
    ``|`` would win. The embedding table is set equal to the head first (LeRobot's loader copies the
    head into it anyway).
    Returns the factor. Builder-only; the weights are then saved like any others.
    """
    import torch
    from lerobot.policies import prepare_observation_for_inference
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS
    from lerobot.utils.feature_utils import build_dataset_frame

    from lerobot_zenoh.server.runners.decode_batch import BatchDecoder, DecodeRequest
    from lerobot_zenoh.server.runners.fast_tokens import byte_decoder

    model = policy.model
    head = model.paligemma_with_expert.paligemma.lm_head.weight
    vocab = head.shape[0]
    skip = int(policy.config.fast_skip_tokens)
    hi = vocab - 1 - skip  # FAST token 0
    keep = torch.zeros(vocab, dtype=torch.bool)
    for t, token in enumerate(fast_tokens.vocab):  # tokens of ASCII bytes: any sequence is valid UTF-8
        if all(byte_decoder()[ch] < 0x80 for ch in token):
            keep[hi - t] = True
    keep[end_token] = True
    rng = np.random.default_rng(seed)
    features = spec.observation_features()
    prefixes = []
    with torch.no_grad():
        head[~keep] *= 0.01
        embed = model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight
        embed.copy_(head)  # LeRobot's loader copies the head into the embedding table anyway
        for i in range(probes):
            values: dict[str, Any] = {n: float(v) for n, v in zip(spec.state_names, rng.normal(0, 0.5, spec.state_dim),
                                                                 strict=True)}
            for cam, (h, w) in spec.cameras.items():
                values[cam] = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            frame = build_dataset_frame(features, values, prefix="observation")
            batch = preprocessor(prepare_observation_for_inference(frame, torch.device("cpu"), "pick the cube", None))
            images, img_masks = policy._preprocess_images(batch)
            tokens = batch[OBS_LANGUAGE_TOKENS]
            masks = batch[OBS_LANGUAGE_ATTENTION_MASK]
            bos = torch.full((1, 1), policy._paligemma_tokenizer.bos_token_id, dtype=torch.long)
            tokens = torch.cat([tokens, bos], dim=1)
            masks = torch.cat([masks, torch.ones((1, 1), dtype=torch.bool)], dim=1)
            embs, pad, att, _, _ = model.embed_prefix_fast(images, img_masks, tokens, masks)
            prefixes.append(DecodeRequest(i, embs, pad, att))

    best_fast: list[list[float]] = []  # per probe row, per step: the best FAST logit
    hiddens: list[list[Any]] = []  # ... and the normalized hidden state

    class _Probe(BatchDecoder):
        def _greedy(self, hidden):  # the head's argmax without `|`, recording what `|` would need
            logits = self._lm_head(hidden).float()
            logits[:, end_token] = -float("inf")
            best = logits.max(dim=-1)
            for row in range(hidden.shape[0]):
                if len(best_fast) <= row:
                    best_fast.append([])
                    hiddens.append([])
                best_fast[row].append(float(best.values[row]))
                hiddens[row].append(hidden[row].float())
            return best.indices.tolist()

    probe = _Probe(model, end_token=end_token, max_new_tokens=probe_steps, n_slots=probes,
                   max_prefix_len=prefixes[0].embs.shape[1])
    probe.run_all(prefixes)
    # The `|` row points along the probes' mean hidden state, so its logit is mostly positive and
    # varies with the observation and the tokens so far; its length decides when it wins.
    # Orthogonal to the first step's (the prefill's) mean, so that a request rarely ends before its
    # first FAST token.
    direction = torch.stack([h for row in hiddens for h in row[1:]]).mean(dim=0)
    first = torch.stack([row[0] for row in hiddens]).mean(dim=0)
    first /= first.norm()
    direction -= (direction @ first) * first
    direction /= direction.norm()
    needed = [[m / float(h @ direction) if float(h @ direction) > 0 and m > 0 else float("inf")
               for m, h in zip(ms, hs, strict=True)] for ms, hs in zip(best_fast, hiddens, strict=True)]

    def mean_length(factor: float) -> float:
        return float(np.mean([next((t for t, f in enumerate(row) if f < factor), probe_steps) for row in needed]))

    low, high = 0.0, 1.0
    while mean_length(high) > target_tokens and high < 1e6:
        high *= 1.5
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if mean_length(mid) > target_tokens else (low, mid)
    with torch.no_grad():
        head[end_token] = (high * direction).to(head.dtype)
        embed[end_token] = head[end_token]  # never an input: decoding stops at it
    return high
