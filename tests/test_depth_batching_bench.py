"""bench/depth_batching.py's judges on constructed per-problem results: the cheapest fixed budget within the
tolerance, a rule's setting that meets the bar pooled and per difficulty, and cases where each must say no
(a pooled tie hiding a difficulty that drops, a setting worse on every split)."""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import pytest

from bench.depth_batching import aheads, judge, meets, paired, select, split_shares
from bench.depth_timing import throughput_rows, tick_list

ARGS = Namespace(tolerance=0.01, per_difficulty=0.02, full_loops=3, policies="step_norm_rel", splits=50, seed=0)
LABELS = np.repeat([1, 2], 200)  # 200 problems of each difficulty


def solved(rate_d1: float, rate_d2: float) -> np.ndarray:
    """Per problem: the first rate x 200 of each difficulty solved."""
    out = np.zeros(400, dtype=bool)
    out[: int(rate_d1 * 200)] = True
    out[200: 200 + int(rate_d2 * 200)] = True
    return out


def qualities(rules: dict) -> dict:
    base = {"fixed 1": (1.0, solved(0.5, 0.2)), "fixed 2": (2.0, solved(0.95, 0.9)), "fixed 3": (3.0, solved(0.95, 0.9))}
    base.update(rules)
    return {label: {"steps": steps, "solved": right} for label, (steps, right) in base.items()}


def test_the_cheapest_setting_meeting_the_bar_and_a_pooled_tie_that_hides_a_difficulty():
    # 0.5: pooled equal to F (d=1 +5 points, d=2 -5 points): fails per difficulty; 0.3 meets; 0.1 too costly
    q = qualities({"step_norm_rel 0.5": (1.2, solved(1.0, 0.85)), "step_norm_rel 0.3": (1.5, solved(0.95, 0.9)),
                   "step_norm_rel 0.1": (1.9, solved(0.95, 0.9))})
    rows = np.arange(400)
    assert paired(q["step_norm_rel 0.5"]["solved"], q["fixed 2"]["solved"])[0] == 0.0
    assert not meets({k: v["solved"] for k, v in q.items()}, "step_norm_rel 0.5", "fixed 2", rows, LABELS, ARGS)
    choice = select(q, LABELS, rows, ARGS)
    assert choice["fixed"] == "fixed 2"
    assert choice["chosen"]["step_norm_rel plain"] == "step_norm_rel 0.3"
    judged = judge(q, LABELS, rows, choice, ARGS)["step_norm_rel plain"]
    assert judged["meets"] and judged["paired_diff"] == 0.0 and judged["diff_by_difficulty"] == {1: 0.0, 2: 0.0}
    # over random halves the pooled tie is sometimes chosen on A (its per-difficulty drop splits unevenly)
    # and then fails on B; without it every split's choice holds
    assert split_shares(q, LABELS, ARGS)["step_norm_rel plain"] < 1.0
    del q["step_norm_rel 0.5"]
    assert split_shares(q, LABELS, ARGS)["step_norm_rel plain"] == 1.0


def test_a_setting_worse_everywhere_is_never_chosen_and_a_one_sided_margin_is_stricter():
    q = qualities({"step_norm_rel 0.5": (1.2, solved(0.90, 0.85))})  # 5 points under F in both difficulties
    choice = select(q, LABELS, np.arange(400), ARGS)
    assert choice["chosen"]["step_norm_rel plain"] is None and choice["chosen"]["step_norm_rel safe"] is None
    assert judge(q, LABELS, np.arange(400), choice, ARGS)["step_norm_rel plain"] is None
    shares = split_shares(q, LABELS, ARGS)
    assert shares["step_norm_rel plain"] == 0.0
    assert shares["full budget (reference)"] == 1.0  # fixed 3 equals F (fixed 2) on every problem


def test_the_reference_share_sees_a_full_budget_that_drops_a_difficulty():
    """A full budget 3 points under F at difficulty 2 ('overthinking'): the reference share says the judge
    refuses even the full budget."""
    q = qualities({})
    q["fixed 3"] = {"steps": 3.0, "solved": solved(0.97, 0.87)}
    assert split_shares(q, LABELS, ARGS)["full budget (reference)"] < 0.5
    # 0.75 points under F pooled: meets a 1-point tolerance, not with one paired standard error of margin
    close = solved(0.95, 0.9)
    close[[0, 1, 2]] = False
    sets = {"fixed 2": solved(0.95, 0.9), "rule": close}
    rows = np.arange(400)
    diff, error = paired(sets["rule"], sets["fixed 2"])
    assert -0.01 < diff < 0 and diff - error < -0.01
    assert meets(sets, "rule", "fixed 2", rows, LABELS, ARGS)
    assert not meets(sets, "rule", "fixed 2", rows, LABELS, ARGS, margin=1.0)


def test_the_timed_mode_is_the_least_strict_that_holds_on_nine_splits_in_ten():
    from bench.depth_batching import timed_choice

    choice = {"chosen": {"kl plain": "kl 0.1", "kl safe": "kl 0.05", "kl safer": "kl 0.03", "kl strict": "kl 0.02",
                         "kl strictest": "kl 0.01"}}
    args = Namespace(policies="kl")
    assert timed_choice(choice, {"kl plain": 0.95, "kl safe": 0.99}, args) == {"kl": "kl 0.1"}
    assert timed_choice(choice, {"kl plain": 0.85, "kl safe": 0.92, "kl safer": 0.99}, args) == {"kl": "kl 0.05"}
    assert choice["timed_mode"] == {"kl": "safe"}
    assert timed_choice(choice, {"kl plain": 0.5, "kl safe": 0.6, "kl safer": 0.8, "kl strict": 0.91},
                        args) == {"kl": "kl 0.02"}
    # none holds: the mode with the highest share, the least strict of equals, among modes that chose
    assert timed_choice(choice, {"kl plain": 0.5, "kl safe": 0.8, "kl strictest": 0.8}, args) == {"kl": "kl 0.05"}
    assert choice["timed_mode"] == {"kl": "safe"}
    choice["chosen"]["kl safe"] = None
    assert timed_choice(choice, {"kl plain": 0.5, "kl safe": 0.95, "kl strictest": 0.8}, args) == {"kl": "kl 0.01"}
    choice["chosen"] = dict.fromkeys(choice["chosen"])
    assert timed_choice(choice, {}, args) == {"kl": None}


def test_a_difficulty_margin_refuses_a_drop_within_the_bar_but_not_within_its_error():
    """1.5 points under F at difficulty 2 (3 of 200 problems lost): within the 2-point bar, but not once one of
    that difficulty's own paired standard errors (0.86 points) is taken off; pooled (0.75 under) it is within the
    1-point tolerance."""
    rule = solved(0.95, 0.9)
    rule[[200, 201, 202]] = False
    sets = {"fixed 2": solved(0.95, 0.9), "rule": rule}
    rows = np.arange(400)
    part = rows[LABELS == 2]
    diff, error = paired(sets["rule"][part], sets["fixed 2"][part])
    assert diff == pytest.approx(-0.015) and diff - error < -0.02
    assert meets(sets, "rule", "fixed 2", rows, LABELS, ARGS)
    assert not meets(sets, "rule", "fixed 2", rows, LABELS, ARGS, difficulty_margin=1.0)
    assert meets(sets, "fixed 2", "fixed 2", rows, LABELS, ARGS, margin=2.0, difficulty_margin=2.0)


def test_ratios_are_against_the_fastest_path_at_f_whichever_it_is():
    """With the compiled tick faster at F, the eager engine at F is below 1 and a rule's share of its bound is
    judged against the compiled F; with the eager tick the faster, against it; with the lock-step decoder the
    fastest at F, against it. The shared layout is never F."""
    records = {name: {"latency": [0.1, 0.2], "steps": steps, "paid": steps} for name, steps in
               (("engine | fixed 6", 6.0), ("engine compiled | fixed 6", 6.0), ("engine compiled | kl 0.02", 3.0),
                ("engine shared-KV | fixed 6", 6.0))}
    settings = {"fixed 6": {"loop_counts": (6,)}}
    seconds = {"engine | fixed 6": [2.0] * 3, "engine compiled | fixed 6": [1.0] * 3,
               "engine compiled | kl 0.02": [0.8] * 3, "engine shared-KV | fixed 6": [0.1] * 3}
    rows = throughput_rows(seconds, records, 100, settings, "fixed 6")
    assert rows["engine | fixed 6"]["vs_engine_fixed"] == 1.0 and rows["engine | fixed 6"]["vs_fastest_fixed"] == 0.5
    rule = rows["engine compiled | kl 0.02"]
    assert rule["vs_fastest_fixed"] == pytest.approx(1.25) and rule["bound"] == 2.0
    assert rule["share_of_bound"] == pytest.approx(0.625)  # not 2.5 / 2 against the slower eager F
    seconds["engine compiled | fixed 6"] = [4.0] * 3
    rows = throughput_rows(seconds, records, 100, settings, "fixed 6")
    assert rows["engine compiled | kl 0.02"]["vs_fastest_fixed"] == pytest.approx(2.5)
    records["lockstep | fixed 6"] = {"latency": [0.1], "steps": 6.0, "paid": 6.0}
    seconds["lockstep | fixed 6"] = [0.5] * 3  # the lock-step decoder the fastest at F
    rows = throughput_rows(seconds, records, 100, settings, "fixed 6")
    assert rows["engine compiled | kl 0.02"]["vs_fastest_fixed"] == pytest.approx(0.625)
    assert rows["lockstep | fixed 6"]["vs_fastest_fixed"] == 1.0


def test_ticks_named_are_checked_and_eager_is_always_first():
    assert tick_list("compiled") == ["eager", "compiled"] and tick_list("compiled,eager,compiled") == ["eager",
                                                                                                      "compiled"]
    from rdepth.errors import RdepthError

    with pytest.raises(RdepthError, match="--ticks takes"):  # one line, exit 2 (a SystemExit was exit 1)
        tick_list("eager,fast")


def test_a_rule_capped_at_the_fixed_budget_is_chosen_when_cheaper_and_refused_when_it_drops_a_difficulty():
    """--caps: 'NAME TAU cap K' competes with the uncapped grid on A like any other setting."""
    uncapped = (1.6, solved(0.95, 0.9))
    q = qualities({"step_norm_rel 0.3": uncapped, "step_norm_rel 0.3 cap 2": (1.5, solved(0.95, 0.9))})
    rows = np.arange(400)
    assert select(q, LABELS, rows, ARGS)["chosen"]["step_norm_rel plain"] == "step_norm_rel 0.3 cap 2"
    # the cap cuts the slow rows of difficulty 2 (3 points under F there): the uncapped setting is chosen
    q = qualities({"step_norm_rel 0.3": uncapped, "step_norm_rel 0.3 cap 2": (1.5, solved(0.95, 0.87))})
    assert select(q, LABELS, rows, ARGS)["chosen"]["step_norm_rel plain"] == "step_norm_rel 0.3"


def test_caps_make_their_own_settings_and_a_reused_quality_file_gains_only_the_missing_ones(tmp_path, monkeypatch):
    import bench.depth_batching as bench

    args = bench.parse_args(["--run", "r", "--data", "d", "--full-loops", "4", "--caps", "2,4",
                             "--policies", "step_norm_rel", "--json", str(tmp_path / "q.json")])
    settings = bench.settings_for(Namespace(readout=lambda hidden: hidden), args)
    taus = bench.GRID["step_norm_rel"]
    assert [label for label in settings if label.startswith("step_norm_rel")] == (
        [f"step_norm_rel {tau:g} cap 2" for tau in taus] + [f"step_norm_rel {tau:g}" for tau in taus])
    assert settings["step_norm_rel 0.5 cap 2"]["factory"]().policy(0).k_max == 2
    with pytest.raises(SystemExit):  # a cap above the full budget has no fixed budget to compare with
        bench.parse_args(["--run", "r", "--data", "d", "--full-loops", "4", "--caps", "5"])
    measured = []

    def fake_quality(model, heldout, wanted, seed, device):
        measured.append(sorted(wanted))
        return {label: {"steps": float(len(label)), "solved": np.ones(3, dtype=bool)} for label in wanted}

    monkeypatch.setattr(bench, "quality", fake_quality)
    old = {label: setting for label, setting in settings.items() if "cap" not in label}
    first = bench.measured_quality(None, None, old, args, "cpu")
    np.savez(tmp_path / "q.quality.npz", **{"steps|other": 1.0, "solved|other": np.zeros(3, dtype=bool)},
             **{f"{key}|{label}": q[key] for label, q in first.items() for key in ("steps", "solved")})
    args.reuse_quality = True
    again = bench.measured_quality(None, None, settings, args, "cpu")
    assert measured[-1] == sorted(label for label in settings if "cap" in label)  # only the new ones measured
    assert list(again) == list(settings)
    kept = np.load(tmp_path / "q.quality.npz")
    assert "steps|other" in kept.files and "steps|step_norm_rel 0.5 cap 2" in kept.files  # merged, nothing lost
    count = len(measured)
    third = bench.measured_quality(None, None, settings, args, "cpu")  # everything saved: nothing measured
    assert len(measured) == count and list(third) == list(settings)
    assert all(third[label]["steps"] == again[label]["steps"] for label in settings)


def test_a_tick_that_cannot_run_ahead_is_timed_once_at_one_tick_a_call():
    args = Namespace(ahead="1,4,4")
    assert aheads(args, "compiled") == [1, 4] and aheads(args, "static") == [1, 4]
    assert aheads(args, "token") == [1] and aheads(Namespace(ahead="4"), "eager") == [1]
