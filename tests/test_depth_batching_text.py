"""bench/depth_batching_text.py: its judges on constructed per-window NLLs (a rule within the tolerance, a
pooled tie hiding a bucket that gets worse, a rule worse everywhere), the timed calls' generated tokens
against the decoder's in float64, and the benchmark end to end on a tiny run of the real wiki corpus."""

from __future__ import annotations

import json
from argparse import Namespace

import numpy as np
import pytest
import torch

from bench.depth_batching_text import buckets_of, judge, main, meets, paired, select, split_shares
from bench.depth_timing import engine_call, lockstep_call

ARGS = Namespace(tolerance=0.01, per_bucket=0.02, full_loops=3, policies="step_norm_rel", splits=40, seed=0)
WINDOWS = 400
# Per window a full-budget NLL from 2 to 6 nats (distinct: the quartile buckets hold 100 windows each)
BASE = np.linspace(2.0, 6.0, WINDOWS)
BUCKETS = buckets_of(BASE, 4)


def qualities(rules: dict) -> dict:
    """Fixed 1 far worse; fixed 2 (F) 0.5% above the full budget fixed 3; ``rules``: label -> (steps, nll)."""
    table = {"fixed 1": (1.0, BASE * 1.2), "fixed 2": (2.0, BASE * 1.005), "fixed 3": (3.0, BASE), **rules}
    return {label: {"steps": np.full(WINDOWS, steps), "nll": nll} for label, (steps, nll) in table.items()}


def test_buckets_are_quartiles_of_the_full_budget_nll_and_paired_differences_are_exact():
    assert np.bincount(BUCKETS).tolist() == [100, 100, 100, 100]
    assert (np.diff(BUCKETS) >= 0).all()  # a higher NLL never in a lower bucket
    diff, error = paired(np.array([1.0, 2.0, 3.0]), np.array([0.0, 2.0, 2.0]))
    assert diff == pytest.approx(2 / 3) and error == pytest.approx(np.std([1, 0, 1], ddof=1) / np.sqrt(3))


def test_the_cheapest_setting_within_tolerance_and_a_pooled_tie_that_hides_a_worse_bucket():
    f = BASE * 1.005
    hiding = f.copy()
    hiding[BUCKETS == 3] *= 1.04  # the hardest quarter 4% worse ...
    hiding[BUCKETS == 0] *= 0.9  # ... paid for by the easiest: pooled no worse than F
    q = qualities({"step_norm_rel 0.5": (1.2, hiding), "step_norm_rel 0.3": (1.5, f * 1.008),
                   "step_norm_rel 0.1": (1.9, f)})
    rows = np.arange(WINDOWS)
    nll = {label: v["nll"] for label, v in q.items()}
    assert paired(nll["step_norm_rel 0.5"], f)[0] < 0
    assert not meets(nll, "step_norm_rel 0.5", "fixed 2", rows, BUCKETS, ARGS)
    assert meets(nll, "step_norm_rel 0.3", "fixed 2", rows, BUCKETS, ARGS)
    choice = select(q, BUCKETS, rows, ARGS)
    assert choice["fixed"] == "fixed 2"  # within 1% of the full budget; fixed 1 (20% above) is not
    assert choice["chosen"]["step_norm_rel plain"] == "step_norm_rel 0.3"
    judged = judge(q, BUCKETS, rows, choice, ARGS)["step_norm_rel plain"]
    assert judged["meets"] and judged["relative_diff"] == pytest.approx(0.008)
    assert all(v["relative_diff"] == pytest.approx(0.008) for v in judged["by_bucket"].values())
    assert split_shares(q, BUCKETS, ARGS)["step_norm_rel plain"] == 1.0
    # judged on half B alone the tie still fails: the bar is per bucket, not only pooled
    rows_b = np.arange(1, WINDOWS, 2)
    assert not meets(nll, "step_norm_rel 0.5", "fixed 2", rows_b, BUCKETS, ARGS)


def test_a_rule_worse_everywhere_is_never_chosen_and_a_margin_is_stricter():
    q = qualities({"step_norm_rel 0.5": (1.2, BASE * 1.005 * 1.03)})  # 3% above F in every window
    choice = select(q, BUCKETS, np.arange(WINDOWS), ARGS)
    assert choice["chosen"]["step_norm_rel plain"] is None
    assert judge(q, BUCKETS, np.arange(WINDOWS), choice, ARGS)["step_norm_rel plain"] is None
    shares = split_shares(q, BUCKETS, ARGS)
    assert shares["step_norm_rel plain"] == 0.0
    assert shares["full budget (reference)"] == 1.0  # the full budget is below F everywhere
    # 0.9% above F on average, noisy per window: within the tolerance, not with one standard error of margin
    noisy = BASE * 1.005 * (1.009 + 0.05 * np.where(np.arange(WINDOWS) % 2 == 0, 1, -1))
    nll = {"fixed 2": BASE * 1.005, "rule": noisy}
    rows = np.arange(WINDOWS)
    diff, error = paired(noisy, nll["fixed 2"])
    assert diff < 0.01 * nll["fixed 2"].mean() < diff + error
    loose = Namespace(**{**vars(ARGS), "per_bucket": 0.5})
    assert meets(nll, "rule", "fixed 2", rows, BUCKETS, loose)
    assert not meets(nll, "rule", "fixed 2", rows, BUCKETS, loose, margin=1.0)
    # per bucket: 0.9% above F is within a 1.2% bar, not once two of the bucket's own standard errors are added
    bucket_bar = Namespace(**{**vars(ARGS), "tolerance": 0.5, "per_bucket": 0.012})
    assert meets(nll, "rule", "fixed 2", rows, BUCKETS, bucket_bar)
    assert not meets(nll, "rule", "fixed 2", rows, BUCKETS, bucket_bar, bucket_margin=2.0)
    assert meets(nll, "fixed 2", "fixed 2", rows, BUCKETS, bucket_bar, margin=2.0, bucket_margin=2.0)


def test_f_is_the_full_budget_when_no_cheaper_budget_is_within_tolerance():
    q = qualities({})
    q["fixed 2"]["nll"] = BASE * 1.02
    assert select(q, BUCKETS, np.arange(WINDOWS), ARGS)["fixed"] == "fixed 3"


def test_timed_calls_generate_what_the_decoder_generates_in_float64():
    """The engine's and the lock-step batches' greedy tokens (depth_timing's calls) equal Decoder.generate's
    for every request, at a fixed budget and under a rule, with rows keyed by their own ids."""
    from conftest import tiny_model

    from rdepth.exits.controller import controller_factory
    from rdepth.model.decoder import Decoder
    from rdepth.model.noise import StateNoise

    model = tiny_model()
    prompts = torch.randint(0, 50, (5, 6), generator=torch.Generator().manual_seed(1)).numpy()
    ids = np.array([7, 3, 11, 0, 5])
    budgets = [{"loop_counts": (2, 3)},
               {"controller_factory": controller_factory("step_norm_rel", 0.3, 4, lambda: model.readout)}]
    for budget in budgets:
        expect = Decoder(model, 5, noise=StateNoise(0, ids.tolist()), **budget).generate(torch.from_numpy(prompts), 4)
        expect = expect[:, 6:].tolist()
        for make in (engine_call, lockstep_call):
            call, record = make(model, prompts, ids, 2, budget, 0, new_tokens=4)
            call()
            assert [record["tokens"][k] for k in range(5)] == expect, (make.__name__, budget)
            assert record["positions"] == 5 * (6 + 4 - 1)
            assert len(record["latency"]) == 5
        if "loop_counts" in budget:
            assert record["steps"] == record["paid"] == 5.0


def test_end_to_end_on_a_tiny_wiki_run(tiny_text_run, wiki_small, tmp_path, capsys):
    from rdepth.run.evaluate import evaluate
    from rdepth.run.heldout import held_out_windows
    from rdepth.run.opened import open_run

    out = tmp_path / "bench.json"
    assert main(["--run", str(tiny_text_run), "--data", str(wiki_small), "--windows", "16", "--window-tokens", "12",
                 "--prompt-tokens", "6", "--new-tokens", "3", "--full-loops", "3", "--widths", "1,4",
                 "--min-requests", "2", "--rounds", "1", "--warmup", "0", "--splits", "10", "--ticks", "eager,static",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "torch" in printed and "revision" in printed
    report = json.loads(out.read_text())
    assert report["windows"] == 16 and report["groups"] == 2 and sum(report["bucket_sizes"].values()) == 16
    quality = report["quality"]
    assert len(quality) == 3 + 7 + 6  # fixed 1..3, step_norm_rel and kl grids
    assert [quality[f"fixed {k}"]["steps"] for k in (1, 2, 3)] == [2.0, 4.0, 6.0]  # k steps in each of 2 groups
    # the per-window NLLs average to the one evaluation loop's cross-entropy on the same windows and states
    run = open_run(tiny_text_run, wiki_small, "cpu")
    windows = held_out_windows(run.tokens, 12, 16)
    assert quality["fixed 3"]["nll"] == pytest.approx(evaluate(run.model, windows, loop_counts=(3, 3))["ce"], rel=1e-5)
    for width, count in (("B=1", 4), ("B=4", 8)):  # 4B requests, at most half B
        timed = report["timing"][width]
        assert timed["requests"] == count and timed["positions"] == count * (6 + 3 - 1)
        assert set(timed["engine_positions"].values()) == {timed["positions"]}
        fixed = report["choice"]["fixed"]
        assert timed["rows"][f"engine | {fixed}"]["vs_engine_fixed"] == 1.0
        assert f"engine static | {fixed}" in timed["rows"]  # the static tick on two looped groups, same positions
        assert timed["engine_vs_lockstep_tokens"][fixed]["tokens"] >= 0.9


def test_bad_input_is_one_line(tiny_text_run, wiki_small, tmp_path, capsys):
    from rdepth.cli.main import run_command

    def errors(argv):
        capsys.readouterr()
        try:
            code = run_command("bench/depth_batching_text.py", lambda: main(argv))
        except SystemExit as exc:  # the parser's one line
            code = exc.code
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        return code, lines

    base = ["--run", str(tiny_text_run), "--data", str(wiki_small)]
    cases = [(["--run", str(tmp_path / "nope"), "--data", str(wiki_small)], "nope"),
             ([*base[:3], str(tmp_path / "nodata")], "nodata"),
             ([*base, "--policies", "entropy"], "no grid for entropy"),
             ([*base, "--widths", "a"], "--widths"),
             ([*base, "--rounds", "0"], "--rounds must be >= 1"),
             ([*base, "--prompt-tokens", "100", "--window-tokens", "64"], "--prompt-tokens"),
             ([*base, "--window-tokens", "64", "--json", str(tmp_path / "out.json")], "context")]  # the tiny run's context is 32
    for argv, words in cases:
        code, lines = errors(argv)
        assert code == 2 and len(lines) == 1 and "error" in lines[0] and words in lines[0], (argv, lines)
    assert not (tmp_path / "out.json").exists()
