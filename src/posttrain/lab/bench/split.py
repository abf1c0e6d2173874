"""How every three-engine benchmark splits a speedup: the total over FSDP2, the part from ODC's
transport and engine (collective ODC over FSDP2), and ODC's own mechanism (ODC with its own
balancing over collective ODC), each a median with the lowest and highest round."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

__all__ = ["interleaved_rounds", "log_split", "split_ratios", "write_result"]


def split_ratios(rounds: Sequence[dict], names: Sequence[str], value: Callable = lambda x: x) -> dict:
    """``{"total", "transport_and_engine", "mechanism"}``: ``(median, lowest, highest)`` over
    ``rounds`` (each ``{name: measurement}``) of the throughput ratios; ``names`` are the FSDP2,
    collective-ODC and ODC variants in that order; ``value`` reads a throughput from a measurement."""
    fsdp, coll, odc = names

    def ratio(a: str, b: str) -> tuple[float, float, float]:
        vals = [value(x[a]) / value(x[b]) for x in rounds]
        return statistics.median(vals), min(vals), max(vals)

    return {"total": ratio(odc, fsdp), "mechanism": ratio(odc, coll), "transport_and_engine": ratio(coll, fsdp)}


def log_split(result: dict, names: Sequence[str], log=print) -> None:
    """Print the three ratios of :func:`split_ratios` with what each divides."""
    fsdp, coll, odc = names
    for key, label in (("total", f"{odc} / {fsdp}"), ("transport_and_engine", f"{coll} / {fsdp}"),
                       ("mechanism", f"ODC's own: {odc} / {coll}")):
        m, lo, hi = result[key]
        log(f"  {key:22s} {m:5.2f}x  ({lo:.2f}-{hi:.2f})  {label}")


def interleaved_rounds(repeats: int, variants: Sequence, measure: Callable, *, unit: str = "tokens/s",
                       log=print) -> list[dict]:
    """``repeats`` rounds, each running every variant once in turn (so slow drifts of the machine
    hit all alike): ``measure(variant) -> (name, measurement, throughput)``; per round
    ``{name: measurement}``, each printed as it comes."""
    rounds = []
    for k in range(repeats):
        got = {}
        for variant in variants:
            name, measurement, throughput = measure(variant)
            got[name] = measurement
            log(f"  round {k + 1}/{repeats}  {name:28s} {throughput:8.0f} {unit}", flush=True)
        rounds.append(got)
    return rounds


def write_result(result: dict, path: str | None, log=print) -> None:
    """Write a benchmark's result as JSON to ``path`` (folders made; nothing without a path)."""
    if not path:
        return
    import json
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
