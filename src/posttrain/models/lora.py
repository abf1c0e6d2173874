"""LoRA adapters through ``peft``: injected into a Hugging Face model, the base frozen.

:func:`add_lora` replaces the target linear layers of an :class:`~posttrain.models.HFCausalLM`'s
model by ``peft``'s LoRA layers (``peft.inject_adapter_in_model``): each keeps its weight as
``NAME.base_layer.weight``, frozen, and adds ``NAME.lora_A.default.weight`` (``rank x in``,
Kaiming-uniform) and ``NAME.lora_B.default.weight`` (``out x rank``, zero), the only trainable
parameters; the layer computes ``base(x) + (alpha / rank) * B(A(dropout(x)))``. The engines shard
the frozen base like any parameter and never reduce its (absent) gradients; the optimizer holds
state for the adapters only.

What a run writes from the full parameters (:func:`adapter_files`, :func:`merged`):

- an adapter directory that ``peft.PeftModel.from_pretrained(base, DIR)`` loads
  (``adapter_config.json`` and ``adapter_model.safetensors`` under peft's names);
- or, merged, the base model's own parameters with ``W + (alpha / rank) * B @ A`` in each target.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LoraSpec", "adapter_files", "add_lora", "check_model_targets", "check_targets", "linear_names", "merged",
           "write_model"]

_ADAPTER = "default"


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run.

    Attributes:
        rank: the adapters' rank ``r``.
        alpha: the scale's numerator: updates are ``alpha / rank * B @ A`` (0: twice the rank).
        dropout: dropout on the adapters' input while training.
        targets: names of the linear layers that get adapters (the last part of a module's name,
            ``q_proj``; empty: peft's default for the model's architecture).
    """

    rank: int
    alpha: float = 0.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return (self.alpha or 2.0 * self.rank) / self.rank

    def peft_config(self, model_type: str | None):
        """The ``peft.LoraConfig`` (targets resolved for ``model_type``)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha or 2 * self.rank, lora_dropout=self.dropout,
                          target_modules=list(self.resolved_targets(model_type)), bias="none")

    def resolved_targets(self, model_type: str | None) -> tuple[str, ...]:
        if self.targets:
            return tuple(self.targets)
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        found = defaults.get(model_type or "")
        if not found:
            raise ValueError(f"peft has no default LoRA targets for model type {model_type!r}; give `lora_targets`")
        return tuple(found)


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of the linear layers of ``model`` (what ``targets`` may name)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n})


def check_targets(spec: LoraSpec, model: nn.Module, model_type: str | None) -> None:
    """Refuse targets that name no linear layer of ``model`` (one line listing those it has)."""
    have = linear_names(model)
    missing = [t for t in spec.resolved_targets(model_type) if t not in have]
    if missing:
        raise ValueError(f"lora_targets={','.join(missing)}: the model has no such linear layer; it has "
                         f"{', '.join(have)}")


def check_model_targets(spec: LoraSpec, model_path: str | None = None, build=None) -> None:
    """:func:`check_targets` on the model at ``model_path`` (or the :class:`HFCausalLM` that
    ``build()`` makes), built on the meta device: no weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)) if model_path else build().hf
    check_targets(spec, hf, getattr(hf.config, "model_type", None))


def add_lora(model: nn.Module, spec: LoraSpec, seed: int) -> None:
    """Inject ``spec``'s adapters into ``model`` (an :class:`~posttrain.models.HFCausalLM`) in
    place, their initialization seeded by ``seed``; only the adapters stay trainable."""
    from peft import inject_adapter_in_model

    hf = model.hf
    check_targets(spec, hf, getattr(hf.config, "model_type", None))
    torch.manual_seed(seed)
    inject_adapter_in_model(spec.peft_config(getattr(hf.config, "model_type", None)), hf)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)


def _peft_name(name: str) -> str:
    """``model.layers.0.q_proj.lora_A.default.weight`` as peft's adapter file names it."""
    return "base_model.model." + name.replace(f".{_ADAPTER}.", ".")


def adapter_files(parts: Iterable[dict[str, torch.Tensor]], out_dir: str | os.PathLike, spec: LoraSpec,
                  model_type: str | None, base: str | None, tokenizer=None, write: bool = True) -> str | None:
    """Write the adapters found in ``parts`` (full parameters under the model's names) as a peft
    adapter directory at ``out_dir`` (replaced whole; written where ``write``; every caller
    iterates ``parts``, a collective). The directory, or ``None`` where not written."""
    import shutil

    from safetensors.torch import save_file

    from posttrain._files import replace_dir, work_dir

    tensors = {}
    for part in parts:
        for name, value in part.items():
            if ".lora_" in name:
                tensors[_peft_name(name.removeprefix("hf."))] = value.detach().contiguous().cpu().clone()
    if not write:
        return None
    if not tensors:
        raise ValueError("nothing to export: the model has no LoRA adapters")
    out = os.path.abspath(out_dir)
    tmp = work_dir(os.path.dirname(out), f".{os.path.basename(out)}.")
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = spec.peft_config(model_type)
        config.base_model_name_or_path = base
        config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, out)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def merged(parts: Iterable[dict[str, torch.Tensor]], scale: float) -> Iterator[dict[str, torch.Tensor]]:
    """``parts`` with each adapted layer's ``W + scale * B @ A`` under the base model's own name
    (``NAME.weight``; ``NAME.base_layer.bias`` as ``NAME.bias``) and no adapter tensors: a part
    is yielded once it holds no half of a layer (a layer's tensors may span parts)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        out: dict[str, torch.Tensor] = {}
        for name, value in part.items():
            if ".base_layer." in name:
                layer, _, leaf = name.partition(".base_layer.")
                if leaf == "bias":
                    out[f"{layer}.bias"] = value
                    continue
                pending.setdefault(layer, {})["W"] = value
            elif f".lora_A.{_ADAPTER}." in name:
                pending.setdefault(name.partition(".lora_A.")[0], {})["A"] = value
            elif f".lora_B.{_ADAPTER}." in name:
                pending.setdefault(name.partition(".lora_B.")[0], {})["B"] = value
            else:
                out[name] = value
        for layer in [k for k, v in pending.items() if len(v) == 3]:
            t = pending.pop(layer)
            w = t["W"]
            delta = (t["B"].double() @ t["A"].double()) * scale
            out[f"{layer}.weight"] = (w.double() + delta).to(w.dtype)
        if out:
            yield out
    if pending:
        raise ValueError(f"adapted layers without all of base weight, lora_A and lora_B: {sorted(pending)[:3]}")


def write_model(parts: Iterable[dict[str, torch.Tensor]], out_dir: str | os.PathLike, spec: LoraSpec | None,
                merge: bool, *, config, tokenizer=None, generation_config=None, skip=(), base: str | None = None,
                write: bool = True) -> str | None:
    """A run's ``output_dir`` from its full parameters ``parts``: the model (without ``spec``),
    the adapter directory, or (``merge``) the model with the adapters merged; see
    :func:`posttrain.models.save_pretrained` for ``write`` and the rest."""
    from .hf import save_pretrained

    if spec is not None and not merge:
        return adapter_files(parts, out_dir, spec, getattr(config, "model_type", None), base=base,
                             tokenizer=tokenizer, write=write)
    if spec is not None:
        parts = merged(parts, spec.scale)
    return save_pretrained(parts, out_dir, config=config, tokenizer=tokenizer, generation_config=generation_config,
                           skip=skip, write=write)
