"""Packing and loss normalization.

A failure pinpoints attention or positions leaking across packed sequences, or a loss
normalization whose gradient depends on how sequences are spread over microbatches and ranks.
"""

from __future__ import annotations

import random

import pytest
import torch

from posttrain.balance import pack_sequences
from posttrain.models import GPT, GPTConfig, token_loss_sum

CFG = GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, max_seq_len=256)


def _seqs(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g) for _ in range(n)]


def test_packed_logits_equal_separate_runs():
    torch.manual_seed(0)
    model = GPT(CFG)
    seqs = _seqs()
    packed = pack_sequences(seqs)
    logits = model(packed.inputs, document_lengths=packed.document_lengths)
    parts = logits[0].split(packed.document_lengths)
    for seq, part in zip(seqs, parts):
        torch.testing.assert_close(part, model(seq[:-1].unsqueeze(0))[0], rtol=1e-5, atol=1e-5)
    # without the document boundaries the logits differ (attention crosses sequences)
    assert not torch.allclose(model(packed.inputs)[0, packed.document_lengths[0]:], logits[0, packed.document_lengths[0]:])


def _grads(model, groups, normalizer):
    model.zero_grad()
    total = sum(len(s) - 1 for g in groups for s in g)
    for group in groups:
        packed = pack_sequences(group)
        loss = token_loss_sum(model(packed.inputs, document_lengths=packed.document_lengths), packed.targets)
        (loss / (total if normalizer == "global" else packed.num_tokens)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_global_token_normalization_is_independent_of_placement():
    """Same gradient for one microbatch of everything and for any random split into
    microbatches (over any ranks: under ODC their gradients are summed). Per-microbatch
    means, by contrast, depend on the split."""
    torch.manual_seed(0)
    model = GPT(CFG)
    seqs = _seqs(9, seed=3)
    want = _grads(model, [seqs], "global")
    rng = random.Random(0)
    for _ in range(5):
        order = rng.sample(seqs, len(seqs))
        cuts = sorted(rng.sample(range(1, len(seqs)), 3))
        groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(seqs)])]
        torch.testing.assert_close(_grads(model, groups, "global"), want, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(_grads(model, groups, "per_microbatch") / len(groups), want, rtol=1e-3)


def test_bad_packing_input():
    with pytest.raises(ValueError, match="no sequences"):
        pack_sequences([])
    with pytest.raises(ValueError, match="sequence 1 has 1 token"):
        pack_sequences([torch.tensor([1, 2]), torch.tensor([3])])
    with pytest.raises(ValueError, match="do not tile"):
        GPT(CFG)(torch.zeros(1, 5, dtype=torch.long), document_lengths=[2, 2])
