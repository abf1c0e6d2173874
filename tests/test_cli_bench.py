"""`posttrain bench ...`: every benchmark runs on a tiny config and its results file holds what it
promises (checked on the JSON, not on the printed table).

A failure pinpoints a benchmark's wiring or its results, not a speed.
"""

from __future__ import annotations

import json
import os
import time

import pytest


def test_bench_odc_runs_every_variant_and_both_bounds_and_splits_the_gain(cli_proc, tmp_path):
    out = tmp_path / "b.json"
    proc = cli_proc("bench", "odc", "--steps", "2", "--sequences", "4", "--max-len", "64", "--dim", "32",
                "--layers", "1", "--repeats", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    median, spread, fac = got["median"], got["spread"], got["factors"]
    assert set(median) == {"fsdp+round_robin", "fsdp+same_micro", "odc-fsdp2-collective+same_micro",
                           "odc-fsdp2+round_robin", "odc-fsdp2+diff_micro", "odc-collective+same_micro",
                           "odc+diff_micro", "even", "partition"}
    assert median["fsdp+same_micro"]["vs_fsdp_same_micro"] == 1.0
    assert median["partition"]["vs_partition"] == 1.0 and median["odc+diff_micro"]["tokens_per_s"] > 0
    refs = {"vs_fsdp_same_micro": "fsdp+same_micro", "vs_partition": "partition"}
    for name in median:  # each round's ratio is reported; the median lies within their range
        for key, ref in refs.items():
            per_round = [r[name]["tokens_per_s"] / r[ref]["tokens_per_s"] for r in got["rounds"]]
            assert spread[name][key] == [min(per_round), max(per_round)]
            assert min(per_round) <= median[name][key] <= max(per_round)
    for r in got["rounds"]:  # the three factors multiply to the total, round by round
        tp = {k: v["tokens_per_s"] for k, v in r.items()}
        assert tp["odc+diff_micro"] / tp["fsdp+same_micro"] == pytest.approx(
            tp["odc-fsdp2-collective+same_micro"] / tp["fsdp+same_micro"]
            * tp["odc-collective+same_micro"] / tp["odc-fsdp2-collective+same_micro"]
            * tp["odc+diff_micro"] / tp["odc-collective+same_micro"])
    assert set(fac) >= {"total", "transport", "engine", "mechanism", "headroom", "partition_vs_even"}
    # the variants' factors pooled over the rounds (as the demo's): they multiply to the total, each in its interval
    assert fac["transport"][0] * fac["engine"][0] * fac["mechanism"][0] == pytest.approx(fac["total"][0])
    assert all(fac[k][1] <= fac[k][0] <= fac[k][2] for k in ("total", "transport", "engine", "mechanism"))
    from posttrain.lab.bench.odc import factors, split_odc_vs_partition

    for r in got["rounds"]:  # odc/part splits into the balancer's plan, the engine's compute, the critical share
        split = split_odc_vs_partition(r)
        odc = r["odc+diff_micro"]
        assert split["odc_critical_share"] == odc["busiest_compute_s"] / odc["step_time_s"] and 0 < odc[
            "busiest_compute_s"] <= odc["step_time_s"]
        assert split["plan_vs_partition"] == r["partition"]["plan_tokens_per_s"] / r["partition"]["tokens_per_s"]
        assert split["plan_vs_partition"] * split["plain_vs_engine_compute"] * split["odc_critical_share"] == \
            pytest.approx(odc["tokens_per_s"] / r["partition"]["tokens_per_s"])
    per_round = [r["partition"]["tokens_per_s"] / r["odc-collective+same_micro"]["tokens_per_s"]
                 * r["odc+diff_micro"]["tokens_per_s"] / r["partition"]["plan_tokens_per_s"] for r in got["rounds"]]
    assert [factors(r)["reachable_headroom"] for r in got["rounds"]] == pytest.approx(per_round)
    assert min(per_round) <= fac["reachable_headroom"][0] <= max(per_round)
    for key in ("plan_vs_partition", "plain_vs_engine_compute", "odc_critical_share"):
        # (their product holds round by round, above; the medians of two noisy rounds need not multiply)
        per_round = [split_odc_vs_partition(r)[key] for r in got["rounds"]]
        assert min(per_round) <= fac[key][0] <= max(per_round), (key, per_round, fac[key])
    for r in got["rounds"]:  # whole sequences never divide more evenly than all compute does
        assert r["partition"]["tokens_per_s"] <= 1.25 * r["even"]["tokens_per_s"]


def test_the_sweep_estimate_fits_a_fixed_and_a_per_sequence_cost():
    from posttrain.lab.bench.odc import sweep_estimate

    # 20 s fixed + 10 s a sequence: 40 s at 2, 60 s at 4; points 2, 2, 4, 8 -> 40+40+60+100 = 240 s x 5 rounds
    got = sweep_estimate([(2, 40.0), (2, 40.0), (4, 60.0)], [2, 2, 4, 8], repeats=5)
    assert got.startswith("the measurements will take about 20 min in all (4 points x 5 rounds; a fixed cost")
    one = sweep_estimate([(4, 60.0)], [4, 4], repeats=2)  # one size only: proportional
    assert "about 4 min in all (2 points x 2 rounds; the first point's time scaled" in one


def test_bench_odc_sweep_reports_every_point_with_predictions(cli_proc, tmp_path, cli):
    out = tmp_path / "s.json"
    proc = cli_proc("bench", "odc", "--sweep", "--sequences-per-rank", "1,2", "--sweep-max-tokens", "64,128", "--steps",
                "2", "--max-len", "64", "--dim", "32", "--layers", "1", "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("sweep: 4 points x 1 rounds x ")  # what it will run, before it runs
    estimate = next(i for i, ln in enumerate(lines) if ln.startswith("the measurements will take about"))
    first_of_two = next(i for i, ln in enumerate(lines) if "round 1/1   2 seq/rank" in ln)
    assert first_of_two < estimate < next(i for i, ln in enumerate(lines) if "round 1/1   2 seq/rank max_tokens   128" in ln)
    saved = json.loads(out.read_text())
    points = saved["points"]
    assert set(saved["calibration"]["engine"]) == {"one-sided", "collective"}  # what the predictions rest on
    assert 0 <= saved["calibration"]["jitter"] <= 1
    assert [(p["sequences_per_rank"], p["max_tokens"]) for p in points] == [(1, 64), (1, 128), (2, 64), (2, 128)]
    for p in points:
        assert p["headroom"][0] > 0 and p["mechanism"][0] > 0
        assert p["predicted"]["headroom"] > 0 and p["predicted"]["mechanism"] > 0
    for p in points:  # where odc/part goes, point by point
        assert 0 < p["odc_critical_share"][0] <= 1 and p["plan_vs_partition"][0] > 0
        assert p["captured_of_reachable"] is None or p["reachable_headroom"][0] > 1
    rc, _, err = cli("bench", "odc", "--sweep", "--sweep-max-tokens", "32", "--max-len", "64")
    assert rc == 2 and "--sweep-max-tokens=32 is below --max-len=64" in err


def test_bench_odc_rounds_rotate_their_order_bounds_included(monkeypatch):
    """A machine that drifts over a round must not always favour the variant that runs first."""
    import posttrain.lab.bench.odc as bench

    order = []
    monkeypatch.setattr(bench, "run_ranks", lambda fn, n, cfg, **kw: order.append(f"{cfg.engine.label}+{cfg.balance}") or [])
    monkeypatch.setattr(bench, "summarize", lambda results: {"tokens_per_s": 1.0})
    monkeypatch.setattr(bench, "measure_bounds", lambda cfg, n: order.append("bounds") or {})
    base = bench.TrainConfig(steps=2, sequences=4, max_len=64, dim=32, num_layers=1)
    firsts = []
    for k in range(4):
        order.clear()
        bench._round(base, 2, bench.MECHANISM_VARIANTS, lambda *a, **kw: None, "", k)
        assert sorted(order) == sorted(["odc-collective+same_micro", "odc+diff_micro", "bounds"])
        firsts.append(order[0])
    assert firsts == ["odc-collective+same_micro", "odc+diff_micro", "bounds", "odc-collective+same_micro"]


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_odc_overhead_benchmark_reports_every_rank(cli_proc, tmp_path, world_size):
    out = tmp_path / "o.json"
    proc = cli_proc("bench", "overhead", "--dim", "32", "--world-size", world_size, "--repeats", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["world_size"] == int(world_size) and len(got["ranks"]) == int(world_size)
    for r in got["ranks"]:
        assert set(r["phases_ms"]) == {"plain", "fsdp", "flat"}
        assert all(len(v) == 4 and min(v) >= 0 for v in r["phases_ms"].values())  # entry, forward, backward, exit
        # flat ODC's hook counts what it does: 4 blocks gathered for forward and again for
        # backward, the root once; one push each
        assert r["comm"]["flat"]["gather"][0] == 9.0 and r["comm"]["flat"]["reduce"][0] == 5.0
        assert set(r["optimizer_ms"]) == {"default", "foreach", "fused"} and min(r["optimizer_ms"].values()) > 0
        assert min(r["python_calls"].values()) > 0


def test_bench_pipeline_tiny(cli_proc, tmp_path, cli):
    out = tmp_path / "b.json"
    proc = cli_proc("bench", "pipeline", "--pp-sizes", "2", "--dim", "32", "--layers", "4", "--seq-len", "32",
                "--repeats", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert {r["schedule"] for r in res["memory"]} == {"1f1b", "interleaved_1f1b", "group_interleaved",
                                                      "group_interleaved_zb", "interleaved_zb"}
    assert {r["group_size"] for r in res["memory"] if r["schedule"] == "group_interleaved_zb"} == {1}
    assert all(r["peak_units"] == r["predicted_units"] for r in res["memory"])
    assert [r["schedule"] for r in res["timing"]] == ["1f1b", "interleaved_1f1b"]
    assert all(r["max_grad_diff"] == 0.0 and r["ratio"] > 0 for r in res["timing"])
    rc, _, err = cli("bench", "pipeline", "--pp-sizes", "two")
    assert rc == 2 and "--pp-sizes: invalid comma-separated int list value" in err
    rc, _, err = cli("bench", "pipeline", "--pp-sizes", "1,2")
    assert rc == 2 and "--pp-sizes=1,2: a pipeline needs at least 2 ranks" in err


def test_bench_transport_reports_both_ratios(cli_proc, tmp_path, cli):
    out = tmp_path / "t.json"
    proc = cli_proc("bench", "transport", "--sizes-mib", "0.25", "--iters", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert [r["shard_mib"] for r in got["rows"]] == [0.25] and got["iters"] == 2
    for r in got["rows"]:
        for key in ("gloo_gather_gib_s", "shm_gather_gib_s", "gather_ratio", "gloo_reduce_gib_s", "shm_reduce_gib_s",
                    "reduce_ratio"):
            assert r[key] > 0, key
    rc, _, err = cli("bench", "transport", "--iters", "0")
    assert rc == 2 and "--iters=0" in err


def test_bench_balance_reports_every_method_and_the_targets(cli_proc, tmp_path, cli):
    out = tmp_path / "b.json"
    proc = cli_proc("bench", "balance", "--world-sizes", "2,4", "--seeds", "1", "--profiles", "long_tail", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert {(r["world_size"], r["method"]) for r in got["rows"]} == {
        (n, m) for n in (2, 4) for m in ("round_robin", "local_sort", "same_micro", "diff_micro")}
    assert got["targets"] and all(t["met"] is None for t in got["targets"])  # no 32 or 1024 ranks in this run
    rc, _, err = cli("bench", "balance", "--world-sizes", "2,x")
    assert rc == 2 and "--world-sizes" in err and "Traceback" not in err
    rc, _, err = cli("bench", "balance", "--profiles", "long_tail,nope")
    assert rc == 2 and "unknown length profile 'nope'" in err


def test_bench_rl_replays_the_same_rollouts_under_three_engines(cli, tmp_path):
    out = tmp_path / "rl.json"
    rc, _, err = cli("bench", "rl", "--steps", "3", "--samples", "8", "--max-new-tokens", "64", "--dim", "32",
                          "--layers", "1", "--repeats", "2", "--json", str(out))
    assert rc == 0, err
    got = json.loads(out.read_text())
    assert set(got["tokens_per_s"]) == {"fsdp+same_micro", "odc-collective+same_micro", "odc+diff_micro"}
    assert len(got["rounds"]) == 2 and got["response_lengths"]["max"] <= 64
    for key in ("total", "mechanism", "transport_and_engine"):
        median, lo, hi = got[key]
        assert 0 < lo <= median <= hi
    pred = got["predicted"]  # the simulator for the same plans, beside the measurement
    assert pred["mechanism"] > 0 and pred["headroom"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    rc, _, err = cli("bench", "rl", "--rollouts", str(bad))
    assert rc == 2 and "not the `record` file of an RL run" in err


def test_bench_pipeline_dp_runs_three_engines_and_records_when_it_measures_nothing(cli, tmp_path):
    out = tmp_path / "ppdp.json"
    rc, _, err = cli("bench", "pipeline-dp", "--steps", "2", "--repeats", "1", "--sequences", "8",
                          "--layers", "2", "--dim", "64", "--json", str(out))
    assert rc == 0, err
    import os

    got = json.loads(out.read_text())
    assert set(got["tokens_per_s"]) == {"fsdp+same_micro", "odc-collective+same_micro", "odc+diff_micro"}
    for key in ("total", "mechanism", "transport_and_engine"):
        assert got[key][0] > 0
    assert all(m[0] == m[1] for m in got["microbatches"]["fsdp+same_micro"])  # same_micro: equal counts
    assert got["oversubscribed"] == (4 > (os.cpu_count() or 1))
    rc, _, err = cli("bench", "pipeline-dp", "--dp-size", "1")
    assert rc == 2 and "--dp-size=1 is too small" in err


def test_results_keeps_each_finished_command_when_a_later_one_fails(tmp_path, monkeypatch):
    """`posttrain results` rewrites the file after every command: a failure in the third profile
    keeps the first two new reports, every section it did not rerun and sections it does not
    produce (measured on a GPU machine)."""
    from posttrain.lab import results

    path = tmp_path / "results.md"
    path.write_text("# old\n<!-- result: demo -->\nold demo\n<!-- end: demo -->\n"
                    "<!-- result: profiles -->\nold profiles\n<!-- end: profiles -->\n"
                    "<!-- result: gpu-h200 -->\nmeasured on a GPU\n<!-- end: gpu-h200 -->\n")
    calls = []

    def fake_run(argv, log):
        calls.append(argv)
        if len(calls) == 3:
            raise RuntimeError("interrupted")
        return f"report {len(calls)} for {argv[argv.index('--profile') + 1]}"

    monkeypatch.setattr(results, "_run", fake_run)
    with pytest.raises(RuntimeError, match="interrupted"):
        results.run_results(str(path), only=["profiles"], log=lambda line: None)
    text = path.read_text()
    assert "old demo" in text and "old profiles" not in text
    assert "report 1 for longalign" in text and "report 2 for swe_smith" in text
    assert text.count("<!-- end: profiles -->") == 1
    assert "<!-- result: gpu-h200 -->\nmeasured on a GPU\n<!-- end: gpu-h200 -->" in text  # not its own: kept


def test_results_reruns_one_profile_and_keeps_the_others(tmp_path, monkeypatch):
    from posttrain.lab import results

    path = tmp_path / "results.md"
    monkeypatch.setattr(results, "_run", lambda argv, log: f"first {argv[argv.index('--profile') + 1]}")
    results.run_results(str(path), only=["profiles"], log=lambda line: None)
    monkeypatch.setattr(results, "_run", lambda argv, log: f"second {argv[argv.index('--profile') + 1]}")
    results.run_results(str(path), only=["profiles:swe_smith", "profiles:uniform"], log=lambda line: None)
    text = path.read_text()
    assert [p for p in results._PROFILES if f"first {p}" in text] == ["longalign", "long_tail", "bimodal"]
    assert "second swe_smith" in text and "second uniform" in text and "second longalign" not in text
    # in the file's order
    assert text.index("first longalign") < text.index("second swe_smith") < text.index("first long_tail")
    with pytest.raises(ValueError, match="unknown profile 'nope'"):
        results.run_results(str(path), only=["profiles:nope"], log=lambda line: None)


def test_measure_bounds_times_odc_own_plan_beside_the_chosen_one(monkeypatch):
    """The partition bound per step is the fastest candidate of a first run, timed again in a second;
    diff_micro's own plan is timed in that second run too, so plan and bound compare within one run."""
    import posttrain.lab.bench.odc as bench

    cands = {"measured": [[[0], [1]]], "fitted": [[[1], [0]]], "diff_micro": [[[0, 1], []]]}
    first = [{"measured": [3.0], "fitted": [2.0], "diff_micro": [4.0]}, {"measured": [1.0], "fitted": [1.0],
                                                                        "diff_micro": [0.0]}]
    second = [{"chosen": [2.5], "diff_micro": [5.0]}, {"chosen": [1.5], "diff_micro": [0.0]}]
    runs = []

    def fake(fn, n, cfg, *args, **kw):
        if fn is bench.sequence_times_worker:
            return [{}]
        runs.append(args[0])
        return first if len(runs) == 1 else second

    monkeypatch.setattr(bench, "run_ranks", fake)
    monkeypatch.setattr(bench, "partition_candidates", lambda cfg, n, times: (cands, True))
    cfg = bench.TrainConfig(steps=2, sequences=2, max_len=64, dim=32, num_layers=1)
    got = bench.measure_bounds(cfg, 2)
    assert runs[1] == {"chosen": [[[1], [0]]], "diff_micro": [[[0, 1], []]]}  # fitted won step 1 (2.0 < 3.0, 4.0)
    tokens = bench._steady_tokens(cfg, 2)
    assert got["partition"]["tokens_per_s"] == pytest.approx(tokens / 2.5)
    assert got["partition"]["plan_tokens_per_s"] == pytest.approx(tokens / 5.0)
    assert got["even"]["tokens_per_s"] == pytest.approx(tokens / 2.0)


def test_the_bench_times_its_bounds_in_the_variants_job_a_turn_of_their_own(monkeypatch):
    """The bounds' shares take turns with the variants step by step in one job (in jobs of their
    own after it, a machine that drifted between jobs moved every ratio to the bounds): every rank
    times its share of every step of every round, and each round's bounds come from that round."""
    import posttrain.lab.bench.odc as bench
    from posttrain.lab.bench.stepwise import stepwise_rounds

    cfg = bench.TrainConfig(steps=3, sequences=4, max_len=64, dim=32, num_layers=1, device="cpu")
    choice = {"shares": {"chosen": [[[0, 1], [2, 3]], [[0, 2], [1, 3]]], "diff_micro": [[[0, 1, 2], [3]]] * 2},
              "exact": True, "best": {"measured": 2}, "candidates_tokens_per_s": {},
              "tokens": bench._steady_tokens(cfg, 2)}
    cfgs = {"odc+diff_micro": bench._variant_cfg(cfg, "odc", "one-sided", "diff_micro")}
    per_round, raw = stepwise_rounds(cfgs, world_size=2, batches=2, rounds=2, shares=choice["shares"])
    assert set(per_round[0]) == {"odc+diff_micro"}
    for name in choice["shares"]:
        for rows in raw["bounds"][name]:  # (every rank's: round, batch, its seconds)
            assert sorted((r, k) for r, k, _ in rows) == [(0, 1), (0, 2), (1, 1), (1, 2)]
            assert all(s > 0 for _, _, s in rows)
    got = bench.stepwise_bounds(cfg, 2, choice, raw, 2)
    for k, bounds in enumerate(got):
        per_rank = [{name: [s for r, _, s in sorted(raw["bounds"][name][rank]) if r == k] for name in choice["shares"]}
                    for rank in range(2)]
        chosen = [max(per_rank[0]["chosen"][b], per_rank[1]["chosen"][b]) for b in range(2)]
        tokens = bench._steady_tokens(cfg, 2)
        assert bounds["partition"]["tokens_per_s"] == pytest.approx(tokens / sum(chosen))
        assert bounds["even"]["tokens_per_s"] == pytest.approx(
            tokens / (sum(per_rank[0]["chosen"]) + sum(per_rank[1]["chosen"])) * 2)
        assert bounds["partition"]["best"] == {"measured": 2}
    # and bench odc times them there: no job of their own after the variants'
    seen = []

    def recording(cfgs, **kw):
        seen.append(kw.get("shares"))
        return stepwise_rounds(cfgs, **kw)

    monkeypatch.setattr(bench, "stepwise_rounds", recording)
    monkeypatch.setattr(bench, "measure_bounds", lambda *a: pytest.fail("the bounds ran in a job of their own"))
    monkeypatch.setattr(bench, "choose_bounds", lambda c, n: choice)
    got = bench.bench_odc(cfg, world_size=2, repeats=1, log=lambda *a, **k: None)
    assert seen == [choice["shares"]]
    assert got["rounds"][0]["partition"]["best"] == {"measured": 2} and got["rounds"][0]["even"]["tokens_per_s"] > 0


def test_bench_lora_counts_what_the_adapters_save(cli, tmp_path):
    """Exact counts: AdamW's state is two moments of the adapters' elements; flat ODC pushes only
    the adapters' gradients and gathers the frozen base as before."""
    out = tmp_path / "l.json"
    rc, printed, err = cli("bench", "lora", "--dim", "64", "--layers", "2", "--rank", "2", "--steps", "2", "--rounds",
                           "1", "--json", str(out))
    assert rc == 0, err
    rows = {(r["engine"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    # llama 2x64: 2 heads of 32, 1 KV head; rank 2: A is 2 x in, B is out x 2
    per_layer = sum(2 * 64 + out_dim * 2 for out_dim in (64, 32, 32, 64))  # q, k, v, o
    assert rows[("fsdp", "lora")]["optimizer_state_numel"] == 2 * 2 * per_layer
    assert 2 * 2 * per_layer <= rows[("odc", "lora")]["optimizer_state_numel"] <= 2 * 2 * per_layer + 8  # padding
    for dp in ("odc", "fsdp"):
        assert rows[(dp, "lora")]["optimizer_state_numel"] < rows[(dp, "full")]["optimizer_state_numel"] / 20
    odc_full, odc_lora = rows[("odc", "full")], rows[("odc", "lora")]
    assert 0 < odc_lora["push_bytes_per_step"] < odc_full["push_bytes_per_step"] / 20
    assert 1.0 <= odc_lora["gather_bytes_per_step"] / odc_full["gather_bytes_per_step"] < 1.2
    assert "LoRA rank 2 on q_proj,k_proj,v_proj,o_proj vs full fine-tuning" in printed
    rc, _, err = cli("bench", "lora", "--steps", "1")
    assert rc == 2 and "--steps=1 must be at least 2" in err


@pytest.mark.slow
def test_bench_rl_e2e_times_whole_grpo_steps_beside_trl(run_cli, cli, tmp_path):
    """Whole GRPO steps by stopwatch with the phases beside them, for posttrain's sampler and
    ``generate``, batched and per prompt, and two engines, and TRL's GRPOTrainer on the same model,
    prompts and reward, all taking turns a step at a time in long-lived processes; every step rate
    set against posttrain's batched flat-ODC run, with an interval over rounds."""
    out = tmp_path / "e2e.json"
    proc = run_cli("bench", "rl-e2e", "--settings", "readme", "--sft-steps", "5", "--steps", "2", "--warmup", "1",
                   "--rounds", "2", "--trl", "1x2", "--work-dir", str(tmp_path / "w"), "--json", str(out),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())["settings"]["readme"]
    names = set(got["step_s"])
    assert names == {"odc+diff_micro (batched)", "odc+diff_micro (batched, generate)",
                     "odc+diff_micro (per prompt, generate)", "fsdp+same_micro (batched)",
                     "odc+diff_micro (batched, every group)", "trl (1 process, 2 threads)"}
    # every posttrain variant counts its equal-reward groups; the every-group one is set against TRL too
    assert set(got["equal_groups"]) == names - {"trl (1 process, 2 threads)"}
    assert all(0 <= v <= 8 for v in got["equal_groups"].values())
    lo, hi = got["rate_over_trl_every_group"][1:]
    assert lo <= got["rate_over_trl_every_group"][0] <= hi
    assert got["trl"] == "trl (1 process, 2 threads)"
    assert got["rate_over"]["odc+diff_micro (batched)"] == [1.0, 1.0, 1.0]
    for name, (ratio, lo, hi) in got["rate_over"].items():  # the interval holds the ratio; the rounds bound both
        low, high = got["round_range"][name]  # (the same ratios computed two ways: equal to the last bit or so)
        assert lo <= ratio <= hi and low * (1 - 1e-12) <= lo and hi <= high * (1 + 1e-12), name
    # the rate is the step seconds' ratio: TRL's summed seconds over posttrain's
    trl_rate = got["step_s"]["trl (1 process, 2 threads)"] / got["step_s"]["odc+diff_micro (batched)"]
    assert got["rate_over"]["trl (1 process, 2 threads)"][0] == pytest.approx(trl_rate, rel=1e-9)
    assert all(v > 0 for v in got["step_s"].values())
    for name, ph in got["phases"].items():  # posttrain's phases fit inside its step, and its stopwatch holds
        assert ph["rollout_s"] > 0  # its own step alone (not the other variants' turns since its previous one)
        assert ph["rollout_s"] + ph["update_s"] + ph["reference_s"] <= got["step_s"][name] * 1.05, (name, ph)
        assert ph["other_s"] < 0.5 * got["step_s"][name], (name, ph)
    lines = proc.stdout.splitlines()
    assert any(ln.strip().startswith("trl (1 process, 2 threads)") for ln in lines)
    assert any("round 2/2:" in ln for ln in lines)
    assert any("against TRL's faster launch" in ln for ln in lines)
    for args, says in ((("--settings", "huge"), "settings=huge: choose from readme, long"),
                       (("--trl", "2x1,2x1"), "one or more different launches"),
                       (("--trl", "2"), "trl=2: each launch is PROCESSESxTHREADS"),
                       (("--trl", "3x1"), "3 processes cannot share the 64 completions")):
        rc, _, err = cli("bench", "rl-e2e", *args)  # (refused before any work: in this process)
        assert rc == 2 and says in err, (args, err)


def test_bench_odc_with_context_parallel_runs_odc_cp_beside_odc(cli_proc, tmp_path):
    out = tmp_path / "b.json"
    proc = cli_proc("bench", "odc", "--steps", "2", "--sequences", "2", "--max-len", "64", "--dim", "32",
                   "--layers", "1", "--repeats", "1", "--context-parallel", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert "odc+cp" in got["median"] and got["median"]["odc+cp"]["tokens_per_s"] > 0
    m, lo, hi = got["factors"]["cp"]
    assert lo <= m <= hi
    r = got["rounds"][0]
    assert m == pytest.approx(r["odc+cp"]["tokens_per_s"] / r["odc+diff_micro"]["tokens_per_s"])
    assert "split sequences: odc+cp / odc+diff_micro" in proc.stdout
    # what each leaves to the even bound, split into factors whose product is exact per round
    assert "against the even bound" in proc.stdout
    for name in ("odc+diff_micro", "odc+cp"):
        e = got["vs_even"][name]
        assert e["vs_even"][0] == pytest.approx(r[name]["tokens_per_s"] / r["even"]["tokens_per_s"])
        assert e["vs_even"][0] == pytest.approx(e["work"][0] * e["balance"][0] * e["critical"][0])
        assert 0 < e["balance"][0] <= 1 and 0 < e["critical"][0] <= 1
        assert 0 < e["planned"]["balance"] <= 1
    assert got["vs_even"]["odc+cp"]["planned"]["work"] <= 1  # (a split pays the exchange)
    # the calibrated prediction needs more microbatch shapes than this run has: said, and the
    # measurements are written all the same
    assert "cp: no prediction (calibration needs 3 or more microbatches" in proc.stdout
    assert "calibration needs" in got["predicted_cp"]["error"]
    bad = cli_proc("bench", "odc", "--context-parallel", "2", "--sweep")
    assert bad.returncode != 0 and "not part of the sweep yet" in bad.stderr


def test_results_calls_a_commit_dirty_only_for_changes_it_did_not_write():
    from posttrain.lab.results import _dirty

    assert not _dirty([" M README.md", " M docs/results.md", " M docs/rl_reward.png"])
    assert _dirty([" M README.md", " M src/posttrain/train/sft/loop.py"])
    assert _dirty(["R  docs/a.md -> src/b.py"])
    assert not _dirty([])


def _steps_then_finishes(go, done, *args):
    while go.recv() == "step":
        done.send(0.125)


def _dies_while_the_other_fails(go, done, *args):
    go.recv()
    if os.environ["RANK"] == "1":
        os._exit(4)
    time.sleep(0.3)  # (as a TRL process whose peer vanished from its group reports a while later)
    raise RuntimeError("connection closed by peer")


def _one_step_then_exit(go, done, *args):
    go.recv()
    done.send(0.25)
    go.recv()
    os._exit(3)


def _fails(go, done, *args):
    go.recv()
    raise ValueError("no model at /nowhere")


def _steps_forever(go, done, *args):
    while True:
        go.recv()
        done.send(0.5)


def _second_exits(go, done, *args):
    while True:
        go.recv()
        if os.environ["RANK"] == "1":
            os._exit(4)
        done.send(float(os.environ["WORLD_SIZE"]))


def test_trl_turns_report_a_dead_or_failing_trl_process_in_one_line(monkeypatch):
    """The TRL processes of ``bench rl-e2e``'s turns: a step's seconds come back; a process that
    died or raised is one error naming it; closing the posttrain side ends a process that waits."""
    from posttrain.lab.bench import rl_e2e

    def turns(fn, processes=1):
        monkeypatch.setattr(rl_e2e, "_trl_turns", fn)  # (the fork inherits it)
        return rl_e2e.TRLTurns(processes, 2, "model", "prompts.jsonl", rl_e2e.SETTINGS["readme"], 10, "/tmp", 1)

    def refused(t, match: str, steps: int = 0, call: str = "step") -> None:  # (then closed, whatever happened)
        try:
            for _ in range(steps):
                assert t.step() == 0.25
            with pytest.raises(RuntimeError, match=match):
                getattr(t, call)()
        finally:
            t.close()

    t = turns(_one_step_then_exit)
    refused(t, r"^trl \(1 process, 2 threads\): its process 0 ended \(exit code 3\)", steps=1)
    assert t.procs[0].exitcode == 3
    refused(turns(_fails), r"(?s)trl \(1 process, 2 threads\) failed in its process 0:.*no model at /nowhere")
    t = turns(_steps_forever)
    assert t.step() == 0.5 and t.step() == 0.5
    began = time.perf_counter()
    t.close()  # (the pipe's end shows in the process: it exits without being killed)
    assert t.procs[0].exitcode == 1 and time.perf_counter() - began < 20
    # (its processes see the group's environment)
    refused(turns(_second_exits, processes=2),
            r"^trl \(2 processes, 2 threads each\): its process 1 ended \(exit code 4\)")
    # the process that died is named, not its peer's failure
    refused(turns(_dies_while_the_other_fails, processes=2), r"its process 1 ended \(exit code 4\)")
    t = turns(_steps_then_finishes, processes=2)  # told to finish after its steps, it ends cleanly
    assert t.step() == 0.125 and t.step() == 0.125
    t.finish()
    t.close()
    assert [p.exitcode for p in t.procs] == [0, 0]
    # one that ended otherwise is an error at the end
    refused(turns(_one_step_then_exit), r"its process 0 did not end cleanly after its last step \(exit code 3\)",
            steps=1, call="finish")
    # a second launch alive beside the first does not hold the first's pipes open: closing the
    # first ends its process by the pipe's end, not by a kill
    a, b = turns(_steps_forever), turns(_steps_forever)
    began = time.perf_counter()
    a.close()
    assert a.procs[0].exitcode == 1 and time.perf_counter() - began < 20
    b.close()


def test_the_turns_order_is_drawn_afresh_so_every_variant_follows_every_other():
    from posttrain.lab.bench.rl_e2e import turn_order

    names = [f"v{i}" for i in range(6)]
    orders = [turn_order(names, step) for step in range(2, 62)]
    assert all(sorted(o) == names for o in orders)
    assert turn_order(names, 7) == turn_order(names, 7)  # (seeded: the same run, the same order)
    follows = {(o[i], o[i + 1]) for o in orders for i in range(len(o) - 1)}
    assert follows == {(a, b) for a in names for b in names if a != b}
