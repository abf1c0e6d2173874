"""Split attention's compute per zigzag shard, alone (no exchange): one process, one thread.

A sequence of ``n`` tokens split over 2 ranks (posttrain.balance.packing.zigzag): shard 0 holds
chunks 0 and 3 of 4, shard 1 chunks 1 and 2. Each shard's queries attend to the whole sequence's keys
through posttrain.models.split_attention's run attention (the CPU's flash kernel, log-sum-exp merge),
forward then backward, the two shards and the whole sequence's causal forward taking turns over 12
rounds (the first 2 not counted); the medians. Both shards do the same attention work, half the
whole sequence's: this says whether the kernel calls make one shard slower than the other. Also
shard 1 with its two adjacent chunks as one run, as causal_blocks ran it before 2026-11-28 (one
causal square twice as long: 15-20% slower at 1,024 tokens).

Usage: python scripts/split_attention_probe.py [n] (default 4096; heads 4 x 32, GPT's default shape)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from posttrain.balance.packing import shard_positions
from posttrain.models.split_attention import _LSE_ATTENTION, _RunAttention, causal_blocks


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    n = int(argv[0]) if argv else 4096
    heads, dim = 4, 32
    torch.manual_seed(0)
    q_all, k_all, v_all = (torch.randn(1, heads, n, dim) for _ in range(3))
    kernel = _LSE_ATTENTION["cpu"]
    key_positions = torch.cat([shard_positions(n, 0, 2), shard_positions(n, 1, 2)])
    order = torch.argsort(key_positions)
    keys, values = (t[:, :, key_positions][:, :, order] for t in (k_all, v_all))

    def shard(index: int, merged: bool = False) -> tuple[float, float]:
        pos = shard_positions(n, index, 2)
        runs = causal_blocks(pos, key_positions).runs
        if merged:  # adjacent runs as one (shard 1's two chunks: how causal_blocks ran them before 2026-11-28)
            one = [runs[0]]
            for b, e, before, upto in runs[1:]:
                if b == one[-1][1] and before == one[-1][3]:
                    one[-1] = (one[-1][0], e, one[-1][2], upto)
                else:
                    one.append((b, e, before, upto))
            runs = one
        q = q_all[:, :, pos].clone().requires_grad_()
        k, v = keys.clone().requires_grad_(), values.clone().requires_grad_()
        t0 = time.perf_counter()
        out = _RunAttention.apply(q, k, v, runs, dim ** -0.5, kernel)
        t1 = time.perf_counter()
        out.sum().backward()
        return t1 - t0, time.perf_counter() - t1

    def whole() -> tuple[float, float]:
        t0 = time.perf_counter()
        kernel[0](q_all, k_all, v_all, True, dim ** -0.5)
        return time.perf_counter() - t0, float("nan")

    variants = {"shard 0 (chunks 0, 3)": lambda: shard(0), "shard 1 (chunks 1, 2)": lambda: shard(1),
                "shard 1 as one run (before)": lambda: shard(1, merged=True),
                "whole, causal": whole}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(12):
        for name, fn in variants.items():
            times[name].append(fn())
    print(f"{n} tokens, {heads} heads of {dim}, one thread; medians of 10 rounds:")
    for name, got in times.items():
        fwd = statistics.median(t[0] for t in got[2:])
        bwd = statistics.median(t[1] for t in got[2:])
        print(f"  {name:28} forward {1e3 * fwd:7.2f} ms" + ("" if bwd != bwd else f"  backward {1e3 * bwd:7.2f} ms"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
