"""The two-scale paper's four claims, judged from the saved summaries (pure functions, torch-free).

Inputs are what the analyses saved: the geometry summary (``geometry/summary.json``,
:mod:`rdepth.geometry.summary`) and the sweep result (``sweep.json``,
:mod:`rdepth.exits.summary`). Each claim function returns a dict: ``id``,
``claim`` (the paper's sentence), ``paper`` (its figure and numbers), ``ours``
(the numbers measured, the text shown), ``verdict`` (one of :data:`VERDICTS`),
``why`` (sentences) and ``criteria`` (how the verdict is decided, with the
constants). The report draws nothing from anything else.
"""

from __future__ import annotations

from typing import Any

REPRODUCED, PARTLY, NOT, UNTESTED = "reproduced", "partly", "not reproduced", "not tested"
VERDICTS = (REPRODUCED, PARTLY, NOT, UNTESTED)

# Claim 1: a step has shrunk to this fraction of the first refinement step ||Delta^(1)|| ...
DECAY_FRACTION = 0.1
# ... by this loop step (the paper: "within 5-10 steps").
DECAY_BY_STEP = 10
# Claim 2: the paper's band of settled consecutive-step cosines, and the slack allowed around it.
PAPER_COSINE = (0.5, 0.65)
COSINE_SLACK = 0.05
# Claim 3: "DLR >> 1" read as at least an order of magnitude.
DLR_MUCH = 10.0
# Claim 4: a step-norm "cliff" is a perplexity rise of at least this much at the largest tau ...
CLIFF_LOSS = 0.05
# ... while the small taus stay within the sweep's tolerance (taus at most this).
CLIFF_SAFE_TAU = 1e-4


def _final_groups(summary: dict[str, Any]) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """The last checkpoint, the budget the loop-scale numbers come from, and its groups."""
    final = summary["checkpoints"][-1]
    budget = summary.get("scale_budget") or ("long" if "long" in final["budgets"] else "train")
    return final, budget, final["budgets"][budget]["groups"]


def decay_step(sizes: list[float]) -> int | None:
    """First loop step k >= 2 whose mean step size is at most DECAY_FRACTION x ||Delta^(1)|| (None: never).

    Step 0 is the jump from the random initial state, so the decay is measured from step 1.
    """
    if len(sizes) < 3 or not sizes[1] > 0:
        return None
    return next((k for k in range(2, len(sizes)) if sizes[k] <= DECAY_FRACTION * sizes[1]), None)


def _verdict(held: int, total: int) -> str:
    return REPRODUCED if held == total else (PARTLY if held else NOT)


def claim_step_decay(summary: dict[str, Any]) -> dict[str, Any]:
    """Claim 1: loop-step sizes decay within 5-10 steps (Fig. 3a)."""
    final, budget, groups = _final_groups(summary)
    per_group = []
    for group in groups:
        sizes = group["step_size"]["mean"]
        headline = group.get("headline", {})
        per_group.append({"group": group["name"], "decay_step": decay_step(sizes), "steps": len(sizes),
                          "step_sizes": [float(v) for v in sizes[:DECAY_BY_STEP + 1]],
                          "decay_10_over_1": headline.get("decay_10_over_1"),
                          "noise_floor_step": headline.get("noise_floor_step")})
    series = [{"checkpoint": entry["label"], "step": entry["step"],
               "decay_step": {g["name"]: decay_step(g["step_size"]["mean"])
                              for g in entry["budgets"][budget]["groups"]}}
              for entry in summary["checkpoints"]]
    result = _claim("step_decay", "Loop-step sizes ||Δ(k)|| decay quickly, within 5-10 loop steps.",
                    {"figure": "Fig. 3a", "value": "decay within 5-10 steps, every group and checkpoint"},
                    criteria=f"per group, the first step k >= 2 with mean ||Δ(k)|| <= {DECAY_FRACTION:g} x ||Δ(1)|| "
                             f"(step 0 is the jump from the random start), final checkpoint, '{budget}' budget; "
                             f"reproduced when every group gets there by step {DECAY_BY_STEP}, partly when some do "
                             "or all do later")
    if not per_group:
        return _untested(result, "the model has no looped group")
    held = sum(g["decay_step"] is not None and g["decay_step"] <= DECAY_BY_STEP for g in per_group)
    verdict = _verdict(held, len(per_group))
    if verdict == NOT and any(g["decay_step"] is not None for g in per_group):
        verdict = PARTLY
    text = ", ".join(f"group {g['group']}: " + ("never" if g["decay_step"] is None else f"step {g['decay_step']}")
                     for g in per_group)
    result.update(verdict=verdict, ours={"value": f"step size at 1/{round(1 / DECAY_FRACTION)} of step 1 by {text}",
                                          "groups": per_group, "series": series, "budget": budget,
                                          "checkpoint": final["label"]})
    result["why"] = [f"{held} of {len(per_group)} groups decay {round(1 / DECAY_FRACTION)}x by step {DECAY_BY_STEP} "
                     f"at the final checkpoint ({final['label']})."]
    return result


def claim_cosine(summary: dict[str, Any]) -> dict[str, Any]:
    """Claim 2: consecutive-step cosines settle around 0.5-0.65, a slow spiral (Fig. 3b, Fig. 5)."""
    final, budget, groups = _final_groups(summary)
    low, high = PAPER_COSINE[0] - COSINE_SLACK, PAPER_COSINE[1] + COSINE_SLACK
    per_group = [{"group": g["name"], "settled_cosine": g.get("headline", {}).get("settled_cosine"),
                  "cosines": [float(v) for v in g["cosine"]["mean"][:DECAY_BY_STEP]]} for g in groups]
    series = [{"checkpoint": entry["label"], "step": entry["step"],
               "settled_cosine": {g["name"]: g.get("headline", {}).get("settled_cosine")
                                  for g in entry["budgets"][budget]["groups"]}}
              for entry in summary["checkpoints"]]
    result = _claim("cosine", "Consecutive loop steps settle at cosines of about 0.5-0.65: a slow spiral, "
                              "complementary rather than collinear pushes.",
                    {"figure": "Fig. 3b, Fig. 5", "value": f"settled cos(Δ(k), Δ(k-1)) ≈ {PAPER_COSINE[0]}-"
                                                           f"{PAPER_COSINE[1]} in later checkpoints"},
                    criteria=f"per group, the mean of the last settled cosines above the float noise floor "
                             f"(geometry headline settled_cosine), final checkpoint, '{budget}' budget; reproduced when "
                             f"every group is within {low:.2f}-{high:.2f}, partly when some group is or every group "
                             "is positive (turning, not reversing)")
    measured = [g for g in per_group if g["settled_cosine"] is not None]
    if not measured:
        return _untested(result, "no group has a settled cosine above the noise floor")
    inside = sum(low <= g["settled_cosine"] <= high for g in measured)
    verdict = _verdict(inside, len(measured))
    if verdict == NOT and all(g["settled_cosine"] > 0 for g in measured):
        verdict = PARTLY
    values = ", ".join(f"group {g['group']}: {g['settled_cosine']:.2f}" for g in measured)
    why = [f"{inside} of {len(measured)} groups settle inside {low:.2f}-{high:.2f} ({values})."]
    negative = [g["group"] for g in measured if g["settled_cosine"] < 0]
    if negative:
        why.append(f"Negative in group {', '.join(negative)}: each step partly undoes the last, an oscillating contraction "
                   "rather than a spiral.")
    result.update(verdict=verdict, why=why, ours={"value": f"settled cosine {values}", "groups": per_group,
                                                  "series": series, "budget": budget,
                                                  "checkpoint": final["label"]})
    return result


def claim_dlr(summary: dict[str, Any]) -> dict[str, Any]:
    """Claim 3: drift between groups is much larger than a loop step, DLR >> 1 (Fig. 2)."""
    final = summary["checkpoints"][-1]
    refine = summary.get("dlr_default_refine", "first_refine")
    budget = "train" if "train" in final["budgets"] else next(iter(final["budgets"]))
    result = _claim("dlr", "Drift across group hand-offs is much larger than a loop step: DLR >> 1.",
                    {"figure": "Fig. 2", "value": "DLR >> 1 at the boundaries 4 -> 5-6 and 5-6 -> 7, every checkpoint"},
                    criteria=f"median over tokens of DLR by Eq. 2 as written ('literal'), final checkpoint, the "
                             f"'{budget}' budget; reproduced when every boundary is >= {DLR_MUCH:g}, partly when every "
                             "boundary is > 1, not when some boundary is <= 1")
    boundaries = final["budgets"][budget].get("dlr") or {}
    if not boundaries:
        return _untested(result, "one looped group: there is no boundary between groups to measure drift across")
    per_boundary = []
    for name, definitions in boundaries.items():
        literal = (definitions.get("literal") or {}).get("median")
        refined = (definitions.get(refine) or {}).get("median")
        per_boundary.append({"boundary": name, "literal_median": literal, f"{refine}_median": refined})
    series = [{"checkpoint": entry["label"], "step": entry["step"],
               "literal_median": {name: (d.get("literal") or {}).get("median")
                                  for name, d in (entry["budgets"][budget].get("dlr") or {}).items()}}
              for entry in summary["checkpoints"]]
    values = [b["literal_median"] for b in per_boundary]
    if any(v is None for v in values):
        return _untested(result, "DLR is undefined at some boundary")
    if all(v >= DLR_MUCH for v in values):
        verdict = REPRODUCED
    elif all(v > 1 for v in values):
        verdict = PARTLY
    else:
        verdict = NOT
    text = ", ".join(f"{b['boundary']}: {b['literal_median']:.1f}" for b in per_boundary)
    why = [f"Eq. 2 medians {text}."]
    if verdict == PARTLY:
        refined = [b[f"{refine}_median"] for b in per_boundary]
        if all(v is not None and v >= DLR_MUCH for v in refined):
            why.append(f"Above 1 but under {DLR_MUCH:g}; measured against the refinement steps only (leaving out "
                       f"the jump from the random start, '{refine}') every boundary is >= {DLR_MUCH:g} "
                       f"({', '.join(f'{v:.1f}' for v in refined)}).")
        else:
            why.append("Drift exceeds a loop step at every boundary, but not by an order of magnitude.")
    result.update(verdict=verdict, why=why, ours={"value": f"DLR (Eq. 2, median) {text}", "boundaries": per_boundary,
                                                  "series": series, "budget": budget, "checkpoint": final["label"]})
    return result


def _policy_rows(sweep: dict[str, Any], policy: str) -> list[dict[str, Any]]:
    """One row per tau of ``policy``: perplexity rise over the full budget, steps, latency, throughput."""
    full = sweep["reference"]["ppl"]
    rows = []
    for point in sweep["points"]:
        if point["policy"] != policy:
            continue
        batched = point.get("ms_per_token_batched")
        rows.append({"tau": point["value"], "ppl": point["ppl"], "ppl_rise": point["ppl"] / full - 1.0,
                     "steps": point["steps"] if "steps" in point else sum(point["mean_steps"]),
                     "ms_per_token_b1": point.get("ms_per_token_b1"),
                     "ms_per_token_generate": point.get("ms_per_token_generate"),
                     "tokens_per_s_batched": 1000.0 / batched if batched else None})
    return sorted(rows, key=lambda row: row["tau"])


def _fastest_within(sweep: dict[str, Any], policy: str) -> dict[str, Any] | None:
    ranking = sweep["summary"]["headline_ranking"]
    rows = sweep["summary"]["matched_quality"][ranking]
    return next((row for row in rows if row["policy"] == policy and row["value"] is not None), None)


def claim_exits(sweep: dict[str, Any]) -> dict[str, Any]:
    """Claim 4: acceleration keeps perplexity flat at lower latency than KL; step-norm falls off a
    cliff above tau = 1e-3 (Fig. 4)."""
    from rdepth.exits.stats import compare

    summary = sweep["summary"]
    tolerance = summary["tolerance"]
    result = _claim("exits", "The acceleration exit keeps perplexity flat at lower latency than KL, while step-norm "
                             "loses quality beyond tau = 1e-3 and sharply at 1e-2.",
                    {"figure": "Fig. 4", "value": "acceleration ~580 -> 360 ms/token from tau 1e-5 to 1e-2 at flat "
                                                  "PPL; KL flat but slower; step-norm degrades beyond 1e-3"},
                    criteria=f"(a) acceleration's perplexity within {100 * tolerance:g}% of the full budget at every "
                             f"tau; (b) at matched quality its batch-1 latency below KL's, outside the timing noise "
                             f"(loop steps when not timed); (c) step-norm {100 * CLIFF_LOSS:g}% or more above the full "
                             f"budget at the largest tau while within {100 * tolerance:g}% at tau <= {CLIFF_SAFE_TAU:g}. "
                             "Reproduced when all three hold, partly when one or two do")
    policies = {name: _policy_rows(sweep, name) for name in ("acceleration", "kl", "step_norm",
                                                             "acceleration_rel", "step_norm_rel")}
    needed = [name for name in ("acceleration", "kl", "step_norm") if not policies[name]]
    if needed:
        return _untested(result, f"the sweep has no {', '.join(needed)} points")
    checks: dict[str, dict[str, Any]] = {}
    accel = policies["acceleration"]
    worst = max(row["ppl_rise"] for row in accel)
    checks["acceleration_flat"] = {"holds": worst <= tolerance, "worst_ppl_rise": worst}
    fast_accel, fast_kl = _fastest_within(sweep, "acceleration"), _fastest_within(sweep, "kl")
    latency: dict[str, Any] = {"acceleration": fast_accel, "kl": fast_kl}
    if fast_accel is None or fast_kl is None:
        latency["holds"] = False
        latency["reason"] = "no point within tolerance for " + ("acceleration" if fast_accel is None else "kl")
    elif "ms_per_token_b1" in fast_accel and "ms_per_token_b1" in fast_kl:
        compared = compare((fast_kl["ms_per_token_b1"], fast_kl.get("ms_per_token_b1_iqr") or
                            [fast_kl["ms_per_token_b1"]] * 2),
                           (fast_accel["ms_per_token_b1"], fast_accel.get("ms_per_token_b1_iqr") or
                            [fast_accel["ms_per_token_b1"]] * 2), summary.get("noise_threshold", 0.1))
        latency.update(kl_over_acceleration_b1=compared, holds=compared["ratio"] > 1 and not compared["noise"])
        if compared["noise"]:
            latency["reason"] = f"within timing noise ({compared['noise']})"
    else:
        latency.update(holds=fast_accel["steps"] < fast_kl["steps"], by="loop steps (not timed)")
    checks["faster_than_kl"] = latency
    step = policies["step_norm"]
    top = step[-1]
    safe = [row for row in step if row["tau"] <= CLIFF_SAFE_TAU]
    safe_ok = all(row["ppl_rise"] <= tolerance for row in safe)
    checks["step_norm_cliff"] = {"holds": top["ppl_rise"] >= CLIFF_LOSS and safe_ok and bool(safe),
                                 "largest_tau": top["tau"], "ppl_rise_at_largest_tau": top["ppl_rise"],
                                 "small_taus_within_tolerance": safe_ok}
    held = sum(bool(check["holds"]) for check in checks.values())
    verdict = _verdict(held, len(checks))
    why = []
    why.append(f"(a) acceleration's worst perplexity rise over the taus: {100 * worst:+.2f}% "
               f"({'flat' if checks['acceleration_flat']['holds'] else 'not flat'}).")
    if "kl_over_acceleration_b1" in latency:
        compared = latency["kl_over_acceleration_b1"]
        why.append(f"(b) at matched quality KL takes {compared['ratio']:.2f}x acceleration's batch-1 latency "
                   f"[{compared['range'][0]:.2f}-{compared['range'][1]:.2f}]"
                   + (f", within noise: {compared['noise']}." if compared["noise"] else "."))
    elif latency.get("by"):
        why.append(f"(b) by loop steps: acceleration {fast_accel['steps']:.2f}, KL {fast_kl['steps']:.2f} (not timed).")
    else:
        why.append(f"(b) {latency['reason']}.")
    why.append(f"(c) step-norm at tau {top['tau']:g}: {100 * top['ppl_rise']:+.2f}% perplexity"
               + ("" if safe_ok else f"; already above {100 * tolerance:g}% at tau <= {CLIFF_SAFE_TAU:g}") + ".")
    value = (f"acceleration worst {100 * worst:+.2f}% PPL; step-norm {100 * top['ppl_rise']:+.2f}% at tau "
             f"{top['tau']:g}")
    if "kl_over_acceleration_b1" in latency:
        value += (f"; batch-1 latency {fast_accel['ms_per_token_b1']:.3g} (acceleration) vs "
                  f"{fast_kl['ms_per_token_b1']:.3g} ms/token (KL)")
    result.update(verdict=verdict, why=why, ours={"value": value, "checks": checks, "policies": policies,
                                                  "full_ppl": sweep["reference"]["ppl"], "tolerance": tolerance,
                                                  "timing_path": summary.get("timing_path"),
                                                  "device": sweep.get("environment", {}).get("device")})
    return result


def unlearned_reason(quality: dict[str, Any] | None) -> str | None:
    """Why the trained model's loops say nothing about the paper, or None: its validation perplexity at
    the training budget is not below the unigram baseline on the same tokens (``quality``: the
    ``loop_budgets`` rows, ``unigram`` and ``train_loops`` that ``rdepth reproduce`` measures)."""
    if not quality or not quality.get("unigram") or not quality.get("loop_budgets"):
        return None
    rows = quality["loop_budgets"]
    trained = next((row for row in rows if max(row["loops"]) == quality.get("train_loops")), rows[-1])
    unigram = quality["unigram"]["ppl"]
    if trained["ppl"] < unigram:
        return None
    return (f"the model did not learn past unigram statistics (validation perplexity {trained['ppl']:.1f} at "
            f"{max(trained['loops'])} loops against the unigram baseline's {unigram:.1f} on the same tokens), "
            "so its loops say nothing about the paper")


def judge_all(geometry: dict[str, Any], sweep: dict[str, Any],
              quality: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The four claims in the paper's order; every one "not tested" when the model did not learn
    (:func:`unlearned_reason`)."""
    claims = [claim_step_decay(geometry), claim_cosine(geometry), claim_dlr(geometry), claim_exits(sweep)]
    reason = unlearned_reason(quality)
    if reason is not None:
        for claim in claims:
            measured = claim["ours"].get("value")
            _untested(claim, reason)
            if measured:
                claim["ours"].update(value=f"{measured} (not judged: the model did not learn)",
                                     measured_anyway=measured)
    return claims


def _claim(claim_id: str, text: str, paper: dict[str, str], criteria: str) -> dict[str, Any]:
    return {"id": claim_id, "claim": text, "paper": paper, "ours": {}, "verdict": UNTESTED, "why": [],
            "criteria": criteria}


def _untested(result: dict[str, Any], reason: str) -> dict[str, Any]:
    result.update(verdict=UNTESTED, why=[f"Not tested: {reason}."], ours={"value": f"not measured ({reason})"})
    return result
