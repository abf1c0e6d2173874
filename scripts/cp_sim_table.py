"""The simulated table of context parallelism in docs/odc.md: ``posttrain simulate odc
--context-parallel auto`` for every profile x sequences a rank x world size, printed as the
table's markdown rows (``odc+cp / odc+diff_micro`` and ODC's mean utilization without and with
splitting). Predictions of the simulator, nothing here runs a model.

    python scripts/cp_sim_table.py                      # the docs' table, about 6 minutes
    python scripts/cp_sim_table.py --worlds 8 16 --per-rank 2
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time


def cell(profile: str, world: int, per_rank: int, minibatches: int) -> str:
    """One cell: ``2.04x (0.48 -> 0.98)``, or ``1.00x (nothing split)``."""
    out = subprocess.run(
        [sys.executable, "-m", "posttrain", "simulate", "odc", "--profile", profile, "--world-size", str(world),
         "--sequences-per-rank", str(per_rank), "--minibatches", str(minibatches), "--context-parallel", "auto",
         "--trace", "", "--plot", ""], capture_output=True, text=True, check=True).stdout
    util = {}
    for line in out.splitlines():
        m = re.match(r"(odc\+diff_micro|odc\+cp \(\d+ split\))\s+[\d,]+\s+[\d.]+\s+[\d.]+/([\d.]+)", line)
        if m:
            util["cp" if m.group(1).startswith("odc+cp") else "odc"] = m.group(2)
    if "cp" not in util or "odc+cp (0 split)" in out:
        return "1.00x (nothing split)"
    speed = re.search(r"speedup odc\+cp \(\d+ split\) / odc\+diff_micro: ([\d.]+)", out)
    if speed is None or "odc" not in util:
        raise SystemExit(f"unexpected `simulate odc` output:\n{out}")
    return f"{speed.group(1)}x ({util['odc']} -> {util['cp']})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="+", default=["longalign", "long_tail"])
    ap.add_argument("--per-rank", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--worlds", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--minibatches", type=int, default=4)
    a = ap.parse_args()
    t0 = time.time()
    print("| profile | sequences a rank | " + " | ".join(f"{w} GPUs" for w in a.worlds) + " |")
    print("|---|---|" + "---|" * len(a.worlds))
    for profile in a.profiles:
        for s in a.per_rank:
            cells = [cell(profile, w, s, a.minibatches) for w in a.worlds]
            print(f"| {profile} | {s} | " + " | ".join(cells) + " |", flush=True)
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
