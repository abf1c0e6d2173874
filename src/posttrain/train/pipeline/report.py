"""What ``posttrain pipeline`` prints: a per-rank table of a run."""

from __future__ import annotations

import statistics

__all__ = ["format_report"]

def format_report(results: list[dict], predicted: list[int]) -> str:
    """Per rank: stages, peak saved activations of all the rank's stages together (MiB and
    chunk-microbatches, predicted too), offloaded MiB and median step time of the steps after the
    first (the first pays for warm-up)."""
    lines = [f"{'rank':>4} {'stages':>8} {'peak MiB':>9} {'peak units':>10} {'predicted':>9} "
             f"{'offloaded MiB':>13} {'step s':>7}"]
    for r, (res, pred) in enumerate(zip(results, predicted)):
        last = res["result"]
        peak_mib = last["rank_peak_bytes"] / 2**20
        times = res["step_times"][1:] or res["step_times"]
        lines.append(f"{r:>4} {','.join(map(str, res['stages'])):>8} {peak_mib:>9.2f} {last['peak_units']:>10.2f} "
                     f"{pred:>9} {last['offloaded_bytes'] / 2**20:>13.2f} {statistics.median(times):>7.3f}")
    losses = [x for res in results for x in res["losses"] if x is not None]
    lines.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; peaks are of a rank's "
                 "stages together, measured by the saved-tensor hooks (last step)")
    return "\n".join(lines)
