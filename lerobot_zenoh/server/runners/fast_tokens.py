"""The FAST action-token format, read and decoded by this project's own code (no torch, no code from
the checkpoint).

A FAST action tokenizer folder (Physical Intelligence's ``fast``, LeRobot's
``fast-action-tokenizer``, or the one `train_fast_tokenizer` writes) is data plus, on the hub, a
Python module that ``AutoProcessor(..., trust_remote_code=True)`` would import and run. The data is
all that decoding needs:

- ``processor_config.json``: ``scale`` (the DCT quantization factor), ``min_token`` (the smallest
  quantized coefficient seen in training), ``vocab_size`` (BPE entries), optionally ``time_horizon``
  and ``action_dim``;
- ``tokenizer.json``: a byte-level BPE over strings whose characters are quantized DCT coefficients
  (character code = coefficient - ``min_token``).

A chunk ``(T, D)`` is encoded as: orthonormal DCT-II along time, ``round(coeff * scale)``, flattened
time-major (all dimensions of frequency 0, then frequency 1, ...), each coefficient as one character,
the string BPE-encoded. Decoding inverts it: token strings concatenated, byte-level bytes -> UTF-8 ->
one coefficient per character, padded with zeros or cut to ``T * D`` (LeRobot's "relaxed" decoding),
divided by ``scale``, inverse DCT. A token sequence that is not valid UTF-8 after the byte mapping is
*refused* (`FastDecodeError`) instead of being decoded into replacement characters. docs/policies.md
("pi0-FAST") and docs/security.md say why no shipped code is run.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROCESSOR_CONFIG = "processor_config.json"
TOKENIZER_JSON = "tokenizer.json"


class FastFormatError(ValueError):
    """The folder is not a FAST tokenizer this module can decode (message says what is wrong)."""


class FastDecodeError(ValueError):
    """A token sequence that does not decode to coefficients (not valid UTF-8 after the byte mapping)."""


@functools.cache
def byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's printable stand-in for each byte) -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@functools.cache
def dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``C`` (``coeffs = C @ x`` along time; its inverse is ``C.T``)."""
    k = np.arange(n)[:, None]
    t = np.arange(n)[None, :]
    c = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * t + 1) * k / (2 * n))
    c[0] /= np.sqrt(2.0)
    return c


@dataclass(frozen=True)
class FastActionTokenizer:
    """A FAST tokenizer's data: the BPE vocabulary (id -> token string) and the quantization."""

    vocab: tuple[str, ...]
    scale: float
    min_token: int
    time_horizon: int | None = None
    action_dim: int | None = None
    folder: Path | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @classmethod
    def from_folder(cls, folder: str | Path) -> FastActionTokenizer:
        """Read a FAST folder's data (never its code). `FastFormatError` saying what is wrong."""
        folder = Path(folder)
        try:
            proc = json.loads((folder / PROCESSOR_CONFIG).read_text())
            tok = json.loads((folder / TOKENIZER_JSON).read_text())
        except (OSError, ValueError) as exc:
            raise FastFormatError(f"{folder}: needs {PROCESSOR_CONFIG} and {TOKENIZER_JSON}: {exc}") from exc
        try:
            scale = float(proc["scale"])
            min_token = int(proc["min_token"])
            declared = int(proc.get("vocab_size", 0)) or None
        except (KeyError, TypeError, ValueError) as exc:
            raise FastFormatError(f"{folder / PROCESSOR_CONFIG}: needs numeric scale and min_token ({exc})") from exc
        if not scale > 0:
            raise FastFormatError(f"{folder / PROCESSOR_CONFIG}: scale must be > 0, got {scale}")
        model = tok.get("model") or {}
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise FastFormatError(f"{folder / TOKENIZER_JSON}: not a BPE tokenizer (model.type {model.get('type')!r})")
        decoder = (tok.get("decoder") or {}).get("type")
        if decoder != "ByteLevel":
            raise FastFormatError(f"{folder / TOKENIZER_JSON}: decoder {decoder!r}; the FAST format is byte-level "
                                  "BPE (decoder ByteLevel)")
        by_id: dict[int, str] = {}
        for token, idx in model["vocab"].items():
            by_id[int(idx)] = token
        for added in tok.get("added_tokens") or ():
            by_id.setdefault(int(added["id"]), added["content"])
        n = max(by_id) + 1 if by_id else 0
        if sorted(by_id) != list(range(n)):
            raise FastFormatError(f"{folder / TOKENIZER_JSON}: token ids are not 0..{n - 1} without gaps")
        if declared is not None and declared < n:
            raise FastFormatError(f"{folder / PROCESSOR_CONFIG}: vocab_size {declared} but {TOKENIZER_JSON} has {n} "
                                  "tokens")

        def _opt(name: str) -> int | None:
            value = proc.get(name)
            return None if value is None else int(value)

        return cls(vocab=tuple(by_id[i] for i in range(n)), scale=scale, min_token=min_token,
                   time_horizon=_opt("time_horizon"), action_dim=_opt("action_dim"), folder=folder)

    # -- decoding ------------------------------------------------------------------------------------

    def coefficients(self, tokens: Iterable[int]) -> np.ndarray:
        """FAST token ids -> the quantized DCT coefficients they spell (int64, flat)."""
        table = byte_decoder()
        try:
            raw = bytes(table[ch] for t in tokens for ch in self.vocab[int(t)])
        except (KeyError, IndexError) as exc:
            raise FastDecodeError(f"token outside the byte-level vocabulary ({exc})") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FastDecodeError(f"tokens do not spell valid UTF-8 ({exc.reason})") from exc
        return np.fromiter((ord(c) for c in text), dtype=np.int64, count=len(text)) + self.min_token

    def decode(self, tokens: Sequence[int], time_horizon: int, action_dim: int) -> np.ndarray:
        """FAST token ids -> the float64 ``(time_horizon, action_dim)`` chunk (normalized units)."""
        coeffs = self.coefficients(tokens).astype(np.float64)
        n = time_horizon * action_dim
        coeffs = coeffs[:n] if coeffs.size >= n else np.pad(coeffs, (0, n - coeffs.size))
        return dct_matrix(time_horizon).T @ (coeffs.reshape(time_horizon, action_dim) / self.scale)

    # -- encoding (for tests and the builder) ----------------------------------------------------------

    def coefficient_string(self, chunk: np.ndarray) -> str:
        """A ``(T, D)`` chunk -> the string of its quantized coefficients (what the BPE encodes)."""
        chunk = np.asarray(chunk, dtype=np.float64)
        q = np.around(dct_matrix(chunk.shape[0]) @ chunk * self.scale).astype(np.int64).reshape(-1)
        return "".join(map(chr, np.maximum(q - self.min_token, 0)))


def train_fast_tokenizer(chunks: Sequence[np.ndarray], folder: str | Path, *, vocab_size: int = 1024,
                         scale: float = 10.0) -> FastActionTokenizer:
    """Fit a FAST tokenizer on ``(T, D)`` chunks (normalized units) and save it to `folder` in the
    standard layout (``tokenizer.json`` + ``tokenizer_config.json`` + ``processor_config.json``),
    without any Python module. Returns it as read back by `FastActionTokenizer.from_folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    t, d = np.asarray(chunks[0]).shape
    quantized = [np.around(dct_matrix(t) @ np.asarray(c, dtype=np.float64) * scale).astype(np.int64).reshape(-1)
                 for c in chunks]
    lo = int(min(q.min() for q in quantized))
    hi = int(max(q.max() for q in quantized))
    if hi - lo + 1 > vocab_size:
        raise ValueError(f"coefficient range {hi - lo + 1} exceeds vocab_size {vocab_size}: raise vocab_size")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=10000)
    bpe.train_from_iterator(("".join(map(chr, q - lo)) for q in quantized), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=bpe, clean_up_tokenization_spaces=False).save_pretrained(folder)
    processor: dict[str, Any] = {"scale": scale, "min_token": lo, "vocab_size": bpe.get_vocab_size(),
                                 "time_horizon": t, "action_dim": d}
    (folder / PROCESSOR_CONFIG).write_text(json.dumps(processor, indent=2) + "\n")
    return FastActionTokenizer.from_folder(folder)


def encode_with(folder: str | Path, tokenizer: FastActionTokenizer, chunk: np.ndarray) -> list[int]:
    """A chunk's FAST token ids through the folder's own BPE (``tokenizers`` reading tokenizer.json: data only)."""
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(Path(folder) / TOKENIZER_JSON))
    return bpe.encode(tokenizer.coefficient_string(chunk)).ids
