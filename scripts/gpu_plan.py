"""The dry run's plan of `scripts/gpu-verify.sh tests`: the CUDA tests it would run and the time to
expect, from the per-test seconds the last GPU run recorded (scripts/gpu-durations.txt, written by
gpu-verify.sh as $OUT/durations.txt and committed). A test with no record is planned at a guess and
said so; the bound is every test at its timeout.

Usage: python scripts/gpu_plan.py COLLECTED DURATIONS WORKERS TEST_TIMEOUT PART_TIMEOUT
"""

from __future__ import annotations

import heapq
import os
import sys

GUESS_S = 30.0  # a test without a recorded duration (a CUDA test starts 1-4 processes that import torch)


def makespan(seconds: list[float], workers: int) -> float:
    """Longest-first onto the least loaded worker (what pytest-xdist's load scheduling approaches)."""
    loads = [0.0] * max(1, workers)
    heapq.heapify(loads)
    for s in sorted(seconds, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + s)
    return max(loads)


def main(argv: list[str]) -> int:
    collected, durations, workers, test_timeout, part_timeout = argv
    workers, test_timeout, part_timeout = int(workers), float(test_timeout), float(part_timeout)
    tests = [line.strip() for line in open(collected) if "::" in line]
    recorded = {}
    if os.path.exists(durations):
        for line in open(durations):
            if line.strip() and not line.startswith("#"):
                s, test = line.split(maxsplit=1)
                recorded[test.strip()] = float(s)
    if not tests:
        print("gpu_plan: no CUDA test collected (run from the checkout's root)", file=sys.stderr)
        return 1
    seconds = []
    for t in tests:
        s = recorded.get(t)
        seconds.append(s if s is not None else GUESS_S)
        print(f"    {f'{s:6.1f} s' if s is not None else '  no record'}  {t}")
    missing = sum(1 for t in tests if t not in recorded)
    w = max(1, workers)
    expected = makespan(seconds, w)
    bound = makespan([test_timeout] * len(tests), w)
    print(f"  {len(tests)} tests; {len(tests) - missing} with a recorded duration"
          + (f", {missing} without (planned at {GUESS_S:.0f} s each, a guess)" if missing else "")
          + f"; expected {expected:.0f} s on {w} worker(s), at most {bound:.0f} s with every test at its timeout;"
          f" the part is cut at {part_timeout:.0f} s")
    if expected > part_timeout:
        print(f"gpu_plan: the expected {expected:.0f} s exceed the part's {part_timeout:.0f} s: raise WORKERS or split "
              "the tests", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
