"""Embedded synthetic data. A failure pinpoints a profile with the wrong shape or non-reproducible
data (record formats and files: test_data_formats.py)."""

from __future__ import annotations

import statistics

import pytest

from posttrain.data import PROFILES, profile_lengths, synthetic_sequences


@pytest.mark.parametrize("profile", PROFILES)
def test_profiles_are_seeded_and_in_range(profile):
    a = profile_lengths(profile, 500, max_len=1024, seed=1)
    assert a == profile_lengths(profile, 500, max_len=1024, seed=1)
    assert a != profile_lengths(profile, 500, max_len=1024, seed=2)
    assert all(8 <= n <= 1024 for n in a)


def test_profiles_have_their_shapes():
    tail = profile_lengths("long_tail", 2000, max_len=4096)
    assert statistics.median(tail) < 700 and max(tail) > 2000  # short median, long tail
    bi = profile_lengths("bimodal", 2000, max_len=4096)
    assert 0.7 < sum(n < 500 for n in bi) / len(bi) < 0.9 and sum(n >= 2048 for n in bi) > 300
    uni = profile_lengths("uniform", 2000, max_len=4096)
    assert min(uni) >= 2048


@pytest.mark.parametrize("profile,mean,top", [("longalign", 16500, 65536), ("swe_smith", 34700, 131072)])
def test_published_shapes_scale_with_max_len(profile, mean, top):
    """At their own scale the stand-ins have the paper's means; scaled to max_len=4096 every
    length shrinks by the same factor (1/16, 1/32), so the shape is kept."""
    full = profile_lengths(profile, 20000, max_len=top)
    assert statistics.mean(full) == pytest.approx(mean, rel=0.05) and max(full) <= top
    small = profile_lengths(profile, 20000, max_len=4096)
    assert statistics.mean(small) == pytest.approx(mean * 4096 / top, rel=0.05) and max(small) <= 4096
    scaled = [min(4096, max(8, n * 4096 / top)) for n in full[:50]]
    assert all(abs(a - b) <= 1 for a, b in zip(small, scaled))  # the same draws, shrunk


def test_synthetic_sequences_follow_the_counting_task():
    seqs = synthetic_sequences([5, 9], vocab_size=16, seed=0)
    assert [len(s) for s in seqs] == [5, 9]
    for s in seqs:
        steps = {int((s[i + 1] - s[i]) % 16) for i in range(len(s) - 1)}
        assert len(steps) == 1 and steps.pop() in (1, 2, 3)


def test_unknown_profile_lists_choices():
    with pytest.raises(ValueError, match="long_tail, bimodal, uniform, longalign, swe_smith"):
        profile_lengths("zipf", 3, max_len=64)
