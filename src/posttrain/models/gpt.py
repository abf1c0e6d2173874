"""A small decoder-only transformer (nanoGPT-shaped) with pre-norm blocks in ``model.layers``.

``model.layers`` is a ``ModuleList`` so that FSDP2 can shard block by block and a pipeline
can cut between blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .split_attention import SplitShard, check_split, packed_attention

__all__ = ["GPT", "GPTConfig", "token_loss_sum"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids.
        dim: hidden size.
        num_layers: number of transformer blocks.
        num_heads: attention heads; must divide ``dim``.
        max_seq_len: longest sequence (learned position embedding).
    """

    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 1024

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide dim={self.dim}")
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, document_lengths: list[int] | None = None,
                split: SplitShard | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in (q, k, v))
        if document_lengths is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Per-sequence causal attention: exact, and sum(n_i^2) work instead of the (sum n_i)^2
            # a block-diagonal mask would cost; a split first sequence over its whole sequence. One
            # call per sequence: the benchmarks in docs/results.md measured GPT so (batching sequences
            # of similar length, as transformers models do here, waits for their rerun).
            y = packed_attention(q, k, v, document_lengths, split, batch=False)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    """Token embedding + learned positions, ``num_layers`` blocks, final norm and LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, document_lengths: list[int] | None = None,
                split: SplitShard | None = None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` for token ids ``(batch, seq)``.

        Args:
            tokens: token ids.
            document_lengths: for packed input (batch 1), the lengths of the sequences laid end
                to end; positions restart at each and attention runs per sequence (causal
                within it, never across). See :func:`posttrain.balance.pack_sequences`.
            split: the first packed sequence is this rank's shard of a sequence split across
                ranks (context parallelism): its positions are the shard's, and its attention
                a collective over the shard's group.
            logits_at: only the logits at these positions of the sequence dimension (a 1-D index
                tensor): ``(batch, len(logits_at), vocab)``, the head run on those rows alone.
        """
        t = tokens.shape[1]
        if document_lengths is None:
            check_split(document_lengths, split)
            if t > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
            pos = torch.arange(t, device=tokens.device)
        else:
            if tokens.shape[0] != 1:
                raise ValueError(f"packed input must have batch size 1, got {tokens.shape[0]}")
            pos = packed_positions(document_lengths, t, self.cfg.max_seq_len, tokens.device, split)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x, document_lengths) if split is None else layer(x, document_lengths, split)
        if logits_at is not None:
            x = x[:, logits_at]
        return self.head(self.norm(x))


def packed_positions(document_lengths: list[int], total: int, max_seq_len: int, device: torch.device,
                     split: SplitShard | None = None) -> torch.Tensor:
    """Position ids that restart at every packed document (the first: ``split``'s positions where given)."""
    if sum(document_lengths) != total or any(n < 1 for n in document_lengths):
        raise ValueError(f"document_lengths {document_lengths} do not tile {total} tokens")
    check_split(document_lengths, split)
    if max(document_lengths) > max_seq_len:
        raise ValueError(f"a packed sequence of {max(document_lengths)} tokens exceeds max_seq_len={max_seq_len}")
    if split is not None and int(split.positions.max()) >= max_seq_len:
        raise ValueError(f"a split sequence reaches position {int(split.positions.max())}, beyond "
                         f"max_seq_len={max_seq_len}")
    parts = [torch.arange(n, device=device) for n in document_lengths]
    if split is not None:
        parts[0] = split.positions.to(device)
    return torch.cat(parts)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the trained targets (``-100``: not
    trained), each times its weight if ``weights`` (same shape as ``targets``) is given; divide
    by a minibatch-global count."""
    if weights is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    per = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return (per * weights.flatten().to(per.dtype)).sum()
