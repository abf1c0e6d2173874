"""FSDP2 vs ODC training throughput on this machine; the same as ``posttrain bench odc``.

    python benchmarks/odc_vs_fsdp.py                       # long-tail profile, 5 rounds
    python benchmarks/odc_vs_fsdp.py --profile uniform     # near-equal lengths: the control

See :mod:`posttrain.bench` for what runs and how the ideal bound is measured.
"""

from __future__ import annotations

import sys

from posttrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "odc", *sys.argv[1:]]))
