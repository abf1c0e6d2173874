"""Pipeline benchmark on this machine; the same as ``posttrain bench pipeline``.

    python benchmarks/pipeline.py                 # 2 and 4 stages: memory table, then runner vs torch
    python benchmarks/pipeline.py --stages 2      # 2 stages only

See :mod:`posttrain.pipeline.bench` for what runs.
"""

from __future__ import annotations

import sys

from posttrain.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "pipeline", *sys.argv[1:]]))
