"""Evaluation with exits, the sweep's saved summary, and ``rdepth sweep`` end to end on a tiny model."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rdepth.cli.main import main
from rdepth.config import get_preset
from rdepth.data.tokenizers import train_bpe
from rdepth.errors import RdepthError
from rdepth.exitrun.evaluate import evaluate_with_exits
from rdepth.exits.controller import controller_factory
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import save_checkpoint
from rdepth.run.evaluate import evaluate
from rdepth.run.heldout import held_out_windows
from rdepth.sweep.config import SweepConfig
from rdepth.sweep.plots import save_sweep_figures
from rdepth.sweep.report import write_report_section
from rdepth.sweep.run import run_sweep
from rdepth.sweep.summary import load_sweep, matched_quality, summarize

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent

TEXT = (
    "A looped block refines each token with small steps and then hands it on. "
    "Some tokens settle quickly, others keep turning for a while before they stop. "
) * 30


@pytest.fixture(scope="module")
def tiny_model() -> RecurrentLM:
    torch.manual_seed(0)
    config = get_preset("tiny", n_layer=4, d_model=32, n_head=2, block_size=16, vocab_size=50, groups="1|2")
    return RecurrentLM(config).eval()


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    """Six held-out windows [6, 17] cut by the run layer's one window maker."""
    tokens = np.random.default_rng(0).integers(0, 50, size=16 * 6 + 1)
    return held_out_windows(tokens, 16)


def test_fixed_controller_evaluation_equals_the_dense_budget(tiny_model, windows):
    dense = evaluate_with_exits(tiny_model, windows, loop_counts=[3, 2], batch_size=4)
    packed = evaluate_with_exits(tiny_model, windows, controller=controller_factory("fixed", None, [3, 2])(),
                                 batch_size=4)
    assert packed.ce == pytest.approx(dense.ce, rel=1e-5)
    assert dense.tokens == packed.tokens == 6 * 16
    assert packed.mean_steps == [3.0, 2.0] and dense.mean_used == [3.0, 2.0]
    assert packed.computed_histogram == [[0, 0, 0, 96], [0, 0, 96]]


def test_histograms_and_means_agree_with_the_model_outputs(tiny_model, windows):
    factory = lambda: controller_factory("step_norm", 0.6, 6)()  # noqa: E731
    result = evaluate_with_exits(tiny_model, windows, controller=factory, batch_size=3, seed=4)
    computed, used, losses = [[], []], [[], []], []
    for first in (0, 3):
        batch = windows[first:first + 3]
        noise = StateNoise.consecutive(4, first, 3)  # window i starts from the run layer's noise row i
        with torch.no_grad():
            out = tiny_model(batch[:, :-1], batch[:, 1:], controller=factory(), noise=noise)
        losses.append(out.loss.item())
        for group in range(2):
            computed[group].append(out.computed[group].flatten())
            used[group].append(out.used[group].flatten())
    assert result.ce == pytest.approx(sum(losses) / 2, rel=1e-6)
    for group in range(2):
        steps = torch.cat(computed[group])
        assert steps.min() > 0 and steps.max() <= 6 and steps.min() < steps.max()  # exits really vary
        assert result.computed_histogram[group] == torch.bincount(steps, minlength=7).tolist()
        assert result.used_histogram[group] == torch.bincount(torch.cat(used[group]), minlength=7).tolist()
        assert result.mean_steps[group] == pytest.approx(steps.double().mean().item())
    assert sum(result.used_histogram[0]) == result.tokens


def test_evaluate_needs_exactly_one_mode(tiny_model, windows):
    with pytest.raises(RdepthError, match="exactly one"):
        evaluate_with_exits(tiny_model, windows)


def test_sweep_fixed_budgets_equal_the_run_layer_evaluation(tiny_model, windows):
    """Window i's noise comes from the run layer: the sweep's fixed budgets are ``rdepth eval``'s numbers."""
    config = SweepConfig(policies=("step_norm",), taus=(0.6,), k_max=(3, 2), batch_size=4, timing=False, seed=7)
    result = run_sweep(tiny_model, windows, config)
    entries = [result["reference"], *result["fixed_ladder"], result["points"][0]["baseline"]]
    assert [e["budget"] for e in result["fixed_ladder"]] == [[1, 1], [2, 2], [3, 2]]
    for entry in entries:
        same_batches = evaluate(tiny_model, windows, loop_counts=entry["budget"], batch_size=4, seed=7)
        assert entry["ce"] == same_batches["ce"] and entry["tokens"] == same_batches["tokens"] == 96
        other_batches = evaluate(tiny_model, windows, loop_counts=entry["budget"], batch_size=5, seed=7)
        assert entry["ce"] == pytest.approx(other_batches["ce"], rel=1e-6)
    assert result["config"]["windows"] == 6 and result["config"]["block_size"] == 16
    summary = result["summary"]
    assert summary["timings"] == [] and summary["latency_key"] is None
    assert summary["headline_ranking"] == summary["report_ranking"] == "steps"
    assert summary["matched_quality"]["steps"] == matched_quality(result, config.tolerance, "steps")


def test_sweep_config_validation():
    with pytest.raises(RdepthError, match="unknown exit policy"):
        SweepConfig(policies=("nope",))
    with pytest.raises(RdepthError, match="baseline"):
        SweepConfig(policies=("fixed",))
    with pytest.raises(RdepthError, match="taus"):
        SweepConfig(taus=(0.0,))
    with pytest.raises(RdepthError, match="autocast"):
        SweepConfig(autocast="fp8")
    with pytest.raises(RdepthError, match="device"):
        SweepConfig(device="tpu")
    with pytest.raises(RdepthError, match="tolerance"):
        SweepConfig(tolerance=-0.1)
    assert "fixed" not in SweepConfig().policies and "acceleration" in SweepConfig().policies
    assert SweepConfig().values("argmax_stable") == (1, 2, 3)
    assert SweepConfig(grid={"kl": (1e-6,)}).values("kl") == (1e-6,)
    assert SweepConfig(batch_size=4, max_batches=3).max_windows == 12
    assert SweepConfig(k_max=(5,)).resolve_k_max(2, (4, 4)) == (5, 5)
    assert SweepConfig().resolve_k_max(2, (4, 3)) == (8, 6)


def test_sweep_config_and_cli_import_without_torch():
    """``rdepth --help`` stays fast: the sweep's settings and flags need no torch."""
    code = "import sys, rdepth.cli.sweep, rdepth.exits.config, rdepth.sweep.summary; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_exit_profile_is_one_more_point_equal_to_its_policy(tiny_model, windows, tmp_path):
    """A profile with one shared value measures what the policy at that value measures; per-group
    values are saved with the point and named in the summary."""
    from rdepth.exitrun.profile import make_profile
    from rdepth.io import write_json

    shared = tmp_path / "shared.json"
    write_json(shared, make_profile("step_norm", [0.6, 0.6], (3, 2), {}))
    config = SweepConfig(policies=("step_norm",), taus=(0.6,), k_max=(3, 2), batch_size=4, timing=False, seed=7,
                         fixed_ladder=False, exit_profile=str(shared))
    result = run_sweep(tiny_model, windows, config)
    policy, profile = result["points"]
    assert profile["policy"] == "profile" and profile["values"] == [0.6, 0.6]
    for key in ("ce", "mean_steps", "tokens"):
        assert profile[key] == policy[key]
    per_group = tmp_path / "per_group.json"
    write_json(per_group, make_profile("step_norm", [0.6, 100.0], (3, 2), {}))
    result = run_sweep(tiny_model, windows, SweepConfig(
        policies=("step_norm",), taus=(0.6,), k_max=(3, 2), batch_size=4, timing=False, seed=7,
        fixed_ladder=False, exit_profile=str(per_group), tolerance=10.0))
    profile = result["points"][1]
    assert profile["mean_steps"][0] == result["points"][0]["mean_steps"][0] and profile["mean_steps"][1] == 1.0
    rows = {row["policy"]: row for row in result["summary"]["matched_quality"]["steps"]}
    assert rows["profile"]["values"] == [0.6, 100.0]
    with pytest.raises(RdepthError, match="group value"):
        run_sweep(tiny_model, windows, SweepConfig(policies=("step_norm",), taus=(0.6,), k_max=(3, 2), timing=False,
                                                   exit_profile=str(tmp_path / "one.json"))
                  if write_json(tmp_path / "one.json", make_profile("step_norm", [0.6], (3,), {})) is None else None)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    run = root / "run"
    tokenizer = train_bpe([TEXT], 300)
    tokenizer.save(run / "tokenizer")
    config = get_preset("tiny", n_layer=4, n_head=2, d_model=32, block_size=24, vocab_size=tokenizer.vocab_size,
                        groups="1|2", mean_loops=3.0, tokenizer="bpe:300")
    torch.manual_seed(0)
    save_checkpoint(run, 5, RecurrentLM(config), config)
    text = root / "held_out.txt"
    text.write_text(TEXT)
    return run, text


@pytest.fixture(scope="module")
def swept(tiny_run, tmp_path_factory) -> Path:
    """``rdepth sweep`` run once with every kind of measurement; its output folder."""
    run, text = tiny_run
    out = tmp_path_factory.mktemp("swept") / "out"
    code = main([
        "sweep", "--checkpoint", str(run), "--data", str(text), "--out", str(out),
        "--policies", "acceleration,kl,argmax_stable", "--taus", "1e-1",
        "--grid", "argmax_stable=2", "--grid", "kl=1e-3,1e-1", "--k-max", "4", "--batch-size", "2",
        "--max-batches", "2",
        "--timing-batch-size", "2", "--warmup", "0", "--repeats", "1", "--device", "cpu",
        "--generate-tokens", "3", "--generate-prompt", "4", "--no-progress",
    ])
    assert code == 0
    return out


def test_sweep_cli_writes_numbers_figures_and_report(swept):
    out = swept
    result = json.loads((out / "sweep.json").read_text())
    assert result["k_max"] == [4, 4]
    assert result["config"]["grid"] == result["config"]["grids"] == {"argmax_stable": [2], "kl": [1e-3, 1e-1]}
    assert [(p["policy"], p["value"]) for p in result["points"]] == [
        ("acceleration", 1e-1), ("kl", 1e-3), ("kl", 1e-1), ("argmax_stable", 2),
    ]
    reference = result["reference"]
    assert reference["budget"] == [4, 4] and reference["mean_steps"] == [4.0, 4.0]
    assert reference["tokens"] == 4 * 24
    assert len(result["fixed_ladder"]) == 4
    for point in result["points"]:
        assert point["ms_per_token_b1"] > 0 and point["ms_per_token_batched"] > 0
        assert point["ms_per_token_generate"] > 0
        assert all(1 <= m <= 4 for m in point["mean_steps"])
        assert sum(point["computed_histogram"][0]) == point["tokens"] == reference["tokens"]
        assert point["baseline"]["budget"] == [max(1, round(m)) for m in point["mean_steps"]]
        assert point["ppl"] == pytest.approx(np.exp(point["ce"]))
        assert point["steps"] == pytest.approx(sum(point["mean_steps"]))
    with open(out / "sweep.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4 + 1 + 4 and rows[4]["policy"] == "fixed_full"
    for name in ("figure4.png", "pareto.png", "exit_histograms.png"):
        assert (out / "figures" / name).stat().st_size > 1000
    page = (out / "index.html").read_text()
    assert "Early exit" in page and "figures/pareto.png" in page and "within 1%" in page


def test_saved_summary_holds_every_headline_number(swept):
    result = load_sweep(swept)
    summary = result["summary"]
    assert summary == json.loads(json.dumps(summarize(result, 0.01)))  # computed once, saved as computed
    assert summary["timings"] == ["b1", "batched", "generate"]
    assert summary["headline_ranking"] == "b1" and summary["report_ranking"] == "generate"
    assert summary["latency_key"] == "ms_per_token_generate"
    assert summary["ppl_limit"] == pytest.approx(1.01 * result["reference"]["ppl"])
    assert summary["full_steps"] == 8
    assert set(summary["matched_quality"]) == {"steps", "b1", "batched", "generate"}
    rows = summary["matched_quality"]["b1"]
    assert [r["policy"] for r in rows] == ["acceleration", "kl", "argmax_stable"]
    assert rows == json.loads(json.dumps(matched_quality(result, 0.01, "b1")))
    if summary["best"] is not None:
        assert summary["best"] in rows


def test_saved_timings_name_their_path_and_spread(swept):
    """Policies and fixed budgets are timed on the packed path; fixed budgets also on the dense one;
    every latency has its IQR and per-round samples."""
    result = load_sweep(swept)
    repeats = result["config"]["repeats"]
    fixed = [result["reference"], *result["fixed_ladder"], *(p["baseline"] for p in result["points"])]
    for entry in [*fixed, *result["points"]]:
        assert entry["timing_path"] == "packed"
        for key in ("ms_per_token_b1", "ms_per_token_batched", "ms_per_token_generate"):
            low, high = entry[f"{key}_iqr"]
            assert 0 < low <= entry[key] <= high and len(entry["timing_samples"][key]) == repeats
    for entry in fixed:
        assert entry["dense_ms_per_token_b1"] > 0 and entry["dense_ms_per_token_batched"] > 0
    assert not any("dense_ms_per_token_b1" in p for p in result["points"])
    summary = result["summary"]
    assert summary["timing_path"] == "packed" and summary["noise_threshold"] == 0.1
    assert set(summary["latency_definitions"]) == {
        "ms_per_token_b1", "ms_per_token_batched", "ms_per_token_generate", "dense_ms_per_token_b1",
        "dense_ms_per_token_batched",
    }
    budgets = [row["budget"] for row in summary["packed_over_dense"]]
    assert sorted(budgets) == sorted({tuple(e["budget"]): e["budget"] for e in fixed}.values())  # each once
    assert all(row["b1"]["ratio"] > 0 and "batched" in row for row in summary["packed_over_dense"])
    assert summary["noisy"] == bool(summary["noise_warnings"])
    assert summary["decode"] == {"mode": "head", "loops": None, "kl_direction": "new_old", "kl_prior": "none",
                                 "description": summary["decode"]["description"]}
    row = summary["matched_quality"]["b1"][0]
    for name in ("speedup_vs_full_b1", "speedup_vs_fixed_b1", "speedup_vs_dense_full_b1"):
        assert name in row and f"{name}_range" in row and f"{name}_noise" in row
    assert "speedup_vs_dense_full_generate" not in row  # generation has no dense path
    with open(swept / "sweep.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[4]["dense_ms_per_token_b1"]) > 0 and rows[0]["dense_ms_per_token_b1"] == ""
    page = (swept / "index.html").read_text()
    assert "teacher-forced ms/token" in page and "packed / dense time" in page


def test_report_and_plots_refuse_an_older_sweep_json(swept, tmp_path):
    old = json.loads((swept / "sweep.json").read_text())
    del old["summary"]
    (tmp_path / "sweep.json").write_text(json.dumps(old))
    with pytest.raises(RdepthError, match="older rdepth.*rerun rdepth sweep") as exc:
        load_sweep(tmp_path)
    assert "\n" not in str(exc.value)
    with pytest.raises(RdepthError, match="older rdepth"):
        write_report_section(old, tmp_path, {})
    with pytest.raises(RdepthError, match="older rdepth"):
        save_sweep_figures(old, tmp_path / "figures")
    assert not (tmp_path / "figures").exists() and not (tmp_path / "index.html").exists()


def _bench():
    spec = importlib.util.spec_from_file_location("exit_speed", ROOT / "bench" / "exit_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_reads_the_saved_summary_and_shares_the_sweep_flags(swept, tmp_path, capsys):
    bench = _bench()
    assert bench.main(["--from-sweep", str(swept / "sweep.json")]) == 0
    printed = capsys.readouterr().out
    assert "acceleration" in printed and "x full generate" in printed and "cheapest fixed budget" in printed
    assert "x dense b1" in printed and "packed / dense time for identical work" in printed
    old = json.loads((swept / "sweep.json").read_text())
    old["summary"]["format"] = 2
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert bench.main(["--from-sweep", str(tmp_path / "old.json")]) == 2
    assert "older rdepth" in capsys.readouterr().err
    # No copied defaults: the benchmark's flags build the same SweepConfig as rdepth sweep's.
    _, config = bench.parse_args(["--checkpoint", "c", "--data", "d", "--out", "o"])
    assert config == SweepConfig(checkpoint="c", data="d", out="o")


def test_sweep_cli_user_errors(tiny_run, tmp_path, capsys):
    run, text = tiny_run
    assert main(["sweep", "--checkpoint", str(run), "--data", str(text), "--out", str(tmp_path / "o"),
                 "--policies", "nope"]) == 2
    assert "unknown exit policy 'nope'" in capsys.readouterr().err
    assert main(["sweep", "--checkpoint", str(tmp_path / "missing"), "--data", str(text),
                 "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


def test_sweep_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sweep", "--help"])
    assert exc.value.code == 0
    assert "--checkpoint" in capsys.readouterr().out


def _fake_point(policy, value, ppl, steps, ms):
    entry = {"ppl": ppl, "mean_steps": steps, "ms_per_token_b1": ms}
    return {"policy": policy, "value": value, **entry,
            "baseline": {"budget": [round(s) for s in steps], **entry, "ppl": ppl * 1.05}}


def test_matched_quality_picks_the_fastest_point_within_tolerance():
    result = {
        "k_max": [8, 8],
        "reference": {"budget": [8, 8], "ppl": 100.0, "mean_steps": [8, 8], "ms_per_token_b1": 2.0},
        "fixed_ladder": [
            {"budget": [k, k], "ppl": 100.0 + 2 * (8 - k), "mean_steps": [k, k], "ms_per_token_b1": k / 4}
            for k in range(1, 9)
        ],
        "points": [
            _fake_point("acceleration", 1e-3, 100.5, [6, 6], 1.6),
            _fake_point("acceleration", 1e-2, 100.9, [4, 5], 1.0),  # fastest within 1%
            _fake_point("acceleration", 1e-1, 110.0, [2, 2], 0.5),  # too far
            _fake_point("kl", 1e-2, 101.5, [3, 3], 0.4),  # never within 1%
        ],
    }
    rows = {row["policy"]: row for row in matched_quality(result, tolerance=0.01)}
    accel = rows["acceleration"]
    assert accel["value"] == 1e-2 and accel["steps"] == 9 and accel["steps_saved"] == pytest.approx(1 - 9 / 16)
    assert accel["speedup_vs_full_b1"] == pytest.approx(2.0)
    # Cheapest fixed budget within 1%: (8, 8) only (the ladder loses 2 ppl per step removed).
    assert accel["matched_fixed_budget"] == [8, 8] and accel["speedup_vs_fixed_b1"] == pytest.approx(2.0)
    assert rows["kl"]["value"] is None
    assert rows["kl"]["matched_fixed_budget"] == [8, 8]
    by_steps = {row["policy"]: row for row in matched_quality(result, tolerance=0.01, ranking="steps")}
    assert by_steps["acceleration"]["value"] == 1e-2  # fewest steps within 1% as well
    with pytest.raises(RdepthError, match="ranking"):
        matched_quality(result, ranking="nope")
