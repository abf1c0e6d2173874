"""How steady this machine's speed is: the same small matrix products timed back to back for a
while, reported per second as the mean over the fastest. Run it alone:
``.venv/bin/python scripts/machine_noise.py [seconds]`` (docs/odc.md, "Measuring on 2 shared cores",
quotes it). One thread, so one core; a second copy in parallel shows the other core."""

from __future__ import annotations

import statistics
import sys
import time

import torch


def main(seconds: float = 15.0) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    for _ in range(50):
        a @ b
    times: list[tuple[float, float]] = []  # (when, how long 20 products took)
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        for _ in range(20):
            a @ b
        times.append((now, time.perf_counter() - now))
    fastest = min(t for _, t in times)
    start = times[0][0]
    per_second = [statistics.mean(t for w, t in times if k <= w - start < k + 1) / fastest for k in range(int(seconds))]
    median = statistics.median(t for _, t in times) / fastest
    print(f"{len(times)} timings of the same work over {seconds:.0f} s: median {median:.2f}x "
          f"the fastest, 90th percentile {sorted(t for _, t in times)[int(0.9 * len(times))] / fastest:.2f}x")
    print("each second's mean over the fastest: " + " ".join(f"{x:.2f}" for x in per_second))


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 15.0)
