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


def _worker(rank, world, n, heads, kv_heads, d, lse=True, dtype=torch.float32, device="cpu", shm=False):
    if not lse:  # the masked pieces, as a device without a log-sum-exp kernel runs them
        import posttrain.models.split_attention as sa

        sa._LSE_ATTENTION.clear()
    q, k, v, w = _tensors(n, heads, kv_heads, d)
    (a0, a1), (b0, b1) = zigzag(n, world)[rank]
    idx = torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)])
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    mine = [t[:, :, idx].to(dev, dtype).clone().requires_grad_() for t in (q, k, v)]
    w = w.to(dev, dtype)
    group = None
    if shm:  # the ODC trainers' exchange among ranks of one host
        import torch.distributed as dist

        from posttrain.odc import ShmRowExchange, row_exchange

        group = row_exchange(dist.group.WORLD)
        assert isinstance(group, ShmRowExchange)
    out = split_causal_attention(*mine, idx.to(dev), group=group)
    (out * w[:, :, idx.to(dev)]).sum().backward()
    return idx, out.detach().cpu(), *(t.grad.cpu() for t in mine)


@pytest.mark.parametrize("lse", [True, False], ids=["lse-blocks", "masked-pieces"])
@pytest.mark.parametrize("world,n,heads,kv_heads", [(2, 16, 4, 2), (2, 11, 4, 4), (4, 37, 4, 1), (4, 32, 2, 2),
                                                    (2, 300, 2, 1)],
                         ids=["2ranks-gqa", "2ranks-uneven", "4ranks-mqa-uneven", "4ranks-mha", "2ranks-pieces"])
def test_split_attention_equals_one_process_with_exact_gradients(world, n, heads, kv_heads, lse):
    d = 8
    q, k, v, w = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_tensors(n, heads, kv_heads, d)))
    rep = heads // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    (out * w).sum().backward()
    got = run_ranks(_worker, world, n, heads, kv_heads, d, lse, timeout_s=120)
    seen = torch.cat([idx for idx, *_ in got])
    assert sorted(seen.tolist()) == list(range(n))  # every token on exactly one rank
    for idx, o, gq, gk, gv in got:
        torch.testing.assert_close(o, out.detach()[:, :, idx], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gq, q.grad[:, :, idx], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gk, k.grad[:, :, idx], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gv, v.grad[:, :, idx], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lse", [True, False], ids=["lse-blocks", "masked-pieces"])
@pytest.mark.parametrize("world,n,heads,kv_heads", [(2, 16, 4, 2), (4, 37, 4, 1)], ids=["2ranks-gqa", "4ranks-mqa-uneven"])
def test_split_attention_through_shared_memory_equals_one_process(world, n, heads, kv_heads, lse):
    """The same through the ODC trainers' shared-memory exchange instead of gloo's collectives
    (the positions' exchange too: no lengths given)."""
    d = 8
    q, k, v, w = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_tensors(n, heads, kv_heads, d)))
    rep = heads // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    (out * w).sum().backward()
    got = run_ranks(_worker, world, n, heads, kv_heads, d, lse, shm=True, timeout_s=120)
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


@pytest.mark.parametrize("n,k", [(64, 2), (4096, 2), (4099, 4), (1000, 8)])
def test_a_shard_attends_to_the_keys_its_runs_need_not_to_every_key(n, k):
    """``causal_blocks``: a zigzag shard's runs (two of at most half the shard each, also where its
    chunks are adjacent: one causal square twice as long is slower in the CPU's kernel, and the
    group would wait for that shard at every layer) see exactly the sorted keys up to their last
    position, those before their first without a mask
    (the log-sum-exp path): every rank computes its even share of the causal work. The masked
    pieces (devices without such a kernel) keep the two chunks apart and see the keys up to their
    last position: within (2k + 1) / 2k of the even share, within 1 + 1 / 6k for long shards; one
    masked call over every key would cost each rank the whole sequence's work."""
    from posttrain.models.split_attention import causal_blocks

    shards = [torch.cat([torch.arange(a0, a1), torch.arange(b0, b1)]) for (a0, a1), (b0, b1) in zigzag(n, k)]
    keys = torch.cat(shards)  # (gathered in shard order)
    even = n * n / 2 / k
    exact, masked = [], []
    for rank, pos in enumerate(shards):
        blocks = causal_blocks(pos, keys)
        ordered = keys if blocks.order is None else keys[blocks.order]
        assert ordered.tolist() == list(range(n))
        # the same order as ranges of gathered rows, one block copy each: the zigzag's chunks
        assert [i for a, b in blocks.segments for i in range(a, b)] == (blocks.order.tolist() if blocks.order
                                                                         is not None else list(range(n)))
        assert len(blocks.segments) <= 2 * k
        for begin, end, before, upto in blocks.runs:
            assert (before, upto) == (int(pos[begin]), int(pos[end - 1]) + 1)
        assert len(blocks.runs) == 2 and all(end - begin <= -(-len(pos) // 2) for begin, end, _, _ in blocks.runs)
        exact.append(sum((end - begin) * before + (end - begin) ** 2 / 2 for begin, end, before, _ in blocks.runs))
        cuts = [a for a, _, _ in blocks.pieces] + [len(pos)]
        (_, _), (b0, b1) = zigzag(n, k)[rank]
        assert len(pos) - (b1 - b0) in cuts  # (the two chunks apart)
        assert all(b - a <= max(64, -(-len(pos) // 8)) for a, b, _ in blocks.pieces)
        assert all(m == int(pos[b - 1]) + 1 for _, b, m in blocks.pieces)
        masked.append(sum((b - a) * m for a, b, m in blocks.pieces))
    assert max(exact) <= even * 1.02 + n and min(exact) >= even * 0.98 - n
    assert max(masked) <= even * (2 * k + 1) / (2 * k) + 2 * n
    if n // k >= 16 * 64:
        assert max(masked) <= even * (1 + 1 / (6 * k))
    assert max(masked) < 0.75 * n * n / k  # (a masked call over every key: n / k queries x n keys each)


def test_gathered_ranges_are_cut_at_the_ranks_rows():
    """A range of the ranks' rows concatenated runs over from one rank's rows into the next's; the
    gather copies each rank's part from that rank's padded rows."""
    from posttrain.models.split_attention import _rank_spans

    assert _rank_spans([(0, 11)], [6, 5]) == [(0, 0, 6), (1, 0, 5)]
    assert _rank_spans([(0, 3), (9, 11), (3, 9)], [6, 5]) == [(0, 0, 3), (1, 3, 5), (0, 3, 6), (1, 0, 3)]


@pytest.mark.parametrize("lse", [True, False], ids=["lse-blocks", "masked-pieces"])
def test_split_attention_in_bf16_is_one_process_fp32_within_bf16s_rounding(lse):
    """bf16 queries, keys and values on 2 ranks (grouped-query): output and gradients within
    bf16's rounding of one fp32 process's (the blocks are merged and their gradients summed in
    fp32); all in fp32 the same comparison holds to 1e-5."""
    n, heads, kv_heads, d = 96, 4, 2, 16
    q, k, v, w = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_tensors(n, heads, kv_heads, d)))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    (out * w).sum().backward()
    got = run_ranks(_worker, 2, n, heads, kv_heads, d, lse, torch.bfloat16, timeout_s=120)
    for idx, o, gq, gk, gv in got:
        assert o.dtype == gq.dtype == torch.bfloat16
        for mine, want in ((o, out.detach()), (gq, q.grad), (gk, k.grad), (gv, v.grad)):
            want = want[:, :, idx]
            assert (mine.float() - want).abs().max() <= 2e-2 * want.abs().max() + 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_attention_on_a_gpu_equals_one_process(dtype):
    """On CUDA (two ranks sharing the GPU, the keys and values all-gathered over gloo from GPU
    memory): the masked pieces a device without a log-sum-exp kernel runs give one CPU process's
    fp32 output and gradients, within the GPU kernels' own rounding (fp32) or bf16's; long enough
    for several pieces per shard, grouped-query."""
    n, heads, kv_heads, d = 600, 4, 2, 16
    q, k, v, w = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_tensors(n, heads, kv_heads, d)))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    (out * w).sum().backward()
    got = run_ranks(_worker, 2, n, heads, kv_heads, d, True, dtype, "cuda", start="spawn", timeout_s=180)
    assert sorted(torch.cat([idx for idx, *_ in got]).tolist()) == list(range(n))
    for idx, o, gq, gk, gv in got:
        assert o.dtype == gq.dtype == dtype
        for mine, want in ((o, out.detach()), (gq, q.grad), (gk, k.grad), (gv, v.grad)):
            want = want[:, :, idx]
            if dtype == torch.float32:
                torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-5)
            else:
                assert (mine.float() - want).abs().max() <= 2e-2 * want.abs().max() + 1e-2
