"""bench/exit_rule_cost.py (issue 38): a rule's cost per loop step as the model grows. A tiny end-to-end run,
its refusals of malformed flags, and its check that every rule really ran the K steps it is charged for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import exit_rule_cost  # noqa: E402


def test_a_tiny_run_times_every_rule_at_exactly_k_steps(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert exit_rule_cost.main(["--shapes", "32x1,32x2", "--policies", "learned,step_norm_rel,kl", "--steps", "4",
                                "--tokens", "4", "--rounds", "1", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [(row["width"], row["looped_layers"]) for row in saved["rows"]] == [(32, 1), (32, 2)]
    for row in saved["rows"]:
        assert row["executed_steps"] == {"fixed 4": 4.0, "fixed 2": 2.0, "learned": 4.0, "step_norm_rel": 4.0,
                                         "kl": 4.0}
        assert set(row["rules"]) == {"learned", "step_norm_rel", "kl"}
        assert all(ms > 0 for ms in row["ms_per_token"].values())
    assert saved["rows"][1]["parameters"] > saved["rows"][0]["parameters"]  # the second looped layer
    assert "a loop step" in capsys.readouterr().out


def test_a_rule_that_stops_early_is_refused_not_charged_for_fewer_steps(monkeypatch):
    """The cost per step divides by K: a threshold that fires (here tau 1: every token stops at step 1)
    would make the rule look cheaper than it is, so the run stops with the reason."""
    from rdepth.errors import RdepthError

    monkeypatch.setitem(exit_rule_cost.NEVER, "learned", 1.0)
    with pytest.raises(RdepthError, match="stopped before 4 steps"):  # one line, exit 2 (issue 61)
        exit_rule_cost.main(["--shapes", "32x1", "--policies", "learned", "--steps", "4", "--tokens", "3",
                             "--rounds", "1"])


@pytest.mark.parametrize("argv", [["--shapes", "32"], ["--shapes", "32xa"], ["--shapes", "0x1"],
                                  ["--policies", "acceleration"], ["--steps", "1"]])
def test_malformed_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        exit_rule_cost.parse_args(argv)
    assert stop.value.code == 2
    assert "error" in capsys.readouterr().err
