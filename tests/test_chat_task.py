"""The embedded chat task end to end, as a user runs it: make the model directory and data,
post-train on the assistant's tokens under flat ODC, export, grade by exact match. A failure
means post-training through posttrain does not teach a model what plain training would."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from posttrain.lab.chat import exact_match, make_chat_task
from posttrain.train.dp import TrainConfig, run_training


def test_a_short_cpu_run_learns_the_chat_task(tmp_path):
    paths = make_chat_task(tmp_path / "task", train_records=2000, eval_records=32)
    before = exact_match(paths["model"], paths["eval"])
    out = tmp_path / "model"
    cfg = TrainConfig(model_path=paths["model"], data=paths["train"], eval_data=paths["eval"], eval_every=100,
                      sequences=32, max_tokens=256, steps=300, lr=3e-3, output_dir=str(out))
    metrics = run_training(cfg, world_size=2, quiet=True)[0]["metrics"]
    evals = [m["eval_loss"] for m in metrics if m["eval_loss"] is not None]
    assert len(evals) == 3 and evals[-1] < 0.5 * evals[0]  # held-out loss falls
    after = exact_match(str(out), paths["eval"])
    assert before["accuracy"] == 0.0 and after["accuracy"] >= 0.3, (before, after)
