"""Attention over a sequence split across ranks (context parallelism's execution primitive): every
rank's output and every gradient equal one process's causal attention over the whole sequence.
A failure pinpoints the key/value exchange (forward), its gradient's return to the owners
(backward), the causal mask across shards, or grouped-query heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.balance import zigzag
from posttrain.launch import run_ranks
from posttrain.models.split_attention import split_causal_attention


def _tensors(n, heads, kv_heads, d):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, n, d, generator=g) for h in (heads, kv_heads, kv_heads, heads)]  # q, k, v, weights


def _worker(rank, world, n, heads, kv_heads, d):
    q, k, v, w = _tensors(n, heads, kv_heads, d)
    (a0, a1), (b0, b1) = zigzag(n, world)[rank]
    idx = torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)])
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    out = split_causal_attention(*mine, idx)
    (out * w[:, :, idx]).sum().backward()
    return idx, out.detach(), *(t.grad for t in mine)


@pytest.mark.parametrize("world,n,heads,kv_heads", [(2, 16, 4, 2), (2, 11, 4, 4), (4, 37, 4, 1), (4, 32, 2, 2)],
                         ids=["2ranks-gqa", "2ranks-uneven", "4ranks-mqa-uneven", "4ranks-mha"])
def test_split_attention_equals_one_process_with_exact_gradients(world, n, heads, kv_heads):
    d = 8
    q, k, v, w = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_tensors(n, heads, kv_heads, d)))
    rep = heads // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    (out * w).sum().backward()
    got = run_ranks(_worker, world, n, heads, kv_heads, d, timeout_s=120)
    seen = torch.cat([idx for idx, *_ in got])
    assert sorted(seen.tolist()) == list(range(n))  # every token on exactly one rank
    for idx, o, gq, gk, gv in got:
        torch.testing.assert_close(o, out.detach()[:, :, idx], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gq, q.grad[:, :, idx], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gk, k.grad[:, :, idx], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gv, v.grad[:, :, idx], rtol=1e-5, atol=1e-6)


def test_split_attention_refuses_what_is_not_one_shard():
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        split_causal_attention(q, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.arange(4))
    with pytest.raises(ValueError, match="give both lengths and key_positions"):
        split_causal_attention(q, torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8), torch.arange(4), lengths=[4])
    with pytest.raises(ValueError, match="one sequence's shard"):
        split_causal_attention(q, torch.zeros(1, 3, 5, 8), torch.zeros(1, 3, 5, 8), torch.arange(4))
