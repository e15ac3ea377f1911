"""The paper's judges, round 4 (issue 67): each defect's constructed case, where the round-3 rule gave the wrong
verdict, and one test per lenient mutation the round-3 tests let through (each named in its docstring).

The geometry cases go through the public path (GeometryObserver -> summarize_budget -> the judge), the exit cases
through a constructed sweep, Raptor's through rdepth.surrogate.measure.null.judge. The builders are
tests/test_claims_judges.py's."""

from __future__ import annotations

import math

import pytest
import torch
from test_claims_judges import KL, TOKENS, _turn, points, scales, spiral, summary_of, sweep, turning

from rdepth.geometry.stream import GeometryObserver
from rdepth.geometry.summary import NOISE_FLOORS, checkpoint_entry, summarize_budget
from rdepth.reproduce import claims as C
from rdepth.surrogate.measure import null as raptor

NAMES = ["4", "5-6", "7"]


def spiral_per_token(point: torch.Tensor, start: torch.Tensor, rates: torch.Tensor, angle: float, steps: int,
                     seed: int) -> torch.Tensor:
    """States [steps+1, N, d] of x(k+1) - p = rates[t] R(angle) (x(k) - p): every token turns by ``angle`` a step
    (so every cosine is cos(angle)) and contracts at its own rate ``rates`` [N], from ``start`` [N] away."""
    generator = torch.Generator().manual_seed(seed)
    offset = torch.randn(point.shape, generator=generator, dtype=torch.float64)
    offset = offset / offset.norm(dim=-1, keepdim=True) * start.unsqueeze(-1)
    states = [point + offset]
    for _ in range(steps):
        offset = rates.unsqueeze(-1) * _turn(offset, angle)
        states.append(point + offset)
    return torch.stack(states)


def per_token(value: float, other: float, share: float) -> torch.Tensor:
    """[TOKENS]: ``value``, except the first ``share`` of the tokens at ``other``."""
    out = torch.full((TOKENS,), value, dtype=torch.float64)
    out[:int(share * TOKENS)] = other
    return out


# ------------------------------------------------------------------ defect 2: claim 3's control per token


@pytest.mark.parametrize("steps", [6, 12])
def test_zero_drift_with_tokens_contracting_at_different_rates_is_not_reproduced(steps):
    """Zero drift: both groups settle at the same point. In the later group 80% of the tokens contract 0.85 a step
    and 20% contract 0.3 from 10,000x farther: those few dominate the mean curve, so a control fitted to it reads a
    contraction near 0.3 and understates what the slow 80% have left by 2.7x (the round-3 rule read 'reproduced'
    at K = 6 and 12). Each token's own contraction gives a control the hand-off distance never exceeds."""
    point = points()
    earlier = spiral_per_token(point, per_token(1.0, 1.0, 0.0), per_token(0.6, 0.6, 0.0), 1.0, steps, 1)
    later = spiral_per_token(point, per_token(100.0, 1e6, 0.2), per_token(0.85, 0.3, 0.2), 1.0, steps, 2)
    claim = C.claim_dlr(summary_of([earlier, later]))
    (row,) = claim["ours"]["boundaries"]
    assert row["handoff_median"] > C.DLR_MUCH  # the ratio alone clears the bar: the control must decide
    assert row["over_control_median"] <= 1.0 + 1e-6  # the linear loop's distance left bounds the hand-off exactly
    assert row["share_clear"] == 0.0
    assert claim["verdict"] == C.NOT, claim["why"]


def test_real_drift_over_tokens_contracting_at_different_rates_is_reproduced():
    """The same loops with the later group's fixed point 400 away: drift, clear of every token's own control."""
    point = points()
    far = point + 400.0 * torch.nn.functional.normalize(torch.randn(TOKENS, 8, dtype=torch.float64), dim=-1)
    earlier = spiral_per_token(point, per_token(30.0, 30.0, 0.0), per_token(0.6, 0.6, 0.0), 1.0, 30, 1)
    later = spiral_per_token(far, per_token(30.0, 300.0, 0.2), per_token(0.5, 0.3, 0.2), 1.0, 30, 2)
    claim = C.claim_dlr(summary_of([earlier, later]))
    assert claim["verdict"] == C.REPRODUCED, claim["why"]
    assert claim["ours"]["boundaries"][0]["share_clear"] == 1.0


# ------------------------------------------------------------------ defect 3: a decay gate that abstains


def test_a_constant_cosine_with_a_spread_of_contraction_is_reproduced():
    """Every token turns by exactly arccos(0.55) every step; half contract 0.6 a step, half 0.93 from 3x farther,
    so the mean step stays above a tenth of ||Δ(1)|| over the 30 loops. The round-3 rule read 'the steps never
    decay' as 'not reproduced'; the window now starts at loop step 10 when the mean never decays."""
    summary = summary_of([spiral_per_token(points(), per_token(10.0, 30.0, 0.5), per_token(0.6, 0.93, 0.5),
                                           math.acos(0.55), 30, seed) for seed in (1, 2)])
    claim = C.claim_cosine(summary)
    for group in claim["ours"]["groups"]:
        assert group["settled_cosine"] == pytest.approx(0.55) and group["window"] == [24, 28]
    headline = summary["checkpoints"][0]["budgets"]["long"]["groups"][0]["headline"]
    assert headline["decayed_step"] is None
    assert claim["verdict"] == C.REPRODUCED, claim["why"]


def test_steps_that_level_off_and_keep_turning_read_the_same_for_the_cosine_and_the_plateau():
    """The paper's section-4 regime: the steps fall to 0.3 of ||Δ(1)|| and level off there, turning at 0.55.
    The plateau judge said 'reproduced' and the cosine judge 'the steps never decay' (not reproduced)."""
    sizes = [50.0] + [max(0.3, 0.7 ** k) for k in range(30)]
    summary = summary_of([turning(points(), sizes, [0.55] * 30, seed) for seed in (1, 2)])
    assert C.claim_plateau(summary)["verdict"] == C.REPRODUCED
    assert C.claim_cosine(summary)["verdict"] == C.REPRODUCED


def test_without_a_decay_a_short_budget_is_not_tested():
    """No decay and 8 loops: no five cosines from loop step 10, so nothing is read: not tested, never a verdict."""
    summary = summary_of([spiral(points(), scales(30.0), 0.97, math.acos(0.58), 8, 1)] * 2)
    windows = [g["headline"]["settled_cosine_window"] for g in summary["checkpoints"][0]["budgets"]["long"]["groups"]]
    assert [w["reason"] for w in windows] == ["no decay"] * 2
    claim = C.claim_cosine(summary)
    assert claim["verdict"] == C.UNTESTED and "from loop step 10" in claim["why"][0]


# ------------------------------------------------------------------ defect 4: a slope against its standard error


def test_a_wobble_inside_the_band_is_no_trend():
    """Cosines 0.575 + 0.08 sin(π j / 2): a zero-mean wobble inside 0.45-0.70, spread 0.16 over five cosines.
    Where the window falls on it (j = 26..30: 0.575, 0.495, 0.575, 0.655, 0.575) its least-squares slope is
    +0.016 a step, over the 0.01 bar, and the round-3 rule read a trend (no plateau, not reproduced); its
    standard error is 0.018, so it is noise. A straight fall of 0.04 a step still trends."""
    sizes = [50.0] + [0.8 ** k for k in range(39)]  # a tenth of ||Δ(1)|| at k = 12, the 1e-3 floor at k = 32
    wobble = [0.575 + 0.08 * math.sin(math.pi * j / 2) for j in range(39)]
    claim = C.claim_cosine(summary_of([turning(points(), sizes, wobble, seed) for seed in (1, 2)]))
    for group in claim["ours"]["groups"]:
        assert group["window"] == [26, 30] and group["slope"] == pytest.approx(0.016, abs=1e-4)
        assert group["reason"] is None and group["settled_cosine"] == pytest.approx(0.575, abs=1e-3)
    assert claim["verdict"] == C.REPRODUCED, claim["why"]
    falling = [0.58 - 0.04 * (j - 28) for j in range(39)]
    claim = C.claim_cosine(summary_of([turning(points(), sizes, falling, seed) for seed in (1, 2)]))
    assert [g["reason"] for g in claim["ours"]["groups"]] == ["trend"] * 2 and claim["verdict"] == C.NOT


# ------------------------------------------------------------------ defect 6: the floor sees the precision


def summary_in(groups: list[torch.Tensor], precision: str) -> dict:
    """A one-checkpoint summary of these groups' states fed in ``precision`` (float32: each state rounded to it,
    as a model run in float32 hands them on), at that precision's noise floor (NOISE_FLOORS)."""
    observer = GeometryObserver(rank=False, keep_sequence=None)
    dtype = {"float32": torch.float32, "float64": torch.float64}[precision]
    for group, states in enumerate(groups):
        for step, state in enumerate(states):
            observer(group, step, state.to(dtype).unsqueeze(0), None)
    names = NAMES[:len(groups)]
    budget = {"loop_counts": [len(s) - 1 for s in groups],
              **summarize_budget(observer.result(), names, None, NOISE_FLOORS[precision])}
    entry = checkpoint_entry("step_000100", 100, "constructed", {"train": budget, "long": budget})
    return {"checkpoints": [entry], "scale_budget": "long", "groups": names, "dlr_default_refine": "first_refine",
            "settings": {"precision": precision}}


def test_one_trajectory_reads_the_same_in_float32_and_float64():
    """Steps fall 0.3 a step from ||Δ(1)|| = 3 and level off at 2.2e-4 of it (6.6e-4, over a thousand times
    float32's rounding of states of norm ~5), turning at 0.55 throughout. The round-3 float32 floor (1e-3 of
    ||Δ(1)||) dropped the level stretch: the plateau read 'not reproduced' and the cosine 'not tested' in float32,
    both 'reproduced' in float64."""
    sizes = [5.0] + [max(3.0 * 0.3 ** k, 6.6e-4) for k in range(30)]
    groups = [turning(0.3 * points(seed), sizes, [0.55] * 30, seed) for seed in (1, 2)]
    verdicts = {}
    for precision in ("float32", "float64"):
        summary = summary_in(groups, precision)
        verdicts[precision] = [C.claim_plateau(summary)["verdict"], C.claim_cosine(summary)["verdict"]]
    assert verdicts["float32"] == verdicts["float64"] == [C.REPRODUCED, C.REPRODUCED]


def test_a_float32_loop_settled_to_its_rounding_is_no_plateau():
    """A loop halving its steps from ||Δ(1)|| ≈ 0.9 around a point of norm ~1,400, run in float32: once its steps
    reach the arithmetic's rounding (here a dither of 4 eps ||x|| per state, what a float32 layer leaves) they stop
    shrinking, about 1e-3 of ||Δ(1)||, far above a floor of 1e-6 of ||Δ(1)|| alone, and look level. The rounding
    term (32 x eps x ||x||, 5e-3) puts them under the floor: no plateau."""
    eps = torch.finfo(torch.float32).eps
    groups = []
    for seed in (1, 2):
        point = 50.0 * points(seed)
        states = spiral(point, scales(2.0), 0.5, 1.0, 40, seed)
        dither = torch.randn(states.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        groups.append(states + 4 * eps * point.norm(dim=-1, keepdim=True) * dither / math.sqrt(8))
    summary = summary_in(groups, "float32")
    headline = summary["checkpoints"][0]["budgets"]["long"]["groups"][0]["headline"]
    assert headline["plateau"]["ratio"] > 0.5  # level: the rounding noise does not shrink
    assert headline["plateau"]["last_over_step1"] > 1e-4  # far above the loop-relative floor (1e-6) alone
    assert C.claim_plateau(summary)["verdict"] == C.NOT


# ------------------------------------------------------------------ defects 1 and 5: claim 4


def shifted(rows: list[tuple[float, float]], rise: float) -> list[tuple[float, float]]:
    return [(r + rise, steps) for r, steps in rows]


def test_a_front_shifted_by_half_the_quality_slack_saves_nothing():
    """The rule is KL's front; KL and step-norm are the same front 0.1% worse in perplexity (half the 0.2% slack):
    on these flat fronts the cost at exactly equal quality reads a large saving (the round-3 rule: 'reproduced');
    within the slack the rule costs what KL costs."""
    other = shifted(KL, 0.001)
    claim = C.claim_exits(sweep({"acceleration_rel": KL, "kl": other, "step_norm_rel": other}))
    for comparison in claim["ours"]["fronts"]["comparisons"].values():
        assert not comparison["cheaper"] and comparison["axes"]["steps"]["matched"]["saving"] <= 0.0
    assert claim["verdict"] == C.NOT, claim["why"]


def test_a_front_spanning_a_hair_of_quality_is_held_to_the_other_rules_measured_points():
    """The rule's five thresholds span a 0.005% perplexity rise at 22-15 steps; KL keeps 0.03% at 14 steps, a hair
    further and cheaper. KL's cost interpolated inside the rule's range reads a 30% saving (round 3: 'reproduced');
    KL's measured point within the slack is cheaper than the rule's cheapest."""
    rule = [(0.0, 22.0), (1e-5, 20.0), (2e-5, 18.0), (4e-5, 16.0), (5e-5, 15.0)]
    kl = [(0.0, 23.0), (3e-4, 14.0), (1e-3, 12.0), (0.004, 10.0), (0.006, 9.0)]
    claim = C.claim_exits(sweep({"acceleration_rel": rule, "kl": kl, "step_norm_rel": kl}))
    matched = claim["ours"]["fronts"]["comparisons"]["kl"]["axes"]["steps"]["matched"]
    assert not matched["cheaper"] and matched["costlier"] and (pytest.approx(-3e-4), 14.0) in matched["unmatched"]
    assert claim["verdict"] == C.NOT, claim["why"]


def test_the_papers_flat_fronts_at_lower_cost_are_reproduced():
    """Both rules flat (every threshold within 0.05% of the full budget), the rule at 10-16 steps where KL needs
    19-23: the paper's own picture ('at same quality, acceleration dominates KL'), reproduced."""
    rule = [(0.0, 16.0), (1e-4, 14.0), (2e-4, 12.0), (3e-4, 11.0), (5e-4, 10.0)]
    kl = [(0.0, 23.0), (1e-4, 22.0), (2e-4, 21.0), (3e-4, 20.0), (5e-4, 19.0)]
    claim = C.claim_exits(sweep({"acceleration_rel": rule, "kl": kl, "step_norm_rel": kl}))
    assert claim["ours"]["fronts"]["comparisons"]["kl"]["axes"]["steps"]["matched"]["saving"] == pytest.approx(
        1 - 10.0 / 19.0)
    assert claim["verdict"] == C.REPRODUCED, claim["why"]


CHEAP = [(0.0, 16.0), (0.005, 14.0), (0.0105, 12.0), (0.45, 10.0), (0.46, 9.0)]


def test_a_cliff_after_a_threshold_just_outside_the_tolerance_is_not_stable():
    """Cheaper than both rules at matched quality, then +44% perplexity one threshold after +1.05%: the round-3
    rule counted jumps only from thresholds within the 1% tolerance and read 'stable', 'reproduced'."""
    claim = C.claim_exits(sweep({"acceleration_rel": CHEAP, "kl": KL, "step_norm_rel": KL}))
    fronts = claim["ours"]["fronts"]
    assert all(c["cheaper"] for c in fronts["comparisons"].values())
    assert fronts["jump"]["acceleration_rel"] == pytest.approx(0.4395) and fronts["stable"] is False
    assert claim["verdict"] == C.PARTLY
    assert claim["verdict_note"] == ("cheaper at matched quality than KL and the first-order step-norm rule; "
                                     "not stable")


def test_a_diverged_threshold_is_not_stable():
    """One threshold's perplexity is NaN (the setting diverged): max() skipped it and round 3 read 'stable'."""
    rule = [(0.0, 16.0), (0.001, 14.0), (math.nan, 13.0), (0.002, 12.0), (0.003, 11.0)]
    claim = C.claim_exits(sweep({"acceleration_rel": rule, "kl": KL, "step_norm_rel": KL}))
    assert claim["ours"]["fronts"]["jump"]["acceleration_rel"] == math.inf
    assert claim["ours"]["fronts"]["stable"] is False and claim["verdict"] == C.PARTLY
    assert "diverged" in " ".join(claim["why"])


def test_partly_says_which_comparison_holds():
    """Cheaper than KL, not than step-norm (which reaches the full quality at 12 steps): 'partly', and the verdict
    says which (claims.json's verdict_note and ours.holds, the table's verdict column)."""
    from rdepth.reproduce.report import table_rows

    step_norm = [(0.0, 12.0), (0.001, 11.0), (0.002, 10.0), (0.004, 9.0), (0.006, 8.0)]
    claim = C.claim_exits(sweep({"acceleration_rel": [(r, 0.7 * s) for r, s in KL], "kl": KL,
                                 "step_norm_rel": step_norm}))
    assert claim["verdict"] == C.PARTLY
    assert claim["ours"]["holds"] == {"kl": True, "step_norm_rel": False, "stable": True}
    note = "cheaper at matched quality than KL, not than the first-order step-norm rule; stable"
    assert claim["verdict_note"] == note and claim["why"][0] == f"Partly: {note}."
    assert claim["ours"]["value"].startswith(note)
    (row,) = table_rows({"claims": [claim]})
    assert row["verdict"] == f"partly ({note})"


# ------------------------------------------------------------------ item 8: the lenient mutations


def test_a_saving_under_five_percent_is_not_cheaper():
    """Mutation: claim 4's 5% minimum saving set to 0. The rule costs 3% less than KL and step-norm everywhere:
    over the 1% cost slack, under the 5% bar: not reproduced."""
    rule = [(rise, 0.97 * steps) for rise, steps in KL]
    claim = C.claim_exits(sweep({"acceleration_rel": rule, "kl": KL, "step_norm_rel": KL}))
    assert claim["ours"]["fronts"]["comparisons"]["kl"]["axes"]["steps"]["matched"]["saving"] == pytest.approx(0.03)
    assert claim["verdict"] == C.NOT


def test_a_rule_ten_percent_dearer_somewhere_is_not_cheaper():
    """Mutation: the 1% cost slack raised to 20% (which also raises the minimum saving to 20%). The rule saves 26%
    at the full quality but pays 10% more than KL's loosest threshold at +0.6%: dearer somewhere, so not cheaper:
    not reproduced."""
    kl = KL[:4] + [(0.006, 10.0)]
    rule = [(0.0, 14.0), (0.001, 13.5), (0.002, 13.0), (0.004, 12.0), (0.006, 11.0)]
    claim = C.claim_exits(sweep({"acceleration_rel": rule, "kl": kl, "step_norm_rel": kl}))
    matched = claim["ours"]["fronts"]["comparisons"]["kl"]["axes"]["steps"]["matched"]
    assert matched["saving"] == pytest.approx(1 - 14.0 / 19.0) and not matched["cheaper"]
    assert claim["verdict"] == C.NOT


def test_steps_still_contracting_above_the_floor_are_no_plateau():
    """Mutation: the plateau's decay bar removed. Steps shrink 0.8 a step: 9x over the last 10 of 30 loops, yet
    the last is still 0.2% of ||Δ(1)||, above the floor: not reproduced."""
    summary = summary_of([spiral(points(), scales(30.0), 0.8, 1.0, 30, seed) for seed in (1, 2)])
    claim = C.claim_plateau(summary)
    assert all(g["ratio"] == pytest.approx(0.8 ** 10) and g["last_over_step1"] > 1e-3 for g in claim["ours"]["groups"])
    assert claim["verdict"] == C.NOT


@pytest.mark.parametrize("checkpoints", [1, 2])
def test_near_the_band_without_moving_toward_it_is_not_reproduced(checkpoints):
    """Mutation: 'partly' for any group near the band without the trend test. Every group settles at 0.38, 0.07
    under the band (near), with one checkpoint (no trend to test) or moving away from it over two (0.42 -> 0.38):
    not reproduced."""
    series = [[spiral(points(), scales(30.0), 0.6, math.acos(cos), 30, seed) for seed in (1, 2)]
              for cos in ([0.42, 0.38] if checkpoints == 2 else [0.38])]
    summaries = [summary_of(groups) for groups in series]
    summary = summaries[-1]
    summary["checkpoints"] = [dict(s["checkpoints"][0], label=f"step_{100 * (i + 1):06d}", step=100 * (i + 1))
                              for i, s in enumerate(summaries)]
    claim = C.claim_cosine(summary)
    assert [g["status"] for g in claim["ours"]["groups"]] == ["near", "near"]
    assert claim["ours"]["trend"]["holds"] is (None if checkpoints == 1 else False)
    assert claim["verdict"] == C.NOT


# ------------------------------------------------------------------ Raptor (item 7, and its own checks)


def raptor_runs(**changes) -> list[dict]:
    """Three identical seeds of dynamics with every finding's statistic set (test_surrogate_null's layout)."""
    values = dict(ratio=0.2, recovery=0.3, cls_peak=20.0, coherence=0.4, last_rank=2.0)
    values.update(changes)
    dynamics = {"basins": {"ratio": [0.8, 0.7, values["ratio"]], "nearest_class": [0.3, 0.5, 0.9]},
                "perturbation": [{"depth": 0, "recovery": values["recovery"]}],
                "angular": {"step_first": [1.0, 1.0, values["cls_peak"], 1.0], "step_others": [1.0, 1.0, 2.0, 1.0]},
                "coherence": {"others": [0.1, 0.2, 0.3, 0.3 + values["coherence"]]},
                "update_effective_rank": [10.0, 8.0, values["last_rank"]], "step_size": [0.3, 0.2, 0.1]}
    return [dynamics] * 3


NULL = dict(ratio=0.45, recovery=0.9, cls_peak=5.0, coherence=0.05, last_rank=4.0)
BASINS = "class-dependent angular basins"


def own_checks(held: list[bool]) -> list[list[dict]]:
    """Per trained seed, every finding's own check, holding where ``held`` says."""
    return [[{"finding": finding, "verdict": "reproduced" if ok else "not reproduced"} for finding in
             raptor.STATISTICS] for ok in held]


def test_a_null_that_was_not_measured_is_not_beaten():
    """Only the shuffled-depth null passed: round 3 counted the missing random-init null as beaten and read
    'reproduced'; each null is required by name."""
    rows = raptor.judge(raptor_runs(), {"shuffled_depth": raptor_runs(**NULL)}, own_checks([True] * 3))
    assert all(row["verdict"] == raptor.UNTESTED for row in rows)
    assert all("random_init null was not measured" in row["why"] for row in rows)


def test_a_gap_equal_to_the_minimum_effect_meets_it():
    """Trained 0.30 against a null at 0.35, no spread: the gap is the minimum effect 0.05, which float rounding
    makes 0.04999999999999999; round 3 said the null was not beaten."""
    nulls = {"random_init": raptor_runs(ratio=0.35), "shuffled_depth": raptor_runs(ratio=0.35)}
    rows = raptor.judge(raptor_runs(ratio=0.30), nulls, own_checks([True] * 3))
    row = next(row for row in rows if row["finding"] == BASINS)
    assert row["against"]["random_init"]["gap"] < 0.05 and row["against"]["random_init"]["beats"]
    assert row["verdict"] == raptor.REPRODUCED
    assert not raptor.compare([0.30] * 3, [0.3 + 1e-12] * 3, "lower", 0.0)["beats"]  # a gap inside the tolerance


def test_own_checks_failing_at_one_seed_leave_it_partly():
    """Mutation: Raptor's own checks ignored. Beyond both nulls, but the finding's own check fails at one of the
    three seeds: partly, not reproduced."""
    nulls = {"random_init": raptor_runs(**NULL), "shuffled_depth": raptor_runs(**NULL)}
    rows = raptor.judge(raptor_runs(), nulls, own_checks([True, False, True]))
    assert all(row["verdict"] == raptor.PARTLY and row["own_checks"] == "2 of 3 seeds" for row in rows)
    assert all(row["verdict"] == raptor.REPRODUCED for row in raptor.judge(raptor_runs(), nulls, own_checks([True] * 3)))
