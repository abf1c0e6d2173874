"""``posttrain export CKPT_DIR OUT_DIR``: a training checkpoint as a ``transformers`` model directory."""

from __future__ import annotations

from dataclasses import dataclass, field

from .options import add_command

__all__ = ["ExportCommand", "add_parser"]


@dataclass(frozen=True)
class ExportCommand:
    """``posttrain export``: the checkpoint and the model directory it becomes.

    Attributes:
        checkpoint: a run's checkpoint directory (its newest checkpoint) or one step-N folder.
        out_dir: the model directory to write (replaced if it exists).
    """

    checkpoint: str = field(default="", metadata={"positional": "CKPT_DIR"})
    out_dir: str = field(default="", metadata={"positional": "OUT_DIR"})


def _run(c: ExportCommand) -> int:
    from posttrain.train.sft import export_checkpoint

    out = export_checkpoint(c.checkpoint, c.out_dir)
    print(f"wrote {out} (AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it)")
    return 0


def add_parser(sub) -> None:
    add_command(sub, "export", ExportCommand, _run, help="turn a training checkpoint into a transformers model directory")
