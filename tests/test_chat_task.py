"""The embedded chat task end to end, as a user runs it: make the model directory and data,
post-train on the assistant's tokens under flat ODC, export, grade by exact match. A failure
means post-training through posttrain does not teach a model what plain training would."""

from __future__ import annotations

from posttrain.lab.chat import exact_match, make_chat_task
from posttrain.train.dp import TrainConfig, run_training


def test_a_short_cpu_run_learns_the_chat_task(tmp_path):
    paths = make_chat_task(tmp_path / "task")  # the defaults: 4,000 conversations, 64 held out
    before = exact_match(paths["model"], paths["eval"])
    out = tmp_path / "model"
    # Deterministic: the run is bitwise reproducible, so where it ends does not drift between
    # runs (this task's loss falls steeply at a point that depends on tiny rounding differences).
    cfg = TrainConfig(model_path=paths["model"], data=paths["train"], eval_data=paths["eval"], eval_every=100,
                      sequences=32, max_tokens=256, steps=400, lr=3e-3, deterministic=True, output_dir=str(out))
    metrics = run_training(cfg, world_size=2, quiet=True)[0]["metrics"]
    evals = [m["eval_loss"] for m in metrics if m["eval_loss"] is not None]
    assert len(evals) == 4 and evals[-1] < 0.2 * evals[0]  # held-out loss falls
    after = exact_match(str(out), paths["eval"])
    assert before["accuracy"] == 0.0 and after["accuracy"] >= 0.5, (before, after)
