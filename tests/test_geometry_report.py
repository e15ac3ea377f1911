"""Headline numbers of the geometry analysis (computed once, saved) and the report that only reads them."""

from __future__ import annotations

import numpy as np
import pytest

from rdepth.geometry.report_page import at_a_glance, dlr_note, drift_scale_rows, geometry_section, loop_scale_rows
from rdepth.geometry.summary import (
    DLR_LABELS,
    NOISE_FLOOR,
    SETTLED_STEPS,
    group_headline,
    noise_floor_step,
    scale_budget,
    settled_cosine,
    step_ratio,
)


def _group(steps: int = 12) -> dict:
    sizes = [0.5**k for k in range(steps)]  # geometric decay: |D5|/|D0| = 1/32
    cosines = [0.95] + [0.3] * (steps - 2)  # the jump from the random start, then a plateau at 0.3
    group = {
        "name": "4", "steps": steps,
        "step_size": {"mean": sizes, "std": [0.0] * steps},
        "relative_step_size": {"mean": [size / 10 for size in sizes], "std": [0.0] * steps},
        "cosine": {"mean": cosines, "std": [0.0] * (steps - 1)},
        "effective_rank": [3.0] * steps,
        "convergence": {"median": 7.0, "never_fraction": 0.25},
    }
    group["headline"] = group_headline(group)
    return group


def _summary() -> dict:
    group = _group()
    dlr = {"4->5-6": {name: {"mean": value, "median": value + 1} for name, value in
                      (("first", 3.0), ("literal", 40.0), ("output", 5.0), ("first_refine", 30.0))}}
    budget = {"loop_counts": [12], "loss": 4.0, "groups": [group], "dlr": dlr}
    return {
        "checkpoints": [{"label": "step_000100", "step": 100, "budgets": {"train": budget, "long": budget}}],
        "dlr_default": "first", "dlr_default_refine": "first_refine", "groups": ["4"],
        "dlr_definitions": {name: name for name in ("first", "literal", "output", "first_refine")},
        "dlr_labels": {name: DLR_LABELS[name] for name in ("first", "literal", "output", "first_refine")},
        "dlr_terms": {"numerators": {"x(1)": "the first iterate"}, "denominators": {"mean |Δ(k)|, k≥1": "k >= 1"}},
        "settings": {"data": "val"}, "sequences": 2, "seq_len": 8, "budgets": {"train": [12], "long": [12]},
        "scale_budget": "long", "headline_definitions": {"settled_steps": SETTLED_STEPS, "noise_floor": NOISE_FLOOR},
    }


def test_group_headline_known_ratios():
    headline = _group()["headline"]
    assert headline["decay_5_over_0"] == pytest.approx(1 / 32)
    assert headline["decay_10_over_0"] == pytest.approx(1 / 1024)
    assert headline["decay_10_over_1"] == pytest.approx(1 / 512)
    # sizes 0.5^k over ||Δ(1)|| = 0.5 fall to a tenth at k = 5 (the decay, 0.0625) and under the 1e-3 floor at
    # k = 11 (0.00098): cosines 5-9 count (after the decay; cosine j compares updates j and j+1 <= 10), all 0.3
    assert headline["noise_floor_step"] == 11 and headline["decayed_step"] == 5
    assert headline["settled_cosine"] == pytest.approx(0.3)
    assert headline["settled_cosine_std"] == 0.0
    assert headline["settled_cosine_window"] == {"usable": 5, "window": [5, 9], "plateau": True, "range": 0.0,
                                                 "slope": 0.0, "reason": None}
    assert headline["plateau"]["ratio"] == pytest.approx(2.0 ** -10) and not headline["plateau"]["holds"]
    assert headline["first_step_size"] == 1.0 and headline["second_step_size"] == 0.5
    assert headline["last_effective_rank"] == 3.0
    short = group_headline(_group(steps=3))
    assert short["decay_5_over_0"] is None and short["decay_10_over_1"] is None
    assert step_ratio([0.0, 1.0], 1, 0) is None
    assert scale_budget({"train": [3]}) == "train" and scale_budget({"train": [3], "long": [30]}) == "long"


def test_settled_cosine_ignores_steps_at_the_noise_floor():
    sizes = [1e-2] * 8 + [1e-7] * 4  # update 8 on is under 1e-3 of the first refinement step
    assert noise_floor_step(sizes) == 8
    shifted = [size * 1e6 for size in sizes]  # the floor is the loop's own scale: rescaling moves nothing
    assert noise_floor_step(shifted) == 8 and noise_floor_step([1.0, 0.0, 0.0]) == 1
    # usable cosines j = 1..6 (update j+1 above the floor; j = 0 is the jump from the random start):
    # the last five, 2..6; the cosines after the floor (9.0) never count
    cosines = [-1.0, 0.5, 0.6, 0.5, 0.4, 0.5, 0.6, 9.0, 9.0, 9.0, 9.0]
    assert settled_cosine(cosines, 8) == pytest.approx(0.52)  # (0.4 + 0.5 + 0.6 + 0.5 + 0.6) / 5
    assert settled_cosine([0.5], 1) is None


def test_report_rows_read_the_saved_headline():
    (row,) = loop_scale_rows(_summary())
    assert row["|Δ5|/|Δ0|"] == pytest.approx(1 / 32) and row["settled cos"] == pytest.approx(0.3)
    assert row["cosines above floor"] == 5  # what the settled cosine rests on
    assert row["eff. rank (last Δ)"] == 3.0 and row["never conv. %"] == "25.0" and row["noise floor at k"] == 11
    summary = _summary()  # the page shows what was saved, never a recomputation from the curves
    summary["checkpoints"][0]["budgets"]["long"]["groups"][0]["headline"].update(
        settled_cosine=-0.25, decay_10_over_1=0.125)
    (row,) = loop_scale_rows(summary)
    assert row["settled cos"] == -0.25 and row["|Δ10|/|Δ1|"] == 0.125
    text = at_a_glance(summary)
    assert "4: -0.25" in text and "4: 0.12" in text


def test_drift_rows_and_glance_text(tmp_path):
    (row,) = drift_scale_rows(_summary())
    # columns name the numerator and the steps the denominator averages, and the saved definition
    assert row["x(1) ÷ mean |Δ(k)|, k≥0 [first] mean"] == 3.0
    assert row["x(1) ÷ mean |Δ(k)|, k≥0 [first] median"] == 4.0
    assert row["x(1) ÷ mean |Δ(k)|, k≥1 [first_refine] mean"] == 30.0
    assert row["x(1) ÷ mean |Δ(k)|, k≥1 [first_refine] median"] == 31.0
    assert row["x(0) ÷ mean |Δ(k)|, k≥0 (Eq. 2) [literal] mean"] == 40.0
    assert list(row)[2:6] == [f"x(1) ÷ mean |Δ(k)|, k≥{k} [{name}] {stat}" for k, name in
                              ((0, "first"), (1, "first_refine")) for stat in ("mean", "median")]
    text = at_a_glance(_summary())
    assert "4->5-6: 4 against the mean of all loop steps (Eq. 2's denominator" in text
    assert "4->5-6: 31 against the mean refinement step" in text and "0.30" in text
    note = dlr_note(_summary())
    assert "Eq. 2 as written is 'literal'" in note and "first_refine = x(1) ÷ mean |Δ(k)|, k≥1" in note
    section = geometry_section(tmp_path, _summary(), [("figures/f.png", "a figure")])
    kinds = [block["kind"] for block in section.blocks]
    assert kinds.count("table") == 3 and kinds.count("figure") == 1
    assert note in "".join(str(block) for block in section.blocks)


def test_dlr_stats_skip_undefined_values():
    from rdepth.geometry.summary import _stats

    stats = _stats(np.array([1.0, np.nan, 3.0]))
    assert stats["mean"] == 2.0 and stats["median"] == 2.0 and stats["defined"] == pytest.approx(2 / 3)
    assert _stats(np.array([np.nan, np.nan]))["mean"] is None
    summary = _summary()
    summary["checkpoints"][0]["budgets"]["train"]["dlr"]["4->5-6"]["first_refine"] = _stats(np.array([np.nan]))
    assert "4->5-6: n/a against the mean refinement step" in at_a_glance(summary)
    (row,) = drift_scale_rows(summary)
    assert row["x(1) ÷ mean |Δ(k)|, k≥1 [first_refine] median"] is None


def _one_group_summary() -> dict:
    summary = _summary()
    for budget in summary["checkpoints"][0]["budgets"].values():
        budget["dlr"] = {}  # one looped group: no boundary, no drift
    return summary


def test_one_looped_group_has_no_drift_figure_and_says_why(tmp_path):
    from rdepth.geometry.plots import has_boundaries

    assert has_boundaries(_summary()) and not has_boundaries(_one_group_summary())
    assert "one looped group, so no hand-offs between groups" in at_a_glance(_one_group_summary())
    section = geometry_section(tmp_path, _one_group_summary(), [])
    notes = [block["text"] for block in section.blocks if block["kind"] == "note"]
    assert any(note.startswith("No drift-to-loop ratio (Fig. 2): the model has one looped group") for note in notes)
    assert not any("No drift-to-loop" in str(block) for block in geometry_section(tmp_path, _summary(), []).blocks)


def test_the_loss_caption_names_the_tokens_scored(tmp_path):
    def loss_caption(summary: dict) -> str:
        blocks = geometry_section(tmp_path, summary, []).blocks
        return next(b["caption"] for b in blocks if b["kind"] == "table" and "cross-entropy" in b["caption"])

    task = {**_summary(), "loss_tokens": "answers"}
    assert "on the answer tokens (what the model is trained to predict) among this section's 16" in loss_caption(task)
    assert "on this section's 16 held-out tokens" in loss_caption(_summary())
