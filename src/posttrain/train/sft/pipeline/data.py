"""Real data through the pipeline: a step's records packed into the schedule's microbatches.

A pipeline schedule is built for a fixed number of microbatches ``m``, and every stage runs every
microbatch, so the step's records are split into exactly ``m`` sets of balanced cost
(:func:`~posttrain.balance.exact.min_max_partition` on the FLOPs of each record: the slowest
microbatch paces every stage), each packed into one microbatch of at most ``max_tokens`` tokens.
The loss of a microbatch is its summed token loss (weighted per sequence with
``loss_agg="seq-mean-token-mean"``), divided by the step's trained tokens (or trained sequences): the
gradient of the step's mean token loss whatever the packing, as in ``posttrain train``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.balance import FlopsCost, pack_sequences
from posttrain.balance.exact import min_max_partition
from posttrain.models import token_loss_sum
from posttrain.train.sft import TrainConfig, TrainData
from posttrain.train.sft.loop import loss_units

from .config import PipelineConfig

__all__ = ["PipelineData", "PipelineStep", "packed_loss", "train_config"]


def train_config(cfg: PipelineConfig) -> TrainConfig:
    """The data fields of ``cfg`` as ``posttrain train`` reads them (same formats, masks, cache)."""
    return TrainConfig(model_path=cfg.model_path, data=cfg.data, tokenizer=cfg.tokenizer, sequences=cfg.sequences,
                       max_tokens=cfg.max_tokens, seed=cfg.seed, steps=cfg.steps, train_on_prompt=cfg.train_on_prompt,
                       loss_agg=cfg.loss_agg, truncate=cfg.truncate, skip_long=cfg.skip_long)


@dataclass
class PipelineStep:
    """What :meth:`PipelineRunner.step` takes for one step of real data.

    Attributes:
        inputs: per microbatch, the packed ``(1, tokens)`` input ids.
        targets: per microbatch, ``(targets, weights)``: next-token ids (``-100``: not trained) and
            per-token weights (``None`` with ``loss_agg="token-mean"``).
        extras: per microbatch, ``{"document_lengths": [...]}`` for every stage.
        loss_divisor: the step's trained tokens (or sequences).
        sequence_ids: per microbatch, the records' positions in the step.
    """

    inputs: list[torch.Tensor]
    targets: list[tuple[torch.Tensor, torch.Tensor | None]]
    extras: list[dict]
    loss_divisor: float
    sequence_ids: list[list[int]]


def packed_loss(logits: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """Summed (weighted) next-token loss of one packed microbatch."""
    targets, weights = target
    return token_loss_sum(logits, targets, weights)


class PipelineData:
    """The records of ``cfg.data``, step by step (every rank builds the same)."""

    def __init__(self, cfg: PipelineConfig, model_config, *, log=None) -> None:
        self.cfg = cfg
        self.data = TrainData(train_config(cfg), 1, log=log)
        self.cost = FlopsCost.from_config(model_config)

    def step(self, step: int) -> PipelineStep:
        cfg = self.cfg
        samples = self.data.minibatch(step)
        lengths = [len(s) - 1 for s in samples]
        sets, _ = min_max_partition([self.cost(n) for n in lengths], cfg.num_microbatches)
        sets = [sorted(s) for s in sets]
        too_big = [sum(lengths[i] for i in s) for s in sets]
        if min(len(s) for s in sets) == 0 or max(too_big) > cfg.max_tokens:
            raise ValueError(f"step {step}: {len(samples)} records of {sum(lengths)} tokens do not fit in "
                             f"num_microbatches={cfg.num_microbatches} microbatches of at most max_tokens="
                             f"{cfg.max_tokens} (the fullest needs {max(too_big)}); raise `max_tokens` or "
                             "`num_microbatches`, or lower `sequences`")
        divisor = loss_units(samples, range(len(samples)), cfg.loss_agg)
        if divisor == 0:
            raise ValueError(f"step {step}: no trained token in its {len(samples)} records (all masked)")
        return self.pack(samples, sets, float(divisor))

    def pack(self, samples: list, sets: list[list[int]], divisor: float) -> PipelineStep:
        """``samples[i] for i in sets[j]`` packed into microbatch ``j``, with ``divisor`` as the loss divisor."""
        cfg = self.cfg
        inputs, targets, extras = [], [], []
        for s in sets:
            if not s:  # a dummy microbatch (one untrained token): keeps per-layer rendezvous matched
                inputs.append(torch.zeros(1, 1, dtype=torch.long))
                targets.append((torch.full((1, 1), -100, dtype=torch.long), None))
                extras.append({"document_lengths": [1]})
                continue
            picked = [samples[i] for i in s]
            packed = pack_sequences([p.input_ids for p in picked], [p.labels for p in picked])
            weights = None
            if cfg.loss_agg == "seq-mean-token-mean":
                weights = torch.cat([torch.full((len(p) - 1,), 1.0 / max(1, p.trained)) for p in picked]).unsqueeze(0)
            inputs.append(packed.inputs)
            targets.append((packed.targets, weights))
            extras.append({"document_lengths": packed.document_lengths})
        return PipelineStep(inputs, targets, extras, divisor, sets)
