"""The offload measurement of ``posttrain doctor`` (:mod:`posttrain.lab.offload_gpu`), on the CPU at
tiny sizes (and on CUDA where there is one)."""

import math

import pytest
import torch

from posttrain.lab.offload_gpu import docs_k, format_offload, format_selective, measure_offload, offload_order

FIELDS = ("tokens", "step_s_none", "step_s_offload", "overhead", "base_bytes", "peak_bytes_none", "peak_bytes_offload",
          "act_bytes_none", "act_bytes_offload", "act_reduction", "saved_bytes_per_mb", "saved_per_token_layer_h",
          "saved_peak_mb_none", "saved_peak_mb_offload", "fb_s", "d2h_s", "h2d_s", "d2h_gbps", "h2d_gbps", "tflops",
          "k_measured", "k_docs", "late_reloads", "grads_match", "grad_max_rel_diff", "f_s", "b_s", "fraction",
          "predicted_overhead_full", "predicted_overhead_selective", "predicted_peak_mb", "offloaded_bytes_full",
          "step_s_selective", "overhead_selective", "act_bytes_selective", "saved_peak_mb_selective",
          "offloaded_bytes_selective")


def test_offload_order_is_the_runners_full_offload():
    actions = offload_order(4)
    assert [str(a) for a in actions if a.kind in ("F", "B")] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"]
    order = [str(a) for a in actions]
    for j in range(4):  # each microbatch goes out after its forward and back before its backward
        assert order.index(f"0F{j}") < order.index(f"0OFFLOAD{j}") < order.index(f"0RELOAD{j}") < order.index(f"0B{j}")


def test_docs_k_is_the_formula_of_docs_pipeline():
    # k = 10 / (3 (6h + s)) * Bc / Bo
    assert docs_k(4096, 4096, 600e12, 50e9) == pytest.approx(10 / (3 * (6 * 4096 + 4096)) * 600e12 / 50e9)
    assert docs_k(4096, 16384, 1.0, 1.0) < docs_k(4096, 4096, 1.0, 1.0)  # longer sequences: cheaper offload


def test_measure_offload_on_cpu_gives_equal_gradients_and_every_field():
    rows = measure_offload("cpu", hidden=64, layers=2, tokens=(32, 64), microbatches=2, dtype=torch.float32, repeats=2)
    assert [r["tokens"] for r in rows] == [32, 64]
    for r in rows:
        assert set(FIELDS) <= set(r)
        assert r["grads_match"] and r["grad_max_rel_diff"] == 0.0  # offload moves bits: the same gradients
        assert r["late_reloads"] == 0  # every reload issued ahead of its backward
        for key in ("base_bytes", "peak_bytes_none", "peak_bytes_offload", "act_bytes_none", "act_bytes_offload",
                    "act_reduction"):
            assert r[key] is None  # the CPU keeps no peak count
        for key in ("step_s_none", "step_s_offload", "fb_s", "d2h_s", "h2d_s", "k_measured", "k_docs", "tflops"):
            assert r[key] > 0 and math.isfinite(r[key])
        assert r["saved_bytes_per_mb"] > 0
        # what a Llama layer saves per token, in units of h (the docs assume 10 half-precision values)
        assert r["saved_per_token_layer_h"] > 10
        assert r["saved_peak_mb_none"] == 2.0  # both microbatches held before the first backward
    assert rows[1]["saved_bytes_per_mb"] == 2 * rows[0]["saved_bytes_per_mb"]  # linear in tokens (sdpa saves no n^2)
    lines = format_offload(rows)
    assert len(lines) == 2 + len(rows) and all(line.startswith("|") and line.endswith("|") for line in lines)
    assert "equal" in lines[2] and "n/a" in lines[2]


def test_selective_offload_at_a_share_moves_that_share_with_equal_gradients():
    """``fraction`` given (on a GPU the planner picks it from the measured k; on the CPU copies are
    cheap and full offload hides, so no share is picked): a third variant moves about half the
    bytes of full offload, with the same gradients, holds more than full offload and less than none,
    as the simulator predicts; the selective table has its row."""
    (row,) = measure_offload("cpu", hidden=64, layers=2, tokens=(64,), microbatches=4, dtype=torch.float32, repeats=1,
                             fraction=0.5)
    assert row["grads_match"] and row["grad_max_rel_diff"] == 0.0 and row["late_reloads"] == 0
    assert row["fraction"] == 0.5 and row["step_s_selective"] > 0
    assert 0.35 < row["offloaded_bytes_selective"] / row["offloaded_bytes_full"] < 0.65
    assert row["saved_peak_mb_offload"] < row["saved_peak_mb_selective"] < row["saved_peak_mb_none"]
    assert row["saved_peak_mb_selective"] == pytest.approx(row["predicted_peak_mb"]["selective"], abs=0.2)
    (plain,) = measure_offload("cpu", hidden=64, layers=1, tokens=(32,), microbatches=2, dtype=torch.float32, repeats=1)
    assert plain["fraction"] == 1.0 and plain["step_s_selective"] is None  # the CPU's copies hide: full offload
    lines = format_selective([row, plain])
    assert len(lines) == 4 and "0.50" in lines[2] and "not run" in lines[3]
    with pytest.raises(ValueError, match=r"fraction=0 must be in \(0, 1\]"):
        measure_offload("cpu", hidden=64, layers=1, tokens=(32,), fraction=0)


def test_full_offload_holds_fewer_microbatches_at_once():
    (row,) = measure_offload("cpu", hidden=64, layers=1, tokens=(32,), microbatches=4, dtype=torch.float32, repeats=1)
    assert row["grads_match"]
    assert row["saved_peak_mb_none"] == 4.0
    assert row["saved_peak_mb_offload"] < 4.0


@pytest.mark.cuda
def test_measure_offload_on_cuda_small():
    rows = measure_offload("cuda", hidden=256, layers=1, tokens=(512,), microbatches=4, dtype=torch.bfloat16, repeats=2)
    (r,) = rows
    assert r["grads_match"], r["grad_max_rel_diff"]
    assert r["late_reloads"] == 0
    assert r["peak_bytes_none"] > r["base_bytes"] > 0 and r["act_bytes_none"] > 0
    assert r["act_bytes_offload"] <= r["act_bytes_none"]
    assert r["k_measured"] > 0 and r["k_docs"] > 0
    assert len(format_offload(rows)) == 3
    # selective offload on the GPU's side stream: half of each microbatch out and back, the rest kept
    (h,) = measure_offload("cuda", hidden=256, layers=1, tokens=(512,), microbatches=4, dtype=torch.bfloat16,
                           repeats=2, fraction=0.5)
    assert h["grads_match"], h["grad_max_rel_diff"]
    assert h["late_reloads"] == 0 and 0.3 < h["offloaded_bytes_selective"] / h["offloaded_bytes_full"] < 0.7
    assert h["act_bytes_selective"] <= h["act_bytes_none"]
    assert len(format_selective([*rows, h])) == 4
