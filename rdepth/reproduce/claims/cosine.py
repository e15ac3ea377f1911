"""Claim 2: consecutive-step cosines settle around 0.5-0.65, a slow spiral (Fig. 3b, Fig. 5), and get there
over training.

The paper: "consecutive updates become more orthogonal: cos∠(Δ(k),Δ(k−1)) rises from noisy/low values and
settles at lower levels (≈ 0.5–0.65 in later checkpoints)" (§3), and "the stabilization of
cos∠(Δ(k),Δ(k−1)) indicating non-collinear, refinement-like updates" (§2). What is judged is where the cosine
stabilizes, read where the loop's transient is over (:func:`rdepth.geometry.summary.settled_window`):

* after the step-size decay; when the mean step never falls to a tenth of ||Δ(1)|| (steps that level off and
  keep turning, as §4 describes: "norms plateau at a small nonzero value due to rotation"; or tokens that
  contract at different rates), from loop step SETTLED_AFTER on, where the paper's "typically within 5-10 steps"
  has the transient over. That the steps never decay is claim 1's business, never a verdict here: a budget too
  short to read five cosines there is "not measured" (issue 67);
* "settles" means no trend: a slope over the five cosines above SETTLED_SLOPE a step counts only when it is
  also beyond TREND_T standard errors (a zero-mean wobble inside the band is noise, wherever the window falls).
"""

from __future__ import annotations

from typing import Any

from rdepth.geometry.summary import SETTLED_AFTER, SETTLED_SLOPE, TOLERANCE, TREND_T
from rdepth.reproduce.claims.step_decay import DECAY_BY_STEP
from rdepth.reproduce.claims.verdict import (
    NOT,
    PARTLY,
    REPRODUCED,
    final_groups,
    judged_on,
    missing_field,
    new_claim,
    untested,
)

# Claim 2: the paper's band of settled consecutive-step cosines, and the slack allowed around it.
PAPER_COSINE = (0.5, 0.65)
COSINE_SLACK = 0.05
# ... and a settled cosine at or above this is collinear: the opposite of "increasingly orthogonal".
COLLINEAR = 0.9
# "Partly" without a group inside the band: every group settled within this of the band (half the paper's
# slack-free band width, 0.15, rounded down) and moving toward it over training in every group.
NEAR_BAND = 0.1
# Claim 2's trend: the settled cosine must move toward the paper's band by at least this much from the
# first to the last checkpoint (smaller moves are within checkpoint-to-checkpoint noise).
TREND_MIN_MOVE = 0.02


def _distance_to_band(value: float, low: float, high: float) -> float:
    return max(low - value, 0.0, value - high)


def cosine_trend(series: list[dict[str, Any]], low: float, high: float) -> dict[str, Any]:
    """Claim 2 over training: per group, the settled cosine at the first and last checkpoint, its
    least-squares slope per 1,000 training steps, and whether it moved toward the band [low, high] by at
    least TREND_MIN_MOVE (or stayed inside it). ``holds``: every group did; None with one checkpoint."""
    names = list(series[-1]["settled_cosine"]) if series else []
    groups = []
    for name in names:
        points = [(entry["step"], entry["settled_cosine"].get(name)) for entry in series]
        points = [(step, value) for step, value in points if value is not None]
        if len(points) < 2:
            groups.append({"group": name, "points": len(points), "toward_band": None})
            continue
        steps = [p[0] for p in points]
        values = [p[1] for p in points]
        mean_step, mean_value = sum(steps) / len(steps), sum(values) / len(values)
        spread = sum((x - mean_step) ** 2 for x in steps)
        slope = (sum((x - mean_step) * (y - mean_value) for x, y in points) / spread * 1000.0) if spread else None
        before, after = _distance_to_band(values[0], low, high), _distance_to_band(values[-1], low, high)
        toward = after <= TOLERANCE or before - after >= TREND_MIN_MOVE - TOLERANCE
        groups.append({"group": name, "points": len(points), "first": values[0], "last": values[-1],
                       "slope_per_1000_steps": slope, "distance_first": before, "distance_last": after,
                       "toward_band": toward})
    judged = [g for g in groups if g["toward_band"] is not None]
    return {"groups": groups, "holds": all(g["toward_band"] for g in judged) if judged else None}


def _cosine_why(measured: list[dict], total: int, inside: int, values: str, trend: dict, checkpoints: int,
                low: float, high: float) -> list[str]:
    """Claim 2's reasons: the level per group, what a negative cosine means, the trend, and the paper's wording."""
    why = [f"{inside} of {total} groups settle inside {low:.2f}-{high:.2f} ({values})."]
    negative = [g["group"] for g in measured if g["settled_cosine"] < 0]
    if negative:
        why.append(f"Negative in group {', '.join(negative)}: each step partly undoes the last, an oscillating contraction "
                   "rather than a spiral.")
    if trend["holds"] is not None:
        moves = ", ".join(f"group {g['group']}: {g['first']:.2f} -> {g['last']:.2f}" for g in trend["groups"]
                          if g["toward_band"] is not None)
        why.append(f"Over {checkpoints} checkpoints ({moves}) the settled cosine "
                   + ("moves toward the band in every group." if trend["holds"] else
                      "does not move toward the band in every group."))
    why.append("The paper's wording pulls two ways: 'increasingly orthogonal' steps mean cosines falling toward 0, "
               "while its Figs. 3b/5 show cosines rising from low values and settling at 0.5-0.65 (60-50 degrees, "
               "far from orthogonal); the trend is judged as movement toward the band the figures show.")
    return why


def cosine_status(value: float | None, low: float, high: float, reason: str | None = None) -> str:
    """One group's settled cosine against the band [low, high] (compared within TOLERANCE): "inside",
    "collinear" (>= COLLINEAR), "near" (within NEAR_BAND of the band), "outside"; with no settled cosine,
    "not measured" (``reason`` "too few": the noise floor comes before five cosines after the decay; "no decay":
    the steps never decay and the budget ends before five cosines from SETTLED_AFTER) or "no plateau"
    (measured, never settles: a range or a trend)."""
    if value is None:
        return "not measured" if reason in ("too few", "no decay") else "no plateau"
    if low - TOLERANCE <= value <= high + TOLERANCE:
        return "inside"
    if value >= COLLINEAR - TOLERANCE:
        return "collinear"
    return "near" if _distance_to_band(value, low, high) <= NEAR_BAND + TOLERANCE else "outside"


def _require_settled_windows(final: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """RdepthError naming ``settled_cosine_window`` when a group's headline predates it."""
    for g in groups:
        if "settled_cosine_window" not in (g.get("headline") or {}):
            raise missing_field("settled_cosine_window", f"checkpoint {final['label']}, group {g['name']}",
                                "where the settled cosine is read, leaving out the step from the random start")
        if "reason" not in g["headline"]["settled_cosine_window"]:
            raise missing_field("settled_cosine_window.reason", f"checkpoint {final['label']}, group {g['name']}",
                                "the settled window after the step-size decay, with its trend test")


def _cosine_rows(groups: list[dict[str, Any]], low: float, high: float) -> list[dict[str, Any]]:
    """Claim 2 per group of one checkpoint: the settled cosine, its status against [low, high], the window
    it was read over and the first cosines."""
    per_group = []
    for g in groups:
        headline = g["headline"]
        window = headline["settled_cosine_window"]
        per_group.append({"group": g["name"], "settled_cosine": headline.get("settled_cosine"),
                          "status": cosine_status(headline.get("settled_cosine"), low, high, window.get("reason")),
                          "cosines_used": window["usable"], "window": window["window"],
                          "reason": window.get("reason"), "slope": window.get("slope"), "range": window.get("range"),
                          "cosines": [float(v) for v in g["cosine"]["mean"][:DECAY_BY_STEP]]})
    return per_group


def _cosine_series(summary: dict[str, Any], budget: str) -> list[dict[str, Any]]:
    """Claim 2 at every checkpoint: per group, the settled cosine at ``budget``."""
    return [{"checkpoint": entry["label"], "step": entry["step"],
             "settled_cosine": {g["name"]: g.get("headline", {}).get("settled_cosine")
                                for g in entry["budgets"][budget]["groups"]}}
            for entry in summary["checkpoints"]]


def _cosine_verdict(per_group: list[dict[str, Any]], trend_holds: bool | None) -> str:
    """Claim 2's verdict. Reproduced: every group inside the band. Not reproduced: some group collinear, or no
    group inside unless every group is near the band and the trend moves toward it in every group (then
    partly). Partly: some but not every group inside (a group that never settles, or was not measured,
    counts against it)."""
    statuses = [g["status"] for g in per_group]
    if "collinear" in statuses:
        return NOT
    inside = statuses.count("inside")
    if inside == len(statuses):
        return REPRODUCED
    if inside:
        return PARTLY
    return PARTLY if trend_holds and all(status == "near" for status in statuses) else NOT


def _cosine_values(per_group: list[dict[str, Any]]) -> str:
    """Per group, the settled cosine and the window it was read over (or "no plateau")."""
    return ", ".join(f"group {g['group']}: " + (f"{g['settled_cosine']:.2f} over {g['window'][0]}-{g['window'][1]}"
                                                 if g["settled_cosine"] is not None else _no_plateau_text(g))
                     for g in per_group)


def _no_plateau_text(g: dict[str, Any]) -> str:
    """Why a group has no settled cosine, with the numbers."""
    reason = g.get("reason")
    if reason == "trend":
        return (f"no plateau (cosines trend {g['slope']:+.3f} a step, beyond {TREND_T:g} standard errors, over "
                f"{g['window'][0]}-{g['window'][1]})")
    if reason == "range":
        return f"no plateau (cosines spread {g['range']:.2f} over {g['window'][0]}-{g['window'][1]})"
    if reason == "no decay":
        return (f"not measured (the steps never decay to a tenth of ||Δ(1)||, and fewer than 5 cosines from loop step "
                f"{SETTLED_AFTER} on are above the floor: {g['cosines_used']})")
    return f"not measured ({g['cosines_used']} cosines after the decay above the floor)"


def _settled_cosine_spread(groups: list[dict[str, Any]]) -> str:
    """Per group with one saved, the settled cosine's std over tokens."""
    return ", ".join(f"group {g['name']}: ± {g['headline']['settled_cosine_std']:.2f}" for g in groups
                     if (g.get("headline") or {}).get("settled_cosine_std") is not None)


def claim_cosine(summary: dict[str, Any], seeds: dict[str, Any] | None = None) -> dict[str, Any]:
    """Claim 2: consecutive-step cosines settle around 0.5-0.65, a slow spiral (Fig. 3b, Fig. 5), and get
    there over training ("increasingly orthogonal", judged as a trend over the checkpoint series)."""
    final, budget, groups = final_groups(summary)
    low, high = PAPER_COSINE[0] - COSINE_SLACK, PAPER_COSINE[1] + COSINE_SLACK
    floor = (summary.get("headline_definitions") or {}).get("noise_floor", 1e-3)
    _require_settled_windows(final, groups)
    per_group = _cosine_rows(groups, low, high)
    series = _cosine_series(summary, budget)
    result = new_claim("cosine", "Consecutive loop steps settle at cosines of about 0.5-0.65: a slow spiral, "
                                 "complementary rather than collinear pushes.",
                       {"figure": "Fig. 3b, Fig. 5", "value": f"settled cos(Δ(k), Δ(k-1)) ≈ {PAPER_COSINE[0]}-"
                                                              f"{PAPER_COSINE[1]} in later checkpoints"},
                       criteria=f"per group, the settled cosine: the mean of the last 5 cosines j after the step-size "
                                "decay (the first step at 1/10 of ||Δ(1)||; when the mean step never gets there, "
                                f"from loop step {SETTLED_AFTER}; cos(Δ(0), Δ(1)), from the random start, never "
                                f"counts) whose steps are above the noise floor (the larger of {floor:g} of ||Δ(1)|| "
                                "and 32 x the precision's epsilon x ||x||), when 5 such cosines exist, stay within "
                                f"0.2 of each other and show no trend (a least-squares slope above {SETTLED_SLOPE:g} a "
                                f"step and above {TREND_T:g} standard errors); 'no plateau' when the cosines were "
                                "measured but never settle (a negative result), 'not measured' when the floor or the "
                                "end of the budget comes first; final checkpoint, "
                                f"'{budget}' budget, bounds compared within {TOLERANCE:g}. Reproduced when every group "
                                f"is within {low:.2f}-{high:.2f}; not reproduced when some group is collinear (>= "
                                f"{COLLINEAR:g}, the opposite of 'increasingly orthogonal'); partly when some but not "
                                "every group is inside, or when none is but every group settles within "
                                f"{NEAR_BAND:g} of the band and moves toward it by >= {TREND_MIN_MOVE:g} from the "
                                "first to the last "
                                "checkpoint in every group; not reproduced otherwise (a group with no plateau counts "
                                "against the claim); not tested when no group could be measured")
    if all(g["status"] == "not measured" for g in per_group):
        counts = ", ".join(f"group {g['group']}: {g['cosines_used']} cosines above the floor" for g in per_group)
        return untested(result, f"no group has 5 cosines after the step-size decay (or, without one, from loop step "
                                f"{SETTLED_AFTER}) above the noise floor ({counts})")
    measured = [g for g in per_group if g["settled_cosine"] is not None]
    inside = sum(g["status"] == "inside" for g in per_group)
    collinear = [g["group"] for g in per_group if g["status"] == "collinear"]
    values = _cosine_values(per_group)
    trend = cosine_trend(series, low, high)
    verdict = _cosine_verdict(per_group, trend["holds"])
    why = _cosine_why(measured, len(per_group), inside, values, trend, len(series), low, high)
    if collinear:
        why.insert(1, f"Collinear in group {', '.join(collinear)} (settled cosine >= {COLLINEAR:g}): consecutive "
                      "steps push in one direction, the opposite of 'increasingly orthogonal'.")
    spread = _settled_cosine_spread(groups)
    result.update(verdict=verdict, why=why, ours={"value": f"settled cosine {values}", "groups": per_group,
                                                  "series": series, "trend": trend, "budget": budget,
                                                  "checkpoint": final["label"]})
    result["judged_on"] = judged_on(summary, budget, final["budgets"][budget].get("loop_counts"),
                                    f"cosine std over tokens at the settled steps: {spread}" if spread else None,
                                    seeds, final["label"])
    return result
