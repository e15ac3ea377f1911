"""Claim 2: consecutive-step cosines settle around 0.5-0.65, a slow spiral (Fig. 3b, Fig. 5), and get there
over training.
"""

from __future__ import annotations

from typing import Any

from rdepth.reproduce.claims.step_decay import DECAY_BY_STEP
from rdepth.reproduce.claims.verdict import (NOT, PARTLY, count_verdict, final_groups, judged_on, missing_field,
                                            new_claim, untested)

# Claim 2: the paper's band of settled consecutive-step cosines, and the slack allowed around it.
PAPER_COSINE = (0.5, 0.65)
COSINE_SLACK = 0.05
# ... and a settled cosine at or above this is collinear: the opposite of "increasingly orthogonal".
COLLINEAR = 0.9
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
        toward = after == 0.0 or before - after >= TREND_MIN_MOVE
        groups.append({"group": name, "points": len(points), "first": values[0], "last": values[-1],
                       "slope_per_1000_steps": slope, "distance_first": before, "distance_last": after,
                       "toward_band": toward})
    judged = [g for g in groups if g["toward_band"] is not None]
    return {"groups": groups, "holds": all(g["toward_band"] for g in judged) if judged else None}


def _cosine_why(measured: list[dict], inside: int, values: str, trend: dict, checkpoints: int,
                low: float, high: float) -> list[str]:
    """Claim 2's reasons: the level per group, what a negative cosine means, the trend, and the paper's wording."""
    why = [f"{inside} of {len(measured)} groups settle inside {low:.2f}-{high:.2f} ({values})."]
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


def cosine_status(value: float | None, low: float, high: float) -> str:
    """One group's settled cosine: "no plateau" (None), "inside" the band, "collinear" (>= COLLINEAR) or "outside"."""
    if value is None:
        return "no plateau"
    if low <= value <= high:
        return "inside"
    return "collinear" if value >= COLLINEAR else "outside"


def _require_settled_windows(final: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """RdepthError naming ``settled_cosine_window`` when a group's headline predates it."""
    for g in groups:
        if "settled_cosine_window" not in (g.get("headline") or {}):
            raise missing_field("settled_cosine_window", f"checkpoint {final['label']}, group {g['name']}",
                                "where the settled cosine is read, leaving out the step from the random start")


def _cosine_rows(groups: list[dict[str, Any]], low: float, high: float) -> list[dict[str, Any]]:
    """Claim 2 per group of one checkpoint: the settled cosine, its status against [low, high], the window
    it was read over and the first cosines."""
    per_group = []
    for g in groups:
        headline = g["headline"]
        window = headline["settled_cosine_window"]
        per_group.append({"group": g["name"], "settled_cosine": headline.get("settled_cosine"),
                          "status": cosine_status(headline.get("settled_cosine"), low, high),
                          "cosines_used": window["usable"], "window": window["window"],
                          "cosines": [float(v) for v in g["cosine"]["mean"][:DECAY_BY_STEP]]})
    return per_group


def _cosine_series(summary: dict[str, Any], budget: str) -> list[dict[str, Any]]:
    """Claim 2 at every checkpoint: per group, the settled cosine at ``budget``."""
    return [{"checkpoint": entry["label"], "step": entry["step"],
             "settled_cosine": {g["name"]: g.get("headline", {}).get("settled_cosine")
                                for g in entry["budgets"][budget]["groups"]}}
            for entry in summary["checkpoints"]]


def _cosine_level(per_group: list[dict[str, Any]], measured: list[dict[str, Any]], inside: int) -> str:
    """Claim 2's level: reproduced when every group is inside the band, partly when some group is or every
    settled group is positive."""
    verdict = count_verdict(inside, len(per_group))
    if verdict == NOT and all(g["settled_cosine"] > 0 for g in measured):
        verdict = PARTLY
    return verdict


def _cosine_with_trend(verdict: str, holds: bool | None) -> str:
    """Claim 2's level graded by its trend over training (``holds``: :func:`cosine_trend`'s)."""
    if verdict == NOT and holds:
        return PARTLY  # not there yet, but getting there: the "increasingly" half of the claim
    return verdict


def _cosine_values(per_group: list[dict[str, Any]]) -> str:
    """Per group, the settled cosine and the window it was read over (or "no plateau")."""
    return ", ".join(f"group {g['group']}: " + (f"{g['settled_cosine']:.2f} over {g['window'][0]}-{g['window'][1]}"
                                                 if g["settled_cosine"] is not None else "no plateau")
                     for g in per_group)


def _settled_cosine_spread(groups: list[dict[str, Any]]) -> str:
    """Per group with one saved, the settled cosine's std over tokens."""
    return ", ".join(f"group {g['name']}: ± {g['headline']['settled_cosine_std']:.2f}" for g in groups
                     if (g.get("headline") or {}).get("settled_cosine_std") is not None)


def claim_cosine(summary: dict[str, Any], seeds: dict[str, Any] | None = None) -> dict[str, Any]:
    """Claim 2: consecutive-step cosines settle around 0.5-0.65, a slow spiral (Fig. 3b, Fig. 5), and get
    there over training ("increasingly orthogonal", judged as a trend over the checkpoint series)."""
    final, budget, groups = final_groups(summary)
    low, high = PAPER_COSINE[0] - COSINE_SLACK, PAPER_COSINE[1] + COSINE_SLACK
    _require_settled_windows(final, groups)
    per_group = _cosine_rows(groups, low, high)
    series = _cosine_series(summary, budget)
    result = new_claim("cosine", "Consecutive loop steps settle at cosines of about 0.5-0.65: a slow spiral, "
                              "complementary rather than collinear pushes.",
                    {"figure": "Fig. 3b, Fig. 5", "value": f"settled cos(Δ(k), Δ(k-1)) ≈ {PAPER_COSINE[0]}-"
                                                           f"{PAPER_COSINE[1]} in later checkpoints"},
                    criteria=f"per group, the settled cosine: the mean of the last 5 cosines j >= 1 (cos(Δ(0), Δ(1)), "
                             "from the random start, left out) whose steps are above the noise floor, when 5 such "
                             "cosines exist and stay within 0.2 of each other ('no plateau' otherwise); final "
                             f"checkpoint, '{budget}' budget. Reproduced when every group is within {low:.2f}-{high:.2f}; "
                             f"not reproduced when some group is collinear (>= {COLLINEAR:g}, the opposite of "
                             "'increasingly orthogonal'); otherwise partly when some group is inside or every "
                             "settled group is positive, or when the settled cosine moves toward the band by "
                             f">= {TREND_MIN_MOVE:g} from the first to the last checkpoint in every group")
    measured = [g for g in per_group if g["settled_cosine"] is not None]
    if not measured:
        counts = ", ".join(f"group {g['group']}: {g['cosines_used']} cosines above the floor" for g in per_group)
        return untested(result, f"no plateau: no group has 5 settled cosines above the noise floor ({counts})")
    inside = sum(g["status"] == "inside" for g in per_group)
    collinear = [g["group"] for g in per_group if g["status"] == "collinear"]
    level = _cosine_level(per_group, measured, inside)
    values = _cosine_values(per_group)
    trend = cosine_trend(series, low, high)
    verdict = NOT if collinear else _cosine_with_trend(level, trend["holds"])
    why = _cosine_why(measured, inside, values, trend, len(series), low, high)
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
