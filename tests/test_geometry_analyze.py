"""``rdepth analyze`` end to end on a tiny model with two checkpoints."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from rdepth.cli.main import main
from rdepth.config import get_preset
from rdepth.data.tokenizers import train_bpe
from rdepth.errors import RdepthError
from rdepth.geometry import metrics
from rdepth.geometry.config import AnalyzeConfig
from rdepth.geometry.summary import FORMAT_VERSION, group_headline, load_summary
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise
from rdepth.run.checkpoint import load_model, save_checkpoint
from rdepth.run.evaluate import evaluate
from rdepth.run.heldout import held_out_windows, run_tokenizer

TEXT = (
    "The loop refines a token in small steps; the next block moves it further. "
    "Small steps, then a larger drift across blocks, again and again. "
) * 40


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A run folder with two checkpoints of a 4-layer, 3-group model and its tokenizer."""
    root = tmp_path_factory.mktemp("analyze")
    run = root / "run"
    tokenizer = train_bpe([TEXT], 300)
    tokenizer.save(run / "tokenizer")
    config = get_preset(
        "tiny", n_layer=5, n_head=2, d_model=32, block_size=24, vocab_size=tokenizer.vocab_size,
        groups="1|2-3|4", mean_loops=3.0, tokenizer="bpe:300",
    )
    torch.manual_seed(0)
    model = RecurrentLM(config)
    save_checkpoint(run, 10, model, config)
    with torch.no_grad():  # a "later" checkpoint: different weights, same architecture
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    save_checkpoint(run, 20, model, config)
    text = root / "held_out.txt"
    text.write_text(TEXT)
    return run, text, model


@pytest.fixture(scope="module")
def analyzed(tiny_run, tmp_path_factory):
    """``rdepth analyze`` run once on both checkpoints (5 windows, batches of 2, long budget 12, DLR curve K = 1..4, Jacobian at 2 positions)."""
    run, text, _ = tiny_run
    out = tmp_path_factory.mktemp("analyzed") / "out"
    code = main([
        "analyze", "--checkpoints", str(run), "--data", str(text), "--out", str(out),
        "--sequences", "5", "--batch-size", "2", "--long-loops", "12", "--top-tokens", "4", "--device", "cpu",
        "--dlr-curve-loops", "4", "--dlr-curve-sequences", "2", "--jacobian-positions", "2",
    ])
    assert code == 0
    return out


def _windows(run) -> torch.Tensor:
    return held_out_windows(np.asarray(run_tokenizer(run).encode(TEXT)), 24, 5)


def test_analyze_writes_numbers_figures_and_report(tiny_run, analyzed):
    run, text, last_model = tiny_run
    out = analyzed
    summary = load_summary(out)
    assert [c["label"] for c in summary["checkpoints"]] == ["step_000010", "step_000020"]
    assert [c["step"] for c in summary["checkpoints"]] == [10, 20]
    assert summary["groups"] == ["1", "2-3", "4"]
    assert summary["budgets"] == {"train": [3, 3, 3], "long": [12, 12, 12]}
    last = summary["checkpoints"][-1]["budgets"]
    assert len(last["long"]["groups"][0]["step_size"]["mean"]) == 12
    assert len(last["long"]["groups"][0]["cosine"]["mean"]) == 11
    assert set(last["train"]["dlr"]) == {"1->2-3", "2-3->4"}
    assert set(last["train"]["dlr"]["1->2-3"]) == set(metrics.DLR_DEFINITIONS) | {metrics.HANDOFF}
    assert set(last["train"]["handoff_control"]) == {"1->2-3", "2-3->4"}

    # the saved numbers equal the batch functions on iterates collected independently
    windows = _windows(run)
    batches = windows.split(2)
    iterates = [[[] for _ in batches] for _ in range(3)]  # [group][batch] -> states [B, T, d]
    last_model = copy.deepcopy(last_model).double()  # analyze measures in float64 by default
    with torch.no_grad():
        last_model.eval()
        for number, batch in enumerate(batches):
            def keep(group, step, state, active, number=number):
                iterates[group][number].append(state.clone())

            noise = StateNoise.consecutive(0, 2 * number, batch.shape[0])  # window i: noise row i, seed 0
            last_model(batch[:, :-1], loop_counts=(3, 3, 3), noise=noise, observer=keep)
    # [K+1, N, d] per group, rows ordered batch, sequence, position (as the observer sees them)
    per_group = [torch.cat([torch.stack(states).flatten(1, 2) for states in group], dim=1) for group in iterates]
    for group in range(3):
        expected = metrics.summarize(metrics.step_sizes(per_group[group]))["mean"].numpy()
        np.testing.assert_allclose(last["train"]["groups"][group]["step_size"]["mean"], expected, rtol=1e-5)
    expected_dlr = metrics.drift_to_loop_ratio(per_group[0], per_group[1], "first").mean().item()
    assert last["train"]["dlr"]["1->2-3"]["first"]["mean"] == pytest.approx(expected_dlr, rel=1e-5)
    expected_handoff = metrics.handoff_ratio(per_group[1], per_group[2]).mean().item()
    assert last["train"]["dlr"]["2-3->4"]["handoff"]["mean"] == pytest.approx(expected_handoff, rel=1e-5)

    # per-token arrays and the PCA projection of sequence 0
    with np.load(out / last["train"]["arrays"]) as npz:
        assert npz["convergence_step/1"].shape == (5 * 24,)
        assert npz["pca_coords"].shape == (3 * 4, 24, 2)
        assert npz["pca_step"].tolist() == [0, 1, 2, 3] * 3
    slowest = json.loads((out / "geometry" / "slowest_tokens.json").read_text())
    assert len(slowest["rows"]) == 4 and "context" in slowest["rows"][0]

    for stem in ("fig1_pca_trajectories", "fig2_dlr", "fig3_loop_dynamics", "fig5_long_cosines"):
        assert (out / "figures" / f"{stem}.png").stat().st_size > 1000
        assert (out / "figures" / f"{stem}.svg").exists()
    page = (out / "index.html").read_text()
    assert "Loop geometry: two scales" in page
    assert "figures/fig2_dlr.png" in page and "Drift scale" in page
    assert "step_000020" in page


def test_analyze_saves_its_headline_numbers(analyzed):
    summary = load_summary(analyzed)
    assert summary["format_version"] == FORMAT_VERSION and summary["scale_budget"] == "long"
    assert summary["headline_definitions"] == {"settled_steps": 5, "settled_range": 0.2, "settled_slope": 0.01,
                                               "decayed_fraction": 0.1, "noise_floor": 1e-6,
                                               "noise_floor_of": "the first refinement step",
                                               "plateau_window": 10, "plateau_max_decay": 2.0}
    assert summary["settings"]["precision"] == "float64"
    for entry in summary["checkpoints"]:
        for budget in entry["budgets"].values():
            for group in budget["groups"]:
                # what each headline number means is tested on a constructed group below; here: every group
                # of every budget has them, read off its own saved curves
                saved = group["headline"]
                assert set(saved) == HEADLINE_KEYS
                sizes = group["step_size"]["mean"]
                assert saved["first_step_size"] == sizes[0]
                assert saved["decay_5_over_0"] == (pytest.approx(sizes[5] / sizes[0]) if len(sizes) > 5 else None)


HEADLINE_KEYS = {"first_step_size", "second_step_size", "decay_5_over_0", "decay_10_over_0", "decay_10_over_1",
                 "noise_floor_step", "decayed_step", "settled_cosine", "settled_cosine_std", "settled_cosine_window", "plateau",
                 "last_effective_rank"}


def test_headline_numbers_of_a_constructed_group():
    """Step sizes 2 x 0.5^k (||Δ(1)|| = 1: a tenth of it at k = 5, under the 1e-3 floor from k = 11), cosines
    that settle at 0.6 after a swing from the random start, and a last effective rank of 3: every headline
    number is known by hand."""
    sizes = [2.0 * 0.5 ** k for k in range(14)]
    cosines = [-0.9, 0.95, 0.8, 0.7, 0.58, 0.62, 0.6, 0.6, 0.6, 0.6, -1.0, -1.0, -1.0]
    group = {"step_size": {"mean": sizes}, "relative_step_size": {"mean": [0.5 ** k for k in range(14)]},
             "cosine": {"mean": cosines, "std": [0.1 * j for j in range(13)]}, "effective_rank": [9.0, 5.0, 3.0]}
    headline = group_headline(group)
    assert set(headline) == HEADLINE_KEYS
    assert headline["first_step_size"] == 2.0 and headline["second_step_size"] == 1.0
    assert headline["decay_5_over_0"] == pytest.approx(1 / 32) and headline["decay_10_over_0"] == pytest.approx(1 / 1024)
    assert headline["decay_10_over_1"] == pytest.approx(1 / 512)
    assert headline["noise_floor_step"] == 11  # 0.5^10 = 9.8e-4 < 1e-3 <= 0.5^9 of ||Δ(1)||
    assert headline["decayed_step"] == 5  # 0.5^4 = 0.0625 <= 0.1 < 0.5^3
    # cosine j counts from the decay while update j+1 is above the floor: j = 5..9, the last five
    assert headline["settled_cosine_window"] == {"usable": 5, "window": [5, 9], "plateau": True,
                                                 "range": pytest.approx(0.02), "slope": pytest.approx(-0.004),
                                                 "reason": None}
    assert headline["settled_cosine"] == pytest.approx(0.604)
    assert headline["settled_cosine_std"] == pytest.approx(0.7)  # stds 0.5..0.9, mean 0.7
    assert headline["plateau"] == {"ratio": pytest.approx(0.5 ** 10), "last_over_step1": pytest.approx(2 * 0.5 ** 13),
                                   "window": 10, "holds": False}
    assert headline["last_effective_rank"] == 3.0
    flat = dict(group, step_size={"mean": [2.0] + [0.3] * 13}, relative_step_size={"mean": [1.0] + [0.01] * 13})
    assert group_headline(flat)["plateau"]["holds"] is True and group_headline(flat)["noise_floor_step"] is None


def test_analyze_loss_equals_eval_whatever_the_batch_size(tiny_run, analyzed):
    """The analysed windows through ``rdepth.run.evaluate.evaluate`` (the loop ``rdepth eval`` runs), in
    other batch sizes, give the cross-entropy analyze saved (batches of 2) at both budgets."""
    run, _, _ = tiny_run
    summary = load_summary(analyzed)
    windows = _windows(run)
    assert summary["sequences"] == windows.shape[0] and summary["seq_len"] == windows.shape[1] - 1
    for entry in summary["checkpoints"]:
        model, _ = load_model(entry["path"])
        model = model.double()  # analyze measures in its precision, float64 by default
        for budget in entry["budgets"].values():
            for batch_size in (1, 3, 5):
                result = evaluate(model, windows, loop_counts=budget["loop_counts"], batch_size=batch_size)
                assert result["ce"] == pytest.approx(budget["loss"], rel=1e-6, abs=0), (entry["label"], batch_size)


def test_old_summary_format_is_a_one_line_error(analyzed, tmp_path):
    summary = json.loads((analyzed / "geometry" / "summary.json").read_text())
    summary["format_version"] = 1
    (tmp_path / "geometry").mkdir()
    (tmp_path / "geometry" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(RdepthError, match="format 1.*rerun `rdepth analyze`") as error:
        load_summary(tmp_path)
    assert "\n" not in str(error.value)


def test_analyze_user_errors(tiny_run, tmp_path, capsys):
    run, text, _ = tiny_run
    assert main(["analyze", "--checkpoints", str(tmp_path / "nope"), "--data", str(text),
                 "--out", str(tmp_path / "o")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    assert main(["analyze", "--checkpoints", str(run), "--data", str(text), "--out", str(tmp_path / "o"),
                 "--sequences", "0"]) == 2
    assert "sequences must be a positive integer" in capsys.readouterr().err
    with pytest.raises(RdepthError, match="keep_sequence"):
        AnalyzeConfig(sequences=2, keep_sequence=2)
    with pytest.raises(RdepthError, match="fewer than one window"):
        held_out_windows(np.arange(5), 24, 2)


def test_analyze_flags_build_the_config():
    from rdepth.cli.main import build_parser
    from rdepth.cli.options import build

    args = build_parser().parse_args(["analyze", "--checkpoints", "a", "--checkpoints", "b/step_000010",
                                      "--data", "d.txt", "--out", "o", "--no-rank", "--seq-len", "16"])
    config = build(AnalyzeConfig, {}, args)
    assert config == AnalyzeConfig(checkpoints=["a", "b/step_000010"], data="d.txt", out="o", rank=False, seq_len=16)
    assert AnalyzeConfig().long_loops == 30 and AnalyzeConfig().checkpoints == []
    # several paths after one flag (a shell glob), mixed with a repeated flag; loop counts parsed as integers
    args = build_parser().parse_args(["analyze", "--checkpoints", "a", "b", "--data", "d.txt", "--checkpoints", "c",
                                      "--out", "o", "--train-loops", "2,3,4"])
    config = build(AnalyzeConfig, {}, args)
    assert config.checkpoints == ["a", "b", "c"] and config.train_loops == (2, 3, 4)
    assert build(AnalyzeConfig, {}, build_parser().parse_args(
        ["analyze", "--checkpoints", "a", "--data", "d", "--out", "o", "--train-loops", "5"])).train_loops == (5,)


def test_train_loops_are_integers_that_reach_the_model_as_counts(tiny_run, capsys):
    run, text, model = tiny_run
    assert AnalyzeConfig(train_loops=[2, 3, 4]).train_loops == (2, 3, 4)
    assert AnalyzeConfig(train_loops=6).train_loops == (6,)
    assert model.resolve_loop_counts(AnalyzeConfig(train_loops=(2, 3, 4)).train_loops) == (2, 3, 4)
    assert model.resolve_loop_counts(AnalyzeConfig(train_loops=(5,)).train_loops) == (5, 5, 5)
    for bad in ("4", "2,3,4", (0,), (2.5,), (True,), ()):
        with pytest.raises(RdepthError, match="train_loops must be positive integers"):
            AnalyzeConfig(train_loops=bad)
    with pytest.raises(RdepthError, match="2 values for 3 recurrence groups"):
        model.resolve_loop_counts(AnalyzeConfig(train_loops=(2, 3)).train_loops)
    with pytest.raises(SystemExit) as exit_info:  # a parse error: argparse exits with status 2
        main(["analyze", "--checkpoints", str(run), "--data", str(text), "--out", "o", "--train-loops", "2,x"])
    assert exit_info.value.code == 2
    assert "--train-loops expects comma-separated int values" in capsys.readouterr().err


def test_dlr_curve_is_saved_per_budget_and_recomputes_from_its_arrays(analyzed):
    """The DLR loop-budget curve: K = 1..4 on the last checkpoint; each saved median is the median of the
    per-token ratios in its NPZ (recomputed here with numpy, not through rdepth)."""
    summary = load_summary(analyzed)
    curve = summary["dlr_curve"]
    assert curve["loops"] == [1, 2, 3, 4] and curve["sequences"] == 2
    assert curve["checkpoint"] == summary["checkpoints"][-1]["label"]
    with np.load(analyzed / curve["arrays"]) as npz:
        for boundary, definitions in curve["boundaries"].items():
            for definition, stats in definitions.items():
                for index, loops in enumerate(curve["loops"]):
                    values = npz[f"{boundary}/{definition}/{loops}"]
                    finite = values[np.isfinite(values)]
                    if finite.size == 0:
                        assert stats["median"][index] is None  # a "_refine" ratio at K = 1
                    else:
                        assert stats["median"][index] == pytest.approx(float(np.median(finite)), rel=1e-6)
    # at the long budget's K the curve's literal DLR is the long budget's own (same windows and noise)
    assert set(curve["boundaries"]) == set(summary["checkpoints"][-1]["budgets"]["long"]["dlr"])


def test_jacobian_spectra_are_saved_per_checkpoint(analyzed):
    summary = load_summary(analyzed)
    for entry in summary["checkpoints"]:
        spectra = entry["jacobian"]
        assert spectra["loop_counts"] == [12, 12, 12] and len(spectra["positions"]) == 2
        assert all(6 <= p < 24 for p in spectra["positions"])  # past the first quarter of 24 positions
        for group in spectra["groups"]:
            rows = group["eigenvalues"]
            assert len(rows) == 2 and len(rows[0]) == 6
            moduli = [row["modulus"] for row in rows[0]]
            assert moduli == sorted(moduli, reverse=True)
            assert group["spectral_radius"]["median"] == pytest.approx(
                float(np.median([position[0]["modulus"] for position in rows])))
