"""What a page fault costs here: fill 32 MiB tensors, freshly allocated each time, with glibc's
default allocator (every large allocation a fresh ``mmap``: each first touch of a page faults)
and after ``posttrain.launch.keep_freed_memory`` (the freed memory kept: no faults), in two
processes each, taking turns; per mode the median time of 10 fills and the faults they took.

    python scripts/page_faults.py
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _measure(keep: bool) -> dict:
    import torch

    from posttrain.launch import keep_freed_memory

    torch.set_num_threads(1)
    if keep and not keep_freed_memory():
        raise SystemExit("keep_freed_memory did not apply here (not glibc, or the allocator set by the environment)")
    times, faults = [], []
    for _ in range(21):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        for _ in range(10):
            x = torch.empty(8 << 20)  # 32 MiB of fp32
            x.fill_(1.0)
            del x
        times.append(time.perf_counter() - t)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"ms": statistics.median(times[1:]) * 1e3, "faults": statistics.median(faults[1:])}


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] in ("default", "keep"):
        print(json.dumps(_measure(sys.argv[1] == "keep")))
        return 0
    got: dict[str, list[dict]] = {"default": [], "keep": []}
    for _ in range(2):
        for mode in got:
            out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, check=True,
                                 env={**os.environ, "POSTTRAIN_KEEP_FREED_MEMORY": "1"})
            got[mode].append(json.loads(out.stdout))
    for mode, runs in got.items():
        print(f"{mode:8} 10 fills of 32 MiB: " + ", ".join(f"{r['ms']:.1f} ms ({r['faults']:.0f} faults)" for r in runs))
    d, k = (statistics.median(r["ms"] for r in got[m]) for m in ("default", "keep"))
    faults = statistics.median(r["faults"] for r in got["default"])
    print(f"a fault costs about {(d - k) / max(1, faults) * 1e3:.2f} microseconds ({faults:.0f} faults, "
          f"{d:.1f} against {k:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
