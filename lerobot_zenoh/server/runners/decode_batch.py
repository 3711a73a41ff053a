"""Iteration-level continuous batching of pi0-FAST's token decoding across robots.

The unit of scheduling is one decode step (Orca / vLLM): requests from different robots join the
running batch at a token boundary and leave it the step they finish, so the batch never waits for
its slowest member. Pieces:

- `KvSlots`: the bounded KV cache. One preallocated buffer per layer, ``(slots, kv_heads, max_len,
  head_dim)``; a request holds one slot from its prefill to its last token, with its own length and
  key-validity row (its prompt's padding stays masked). Slots are the memory bound: a request waits
  when none is free, and a request dropped while it holds one (its session forgotten) is an
  *eviction*, counted.
- `_SlotCache`: what the Gemma layers see as ``past_key_values`` for one forward: ``update`` writes
  each new key/value at its request's slot and position and returns the keys/values the queries
  attend to. Three layouts: a prefill (joiners, ``(J, P)``), a decode step (``(B, 1)``: each row its
  own slot up to the longest length, the rest masked), and ActionFlow's packed forward (joiners'
  prefill tokens and the running rows' decode tokens flattened into one ``(1, J*P + B)`` sequence,
  each token attending only to its own request's keys: one big matrix multiply per weight instead
  of a prefill plus a decode step).
- `BatchDecoder`: the waiting queue, the running set and the step loop. ``submit`` queues a
  request (its prefix embeddings); ``step`` admits waiting requests into free slots (the injected
  `RequestScheduler`, e.g. wait ratio, picks who when there are more than slots), runs their prefill
  (``join="separate"``) or packs it with the running rows' decode step (``join="packed"``), appends
  one greedy token to every running request and returns the ones that finished: with the
  end-of-action token, or at ``max_new_tokens`` without it (``reason="decode_limit"``).

Greedy decoding makes a request's tokens a function of its own prefix only; a row never sees
another row's keys (masked), so batching changes at most float rounding, and the tokens (hence the
decoded chunk) equal those of the request decoded alone (tested bit for bit on the tiny model; see
docs/policies.md "pi0-FAST"). The layers, norms, rotary embeddings and LM head are LeRobot's own
modules; only the cache layout and the masks are this module's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lerobot_zenoh.errors import PolicyError

#: LeRobot's additive mask value for a masked key (``prepare_attention_masks_4d``; finite, so a fully
#: masked row gives no NaN).
_MASKED = -2.3819763e38

JOIN_MODES = ("separate", "packed")
#: When waiting requests are admitted: at every step (``iteration``: continuous batching) or only
#: when nothing is running (``idle``: static batching, the batch waits for its slowest request; kept
#: for the benchmark's comparison).
ADMIT_MODES = ("iteration", "idle")


@dataclass
class DecodeRequest:
    """One request's prefix, ready to decode: embeddings ``(1, P, W)``, its padding mask ``(1, P)``
    and its prefix attention mask ``(1, P, P)`` (LeRobot's `embed_prefix_fast`)."""

    key: Hashable
    embs: torch.Tensor
    pad: torch.Tensor
    att: torch.Tensor
    arrived_s: float = 0.0


@dataclass
class DecodeResult:
    """A finished request: its generated token ids (without the end token), and why it stopped
    (``"end"``: the end-of-action token; ``"decode_limit"``: `max_new_tokens` without it)."""

    key: Hashable
    tokens: list[int]
    reason: str
    arrived_s: float = 0.0
    admitted_s: float = 0.0
    finished_s: float = 0.0


@dataclass
class _Running:
    request: DecodeRequest
    slot: int
    prefix_len: int  # P (padded prompt length: the first generated key goes at P)
    n_valid: int  # the prompt's unpadded length (the first generated token's position id)
    tokens: list[int] = field(default_factory=list)  # generated; the last one is the next input
    admitted_s: float = 0.0


class KvSlots:
    """The bounded KV cache: `n_slots` requests of up to `max_len` keys each, per layer."""

    def __init__(self, n_layers: int, n_slots: int, kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device):
        if n_slots < 1 or max_len < 1:
            raise PolicyError(f"KV cache needs >= 1 slot and length, got {n_slots} x {max_len}")
        shape = (n_slots, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.valid = torch.zeros((n_slots, max_len), dtype=torch.bool, device=device)
        self.n_slots = n_slots
        self.max_len = max_len
        self._free = list(range(n_slots))
        self.allocations = 0
        self.evictions = 0

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        slot = self._free.pop(0)
        self.valid[slot] = False
        self.allocations += 1
        return slot

    def release(self, slot: int, *, evicted: bool = False) -> None:
        self._free.append(slot)
        self._free.sort()
        if evicted:
            self.evictions += 1

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class _SlotCache:
    """``past_key_values`` of one forward: writes the new keys/values into `KvSlots` and returns what
    the queries attend to (see the module docstring for the three layouts)."""

    def __init__(self, kv: KvSlots, mode: str, slots: torch.Tensor, write_pos: torch.Tensor,
                 read_len: int, n_prefill: int = 0, prefill_len: int = 0):
        self.kv = kv
        self.mode = mode
        self.slots = slots  # slots of the rows (packed: joiners first, then decoders)
        self.write_pos = write_pos  # decode rows: the position each new key goes to
        self.read_len = read_len
        self.n_prefill = n_prefill
        self.prefill_len = prefill_len

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only used when cache_position is None
        return 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any,
               **__: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv.keys[layer_idx], self.kv.values[layer_idx]
        if self.mode == "prefill":  # (J, H, P, D): rows are whole prompts
            keys[self.slots, :, : key_states.shape[2]] = key_states
            values[self.slots, :, : value_states.shape[2]] = value_states
            return key_states, value_states
        if self.mode == "decode":  # (B, H, 1, D)
            keys[self.slots, :, self.write_pos] = key_states[:, :, 0]
            values[self.slots, :, self.write_pos] = value_states[:, :, 0]
            return keys[self.slots, :, : self.read_len], values[self.slots, :, : self.read_len]
        # packed: (1, H, J*P + B, D)
        j, p = self.n_prefill, self.prefill_len
        pre_slots, dec_slots = self.slots[:j], self.slots[j:]
        if j:
            ks = key_states[0, :, : j * p].reshape(key_states.shape[1], j, p, -1).transpose(0, 1)
            vs = value_states[0, :, : j * p].reshape(value_states.shape[1], j, p, -1).transpose(0, 1)
            keys[pre_slots, :, :p] = ks
            values[pre_slots, :, :p] = vs
        if len(dec_slots):
            keys[dec_slots, :, self.write_pos] = key_states[0, :, j * p:].transpose(0, 1)
            values[dec_slots, :, self.write_pos] = value_states[0, :, j * p:].transpose(0, 1)
        n = len(self.slots)
        k = keys[self.slots, :, : self.read_len].transpose(0, 1).reshape(1, keys.shape[1], n * self.read_len, -1)
        v = values[self.slots, :, : self.read_len].transpose(0, 1).reshape(1, keys.shape[1], n * self.read_len, -1)
        return k, v


@dataclass
class StepTimes:
    """Seconds spent per kind of forward, and how many (for the benchmark's per-token figures)."""

    prefill_s: float = 0.0
    prefills: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    packed_s: float = 0.0
    packed: int = 0


class BatchDecoder:
    """Greedy token decoding of many requests at once, joining and leaving at token boundaries.

    `model` is LeRobot's ``PI0FastPytorch`` (its PaliGemma language model and LM head are used).
    `end_token` stops a request; `max_new_tokens` bounds it (the configured limit). `n_slots` bounds
    the running batch and the KV memory; `max_prefix_len` the prompt length a slot holds.
    `scheduler` (a `scheduling.request_schedulers.RequestScheduler`) picks who joins when more are
    waiting than slots are free; requests are then keyed by a string. `join`: ``"separate"`` (a
    prefill forward, then the next step's decode) or ``"packed"`` (prefill tokens and decode tokens in
    one forward). `admit`: ``"iteration"`` (join at any step) or ``"idle"`` (static batching). `clock` is
    injected for tests.
    """

    def __init__(self, model: Any, *, end_token: int, max_new_tokens: int, n_slots: int, max_prefix_len: int,
                 scheduler: Any = None, join: str = "separate", admit: str = "iteration",
                 clock: Callable[[], float] = time.perf_counter):
        if join not in JOIN_MODES:
            raise PolicyError(f"join must be one of {', '.join(JOIN_MODES)}, got {join!r}")
        if admit not in ADMIT_MODES:
            raise PolicyError(f"admit must be one of {', '.join(ADMIT_MODES)}, got {admit!r}")
        self.admit_mode = admit
        if max_new_tokens < 1:
            raise PolicyError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        paligemma = model.paligemma_with_expert.paligemma
        self._model = model
        self._lm = paligemma.model.language_model
        self._lm_head = paligemma.lm_head
        text = self._lm.config
        param = self._lm.layers[0].self_attn.q_proj.weight
        self._dtype = param.dtype
        self.kv = KvSlots(text.num_hidden_layers, n_slots, text.num_key_value_heads,
                          max_prefix_len + max_new_tokens, text.head_dim, dtype=param.dtype, device=param.device)
        self.end_token = int(end_token)
        self.max_new_tokens = int(max_new_tokens)
        self.max_prefix_len = int(max_prefix_len)
        self.scheduler = scheduler
        self.join_mode = join
        self.clock = clock
        self.device = param.device
        self._waiting: OrderedDict[Hashable, DecodeRequest] = OrderedDict()
        self._running: dict[Hashable, _Running] = {}
        self.times = StepTimes()
        self.finished_end = 0
        self.finished_limit = 0

    # -- the queue -----------------------------------------------------------------------------------

    def submit(self, request: DecodeRequest) -> None:
        """Queue `request` (it joins at a later step). A key already waiting or running is refused."""
        if request.key in self._waiting or request.key in self._running:
            raise PolicyError(f"request {request.key!r} is already being decoded")
        if request.embs.shape[1] > self.max_prefix_len:
            raise PolicyError(f"prompt of {request.embs.shape[1]} tokens exceeds the KV slot's {self.max_prefix_len}")
        self._waiting[request.key] = request
        if self.scheduler is not None:
            self.scheduler.on_arrival(request.key, request.arrived_s)

    def cancel(self, key: Hashable) -> bool:
        """Drop a waiting or running request (its session is gone); a running one is an eviction."""
        if self._waiting.pop(key, None) is not None:
            if self.scheduler is not None:
                self.scheduler.forget(key)
            return True
        run = self._running.pop(key, None)
        if run is None:
            return False
        self.kv.release(run.slot, evicted=True)
        return True

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    def keys(self) -> list[Hashable]:
        """The requests running, then those waiting."""
        return [*self._running, *self._waiting]

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, int | float]:
        return {"slots": self.kv.n_slots, "running": len(self._running), "waiting": len(self._waiting),
                "kv_bytes": self.kv.bytes, "kv_allocations": self.kv.allocations, "kv_evictions": self.kv.evictions,
                "finished_end": self.finished_end, "finished_limit": self.finished_limit,
                "prefills": self.times.prefills, "prefill_ms": self.times.prefill_s * 1000,
                "decode_steps": self.times.decode_steps, "decode_rows": self.times.decode_rows,
                "decode_ms": self.times.decode_s * 1000, "packed_steps": self.times.packed,
                "packed_ms": self.times.packed_s * 1000}

    # -- the step ------------------------------------------------------------------------------------

    def step(self) -> list[DecodeResult]:
        """Admit who fits, advance every running request by one token, return those that finished."""
        joiners = self._admit()
        finished: list[DecodeResult] = []
        decoders = [r for r in self._running.values() if r.tokens]
        with torch.no_grad():
            if joiners and self.join_mode == "packed" and decoders:
                self._packed(joiners, decoders)
            else:
                if joiners:
                    self._prefill(joiners)
                if decoders:
                    self._decode(decoders)
        now = self.clock()
        for run in [*joiners, *decoders]:
            reason = None
            if run.tokens[-1] == self.end_token:
                reason = "end"
                self.finished_end += 1
            elif len(run.tokens) >= self.max_new_tokens:
                reason = "decode_limit"
                self.finished_limit += 1
            if reason is not None:
                del self._running[run.request.key]
                self.kv.release(run.slot)
                tokens = run.tokens[:-1] if reason == "end" else list(run.tokens)
                finished.append(DecodeResult(run.request.key, tokens, reason, run.request.arrived_s,
                                             run.admitted_s, now))
                if self.scheduler is not None:
                    self.scheduler.on_served([run.request.key], now, now - run.admitted_s)
        return finished

    def _admit(self) -> list[_Running]:
        free = self.kv.free
        if not free or not self._waiting or (self.admit_mode == "idle" and self._running):
            return []
        keys = list(self._waiting)
        if len(keys) > free and self.scheduler is not None:
            keys = list(self.scheduler.pick(keys, self.clock(), max_batch=free))[:free]
        else:
            keys = keys[:free]
        now = self.clock()
        out = []
        for key in keys:
            request = self._waiting.pop(key)
            run = _Running(request, self.kv.allocate(), int(request.embs.shape[1]), int(request.pad.sum()),
                           admitted_s=now)
            self._running[key] = run
            out.append(run)
        return out

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        logits = self._lm_head(hidden)  # (N, V)
        return torch.argmax(logits, dim=-1).tolist()

    def _forward(self, embs: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: _SlotCache):
        out = self._lm.forward(inputs_embeds=embs, attention_mask=mask, position_ids=positions,
                               past_key_values=cache, use_cache=True, adarms_cond=None)
        return out.last_hidden_state

    def _prefill(self, joiners: Sequence[_Running]) -> None:
        t0 = time.perf_counter()
        lengths = {r.prefix_len for r in joiners}
        groups = [[r for r in joiners if r.prefix_len == p] for p in sorted(lengths)]
        for group in groups:
            embs = torch.cat([r.request.embs for r in group]).to(self._dtype)
            pad = torch.cat([r.request.pad for r in group])
            att = torch.cat([r.request.att for r in group])
            slots = torch.tensor([r.slot for r in group], device=self.device)
            positions = torch.cumsum(pad, dim=1) - 1
            mask = torch.where(att[:, None], 0.0, _MASKED).to(self._dtype)
            cache = _SlotCache(self.kv, "prefill", slots, torch.empty(0), 0)
            hidden = self._forward(embs, mask, positions, cache)
            self.kv.valid[slots, : pad.shape[1]] = pad
            for r, tok in zip(group, self._greedy(hidden[:, -1]), strict=True):
                r.tokens.append(tok)
        self.times.prefill_s += time.perf_counter() - t0
        self.times.prefills += len(joiners)

    def _decode_inputs(self, decoders: Sequence[_Running]):
        slots = torch.tensor([r.slot for r in decoders], device=self.device)
        fed = [len(r.tokens) - 1 for r in decoders]  # generated tokens already in the cache
        write = torch.tensor([r.prefix_len + f for r, f in zip(decoders, fed, strict=True)], device=self.device)
        positions = torch.tensor([[r.n_valid + f] for r, f in zip(decoders, fed, strict=True)], device=self.device)
        tokens = torch.tensor([[r.tokens[-1]] for r in decoders], device=self.device)
        embs = self._model.paligemma_with_expert.embed_language_tokens(tokens).to(self._dtype)  # (B, 1, W)
        self.kv.valid[slots, write] = True
        return slots, write, positions, embs, int(write.max()) + 1

    def _decode(self, decoders: Sequence[_Running]) -> None:
        t0 = time.perf_counter()
        slots, write, positions, embs, read_len = self._decode_inputs(decoders)
        mask = torch.where(self.kv.valid[slots, :read_len][:, None, None], 0.0, _MASKED).to(self._dtype)
        cache = _SlotCache(self.kv, "decode", slots, write, read_len)
        hidden = self._forward(embs, mask, positions, cache)
        for r, tok in zip(decoders, self._greedy(hidden[:, -1]), strict=True):
            r.tokens.append(tok)
        self.times.decode_s += time.perf_counter() - t0
        self.times.decode_steps += 1
        self.times.decode_rows += len(decoders)

    def _packed(self, joiners: Sequence[_Running], decoders: Sequence[_Running]) -> None:
        """ActionFlow's packed forward: the joiners' prompts and the running rows' next tokens as one
        sequence, each token attending to its own request's keys only."""
        t0 = time.perf_counter()
        p = joiners[0].prefix_len
        if any(r.prefix_len != p for r in joiners):  # prompts of one model have one padded length
            self._prefill(joiners)
            self._decode(decoders)
            return
        j, b = len(joiners), len(decoders)
        dec_slots, write, dec_pos, dec_embs, read_len = self._decode_inputs(decoders)
        read_len = max(read_len, p)
        pre_embs = torch.cat([r.request.embs for r in joiners]).to(self._dtype)  # (J, P, W)
        pad = torch.cat([r.request.pad for r in joiners])
        att = torch.cat([r.request.att for r in joiners])  # (J, P, P)
        pre_slots = torch.tensor([r.slot for r in joiners], device=self.device)
        self.kv.valid[pre_slots, :p] = pad
        slots = torch.cat([pre_slots, dec_slots])
        n = j + b
        q = j * p + b
        allowed = torch.zeros((q, n * read_len), dtype=torch.bool, device=self.device)
        for i in range(j):
            allowed[i * p:(i + 1) * p, i * read_len: i * read_len + p] = att[i]
        for k in range(b):
            col = (j + k) * read_len
            allowed[j * p + k, col: col + read_len] = self.kv.valid[dec_slots[k], :read_len]
        mask = torch.where(allowed[None, None], 0.0, _MASKED).to(self._dtype)
        positions = torch.cat([(torch.cumsum(pad, dim=1) - 1).reshape(1, -1), dec_pos.reshape(1, -1)], dim=1)
        embs = torch.cat([pre_embs.reshape(1, j * p, -1), dec_embs.reshape(1, b, -1)], dim=1)
        cache = _SlotCache(self.kv, "packed", slots, write, read_len, n_prefill=j, prefill_len=p)
        hidden = self._forward(embs, mask, positions, cache)[0]  # (Q, W)
        last = torch.cat([hidden[torch.arange(1, j + 1, device=self.device) * p - 1], hidden[j * p:]])
        for r, tok in zip([*joiners, *decoders], self._greedy(last), strict=True):
            r.tokens.append(tok)
        self.times.packed_s += time.perf_counter() - t0
        self.times.packed += 1
        self.times.prefills += j
        self.times.decode_rows += b

    def run_all(self, requests: Sequence[DecodeRequest]) -> list[DecodeResult]:
        """Submit `requests` and step until all finished; results in the order given."""
        for r in requests:
            self.submit(r)
        done: dict[Hashable, DecodeResult] = {}
        while self.busy:
            for res in self.step():
                done[res.key] = res
        return [done[r.key] for r in requests]
