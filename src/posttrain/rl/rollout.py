"""Rollouts: sampling responses with a KV cache, behind a small interface a serving engine can
implement instead.

:class:`HFRollout` samples on an unsharded copy of the policy (the engine's full parameters, loaded
into it before each rollout phase), every prompt of a step in one left-padded batch: by default
with posttrain's own decoding loop over the model's forward and ``transformers``' KV cache
(:func:`sample`: rows that ended leave the batch and its cache, and nothing but the tempered,
nucleus-truncated softmax shapes the draw), or with ``transformers``' ``generate``. It can also
score responses' log-probabilities under that copy (:meth:`HFRollout.logprobs`, batched).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.nn as nn

from .loss import token_logprobs

__all__ = ["HFRollout", "RolloutEngine", "sample"]

#: Rows that ended leave the batch (and its KV cache) once at least this fraction of the rows still
#: in it has ended: each removal copies the cache, so ending rows are dropped in groups.
COMPACT_FRACTION = 0.125


@torch.no_grad()
def sample(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
           eos_token_id: int, pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Sample up to ``max_new_tokens`` tokens after each row of a left-padded batch (``input_ids``
    and ``attention_mask``, ``(rows, width)``, on the model's device) with a KV cache: a prefill,
    then one forward of the last token per step. Each token is drawn from ``softmax(logits /
    temperature)``, truncated to its nucleus when ``top_p < 1`` (the smallest set of likeliest
    tokens whose probability reaches ``top_p``; the likeliest is always kept), with the global
    torch generator. A row ends at its first ``eos_token_id`` (kept); once at least
    :data:`COMPACT_FRACTION` of the rows still running have ended, they leave the batch and the
    cache, so a long tail of responses costs only its own rows (where the cache's layers all hold
    keys and values only; a model with linear-attention layers keeps every row, as ``generate``). Returns ``(rows,
    max_new_tokens)`` token ids, ``pad_token_id`` after a row's end (on the model's device).

    Unlike ``generate``, no other logits processor (a model's ``generation_config`` defaults such
    as repetition penalties or top-k) applies: the update's log-probabilities are those of exactly
    this distribution."""
    from transformers import DynamicCache

    rows, device = input_ids.shape[0], input_ids.device
    out = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    keep_last = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, **keep_last).logits[:, -1]
    compactable = _rows_removable(cache)
    live = torch.arange(rows, device=device)  # the batch's rows, as rows of ``out``
    running = torch.ones(rows, dtype=torch.bool, device=device)
    last = positions[:, -1]
    mask = attention_mask
    for t in range(max_new_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # (the likeliest's mass before it is 0: always kept)
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        token = torch.multinomial(probs, 1).squeeze(1)
        token = torch.where(running, token, pad_token_id)
        out[live, t] = token
        running = running & (token != eos_token_id)
        if t == max_new_tokens - 1:
            break
        still = int(running.sum())  # (one wait for the device a step, as generate's stopping check)
        if still == 0:
            break
        if compactable and len(live) - still >= max(1, int(len(live) * COMPACT_FRACTION)):
            keep = running.nonzero().squeeze(1)
            live, token, mask, last, running = live[keep], token[keep], mask[keep], last[keep], running[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        last = last + 1
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=last[:, None], past_key_values=cache,
                       use_cache=True).logits[:, -1]
    return out


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (every current ``transformers`` causal
    LM; older remote code may not): the prefill then computes the last position's logits only."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "logits_to_keep" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _rows_removable(cache) -> bool:
    """Whether rows can leave the cache: every layer a plain key/value layer (full or sliding
    window). A layer with other state (linear attention's convolution and recurrent states) keeps
    every row, as ``generate`` does."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers)


class RolloutEngine(Protocol):
    """What the RL loop needs of a rollout engine, in the order it asks each step: the
    weight-sync phases of serving engines (vLLM's and SGLang's sleep mode), so that one can stand
    in for :class:`HFRollout` without touching the loop.

    1. :meth:`wake`: take back the memory given up by :meth:`sleep` (weights first).
    2. :meth:`load_weights`: the policy's full parameters in buckets (one dict per engine unit),
       so no process holds more than one bucket of them besides the engine's own copy.
    3. :meth:`generate`.
    4. :meth:`sleep`: give up its memory (weights, KV cache) while the policy trains.

    The old log-probs of the update's ratio come from the policy's engine, not from the rollout
    engine (whose numerics may differ, as a serving engine's do).
    """

    def wake(self) -> None:
        """Before the weights are loaded: take back what :meth:`sleep` released."""

    def load_weights(self, parts: Iterable[dict[str, torch.Tensor]]) -> None:
        """Take the policy's current full parameters (dicts of name -> tensor, a bucket at a time)."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, seed: int) -> list[list[int]]:
        """``n`` sampled responses per prompt (token ids, ending with end-of-sequence unless the
        length limit cut them), prompt after prompt."""

    def sleep(self) -> None:
        """After the rollout phase: release memory until :meth:`wake`."""


class HFRollout:
    """Sampling (temperature, top-p, a KV cache) on an unsharded ``transformers`` model.

    Args:
        model: a ``transformers`` causal LM (its own copy: weights are replaced by :meth:`load_weights`),
            on the device it samples on (prompts go there; responses and log-probs come back to
            the CPU).
        eos_token_id, pad_token_id: the tokenizer's.
        temperature, top_p, max_new_tokens: sampling settings.
        max_batch_tokens: the most padded tokens (prompt and response) one sampling batch or one
            scoring forward holds; more rows go in further batches.
        per_prompt: one batch per prompt (its samples together, no padding) instead.
        use_generate: sample with ``transformers``' ``generate`` instead of :func:`sample`.
    """

    def __init__(self, model: nn.Module, *, eos_token_id: int, pad_token_id: int | None, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 64, max_batch_tokens: int = 1 << 16,
                 per_prompt: bool = False, use_generate: bool = False) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be positive")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be at least 1")
        self.max_batch_tokens = max_batch_tokens
        self.per_prompt = per_prompt
        self.use_generate = use_generate
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.eos, self.pad = eos_token_id, pad_token_id if pad_token_id is not None else eos_token_id
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens

    def wake(self) -> None:
        """Nothing: this engine keeps its copy of the policy between steps (``generate`` keeps no
        KV cache across calls)."""

    def sleep(self) -> None:
        """Nothing (see :meth:`wake`)."""

    def load_weights(self, parts: Iterable[dict[str, torch.Tensor]]) -> None:
        """Copy the policy's full parameters in (names as the engine gives them: the model's own,
        or under an ``hf.`` wrapper). Every part is taken first (iterating them is a collective
        over the engine's ranks), then a name the rollout model does not have, or a parameter of
        it that no part gave, is refused in one line: a copy that silently kept stale weights
        would sample from the wrong policy."""
        state = self.model.state_dict()
        loaded: set[int] = set()  # storages written (a tied weight is one storage under two names)
        unknown: list[str] = []
        with torch.no_grad():
            for part in parts:
                for name, value in part.items():
                    target = state.get(name.removeprefix("hf."))
                    if target is None:
                        unknown.append(name)
                        continue
                    if target.shape != value.shape:
                        raise ValueError(f"rollout weights: {name} is {tuple(value.shape)} but the rollout model's "
                                         f"is {tuple(target.shape)}; the rollout model is not the policy's architecture")
                    target.copy_(value)
                    loaded.add(target.untyped_storage().data_ptr())
        missing = [n for n, p in self.model.named_parameters() if p.untyped_storage().data_ptr() not in loaded]
        if unknown or missing:
            what = []
            if unknown:
                what.append(f"{len(unknown)} name(s) the rollout model lacks ({', '.join(unknown[:3])})")
            if missing:
                what.append(f"{len(missing)} of its parameters not given ({', '.join(missing[:3])})")
            raise ValueError(f"rollout weights do not match the rollout model: {'; '.join(what)}; "
                             "the rollout model must be the policy's architecture")

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, seed: int) -> list[list[int]]:
        """``n`` samples of every prompt, all of them in one batch (or a few, each of at most
        ``max_batch_tokens`` prompt and response tokens): the prompts left-padded to the longest,
        with an attention mask, so every row's positions start at its first real token. A
        response ends at the first end-of-sequence token (kept) or at ``max_new_tokens``."""
        torch.manual_seed(seed)
        rows = [list(p) for p in prompts for _ in range(n)]
        out: list[list[int]] = []
        batches = [rows[i:i + n] for i in range(0, len(rows), n)] if self.per_prompt else self._batches(rows)
        for batch in batches:
            width = max(len(r) for r in batch)
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r):] = torch.tensor(r)
                mask[i, width - len(r):] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            if self.use_generate:
                gen = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=self.temperature,
                                          top_p=self.top_p, top_k=0, max_new_tokens=self.max_new_tokens,
                                          eos_token_id=self.eos, pad_token_id=self.pad)[:, width:]
            else:
                gen = sample(self.model, ids, mask, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                             pad_token_id=self.pad, temperature=self.temperature, top_p=self.top_p)
            for row in gen.tolist():
                cut = row.index(self.eos) + 1 if self.eos in row else len(row)
                out.append(row[:cut])
        return out

    def _batches(self, rows: list[list[int]]) -> list[list[list[int]]]:
        """``rows`` in order, cut into batches whose padded prompt and response tokens stay within
        ``max_batch_tokens`` (a batch holds at least one row)."""
        batches: list[list[list[int]]] = []
        current: list[list[int]] = []
        width = 0
        for r in rows:
            w = max(width, len(r))
            if current and (len(current) + 1) * (w + self.max_new_tokens) > self.max_batch_tokens:
                batches.append(current)
                current, w = [], len(r)
            current.append(r)
            width = w
        if current:
            batches.append(current)
        return batches

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        """One forward per batch of sequences (right-padded, with an attention mask; batches of at
        most ``max_batch_tokens`` padded tokens), not one per sequence."""
        out: list[torch.Tensor] = []
        order = list(range(len(sequences)))
        rows = [sequences[i].tolist() for i in order]
        start = 0
        for batch in self._batches(rows):
            width = max(len(r) for r in batch) - 1
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, : len(r) - 1] = torch.tensor(r[:-1])
                mask[i, : len(r) - 1] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False).logits
            for i, r in enumerate(batch):
                p = prompt_lens[start + i]
                target = torch.tensor(r[p:], device=self.device)
                out.append(token_logprobs(logits[i, p - 1 : len(r) - 1], target, self.temperature))  # what was sampled
            start += len(batch)
        return [lp.cpu() for lp in out]  # (queued first: one wait for the device)
