"""``posttrain doctor``: check the GPU paths on this machine and write ``out/gpu-report.md``."""

from __future__ import annotations

from posttrain.lab.doctor import Doctor

from .options import add_command

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    add_command(sub, "doctor", Doctor, lambda d: d.run(),
                help="check the GPU paths here (devices, the CUDA tests, copy bandwidth) and write a report")
