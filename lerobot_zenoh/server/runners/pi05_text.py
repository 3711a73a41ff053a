"""The text side of a pi0.5 serving actions and language from one prefill (`Pi05LanguageRunner`,
runners/pi05_language.py): the settings of a manifest's ``language`` block, what a request asks
(`LanguageQuery`), the per-frame decode budget (`DecodeBudget`) and the decode state of every robot's
generation (`TextDecoder`).

`TextDecoder` owns the generations: started from a copy of a row of LeRobot's prefix cache
(`start`), each appends its prompt in one batched forward (its first token) and then decodes one
token per step, every robot's unfinished generation in one batch, for the frame's budget (`advance`:
cross-frame continuous batching). It calls PaliGemma's language model and `lm_head` directly and
never touches the action expert; the runner hands it the prefix caches and takes its `TextUpdate`s.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, model_validator

from lerobot_zenoh.config import Settings
from lerobot_zenoh.errors import ConfigError, ProtocolError
from lerobot_zenoh.protocol.reasons import Reason
from lerobot_zenoh.server.runners.base import InferenceRequest

#: `InferenceRequest.extras` key of a request that also asks this observation's text: a `LanguageQuery`.
LANGUAGE_EXTRA = "language"
#: Action calls whose slowest bounds a frame of text under an SLO (`DecodeBudget.frame_ms`).
ACTION_WINDOW = 32


class LanguageSettings(Settings):
    """How a pi0.5 runner decodes language (a manifest entry's ``language`` block).

    - `prompt`: appended after the shared prefix when the component gives none (a language-trained
      checkpoint defines what it expects).
    - `max_new_tokens`: the token limit of one generation; a query asking more is refused.
    - `tokens_per_frame`: the decode budget per frame (steps of the batched decode per `advance`);
      `min_tokens_per_frame` the floor it shrinks to when actions near their SLO.
    - `max_prompt_tokens`: a longer prompt is refused (``prompt_too_long``).
    - `stop`: strings that end a generation (each must be one token of the tokenizer), besides its
      end-of-sequence token.
    - `max_requests`, `max_cached_tokens`: the memory cap (generations, KV entries); the oldest is
      evicted beyond it.
    - `action_slo_ms`: the actions' latency SLO; when set, a frame of text may take the SLO less 10 %
      less the slowest recent action call, and its prompt passes and steps are fitted into that
      from their measured times (`DecodeBudget`).
    """

    config_prefix = "language"

    prompt: str = Field("Subtask:", min_length=1)  # the text continues it: never empty
    max_new_tokens: int = Field(32, ge=1, le=4096, strict=True)
    tokens_per_frame: int = Field(4, ge=1, le=1024, strict=True)
    min_tokens_per_frame: int = Field(1, ge=0, strict=True)
    max_prompt_tokens: int = Field(32, ge=1, le=4096, strict=True)
    stop: tuple[str, ...] = ()
    max_requests: int = Field(16, ge=1, le=4096, strict=True)
    max_cached_tokens: int = Field(65536, ge=1, strict=True)
    action_slo_ms: float | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _floor(self):
        if self.min_tokens_per_frame > self.tokens_per_frame:
            raise ValueError(f"min_tokens_per_frame {self.min_tokens_per_frame} is more than "
                             f"tokens_per_frame {self.tokens_per_frame}")
        return self


@dataclass(frozen=True)
class LanguageQuery:
    """What one observation asks of the language side: the prompt (empty: the settings'), the token
    limit (None: the settings'), `tag`, echoed in its `TextUpdate`s (the server's seq id), and
    whether the same observation also asks for actions (`actions`; False: a text-only request runs
    LeRobot's prefix pass alone and its result carries no actions)."""

    prompt: str = ""
    max_new_tokens: int | None = None
    tag: Any = None
    actions: bool = True


@dataclass(frozen=True)
class TextUpdate:
    """A generation's text so far (`final`: done; `reason` ``stop`` or ``limit``)."""

    session_id: str
    tag: Any
    text: str
    tokens: int
    final: bool
    reason: str | None = None


class DecodeBudget:
    """What one frame of text (`TextDecoder.advance`) may cost, declared against the actions' SLO.

    Without `action_slo_ms`: `tokens_per_frame` decode steps and every pending prompt pass. With it,
    a frame may take ``frame_ms() = slo * (1 - margin) - the slowest of the last 32 action calls``.
    The server decodes text only while no observation waits and stops a frame between steps when one
    arrives (server/engine/serving.py, `TextDecoder.actions_wait`), so an observation waits at most that long
    (usually one step) before its own call starts: its action latency stays within the SLO. The frame's prompt passes (`admits`) and decode steps
    (`tokens`, and a check of the clock between steps) are fitted into it from their measured times;
    at least `min_tokens_per_frame` steps, and one prompt pass when nothing runs: that floor is all
    text may cost the actions when the SLO leaves no room.

    Pure (no torch, no clock): `observe` takes measured times (EWMA per step and per prompt pass).
    """

    def __init__(self, settings: LanguageSettings, *, margin: float = 0.1, alpha: float = 0.2):
        self.settings = settings
        self.margin = margin
        self.alpha = alpha
        self._actions: deque[float] = deque(maxlen=ACTION_WINDOW)
        self.step_ms: float | None = None
        self.admit_ms: float | None = None  # one generation's share of a prompt pass

    @property
    def action_ms(self) -> float | None:
        """The slowest recent action call (what an observation waiting behind text then pays)."""
        return max(self._actions, default=None)

    def observe(self, *, action_ms: float | None = None, step_ms: float | None = None,
                admit_ms: float | None = None) -> None:
        if action_ms is not None:
            self._actions.append(action_ms)
        if step_ms is not None:
            self.step_ms = step_ms if self.step_ms is None else self.step_ms + self.alpha * (step_ms - self.step_ms)
        if admit_ms is not None:
            self.admit_ms = admit_ms if self.admit_ms is None else self.admit_ms + self.alpha * (admit_ms - self.admit_ms)

    def frame_ms(self) -> float | None:
        """The time one frame of text may take (None: no SLO, or no action measured yet)."""
        s = self.settings
        if s.action_slo_ms is None or self.action_ms is None:
            return None
        return max(0.0, s.action_slo_ms * (1 - self.margin) - self.action_ms)

    def tokens(self) -> int:
        s = self.settings
        frame = self.frame_ms()
        if frame is None or not self.step_ms:
            return s.tokens_per_frame
        return max(s.min_tokens_per_frame, min(s.tokens_per_frame, math.floor(frame / self.step_ms)))

    def admits(self, pending: int, running: int) -> int:
        """How many of `pending` generations (oldest first) get their prompt pass this frame."""
        frame = self.frame_ms()
        if frame is None:
            return pending
        floor = 1 if running == 0 else 0  # text never starves: one prompt pass when nothing runs
        if self.admit_ms is None:
            return min(pending, 1)  # one, to measure what a prompt pass costs
        room = frame - (self.step_ms or 0.0) * self.settings.min_tokens_per_frame  # the floor's steps go too
        return min(pending, max(floor, math.floor(max(0.0, room) / max(self.admit_ms, 1e-6))))


@dataclass
class _Generation:
    session_id: str
    tag: Any
    prompt_ids: list[int]
    max_new_tokens: int
    started: int  # admission order (oldest = smallest)
    # Pending (before `advance` appends its prompt): its prefix cache, one row.
    keys: list | None = None
    values: list | None = None
    valid: Any = None  # (1, L) bool
    next_pos: int = 0
    tokens: list[int] = field(default_factory=list)
    done: str | None = None  # stop | limit | evicted | forgotten
    reported: int = 0  # tokens already reported


class _Running:
    """The batched decode state of every running generation (OxyGen's batched state): per layer keys
    and values ``(B, kv_heads, L, head_dim)``, ``valid`` ``(B, L)`` (a generation that joined later has
    invalid columns where others have tokens), the next position of each row and its last token
    (generated, not yet in the cache)."""

    def __init__(self) -> None:
        self.rows: list[_Generation] = []
        self.keys: list = []
        self.values: list = []
        self.valid: Any = None
        self.positions: Any = None
        self.last: Any = None

    @property
    def width(self) -> int:
        return 0 if self.valid is None else int(self.valid.shape[1])

    def cached_tokens(self, extra_columns: int = 0) -> int:
        return len(self.rows) * (self.width + extra_columns)

    def join(self, rows: list[_Generation], keys: list, values: list, valid: Any, positions: Any, last: Any) -> None:
        import torch

        if not self.rows:
            self.rows, self.keys, self.values, self.valid, self.positions, self.last = (
                list(rows), keys, values, valid, positions, last)
            return
        width = max(self.width, int(valid.shape[1]))

        def pad(t: Any, n: int) -> Any:  # right-pad the sequence dimension to `width`
            if n == width:
                return t
            shape = list(t.shape)
            shape[-2 if t.dim() == 4 else -1] = width - n
            return torch.cat([t, t.new_zeros(shape)], dim=-2 if t.dim() == 4 else -1)

        w_old, w_new = self.width, int(valid.shape[1])
        self.keys = [torch.cat([pad(a, w_old), pad(b, w_new)]) for a, b in zip(self.keys, keys, strict=True)]
        self.values = [torch.cat([pad(a, w_old), pad(b, w_new)]) for a, b in zip(self.values, values, strict=True)]
        self.valid = torch.cat([pad(self.valid, w_old), pad(valid, w_new)])
        self.positions = torch.cat([self.positions, positions])
        self.last = torch.cat([self.last, last])
        self.rows += rows

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (indices, in order), and drop columns no kept row uses."""
        import torch

        if len(keep) == len(self.rows):
            return
        if not keep:
            self.__init__()
            return
        idx = torch.tensor(keep, device=self.valid.device)
        valid = self.valid.index_select(0, idx)
        used = valid.any(dim=0)
        cols = None if bool(used.all()) else used.nonzero().flatten()
        def take(t: Any) -> Any:
            t = t.index_select(0, idx)
            return t if cols is None else t.index_select(2, cols)

        self.keys = [take(k) for k in self.keys]
        self.values = [take(v) for v in self.values]
        self.valid = valid if cols is None else valid.index_select(1, cols)
        self.positions = self.positions.index_select(0, idx)
        self.last = self.last.index_select(0, idx)
        self.rows = [self.rows[i] for i in keep]



class TextDecoder:
    """Every robot's generation of one pi0.5: pending (a prefix cache, before its prompt pass) and
    running (the batched decode state), under the runner's `lock`; `counters` for telemetry.

    `language_model`, `lm_head`: PaliGemma's; `embed_tokens(ids)`: its token embeddings;
    `tokenizer`: the checkpoint's."""

    def __init__(self, language_model: Any, lm_head: Any, embed_tokens: Callable[[Any], Any], tokenizer: Any,
                 lock: threading.Lock | threading.RLock):
        self._language_model = language_model
        self.lm_head = lm_head
        self._embed_tokens = embed_tokens
        self._tokenizer = tokenizer
        self._lock = lock
        self.vocab = min(len(tokenizer), int(lm_head.weight.shape[0]))
        self.settings = LanguageSettings()
        self.budget = DecodeBudget(self.settings)
        self.stop_ids: frozenset[int] = frozenset()
        self._pending: dict[str, _Generation] = {}
        self.running = _Running()
        self._admitted = 0
        self.actions_wait: Callable[[], bool] | None = None  # the server's: an observation waits (yield)
        self.counters: dict[str, int] = {
            "started": 0, "finished.stop": 0, "finished.limit": 0, "evicted": 0, "forgotten": 0, "busy": 0,
            "tokens": 0, "decode_steps": 0, "budget_shrunk": 0,
            # Decode cost (lerobot-zenoh-profile reads them from telemetry): the time of every
            # `advance` (prompt passes and steps), of the decode steps alone, and the rows they decoded.
            "decode_ms": 0, "step_ms": 0, "step_rows": 0,
        }
        self.configure(self.settings)

    def configure(self, settings: LanguageSettings) -> None:
        """Take `settings` (stop strings must each be one token: `ConfigError` naming the field)."""
        stop = set()
        eos = self._tokenizer.eos_token_id
        if eos is not None:
            stop.add(int(eos))
        for s in settings.stop:
            ids = self._tokenizer(s, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ConfigError("language.stop", f"{s!r} is {len(ids)} tokens of this tokenizer, not one")
            stop.add(int(ids[0]))
        self.settings = settings
        self.budget = DecodeBudget(settings)
        self.stop_ids = frozenset(stop)

    @property
    def active(self) -> int:
        """Generations pending or running."""
        return len(self._pending) + len(self.running.rows)

    def writing(self, session_id: str) -> bool:
        """Whether the session's generation is pending or running."""
        return session_id in self._pending or any(g.session_id == session_id for g in self.running.rows)

    def figures(self) -> dict[str, float]:
        """Counters for telemetry (``language.*``)."""
        out: dict[str, float] = {f"language.{k}": v for k, v in self.counters.items()}
        out["language.active"] = self.active
        out["language.cached_tokens"] = self.running.cached_tokens()
        return out

    def forget(self, session_id: str) -> None:
        """Drop the session's generation (pending or running)."""
        gone = self._pending.pop(session_id, None) is not None
        keep = [i for i, g in enumerate(self.running.rows) if g.session_id != session_id]
        if len(keep) != len(self.running.rows):
            self.running.keep(keep)
            gone = True
        if gone:
            self.counters["forgotten"] += 1

    def prompt_ids(self, query: LanguageQuery) -> list[int]:
        prompt = query.prompt or self.settings.prompt
        ids = self._tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ProtocolError(Reason.PROMPT_TOO_LONG, "the prompt has no tokens")  # only an empty prompt
        if len(ids) > self.settings.max_prompt_tokens:
            raise ProtocolError(Reason.PROMPT_TOO_LONG, f"the prompt is {len(ids)} tokens, at most "
                                                   f"{self.settings.max_prompt_tokens} (language.max_prompt_tokens)")
        return list(ids)

    def token_limit(self, query: LanguageQuery) -> int:
        n = query.max_new_tokens
        if n is None:
            return self.settings.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.settings.max_new_tokens:
            raise ProtocolError(Reason.TEXT_OVER_TOKEN_LIMIT, f"asks {n!r} new tokens, at most "
                                                         f"{self.settings.max_new_tokens} (language.max_new_tokens)")
        return n

    def start(self, cache: Any, mask: Any, starting: list, requests: Sequence[InferenceRequest]) -> None:
        """Copy each asking row's prefix cache out of the call's (the call's is freed with it).

        `mask` is the prefix pass's additive 4D attention mask: every prefix token attends to every
        valid one (pi0.5's prefix is bidirectional), so the row of the first (image) token gives the
        valid columns: 0 where valid, the large negative constant at the padding of the task tokens."""
        layers = [(k, v) for k, v, *_ in cache]
        for i, prompt_ids, limit, tag in starting:
            valid = mask[i: i + 1, 0, 0, :] == 0
            self._admitted += 1
            self._pending[requests[i].session_id] = _Generation(
                session_id=requests[i].session_id, tag=tag, prompt_ids=prompt_ids, max_new_tokens=limit,
                started=self._admitted,
                keys=[k[i: i + 1].clone() for k, _ in layers], values=[v[i: i + 1].clone() for _, v in layers],
                valid=valid, next_pos=int(valid.sum()))
            self.counters["started"] += 1

    def advance(self, max_tokens: int | None = None) -> list[TextUpdate]:
        """Decode one frame's worth (`DecodeBudget`; `max_tokens`: that many steps, unbudgeted): pending
        generations append their prompt (first token), then every running generation decodes one token
        per step, in one batch. Returns the text updates (new tokens, final answers)."""
        import torch

        if not self.active:
            return []
        budget = self.budget
        frame_ms = budget.frame_ms() if max_tokens is None else None
        steps = budget.tokens() if max_tokens is None else max_tokens
        floor = min(self.settings.min_tokens_per_frame, steps)
        shrunk = steps < self.settings.tokens_per_frame
        with self._lock, torch.no_grad():
            t_start = time.perf_counter()
            waits = self.actions_wait if max_tokens is None else None
            admits = None if max_tokens is not None else budget.admits(len(self._pending), len(self.running.rows))
            if waits is not None and waits():  # an observation waits: the least that keeps text going
                admits = min(admits, 0 if self.running.rows else 1)
            admitted = self._admit_pending(admits)
            t0 = time.perf_counter()
            if admitted:
                budget.observe(admit_ms=(t0 - t_start) * 1000 / admitted)
            done_steps = 0
            for _ in range(steps):
                if not any(g.done is None for g in self.running.rows):
                    break
                if done_steps >= floor and ((waits is not None and waits()) or (
                        frame_ms is not None
                        and (time.perf_counter() - t_start) * 1000 + (budget.step_ms or 0.0) > frame_ms)):
                    shrunk = True  # an observation waits, or the clock says the frame is spent
                    break
                while self.running.rows and self.running.cached_tokens(1) > self.settings.max_cached_tokens:
                    self._evict_running_oldest()
                if not self.running.rows:
                    break
                self._step()
                done_steps += 1
            t_end = time.perf_counter()
            if done_steps:
                budget.observe(step_ms=(t_end - t0) * 1000 / done_steps)
            self.counters["budget_shrunk"] += shrunk or bool(self._pending)
            self.counters["decode_ms"] += (t_end - t_start) * 1000
            self.counters["step_ms"] += (t_end - t0) * 1000
            updates = self._updates()
            self.running.keep([i for i, g in enumerate(self.running.rows) if g.done is None])
        return updates

    def _admit_pending(self, limit: int | None) -> int:
        """Append the prompt of each pending generation (the `limit` oldest; None: all) to its prefix
        cache (one batched forward, prompts right-padded and masked) and take its first token; then
        join them to the running batch. Returns how many were admitted; the others wait."""
        import torch

        if not self._pending or limit == 0:
            return 0
        pending = sorted(self._pending.values(), key=lambda g: g.started)
        pending, later = (pending, []) if limit is None else (pending[:limit], pending[limit:])
        self._pending = {g.session_id: g for g in later}
        # A generation that joins needs room: the oldest running (or pending) ones make way.
        fits = list(pending)
        s = self.settings
        while len(fits) + len(self.running.rows) > s.max_requests:
            if self.running.rows:
                self._evict_running_oldest()
            else:
                fits.pop(0).done = "evicted"
                self.counters["evicted"] += 1
        if not fits:
            return 0
        device = fits[0].valid.device
        widths = [int(g.valid.shape[1]) for g in fits]
        prompt_len = max(len(g.prompt_ids) for g in fits)
        width = max(widths)
        keys, values, valids = [], [], []
        for g, w in zip(fits, widths, strict=True):
            pad = width - w
            keys.append([torch.nn.functional.pad(k, (0, 0, 0, pad)) for k in g.keys])
            values.append([torch.nn.functional.pad(v, (0, 0, 0, pad)) for v in g.values])
            valids.append(torch.nn.functional.pad(g.valid, (0, pad), value=False))
            g.keys = g.values = None
        n_layers = len(keys[0])
        k_b = [torch.cat([row[layer] for row in keys]) for layer in range(n_layers)]
        v_b = [torch.cat([row[layer] for row in values]) for layer in range(n_layers)]
        valid = torch.cat(valids)
        ids = torch.zeros((len(fits), prompt_len), dtype=torch.long, device=device)
        prompt_valid = torch.zeros((len(fits), prompt_len), dtype=torch.bool, device=device)
        positions = torch.zeros((len(fits), prompt_len), dtype=torch.long, device=device)
        for r, g in enumerate(fits):
            n = len(g.prompt_ids)
            ids[r, :n] = torch.tensor(g.prompt_ids, device=device)
            prompt_valid[r, :n] = True
            positions[r] = g.next_pos + torch.arange(prompt_len, device=device).clamp(max=n - 1)
        last = torch.tensor([len(g.prompt_ids) - 1 for g in fits], device=device)
        logits, k_b, v_b = self._forward(ids, k_b, v_b, valid, prompt_valid, positions, last=last)
        first = self._greedy(logits[:, -1])
        valid = torch.cat([valid, prompt_valid], dim=1)
        next_pos = torch.tensor([g.next_pos + len(g.prompt_ids) for g in fits], device=device)
        for g, t in zip(fits, first.tolist(), strict=True):
            self._take(g, int(t))
        self.running.join(fits, k_b, v_b, valid, next_pos, first)
        return len(fits)

    def _evict_running_oldest(self) -> None:
        rows = self.running.rows
        oldest = min(range(len(rows)), key=lambda i: rows[i].started)
        if rows[oldest].done is None:
            rows[oldest].done = "evicted"
            self.counters["evicted"] += 1
        self.running.keep([i for i in range(len(rows)) if i != oldest])

    def _step(self) -> None:
        """One decode step of the whole running batch: each row's last token in, its next token out."""
        import torch

        run = self.running
        b = len(run.rows)
        new_valid = torch.tensor([[g.done is None] for g in run.rows], dtype=torch.bool, device=run.valid.device)
        logits, run.keys, run.values = self._forward(run.last[:, None], run.keys, run.values, run.valid,
                                                     torch.ones((b, 1), dtype=torch.bool, device=run.valid.device),
                                                     run.positions[:, None])
        nxt = self._greedy(logits[:, -1])
        # A finished row's column is masked (its token decoded nothing it will use).
        run.valid = torch.cat([run.valid, new_valid], dim=1)
        run.positions = run.positions + 1
        run.last = nxt
        for g, t in zip(run.rows, nxt.tolist(), strict=True):
            if g.done is None:
                self._take(g, int(t))
        self.counters["decode_steps"] += 1
        self.counters["step_rows"] += b

    def _take(self, g: _Generation, token: int) -> None:
        if token in self.stop_ids:
            g.done = "stop"
            self.counters["finished.stop"] += 1
            return
        g.tokens.append(token)
        self.counters["tokens"] += 1
        if len(g.tokens) >= g.max_new_tokens:
            g.done = "limit"
            self.counters["finished.limit"] += 1

    def _forward(self, ids: Any, keys: list, values: list, valid: Any, new_valid: Any, positions: Any, last=None):
        """PaliGemma's language model over `ids` ``(B, T)`` at `positions`, attending to the cached
        columns where `valid` and causally among the new tokens (`new_valid` masks padding); returns
        the logits ``(B, T, V)`` (`last` ``(B,)``: of that position of each row only, ``(B, 1, V)``, all
        a prompt pass reads: `lm_head`'s 257,152 rows per position were most of its cost) and the
        cache extended by the T new columns."""
        import torch
        from lerobot.policies.common.vla_utils import prepare_attention_masks_4d
        from transformers import DynamicCache
        b, t = ids.shape
        cache = DynamicCache(tuple((k, v, None) for k, v in zip(keys, values, strict=True)))
        causal = torch.tril(torch.ones((t, t), dtype=torch.bool, device=ids.device))
        new = causal[None] & new_valid[:, None, :]
        new = new | torch.eye(t, dtype=torch.bool, device=ids.device)[None]  # a padding row sees itself
        past = valid[:, None, :].expand(b, t, valid.shape[1])
        mask = prepare_attention_masks_4d(torch.cat([past, new], dim=2))
        embeds = self._embed_tokens(ids)
        self._language_model.config._attn_implementation = "eager"  # as LeRobot's sample_actions sets it
        out = self._language_model.forward(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                           past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state
        if last is not None:
            hidden = hidden[torch.arange(b, device=hidden.device), last][:, None]
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
        layers = [(k, v) for k, v, *_ in out.past_key_values]
        return logits, [k for k, _ in layers], [v for _, v in layers]


    def _greedy(self, logits: Any) -> Any:
        """Most likely token among those the tokenizer can decode."""
        return logits[..., : self.vocab].argmax(dim=-1)


    def _updates(self) -> list[TextUpdate]:
        out = []
        for g in self.running.rows:
            if g.done == "evicted":
                continue
            if len(g.tokens) == g.reported and g.done is None:
                continue
            g.reported = len(g.tokens)
            text = self._tokenizer.decode(g.tokens, skip_special_tokens=True).strip()
            out.append(TextUpdate(g.session_id, g.tag, text, len(g.tokens), g.done is not None, g.done))
        return out
