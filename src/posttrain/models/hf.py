"""Hugging Face causal LMs in and out.

:class:`HFCausalLM` puts any ``transformers`` decoder-only causal LM behind posttrain's call,
``model(tokens, document_lengths=None) -> logits``: for packed input it passes position ids that
restart at every sequence and no attention mask, from which ``transformers`` builds a
block-diagonal causal mask (``find_packed_sequence_indices``), so attention never crosses
sequences. Its blocks are found where ``transformers`` keeps them (``model.model.layers``).

:func:`load_pretrained` reads a local checkpoint directory (config and safetensors; nothing is
downloaded). :func:`save_pretrained` writes one back from a sharded engine, a part at a time: a
safetensors file per part plus ``model.safetensors.index.json``, the config, the generation
config and the tokenizer, into a temporary folder renamed into place at the end, so
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it as it is and
an interrupted export never leaves a half-written model where a finished one is expected.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from posttrain._files import replace_dir, work_dir

from .gpt import packed_positions
from .split_attention import SplitShard, hf_packing, packed_call, use_split_attention

__all__ = ["HFCausalLM", "check_model_dir", "load_pretrained", "save_pretrained", "tied_names"]

_PREFIX = "hf."


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM called as ``model(tokens, document_lengths=None)``.

    Attributes:
        hf: the wrapped model (its parameters appear under ``hf.`` in this module's names).
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    @property
    def config(self):
        return self.hf.config

    @property
    def max_positions(self) -> int | None:
        return getattr(self.hf.config, "max_position_embeddings", None)

    @property
    def layers(self) -> nn.ModuleList:
        from .blocks import find_blocks

        return find_blocks(self.hf)

    def forward(self, tokens: torch.Tensor, document_lengths: list[int] | None = None,
                split: SplitShard | None = None, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``tokens``; ``document_lengths``, ``split`` and ``logits_at`` as
        :meth:`posttrain.models.GPT.forward` takes them (``logits_at``: ``transformers``'
        ``logits_to_keep``, the LM head on those rows alone). Packed input goes through posttrain's registered attention
        (:func:`~posttrain.models.split_attention.use_split_attention`), which attends per sequence
        (:func:`~posttrain.models.split_attention.packed_attention`: about ``sum(n_i^2)`` work, where
        ``transformers``' SDPA with packed position ids builds a block-diagonal mask over the whole
        microbatch, ``(sum n_i)^2``); calls without ``document_lengths`` keep ``transformers``' SDPA."""
        t = tokens.shape[1]
        limit = self.max_positions or t
        keep = {} if logits_at is None else {"logits_to_keep": logits_at}
        if document_lengths is None:
            if split is not None:
                raise ValueError("a split shard needs document_lengths (packed input)")
            if t > limit:
                raise ValueError(f"sequence length {t} exceeds the model's max_position_embeddings={limit}")
            pos = torch.arange(t, device=tokens.device)
        else:
            if tokens.shape[0] != 1:
                raise ValueError(f"packed input must have batch size 1, got {tokens.shape[0]}")
            pos = packed_positions(document_lengths, t, limit, tokens.device, split)
            use_split_attention(self.hf)
            with packed_call():
                return self.hf(input_ids=tokens, position_ids=pos.unsqueeze(0), use_cache=False,
                               posttrain_packing=hf_packing(document_lengths, split), **keep).logits
        return self.hf(input_ids=tokens, position_ids=pos.unsqueeze(0), use_cache=False, **keep).logits


def check_model_dir(path: str | os.PathLike) -> Path:
    """Refuse, in one line naming ``model_path``, a path that is not a ``transformers`` model
    directory: missing, not a directory, no ``config.json`` or no weights."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"`model_path` {p}: no such directory")
    if not p.is_dir():
        raise ValueError(f"`model_path` {p}: not a directory")
    if not (p / "config.json").exists():
        raise ValueError(f"`model_path` {p}: no config.json (expected a transformers model directory)")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ValueError(f"`model_path` {p}: no weights (*.safetensors) next to config.json")
    return p


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """The causal LM in ``path`` with its weights, in ``dtype`` (fp32: master weights that the
    engines cast for compute under ``--precision bf16``).

    Raises:
        ValueError: not a model directory, or not a causal LM ``transformers`` can build.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank would interleave on the terminal
    p = check_model_dir(path)
    config = AutoConfig.from_pretrained(p)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"`model_path` {p}: {config.model_type} is an encoder-decoder model; posttrain trains "
                         "decoder-only causal LMs")
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
    except (ValueError, KeyError) as e:
        raise ValueError(f"`model_path` {p}: transformers cannot load it as a causal LM ({e})") from None
    return HFCausalLM(model)


def tied_names(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias an earlier one (``lm_head.weight`` -> ``model.embed_tokens.weight``
    with tied embeddings), under the wrapped model's own names."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = name.removeprefix(_PREFIX)
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def save_pretrained(parts: Iterable[dict[str, torch.Tensor]], out_dir: str | os.PathLike, *, config,
                    tokenizer=None, generation_config=None, dtype: torch.dtype | None = None,
                    skip: Iterable[str] = (), write: bool = True) -> str | None:
    """Write a ``transformers`` model directory from ``parts`` (dicts of full tensors, under
    :class:`HFCausalLM` names or the model's own), one safetensors file per non-empty part.

    Every rank of a sharded engine iterates ``engine.iter_full_state()`` (a collective) into this
    function; only the rank with ``write=True`` writes. At most one part is held at a time.

    Args:
        config: the model's ``transformers`` config (saved with ``dtype``).
        tokenizer: saved beside the weights when given.
        generation_config: saved when given.
        dtype: the weights' dtype on disk (default: the config's, else as trained).
        skip: names not written (tied aliases: ``transformers`` re-ties them on load).
        write: whether this process writes (the others only take part in the gathers).

    Returns:
        The directory written (``None`` where ``write`` is false).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    skip = set(skip)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    tmp = work_dir(out.parent, f".{out.name}.") if write else None  # (removes those of killed exports)
    try:
        files: list[tuple[str, list[str]]] = []
        total = 0
        for part in parts:
            tensors = {}
            for name, value in part.items():
                name = name.removeprefix(_PREFIX)
                if name in skip:
                    continue
                v = value.detach()
                if dtype is not None and v.is_floating_point():
                    v = v.to(dtype)
                tensors[name] = v.contiguous().cpu()
            if not write or not tensors:
                continue
            fname = f"part-{len(files):05d}.safetensors"
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            files.append((fname, sorted(tensors)))
            del tensors
        if not write:
            return None
        if not files:
            raise ValueError("nothing to export: the model has no parameters")
        weight_map = {}
        n = len(files)
        for k, (fname, names) in enumerate(files):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / fname, tmp / final)
            weight_map.update({name: final for name in names})
        with open(tmp / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out)
        return str(out)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
