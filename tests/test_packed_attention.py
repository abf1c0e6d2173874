"""Attention over a packed microbatch, per sequence: equal to each sequence's own causal attention
(values and gradients), whether its sequences run together as one padded batch or one by one. A
failure pinpoints the padding (a real query seeing a padded key), the scatter of rows back into
the packed order, grouped-query heads, or a ``transformers`` model's packed call attending across
sequences or building the block-diagonal mask it does not need."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import split_attention
from posttrain.models.split_attention import _length_groups, packed_attention


def _reference(q, k, v, lengths):
    rep, out, a = q.shape[1] // k.shape[1], [], 0
    for n in lengths:
        kk, vv = (t[:, :, a:a + n].repeat_interleave(rep, dim=1) for t in (k, v))
        out.append(F.scaled_dot_product_attention(q[:, :, a:a + n], kk, vv, is_causal=True))
        a += n
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "one-by-one"])
@pytest.mark.parametrize("lengths", [[5], [3, 7, 7, 2, 9, 9, 1], [40, 3, 4, 5, 38, 2], [16] * 8, [100, 2, 2, 2]])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_packed_attention_equals_each_sequences_own(lengths, heads, kv_heads, batch):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(1, h, t, 8, generator=g, dtype=torch.float64).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    out, ref = packed_attention(q, k, v, lengths, batch=batch), _reference(q, k, v, lengths)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert torch.allclose(out, ref, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)


def test_sequences_of_similar_length_run_as_one_batch_and_an_outlier_alone():
    assert _length_groups([16] * 8) == [list(range(8))]
    assert _length_groups([3, 7, 7, 2, 9, 9, 1]) == [[4, 5, 1, 2, 0, 3, 6]]  # short: one call
    assert _length_groups([1000, 20, 22, 19, 21]) == [[0], [2, 4, 1, 3]]
    lengths = [500, 80, 300, 640, 700, 90, 1, 330, 460]
    groups = _length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:  # padding at most doubles a member's work, unless the batch is short
        top = max(lengths[i] for i in g)
        assert top <= split_attention.SHORT or all(top ** 2 <= split_attention.PAD_WASTE * lengths[i] ** 2 for i in g)


def test_a_transformers_models_packed_call_attends_per_sequence_without_a_mask(monkeypatch):
    """A packed microbatch through :class:`HFCausalLM` gives each sequence the logits it has alone, and
    ``transformers`` is asked for no mask then (the block-diagonal one costs t x t)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models.hf import HFCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model = HFCausalLM(hf)
    lengths = [9, 3, 12, 9]
    tokens = torch.randint(0, 64, (1, sum(lengths)))
    masks = []
    real = split_attention._hf_mask
    monkeypatch.setattr(split_attention, "_hf_mask", lambda *a, **k: masks.append(real(*a, **k)) or masks[-1])
    packed = model(tokens, document_lengths=lengths)
    assert masks and all(m is None for m in masks)
    a = 0
    for n in lengths:  # each alone (unpacked: transformers' own SDPA path, its causal mask)
        alone = model(tokens[:, a:a + n])
        assert torch.allclose(packed[:, a:a + n], alone, atol=1e-5)
        a += n
