"""What every claim's verdict is made of: the four verdicts, the claim record, and what a verdict rests on
(``judged_on``). Pure functions, torch-free.
"""

from __future__ import annotations

from typing import Any

from rdepth.errors import RdepthError

REPRODUCED, PARTLY, NOT, UNTESTED = "reproduced", "partly", "not reproduced", "not tested"
VERDICTS = (REPRODUCED, PARTLY, NOT, UNTESTED)


def new_claim(claim_id: str, text: str, paper: dict[str, str], criteria: str) -> dict[str, Any]:
    return {"id": claim_id, "claim": text, "paper": paper, "ours": {}, "verdict": UNTESTED, "why": [],
            "criteria": criteria}


def untested(result: dict[str, Any], reason: str) -> dict[str, Any]:
    result.update(verdict=UNTESTED, why=[f"Not tested: {reason}."], ours={"value": f"not measured ({reason})"})
    return result


def count_verdict(held: int, total: int) -> str:
    return REPRODUCED if held == total else (PARTLY if held else NOT)


def final_groups(summary: dict[str, Any]) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """The last checkpoint, the budget the loop-scale numbers come from, and its groups."""
    final = summary["checkpoints"][-1]
    budget = summary.get("scale_budget") or ("long" if "long" in final["budgets"] else "train")
    return final, budget, final["budgets"][budget]["groups"]


def _precision(summary: dict[str, Any]) -> str:
    """The dtype the geometry was measured in (summaries before ``precision`` existed: float32)."""
    return (summary.get("settings") or {}).get("precision", "float32")


def judged_on(summary: dict[str, Any], budget: str | None, loops: list[int] | None, spread: Any,
              seeds: dict[str, Any] | None = None, checkpoint: str | None = None) -> dict[str, Any]:
    """What a verdict rests on: the loop budget (name and counts), the precision, the seeds (training,
    analysis), the held-out tokens, the checkpoint and the spread of the numbers judged."""
    settings = summary.get("settings") or {}
    return {"budget": budget, "loops": loops, "precision": _precision(summary),
            "seeds": {**(seeds or {}), "analysis": settings.get("seed")},
            "tokens": summary.get("sequences", 0) * summary.get("seq_len", 0) or None,
            "checkpoint": checkpoint, "spread": spread}


def judged_text(claim: dict[str, Any]) -> str:
    """One line: the budget, precision, seeds and spread a verdict was judged on."""
    on = claim.get("judged_on")
    if not on:
        return ""
    seeds = ", ".join(f"{name} {value}" for name, value in (on.get("seeds") or {}).items() if value is not None)
    parts = [f"budget {on['budget']}" + (f" ({','.join(map(str, on['loops']))} loops)" if on.get("loops") else "")
             if on.get("budget") else None,
             on.get("precision"), f"seeds: {seeds}" if seeds else None,
             f"spread: {on['spread']}" if isinstance(on.get("spread"), str) else None]
    return "; ".join(part for part in parts if part)


def missing_field(field: str, where: str, meaning: str) -> RdepthError:
    """The one-line error for a summary from an older rdepth that lacks what a judge needs."""
    return RdepthError(f"geometry summary lacks '{field}' ({meaning}) at {where}: it comes from an older rdepth; "
                       "rerun `rdepth analyze` (or `rdepth reproduce two-scale` into a fresh --out) to recompute it")
