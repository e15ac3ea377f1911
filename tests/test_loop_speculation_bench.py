"""bench/loop_speculation.py: the judge of which fixed budget has the verifying budget's quality (constructed
perplexities, where a cheaper budget qualifies and where none does), and the script end to end on the tiny text
run with --plain-also."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("loop_speculation")


def test_the_cheapest_budget_within_the_tolerance_is_the_one_compared(bench):
    scores = {(16, 16): 100.0, (1, 1): 130.0, (2, 2): 100.9, (4, 4): 100.2, (8, 8): 99.0}
    assert bench.same_quality_budget(scores, (16, 16), 0.01) == (2, 2)
    assert bench.same_quality_budget(scores, (16, 16), 0.005) == (4, 4)
    assert bench.same_quality_budget(scores, (16, 16), 0.5) == (1, 1)
    # no cheaper budget holds the quality: the verifying budget is its own comparison
    worse = {(16, 16): 100.0, (1, 1): 130.0, (4, 4): 102.0, (32, 32): 99.0}
    assert bench.same_quality_budget(worse, (16, 16), 0.01) == (16, 16)
    # a budget of the same total as the verifying one does not displace it
    assert bench.same_quality_budget({(4, 2): 100.0, (2, 4): 100.0}, (4, 2), 0.0) == (4, 2)


def test_plain_also_scores_and_times_every_fixed_budget(bench, tiny_text_run, tmp_path, capsys):
    data = json.loads((tiny_text_run / "config.json").read_text())["train"]["data"]
    out = tmp_path / "spec.json"
    assert bench.main(["--checkpoint", str(tiny_text_run), "--data", data, "--loops", "3", "--draft-loops", "1",
                       "--tokens", "2", "--prompts", "1", "--rounds", "1", "--new-tokens", "6", "--plain-also", "1,3",
                       "--quality-windows", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    scored = result["quality"]
    budgets = [row["budget"] for row in scored["budgets"]]
    assert budgets == [[3, 3], [1, 1], [3, 3]]
    # the same budget scored twice is the same perplexity and the same argmax everywhere
    assert scored["budgets"][0]["ppl"] == scored["budgets"][2]["ppl"] and scored["budgets"][2]["argmax_equal"] == 1.0
    assert 0.0 <= scored["budgets"][1]["argmax_equal"] < 1.0 and scored["budgets"][1]["ppl"] != scored["budgets"][0]["ppl"]
    assert scored["verdict"]["budget"] in ([1, 1], [3, 3]) and scored["verdict"]["draft_loops"] == 1
    assert "cheapest fixed budget within 1.0%" in printed
    with pytest.raises(SystemExit) as refused:
        bench.main(["--checkpoint", str(tiny_text_run), "--data", data, "--exit", "step_norm", "--tau", "0.1",
                    "--plain-also", "1"])
    assert refused.value.code == 2
    assert "--plain-also compares fixed budgets" in capsys.readouterr().err
