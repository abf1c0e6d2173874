"""The step skeleton every trainer runs (``posttrain.train.core.Trainer``), on a toy trainer: the
cadence of checkpoints, exports and metrics rows, resuming, and closing on failure. A failure
names the promise the core broke for every trainer at once."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist

from posttrain.launch import run_ranks
from posttrain.train.core import RunConfig, Trainer, check_run


@dataclass(frozen=True)
class ToyConfig(RunConfig):
    """A toy run.

    Attributes:
        fail_at: raise in this step (-1: never).
    """

    fail_at: int = -1
    DATA_FIELDS: ClassVar[tuple[str, ...]] = ("seed",)
    CHECKPOINT_FORMAT: ClassVar[str | None] = "toy"  # its own state, not an engine's

    @property
    def sequences_per_step(self) -> int:
        return 1


class _State:
    """One parameter, checkpointed whole on every rank."""

    checkpoint_format = "toy"

    def __init__(self, p: torch.nn.Parameter) -> None:
        self.p = p

    def state_dict(self, optimizer):
        return {"model": {"p": self.p.detach()}}

    def load_state_dict(self, state, optimizer):
        with torch.no_grad():
            self.p.copy_(state["model"]["p"])


class Toy(Trainer):
    scalars = ("loss",)

    def __init__(self, cfg: ToyConfig, rank: int, world_size: int, events: list) -> None:
        self.p = torch.nn.Parameter(torch.zeros(3))
        self.events = events
        super().__init__(cfg, rank, world_size, state=_State(self.p), optimizer=torch.optim.SGD([self.p], lr=1.0),
                         label="toy")

    def train_step(self, step):
        if step == self.cfg.fail_at:
            raise ValueError(f"step {step} failed")
        with torch.no_grad():
            self.p += 1.0  # after n steps every entry is n
        dist.barrier()
        self.events.append(("step", step))
        return {"step": step, "rank": self.rank, "loss": float(self.p[0])}

    def export(self):
        self.events.append(("export", int(self.p[0])))
        dist.barrier()

    def progress_line(self, step, row):
        return f"toy step {step}"

    def close(self):
        self.events.append(("close",))


def _worker(rank, world_size, cfg):
    events: list = []
    trainer = Toy(cfg, rank, world_size, events)
    try:
        rows = trainer.run()
    except ValueError:
        return {"events": events, "failed": True}
    return {"events": events, "rows": rows, "resumed_from": trainer.resumed_from, "p": trainer.p.detach().clone()}


def test_checkpoints_exports_and_metrics_follow_their_cadence_and_a_run_resumes(tmp_path):
    cfg = ToyConfig(steps=5, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, output_dir=str(tmp_path / "out"),
                    save_every=2, metrics=str(tmp_path / "m.jsonl"))
    check_run(cfg)
    first = run_ranks(_worker, 2, replace(cfg, steps=3))
    events = first[0]["events"]
    assert [e for e in events if e[0] == "export"] == [("export", 2), ("export", 3)]  # every 2nd, and the last
    assert events[-1] == ("close",)
    assert sorted(os.listdir(cfg.checkpoint_dir)) == ["latest", "step-000002", "step-000003"]
    rows = [json.loads(line) for line in open(cfg.metrics)]
    assert [(r["step"], r["rank"]) for r in rows] == [(s, r) for s in range(3) for r in range(2)]  # every rank's row
    rest = run_ranks(_worker, 2, cfg)
    assert rest[0]["resumed_from"] == 3 and [r["step"] for r in rest[0]["rows"]] == [3, 4]
    assert torch.equal(rest[0]["p"], torch.full((3,), 5.0))  # resumed from the checkpoint's values
    assert [e for e in rest[0]["events"] if e[0] == "export"] == [("export", 4), ("export", 5)]
    assert len(open(cfg.metrics).read().splitlines()) == 10  # the resumed run appended its rows
    assert sorted(os.listdir(cfg.checkpoint_dir)) == ["latest", "step-000004", "step-000005"]


def test_a_failing_step_still_closes_and_writes_nothing_after_it(tmp_path):
    cfg = ToyConfig(steps=4, fail_at=2, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1,
                    output_dir=str(tmp_path / "out"), save_every=1)
    out = run_ranks(_worker, 2, cfg)
    for r in out:
        assert r["failed"] and r["events"][-1] == ("close",)
        assert [e for e in r["events"] if e[0] == "export"] == [("export", 1), ("export", 2)]  # steps 0 and 1 only
    assert sorted(os.listdir(cfg.checkpoint_dir)) == ["latest", "step-000001", "step-000002"]


def test_a_run_that_cannot_write_its_outputs_is_refused_before_any_rank(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"`output_dir` .* is a file, not a directory"):
        check_run(ToyConfig(output_dir=str(tmp_path / "file")))
    with pytest.raises(ValueError, match=r"`metrics` .* is a directory"):
        check_run(ToyConfig(metrics=str(tmp_path)))
    with pytest.raises(ValueError, match="`save_every` needs `output_dir`"):
        ToyConfig(save_every=2)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_resumed_metrics_file_drops_the_steps_past_its_checkpoint(tmp_path, suffix):
    """A run killed after step 4 with its checkpoint after step 2 (and a last line cut short)
    resumes after step 2: the file keeps steps 0-2 and every resumed step appears once."""
    from posttrain.train.core import MetricsLog

    path = str(tmp_path / f"m{suffix}")
    log = MetricsLog(path)
    for step in range(5):
        log.append([{"step": step, "rank": 0, "loss": 1.0 / (step + 1)}])
    log.close()
    with open(path, "a") as f:
        f.write('{"step": 5, "ra' if suffix == ".jsonl" else "5,0")
    log = MetricsLog(path, resume_from=3)
    for step in range(3, 6):
        log.append([{"step": step, "rank": 0, "loss": 0.5}])
    log.close()
    if suffix == ".csv":
        import csv

        with open(path, newline="") as f:
            steps = [int(r["step"]) for r in csv.DictReader(f)]
    else:
        import json

        steps = [json.loads(line)["step"] for line in open(path)]
    assert steps == [0, 1, 2, 3, 4, 5]


def _wandb_history(root) -> list[tuple[str, int, float]]:
    """(run id, step, train/loss) of every history record in the offline W&B runs under
    ``root``, in the order the runs were written. W&B has no reader of its own for these files:
    they are LevelDB-style logs (a 7-byte header, then 32 KiB blocks of records, each a CRC, a
    length and a type: full, first, middle or last) of ``wandb_internal_pb2.Record``."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(glob.glob(os.path.join(root, "wandb", "offline-run-*", "*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", path
        at, block, pending = 7, 32768, b""
        while at + 7 <= len(data):
            if block - at % block < 7:  # a block's tail too short for a header is padding
                at += block - at % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[at:at + 7])
            if kind == 0:
                break
            pending += data[at + 7:at + 7 + length]
            at += 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                rec = pb.Record()
                rec.ParseFromString(pending)
                pending = b""
                if rec.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                    if "train/loss" in items:
                        out.append((os.path.basename(path)[4:-6], int(items["_step"]), items["train/loss"]))
    return out


def test_wandb_gets_the_steps_figures_offline_and_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = ToyConfig(steps=5, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1, wandb="toy-project")
    check_run(cfg)
    run_ranks(_worker, 2, replace(cfg, steps=3))
    first = _wandb_history(tmp_path)
    assert [(s, v) for _, s, v in first] == [(1, 1.0), (2, 2.0), (3, 3.0)]  # step n's loss is n (rank 0's row)
    run_ranks(_worker, 2, cfg)
    every = _wandb_history(tmp_path)
    assert [(s, v) for _, s, v in every] == [(s, float(s)) for s in range(1, 6)]  # the resumed run's steps follow
    assert len({run for run, _, _ in every}) == 1  # one W&B run: the resumed run continued it
    assert json.load(open(tmp_path / "ckpt" / "wandb-run.json"))["id"] == every[0][0]


def test_wandb_is_checked_before_any_rank(monkeypatch):
    with pytest.raises(ValueError, match="`wandb` 'a/b' is not a W&B project name"):
        check_run(ToyConfig(wandb="a/b"))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"`wandb` needs the wandb package: pip install wandb"):
        check_run(ToyConfig(wandb="p"))


def test_metrics_are_buffered_and_flushed_on_the_window_and_at_close(tmp_path):
    from posttrain.train.core import MetricsLog

    path = tmp_path / "m.jsonl"
    log = MetricsLog(str(path), flush_every=3600.0)
    log.append([{"step": 0, "loss": 1.0}])
    log.append([{"step": 1, "loss": 0.5}])
    assert path.read_text() == ""  # buffered: no write per step
    log.flush()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]
    log.append([{"step": 2, "loss": 0.25}])
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    eager = MetricsLog(str(tmp_path / "e.jsonl"), flush_every=0.0)
    eager.append([{"step": 0, "loss": 1.0}])
    assert (tmp_path / "e.jsonl").read_text().count("\n") == 1  # the window passed: on disk at once
    eager.close()


def test_a_wandb_finish_that_fails_loses_no_metrics_rows(tmp_path):
    from posttrain.train.core import MetricsLog

    class FailingRun:
        step = 0

        def log(self, figures, step):
            pass

        def finish(self, exit_code=0):
            raise ConnectionError("no network")

    path = tmp_path / "m.jsonl"
    log = MetricsLog(str(path), flush_every=3600.0)
    log._wandb = FailingRun()
    log.append([{"step": 0, "loss": 1.0}])
    with pytest.raises(ConnectionError):
        log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0]  # written before W&B's finish
