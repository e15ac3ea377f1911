"""Does depth track difficulty: hops per answer token, the per-token oracle, Spearman's rho, and the task
sweep's saved measure (issue 38, item 1)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rdepth.data.task_vocab import TaskVocab
from rdepth.errors import RdepthError
from rdepth.sweep.depth import average_ranks, depth_vs_hops, oracle_steps, spearman, steps_by_hops
from rdepth.tasks.assign import AssignTask
from rdepth.tasks.chase import ChaseTask
from rdepth.tasks.hops import heldout_hops, window_hops
from rdepth.tasks.modsum import ModSumTask
from rdepth.tasks.stream import pack_windows

VOCAB = TaskVocab("task:test")


def ids(text: str) -> list[int]:
    return VOCAB.encode(text)


# ---------------------------------------------------------------- hops, by hand


@pytest.mark.parametrize("task, text, hops", [
    # c->d, a->b, d->d, b->c, e->e: from a, a->b->c->d (3 arrows); e is a fixed point (0)
    (ChaseTask(nodes=5, queries=2), "c d a b d d b c e e ? a d ? e e", (3, 0)),
    (ChaseTask(nodes=5, queries=2), "d e b c a b e e c d ? a e ? c e", (4, 2)),  # a->b->c->d->e; c->d->e
    (ChaseTask(nodes=5, queries=2, ordered=True), "b c d d e ? a d ? e e", (3, 0)),
    (ChaseTask(nodes=5, queries=2, ordered=True), "b c d e e ? d e ? b e", (1, 3)),
    (AssignTask(variables=4, queries=2), "c = b a = 7 d = 2 b = a ? c 7 ? d 2", (3, 1)),  # c->b->a->7; d->2
    (ModSumTask(), "+ 3 9 4 1 = 7", (4,)),
])
def test_answer_hops_of_known_problems(task, text, hops):
    assert task.answer_hops(ids(text)) == hops
    corrupted = ids(text)
    corrupted[-1] = ids("a")[0] if corrupted[-1] != ids("a")[0] else ids("b")[0]
    assert task.answer_hops(corrupted) == hops  # recomputed from the statement, never from the answer slots


@pytest.mark.parametrize("task", [ChaseTask(nodes=8, queries=4), ChaseTask(nodes=8, queries=4, ordered=True,
                                                                          min_distractor_hops=8),
                                  AssignTask(variables=8, queries=3)])
def test_generated_main_query_needs_the_difficulty_and_no_query_more(task):
    rng = np.random.default_rng(0)
    for difficulty in (1, 3, 6):
        for _ in range(20):
            problem = task.sample(rng, difficulty)
            hops = task.answer_hops(problem.tokens)
            assert len(hops) == len(problem.answer_positions)
            assert max(hops) == difficulty and min(hops) >= 0


def test_window_hops_follow_each_problem_of_a_mixture_into_its_window():
    rng = np.random.default_rng(1)
    tasks = [ChaseTask(nodes=6, queries=3), AssignTask(variables=4, queries=2)]
    problems = [tasks[i % 2].sample(rng, 1 + i % 3) for i in range(7)]  # drawn in turn, as held-out sets are
    windows = pack_windows(problems, 50)
    hops = window_hops(tasks, windows.tokens, windows.answer_mask, windows.problem_ids)
    assert (hops >= 0).tolist() == windows.answer_mask.tolist()
    expected = [h for task_index, problem in enumerate(problems)
                for h in tasks[task_index % 2].answer_hops(problem.tokens)]
    assert hops[windows.answer_mask].tolist() == expected
    with pytest.raises(RdepthError, match="malformed chase"):  # an assign problem read as chase
        window_hops([ChaseTask(nodes=6, queries=3)], windows.tokens, windows.answer_mask, windows.problem_ids)


# ---------------------------------------------------------------- the oracle and Spearman


def test_oracle_is_the_fewest_steps_from_which_the_token_stays_right():
    right = np.array([  # rows: budgets 1..4 (steps 2, 4, 6, 8 over two groups); columns: tokens
        [False, False, True, True, False, True],
        [True, True, True, True, False, False],
        [False, True, True, True, False, True],
        [True, True, True, False, True, True],
    ])
    steps = oracle_steps(right, [2, 4, 6, 8])
    # right at 2 then wrong at 3: only 4 stays; right from 2; always; wrong at the cap; only the cap;
    # right at 1, wrong at 2, right again from 3
    assert steps[:3].tolist() == [8, 4, 2] and math.isnan(steps[3]) and steps[4:].tolist() == [8, 6]
    with pytest.raises(RdepthError):
        oracle_steps(right, [2, 4, 4, 8])


def test_spearman_on_known_answers():
    assert spearman([1, 2, 3, 4], [1, 4, 9, 100]) == pytest.approx(1.0)  # monotone, not linear
    assert spearman([1, 2, 3, 4], [9, 4, 1, 0]) == pytest.approx(-1.0)
    # ties share their mean rank: y ranks 1, 2, 3.5, 5, 3.5 -> 8 / sqrt(10 * 9.5)
    assert average_ranks([5, 6, 7, 8, 7]).tolist() == [1, 2, 3.5, 5, 3.5]
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert spearman([1, 2, 3, 4], [1, 2, 2, 1]) == pytest.approx(0.0)  # no monotone relation: the judge can fail
    assert math.isnan(spearman([1, 2, 3], [2, 2, 2]))  # a rule that spends the same on every token
    assert math.isnan(spearman([1], [1]))


def test_depth_measure_tells_a_tracking_rule_from_a_flat_one():
    hops = np.array([0, 1, 1, 2, 3, 3, 0, 2])
    difficulty = np.array([1, 1, 1, 3, 3, 3, 3, 3])
    tracking = hops + 1.0
    flat = np.full(8, 2.0)
    backwards = 5.0 - hops
    oracle = np.array([1, 2, np.nan, 3, 4, 4, 1, 3], dtype=float)
    depth = depth_vs_hops(hops, difficulty, [{"label": "tracks", "steps": tracking}, {"label": "flat", "steps": flat},
                                             {"label": "backwards", "steps": backwards}], oracle)
    tracks, flat_row, back = depth["settings"]
    assert tracks["spearman"] == pytest.approx(1.0) and back["spearman"] == pytest.approx(-1.0)
    assert math.isnan(flat_row["spearman"]) and tracks["spearman_oracle_tokens"] == pytest.approx(1.0)
    assert tracks["hops"] == [0, 1, 2, 3] and tracks["mean_steps_by_hops"] == [1, 2, 3, 4]
    assert tracks["tokens_by_hops"] == [2, 2, 2, 2] and tracks["spearman_by_difficulty"]["1"] == pytest.approx(1.0)
    assert depth["oracle"]["undefined"] == 1 and depth["oracle"]["tokens"] == 7
    assert depth["oracle"]["tokens_by_hops"] == [2, 1, 2, 2] and depth["oracle"]["spearman"] == pytest.approx(1.0)
    assert steps_by_hops([1, 2, np.nan], [0, 0, 1]) == ([0], [1.5], [2])


# ---------------------------------------------------------------- in the task sweep


def test_task_sweep_measures_depth_from_its_own_evaluations(small_chase_data):
    """The sweep's oracle equals one computed from separate dense runs at each fixed budget; each policy's
    per-token steps average to the answer-token steps its entry reports; hops come from the problems."""
    import torch

    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.task import format_task_sweep, run_task_sweep
    from rdepth.tasks.data import load_heldout
    from rdepth.tasks.evaluate import heldout_accuracy
    from rdepth.tasks.hops import manifest_tasks

    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(n_layer=2, n_head=2, d_model=16, block_size=32, vocab_size=42, groups="1",
                                    mean_loops=2.0, backprop_depth=2, tokenizer="task:chase")).eval()
    heldouts = [load_heldout(small_chase_data, d).windows(0, 6) for d in (1, 3)]
    hops = [heldout_hops(manifest_tasks(small_chase_data), h) for h in heldouts]
    assert [int(h.max()) for h in hops] == [1, 3] and all(h.size == 4 * 6 for h in hops)  # 4 queries a problem
    config = SweepConfig(checkpoint="x", data="x", out="x", policies=("step_norm",), taus=(1e-2, 1.0), k_max=(3,),
                         timing=False, progress=False)
    result = run_task_sweep(model, heldouts, config, hops=hops)
    depth = result["depth"]
    assert depth["tokens"] == 48 and [row["label"] for row in depth["settings"]] == ["step_norm tau=0.01",
                                                                                   "step_norm tau=1"]
    separate = [oracle_steps(np.stack([heldout_accuracy(model, h, loop_counts=k, per_token=True)["answer_right"]
                                       for k in (1, 2, 3)]), [1, 2, 3]) for h in heldouts]
    expected = depth_vs_hops(np.concatenate(hops), np.repeat([1, 3], 24), [], np.concatenate(separate))["oracle"]
    assert json.dumps(depth["oracle"]) == json.dumps(expected)  # NaN (no defined token of a hop count) included
    assert depth["oracle"]["tokens"] + depth["oracle"]["undefined"] == 48
    for block in result["difficulties"]:
        for point in block["points"]:
            row = next(r for r in depth["settings"] if r["label"] == point["label"])
            assert 1 <= row["mean_steps"] <= 3
    one = run_task_sweep(model, heldouts[1:], config, hops=hops[1:], tolerance=1.0)  # one difficulty: the entry's mean
    for point, row in zip(one["difficulties"][0]["points"], one["depth"]["settings"], strict=False):
        assert row["mean_steps"] == pytest.approx(point["mean_steps_answer"])
    best = one["summary"]["difficulties"][0]["best"]  # on one difficulty, the depth headline's best is the sweep's
    assert best is not None and one["summary"]["depth"]["best"]["label"] == best["label"]
    summary = result["summary"]["depth"]
    assert set(summary["shown"]) == {"step_norm"} and summary["tokens"] == 48
    assert any("does depth track difficulty" in line for line in format_task_sweep(result))
    assert "depth" not in run_task_sweep(model, heldouts[:1], config)  # without hops: no measure


def test_sweep_cli_writes_the_depth_measure_figure_and_section(small_chase_data, tmp_path, capsys):
    from rdepth.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(small_chase_data), "--out", str(run), "--n-layer", "2", "--n-head", "2",
                 "--d-model", "16", "--block-size", "32", "--groups", "1", "--mean-loops", "2",
                 "--backprop-depth", "2", "--max-steps", "2", "--batch-size", "4", "--eval-batches", "1"]) == 0
    capsys.readouterr()
    out = tmp_path / "sweep"
    assert main(["sweep", "--checkpoint", str(run), "--data", str(small_chase_data), "--out", str(out),
                 "--policies", "step_norm,kl", "--taus", "1e-2,1", "--k-max", "3", "--no-timing", "--no-progress",
                 "--difficulties", "1,3", "--task-windows", "4"]) == 0
    printed = capsys.readouterr().out
    assert "does depth track difficulty" in printed and "oracle" in printed
    saved = json.loads((out / "task_sweep.json").read_text())
    depth = saved["depth"]
    assert depth["tokens"] == 2 * 4 * 4 and len(depth["settings"]) == 4
    assert depth["oracle"]["hops"] == sorted(depth["oracle"]["hops"]) and max(depth["settings"][0]["hops"]) == 3
    assert set(saved["summary"]["depth"]["shown"]) == {"step_norm", "kl"}
    rows = (out / "depth_vs_hops.csv").read_text().splitlines()
    assert rows[0] == "label,policy,parameter,value,hops,tokens,mean_steps,spearman"
    assert len(rows) == 1 + sum(len(r["hops"]) for r in depth["settings"] + [depth["oracle"]])
    assert (out / "figures" / "depth_vs_hops.png").is_file()
    page = (out / "index.html").read_text()
    assert "Does depth track difficulty" in page and "figures/depth_vs_hops.png" in page
    # --no-timing: the page says no wall time was measured (it claimed a timing it never took), and how kl read
    assert "wall time was not measured" in page and "interleaved rounds" not in page
    assert "kl is KL(p_new || p_old)" in page
