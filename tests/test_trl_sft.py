"""posttrain against TRL's SFTTrainer: the comparison's plumbing on the CPU (the figures come from a GPU:
docs/results.md)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_the_trl_comparison_feeds_both_trainers_the_same_records_and_update(tmp_path):
    """posttrain against TRL's SFTTrainer (lab/bench/trl_sft.py), on the CPU at a tiny size: the
    same records in posttrain's order, the same optimizer and loss normalization, so the losses
    of TRL (one record a forward, two padded, two padding-free in one row: no attention across
    them) and of posttrain's flat ODC agree (fp32); a
    variant that fails is reported, not fatal; the profile of TRL's last step is written."""
    import json

    from posttrain.lab.bench import trl_sft

    out = tmp_path / "res.json"
    rc = trl_sft.main(["compare", "--dir", str(tmp_path / "d"), "--preset", "tiny", "--device", "cpu", "--steps", "3",
                       "--warmup", "1", "--rounds", "1", "--records", "24", "--max-len", "256", "--max-tokens", "256",
                       "--sequences", "4", "--variants", "trl,trl:2,trl-pf:2,odc,nosuch",
                       "--profile", str(tmp_path / "prof.txt"), "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    trl, odc = res["variants"]["trl"]["losses"], res["variants"]["odc"]["losses"]
    assert len(trl) == len(odc) == 3 and trl == pytest.approx(odc, rel=1e-5)
    assert res["variants"]["trl:2"]["losses"] == pytest.approx(odc, rel=1e-5)  # padded two a forward
    assert res["variants"]["trl-pf:2"]["losses"] == pytest.approx(odc, rel=1e-5)  # padding-free
    assert list(res["failed"]) == ["nosuch"]
    assert res["variants"]["trl"]["vs_trl"] == [1.0, 1.0, 1.0] and res["variants"]["odc"]["vs_trl"][0] > 0
    assert "Self CPU" in (tmp_path / "prof.txt").read_text()


def test_the_trl_comparison_sets_posttrain_against_the_first_trl_variant_when_plain_trl_is_left_out():
    """Without ``trl`` (one record a forward, the slowest TRL), the variants are set against the first
    TRL variant listed (the GPU run's ``trl-pf:4``): the report names it and measures the losses
    against it. (The comparison's run itself is the test above.)"""
    from posttrain.lab.bench import trl_sft

    assert trl_sft.baseline(["odc", "trl-pf:4", "trl:2"]) == "trl-pf:4"
    assert trl_sft.baseline(["trl:2", "trl", "odc"]) == "trl"
    assert trl_sft.baseline(["odc", "fsdp"]) is None
    row = {"tokens_per_s": 100.0, "range": [90.0, 110.0], "tflops": 1.0, "peak_memory_gib": 2.0}
    res = {"preset": "tiny", "checkpointing": "off", "sequences": 2, "steps": 2, "warmup": 1, "rounds": 1,
           "tokens_per_step": 50.0, "peak_tflops": 989.0, "matmul_tflops": None, "failed": {}, "baseline": "trl-pf:2",
           "variants": {"odc": {**row, "vs_trl": [2.0, 2.0, 2.0], "losses": [1.0, 2.02]},
                        "trl-pf:2": {**row, "vs_trl": [1.0, 1.0, 1.0], "losses": [1.0, 2.0]}}}
    text = trl_sft.report(res)
    assert "| vs trl-pf:2 (rounds) |" in text and "| odc | 100 | 90-110 | 2.00x (2.00-2.00) |" in text
    assert "odc: largest relative difference of a loss from trl-pf:2's: 1.00e-02" in text
