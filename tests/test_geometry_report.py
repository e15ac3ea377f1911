"""Headline numbers of the geometry report, from a constructed summary with known answers."""

from __future__ import annotations

import pytest

from rdepth.geometry.report_page import (
    at_a_glance,
    drift_scale_rows,
    geometry_section,
    loop_scale_rows,
    noise_floor_step,
    settled_cosine,
)


def _summary() -> dict:
    steps = 12
    sizes = [0.5**k for k in range(steps)]  # geometric decay: |D5|/|D0| = 1/32
    cosines = [0.1 * j for j in range(steps - 1)]  # last five: 0.6 .. 1.0 -> mean 0.8
    group = {
        "name": "4", "steps": steps,
        "step_size": {"mean": sizes, "std": [0.0] * steps},
        "relative_step_size": {"mean": [size / 10 for size in sizes], "std": [0.0] * steps},
        "cosine": {"mean": cosines, "std": [0.0] * (steps - 1)},
        "effective_rank": [3.0] * steps,
        "convergence": {"median": 7.0, "never_fraction": 0.25},
    }
    dlr = {"4->5-6": {name: {"mean": value, "median": value + 1} for name, value in
                      (("first", 3.0), ("literal", 40.0), ("output", 5.0))}}
    budget = {"loop_counts": [steps], "loss": 4.0, "groups": [group], "dlr": dlr}
    return {
        "checkpoints": [{"label": "step_000100", "step": 100, "budgets": {"train": budget, "long": budget}}],
        "dlr_default": "first", "dlr_definitions": {"first": "x^(1)"}, "groups": ["4"],
        "settings": {"data": "val"}, "sequences": 2, "seq_len": 8,
    }


def test_loop_scale_rows_known_ratios():
    (row,) = loop_scale_rows(_summary())
    assert row["|Δ5|/|Δ0|"] == pytest.approx(1 / 32)
    assert row["|Δ10|/|Δ0|"] == pytest.approx(1 / 1024)
    assert row["|Δ10|/|Δ1|"] == pytest.approx(1 / 512)
    assert row["settled cos"] == pytest.approx(0.8)
    assert row["eff. rank (last Δ)"] == 3.0 and row["never conv."] == 0.25
    assert row["noise floor at k"] is None


def test_settled_cosine_ignores_steps_at_the_noise_floor():
    group = _summary()["checkpoints"][0]["budgets"]["long"]["groups"][0]
    group["relative_step_size"]["mean"] = [1e-2] * 8 + [1e-7] * 4  # update 8 on is rounding noise
    assert noise_floor_step(group) == 8
    # usable cosines j = 0..6 (update j+1 above the floor): last five 0.2 .. 0.6
    assert settled_cosine(group) == pytest.approx(0.4)


def test_drift_rows_and_glance_text(tmp_path):
    (row,) = drift_scale_rows(_summary())
    assert row["DLR first (mean)"] == 3.0 and row["DLR first (median)"] == 4.0
    assert row["DLR literal (mean)"] == 40.0
    text = at_a_glance(_summary())
    assert "4->5-6: 4" in text and "0.8" in text
    section = geometry_section(tmp_path, _summary(), [("figures/f.png", "a figure")])
    kinds = [block["kind"] for block in section.blocks]
    assert kinds.count("table") == 3 and kinds.count("figure") == 1
