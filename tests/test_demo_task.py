"""The task demo end to end on a tiny model: baselines, accuracy tables, exits, geometry, first screen."""

from __future__ import annotations

import json

import pytest

from rdepth.cli.main import main
from rdepth.config import get_preset
from rdepth.demo.task import baseline_model_config, unrolled_depth

PARAMS = json.dumps({"chase": {"nodes": 8, "queries": 4, "ordered": True}})
SMALL = ["--task-params", PARAMS, "--train-difficulties", "1,3", "--train-tokens", "20000",
         "--model-overrides", json.dumps({"d_model": 32, "n_head": 2, "block_size": 32, "mean_loops": 3.0,
                                          "backprop_depth": 2})]


def test_baselines_have_no_loops_and_the_unrolled_depth():
    looped = get_preset("task")  # 1 prelude layer, layer 1 looped, mean 6 loops
    assert unrolled_depth(looped) == 7
    # tiny: prelude 0, groups 1 | 2-3 | 4 at a mean of 4 loops, coda 5
    assert unrolled_depth(get_preset("tiny")) == 1 + 4 + 2 * 4 + 4 + 1
    no_loop, deep = baseline_model_config(looped, "no_loop"), baseline_model_config(looped, "deep")
    assert (no_loop.n_layer, no_loop.groups, no_loop.n_groups) == (2, "", 0)
    assert (deep.n_layer, deep.groups) == (7, "")
    # the demo's model since issue 38: the loop is the whole model (no single-pass layer), mean 6 loops
    whole = get_preset("task_loop")
    assert (whole.n_layer, whole.groups, unrolled_depth(whole)) == (1, "0", 6)
    assert (baseline_model_config(whole, "no_loop").n_layer, baseline_model_config(whole, "deep").n_layer) == (1, 6)


@pytest.mark.slow
def test_task_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), *SMALL, "--max-steps", "6", "--batch-size", "4", "--checkpoint-every", "3",
            "--curriculum-steps", "3", "--eval-batches", "1", "--analyze-sequences", "2", "--long-loops", "4",
            "--loop-budgets", "1,2", "--baselines", "no_loop,deep", "--ranks", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Loops matter" in printed and "d=6" in printed and "  deep plain" in printed

    result = json.loads((out / "demo.json").read_text())
    assert set(result["accuracy"]) == {"looped", "no_loop", "deep"}
    assert result["accuracy"]["deep"]["model"]["n_layer"] == 3 and result["accuracy"]["deep"]["model"]["groups"] == ""
    looped_rows = result["accuracy"]["looped"]["rows"]
    assert {tuple(r["loop_counts"]) for r in looped_rows} == {(1,), (2,)}
    assert {r["difficulty"] for r in looped_rows} == {1, 2, 3, 5, 6}
    for name in ("train", "baseline_no_loop", "baseline_deep"):  # same data, steps and seed
        saved = json.loads((out / name / "config.json").read_text())
        assert saved["train"]["max_steps"] == 6 and saved["train"]["data"] == str(out / "data")
    overview = json.loads((out / "report" / "overview.json").read_text())
    assert overview["headline"]["difficulty"] == 3 and overview["exits"]["difficulty"] == 3
    page = (out / "report" / "index.html").read_text()
    assert "Result" in page and "Early exit on the task" in page and "step_000003" in page
    # The overview table: one format per column (percent, one decimal), the baselines as columns.
    assert "<td class=\"num\">0.0</td>" in page or "<td class=\"num\">100.0</td>" in page
    assert "no loop" in page and "deep plain" in page
    assert "no loop" in printed.split("exact match (%)")[1]  # the final table's baseline rows
    # The geometry's cross-entropy on a task is on the answers, as training and rdepth eval score it.
    geometry = json.loads((out / "report" / "geometry" / "summary.json").read_text())
    assert geometry["loss_tokens"] == "answers"
    from rdepth.geometry.analyze import answer_masks
    from rdepth.run.evaluate import evaluate
    from rdepth.run.opened import open_run

    opened = open_run(out / "train", out / "data", "cpu")
    windows = opened.windows(2)
    masks = answer_masks(opened, 2, None)
    assert masks.shape == windows.shape and 0 < int(masks.sum()) < masks.numel()
    last = geometry["checkpoints"][-1]["budgets"]["train"]
    on_answers = evaluate(opened.model, windows, loop_counts=last["loop_counts"], masks=masks)["ce"]
    on_all = evaluate(opened.model, windows, loop_counts=last["loop_counts"])["ce"]
    assert last["loss"] == pytest.approx(on_answers, rel=1e-6) and on_answers != pytest.approx(on_all, rel=1e-3)
    assert json.loads((out / "demo.json").read_text())["threads"]["per_process"] == 1
    sweep = json.loads((out / "report" / "task_sweep.json").read_text())
    assert {p["policy"] for p in sweep["difficulties"][0]["points"]} == {"acceleration", "step_norm", "kl",
                                                                          "argmax_stable"}
    # Depth against hops, from the sweep's own evaluations: the figure and the correlations on the first screen.
    assert overview["depth"]["figure"] == "figures/depth_vs_hops.png" and overview["depth"]["tokens"] > 0
    assert overview["depth"]["oracle_spearman"] == sweep["summary"]["depth"]["oracle_spearman"]
    assert "Does depth track difficulty?" in page and "figures/depth_vs_hops.png" in page

    weights = out / "train" / "checkpoints" / "step_000006" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert main(argv + ["--no-analyze", "--no-sweep"]) == 0  # every finished run is reused
    assert weights.stat().st_mtime_ns == before


@pytest.mark.parametrize("argv,fragment", [
    (["--mode", "nope"], "mode"),
    (["--baselines", "shallow"], "baseline"),
    (["--train-difficulties", "1,99"], "difficult"),
    (["--task", "nope"], "unknown task"),
])
def test_bad_demo_input_is_one_line_and_writes_nothing(argv, fragment, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_the_first_screen_table_keeps_powers_of_two_and_the_largest_budget():
    from rdepth.demo.task_report import table_budgets

    assert table_budgets([1, 2, 3, 4, 6, 8, 12, 16, 32], most=5) == [1, 2, 4, 8, 32]
    assert table_budgets([1, 2, 3, 4, 6, 8, 12, 16, 32], most=4) == [1, 2, 4, 32]
    assert table_budgets([1, 2, 4], most=5) == [1, 2, 4]


def test_prepared_task_data_is_reused_after_a_move_and_refused_when_it_differs(tmp_path):
    import shutil

    from rdepth.demo.run import DemoConfig
    from rdepth.demo.task import _prepared
    from rdepth.errors import RdepthError

    fields = dict(task_params=PARAMS, train_difficulties=(1, 3), train_tokens=3000,
                  model_overrides=json.dumps({"block_size": 32}))
    first = _prepared(DemoConfig(out=str(tmp_path / "a"), **fields))
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    before = (moved / "train.bin").stat().st_mtime_ns
    assert _prepared(DemoConfig(out=str(tmp_path / "b"), data=str(moved), **fields)) == moved
    assert (moved / "train.bin").stat().st_mtime_ns == before  # reused, not regenerated
    with pytest.raises(RdepthError, match="holds other prepared data \\(train_tokens differ\\)"):
        _prepared(DemoConfig(out=str(tmp_path / "c"), data=str(moved), **{**fields, "train_tokens": 4000}))
