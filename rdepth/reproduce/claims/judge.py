"""All the two-scale paper's claims in the paper's order, and the one reason that voids them all.
"""

from __future__ import annotations

from typing import Any

from rdepth.reproduce.claims.cosine import claim_cosine
from rdepth.reproduce.claims.dlr import claim_dlr
from rdepth.reproduce.claims.exits import claim_exits
from rdepth.reproduce.claims.plateau import claim_plateau
from rdepth.reproduce.claims.step_decay import claim_step_decay
from rdepth.reproduce.claims.verdict import untested


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
              quality: dict[str, Any] | None = None, seeds: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The claims in the paper's order (the plateau of §4 after the step decay); every one "not tested"
    when the model did not learn (:func:`unlearned_reason`). ``seeds``: e.g. ``{"training": 0}``, saved
    in each verdict's ``judged_on`` beside the analysis seed."""
    claims = [claim_step_decay(geometry, seeds), claim_plateau(geometry, seeds), claim_cosine(geometry, seeds),
              claim_dlr(geometry, seeds), claim_exits(sweep, seeds)]
    reason = unlearned_reason(quality)
    if reason is not None:
        for claim in claims:
            measured = claim["ours"].get("value")
            untested(claim, reason)
            if measured:
                claim["ours"].update(value=f"{measured} (not judged: the model did not learn)",
                                     measured_anyway=measured)
    return claims
