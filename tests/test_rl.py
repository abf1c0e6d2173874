"""RL: advantages, the clipped policy loss and its aggregation, one update step under every engine
against a single-process reference, rewards and prompts that are refused clearly, and a short
run end to end. A failure names the estimator, aggregation or engine that disagrees."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from posttrain.balance import FlopsCost
from posttrain.device import backend as device_backend
from posttrain.dp import EngineConfig, build_engine
from posttrain.launch import run_ranks
from posttrain.models import find_blocks, load_pretrained
from posttrain.rl import (
    LOSS_AGGS,
    Rollout,
    call_reward,
    compute_advantages,
    load_reward,
    loss_units,
    policy_loss,
    token_logprobs,
)
from posttrain.train.core import OptimConfig
from posttrain.train.rl import RLConfig, load_prompts, run_rl, update_minibatch


def test_grpo_and_rloo_advantages():
    r = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]  # two groups of 4; the second all equal
    grpo = compute_advantages(r, 4)
    g = torch.tensor(r[:4])
    assert grpo.values[:4] == pytest.approx(((g - g.mean()) / (g.std() + 1e-6)).tolist())
    assert grpo.values[4:] == [0.0] * 4 and grpo.zero_groups == [1]
    assert compute_advantages(r, 4, normalize_std=False).values[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    rloo = compute_advantages(r, 4, estimator="rloo").values
    assert rloo[0] == pytest.approx(1.0 - (0 + 0 + 1) / 3) and rloo[1] == pytest.approx(0.0 - 2 / 3)
    with pytest.raises(ValueError, match="needs at least 2"):
        compute_advantages([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="not finite"):
        compute_advantages([1.0, float("nan")], 2)
    with pytest.raises(ValueError, match="not groups of 3"):
        compute_advantages([1.0, 2.0], 3)


def _rollouts(model, vocab: int, lengths, seed=0, noise=0.3):
    """Random prompts and responses; old log-probs the model's own plus noise (so some ratios
    clip), reference log-probs the model's minus noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (p, n) in enumerate(lengths):
        ids = torch.randint(0, vocab, (p + n,), generator=g)
        with torch.no_grad():
            lp = token_logprobs(model(ids[:-1].unsqueeze(0))[0][p - 1:], ids[p:])
        out.append(Rollout(ids, p, float(torch.randn((), generator=g)), lp + noise * torch.randn(n, generator=g),
                           lp - noise * torch.rand(n, generator=g), reward=float(k % 2)))
    return out


LENGTHS = [(5, 30), (8, 38), (8, 51), (3, 39), (5, 32), (3, 5), (7, 7), (3, 7)]  # 2 and 3 microbatches at 64


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_the_aggregation_does_not_depend_on_how_rollouts_are_split(tiny_model, agg):
    model = load_pretrained(tiny_model("llama"))
    rolls = _rollouts(model, model.config.vocab_size, LENGTHS)
    units = loss_units(rolls, agg)
    grads = []
    for split in ([list(range(8))], [[0, 1, 2], [3], [4, 5, 6, 7]], [[7], [6, 0], [5, 1, 2], [4, 3]]):
        model.zero_grad()
        for part in split:
            loss, _ = policy_loss(model, [rolls[i] for i in part], kl_coef=0.1, agg=agg)
            (loss / units).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=1e-5)


def test_policy_loss_is_the_clipped_surrogate_plus_k3():
    class Fixed(torch.nn.Module):  # logits that give known log-probs
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def forward(self, x, document_lengths=None, logits_at=None):
            return self.w.expand(1, x.shape[1] if logits_at is None else len(logits_at), 4)

    m = Fixed()
    ids = torch.tensor([0, 1, 2, 3])  # prompt of 2, response of 2
    lp = torch.log(torch.tensor([0.25, 0.25]))
    old = lp - torch.tensor([0.5, -0.05])  # ratios e^0.5 (clipped at 1.2) and e^-0.05
    ref = lp + torch.tensor([0.1, 0.0])
    loss, st = policy_loss(m, [Rollout(ids, 2, 2.0, old, ref)], clip_eps=0.2, kl_coef=0.5, agg="token-mean")
    ratio = torch.exp(lp - old)
    pg = -torch.minimum(ratio * 2, ratio.clamp(0.8, 1.2) * 2)
    d = ref - lp
    assert float(loss.detach()) == pytest.approx(float((pg + 0.5 * (torch.exp(d) - d - 1)).sum()), rel=1e-6)
    assert st["tokens"] == 2 and st["clipped"] == 1


def test_the_kl_penalty_keeps_its_digits_near_the_reference():
    """Near the reference policy (log-prob differences of ~1e-3, the k3 KL ~5e-7 a token) the KL
    is exact to fp32's precision: computed as exp(d) - d - 1 it loses most digits to the
    cancellation against 1 (errors of ~1e-7 a token, 0.4% of the mean here)."""
    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def forward(self, x, document_lengths=None, logits_at=None):
            return self.w.expand(1, x.shape[1] if logits_at is None else len(logits_at), 4)

    n = 4096
    ids = torch.zeros(n + 2, dtype=torch.long)
    lp = torch.full((n,), math.log(0.25))
    d = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    ref = lp + d
    _, st = policy_loss(Fixed(), [Rollout(ids, 2, 0.0, lp, ref)], kl_coef=1.0, agg="token-mean")
    d64 = ref.double() - lp.double()  # what the fp32 inputs say, exactly
    want = float((torch.expm1(d64) - d64).sum())
    assert st["kl"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.2), (0.2, 0.28)], ids=["symmetric", "clip-higher"])
def test_clipped_tokens_are_those_whose_gradient_the_clip_stops(eps_low, eps_high):
    """The four sign/side cases (and inside the range): a ratio above 1 + eps_high with A > 0 or
    below 1 - eps_low with A < 0 is on the clipped branch (zero gradient); above with A < 0 or
    below with A > 0 the unclipped term is the min and the gradient flows (TRL's count)."""
    from posttrain.rl import clipped_surrogate

    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.05, 1.25, 1.25], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    pg, clipped = clipped_surrogate(ratio, adv, eps_low, eps_high)
    pg.sum().backward()
    high = 1.25 > 1 + eps_high  # the 1.25 ratio: clipped under 0.2, inside under clip-higher's 0.28
    assert clipped.tolist() == [True, False, True, False, False, high, False]
    assert ((ratio.grad == 0) == clipped).all(), ratio.grad  # clipped exactly where the gradient stops
    want = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    assert torch.equal(pg, want)


def test_log_probabilities_are_taken_at_the_sampling_temperature(tiny_model):
    """At temperature 1.5 the rollout's log-probabilities are those of softmax(logits / 1.5), the
    distribution it samples; with the policy's taken the same way the ratio of one update epoch
    is 1 and the gradient is the on-policy gradient of the tempered distribution, by hand."""
    from posttrain.rl import HFRollout

    t, advantage, prompt_len = 1.5, 0.7, 4
    model_dir = tiny_model("llama")
    model = load_pretrained(model_dir)
    rollout = HFRollout(load_pretrained(model_dir).hf, eos_token_id=0, pad_token_id=0, temperature=t)
    ids = torch.randint(1, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    old = rollout.logprobs([ids], [prompt_len])[0]

    def tempered(temperature):
        logits = model(ids[:-1].unsqueeze(0))[0][prompt_len - 1:]
        return torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, ids[prompt_len:, None])[:, 0]

    with torch.no_grad():
        torch.testing.assert_close(old, tempered(t), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(old, tempered(1.0), atol=1e-3)  # (the temperature matters here)
    loss, st = policy_loss(model, [Rollout(ids, prompt_len, advantage, old)], temperature=t, agg="token-mean")
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (-(advantage * tempered(t)).sum()).backward()  # the on-policy gradient: d ratio = d logp at ratio 1
    for g, w in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    assert st["clipped"] == 0


def _rollout(tiny_model, **kw):
    from transformers import AutoModelForCausalLM

    from posttrain.rl import HFRollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
    return HFRollout(model, eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id, **kw)


def test_batched_generation_samples_what_one_prompt_at_a_time_would(tiny_model):
    """Every prompt of a step in one ``generate`` call, left-padded with an attention mask: with
    sampling made greedy (a vanishing top_p keeps only the likeliest token) each row's response is
    the one its prompt gets alone, for prompts of different lengths in one batch, in a batch cut
    by ``max_batch_tokens`` too. Responses end at the first end-of-sequence token (kept) or at
    ``max_new_tokens``; the same seed gives the same samples."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (3, 9, 5, 12)]
    greedy = _rollout(tiny_model, top_p=1e-9, max_new_tokens=6)
    alone = [greedy.generate([p], 2, seed=0) for p in prompts]
    together = greedy.generate(prompts, 2, seed=0)
    assert together == [r for rows in alone for r in rows]
    greedy.max_batch_tokens = 40  # a few calls of a few rows each
    assert greedy.generate(prompts, 2, seed=0) == together
    greedy.per_prompt = True  # (--generate-batch prompt: one call per prompt, as before)
    assert greedy.generate(prompts, 2, seed=0) == together
    eos = greedy.eos
    for r in together:
        assert (r[-1] == eos and eos not in r[:-1]) or (len(r) == 6 and eos not in r)

    sampler = _rollout(tiny_model, temperature=1.5, max_new_tokens=6)
    first = sampler.generate(prompts, 4, seed=11)
    assert sampler.generate(prompts, 4, seed=11) == first and sampler.generate(prompts, 4, seed=12) != first
    assert len(first) == 16


def test_posttrains_sampler_decodes_what_generate_does_and_ended_rows_leave_the_batch(tiny_model, monkeypatch):
    """posttrain's decoding loop (``sample``) against ``transformers``' ``generate`` on the same
    left-padded batch, made greedy by a vanishing top_p: the same tokens, row for row, for prompts
    of different lengths (positions, mask and KV cache as ``generate`` keeps them). Then with an
    end-of-sequence token that some rows reach early: those rows end there and leave the batch,
    and every other row still decodes what it decodes alone."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (4, 11, 7, 2)]
    ours = _rollout(tiny_model, top_p=1e-9, max_new_tokens=12)
    theirs = _rollout(tiny_model, top_p=1e-9, max_new_tokens=12, use_generate=True)
    eos = ours.eos
    assert ours.generate(prompts, 2, seed=0) == theirs.generate(prompts, 2, seed=0)

    free = [r[0] for r in (ours.generate([p], 1, seed=0) for p in prompts)]
    ours.eos = theirs.eos = free[0][2]  # an end token the first prompt's response meets early
    assert len([r for r in free if ours.eos in r[:-1]]) < len(prompts)  # (some rows run on past it)
    from transformers import DynamicCache

    removed = []
    select = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda self, keep: removed.append(len(keep)) or select(self, keep))
    together = ours.generate(prompts, 1, seed=0)
    assert removed and removed[0] < len(prompts)  # (rows that ended left the batch and its cache)
    assert together == theirs.generate(prompts, 1, seed=0)
    for r, alone in zip(together, free):
        cut = alone.index(ours.eos) + 1 if ours.eos in alone else len(alone)
        assert r == alone[:cut]
    assert len(together[0]) <= 3 and max(map(len, together)) > 3
    ours.eos = theirs.eos = eos


def test_posttrains_sampler_draws_from_the_tempered_nucleus(tiny_model):
    """One token drawn for 4,000 rows of one prompt (the tiny model's head scaled up, so that its
    distribution is far from uniform): the draws follow softmax(logits / 1.5) (total variation
    under 0.1, where the distribution at temperature 1 is further than 0.15), and with top_p
    only the nucleus is ever drawn (the fewest likeliest tokens whose mass reaches top_p), in
    proportion within it."""
    from posttrain.rl import sample

    rollout = _rollout(tiny_model, temperature=1.5, max_new_tokens=1)
    model = rollout.model
    prompt = torch.tensor([[5, 9, 13, 2, 7]])
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        logits = model(input_ids=prompt).logits[0, -1].float()
    rows = 4000
    ids, mask = prompt.expand(rows, -1), torch.ones(rows, prompt.shape[1], dtype=torch.long)
    for top_p in (1.0, 0.5):
        torch.manual_seed(0)
        drawn = sample(model, ids, mask, max_new_tokens=1, eos_token_id=-1, pad_token_id=0, temperature=1.5,
                       top_p=top_p)[:, 0]
        freq = torch.bincount(drawn, minlength=len(logits)).float() / rows
        want, cold = (torch.softmax(logits / t, -1) for t in (1.5, 1.0))
        if top_p < 1:
            sp, order = want.sort(descending=True)
            nucleus = order[: int((sp.cumsum(0) < top_p).sum()) + 1]
            assert 1 < len(nucleus) < len(want)
            assert set(drawn.tolist()) <= set(nucleus.tolist())
            keep = torch.zeros_like(want, dtype=torch.bool)
            keep[nucleus] = True
            want, cold = ((d * keep) / (d * keep).sum() for d in (want, cold))
        assert (freq - want).abs().sum() / 2 < 0.1
        if top_p == 1.0:
            assert (freq - cold).abs().sum() / 2 > 0.15


def test_batched_scoring_gives_each_sequences_own_logprobs(tiny_model):
    """``HFRollout.logprobs``: one right-padded forward for sequences of different lengths gives
    what each gets alone."""
    rollout = _rollout(tiny_model, temperature=1.5)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 60, (n,), generator=gen) for n in (7, 15, 10)]
    lens = [3, 6, 4]
    together = rollout.logprobs(seqs, lens)
    for s, p, got in zip(seqs, lens, together):
        torch.testing.assert_close(got, rollout.logprobs([s], [p])[0], atol=1e-5, rtol=1e-5)
        assert got.shape == (len(s) - p,)


def test_on_policy_old_logprobs_come_from_the_updates_own_forward(tiny_model):
    """One epoch, one minibatch: the weights that sampled are the ones updated, so ``old_logprobs``
    ``None`` takes them from the update's forward, detached: the ratio is exactly 1 (nothing
    clipped, however tight the clip) and the loss and every gradient equal those with the old
    log-probs computed apart by the same model."""
    model = load_pretrained(tiny_model("llama"))
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 60, (n,), generator=gen) for n in (9, 14)]
    lens, adv = [4, 5], [0.8, -0.5]
    with torch.no_grad():
        logits = model(torch.cat([s[:-1] for s in seqs]).unsqueeze(0), document_lengths=[len(s) - 1 for s in seqs])[0]
        lp = token_logprobs(logits, torch.cat([s[1:] for s in seqs]), 1.5)
    olds, start = [], 0
    for s, p in zip(seqs, lens):
        olds.append(lp[start + p - 1:start + len(s) - 1].clone())
        start += len(s) - 1
    results = []
    for old in (olds, [None, None]):
        model.zero_grad()
        rolls = [Rollout(s, p, a, o) for s, p, a, o in zip(seqs, lens, adv, old)]
        loss, st = policy_loss(model, rolls, temperature=1.5, clip_eps=1e-6, kl_coef=0.0)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], st))
    (want, want_g, _), (got, got_g, st) = results
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
    assert st["clipped"] == 0
    with pytest.raises(ValueError, match="give all or none"):
        policy_loss(model, [Rollout(seqs[0], 4, 1.0, olds[0]), Rollout(seqs[1], 5, 1.0, None)])


def _task_with_reward(tmp_path, monkeypatch, records: int, expression: str) -> tuple[str, str]:
    """``records`` chat-task prompts in a JSONL file and a reward function returning ``expression``
    (of ``prompt`` and ``response``), importable: their ``prompts`` and ``reward`` arguments."""
    from posttrain.data.tasks import chat_task_records

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(records, seed=3)))
    module = "reward_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)  # (one per test: imports are cached)
    (tmp_path / f"{module}.py").write_text(f"def reward(prompt, response):\n    return {expression}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return str(prompts), f"{module}:reward"


@pytest.mark.parametrize("skip", [True, False])
def test_equal_reward_groups_are_skipped_or_trained_as_asked(tmp_path, tiny_model, monkeypatch, skip):
    """A reward every response earns equally: every group has zero advantage. Skipped (the
    default), nothing is updated; trained, the KL term is (TRL's choice). Both count them."""
    from posttrain.cli import build_parser

    prompts, reward = _task_with_reward(tmp_path, monkeypatch, 4, "1.0")
    cfg = RLConfig(model_path=tiny_model("llama"), prompts=prompts, reward=reward,
                   samples_per_prompt=2, prompts_per_step=2, max_new_tokens=4, steps=1, max_tokens=128, kl_coef=0.1,
                   skip_equal_reward_groups=skip)
    row = run_rl(cfg, world_size=2, quiet=True)[0]["metrics"][0]
    assert row["zero_advantage_groups"] == 2
    assert row["updates"] == (0 if skip else 1)
    assert (row["kl"] is None or row["kl"] == 0) if skip else row["kl"] >= 0 and row["entropy"] > 0
    args = build_parser("rl").parse_args(["rl", "--no-skip-equal-reward-groups"])  # the switch's off form
    assert getattr(args, "run.skip_equal_reward_groups") is False


@pytest.mark.parametrize("answer, response, want", [
    ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$", 1.0),
    ("2\\sqrt{2}", "so it is $\\sqrt{8}$", 1.0),
    ("$\\frac{3}{4}$", "0.75", 1.0),
    (3, "x = 3", 1.0),
    ("42", "41", 0.0),
    ("7", "seven", 0.0),
])
def test_the_math_answer_reward_compares_values(answer, response, want):
    fn = load_reward("math_answer")
    assert call_reward(fn, "p", response, fields={"answer": answer, "source": "gsm"}, name="math_answer") == want


def test_a_reward_gets_the_record_fields_it_names():
    record = {"answer": "4 1 3", "tests": ["t1"], "source": "x"}
    assert call_reward(lambda p, r: len(r), "p", "abc", fields=record) == 3  # two arguments: as before
    assert call_reward(lambda prompt, response, answer: float(response == answer), "p", "4 1 3", fields=record) == 1
    assert call_reward(lambda p, r, **kw: len(kw), "p", "r", fields=record) == 3  # **kwargs: every field
    with pytest.raises(ValueError, match=r"`reward` mine:f returned 'high', not a number \(p\.jsonl:7, response"):
        call_reward(lambda p, r: "high", "p", "r", name="mine:f", where="p.jsonl:7")


def test_several_rewards_are_weighted_and_each_reported(tmp_path, tiny_model, monkeypatch):
    from posttrain.data.tasks import chat_task_records

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({**r, "answer": "yes"}) + "\n" for r in chat_task_records(4, seed=3)))
    (tmp_path / "two.py").write_text("def flat(prompt, response):\n    return 1.0\n"
                                     "def given(prompt, response, answer):\n    return float(answer == 'yes') * 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RLConfig(model_path=tiny_model("llama"), prompts=str(prompts), reward="two:flat, two:given",
                   reward_weights=(0.5, 2.0), samples_per_prompt=2, prompts_per_step=2, max_new_tokens=4, steps=1,
                   max_tokens=128)
    row = run_rl(cfg, world_size=2, quiet=True)[0]["metrics"][0]
    assert row["reward_mean/two:flat"] == 1.0 and row["reward_mean/two:given"] == 3.0
    assert row["reward_mean"] == 0.5 * 1.0 + 2.0 * 3.0
    with pytest.raises(ValueError, match="1 weights for the 2 reward"):
        RLConfig(reward="two:flat,two:given", reward_weights=(1.0,))


def test_the_loop_drives_the_rollout_engine_through_its_weight_sync_phases(tmp_path, tiny_model, monkeypatch):
    """wake, load_weights (in buckets), generate, sleep: every step, in that order; no scoring
    forward on the rollout engine (the old log-probs are the update's own, on-policy)."""
    from posttrain.data.tasks import chat_task_records
    from posttrain.rl import HFRollout

    log = tmp_path / "calls.txt"
    for name in ("wake", "load_weights", "generate", "logprobs", "sleep"):  # (logprobs: must not be called)
        original = getattr(HFRollout, name)

        def wrapped(self, *args, _name=name, _original=original, **kwargs):
            if _name == "load_weights":  # count the buckets, and check the copy equals what they gave
                args = (list(args[0]),)
                with open(log, "a") as f:
                    f.write(f"{_name} {len(args[0])}\n")
                result = _original(self, *args, **kwargs)
                own = self.model.state_dict()
                for part in args[0]:
                    for key, value in part.items():
                        assert torch.equal(own[key.removeprefix("hf.")], value), key
                return result
            else:
                with open(log, "a") as f:
                    f.write(f"{_name}\n")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(HFRollout, name, wrapped)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(4, seed=3)))
    cfg = RLConfig(model_path=tiny_model("llama"), prompts=str(prompts), samples_per_prompt=2, prompts_per_step=2,
                   max_new_tokens=4, steps=2, max_tokens=128)
    run_rl(cfg, world_size=1, quiet=True)
    calls = log.read_text().split("\n")[:-1]
    buckets = int(calls[1].split()[1])
    assert buckets > 1  # one bucket per engine unit, not the whole model at once
    assert calls == ["wake", f"load_weights {buckets}", "generate", "sleep"] * 2


def test_rollout_weights_load_by_name_and_a_mismatch_is_refused_in_one_line(tiny_model):
    """The rollout copy takes the engine's full state in buckets (under the ``hf.`` wrapper's
    names here) and then equals it, tied weights included; a name it lacks or a parameter no
    bucket gave is refused after every bucket was taken (taking them is a collective)."""
    from transformers import AutoModelForCausalLM

    from posttrain.rl import HFRollout

    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p))  # differs from the rollout's copy everywhere
    rollout = HFRollout(AutoModelForCausalLM.from_pretrained(tiny_model("llama")), eos_token_id=0, pad_token_id=0)
    names = [n for n, _ in source.named_parameters()]
    full = {f"hf.{n}": p.detach().clone() for n, p in source.named_parameters()}
    buckets = [{k: full[k] for k in list(full)[i:i + 3]} for i in range(0, len(full), 3)]
    rollout.load_weights(iter(buckets))
    got = dict(rollout.model.named_parameters())
    for n in names:
        torch.testing.assert_close(got[n], full[f"hf.{n}"], rtol=0, atol=0, msg=n)

    taken = []
    extra = [*buckets, {"hf.model.layers.99.mlp.up_proj.weight": torch.zeros(1)}]
    with pytest.raises(ValueError, match=r"1 name\(s\) the rollout model lacks \(hf.model.layers.99"):
        rollout.load_weights(b for b in extra if not taken.append(b))
    assert len(taken) == len(extra)  # every bucket taken before refusing
    short = [{k: v for k, v in b.items() if "layers.0.mlp" not in k} for b in buckets]
    with pytest.raises(ValueError, match=r"3 of its parameters not given \(model.layers.0.mlp"):
        rollout.load_weights(iter(short))


def test_rl_config_clip_bounds_default_to_the_symmetric_shorthand():
    cfg = RLConfig(clip_eps=0.1)
    assert (cfg.clip_eps_low, cfg.clip_eps_high) == (0.1, 0.1)
    cfg = RLConfig(clip_eps_high=0.28)
    assert (cfg.clip_eps_low, cfg.clip_eps_high) == (0.2, 0.28)
    with pytest.raises(ValueError, match=r"clip_eps_low=1\.5 must be in"):
        RLConfig(clip_eps_low=1.5)


def _update_worker(rank, world, cfg, model_dir, lengths, kind="cpu"):
    torch.manual_seed(0)
    model = load_pretrained(model_dir)
    rolls = _rollouts(model, model.config.vocab_size, lengths)
    cost = FlopsCost.from_config(model.config)
    if kind == "cuda":  # (two ranks on one GPU share it: flat ODC's run over gloo)
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.accelerator.set_device_index(dev.index)
        model.to(dev)
    engine = build_engine(model, cfg.engine)
    opt = torch.optim.SGD(engine.parameters(), lr=cfg.optim.lr)
    st = update_minibatch(engine, model, opt, rolls, cfg, rank, world, cost)
    st["mesh_dims"] = engine.mesh.ndim
    st["checkpointed"] = all(getattr(b, "_posttrain_checkpointed", False) for b in find_blocks(model))
    full = {k.removeprefix("hf."): v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return full, st


CUDA_WORLD = min(2, torch.cuda.device_count())  # (NVML: no CUDA context in the test process)


@pytest.mark.parametrize("engine, agg, world, kind", [
    (EngineConfig("odc"), "token-mean", 2, "cpu"), (EngineConfig("fsdp"), "seq-mean-token-mean", 2, "cpu"),
    (EngineConfig("odc-fsdp2"), "seq-mean-token-sum", 2, "cpu"),
    (EngineConfig("odc", mode="collective"), "token-mean", 2, "cpu"),
    # the run's engine section reaches the update whole: HSDP and activation checkpointing too
    (EngineConfig("odc", replicas=2, activation_checkpointing=True), "token-mean", 4, "cpu"),
    # on the GPU: flat ODC on 2 ranks (sharing one GPU where there is one), FSDP2 one rank per GPU
    pytest.param(EngineConfig("odc"), "token-mean", 2, "cuda", marks=pytest.mark.cuda, id="odc-cuda"),
    pytest.param(EngineConfig("fsdp"), "seq-mean-token-mean", CUDA_WORLD or 1, "cuda", marks=pytest.mark.cuda,
                 id="fsdp-cuda"),
])
def test_one_update_under_each_engine_equals_the_single_process_reference(tiny_model, engine, agg, world, kind):
    model_dir = tiny_model("llama")
    cfg = RLConfig(engine=engine, balance="diff_micro", loss_agg=agg, kl_coef=0.1, optim=OptimConfig("sgd", lr=0.5),
                   max_tokens=64)
    backend = device_backend("cuda", shared=world > CUDA_WORLD) if kind == "cuda" else "gloo"
    results = run_ranks(_update_worker, world, cfg, model_dir, LENGTHS, kind, backend=backend,
                        start="spawn" if kind == "cuda" else None)
    micro = [int(st["microbatches"]) for _, st in results]
    if not engine.label.endswith(("fsdp", "collective")) and world > 1:
        assert len(set(micro)) > 1  # the ranks ran different numbers of microbatches
    assert results[0][1]["mesh_dims"] == (2 if engine.replicas not in (1, "auto") else 1)
    assert results[0][1]["checkpointed"] == engine.activation_checkpointing
    ref = load_pretrained(model_dir)
    rolls = _rollouts(ref, ref.config.vocab_size, LENGTHS)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.optim.lr)
    loss, _ = policy_loss(ref, rolls, clip_eps=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef,
                          agg=agg)
    (loss / loss_units(rolls, agg)).backward()
    opt.step()
    want = ref.hf.state_dict()
    start = load_pretrained(model_dir).hf.state_dict()
    assert set(results[0][0]) == set(want)
    for name, value in results[0][0].items():
        torch.testing.assert_close(value, want[name], atol=1e-5 if kind == "cpu" else 1e-4, rtol=1e-4, msg=name)
    assert any(not torch.equal(want[n], start[n]) for n in want)  # the step changed the weights
    assert results[0][1]["tokens"] == sum(n for _, n in LENGTHS)


CP_LENGTHS = [(5, 30), (8, 38), (8, 51), (40, 5), (3, 39), (5, 32), (3, 5), (7, 7)]  # 4 longer than 40


@pytest.mark.parametrize("engine, agg", [
    (EngineConfig("odc", context_parallel="auto"), "token-mean"),
    (EngineConfig("odc-fsdp2", context_parallel=2, activation_checkpointing=True), "seq-mean-token-mean"),
    (EngineConfig("odc", context_parallel="auto"), "seq-mean-token-sum"),
], ids=["odc-token-mean", "odc-fsdp2-ckpt-seq-mean-token-mean", "odc-seq-mean-token-sum"])
def test_an_update_with_rollouts_split_across_ranks_equals_the_single_process_reference(tiny_model, engine, agg):
    """Context parallelism in the RL update: rollouts longer than ``max_tokens`` are split across
    both ranks (one with its response in one shard alone: the other shard runs with no response
    token), every rank runs its shards first, and the step equals one process's over the whole
    rollouts, KL included; the statistics count every token once."""
    model_dir = tiny_model("llama")
    cfg = RLConfig(engine=engine, balance="diff_micro", loss_agg=agg, kl_coef=0.1, optim=OptimConfig("sgd", lr=0.5),
                   max_tokens=40)
    results = run_ranks(_update_worker, 2, cfg, model_dir, CP_LENGTHS)
    ref = load_pretrained(model_dir)
    rolls = _rollouts(ref, ref.config.vocab_size, CP_LENGTHS)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.optim.lr)
    loss, want_st = policy_loss(ref, rolls, clip_eps=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
                                kl_coef=cfg.kl_coef, agg=agg)
    (loss / loss_units(rolls, agg)).backward()
    opt.step()
    want = ref.hf.state_dict()
    for name, value in results[0][0].items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=1e-4, msg=name)
    st = results[0][1]
    assert st["tokens"] == sum(n for _, n in CP_LENGTHS) and st["clipped"] == want_st["clipped"]
    assert st["kl"] == pytest.approx(want_st["kl"], rel=1e-4) and st["entropy"] == pytest.approx(want_st["entropy"], rel=1e-4)
    assert sum(int(r[1]["microbatches"]) for r in results) >= 4 * 2  # every long rollout as two shards


def test_an_rl_run_with_split_rollouts_takes_the_unsplit_runs_steps(tmp_path, tiny_model, monkeypatch):
    """The trainer's path (its groups kept across steps): with context parallelism a rollout may
    be longer than a microbatch (``max_tokens`` 24 here: prompts plus 16 new tokens are longer),
    the update splits each such rollout across both ranks, and every step's figures equal the run
    whose microbatches hold them whole (the same samples, the same updates); a prompt that no
    split fits is refused, naming the limit."""
    from posttrain.train.rl import prompt_limit
    prompts, reward = _task_with_reward(tmp_path, monkeypatch, 8, "float(sum(map(ord, response)) % 7)")
    cfg = RLConfig(model_path=tiny_model("llama"), prompts=prompts, reward=reward,
                   samples_per_prompt=2, prompts_per_step=2, max_new_tokens=16, steps=2, max_tokens=128, kl_coef=0.05,
                   seed=1)
    want = run_rl(cfg, world_size=2, quiet=True)[0]["metrics"]
    split = replace(cfg, max_tokens=24, engine=EngineConfig("odc", context_parallel="auto"))
    assert prompt_limit(split, 2)["max_tokens"] == 48
    got = run_rl(split, world_size=2, quiet=True)[0]["metrics"]
    assert sum(r["split_sequences"] for r in got) > 0 and all(r["split_sequences"] == 0 for r in want)
    assert all(r["updates"] > 0 for r in want)
    for a, b in zip(got, want):
        assert a["reward_mean"] == b["reward_mean"] and a["updates"] == b["updates"]
        for k in ("kl", "entropy", "grad_norm"):
            assert (a[k] is None) == (b[k] is None) and (a[k] is None or a[k] == pytest.approx(b[k], rel=1e-4)), k
    with pytest.raises(ValueError, match=r"plus max_new_tokens=16 exceeds the longest split rollout \(max_tokens=12 x "
                                         r"shards\)=24 \+ 1"):
        run_rl(replace(split, max_tokens=12), world_size=2, quiet=True)
    with pytest.raises(ValueError, match=r"plus max_new_tokens=16 exceeds max_tokens=24 \+ 1"):
        run_rl(replace(split, engine=EngineConfig("odc")), world_size=2, quiet=True)
    with pytest.raises(ValueError, match=r"context_parallel=3 shards a rollout over 3 ranks, but the run has 2"):
        run_rl(replace(split, engine=EngineConfig("odc", context_parallel=3)), world_size=2, quiet=True)


def test_rl_context_parallel_takes_diff_micro_only():
    with pytest.raises(ValueError, match="use `balance` diff_micro"):
        RLConfig(engine=EngineConfig("odc", context_parallel="auto"), balance="same_micro")


def _rl_checked_worker(rank, world, cfg):
    """An RL run whose export also checks, in the rank, that the rollout copy loads the engine's
    full state exactly and that the files written hold it."""
    import glob
    import os

    from safetensors.torch import load_file

    from posttrain.train.rl.loop import RLTrainer

    class Checked(RLTrainer):
        checks = None

        def export(self):
            super().export()
            full = {}
            for part in self.engine.iter_full_state():  # (a collective; CPU tensors)
                full.update({k.removeprefix("hf."): v for k, v in part.items()})
            self.rollout.load_weights(self.engine.iter_full_state(self.device))
            own = self.rollout.model.state_dict()
            rollout_ok = all(torch.equal(own[k].cpu(), v) for k, v in full.items())
            exported = {}
            for f in glob.glob(os.path.join(self.cfg.output_dir, "*.safetensors")):
                exported.update(load_file(f))
            export_ok = bool(exported) and all(torch.equal(t, full[k].to(t.dtype)) for k, t in exported.items())
            self.checks = (rollout_ok, export_ok)

    trainer = Checked(cfg, rank, world)
    return trainer.run(), trainer.checks


@pytest.mark.cuda
def test_a_short_rl_run_on_cuda_samples_updates_and_exports(tmp_path, tiny_model):
    """The whole loop on the GPU: rollouts sampled there, the reference and the update sharded
    there by flat ODC (2 ranks, sharing one GPU where there is one; the FSDP2 update on the GPU is
    the single-update test's); the rollout copy takes the engine's full state exactly and the
    export holds it."""
    from posttrain.data.tasks import chat_task_records

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(8, seed=3)))
    cfg = RLConfig(model_path=tiny_model("llama"), prompts=str(prompts), samples_per_prompt=4, prompts_per_step=4,
                   max_new_tokens=8, steps=2, max_tokens=128, kl_coef=0.05, engine=EngineConfig("odc"), device="cuda",
                   skip_equal_reward_groups=False, output_dir=str(tmp_path / "out"))
    out = run_ranks(_rl_checked_worker, 2, cfg, backend=device_backend("cuda", shared=2 > CUDA_WORLD), start="spawn",
                    timeout_s=300)
    rows = out[0][0]
    assert len(rows) == 2 and all(r["updates"] == 1 and r["rollout_tokens_per_s"] > 0 for r in rows)
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["kl"]) for r in rows)
    assert (tmp_path / "out" / "config.json").exists()
    assert [checks for _, checks in out] == [(True, True)] * 2, "rollout copy or export differs from the engine's state"


def _rl_checked_on_cpu(tmp_path, tiny_model):
    from posttrain.data.tasks import chat_task_records

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(8, seed=3)))
    cfg = RLConfig(model_path=tiny_model("llama"), prompts=str(prompts), samples_per_prompt=2, prompts_per_step=2,
                   max_new_tokens=4, steps=1, max_tokens=128, engine=EngineConfig("odc"), device="cpu",
                   output_dir=str(tmp_path / "out"))
    return run_ranks(_rl_checked_worker, 2, cfg, timeout_s=120)


def test_the_cuda_rl_checks_hold_on_the_cpu(tmp_path, tiny_model):
    """The CUDA RL test's in-rank checks (rollout copy = engine state, export = engine state) on the
    CPU, so that a check that could never pass is found here and not on the GPU machine."""
    assert [checks for _, checks in _rl_checked_on_cpu(tmp_path, tiny_model)] == [(True, True)] * 2


def test_rewards_that_raise_or_are_not_finite_are_named():
    assert load_reward("reverse_digits")("reverse 1 2 3", " 3 2 1 ") == 1.0
    with pytest.raises(ValueError, match="`reward` 'math:nope': cannot import"):
        load_reward("math:nope")
    with pytest.raises(ValueError, match="give reverse_digits, math_answer or module:function"):
        load_reward("nothing")
    with pytest.raises(ValueError, match="raised ZeroDivisionError"):
        call_reward(lambda p, r: 1 / 0, "p", "r", name="mine:f")
    with pytest.raises(ValueError, match="returned nan"):
        call_reward(lambda p, r: float("nan"), "p", "r")
    with pytest.raises(ValueError, match="not a number"):
        call_reward(lambda p, r: "high", "p", "r")


def test_prompts_too_long_or_malformed_are_named(tmp_path, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "reverse 1 2 3"}) + "\n" + json.dumps({"prompt": "reverse " + "1 " * 100}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2: a prompt of \d+ tokens plus max_new_tokens=8 exceeds"):
        load_prompts(str(p), tok, max_new_tokens=8, max_tokens=64)
    p.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: expected"):
        load_prompts(str(p), tok, max_new_tokens=8, max_tokens=64)
    with pytest.raises(ValueError, match="needs at least 2"):
        RLConfig(samples_per_prompt=1)


def test_a_short_rl_run_reports_every_figure(tmp_path, tiny_model):
    from posttrain.data.tasks import chat_task_records

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(8, seed=3)))
    cfg = RLConfig(model_path=tiny_model("llama"), prompts=str(prompts), samples_per_prompt=4, prompts_per_step=4,
                   max_new_tokens=8, steps=2, max_tokens=128, kl_coef=0.05, ppo_epochs=2, minibatches=2,
                   metrics=str(tmp_path / "m.jsonl"), output_dir=str(tmp_path / "out"),
                   record=str(tmp_path / "rollouts.jsonl"))
    results = run_rl(cfg, world_size=2, quiet=True)
    rows = results[0]["metrics"]
    assert len(rows) == 2 and results[1]["metrics"] == rows
    for r in rows:
        assert 0 < r["response_len_mean"] <= 8 and r["rollout_tokens_per_s"] > 0
        assert r["updates"] in (0, 4) and (r["updates"] == 0) == (r["zero_advantage_groups"] == 4)
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "out" / "config.json").exists()
    recorded = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recorded] == [0, 1] and len(recorded[0]["samples"]) == 16
    with pytest.raises(ValueError, match="prompts_per_step=1 is fewer than the 2 ranks"):
        run_rl(replace(cfg, prompts_per_step=1), world_size=2, quiet=True)


def _reference_worker(rank, world, cfg, model_dir, lengths):
    from posttrain.train.rl.reference import ShardedReference

    torch.manual_seed(0)
    model = load_pretrained(model_dir)
    rolls = _rollouts(model, model.config.vocab_size, lengths)
    ref = ShardedReference(model_dir, cfg, FlopsCost.from_config(model.config))
    lps = ref.logprobs([r.input_ids for r in rolls], [r.prompt_len for r in rolls], rank=rank, world_size=world)
    held = sum(t.numel() for t in ref.engine.parameters() if t.requires_grad)
    handle = getattr(ref.engine, "handle", None)
    if handle is not None and hasattr(handle, "layouts"):  # flat ODC: the frozen shards this rank holds
        local = sum(u.frozen_shard.numel() for u in handle.layouts if u.frozen_shard is not None)
    else:  # FSDP2: the local shards of the DTensor parameters
        local = sum(p.to_local().numel() for p in ref.model.parameters())
    micro = ref.microbatches
    ref.close()
    return lps, micro, held, local


@pytest.mark.parametrize("dp, mode", [("odc", "one-sided"), ("fsdp", "one-sided"), ("odc", "collective")])
def test_the_sharded_reference_gives_the_unsharded_models_logprobs(tiny_model, dp, mode):
    model_dir = tiny_model("llama")
    cfg = RLConfig(engine=EngineConfig(dp, mode=mode), balance="diff_micro", kl_coef=0.1, max_tokens=64,
                   temperature=1.5)  # (at the sampling temperature)
    results = run_ranks(_reference_worker, 2, cfg, model_dir, LENGTHS)
    if not cfg.engine.label.endswith(("fsdp", "collective")):
        assert results[0][1] != results[1][1]  # the ranks ran different numbers of forward microbatches
    model = load_pretrained(model_dir)
    assert all(held == 0 for _, _, held, _ in results)  # nothing of the reference is trainable
    total = sum(p.numel() for p in model.parameters())
    for *_, local in results:  # each rank holds about half of it (shards padded to equal sizes)
        assert 0 < local <= total / 2 + 64, (local, total)
    for r, got0, got1 in zip(_rollouts(model, model.config.vocab_size, LENGTHS), results[0][0], results[1][0]):
        with torch.no_grad():
            want = token_logprobs(model(r.input_ids[:-1].unsqueeze(0))[0][r.prompt_len - 1:], r.input_ids[r.prompt_len:],
                                  1.5)
        torch.testing.assert_close(got0, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got0, got1)


def test_an_interrupted_rl_run_resumes_to_the_uninterrupted_one(tmp_path, tiny_model, monkeypatch):
    from posttrain.data.tasks import chat_task_records
    from posttrain.train.sft import export_checkpoint

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chat_task_records(8, seed=3)))
    # A reward every response earns some of (the random model never answers the task right).
    (tmp_path / "wordy.py").write_text("def reward(prompt, response):\n    return float(len(response))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = RLConfig(model_path=tiny_model("llama"), prompts=str(prompts), reward="wordy:reward", samples_per_prompt=4,
                    prompts_per_step=4, max_new_tokens=6, steps=3, max_tokens=128, kl_coef=0.05,
                    optim=OptimConfig(lr=3e-3), temperature=1.5, engine=EngineConfig(deterministic=True),
                    loss_agg="seq-mean-token-sum")  # (an aggregation SFT's config does not take: export ignores it)
    whole = run_rl(replace(base, checkpoint_dir=str(tmp_path / "a"), metrics=str(tmp_path / "a.jsonl")),
                   world_size=2, quiet=True)[0]["metrics"]
    cut = replace(base, checkpoint_dir=str(tmp_path / "b"), metrics=str(tmp_path / "b.jsonl"))
    first = run_rl(replace(cut, steps=2), world_size=2, quiet=True)[0]
    rest = run_rl(cut, world_size=2, quiet=True)[0]
    assert first["resumed_from"] == 0 and rest["resumed_from"] == 2
    keys = ("reward_mean", "response_len_mean", "kl", "clip_fraction", "entropy")
    assert any(r["updates"] for r in whole)  # the policy changed along the way
    for a, b in zip(whole, first["metrics"] + rest["metrics"]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert [json.loads(x)["step"] for x in (tmp_path / "b.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert run_rl(cut, world_size=2, quiet=True) == []  # nothing left to do
    with pytest.raises(ValueError, match="prompts_per_step=4, this run has 2"):
        run_rl(replace(cut, prompts_per_step=2, steps=5), world_size=2, quiet=True)
    # The checkpoint exports like a training checkpoint, to the same weights.
    export_checkpoint(str(tmp_path / "a"), str(tmp_path / "ea"), log=lambda *a: None)
    export_checkpoint(str(tmp_path / "b"), str(tmp_path / "eb"), log=lambda *a: None)
    wa, wb = load_pretrained(str(tmp_path / "ea")).state_dict(), load_pretrained(str(tmp_path / "eb")).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_rl_without_a_model_path_is_refused_unless_random_weights_are_asked_for(cli, tmp_path):
    rc, _, err = cli("rl", "--task-dir", str(tmp_path / "task"), "--steps", "1")
    assert rc == 2 and "posttrain rl needs --model-path" in err and "--random-weights" in err
    assert not (tmp_path / "task").exists()  # refused before making anything
    rc, _, err = cli("rl", "--random-weights", "--model-path", str(tmp_path), "--steps", "1")
    assert rc == 2 and "--random-weights runs the chat task's untrained model instead of --model-path" in err
    rc, stdout, err = cli("rl", "--random-weights", "--task-dir", str(tmp_path / "task"), "--steps", "1",
                          "--samples-per-prompt", "2", "--prompts-per-step", "2", "--max-new-tokens", "4")
    assert rc == 0, err
    assert "--random-weights: the embedded chat task's untrained model" in stdout and (tmp_path / "task" / "model").is_dir()
    assert "reward 0.000 -> 0.000" in stdout  # random weights answer nothing right
