"""Claim 4 on the paper's absolute threshold grid (1e-5..1e-2): checks (a)-(c), reported beside the fronts'
verdict and not judged.
"""

from __future__ import annotations

from typing import Any

from rdepth.reproduce.claims.verdict import count_verdict

# Claim 4: "flat quality" counts only where the rule saves at least this share of the loop steps.
MIN_STEPS_SAVED = 0.10
# Claim 4: a step-norm "cliff" is a perplexity rise of at least this much at the largest tau ...
CLIFF_LOSS = 0.05
# ... while the small taus stay within the sweep's tolerance (taus at most this).
CLIFF_SAFE_TAU = 1e-4


def policy_rows(sweep: dict[str, Any], policy: str) -> list[dict[str, Any]]:
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


def _acceleration_flat(accel: list[dict], reference: dict, tolerance: float) -> dict[str, Any]:
    """Claim 4 (a): acceleration's perplexity within tolerance at every tau, saving enough loop steps somewhere."""
    worst = max(row["ppl_rise"] for row in accel)
    full_steps = float(sum(reference.get("mean_steps") or reference.get("budget") or [0]))
    saved = max((1.0 - row["steps"] / full_steps for row in accel), default=0.0) if full_steps > 0 else 0.0
    return {"holds": worst <= tolerance and saved >= MIN_STEPS_SAVED, "worst_ppl_rise": worst,
            "most_steps_saved": saved, "full_budget_steps": full_steps,
            "flat": worst <= tolerance, "saves_enough": saved >= MIN_STEPS_SAVED}


def _faster_than_kl(sweep: dict[str, Any]) -> dict[str, Any]:
    """Claim 4 (b): at matched quality, acceleration's batch-1 latency below KL's outside the timing noise
    (loop steps when the sweep was not timed)."""
    from rdepth.sweep.stats import compare

    fast_accel, fast_kl = _fastest_within(sweep, "acceleration"), _fastest_within(sweep, "kl")
    latency: dict[str, Any] = {"acceleration": fast_accel, "kl": fast_kl}
    if fast_accel is None or fast_kl is None:
        latency["holds"] = False
        latency["reason"] = "no point within tolerance for " + ("acceleration" if fast_accel is None else "kl")
    elif "ms_per_token_b1" in fast_accel and "ms_per_token_b1" in fast_kl:
        def timing(row):
            return row["ms_per_token_b1"], row.get("ms_per_token_b1_iqr") or [row["ms_per_token_b1"]] * 2

        compared = compare(timing(fast_kl), timing(fast_accel), sweep["summary"].get("noise_threshold", 0.1))
        latency.update(kl_over_acceleration_b1=compared, holds=compared["ratio"] > 1 and not compared["noise"])
        if compared["noise"]:
            latency["reason"] = f"within timing noise ({compared['noise']})"
    else:
        latency.update(holds=fast_accel["steps"] < fast_kl["steps"], by="loop steps (not timed)")
    return latency


def _step_norm_cliff(step: list[dict], tolerance: float) -> dict[str, Any]:
    """Claim 4 (c): step-norm far above the full budget at the largest tau, within tolerance at small ones."""
    top = step[-1]
    safe = [row for row in step if row["tau"] <= CLIFF_SAFE_TAU]
    safe_ok = all(row["ppl_rise"] <= tolerance for row in safe)
    return {"holds": top["ppl_rise"] >= CLIFF_LOSS and safe_ok and bool(safe), "largest_tau": top["tau"],
            "ppl_rise_at_largest_tau": top["ppl_rise"], "small_taus_within_tolerance": safe_ok}


def paper_grid_why(checks: dict[str, dict[str, Any]], tolerance: float) -> list[str]:
    """Claim 4's reasons, one per check, and what the claim can rest on."""
    flat, latency, cliff = checks["acceleration_flat"], checks["faster_than_kl"], checks["step_norm_cliff"]
    worst, saved = flat["worst_ppl_rise"], flat["most_steps_saved"]
    why = [f"(a) acceleration's worst perplexity rise over the taus: {100 * worst:+.2f}% "
           f"({'flat' if worst <= tolerance else 'not flat'}), saving at most {100 * saved:.1f}% of the "
           f"{flat['full_budget_steps']:g} loop steps per token"
           + ("." if saved >= MIN_STEPS_SAVED else f": under {100 * MIN_STEPS_SAVED:g}%, the rule barely fires.")]
    if "kl_over_acceleration_b1" in latency:
        compared = latency["kl_over_acceleration_b1"]
        why.append(f"(b) at matched quality KL takes {compared['ratio']:.2f}x acceleration's batch-1 latency "
                   f"[{compared['range'][0]:.2f}-{compared['range'][1]:.2f}]"
                   + (f", within noise: {compared['noise']}." if compared["noise"] else "."))
    elif latency.get("by"):
        why.append(f"(b) by loop steps: acceleration {latency['acceleration']['steps']:.2f}, "
                   f"KL {latency['kl']['steps']:.2f} (not timed).")
    else:
        why.append(f"(b) {latency['reason']}.")
    why.append(f"(c) step-norm at tau {cliff['largest_tau']:g}: {100 * cliff['ppl_rise_at_largest_tau']:+.2f}% "
               "perplexity" + ("" if cliff["small_taus_within_tolerance"]
                               else f"; already above {100 * tolerance:g}% at tau <= {CLIFF_SAFE_TAU:g}") + ".")
    why.append("What the claim can rest on: on a contracting or spiralling loop of constant shape, acceleration "
               "||Δ(k) - Δ(k-1)|| is a fixed multiple of the step norm, so the rule acts like step-norm with a "
               "rescaled threshold and a 1-4 step delay (on reference spirals it never computes fewer steps than "
               "step-norm at the same tau); differences between them are differences of effective threshold.")
    return why


def paper_grid(sweep: dict[str, Any], policies: dict[str, list[dict]], tolerance: float) -> dict[str, Any]:
    """The paper's absolute grid, reported and not judged: checks (a)-(c) and their verdict; {} when the
    sweep lacks one of its rules."""
    if not all(policies[name] for name in ("acceleration", "kl", "step_norm")):
        return {}
    checks = {"acceleration_flat": _acceleration_flat(policies["acceleration"], sweep["reference"], tolerance),
              "faster_than_kl": _faster_than_kl(sweep),
              "step_norm_cliff": _step_norm_cliff(policies["step_norm"], tolerance)}
    return {"checks": checks, "verdict": count_verdict(sum(bool(c["holds"]) for c in checks.values()), len(checks))}
