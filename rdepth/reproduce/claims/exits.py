"""Claim 4: the acceleration exit keeps perplexity flat at lower latency than KL, step-norm falls off a cliff
(Fig. 4); judged along the rules' quality-versus-cost fronts (:mod:`rdepth.reproduce.fronts`).

What the paper says, and how each part is read:

* "These tests show that, at same quality, acceleration dominates KL on latency and avoids the step-norm
  quality cliff" (§4), and "acceleration and KL keep PPL/CE essentially flat across thresholds": on such flat
  fronts a perplexity difference inside one held-out set's noise moves the cost a lot and means nothing, so
  "same quality" is equal within FRONT_QUALITY_SLACK, with the slack always on the side that makes "cheaper"
  hard to claim (:func:`rdepth.reproduce.fronts.at_matched_quality`): acceleration must save at least
  FRONT_MIN_SAVING against the least the other rule pays anywhere within the slack of that quality, and be
  dearer nowhere.
* "the method is more robust to threshold variation" and "avoids the instability of step-norm under
  aggressive thresholds": stable when no step from one threshold to the next on the whole grid raises
  perplexity by more than the sweep's tolerance, and no threshold diverges (a non-finite perplexity).
* "a better latency-quality trade-off than step-norm and KL-based baselines": the two comparisons, against KL
  and against the first-order step-norm rule, are reported each on its own; "partly" says which holds.
"""

from __future__ import annotations

import math
from typing import Any

from rdepth.reproduce.claims.paper_grid import MIN_STEPS_SAVED, paper_grid, paper_grid_why, policy_rows
from rdepth.reproduce.claims.verdict import NOT, PARTLY, REPRODUCED, new_claim, untested

# Claim 4 along fronts: the rules compared, each swept on a grid spanning its own range (SCALE_FREE_GRID in
# rdepth/reproduce/config.py): acceleration and step-norm in their scale-free forms (Eq. 6's bounded
# acceleration; the step over the state's norm), KL in nats.
FRONT_RULES = {"acceleration": "acceleration_rel", "kl": "kl", "step_norm": "step_norm_rel"}
# ... two qualities are the same when they differ by at most this perplexity rise (one sweep seed: about the
# change between neighbouring thresholds of a flat rule), both for whole-front dominance and at matched quality
# (issue 67: compared at exactly equal quality, a front shifted by half of it read a 35% saving) ...
FRONT_QUALITY_SLACK = 0.002
# ... and costs at most this share more executed steps (the ms/token axis uses the sweep's timing noise).
FRONT_STEPS_SLACK = 0.01
# Claim 4 is decided at matched quality, where both rules' fronts reach within the quality slack (points more
# than the slack beyond the other front's range decide nothing): acceleration is cheaper than a rule when it
# matches every point of the rule's front at no more than its cost x (1 + the slack above) and somewhere saves at
# least this share (and at least the cost slack: on the ms/token axis, the timing noise) of the least the rule
# pays within the quality slack. 5% of the loop steps is one step in twenty.
FRONT_MIN_SAVING = 0.05
# Stability (the paper's "more robust to threshold variation"): from every threshold on the grid to the next,
# perplexity rises by at most the sweep's tolerance (a cliff anywhere is a cliff, whatever the threshold before
# it kept), and no threshold's perplexity is non-finite (a diverged setting is the least stable of all).
# The comparisons are named in the verdict's text by what the paper calls them.
RULE_NAMES = {"kl": "KL", "step_norm_rel": "the first-order step-norm rule"}


def _front_points(rows: list[dict], full: tuple[float, float] | None, cost: str) -> list[tuple[float, float]]:
    """A rule's (cost, quality) points, quality = -(perplexity rise), with the full budget's point (every rule
    computes the full budget as its threshold goes to 0); [] when some point lacks the cost. Quality is capped
    at the full budget's (0): a threshold that reads a lower perplexity than computing every step is the noise
    of one held-out set, and a rule credited with it would have a quality range no other rule shares."""
    if any(row.get(cost) is None for row in rows):
        return []
    return [(float(row[cost]), min(-row["ppl_rise"], 0.0)) for row in rows] + ([full] if full else [])


def _front_axes(summary: dict[str, Any], reference: dict[str, Any]) -> dict[str, tuple[str, tuple[float, float], float]]:
    """The cost axes the fronts are compared on, each as (row key, the full budget's point, cost slack):
    executed loop steps always, decode ms/token when the sweep timed the full budget."""
    full_steps = float(summary.get("full_steps") or sum(reference.get("mean_steps") or reference.get("budget") or [0]))
    latency = summary.get("latency_key")
    axes = {"steps": ("steps", (full_steps, 0.0), FRONT_STEPS_SLACK)}
    if latency and reference.get(latency) is not None:
        key = latency.replace("ms_per_token_", "")
        row_key = {"b1": "ms_per_token_b1", "generate": "ms_per_token_generate"}.get(key)
        if row_key:
            axes["ms/token"] = (row_key, (float(reference[latency]), 0.0), summary.get("noise_threshold", 0.1))
    return axes


def _compare_fronts(policies: dict[str, list[dict]], judged: str, other: str,
                    axes: dict[str, tuple[str, tuple[float, float], float]]) -> dict[str, Any]:
    """``judged``'s front against ``other``'s, per axis where both have points: at matched quality within
    FRONT_QUALITY_SLACK (:func:`rdepth.reproduce.fronts.at_matched_quality`, which decides) and, reported, the
    dominance of the whole fronts (:func:`rdepth.reproduce.fronts.dominates`). ``cheaper``: cheaper at matched
    quality on every such axis; ``costlier``: the other rule is, on some axis."""
    from rdepth.reproduce.fronts import at_matched_quality, dominates

    per_axis = {}
    for axis, (cost, full, slack) in axes.items():
        mine, theirs = (_front_points(policies[name], full, cost) for name in (judged, other))
        if not mine or not theirs:
            continue
        per_axis[axis] = {**dominates(mine, theirs, slack, FRONT_QUALITY_SLACK),
                          "matched": at_matched_quality(mine, theirs, slack, max(FRONT_MIN_SAVING, slack),
                                                        FRONT_QUALITY_SLACK)}
    return {"axes": per_axis,
            "cheaper": bool(per_axis) and all(c["matched"]["cheaper"] for c in per_axis.values()),
            "costlier": any(c["matched"]["costlier"] for c in per_axis.values()),
            "dominates": bool(per_axis) and all(c["dominates"] for c in per_axis.values()),
            "dominated": any(dominates(_front_points(policies[other], axes[axis][1], axes[axis][0]),
                                       _front_points(policies[judged], axes[axis][1], axes[axis][0]),
                                       axes[axis][2], FRONT_QUALITY_SLACK)["dominates"]
                             for axis in per_axis)}


def exit_fronts(sweep: dict[str, Any], policies: dict[str, list[dict]]) -> dict[str, Any]:
    """Claim 4 along fronts: per cost axis (executed loop steps; decode ms/token when timed), whether the
    acceleration rule is cheaper than KL and step-norm at matched quality (:func:`_compare_fronts`); per rule
    its stability (``stability``: the largest perplexity change between neighbouring thresholds; ``jump``: the
    largest rise from one threshold to the next over the whole grid, inf when some threshold's perplexity is
    not finite, :func:`rdepth.reproduce.fronts.largest_rise`) and whether acceleration is ``stable`` (its jump
    at most the tolerance; None when it has fewer than two thresholds)."""
    from rdepth.reproduce.fronts import largest_rise, neighbour_spread

    tolerance = sweep["summary"]["tolerance"]
    axes = _front_axes(sweep["summary"], sweep["reference"])
    judged = FRONT_RULES["acceleration"]
    comparisons = {other: _compare_fronts(policies, judged, other, axes)
                   for other in (FRONT_RULES["kl"], FRONT_RULES["step_norm"])}
    stability = {name: neighbour_spread([row["ppl_rise"] for row in rows]) for name, rows in policies.items() if rows}
    jump = {name: largest_rise([row["ppl_rise"] for row in rows]) for name, rows in policies.items() if rows}
    stable = None if jump.get(judged) is None else jump[judged] <= tolerance + 1e-12
    return {"rule": judged, "axes": list(axes), "comparisons": comparisons, "stability": stability, "jump": jump,
            "stable": stable, "stability_bar": tolerance,
            "taus": {name: [row["tau"] for row in rows] for name, rows in policies.items() if rows}}


def _matched_text(other: str, result: dict[str, Any]) -> str:
    """One axis's comparison at matched quality: the shared perplexity range and the largest saving there."""
    matched = result["matched"]
    if matched["shared"] is None:
        return "no shared quality range"
    where = f"over the shared {_shared_text(matched)}"
    if matched["cheaper"]:
        return f"cheaper than {other} {where} ({_saving_text(matched['saving'])})"
    if matched["costlier"]:
        return f"costlier than {other} {where}"
    dearer = (f"; {len(matched['unmatched'])} of {other}'s points cost less than acceleration pays within the "
              "slack" if matched.get("unmatched") else "")
    return f"not cheaper than {other} {where} ({_saving_text(matched['saving'])}{dearer})"


def _shared_text(matched: dict[str, Any]) -> str:
    """The shared quality range as perplexity rises over the full budget (quality is -rise, capped at 0)."""
    low, high = matched["shared"]
    return (f"perplexity rise {100 * (0.0 - high):.2f}% to {100 * (0.0 - low):.2f}% (equal within "
            f"{100 * matched.get('quality_slack', 0.0):g}%)")


def _saving_text(saving: float) -> str:
    return f"saves up to {100 * saving:.1f}%" if saving >= 0 else f"at least {100 * -saving:.1f}% dearer everywhere"


def _fronts_why(fronts: dict[str, Any]) -> list[str]:
    why = []
    judged = fronts["rule"]
    for other, comparison in fronts["comparisons"].items():
        for axis, result in comparison["axes"].items():
            if result["dominates"]:
                text = "dominates"
            elif result["covers"]:
                text = "matches it but is better nowhere"
            else:
                text = (f"leaves {len(result['unmatched'])} of {other}'s {len(result['other_front'])} front "
                        "points unmatched")
            why.append(f"{judged} against {other}, quality vs {axis}: at matched quality "
                       f"{_matched_text(other, result)}; whole fronts (reported): {text}.")
        if comparison["dominated"]:
            why.append(f"{other}'s front dominates {judged}'s.")
    bar = 100 * fronts["stability_bar"]
    jump = fronts["jump"].get(judged)
    rise = ("n/a (fewer than two thresholds)" if jump is None else "a threshold diverged (non-finite perplexity)"
            if math.isinf(jump) else f"{100 * jump:+.2f}% at most")
    why.append(f"Stability: from one threshold to the next, over the whole grid, perplexity rises by {rise} for "
               f"{judged} (" + ("stable" if fronts["stable"] else "not stable" if fronts["stable"] is False
                                else "not tested") + f": the bar is {bar:g}%). Largest change between "
               f"neighbouring thresholds, one sweep seed: {_stability_text(fronts)}.")
    return why


def _stability_text(fronts: dict[str, Any]) -> str:
    """Per rule, the largest perplexity change between neighbouring thresholds, in percent."""
    return ", ".join(f"{name} {100 * value:.2f}%" for name, value in fronts["stability"].items() if value is not None)


def _fronts_verdict(cheaper: list[str], fronts: dict[str, Any]) -> str:
    """Claim 4's verdict: reproduced when acceleration is cheaper than every other rule at matched quality and
    stable; partly when it is cheaper than some rule (or than all, with stability failed or not tested);
    not reproduced when it is cheaper than none."""
    if not cheaper:
        return NOT
    return REPRODUCED if len(cheaper) == len(fronts["comparisons"]) and fronts["stable"] else PARTLY


def comparisons_held(fronts: dict[str, Any]) -> dict[str, Any]:
    """Which of the paper's comparisons hold: per other rule, cheaper at matched quality (True/False), and
    ``stable`` (True/False/None)."""
    return {**{other: bool(c["cheaper"]) for other, c in fronts["comparisons"].items()}, "stable": fronts["stable"]}


def verdict_note(held: dict[str, Any]) -> str:
    """One clause for the verdict: which comparisons hold (against KL, against the first-order step-norm rule)
    and whether acceleration is stable."""
    names = [other for other in held if other != "stable"]
    won = [RULE_NAMES.get(other, other) for other in names if held[other]]
    lost = [RULE_NAMES.get(other, other) for other in names if not held[other]]
    text = ("cheaper at matched quality than " + " and ".join(won) if won else
            "cheaper at matched quality than neither rule")
    if won and lost:
        text += ", not than " + " or ".join(lost)
    stable = held["stable"]
    return text + ("; stable" if stable else "; not stable" if stable is False else "; stability not tested")


def _fronts_value(fronts: dict[str, Any]) -> str:
    """Per other rule and cost axis, whether acceleration is cheaper at matched quality over the shared
    perplexity range (the range the verdict rests on); its stability."""
    def axis_text(axis: str, result: dict[str, Any]) -> str:
        matched = result["matched"]
        if matched["shared"] is None:
            return f"{axis} no shared quality range"
        return (f"{axis} {'cheaper' if matched['cheaper'] else 'not cheaper'} over {_shared_text(matched)} "
                f"({_saving_text(matched['saving'])})")

    return verdict_note(comparisons_held(fronts)) + ". " + "; ".join(
        f"{FRONT_RULES['acceleration']} vs {other} at matched quality: "
        + ", ".join(axis_text(axis, r) for axis, r in c["axes"].items())
        for other, c in fronts["comparisons"].items()) + "; " + (
        "stable" if fronts["stable"] else "not stable" if fronts["stable"] is False else "stability not tested")


def _exits_judged_on(sweep: dict[str, Any], seeds: dict[str, Any] | None, fronts: dict[str, Any]) -> dict[str, Any]:
    """What claim 4 rests on: the full budget and the exit sweep, its autocast, seeds and the fronts' stability."""
    config = sweep.get("config") or {}
    return {"budget": "full budget and exit sweep", "loops": sweep["reference"].get("budget"),
            "precision": f"autocast {config.get('autocast', 'none')}",
            "seeds": {**(seeds or {}), "sweep": config.get("seed")},
            "tokens": None, "checkpoint": None,
            "spread": f"perplexity between neighbouring thresholds (one seed): {_stability_text(fronts)}"}


def claim_exits(sweep: dict[str, Any], seeds: dict[str, Any] | None = None) -> dict[str, Any]:
    """Claim 4: acceleration keeps perplexity flat at lower latency than KL; step-norm falls off a cliff above
    tau = 1e-3 (Fig. 4). Judged along the rules' quality-versus-cost fronts on scale-free threshold grids
    (:func:`exit_fronts`); the paper's absolute grid (checks (a)-(c)) is reported as one row, not judged."""
    summary = sweep["summary"]
    tolerance = summary["tolerance"]
    rules = FRONT_RULES
    result = new_claim("exits", "The acceleration exit keeps perplexity flat at lower latency than KL, while step-norm "
                                "loses quality beyond tau = 1e-3 and sharply at 1e-2.",
                       {"figure": "Fig. 4", "value": "acceleration ~580 -> 360 ms/token from tau 1e-5 to 1e-2 at flat "
                                                     "PPL; KL flat but slower; step-norm degrades beyond 1e-3"},
                       criteria=f"per rule, the front of (cost, quality) points over a threshold grid that spans the "
                                f"rule's own range (scale-free: {rules['acceleration']}, {rules['kl']}, "
                                f"{rules['step_norm']}), with the full budget's point; quality = -perplexity rise, "
                                "cost = executed loop steps and, when timed, decode ms/token. Acceleration is "
                                "cheaper than a "
                                f"rule at matched quality (equal within a {100 * FRONT_QUALITY_SLACK:g}% perplexity "
                                "rise, the slack always on the side that makes 'cheaper' hard to claim) when every "
                                "point of the rule's front within the slack of acceleration's quality range is matched "
                                f"by acceleration at <= its cost x (1 + {FRONT_STEPS_SLACK:g} steps, or the timing "
                                "noise) and <= the slack less quality, and some point of acceleration's front costs >= "
                                f"{100 * FRONT_MIN_SAVING:g}% (or the timing noise) less than the least the rule pays "
                                "to keep that quality less the slack, on every measured cost (points more than the "
                                "slack below the other front's range decide nothing). Stable when no step from one "
                                "threshold to the next, over the whole grid, raises perplexity by more than the "
                                f"sweep's {100 * tolerance:g}% tolerance and no threshold's perplexity is non-finite. "
                                "Reproduced when it is cheaper than both KL and step-norm and stable; partly when "
                                "cheaper than one (the verdict says which), or than both but not stable (or stability "
                                "not tested); not reproduced when cheaper than neither. Whole-front dominance is reported. "
                                "The paper's absolute grid (1e-5..1e-2) is one reported row: (a) acceleration within "
                                f"{100 * tolerance:g}% at every tau while saving >= {100 * MIN_STEPS_SAVED:g}% of the "
                                "steps; (b) faster than KL at matched quality; (c) a step-norm cliff at the "
                                "largest tau")
    policies = {name: policy_rows(sweep, name) for name in ("acceleration", "kl", "step_norm",
                                                             "acceleration_rel", "step_norm_rel")}
    needed = [name for name in rules.values() if not policies[name]]
    if needed:
        return untested(result, f"the sweep has no {', '.join(needed)} points (a sweep on the paper's grid alone, "
                                "from an older rdepth: rerun `rdepth reproduce two-scale` into a fresh --out)")
    reference = sweep["reference"]
    fronts = exit_fronts(sweep, policies)
    cheaper = [other for other, c in fronts["comparisons"].items() if c["cheaper"]]
    why = [f"{rules['acceleration']} is cheaper at matched quality (within the {100 * FRONT_QUALITY_SLACK:g}% "
           "slack) than " + (" and ".join(RULE_NAMES.get(name, name) for name in cheaper) if cheaper else
                             "neither rule") + "."]
    why += _fronts_why(fronts)
    paper = paper_grid(sweep, policies, tolerance)
    if paper:
        why += ["Paper's absolute grid (reported, not judged; its verdict by the old checks: "
                f"{paper['verdict']}): " + " ".join(paper_grid_why(paper["checks"], tolerance))]
    result["judged_on"] = _exits_judged_on(sweep, seeds, fronts)
    held = comparisons_held(fronts)
    verdict = _fronts_verdict(cheaper, fronts)
    if verdict == PARTLY:
        why.insert(0, f"Partly: {verdict_note(held)}.")
    result.update(verdict=verdict, why=why, verdict_note=verdict_note(held),
                  ours={"value": _fronts_value(fronts), "holds": held, "fronts": fronts, "paper_grid": paper,
                        "checks": paper.get("checks"), "policies": policies,
                        "full_ppl": reference["ppl"], "tolerance": tolerance,
                        "timing_path": summary.get("timing_path"),
                        "device": sweep.get("environment", {}).get("device")})
    return result
