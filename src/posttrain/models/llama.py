"""A ``transformers`` ``LlamaForCausalLM`` behind the same call as :class:`~posttrain.models.GPT`.

``LlamaLM(config)(tokens, document_lengths)`` returns logits; for packed input it passes
position ids that restart at every sequence and no attention mask, which ``transformers`` turns
into a block-diagonal causal mask (``find_packed_sequence_indices``), so attention never crosses
sequence boundaries. ``model.layers`` are the decoder layers, for per-block FSDP2 sharding.
Random initialization from a config: nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .gpt import GPTConfig, packed_positions

__all__ = ["LlamaLM", "llama_config"]


def llama_config(cfg: GPTConfig):
    """The ``transformers.LlamaConfig`` of the same size as ``cfg`` (SwiGLU width ~8/3 dim,
    grouped-query attention with half as many KV heads when the head count is even)."""
    try:
        from transformers import LlamaConfig
    except ImportError as e:  # pragma: no cover - transformers is in the test extra
        raise ValueError("--model llama needs transformers: pip install 'posttrain[hf]'") from e
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=(8 * cfg.dim // 3 + 7) // 8 * 8,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads // 2 if cfg.num_heads % 2 == 0 else cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False,
    )


class LlamaLM(nn.Module):
    """``LlamaForCausalLM`` with a random init; ``forward(tokens, document_lengths=None)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.cfg = cfg
        self.hf = LlamaForCausalLM(llama_config(cfg))

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf.model.layers

    def forward(self, tokens: torch.Tensor, document_lengths: list[int] | None = None) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        if document_lengths is None:
            pos = torch.arange(t, device=tokens.device)
        else:
            if tokens.shape[0] != 1:
                raise ValueError(f"packed input must have batch size 1, got {tokens.shape[0]}")
            pos = packed_positions(document_lengths, t, self.cfg.max_seq_len, tokens.device)
        return self.hf(input_ids=tokens, position_ids=pos.unsqueeze(0), use_cache=False).logits
