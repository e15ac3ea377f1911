"""The honest selection (rdepth.sweep.halves): a setting chosen on one half of the problems, judged on the
other. Constructed per-token arrays with known answers, a constructed case where the choice does not hold
on the other half, and the task sweep's own halves against its whole-set accuracy."""

from __future__ import annotations

import numpy as np
import pytest

from rdepth.sweep.halves import half_scores, honest_selection, target_problems


def test_target_problems_follow_the_answer_mask_row_major():
    mask = np.array([[1, 0, 1, 1], [0, 1, 0, 1]], dtype=bool)  # the targets are mask[:, 1:]: column 0 never counts
    ids = np.array([[9, -1, 4, 4], [-1, 5, -1, 6]])
    assert target_problems(mask, ids).tolist() == [4, 4, 5, 6]


def test_half_scores_on_known_answers():
    problems = np.array([0, 0, 1, 1, 2, 3])
    right = np.array([True, True, True, False, False, True])
    steps = np.array([1.0, 3.0, 2.0, 2.0, 5.0, 4.0])
    half_a, half_b = half_scores(right, steps, problems)
    # A: problems 0 (solved) and 2 (not); B: problems 1 (one answer wrong: not solved) and 3 (solved)
    assert half_a == {"problems": 2, "accuracy": 0.5, "answer_steps": 3.0}
    assert half_b == {"problems": 2, "accuracy": 0.5, "answer_steps": 8.0 / 3}


def entry(label, accuracy_a, accuracy_b, steps_a, steps_b):
    return {"label": label, "halves": [{"problems": 10, "accuracy": accuracy_a, "answer_steps": steps_a},
                                       {"problems": 10, "accuracy": accuracy_b, "answer_steps": steps_b}]}


FIXED = [entry("fixed 1", 0.5, 0.5, 1, 1), entry("fixed 2", 0.8, 0.8, 2, 2), entry("fixed 3", 0.9, 0.9, 3, 3)]


def test_a_choice_that_holds_on_the_other_half_meets_the_bar():
    points = [entry("rule a", 0.9, 0.895, 1.5, 1.6), entry("rule b", 0.7, 0.7, 1.2, 1.2)]
    a_to_b, b_to_a = honest_selection(FIXED, points, tolerance=0.01)
    assert a_to_b["point"]["label"] == "rule a" and a_to_b["point"]["meets_bar"]
    assert a_to_b["point"]["accuracy"] == 0.895 and a_to_b["point"]["answer_steps"] == 1.6
    assert a_to_b["cheapest_fixed"]["label"] == "fixed 3" and a_to_b["full_accuracy"] == 0.9
    assert b_to_a["point"]["label"] == "rule a" and b_to_a["point"]["meets_bar"]


def test_a_choice_fitted_to_one_half_is_caught_on_the_other():
    """The null control: the setting that looks best on A (cheapest within the bar there) falls 20 points
    on B; chosen on A it is reported as missing the bar; chosen on B another setting is picked."""
    points = [entry("lucky", 0.9, 0.7, 1.1, 1.1), entry("steady", 0.895, 0.9, 2.5, 2.5)]
    a_to_b, b_to_a = honest_selection(FIXED, points, tolerance=0.01)
    assert a_to_b["point"]["label"] == "lucky" and not a_to_b["point"]["meets_bar"]
    assert b_to_a["point"]["label"] == "steady" and b_to_a["point"]["meets_bar"]
    none = honest_selection(FIXED, [entry("weak", 0.5, 0.5, 1, 1)], tolerance=0.01)
    assert none[0]["point"] is None and none[1]["point"] is None


def test_the_task_sweeps_halves_add_up_to_its_accuracy(small_chase_data):
    """Every entry of a real task sweep carries both halves; their problem-weighted accuracy is the entry's
    whole-set accuracy, and the summary holds both directions."""
    import torch

    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.task import format_task_sweep, run_task_sweep
    from rdepth.tasks.data import load_heldout

    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(n_layer=2, n_head=2, d_model=16, block_size=32, vocab_size=42, groups="1",
                                    mean_loops=2.0, backprop_depth=2, tokenizer="task:chase")).eval()
    heldout = load_heldout(small_chase_data, 3).windows(0, 8)
    config = SweepConfig(checkpoint="x", data="x", out="x", policies=("step_norm",), taus=(1e-2, 1.0), k_max=(3,),
                         timing=False, progress=False)
    result = run_task_sweep(model, [heldout], config, tolerance=1.0)
    block = result["difficulties"][0]
    for item in block["fixed"] + block["points"]:
        a, b = item["halves"]
        assert a["problems"] + b["problems"] == block["problems"]
        weighted = (a["accuracy"] * a["problems"] + b["accuracy"] * b["problems"]) / block["problems"]
        assert weighted == pytest.approx(item["accuracy"])
    rows = result["summary"]["difficulties"][0]["halves"]
    assert [(r["chosen_on"], r["judged_on"]) for r in rows] == [("A", "B"), ("B", "A")]
    assert all(r["point"] is not None for r in rows)  # tolerance 1: every point is within it
    assert any("chosen on half A, judged on B" in line for line in format_task_sweep(result))
