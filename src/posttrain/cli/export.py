"""``posttrain export CKPT_DIR OUT_DIR``: a training checkpoint as a ``transformers`` model directory."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def _run(args: argparse.Namespace) -> int:
    from posttrain.train.sft import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out_dir)
    print(f"wrote {out} (AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="turn a training checkpoint into a transformers model directory")
    p.add_argument("checkpoint", metavar="CKPT_DIR", help="a --checkpoint-dir (its newest checkpoint) or one step-N folder")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the model directory to write (replaced if it exists)")
    p.set_defaults(func=_run)
