"""Cut a model into pipeline stages: embedding + first blocks, middle blocks, last blocks + norm + head.

``split_model(model, num_stages)`` works on the built-in :class:`~posttrain.models.GPT` and on
:class:`~posttrain.models.LlamaLM` (a ``transformers`` ``LlamaForCausalLM``). Blocks are spread as
evenly as possible, earlier stages taking the remainder. The stage modules *share* the model's
parameters (no copy), so ``model.named_parameters()`` names every stage parameter and a
pipeline's gradients can be compared with a single-process run of the same model.

A stage maps one tensor to one tensor: token ids ``(batch, seq)`` into stage 0, hidden states
``(batch, seq, dim)`` between stages, logits ``(batch, seq, vocab)`` out of the last.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..models.gpt import GPT

__all__ = ["block_ranges", "split_model"]


def block_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: the blocks of each stage."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be at least 1")
    if num_layers < num_stages:
        raise ValueError(f"cannot cut {num_layers} blocks into {num_stages} stages: every stage needs at least "
                         f"one block (raise --layers or lower --ranks/--chunks)")
    base, extra = divmod(num_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class _GPTStage(nn.Module):
    def __init__(self, model: GPT, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.max_seq_len = model.cfg.max_seq_len
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.layers = nn.ModuleList(model.layers[lo:hi])
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            t = x.shape[1]
            if t > self.max_seq_len:
                raise ValueError(f"sequence length {t} exceeds max_seq_len={self.max_seq_len}")
            x = self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) if self.last else x


class _LlamaStage(nn.Module):
    def __init__(self, hf, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.config = hf.config
        inner = hf.model
        if first:
            self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        # rotary_emb has no parameters (a buffer of frequencies): every stage recomputes cos/sin
        self.rotary_emb = inner.rotary_emb
        if last:
            self.norm, self.lm_head = inner.norm, hf.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=pos)
        cos_sin = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        return self.lm_head(self.norm(h)) if self.last else h


def split_model(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """``num_stages`` modules that, chained, compute ``model(tokens)`` (see the module docstring).

    Raises:
        ValueError: an unsupported model, or fewer blocks than stages.
    """
    from ..models.llama import LlamaLM

    if isinstance(model, GPT):
        n = len(model.layers)
        ranges = block_ranges(n, num_stages)
        return [_GPTStage(model, lo, hi, s == 0, s == num_stages - 1) for s, (lo, hi) in enumerate(ranges)]
    if isinstance(model, LlamaLM):
        ranges = block_ranges(len(model.layers), num_stages)
        return [_LlamaStage(model.hf, lo, hi, s == 0, s == num_stages - 1) for s, (lo, hi) in enumerate(ranges)]
    raise ValueError(f"split_model supports posttrain's GPT and LlamaLM, got {type(model).__name__}")
