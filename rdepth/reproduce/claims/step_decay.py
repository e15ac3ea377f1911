"""Claim 1: loop-step sizes decay within 5-10 steps (Fig. 3a), faster in later checkpoints (§3 (iii)).
"""

from __future__ import annotations

from typing import Any

from rdepth.geometry.summary import DECAYED_FRACTION
from rdepth.geometry.summary import decayed_step as decay_step
from rdepth.reproduce.claims.verdict import (
    NOT,
    PARTLY,
    REPRODUCED,
    count_verdict,
    final_groups,
    judged_on,
    new_claim,
    untested,
)

# Claim 1: a step has shrunk to this fraction of the first refinement step ||Delta^(1)|| (decay_step:
# rdepth.geometry.summary.decayed_step, which also starts the settled-cosine window) ...
DECAY_FRACTION = DECAYED_FRACTION
# ... by this loop step (the paper: "within 5-10 steps").
DECAY_BY_STEP = 10
# Claim 1's trend ("faster norm decay in later checkpoints"): the step size left at step DECAY_BY_STEP,
# ||Δ(k)|| / ||Δ(1)||, must be at most this share of the first checkpoint's at the last one.
DECAY_TREND_FACTOR = 0.9


def decay_left(sizes: list[float]) -> float | None:
    """||Δ(k)|| / ||Δ(1)|| at k = DECAY_BY_STEP (or the last step when the loop is shorter): the share of the
    first refinement step left; None when the loop has fewer than three steps or a zero step 1."""
    if len(sizes) < 3 or not sizes[1] > 0:
        return None
    return sizes[min(DECAY_BY_STEP, len(sizes) - 1)] / sizes[1]


def decay_trend(series: list[dict[str, Any]]) -> dict[str, Any]:
    """Claim 1 over training: per group, :func:`decay_left` at the first and the last checkpoint; ``faster``
    when the last is at most DECAY_TREND_FACTOR x the first. ``holds``: every group decays faster; None with
    one checkpoint (or no group measured at two)."""
    names = list(series[-1]["decay_left"]) if series else []
    groups = []
    for name in names:
        points = [entry["decay_left"].get(name) for entry in series]
        points = [value for value in points if value is not None]
        if len(points) < 2:
            groups.append({"group": name, "points": len(points), "faster": None})
            continue
        first, last = points[0], points[-1]
        groups.append({"group": name, "points": len(points), "first": first, "last": last,
                       "faster": last <= DECAY_TREND_FACTOR * first})
    judged = [g for g in groups if g["faster"] is not None]
    return {"groups": groups, "holds": all(g["faster"] for g in judged) if judged else None}


def _decay_rows(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Claim 1 per group of one checkpoint: its decay step (:func:`decay_step`), the first step sizes and
    the saved headline decay numbers."""
    per_group = []
    for group in groups:
        sizes = group["step_size"]["mean"]
        headline = group.get("headline", {})
        per_group.append({"group": group["name"], "decay_step": decay_step(sizes), "steps": len(sizes),
                          "step_sizes": [float(v) for v in sizes[:DECAY_BY_STEP + 1]],
                          "decay_10_over_1": headline.get("decay_10_over_1"),
                          "noise_floor_step": headline.get("noise_floor_step")})
    return per_group


def _decay_series(summary: dict[str, Any], budget: str) -> list[dict[str, Any]]:
    """Claim 1 at every checkpoint: per group, its decay step and :func:`decay_left` at ``budget``."""
    return [{"checkpoint": entry["label"], "step": entry["step"],
             "decay_step": {g["name"]: decay_step(g["step_size"]["mean"])
                            for g in entry["budgets"][budget]["groups"]},
             "decay_left": {g["name"]: decay_left(g["step_size"]["mean"])
                            for g in entry["budgets"][budget]["groups"]}}
            for entry in summary["checkpoints"]]


def _decay_held(per_group: list[dict[str, Any]]) -> int:
    """The groups whose step size has decayed by DECAY_BY_STEP."""
    return sum(g["decay_step"] is not None and g["decay_step"] <= DECAY_BY_STEP for g in per_group)


def _decay_level(per_group: list[dict[str, Any]], held: int) -> str:
    """Claim 1's level: reproduced when every group decays by DECAY_BY_STEP, partly when some do or every
    group's decay comes later."""
    verdict = count_verdict(held, len(per_group))
    if verdict == NOT and any(g["decay_step"] is not None for g in per_group):
        verdict = PARTLY
    return verdict


def _decay_with_trend(verdict: str, holds: bool | None) -> str:
    """Claim 1's level graded by its trend over training (``holds``: :func:`decay_trend`'s)."""
    if holds is False and verdict == REPRODUCED:
        return PARTLY  # decays in time, but not faster over training
    if holds and verdict == NOT:
        return PARTLY  # never decays 10x in time, but faster over training
    return verdict


def _decay_moves(trend: dict[str, Any]) -> str:
    """Per group judged over training, the step size left at the first -> the last checkpoint."""
    return ", ".join(f"group {g['group']}: {g['first']:.2g} -> {g['last']:.2g}" for g in trend["groups"]
                     if g["faster"] is not None)


def _decay_value(per_group: list[dict[str, Any]], trend: dict[str, Any]) -> str:
    """Claim 1's measured value: each group's decay step, then the trend's moves when judged."""
    text = ", ".join(f"group {g['group']}: " + ("never" if g["decay_step"] is None else f"step {g['decay_step']}")
                     for g in per_group)
    value = f"step size at 1/{round(1 / DECAY_FRACTION)} of step 1 by {text}"
    if trend["holds"] is not None:
        value += f"; ||Δ({DECAY_BY_STEP})||/||Δ(1)|| first -> last checkpoint: " + _decay_moves(trend)
    return value


def _decay_why(per_group: list[dict[str, Any]], held: int, checkpoint: str, trend: dict[str, Any],
               checkpoints: int) -> list[str]:
    """Claim 1's reasons: the level at the final checkpoint, then the trend over training."""
    why = [f"{held} of {len(per_group)} groups decay {round(1 / DECAY_FRACTION)}x by step {DECAY_BY_STEP} "
           f"at the final checkpoint ({checkpoint})."]
    if trend["holds"] is None:
        why.append("Trend over training not tested: one checkpoint.")
    else:
        why.append(f"||Δ({DECAY_BY_STEP})|| / ||Δ(1)|| from the first to the last of {checkpoints} "
                   f"checkpoints ({_decay_moves(trend)}): " + ("faster decay in every group." if trend["holds"] else
                                                              "not faster in every group."))
    return why


def _first_step_spread(groups: list[dict[str, Any]]) -> str:
    """Per group with a refinement step, ||Δ(1)||'s mean ± std over tokens."""
    return ", ".join(f"group {g['name']}: ||Δ(1)|| {g['step_size']['mean'][1]:.3g} ± {g['step_size']['std'][1]:.2g}"
                     for g in groups if len(g["step_size"]["mean"]) > 1)


def claim_step_decay(summary: dict[str, Any], seeds: dict[str, Any] | None = None) -> dict[str, Any]:
    """Claim 1: loop-step sizes decay within 5-10 steps (Fig. 3a), faster in later checkpoints (§3 (iii))."""
    final, budget, groups = final_groups(summary)
    per_group = _decay_rows(groups)
    series = _decay_series(summary, budget)
    result = new_claim("step_decay", "Loop-step sizes ||Δ(k)|| decay quickly, within 5-10 loop steps, and faster in "
                                     "later checkpoints.",
                       {"figure": "Fig. 3a, §3 (iii)", "value": "decay within 5-10 steps, every group and checkpoint; "
                                                                 "faster norm decay in later checkpoints"},
                       criteria=f"level: per group, the first step k >= 2 with mean ||Δ(k)|| <= {DECAY_FRACTION:g} x "
                                f"||Δ(1)|| (step 0 is the jump from the random start), final checkpoint, '{budget}' "
                                f"budget; met when every group gets there by step {DECAY_BY_STEP}, partly when some do "
                                f"or all do later. Trend: per group, ||Δ({DECAY_BY_STEP})|| / ||Δ(1)|| at the last "
                                f"checkpoint at most {DECAY_TREND_FACTOR:g} x the first checkpoint's. Reproduced when "
                                "the level is met and the trend holds (or cannot be tested: one checkpoint), partly "
                                "when one of them holds")
    if not per_group:
        return untested(result, "the model has no looped group")
    held = _decay_held(per_group)
    level = _decay_level(per_group, held)
    trend = decay_trend(series)
    result.update(verdict=_decay_with_trend(level, trend["holds"]),
                  ours={"value": _decay_value(per_group, trend), "groups": per_group, "series": series,
                        "trend": trend, "budget": budget, "checkpoint": final["label"]})
    result["why"] = _decay_why(per_group, held, final["label"], trend, len(series))
    spread = _first_step_spread(groups)
    result["judged_on"] = judged_on(summary, budget, final["budgets"][budget].get("loop_counts"),
                                    f"over tokens (mean ± std): {spread}" if spread else None, seeds, final["label"])
    return result
