"""The step-norm plateau (§4): step norms level off at a small nonzero value, which fools a step-norm exit.

The paper: "A pure norm threshold can be fooled by this regime (norms plateau at a small nonzero value due to
rotation)" (§4). Two bars, both needed (:func:`rdepth.geometry.summary.plateau`): "plateau", the mean step
shrinks by less than PLATEAU_MAX_DECAY over the last PLATEAU_WINDOW steps (a loop still contracting is no
plateau, however slowly it started); "nonzero", the last step is above the noise floor, the larger of a share
of ||Δ(1)|| and 32 x the precision's epsilon x ||x|| (issue 67: a floor relative to ||Δ(1)|| alone, 1e-3 in
float32, read the same trajectory differently in float32 and float64).
"""

from __future__ import annotations

from typing import Any

from rdepth.reproduce.claims.verdict import count_verdict, final_groups, judged_on, new_claim, untested


def claim_plateau(summary: dict[str, Any], seeds: dict[str, Any] | None = None) -> dict[str, Any]:
    """The step-norm plateau (§4): 'norms plateau at a small nonzero value due to rotation'."""
    final, budget, groups = final_groups(summary)
    definitions = summary.get("headline_definitions") or {}
    window, decay = definitions.get("plateau_window", 10), definitions.get("plateau_max_decay", 2.0)
    result = new_claim("plateau", "Step norms plateau at a small nonzero value (the loop keeps turning instead of "
                                  "stopping), which fools a step-norm exit.",
                       {"figure": "§4, Fig. 3a", "value": "step norms level off at a small nonzero value"},
                       criteria=f"per group, over the last {window} steps of the '{budget}' budget at the final "
                                f"checkpoint, the mean step size shrinks by less than {decay:g}x and the last step is "
                                f"above the noise floor (the larger of {definitions.get('noise_floor', 1e-3):g} x the "
                                "first refinement step ||Δ(1)||, the loop's own scale, and 32 x the precision's "
                                "epsilon x the state's norm, its rounding); reproduced when every group "
                                "plateaus, partly when some do")
    per_group = [{"group": g["name"], **((g.get("headline") or {}).get("plateau") or {})} for g in groups]
    measured = [g for g in per_group if "holds" in g]
    if not measured:
        return untested(result, f"the '{budget}' budget is shorter than the {window}-step window")
    held = sum(g["holds"] for g in measured)
    verdict = count_verdict(held, len(measured))
    text = ", ".join(f"group {g['group']}: x{g['ratio']:.2g} over {window} steps" if g["ratio"] is not None
                     else f"group {g['group']}: zero steps" for g in measured)
    result.update(verdict=verdict, why=[f"{held} of {len(measured)} groups level off ({text}); a loop that contracts "
                                        "to the float floor does not plateau."],
                  ours={"value": f"last/first step size over the last {window} steps: {text}", "groups": per_group,
                        "budget": budget, "checkpoint": final["label"]})
    spread = ", ".join(f"group {g['name']}: {g['step_size']['mean'][-1]:.3g} ± {g['step_size']['std'][-1]:.2g}"
                       for g in groups)
    result["judged_on"] = judged_on(summary, budget, final["budgets"][budget].get("loop_counts"),
                                    f"last step size over tokens (mean ± std): {spread}", seeds, final["label"])
    return result
