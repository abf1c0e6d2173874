"""The sequences of every training step, identical on every rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from posttrain.balance import shard_lengths
from posttrain.data import load_tokenized, profile_lengths, synthetic_sequences
from posttrain.train.core.context import check_shard_count

from .config import SYNTHETIC_VOCAB, TrainConfig

__all__ = ["Sample", "TrainData", "load_tokenizer", "model_vocab_size"]

#: Largest vocabulary inferred from pre-tokenized data without --vocab-size.
_MAX_INFERRED_VOCAB = 1 << 20


@dataclass(frozen=True)
class Sample:
    """One sequence of a step: its token ids and labels (``-100``: not trained; ``None``: every
    token after the first is a trained target)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @cached_property
    def trained(self) -> int:
        """Trained next-token targets."""
        if self.labels is None:
            return len(self) - 1
        return int((self.labels[1:] != -100).sum())


def _has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model"))


def load_tokenizer(cfg: TrainConfig):
    """``(tokenizer, directory)`` of ``--tokenizer`` or, when it has tokenizer files,
    ``--model-path``; ``(None, None)`` when neither gives one."""
    path = cfg.tokenizer or (cfg.model_path if cfg.model_path and _has_tokenizer(cfg.model_path) else None)
    if path is None:
        return None, None
    if not os.path.isdir(path):
        raise ValueError(f"`tokenizer` {path}: not a directory")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path), path
    except (OSError, ValueError) as e:
        raise ValueError(f"`tokenizer` {path}: transformers cannot load a tokenizer there ({e})") from None


def model_vocab_size(cfg: TrainConfig) -> int | None:
    """The vocabulary of ``--model-path``'s config (``None`` without one)."""
    if cfg.model_path is None:
        return None
    from transformers import AutoConfig

    from posttrain.models import check_model_dir

    check_model_dir(cfg.model_path)
    return int(AutoConfig.from_pretrained(cfg.model_path).vocab_size)


class TrainData:
    """The sequences of every step, identical on every rank.

    Synthetic: step ``k`` draws ``sequences`` lengths from the profile with a seed derived from
    ``(seed, k)``. A data file: records tokenized once and cached
    (:func:`posttrain.data.load_tokenized`), a seeded permutation per epoch; step ``k`` takes
    positions ``k*sequences .. (k+1)*sequences - 1`` of the concatenated epochs. Either way the
    data position after step ``k`` is ``(k+1) * sequences``, which a checkpoint records.

    Attributes:
        vocab_size: the vocabulary the model needs (the model's with ``model_path``).
        dataset: the tokenized data (``None`` when synthetic).
        dropped: sequences left out by ``skip_long``; truncated: sequences cut by ``truncate``.
    """

    def __init__(self, cfg: TrainConfig, world_size: int, *, log=None) -> None:
        self.cfg = cfg
        self.dataset = None
        self.dropped = self.truncated = 0
        self._index = None
        self._perm = None
        if cfg.sequences < world_size:
            raise ValueError(f"sequences={cfg.sequences} is fewer than the {world_size} ranks; every rank needs data")
        check_split_reach(cfg, world_size)
        model_vocab = model_vocab_size(cfg)
        self.eval_dataset = self._eval_index = None
        if cfg.data is None:
            if cfg.eval_data:
                raise ValueError("`eval_data` needs `data` (synthetic runs have no held-out set)")
            if model_vocab is not None and model_vocab < SYNTHETIC_VOCAB:
                raise ValueError(f"synthetic data uses {SYNTHETIC_VOCAB} token ids; `model_path` has a vocabulary "
                                 f"of {model_vocab}")
            self.vocab_size = model_vocab or SYNTHETIC_VOCAB
            return
        tokenizer, tok_path = load_tokenizer(cfg)
        ds, keep, self.vocab_size, self.dropped, self.truncated = _prepare(
            cfg.data, cfg, tokenizer, tok_path, model_vocab, log)
        self.dataset, self._index = ds, keep
        if len(keep) < world_size:
            raise ValueError(f"{cfg.data} holds {len(keep)} usable sequences, fewer than the {world_size} ranks")
        if cfg.sequences > len(keep):
            raise ValueError(f"sequences={cfg.sequences} exceeds the {len(keep)} usable sequences in {cfg.data}")
        if cfg.eval_data:
            self.eval_dataset, self._eval_index, _, dropped, cut = _prepare(
                cfg.eval_data, cfg, tokenizer, tok_path, model_vocab, log, vocab=self.vocab_size)
            if log and (dropped or cut):
                log(f"eval_data: {'left out' if dropped else 'cut'} {dropped or cut} sequences longer than "
                    f"{cfg.longest + 1} tokens")

    def eval_samples(self) -> list[Sample]:
        """Every usable held-out sequence (``--eval-data``)."""
        if self.eval_dataset is None:
            return []
        return [Sample(*self.eval_dataset.example(int(i), max_len=self.cfg.longest + 1)) for i in self._eval_index]

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self._index), generator=g))
        return self._perm[1]

    @property
    def num_sequences(self) -> int | None:
        """Usable sequences in the data file (``None``: synthetic)."""
        return None if self._index is None else len(self._index)

    def minibatch(self, step: int) -> list[Sample]:
        """The sequences of step ``step`` (each trained on at most its length minus one)."""
        cfg = self.cfg
        if self.dataset is None:
            seed = cfg.seed * 100_003 + step
            lengths = profile_lengths(cfg.profile, cfg.sequences, max_len=cfg.max_len, seed=seed)
            return [Sample(s) for s in synthetic_sequences([n + 1 for n in lengths], vocab_size=SYNTHETIC_VOCAB,
                                                           seed=seed)]
        return [Sample(ids, labels) for ids, labels in self.dataset.examples(self.record_ids(step),
                                                                             max_len=cfg.longest + 1)]

    def record_ids(self, step: int) -> list[int]:
        """The data file's records (0-based, in the file's order) that step ``step`` trains on, in
        its order (for a comparison that must feed another trainer the same sequences)."""
        if self.dataset is None:
            raise ValueError("synthetic data has no records")
        n, cfg = len(self._index), self.cfg
        return [int(self._index[int(self._permutation(epoch)[i])])
                for epoch, i in (divmod(pos, n) for pos in range(step * cfg.sequences, (step + 1) * cfg.sequences))]


def check_split_reach(cfg: TrainConfig, world_size: int) -> None:
    """Refuse a run whose longest sequence no allowed split fits into shards of ``max_tokens``
    (context parallelism over at most the world's ranks, or its fixed shard count)."""
    check_shard_count(cfg, world_size, "sequence")
    if cfg.longest <= cfg.max_tokens:
        return
    cp = cfg.engine.context_parallel
    k = world_size if cp == "auto" else int(cp)
    if max(shard_lengths(cfg.longest, k)) > cfg.max_tokens:
        need = -(-cfg.longest // cfg.max_tokens)
        while max(shard_lengths(cfg.longest, need)) > cfg.max_tokens:
            need += 1
        raise ValueError(f"max_len={cfg.longest} tokens split over {k} ranks leaves shards longer than "
                         f"max_tokens={cfg.max_tokens}: it needs {need} ranks (a larger world"
                         + (", context_parallel auto" if cp != "auto" else "") + ") or a larger `max_tokens`")


def _prepare(path: str, cfg: TrainConfig, tokenizer, tok_path: str | None, model_vocab: int | None, log,
             vocab: int | None = None) -> tuple:
    """Tokenize ``path`` (cached), check its ids against the vocabulary and its lengths against
    ``--max-tokens``: ``(dataset, usable indices, vocabulary, dropped, truncated)``."""
    ds = load_tokenized(path, tokenizer, tokenizer_path=tok_path, train_on_prompt=cfg.train_on_prompt,
                        progress=log is not None, log=log or (lambda *a, **k: None))
    if vocab is not None:
        flag = "the training data's vocabulary"
    elif model_vocab is not None:
        vocab, flag = model_vocab, "`model_path`'s vocabulary"
    elif cfg.vocab_size is not None:
        vocab, flag = cfg.vocab_size, f"vocab_size={cfg.vocab_size}"
    elif tokenizer is not None:
        vocab, flag = len(tokenizer), "the tokenizer's vocabulary"
    else:
        vocab, flag = ds.max_id + 1, None
        if vocab > _MAX_INFERRED_VOCAB:
            flag = f"the {_MAX_INFERRED_VOCAB} ids posttrain infers without `vocab_size`"
            vocab = _MAX_INFERRED_VOCAB
    if ds.max_id >= vocab:
        max_ids = np.asarray(ds.table["max_id"], dtype=np.int64)
        bad = int(np.nonzero(max_ids >= vocab)[0][0])
        raise ValueError(f"{ds.where(bad)}: token id {int(max_ids[bad])} is outside {flag} ({vocab} ids); "
                         "give the right `vocab_size` or `tokenizer`")
    limit = cfg.longest + 1  # a sequence of n tokens trains on n - 1 positions
    long = np.nonzero(ds.lengths > limit)[0]
    keep, dropped, truncated = np.arange(len(ds)), 0, 0
    if long.size:
        if cfg.skip_long:
            keep, dropped = np.nonzero(ds.lengths <= limit)[0], int(long.size)
        elif cfg.truncate:
            truncated = int(long.size)
        else:
            first = int(long[0])
            n = int(ds.lengths[first])
            if cfg.longest > cfg.max_tokens:
                raise ValueError(f"{ds.where(first)}: a sequence of {n} tokens trains on {n - 1}, more than the "
                                 f"longest a split takes (max_len={cfg.longest}; {long.size} such sequences); "
                                 "raise `max_len`, or give `truncate` or `skip_long`")
            raise ValueError(f"{ds.where(first)}: a sequence of {n} tokens trains on {n - 1}, more than "
                             f"max_tokens={cfg.max_tokens} fit in a microbatch ({long.size} such sequences); "
                             "raise `max_tokens`, split longer sequences across ranks with `context_parallel`, "
                             "or give `truncate` or `skip_long`")
    return ds, keep, vocab, dropped, truncated
