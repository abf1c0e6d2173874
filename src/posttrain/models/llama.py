"""A randomly initialized ``transformers`` ``LlamaForCausalLM`` of a :class:`GPTConfig`'s shape,
called like :class:`~posttrain.models.GPT` (see :class:`~posttrain.models.hf.HFCausalLM`).
Nothing is downloaded."""

from __future__ import annotations

from .gpt import GPTConfig
from .hf import HFCausalLM

__all__ = ["LlamaLM", "llama_config"]


def llama_config(cfg: GPTConfig):
    """The ``transformers.LlamaConfig`` of the same size as ``cfg`` (SwiGLU width ~8/3 dim,
    grouped-query attention with half as many KV heads when the head count is even)."""
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=(8 * cfg.dim // 3 + 7) // 8 * 8,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads // 2 if cfg.num_heads % 2 == 0 else cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=False,
    )


class LlamaLM(HFCausalLM):
    """``LlamaForCausalLM`` of shape ``cfg`` with a random init; ``forward(tokens, document_lengths=None)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        from transformers import LlamaForCausalLM

        super().__init__(LlamaForCausalLM(llama_config(cfg)))
        self.cfg = cfg
