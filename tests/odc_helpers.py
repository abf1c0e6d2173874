"""Shared pieces of the ODC multi-process tests: data, a reference trainer, an ODC trainer."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import posttrain.odc as odc_mod
from posttrain.models import GPT, GPTConfig, token_loss_sum

CFG = GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, max_seq_len=64)
STEPS = 3
# SGD+momentum, not Adam: Adam turns the ~1e-9 summation-order noise of a zero-gradient
# parameter (the key bias of attention) into full-size updates, hiding real comparisons.
LR = 0.05


def make_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(CFG)


def batches(step: int, rank: int, count: int) -> list[torch.Tensor]:
    """``count`` sequences of varied length for ``rank`` at ``step`` (same on every process)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [
        torch.randint(0, CFG.vocab_size, (1, int(torch.randint(4, 24, (1,), generator=g)) + 1), generator=g)
        for _ in range(count)
    ]


def loss_of(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    out = model(seq[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out
    return token_loss_sum(logits, seq[:, 1:])


def step_data(step: int, counts: list[int]) -> tuple[dict[int, list[torch.Tensor]], int]:
    data = {r: batches(step, r, c) for r, c in enumerate(counts)}
    total = sum(x.shape[1] - 1 for xs in data.values() for x in xs)
    return data, total


def train_reference(counts: list[int], make_model=make_gpt, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Single process: every rank's microbatches of a step accumulate into one optimizer step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        data, total = step_data(step, counts)
        for r in range(len(counts)):
            for x in data[r]:
                (loss_of(model, x) / total).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard(model: torch.nn.Module, mesh=None, reshard=True, mp: MixedPrecisionPolicy | None = None) -> None:
    kw = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    blocks = model.model.layers if hasattr(model, "model") else model.layers
    for b in blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def train_odc(
    rank: int,
    world_size: int,
    counts: list[int],
    *,
    make_model=make_gpt,
    mesh_shape: tuple[int, ...] | None = None,
    reshard=True,
    mp: MixedPrecisionPolicy | None = None,
    steps: int = STEPS,
    **odc_kwargs,
):
    """Train under ODC; returns (full state dict, stats, per-step microbatch end times)."""
    mesh = None
    if mesh_shape is not None:
        names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = make_model()
    shard(model, mesh, reshard, mp)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    with odc_mod.enable(model, **odc_kwargs) as odc:
        for step in range(steps):
            data, total = step_data(step, counts)
            mine = data[rank]
            with odc.minibatch(num_tokens=sum(x.shape[1] - 1 for x in mine)) as mb:
                assert mb.global_tokens == total, (mb.global_tokens, total)
                for x in mine:
                    (loss_of(model, x) / mb.global_tokens).backward()
            opt.step()
            opt.zero_grad()
        stats = dict(odc.stats)
    return full_state(model), stats


def train_fsdp(rank: int, world_size: int, counts: list[int], *, make_model=make_gpt, mp=None, steps: int = STEPS):
    """Plain FSDP2 (gloo collectives) with the same global-token loss; FSDP averages over ranks."""
    model = make_model()
    shard(model, None, True, mp)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        data, total = step_data(step, counts)
        for x in data[rank]:
            (loss_of(model, x) / total).backward()
        opt.step()
        opt.zero_grad()
    return full_state(model)


def assert_states_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{k}: {m}", **tol)



def tiny_llama():
    """A transformers LlamaForCausalLM, tiny random config (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def tiny_qwen2_tied():
    """A transformers Qwen2ForCausalLM with tie_word_embeddings=True: lm_head.weight is
    model.embed_tokens.weight (one nn.Parameter used by two modules)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("the Qwen2 test model is not tied")
    return model
