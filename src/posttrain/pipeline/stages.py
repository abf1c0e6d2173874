"""Cut a model into pipeline stages: embedding + first blocks, middle blocks, last blocks + norm + head.

``split_model(model, num_stages)`` works on the built-in :class:`~posttrain.models.GPT` and on
any ``transformers`` decoder-only causal LM laid out as ``model.model.{embed_tokens, layers, norm,
rotary_emb}`` plus ``lm_head`` (Llama, Qwen2, Mistral and their kin), bare or wrapped in
:class:`~posttrain.models.HFCausalLM`. GPT blocks are spread as evenly as possible, earlier stages
taking the remainder; a ``transformers`` model's blocks are spread by cost, the last stage's LM
head counted as the blocks' worth of FLOPs it costs (:func:`balanced_block_ranges`). The stage
modules *share* the model's parameters (no copy), so ``model.named_parameters()`` names every
stage parameter and a pipeline's gradients can be compared with a single-process run of the same
model; tied input and output embeddings are one parameter on the first and the last stage.

A stage maps one tensor to one tensor: token ids ``(batch, seq)`` into stage 0, hidden states
``(batch, seq, dim)`` between stages, logits ``(batch, seq, vocab)`` out of the last. A
``transformers`` stage also takes ``document_lengths`` (packed sequences: batch 1, the lengths of
the documents laid end to end); it rebuilds the position ids, which restart per document, and the
block-diagonal causal mask from them, so packed sequences cross stages as plain hidden states.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..models.gpt import GPT

__all__ = ["HF_STAGE_TYPES", "balanced_block_ranges", "block_ranges", "split_model"]

#: ``transformers`` model types whose forward the stages reproduce (embedding, blocks with
#: rotary positions and a causal or sliding-window mask per ``layer_types``, norm, head).
HF_STAGE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def block_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: the blocks of each stage."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be at least 1")
    if num_layers < num_stages:
        raise ValueError(f"cannot cut {num_layers} blocks into {num_stages} stages: every stage needs at least "
                         f"one block (raise `num_layers` or lower `num_ranks`/`chunks`)")
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


def balanced_block_ranges(num_layers: int, num_stages: int, *, last_extra: float = 0.0) -> list[tuple[int, int]]:
    """``[(first, end), ...]``: contiguous blocks per stage, every stage at least one, minimizing
    the largest stage cost where a block costs 1 and the last stage also costs ``last_extra``
    (the LM head, in blocks). Among optimal splits, earlier stages take more blocks."""
    from functools import cache

    block_ranges(num_layers, num_stages)  # the same refusals

    @cache
    def worst(start: int, stage: int) -> float:  # the least largest cost of blocks start: on stages stage:
        left = num_stages - stage
        if left == 1:
            return num_layers - start + last_extra
        return min(max(end - start, worst(end, stage + 1)) for end in range(start + 1, num_layers - left + 2))

    out, start = [], 0
    for stage in range(num_stages - 1):
        left = num_stages - stage
        target = worst(start, stage)
        end = max(e for e in range(start + 1, num_layers - left + 2)
                  if max(e - start, worst(e, stage + 1)) <= target + 1e-9)
        out.append((start, end))
        start = end
    out.append((start, num_layers))
    return out


def _head_blocks(config) -> float:
    """The LM head's training FLOPs per token in blocks' worth (attention's length term aside)."""
    from ..balance.cost import ModelShape

    shape = ModelShape.from_config(config)
    return shape.hidden * shape.vocab / shape.layer_params


class _HFStage(nn.Module):
    """Blocks ``lo:hi`` of a ``transformers`` decoder (with the embedding on the first stage and
    norm and head on the last); ``forward(x, document_lengths=None)``."""

    def __init__(self, hf, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last, self.lo = first, last, lo
        self.config = hf.config
        inner = hf.model
        if first:
            self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        # rotary_emb has no parameters (a buffer of frequencies): every stage recomputes cos/sin
        self.rotary_emb = inner.rotary_emb
        if last:
            self.norm, self.lm_head = inner.norm, hf.lm_head
        types = getattr(self.config, "layer_types", None)
        self.layer_types = [types[i] if types else "full_attention" for i in range(lo, hi)]
        self.max_positions = getattr(self.config, "max_position_embeddings", None)

    def forward(self, x: torch.Tensor, document_lengths: list[int] | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        from ..models.gpt import packed_positions

        h = self.embed_tokens(x) if self.first else x
        t = h.shape[1]
        limit = self.max_positions or t
        if document_lengths is None:
            if t > limit:
                raise ValueError(f"sequence length {t} exceeds the model's max_position_embeddings={limit}")
            pos = torch.arange(t, device=h.device).unsqueeze(0)
        else:
            if h.shape[0] != 1:
                raise ValueError(f"packed input must have batch size 1, got {h.shape[0]}")
            pos = packed_positions(document_lengths, t, limit, h.device).unsqueeze(0)
        kw = dict(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=pos)
        masks = {"full_attention": create_causal_mask(**kw)}
        if "sliding_attention" in self.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        cos_sin = self.rotary_emb(h, pos)
        for layer, kind in zip(self.layers, self.layer_types):
            h = layer(h, attention_mask=masks[kind], position_ids=pos, position_embeddings=cos_sin)
        return self.lm_head(self.norm(h)) if self.last else h


def _hf_model(model: nn.Module):
    """The ``transformers`` causal LM inside ``model`` (itself, or an :class:`HFCausalLM`'s), or ``None``."""
    from ..models.hf import HFCausalLM

    hf = model.hf if isinstance(model, HFCausalLM) else model
    inner = getattr(hf, "model", None)
    if getattr(hf, "config", None) is None or inner is None or not hasattr(hf, "lm_head"):
        return None
    return hf


def split_model(model: nn.Module, num_stages: int) -> list[nn.Module]:
    """``num_stages`` modules that, chained, compute ``model(tokens)`` (see the module docstring).

    Raises:
        ValueError: an unsupported model, or fewer blocks than stages.
    """
    if isinstance(model, GPT):
        n = len(model.layers)
        ranges = block_ranges(n, num_stages)
        return [_GPTStage(model, lo, hi, s == 0, s == num_stages - 1) for s, (lo, hi) in enumerate(ranges)]
    hf = _hf_model(model)
    if hf is not None:
        kind = getattr(hf.config, "model_type", None)
        if kind not in HF_STAGE_TYPES:
            raise ValueError(f"split_model: model_type {kind!r} is not one whose forward the pipeline stages are "
                             f"known to reproduce ({', '.join(HF_STAGE_TYPES)}): some decoders scale embeddings or "
                             "cap logits in their own forward")
        if getattr(hf.config, "sliding_window", None) and not getattr(hf.config, "layer_types", None):
            raise ValueError(f"split_model: {kind} with sliding_window={hf.config.sliding_window} but no layer_types; "
                             "the stages would not know which layers slide")
        missing = [a for a in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(hf.model, a)]
        if missing:
            raise ValueError(f"split_model: {type(hf).__name__}.model has no {', '.join(missing)}; pipeline stages "
                             "support decoders laid out like Llama (embed_tokens, layers, norm, rotary_emb, lm_head)")
        ranges = balanced_block_ranges(len(hf.model.layers), num_stages, last_extra=_head_blocks(hf.config))
        return [_HFStage(hf, lo, hi, s == 0, s == num_stages - 1) for s, (lo, hi) in enumerate(ranges)]
    raise ValueError(f"split_model supports posttrain's GPT and transformers decoder-only causal LMs, "
                     f"got {type(model).__name__}")
