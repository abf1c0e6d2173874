"""The sequences of every training step, identical on every rank."""

from __future__ import annotations

import torch

from posttrain.data import load_jsonl, profile_lengths, synthetic_sequences

from .config import SYNTHETIC_VOCAB, TrainConfig

__all__ = ["TrainData"]


class TrainData:
    """The sequences of every step, identical on every rank.

    Synthetic: step ``k`` draws ``sequences`` lengths from the profile with a seed derived from
    ``(seed, k)``. JSONL: a seeded permutation per epoch; step ``k`` takes positions
    ``k*sequences .. (k+1)*sequences - 1`` of the concatenated epochs. Either way the data
    position after step ``k`` is ``(k+1) * sequences``, which a checkpoint records.
    """

    def __init__(self, cfg: TrainConfig, world_size: int) -> None:
        self.cfg = cfg
        self.file_sequences = None
        if cfg.data is not None:
            seqs = load_jsonl(cfg.data, max_tokens=cfg.max_tokens)
            if len(seqs) < world_size:
                raise ValueError(f"{cfg.data} holds {len(seqs)} sequences, fewer than the {world_size} ranks")
            if cfg.sequences > len(seqs):
                raise ValueError(f"--sequences={cfg.sequences} exceeds the {len(seqs)} sequences in {cfg.data}")
            self.file_sequences = seqs
            self.vocab_size = max(int(s.max()) for s in seqs) + 1
        else:
            self.vocab_size = SYNTHETIC_VOCAB
        if cfg.sequences < world_size:
            raise ValueError(f"--sequences={cfg.sequences} is fewer than the {world_size} ranks; every rank needs data")

    def minibatch(self, step: int) -> list[torch.Tensor]:
        """The sequences of step ``step`` (token ids, each trained on its length minus one)."""
        cfg = self.cfg
        if self.file_sequences is None:
            seed = cfg.seed * 100_003 + step
            lengths = profile_lengths(cfg.profile, cfg.sequences, max_len=cfg.max_len, seed=seed)
            return synthetic_sequences([n + 1 for n in lengths], vocab_size=SYNTHETIC_VOCAB, seed=seed)
        n, out = len(self.file_sequences), []
        for pos in range(step * cfg.sequences, (step + 1) * cfg.sequences):
            epoch, i = divmod(pos, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
            out.append(self.file_sequences[int(perm[i])])
        return out
