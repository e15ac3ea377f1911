"""Task data through the toolkit: prepare from the CLI, masked training, accuracy per difficulty and budget."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rdepth.cli.main import main
from rdepth.config import ModelConfig
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise
from rdepth.tasks.accuracy import problem_correct
from rdepth.tasks.data import load_heldout
from rdepth.tasks.evaluate import heldout_accuracy, heldout_accuracy_budgets, task_accuracy_table

PARAMS = json.dumps({"chase": {"nodes": 8, "queries": 2, "ordered": True}})


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("task") / "chase"
    assert main(["prepare", "--corpus", "task:chase", "--out", str(out), "--train-difficulties", "1,3",
                 "--train-tokens", "20000", "--val-tokens", "2000", "--heldout-problems", "24",
                 "--block-size", "48", "--task-params", PARAMS]) == 0
    return out


def test_prepare_writes_masks_heldout_sets_and_a_unigram_table(task_data):
    manifest = json.loads((task_data / "manifest.json").read_text())
    assert manifest["tokenizer"] == "task:chase"
    assert sorted(int(d) for d in manifest["task"]["heldout"]) == [1, 2, 3, 5, 6]  # 1.5x and 2x the top
    assert (task_data / "train_mask.bin").stat().st_size == manifest["splits"]["train"]["tokens"]
    assert np.load(task_data / "unigram.npy").shape == (manifest["vocab_size"],)


def test_accuracy_equals_a_direct_computation(task_data):
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(n_layer=2, n_head=2, d_model=16, block_size=48, vocab_size=42, groups="1",
                                    mean_loops=2.0, backprop_depth=2, tokenizer="task:chase")).eval()
    heldout = load_heldout(task_data, 2)
    result = heldout_accuracy(model, heldout, loop_counts=3, batch_size=5, seed=1)
    windows = torch.from_numpy(heldout.tokens)
    with torch.no_grad():
        logits = model(windows[:, :-1], None, 3, noise=StateNoise.consecutive(1, 0, len(windows))).logits
    _, solved = problem_correct(logits, heldout.tokens[:, 1:], heldout.answer_mask[:, 1:], heldout.problem_ids[:, 1:])
    assert result["problems"] == 24 == solved.size
    assert result["accuracy"] == pytest.approx(float(solved.mean()))
    assert result["answer_tokens"] == int(heldout.answer_mask[:, 1:].sum())


@pytest.mark.parametrize("layout, budgets", [
    (dict(n_layer=2, groups="1"), [1, 4, 2, 7, 4]),                              # one group: one shared pass
    (dict(n_layer=4, groups="1|2"), [(1, 3), (2, 1), (1, 1), (2, 5), (1, 6)]),   # two families of the last group
    (dict(n_layer=4, groups="0-1|3"), [(2, 2), (1, 3), (2, 4)]),                 # a coda layer after the last group
    (dict(n_layer=2, groups=""), [None]),                                         # no loop at all
])
def test_budgets_sharing_a_trajectory_equal_separate_runs(task_data, layout, budgets):
    """One pass per family of budgets gives exactly what a run at each budget gives: same accuracy,
    same answer cross-entropy to the last bit (the same operations on the same tensors)."""
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(n_head=2, d_model=16, block_size=48, vocab_size=42, mean_loops=2.0,
                                    backprop_depth=2, tokenizer="task:chase", **layout)).eval()
    heldout = load_heldout(task_data, 3)
    shared = heldout_accuracy_budgets(model, heldout, budgets, batch_size=7, seed=2)
    separate = [heldout_accuracy(model, heldout, loop_counts=budget, batch_size=7, seed=2) for budget in budgets]
    assert shared == separate
    assert len({row["answer_ce"] for row in shared}) == len({tuple(row["loop_counts"]) for row in shared})
    table = task_accuracy_table(model, task_data, budgets, difficulties=[1, 3], batch_size=7, seed=2)
    assert [row["difficulty"] for row in table["rows"]] == [1, 3] * len(budgets)  # budget-major
    assert table["rows"][1::2] == separate


def test_train_and_eval_on_task_data(task_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(task_data), "--out", str(run), "--n-layer", "2", "--n-head", "2",
                 "--d-model", "16", "--block-size", "48", "--groups", "1", "--mean-loops", "2",
                 "--backprop-depth", "2", "--max-steps", "4", "--batch-size", "4", "--eval-batches", "1",
                 "--eval-batch-size", "4", "--log-every", "1"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(task_data), "--loops", "1", "--loops", "3",
                 "--json", str(tmp_path / "eval.json")]) == 0
    printed = capsys.readouterr().out
    assert "d=5" in printed and "answer accuracy" in printed
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert {row["difficulty"] for row in saved["rows"]} == {1, 2, 3, 5, 6}
    assert {tuple(row["loop_counts"]) for row in saved["rows"]} == {(1,), (3,)}


def test_task_checkpoint_on_text_data_is_one_line(task_data, wiki_small, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(task_data), "--out", str(run), "--n-layer", "2", "--n-head", "2",
                 "--d-model", "16", "--block-size", "48", "--groups", "1", "--max-steps", "1", "--batch-size", "2",
                 "--eval-batches", "1"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(wiki_small)]) == 2
    err = capsys.readouterr().err
    assert "task:chase" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,fragment", [
    (["--corpus", "task:nope"], "unknown task"),
    (["--corpus", "task:chase", "--train-difficulties", "1,99"], "difficult"),
    (["--corpus", "wiki", "--train-tokens", "100"], "task:NAME"),
])
def test_bad_task_input_is_one_line(argv, fragment, tmp_path, capsys):
    assert main(["prepare", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_eval_puts_baselines_in_the_same_table(task_data, tmp_path, capsys):
    runs = {}
    for name, groups in (("looped", "1"), ("plain", "")):
        runs[name] = tmp_path / name
        assert main(["train", "--data", str(task_data), "--out", str(runs[name]), "--n-layer", "2", "--n-head", "2",
                     "--d-model", "16", "--block-size", "48", "--groups", groups, "--max-steps", "2",
                     "--batch-size", "2", "--eval-batches", "1"]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(runs["looped"]), "--data", str(task_data), "--loops", "1", "--loops", "2",
                 "--baseline", str(runs["plain"]), "--json", str(tmp_path / "eval.json")]) == 0
    printed = capsys.readouterr().out
    assert "baseline 1" in printed and "groups none" in printed
    saved = json.loads((tmp_path / "eval.json").read_text())
    (baseline,) = saved["baselines"]
    assert baseline["groups"] == "" and {row["difficulty"] for row in baseline["rows"]} == {1, 2, 3, 5, 6}
