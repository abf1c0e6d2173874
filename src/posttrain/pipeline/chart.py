"""What ``posttrain pipeline`` prints and draws: a per-rank table and a schedule chart PNG."""

from __future__ import annotations

import statistics
from pathlib import Path

__all__ = ["format_report", "plot_pipeline"]

_COLORS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#72b7b2"}


def format_report(results: list[dict], predicted: list[int]) -> str:
    """Per rank: stages, peak saved activations (MiB and chunk-microbatches, predicted too), offloaded
    MiB and median step time of the steps after the first (the first pays for warm-up)."""
    lines = [f"{'rank':>4} {'stages':>8} {'peak MiB':>9} {'peak units':>10} {'predicted':>9} "
             f"{'offloaded MiB':>13} {'step s':>7}"]
    for r, (res, pred) in enumerate(zip(results, predicted)):
        last = res["result"]
        peak_mib = sum(last["peak_bytes"].values()) / 2**20
        times = res["step_times"][1:] or res["step_times"]
        lines.append(f"{r:>4} {','.join(map(str, res['stages'])):>8} {peak_mib:>9.2f} {last['peak_units']:>10.2f} "
                     f"{pred:>9} {last['offloaded_bytes'] / 2**20:>13.2f} {statistics.median(times):>7.3f}")
    losses = [x for res in results for x in res["losses"] if x is not None]
    lines.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; peak MiB is the sum over a "
                 f"rank's stages of each stage's peak")
    return "\n".join(lines)


def plot_pipeline(results: list[dict], path: str | Path, title: str) -> Path:
    """One row per rank: the last step's actions as bars (F, B, I, W), offload/reload marks, and the
    resident saved activations (chunk-microbatches) on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(12, 1.6 * n + 1), sharex=True, squeeze=False)
    for r, (res, ax) in enumerate(zip(results, axes[:, 0])):
        last = res["result"]
        for text, t0, t1 in last["actions"]:
            kind = text.lstrip("0123456789").rstrip("0123456789")
            if kind in _COLORS:
                ax.broken_barh([(t0, max(t1 - t0, 1e-6))], (0.1, 0.8), color=_COLORS[kind])
            elif kind in ("OFFLOAD", "RELOAD"):
                ax.plot([t0], [0.05 if kind == "OFFLOAD" else 0.95], marker="v" if kind == "OFFLOAD" else "^",
                        color="black", markersize=4)
        ax.set_yticks([])
        ax.set_ylabel(f"rank {r}")
        mem = ax.twinx()
        xs, ys = zip(*last["curve"]) if last["curve"] else ((0,), (0,))
        mem.step(xs, ys, where="post", color="#54a24b", linewidth=1.2)
        mem.set_ylim(0, max(1.0, max(ys)) * 1.15)
        mem.set_ylabel("resident", fontsize=8)
    axes[-1, 0].set_xlabel("seconds into the step")
    handles = [Patch(color=c, label=k) for k, c in _COLORS.items()]
    handles += [plt.Line2D([], [], color="#54a24b", label="resident saved activations (chunk-microbatches)"),
                plt.Line2D([], [], color="black", marker="v", linestyle="", label="offload"),
                plt.Line2D([], [], color="black", marker="^", linestyle="", label="reload")]
    fig.suptitle(title, y=0.99, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.95), ncol=7, fontsize=8, frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
