"""Evaluation with exits and ``rdepth sweep`` end to end on a tiny model."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from rdepth.cli.main import main
from rdepth.config import get_preset
from rdepth.data.tokenizers import train_bpe
from rdepth.errors import RdepthError
from rdepth.exits import PolicyController
from rdepth.exits.evaluate import evaluate_with_exits
from rdepth.exits.sweep import SweepConfig, matched_quality
from rdepth.model import RecurrentLM
from rdepth.train.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

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
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 50, size=16 * 6 + 1)


def test_fixed_controller_evaluation_equals_the_dense_budget(tiny_model, tokens):
    dense = evaluate_with_exits(tiny_model, tokens, loop_counts=[3, 2], batch_size=4)
    packed = evaluate_with_exits(tiny_model, tokens, controller=PolicyController.from_name("fixed", k_max=[3, 2]),
                                 batch_size=4)
    assert packed.ce == pytest.approx(dense.ce, rel=1e-5)
    assert dense.tokens == packed.tokens == 6 * 16
    assert packed.mean_steps == [3.0, 2.0] and dense.mean_used == [3.0, 2.0]
    assert packed.computed_histogram == [[0, 0, 0, 96], [0, 0, 96]]


def test_histograms_and_means_agree_with_the_model_outputs(tiny_model, tokens):
    factory = lambda: PolicyController.from_name("step_norm", tau=0.6, k_max=6)  # noqa: E731
    result = evaluate_with_exits(tiny_model, tokens, controller=factory, batch_size=3, seed=4)
    generator = torch.Generator().manual_seed(4)
    computed = [[], []]
    for start in (0, 3):
        idx = torch.from_numpy(np.stack([tokens[(start + i) * 16:(start + i + 1) * 16] for i in range(3)]))
        with torch.no_grad():
            out = tiny_model(idx.long(), controller=factory(), generator=generator)
        for group in range(2):
            computed[group].append(out.computed[group].flatten())
    for group in range(2):
        steps = torch.cat(computed[group])
        assert result.computed_histogram[group] == torch.bincount(steps, minlength=7).tolist()
        assert result.mean_steps[group] == pytest.approx(steps.double().mean().item())
    assert sum(result.used_histogram[0]) == result.tokens


def test_evaluate_needs_exactly_one_mode(tiny_model, tokens):
    with pytest.raises(RdepthError, match="exactly one"):
        evaluate_with_exits(tiny_model, tokens)


def test_sweep_config_validation():
    with pytest.raises(RdepthError, match="unknown exit policy"):
        SweepConfig(policies=("nope",))
    with pytest.raises(RdepthError, match="baseline"):
        SweepConfig(policies=("fixed",))
    with pytest.raises(RdepthError, match="taus"):
        SweepConfig(taus=(0.0,))
    with pytest.raises(RdepthError, match="autocast"):
        SweepConfig(autocast="fp8")
    assert SweepConfig().grid("argmax_stable") == (1, 2, 3)
    assert SweepConfig(grids={"kl": (1e-6,)}).grid("kl") == (1e-6,)


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


def test_sweep_cli_writes_numbers_figures_and_report(tiny_run, tmp_path):
    run, text = tiny_run
    out = tmp_path / "out"
    code = main([
        "sweep", "--checkpoint", str(run), "--data", str(text), "--out", str(out),
        "--policies", "acceleration,kl,argmax_stable", "--taus", "1e-1",
        "--grid", "argmax_stable=2", "--grid", "kl=1e-3,1e-1", "--k-max", "4", "--batch-size", "2", "--max-batches", "2",
        "--timing-batch-size", "2", "--warmup", "0", "--repeats", "1", "--device", "cpu",
        "--generate-tokens", "3", "--generate-prompt", "4",
    ])
    assert code == 0
    result = json.loads((out / "sweep.json").read_text())
    assert result["k_max"] == [4, 4]
    assert [(p["policy"], p["value"]) for p in result["points"]] == [
        ("acceleration", 1e-1), ("kl", 1e-3), ("kl", 1e-1), ("argmax_stable", 2),
    ]
    reference = result["reference"]
    assert reference["budget"] == [4, 4] and reference["mean_steps"] == [4.0, 4.0]
    assert len(result["fixed_ladder"]) == 4
    for point in result["points"]:
        assert point["ms_per_token_b1"] > 0 and point["ms_per_token_batched"] > 0
        assert point["ms_per_token_generate"] > 0
        assert all(1 <= m <= 4 for m in point["mean_steps"])
        assert sum(point["computed_histogram"][0]) == point["tokens"] == reference["tokens"]
        assert point["baseline"]["budget"] == [max(1, round(m)) for m in point["mean_steps"]]
        assert point["ppl"] == pytest.approx(np.exp(point["ce"]))
    with open(out / "sweep.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4 + 1 + 4 and rows[4]["policy"] == "fixed_full"
    for name in ("figure4.png", "pareto.png", "exit_histograms.png"):
        assert (out / "figures" / name).stat().st_size > 1000
    page = (out / "index.html").read_text()
    assert "Early exit" in page and "figures/pareto.png" in page
    rows = matched_quality(result)
    assert [r["policy"] for r in rows] == ["acceleration", "kl", "argmax_stable"]


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
    with pytest.raises(RdepthError, match="timing"):
        matched_quality(result, timing="nope")
