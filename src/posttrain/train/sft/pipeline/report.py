"""What ``posttrain pipeline`` prints: a per-rank table of a run."""

from __future__ import annotations

import statistics

__all__ = ["format_dp_report", "format_report", "measured_weight_keep"]


def measured_weight_keep(results: list[dict]) -> dict[int, float]:
    """Per stage, the fraction of a chunk-microbatch ``W`` kept in a run (``run_pipeline``'s
    results, or a ``--calibration-out`` file's ranks: each rank's last step)."""
    return {int(s): f for r in results for s, f in r["result"].get("weight_keep", {}).items()}


def _weight_keep_line(results: list[dict]) -> list[str]:
    keep = measured_weight_keep(results)
    if not keep:
        return []
    return ["kept for W after I, of a chunk-microbatch, per stage: "
            + ", ".join(f"{s}: {f:.2f}" for s, f in sorted(keep.items()))
            + " (the prediction uses these; `no_weight_split` keeps 1.00)"]


def format_report(results: list[dict], predicted: list[float]) -> str:
    """Per rank: stages, peak saved activations of all the rank's stages together (MiB and
    chunk-microbatches, predicted too), offloaded MiB and median step time of the steps after the
    first (the first pays for warm-up); under a split backward, what each stage kept for W."""
    lines = [f"{'rank':>4} {'stages':>8} {'peak MiB':>9} {'peak units':>10} {'predicted':>9} "
             f"{'offloaded MiB':>13} {'step s':>7}"]
    for r, (res, pred) in enumerate(zip(results, predicted)):
        last = res["result"]
        peak_mib = last["rank_peak_bytes"] / 2**20
        times = res["step_times"][1:] or res["step_times"]
        lines.append(f"{r:>4} {','.join(map(str, res['stages'])):>8} {peak_mib:>9.2f} {last['peak_units']:>10.2f} "
                     f"{pred:>9.2f} {last['offloaded_bytes'] / 2**20:>13.2f} {statistics.median(times):>7.3f}")
    lines += _weight_keep_line(results)
    losses = [x for res in results for x in res["losses"] if x is not None]
    lines.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; peaks are of a rank's "
                 "stages together, measured by the saved-tensor hooks (last step)")
    return "\n".join(lines)


def format_dp_report(results: list[dict], predicted: dict[tuple[int, int], float]) -> str:
    """Per process of a pipeline x data-parallel run: its pipeline, stages, microbatches in the last
    step, peak saved activations (``predicted``: by ``(pipeline, pipeline rank)`` for the pipeline's
    own microbatch count), offloaded MiB and median step time after the first step."""
    lines = [f"{'rank':>4} {'pipeline':>8} {'stages':>8} {'microbatches':>12} {'peak MiB':>9} {'peak units':>10} "
             f"{'predicted':>9} {'offloaded MiB':>13} {'step s':>7}"]
    for res in results:
        last = res["result"]
        times = res["step_times"][1:] or res["step_times"]
        lines.append(f"{res['rank']:>4} {res['dp_rank']:>8} {','.join(map(str, res['stages'])):>8} "
                     f"{res['microbatches'][-1]:>12} {last['rank_peak_bytes'] / 2**20:>9.2f} {last['peak_units']:>10.2f} "
                     f"{predicted[(res['dp_rank'], res['pp_rank'])]:>9.2f} {last['offloaded_bytes'] / 2**20:>13.2f} "
                     f"{statistics.median(times):>7.3f}")
    losses = results[0]["losses"]
    counts = ", ".join("/".join(str(m) for m in step) for step in zip(*(
        r["microbatches"] for r in results if r["pp_rank"] == 0)))
    lines.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; microbatches per pipeline and "
                 f"step: {counts}; peak units are of the pipeline's largest microbatch (last step)")
    return "\n".join(lines)
