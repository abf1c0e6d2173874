"""Rollouts: sampling responses with a KV cache, behind a small interface a serving engine can
implement instead.

:class:`HFRollout` samples with ``transformers`` ``generate`` on an unsharded copy of the policy
(the engine's full parameters, loaded into it before each rollout phase), and scores the
responses' log-probabilities under that same copy (the rollout policy's log-probs the update's
ratio is taken against).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.nn as nn

from .loss import token_logprobs

__all__ = ["HFRollout", "RolloutEngine"]


class RolloutEngine(Protocol):
    """What the RL loop needs of a rollout engine, in the order it asks each step: the
    weight-sync phases of serving engines (vLLM's and SGLang's sleep mode), so that one can stand
    in for :class:`HFRollout` without touching the loop.

    1. :meth:`wake`: take back the memory given up by :meth:`sleep` (weights first).
    2. :meth:`load_weights`: the policy's full parameters in buckets (one dict per engine unit),
       so no process holds more than one bucket of them besides the engine's own copy.
    3. :meth:`generate`, then :meth:`logprobs` of what was generated.
    4. :meth:`sleep`: give up its memory (weights, KV cache) while the policy trains.
    """

    def wake(self) -> None:
        """Before the weights are loaded: take back what :meth:`sleep` released."""

    def load_weights(self, parts: Iterable[dict[str, torch.Tensor]]) -> None:
        """Take the policy's current full parameters (dicts of name -> tensor, a bucket at a time)."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, seed: int) -> list[list[int]]:
        """``n`` sampled responses per prompt (token ids, ending with end-of-sequence unless the
        length limit cut them), prompt after prompt."""

    def logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        """Per sequence, the log-probabilities of its response tokens under the loaded weights, at
        the sampling temperature."""

    def sleep(self) -> None:
        """After the rollout phase: release memory until :meth:`wake`."""


class HFRollout:
    """Sampling with ``generate`` (temperature, top-p, a KV cache) on an unsharded model.

    Args:
        model: a ``transformers`` causal LM (its own copy: weights are replaced by :meth:`load_weights`),
            on the device it samples on (prompts go there; responses and log-probs come back to
            the CPU).
        eos_token_id, pad_token_id: the tokenizer's.
        temperature, top_p, max_new_tokens: sampling settings.
    """

    def __init__(self, model: nn.Module, *, eos_token_id: int, pad_token_id: int | None, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 64) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be positive")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
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
        own = self.model.state_dict()
        with torch.no_grad():
            for part in parts:
                for name, value in part.items():
                    name = name.removeprefix("hf.")
                    if name in own:
                        own[name].copy_(value)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, seed: int) -> list[list[int]]:
        out: list[list[int]] = []
        torch.manual_seed(seed)
        for prompt in prompts:  # one prompt at a time: no padding, the n samples batched
            ids = torch.tensor([list(prompt)] * n, device=self.device)
            gen = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=self.temperature, top_p=self.top_p, top_k=0,
                                      max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                                      pad_token_id=self.pad)
            for row in gen[:, ids.shape[1]:].tolist():
                cut = row.index(self.eos) + 1 if self.eos in row else len(row)
                out.append(row[:cut])
        return out

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int]) -> list[torch.Tensor]:
        out = []
        for seq, p in zip(sequences, prompt_lens):
            seq = seq.to(self.device, non_blocking=True)
            logits = self.model(input_ids=seq[:-1].unsqueeze(0), use_cache=False).logits[0]
            out.append(token_logprobs(logits[p - 1:], seq[p:], self.temperature))  # what was sampled
        return [lp.cpu() for lp in out]  # (queued first: one wait for the device)
