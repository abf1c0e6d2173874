"""``posttrain doctor``: check the GPU paths on a machine that has a GPU, and write what it found.

On a CUDA machine it records the devices and versions, runs the CUDA test subset of this checkout
(``pytest -m cuda``: tests that skip without CUDA), measures copy bandwidths the engines and the
offload depend on, each beside a device-to-device copy in the same run, and writes
``out/gpu-report.md``. Without CUDA it says so in one line and lists what it would check, so the
same command is safe to run anywhere.

Every figure in the report is measured by that run on that machine; nothing is carried over.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.device import cuda_available, describe

__all__ = ["CHECKS", "Doctor", "copy_bandwidths", "find_tests"]

#: What the doctor checks on a CUDA machine, in the order it runs them.
CHECKS = (
    "the devices: GPU model, memory and count; driver, CUDA and torch versions",
    "the CUDA test subset (pytest -m cuda): every engine in train, RL and the pipeline (x flat ODC) on "
    "the GPU against the CPU run (ranks sharing the GPU over gloo where there are fewer GPUs; two-GPU "
    "cases skip on one), ODC's device transport, the offload store (pinned buffers, side stream, events), "
    "event-timed spans",
    "copy bandwidth beside a device-to-device copy: host-to-device and device-to-host from pinned "
    "memory (the offload link, PipeOffload's k)",
    "ODC's device transport (2 processes, CUDA IPC): gather and scatter-accumulate (per-writer slots, "
    "atomic adds, locked adds) beside a device-to-device copy",
    "flat ODC's engine overhead: a ~110M-parameter Llama step in bf16, 2 ODC processes on one GPU against "
    "one unsharded process",
    "PipeOffload on one Llama-style stage (hidden 4096, 4k and 16k tokens, bf16): full offload's cost in "
    "step time, the activation memory it frees, measured k beside the formula; selective offload at the "
    "share the planner picks for that k, its cost predicted and measured",
)


@dataclass(frozen=True)
class Doctor:
    """``posttrain doctor``: where the report goes and what to skip.

    Attributes:
        out: the report file (Markdown).
        no_tests: skip the CUDA test subset (only the devices and the measurements).
        no_measure: skip the transport, engine and offload measurements (devices, tests, copies).
        copy_mib: the size of each measured copy, MiB.
        repeats: timed copies per measurement (the median is reported).
    """

    out: str = "out/gpu-report.md"
    no_tests: bool = False
    copy_mib: int = 256
    repeats: int = 10
    no_measure: bool = False

    def __post_init__(self) -> None:
        if self.copy_mib < 1:
            raise ValueError(f"copy_mib={self.copy_mib} must be at least 1")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be at least 1")

    def run(self, log: Callable[[str], None] = print) -> int:
        """Check and write the report; 0 when everything checked passed (or there is no GPU to
        check), 1 when a test failed."""
        if not cuda_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            log(f"posttrain doctor: no CUDA device here (torch {torch.__version__}, {build}); on a GPU machine it "
                "checks:")
            for check in CHECKS:
                log(f"  - {check}")
            return 0
        t0 = time.perf_counter()
        lines = ["# GPU report", "", f"`posttrain doctor` on {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}; "
                 f"posttrain commit {_commit()}.", "", "## Devices", ""]
        for key, value in devices().items():
            lines.append(f"- {key}: {value}")
            log(f"{key}: {value}")
        ok = True
        self._write(lines)  # after every section: a run cut short keeps what it found
        if not self.no_tests:
            tests = find_tests()
            lines += ["", "## The CUDA test subset", ""]
            if tests is None:
                lines.append("not run: no tests/ folder next to this posttrain (run the doctor from a checkout)")
                log("CUDA tests: no tests/ folder found; skipped")
            else:
                log(f"running pytest -m cuda in {tests} ...")
                proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                       tests], capture_output=True, text=True, cwd=os.path.dirname(tests))
                log_path = os.path.splitext(self.out)[0] + "-tests.log"
                os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
                with open(log_path, "w") as f:
                    f.write(proc.stdout + proc.stderr)
                summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
                ok = proc.returncode == 0
                log(f"CUDA tests: {summary}")
                lines += [f"`pytest -m cuda`: {summary} (exit {proc.returncode}; the whole log: {log_path})", ""]
                if not ok:
                    lines += ["```", proc.stdout[-6000:], proc.stderr[-2000:], "```"]
            self._write(lines)
        if self.no_measure:
            sections = []
        else:
            sections = [("ODC device transport", _transport_section), ("Flat ODC engine overhead", _step_section),
                        ("Offload on one Llama stage", _offload_section)]
        rows = copy_bandwidths(self.copy_mib, self.repeats)
        lines += ["", f"## Copy bandwidth ({self.copy_mib} MiB, median of {self.repeats})", "",
                  "| copy | GB/s | / device-to-device |", "|---|---|---|"]
        d2d = rows["device-to-device"]
        for name, gbps in rows.items():
            lines.append(f"| {name} | {gbps:.1f} | {gbps / d2d:.3f} |")
            log(f"{name}: {gbps:.1f} GB/s ({gbps / d2d:.3f} of device-to-device)")
        for title, fn in sections:
            log(f"{title} ...")
            lines += ["", f"## {title}", ""]
            t1 = time.perf_counter()
            try:
                got = fn(log)
            except Exception as exc:  # a failed measurement is reported, the others still run
                ok = False
                tail = traceback.format_exc().strip().splitlines()[-12:]
                log(f"{title} FAILED: {type(exc).__name__}: {exc}")
                got = ["FAILED:", "```", *tail, "```"]
            lines += [*got, "", f"({time.perf_counter() - t1:.0f} s)"]
            self._write(lines)
        lines += ["", f"Finished in {time.perf_counter() - t0:.0f} s; {'every check passed' if ok else 'a check FAILED'}.",
                  ""]
        self._write(lines)
        log(f"wrote {self.out}")
        return 0 if ok else 1

    def _write(self, lines: list[str]) -> None:
        os.makedirs(os.path.dirname(self.out) or ".", exist_ok=True)
        with open(self.out + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(self.out + ".tmp", self.out)


def devices() -> dict[str, str]:
    """The GPU model, memory, count and the versions, as the report lists them."""
    out = {**describe("cuda"), "torch": torch.__version__, "CUDA (torch's build)": str(torch.version.cuda)}
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            out["driver"] = proc.stdout.strip().splitlines()[0]
    return out


def copy_bandwidths(mib: int, repeats: int, device: int = 0) -> dict[str, float]:
    """GB/s of a ``mib`` MiB copy device-to-device, host-to-device and device-to-host (pinned
    host memory), each the median of ``repeats`` copies timed by device events; the first copy of
    each is checked to deliver the bytes it was given (else ``AssertionError``)."""
    n = mib * 2**20
    dev = torch.device("cuda", device)
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("device-to-device", b, a), ("host-to-device (pinned)", a, host),
                           ("device-to-host (pinned)", host, a)):
        src_copy = src.clone()  # what the copies must deliver (a, b and host take turns)
        dst.zero_()
        torch.accelerator.synchronize(dev)
        dst.copy_(src, non_blocking=True)  # warm-up, and the copy whose contents are checked
        torch.accelerator.synchronize(dev)
        if not torch.equal(dst.cpu(), src_copy.cpu()):
            raise AssertionError(f"{name} copy of {mib} MiB delivered other bytes than it was given")
        times = []
        for _ in range(repeats):
            start, end = torch.Event(device=dev, enable_timing=True), torch.Event(device=dev, enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = n / statistics.median(times) / 1e9
    return out


def find_tests() -> str | None:
    """The ``tests/`` folder of the checkout this posttrain runs from (``None``: an install
    without one)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # src/
    for root in (os.getcwd(), os.path.dirname(here)):
        path = os.path.join(root, "tests")
        if os.path.isfile(os.path.join(path, "conftest.py")):
            return path
    return None


def _commit() -> str:
    try:
        proc = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        return proc.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _transport_section(log: Callable[[str], None]) -> list[str]:
    from posttrain.lab.bench.device_transport import bench_device_transport, format_rows

    rows = bench_device_transport(log=log)
    return ["2 processes on this host's GPU(s), fp32 regions; `alone`: rank 0 works while rank 1 waits, `both`: "
            "both at once. GB/s count the region's bytes per operation.", "", *format_rows(rows)]


def _step_section(log: Callable[[str], None]) -> list[str]:
    from posttrain.lab.bench.gpu_step import bench_gpu_step

    r = bench_gpu_step(log=log)
    med = statistics.median
    return [f"Llama, {r['params'] / 1e6:.0f}M parameters, bf16 compute with fp32 master weights (AdamW), "
            f"{r['microbatches']} x {r['seq_len']} tokens a step:", "",
            "| variant | step ms (median over rounds) | peak GiB |", "|---|---|---|",
            f"| one process, unsharded | {med(r['single_s']) * 1e3:.1f} | {r['single_peak_gib']:.1f} |",
            f"| flat ODC, 2 processes on one GPU | {med(r['odc_s']) * 1e3:.1f} | {r['odc_peak_gib']:.1f} |", "",
            f"odc / single: {r['ratio']:.2f} (range {r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}). Losses: "
            f"single {', '.join(f'{x:.4f}' for x in r['single_losses'])}; odc "
            f"{', '.join(f'{x:.4f}' for x in r['odc_losses'])}."]


def _offload_section(log: Callable[[str], None]) -> list[str]:
    from posttrain.lab.offload_gpu import format_offload, format_selective, measure_offload

    rows = measure_offload(torch.device("cuda", 0), microbatches=8)
    lines = [*format_offload(rows), "", "Selective offload at the share the planner picks for the measured k:", "",
             *format_selective(rows)]
    for line in lines:
        log(line)
    return lines
