"""pi0-FAST (LeRobot's autoregressive VLA): FAST action tokens decoded greedily, many robots at once.

Loading (docs/policies.md "pi0-FAST", docs/security.md): LeRobot's constructor and its saved
preprocessor load the FAST action tokenizer with ``AutoProcessor(..., trust_remote_code=True)``,
which imports and runs the Python module shipped in that folder. This runner never lets that
happen: it reads the folder's *data* (`fast_tokens.FastActionTokenizer`: BPE vocabulary,
quantization) and decodes the standard FAST format with this project's own code; while LeRobot
builds the policy and the processor, the config's ``action_tokenizer_name`` names the (checked)
text tokenizer folder instead (`without_action_processor`), and afterwards the policy's
``action_tokenizer`` is an adapter over that data. A text-tokenizer folder that declares code of its
own (``auto_map``) is refused. A FAST folder this module cannot decode (not byte-level BPE, a
vocabulary that does not fit the text tokenizer, a horizon or action size other than the
checkpoint's, a probe chunk that does not come back) is refused at start-up naming
``config.json's action_tokenizer_name``.

Serving: each request's prompt (images, task and discretized state, BOS) is embedded by LeRobot's own
``embed_prefix_fast``; `decode_batch.BatchDecoder` decodes all of a call's requests together, each
leaving the batch at its end-of-action token (``|``); the tokens are cut, cleaned of ``Action: ``
(as LeRobot's ``detokenize_actions`` does) and decoded to a normalized chunk, then LeRobot's saved
postprocessor unnormalizes it. A request whose decode reaches ``max_decoding_steps`` without ``|``,
or whose tokens are not FAST tokens, is answered with a counted reason (``decode_limit``,
``undecodable_action_tokens``): no chunk is made from them (LeRobot would return zeros).

RTC does not apply: FAST tokens are DCT coefficients of the *whole* chunk, frequency by frequency,
so a prefix of actions is no prefix of tokens (the manifest's ``rtc.enabled`` is refused at
start-up for this type).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import PolicyError, ProtocolError
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.runners.base import (
    InferenceRequest,
    InferenceResult,
    RunnerCapabilities,
    check_observation,
)
from lerobot_zenoh.server.runners.fast_tokens import FastActionTokenizer, FastDecodeError, FastFormatError
from lerobot_zenoh.server.runners.flow_matching import sidecar_extras, declared_policy_class, resolve_asset
from lerobot_zenoh.server.runners.lerobot import DTYPES, LeRobotRunner, LoadOptions

log = logging.getLogger(__name__)

_ACTION_FIELD = "config.json's action_tokenizer_name"
_TEXT_FIELD = "config.json's text_tokenizer_name"
END_OF_ACTION = "|"
ACTION_PREFIX = "Action: "

#: KV slots (requests decoding at once) of one model; more requests wait for a free slot.
DEFAULT_SLOTS = 16


class DecodeSettings(Settings):
    """How a pi0-FAST runner decodes (a manifest entry's ``decode`` block; docs/policies.md).

    - `slots`: KV slots, the requests decoding at once; each holds one prompt plus its tokens, so
      memory grows with it (`decode.kv_bytes` in telemetry). More requests wait for a free slot.
    - `join`: how a request joins running ones: ``separate`` (its prefill, then the decode step) or
      ``packed`` (its prefill packed into the running rows' decode step).
    """

    config_prefix = "decode"

    slots: int = Field(DEFAULT_SLOTS, ge=1, le=1024, strict=True)
    join: Literal["separate", "packed"] = "separate"


@contextlib.contextmanager
def without_action_processor(config: Any) -> Iterator[None]:
    """While LeRobot builds a pi0-FAST policy or its processors, its ``action_tokenizer_name`` names
    the text tokenizer folder, so that ``AutoProcessor(..., trust_remote_code=True)`` loads a plain
    tokenizer (no code) instead of the FAST folder's module. The field is put back on exit; the
    runner then installs its own FAST decoder (`FastAdapter`)."""
    original = config.action_tokenizer_name
    config.action_tokenizer_name = config.text_tokenizer_name
    try:
        yield
    finally:
        config.action_tokenizer_name = original


class FastAdapter:
    """What LeRobot's ``decode_actions_with_fast`` reads of a FAST processor (``bpe_tokenizer``,
    ``min_token``, ``scale``), over the folder's data; also carries the project's `FastActionTokenizer`."""

    def __init__(self, fast: FastActionTokenizer):
        from transformers import PreTrainedTokenizerFast

        self.fast = fast
        self.min_token = fast.min_token
        self.scale = fast.scale
        # tokenizer.json is data (the `tokenizers` library parses it); no processor class is imported.
        self.bpe_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(fast.folder / "tokenizer.json"),
                                                     clean_up_tokenization_spaces=False)


def check_no_code(folder: Path, field: str) -> None:
    """`PolicyError` naming `field` when a tokenizer folder declares code (``auto_map``) that loading
    it with ``trust_remote_code`` would import."""
    for name in ("tokenizer_config.json", "config.json", "processor_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except ValueError as exc:
            raise PolicyError(f"{field}: {file} is not JSON: {exc}") from exc
        if isinstance(data, dict) and data.get("auto_map"):
            raise PolicyError(f"{field}: {file} declares code (auto_map {data['auto_map']}) that loading it would "
                              "run; the server runs no code from a checkpoint (docs/security.md)")


@dataclass(frozen=True)
class DecodedTokens:
    """A finished request's outcome before unnormalization: its normalized chunk, or why there is none."""

    chunk: np.ndarray | None
    reason: str | None = None
    detail: str = ""


class Pi0FastRunner(LeRobotRunner):
    """A pi0-FAST checkpoint, its requests decoded together by iteration-level batching."""

    supported_dtypes = ("float32", "bfloat16")
    not_compiled = ("its prefill and decode steps grow a KV cache one token at a time and requests join the "
                    "running batch (new shapes every step)")

    @classmethod
    def chunk_size_for(cls, config: Any) -> int:
        return int(config.n_action_steps)  # what LeRobot decodes the tokens into

    @classmethod
    def capabilities_for(cls, config: Any) -> RunnerCapabilities:
        return RunnerCapabilities(max_batch=None, reads_task=True, iteration_level=True,
                                  settings_blocks=(("decode", "configure_decode"),))

    # -- loading -------------------------------------------------------------------------------------

    @classmethod
    def prepare_config(cls, path: Path, config: Any, options: LoadOptions) -> None:
        config.dtype = DTYPES[options.dtype]
        if config.temperature:
            raise PolicyError(f"{path}: config.json's temperature is {config.temperature}; only greedy decoding "
                              "(0) is served (a chunk must depend on its observation only)")
        if config.use_relative_actions:
            # LeRobot's relative-action steps keep the last preprocessed state for the postprocessor;
            # requests of many robots interleave between the two in a running batch.
            raise PolicyError(f"{path}: config.json's use_relative_actions is not served for pi0_fast (the "
                              "processors' shared state would mix robots decoding in one batch)")
        assets = sidecar_extras(path).get("assets", {})
        text = resolve_asset(path, "text tokenizer", config.text_tokenizer_name, _TEXT_FIELD, options.tokenizer_path,
                             assets.get("tokenizer"), options.field("tokenizer_path"), "tokenizer_config.json")
        check_no_code(text, options.field("tokenizer_path") if options.tokenizer_path else f"{path}: {_TEXT_FIELD}")
        fast_folder = resolve_asset(path, "FAST action tokenizer", config.action_tokenizer_name, _ACTION_FIELD,
                                    None, assets.get("action_tokenizer"), f"{path}: {_ACTION_FIELD}",
                                    "processor_config.json")
        if list(fast_folder.glob("*.py")) or _declares_code(fast_folder):
            log.info("%s: %s ships Python code; it is not run: the FAST format is decoded by the server's own code",
                     path, fast_folder)
        config.text_tokenizer_name = str(text)
        config.action_tokenizer_name = str(fast_folder)

    @classmethod
    def load_policy(cls, path: Path, config: Any, options: LoadOptions) -> Any:
        try:
            fast = FastActionTokenizer.from_folder(config.action_tokenizer_name)
        except FastFormatError as exc:
            raise PolicyError(f"{path}: {_ACTION_FIELD}: {exc}") from exc
        check_fast_tokenizer(path, config, fast)  # before the (slow) model is built
        with without_action_processor(config):
            policy = super().load_policy(path, config, options)
        policy.action_tokenizer = FastAdapter(fast)
        return policy

    @classmethod
    def policy_class(cls, path: Path, config: Any) -> type:
        return declared_policy_class(path, config)

    @classmethod
    def cast_policy(cls, policy: Any, dtype: Any) -> None:
        """Built with config.dtype (LeRobot keeps the vision path and norms in float32)."""

    @classmethod
    def preprocessor_overrides(cls, path: Path, config: Any, options: LoadOptions) -> dict[str, Any]:
        from transformers import PreTrainedTokenizerFast

        text = config.text_tokenizer_name
        # The saved action step would load the FAST folder with trust_remote_code; give it a plain
        # object instead (it only tokenizes training actions, never at inference).
        placeholder = PreTrainedTokenizerFast(tokenizer_file=str(Path(config.action_tokenizer_name) / "tokenizer.json"))
        return {"tokenizer_processor": {"tokenizer_name": text},
                "action_tokenizer_processor": {"action_tokenizer_input_object": placeholder,
                                               "trust_remote_code": False, "paligemma_tokenizer_name": text}}

    @classmethod
    def file_key_candidates(cls, key: str) -> tuple[str, ...]:
        return (key, f"model.{key}")

    # -- serving -------------------------------------------------------------------------------------

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        config = self.policy.config
        text = self.policy._paligemma_tokenizer
        self._fast: FastActionTokenizer = self.policy.action_tokenizer.fast
        self._text_vocab = int(text.vocab_size)
        self._skip = int(config.fast_skip_tokens)
        self._end = int(text.convert_tokens_to_ids(END_OF_ACTION))
        self._prefix_ids = list(text.encode(ACTION_PREFIX, add_special_tokens=False))
        self._bos = int(text.bos_token_id)
        self.max_new_tokens = int(config.max_decoding_steps)
        self.slots = DEFAULT_SLOTS
        self.join_mode: str = "separate"
        self.scheduler = None
        self._decoder = None
        self._prefix_len: int | None = None
        from lerobot.processor import TokenizerProcessorStep

        steps = [step for step in self.preprocessor.steps if isinstance(step, TokenizerProcessorStep)]
        if len(steps) != 1:
            raise PolicyError(f"{self.path}: expected one tokenizer step in policy_preprocessor.json, found {len(steps)}")
        self._prompt_tokenizer = steps[0].input_tokenizer
        self.max_prompt_tokens = int(steps[0].max_length)
        self.refusals: dict[str, int] = {}

    def check_request(self, request: InferenceRequest) -> None:
        """`ProtocolError(Reason.TASK_TOO_LONG)` when the prompt LeRobot builds (``Task: <task>, State:
        <one 0..255 bin per state value>;``) could exceed the tokens the model reads: LeRobot's
        tokenizer step would silently cut it, dropping the end of the task and the state. Counted
        with three digits per state value (the longest bin), so a prompt that fits always fits."""
        task = request.task.strip().replace("_", " ").replace("\n", " ")
        prompt = f"Task: {task}, State: {' '.join(['255'] * self.spec.state_dim)};\n"
        n = len(self._prompt_tokenizer(prompt)["input_ids"])
        if n > self.max_prompt_tokens:
            raise ProtocolError(Reason.TASK_TOO_LONG, f"the prompt is up to {n} tokens, pi0_fast reads at most "
                                                 f"{self.max_prompt_tokens} (tokenizer_max_length)")

    def configure_decode(self, settings: DecodeSettings) -> None:
        """Take the manifest's ``decode`` block (before the first request: the decoder is built then)."""
        self.slots, self.join_mode, self._decoder = settings.slots, settings.join, None

    def figures(self) -> dict[str, float]:
        """``decode.*``: the KV slots and the batch decoder's counters (docs/telemetry.md)."""
        return {} if self._decoder is None else {f"decode.{k}": v for k, v in self._decoder.stats().items()}

    def decoder(self):
        """The batch decoder (built on first use: its slots hold this model's prompt length)."""
        if self._decoder is None:
            from lerobot_zenoh.server.runners.decode_batch import BatchDecoder

            self._decoder = BatchDecoder(self.policy.model, end_token=self._end, max_new_tokens=self.max_new_tokens,
                                        n_slots=self.slots, max_prefix_len=self.prefix_len(),
                                        scheduler=self.scheduler, join=self.join_mode)
        return self._decoder

    def prefix_len(self) -> int:
        """Prompt length of one request: image tokens of every camera + the padded text + BOS (the
        tokenizer pads every prompt to ``tokenizer_max_length``), measured once."""
        if self._prefix_len is None:
            state = np.zeros(self.spec.state_dim, dtype=np.float32)
            images = {c: np.zeros((h, w, 3), np.uint8) for c, (h, w) in self.spec.cameras.items()}
            probe = InferenceRequest("\x00probe", state, images, "", 0)
            self._prefix_len = int(self.prefix(probe, key=None).embs.shape[1])
        return self._prefix_len

    def prefix(self, request: InferenceRequest, key: Hashable):
        """The request's prompt embedded by LeRobot's own code (images, task + state, BOS)."""
        import torch
        from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

        from lerobot_zenoh.server.runners.decode_batch import DecodeRequest

        check_observation(self.spec, request.state, request.images)
        with torch.no_grad():
            batch = self._preprocess(request.state, request.images, request.task)
            images, img_masks = self.policy._preprocess_images(batch)
            tokens = batch[OBS_LANGUAGE_TOKENS]
            masks = batch[OBS_LANGUAGE_ATTENTION_MASK]
            bos = torch.full((1, 1), self._bos, dtype=torch.long, device=tokens.device)
            tokens = torch.cat([tokens, bos], dim=1)
            masks = torch.cat([masks, torch.ones((1, 1), dtype=torch.bool, device=tokens.device)], dim=1)
            embs, pad, att, _, _ = self.policy.model.embed_prefix_fast(images, img_masks, tokens, masks)
        return DecodeRequest(key, embs, pad, att)

    def decode_tokens(self, tokens: Sequence[int]) -> DecodedTokens:
        """Generated text ids (end token excluded) -> the normalized ``(T, action_dim)`` chunk, or the
        reason there is none. Mirrors LeRobot's ``detokenize_actions``: every ``Action: `` removed,
        text id ``i`` -> FAST token ``vocab_size - 1 - fast_skip_tokens - i``."""
        ids = list(tokens)
        n = len(self._prefix_ids)
        i = 0
        while n and i <= len(ids) - n:
            if ids[i:i + n] == self._prefix_ids:
                del ids[i:i + n]
            else:
                i += 1
        fast_ids = [self._text_vocab - 1 - self._skip - t for t in ids]
        bad = [t for t, f in zip(ids, fast_ids, strict=True) if not 0 <= f < self._fast.vocab_size]
        if not fast_ids:
            return DecodedTokens(None, "undecodable_action_tokens", "no action tokens before the end marker")
        if bad:
            return DecodedTokens(None, "undecodable_action_tokens",
                                 f"{len(bad)} of {len(ids)} tokens are not FAST tokens (e.g. text id {bad[0]})")
        try:
            chunk = self._fast.decode(fast_ids, self.spec.chunk_size, self.spec.action_dim)
        except FastDecodeError as exc:
            return DecodedTokens(None, "undecodable_action_tokens", str(exc))
        return DecodedTokens(chunk)

    def finish(self, tokens: Sequence[int], reason: str) -> InferenceResult | ProtocolError:
        """A finished decode -> its unnormalized result, or a `ProtocolError` with a counted reason."""
        import torch

        if reason == "decode_limit":
            return self._refuse("decode_limit", f"no end-of-action token in {self.max_new_tokens} tokens "
                                                f"(max_decoding_steps)")
        decoded = self.decode_tokens(tokens)
        if decoded.chunk is None:
            return self._refuse(decoded.reason, decoded.detail)
        with torch.no_grad():
            chunk = torch.as_tensor(decoded.chunk, dtype=torch.float32, device=self.device)[None]
            actions = self.postprocessor(chunk)
        out = actions.detach().to("cpu", torch.float32).numpy()[0]
        return InferenceResult(out, extras={"action_tokens": len(tokens)})

    def _refuse(self, reason: str, detail: str) -> ProtocolError:
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        return ProtocolError(reason, detail)

    def run(self, requests: Sequence[InferenceRequest], *, capture_updates: bool = False) -> list[Any]:
        """Decode every request together (each leaves the batch when it is done). A request that ends
        without a chunk gets its `ProtocolError` in its place (the runner adapter counts its reason)."""
        results: list[Any] = [None] * len(requests)
        self.stream(list(enumerate(requests)), join=lambda: [], emit=lambda key, res: results.__setitem__(key, res))
        return results

    def stream(self, first: Sequence[tuple[Hashable, InferenceRequest]],
               join: Callable[[], Sequence[tuple[Hashable, InferenceRequest]]],
               emit: Callable[[Hashable, Any], None]) -> None:
        """Iteration-level serving: decode `first`; between decode steps, when a KV slot is free, take
        the requests `join()` returns (keys unique among those in flight) into the batch; `emit(key,
        result)` each request the step it finishes. Returns when nothing is left to decode and
        `join()` gives nothing."""
        decoder = self.decoder()
        pending = list(first)
        while True:
            for key, request in pending:
                try:
                    decoder.submit(self.prefix(request, key))
                except Exception as exc:  # a bad observation or a failing vision tower: this request only
                    emit(key, exc)
            if not decoder.busy:
                return
            try:
                done = decoder.step()
            except Exception as exc:  # torch failure mid-step: every request in flight fails, the loop lives
                for key in decoder.keys():
                    decoder.cancel(key)
                    emit(key, PolicyError(f"{self.path}: decode failed: {exc}"))
                return
            for res in done:
                emit(res.key, self.finish(res.tokens, res.reason))
            # Ask for more only when a slot is free: when the batch is full, the observations wait in
            # the server's newest-only slots and its scheduler (e.g. wait ratio) picks who joins next.
            pending = list(join()) if decoder.kv.free > decoder.waiting else []

    def forget(self, session_id: str) -> None:
        """Stateless per session (the prompt is rebuilt from each observation)."""


def _declares_code(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "processor_config.json").read_text()).get("auto_map"))
    except (OSError, ValueError, AttributeError):
        return False


def check_fast_tokenizer(path: Path, config: Any, fast: FastActionTokenizer) -> None:
    """Refuse, naming the checkpoint field, a FAST tokenizer that cannot serve this checkpoint:
    its declared horizon / action size differ from the config's, its token ids do not fit in the text
    vocabulary's FAST range, or a probe chunk does not come back through encode -> decode."""
    from transformers import AutoTokenizer

    where = f"{path}: {_ACTION_FIELD} ({fast.folder})"
    horizon = int(config.n_action_steps)
    action_dim = int(config.output_features["action"].shape[0])
    if fast.time_horizon is not None and fast.time_horizon != horizon:
        raise PolicyError(f"{where}: fitted on chunks of {fast.time_horizon} steps, the checkpoint decodes {horizon}")
    if fast.action_dim is not None and fast.action_dim != action_dim:
        raise PolicyError(f"{where}: fitted on {fast.action_dim} action dimensions, the checkpoint has {action_dim}")
    # As LeRobot loads it (the folder declares no code: checked in prepare_config).
    text = AutoTokenizer.from_pretrained(config.text_tokenizer_name, add_eos_token=True, add_bos_token=False)
    lowest = int(text.vocab_size) - 1 - int(config.fast_skip_tokens) - (fast.vocab_size - 1)
    end = text.convert_tokens_to_ids(END_OF_ACTION)
    if lowest < 0:
        raise PolicyError(f"{where}: {fast.vocab_size} FAST tokens do not fit below the text vocabulary's "
                          f"{text.vocab_size} ids")
    if end is None or end == text.unk_token_id or end >= lowest:
        raise PolicyError(f"{where}: the text tokenizer has no end-of-action token {END_OF_ACTION!r} outside the FAST "
                          "id range")
    from lerobot_zenoh.server.runners.fast_tokens import encode_with

    probe = np.sin(np.linspace(0, np.pi, horizon))[:, None] * np.linspace(-0.8, 0.8, action_dim)[None]
    try:
        ids = encode_with(fast.folder, fast, probe)
        back = fast.decode(ids, horizon, action_dim)
    except (FastDecodeError, ValueError, OSError, Exception) as exc:  # any failure of the probe = unusable
        raise PolicyError(f"{where}: a probe chunk does not decode: {type(exc).__name__}: {exc}") from exc
    error = float(np.abs(back - probe).max())
    if not np.isfinite(error) or error > 10.0 / fast.scale:
        raise PolicyError(f"{where}: a probe chunk comes back {error:.3g} off after encode -> decode (wrong "
                          "vocabulary or scale)")
