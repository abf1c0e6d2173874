"""Models: a built-in GPT, a random ``transformers`` Llama, and any local ``transformers`` causal
LM checkpoint (in and out), all called as ``model(tokens, document_lengths=None) -> logits``, with
their blocks where :func:`find_blocks` looks."""

from __future__ import annotations

import torch.nn as nn

from .blocks import checkpoint_blocks, find_blocks
from .gpt import GPT, GPTConfig, token_loss_sum
from .hf import HFCausalLM, check_model_dir, load_pretrained, save_pretrained, tied_names
from .llama import LlamaLM, llama_config

__all__ = [
    "GPT",
    "MODELS",
    "GPTConfig",
    "HFCausalLM",
    "LlamaLM",
    "build_model",
    "check_model_dir",
    "checkpoint_blocks",
    "find_blocks",
    "llama_config",
    "load_pretrained",
    "save_pretrained",
    "tied_names",
    "token_loss_sum",
]

MODELS = ("gpt", "llama")


def build_model(kind: str, cfg: GPTConfig) -> nn.Module:
    """A randomly initialized ``gpt`` (:class:`GPT`) or ``llama`` (:class:`LlamaLM`) of shape ``cfg``."""
    if kind == "gpt":
        return GPT(cfg)
    if kind == "llama":
        return LlamaLM(cfg)
    raise ValueError(f"model={kind!r} is not one of {', '.join(MODELS)}")
