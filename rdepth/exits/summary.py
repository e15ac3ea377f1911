"""The saved format of a sweep and its headline numbers, computed once.

A sweep result (``sweep.json``) holds the measured points (``reference``: the
full fixed budget; ``points``: one per policy setting, each with its
``baseline``, the fixed budget at its mean steps; ``fixed_ladder``) and, under
``"summary"``, every number the command line, the report page, the plots and
``bench/exit_speed.py`` show:

``format``
    :data:`SUMMARY_FORMAT`; a result without it is from an older rdepth.
``tolerance``, ``full_ppl``, ``ppl_limit``
    matched quality means perplexity <= ``ppl_limit = full_ppl * (1 + tolerance)``.
``full_steps``
    loop steps per token of the full budget, summed over groups.
``timings``
    the latencies measured, a subset of ``b1``, ``batched``, ``generate``.
``latency_key``
    the latency the plots and the report show (``ms_per_token_generate`` when
    measured, else ``ms_per_token_b1``; None without timing).
``report_ranking``, ``headline_ranking``
    which ``matched_quality`` ranking the report page shows (generation when
    measured) and which the command line and the benchmark print (batch-1
    forward); ``steps`` without timing.
``matched_quality``
    per ranking (``steps`` and every measured timing), one row per policy:
    its fastest point within tolerance (see :func:`matched_quality`).
``matched_fixed_budget``
    the cheapest fixed budget within tolerance (fewest steps), or None.
``best``
    the headline row that saves the most (largest speedup over the full budget
    with timing, most steps saved without), or None.

Nothing here imports torch: a saved sweep is summarised and read anywhere.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Sequence

from rdepth.errors import RdepthError

SUMMARY_FORMAT = 2
TIMINGS = ("b1", "batched", "generate")
RANKINGS = ("steps", *TIMINGS)


def matched_quality(result: dict, tolerance: float = 0.01, ranking: str = "b1") -> list[dict]:
    """Per policy, its fastest point within ``tolerance`` of the full budget's perplexity.

    "Fastest" by ``ms_per_token_<ranking>`` (by mean loop steps for ranking
    ``steps`` or where that timing was not measured). The chosen point is
    compared with the full budget and with the cheapest fixed budget (fewest
    steps, among the ladder and the per-point baselines) reaching the same
    quality. Rows: policy, value, ppl, ppl_vs_full, steps (mean, summed over
    groups), steps_saved (vs the full budget) and, per measured timing t,
    ``ms_per_token_t``, ``speedup_vs_full_t`` and ``speedup_vs_fixed_t``
    (> 1: the policy is faster); ``matched_fixed_budget``. A policy with no
    point within tolerance gets ``value`` None.
    """
    if ranking not in RANKINGS:
        raise RdepthError(f"matched_quality: ranking must be one of {', '.join(RANKINGS)}, got {ranking!r}")
    reference = result["reference"]
    limit = reference["ppl"] * (1.0 + tolerance)
    primary = f"ms_per_token_{ranking}"
    best_fixed = cheapest_fixed(result, limit, ranking)
    full_steps = sum(result["k_max"])
    rows = []
    for name in dict.fromkeys(p["policy"] for p in result["points"]):
        candidates = [p for p in result["points"] if p["policy"] == name and p["ppl"] <= limit]
        row: dict[str, Any] = {"policy": name, "value": None}
        if candidates:
            best = min(candidates, key=lambda p: (p.get(primary, 0.0), sum(p["mean_steps"])))
            steps = sum(best["mean_steps"])
            row.update(
                value=best["value"], ppl=best["ppl"], ppl_vs_full=best["ppl"] / reference["ppl"] - 1.0,
                steps=steps, steps_saved=1.0 - steps / full_steps,
            )
            for timing in TIMINGS:
                key = f"ms_per_token_{timing}"
                if key not in best:
                    continue
                row[key] = best[key]
                row[f"speedup_vs_full_{timing}"] = reference[key] / best[key]
                if best_fixed is not None and key in best_fixed:
                    row[f"speedup_vs_fixed_{timing}"] = best_fixed[key] / best[key]
        if best_fixed is not None:
            row["matched_fixed_budget"] = best_fixed["budget"]
        rows.append(row)
    return rows


def cheapest_fixed(result: dict, limit: float, ranking: str = "b1") -> dict | None:
    """The fixed budget with perplexity <= ``limit`` and the fewest loop steps (ties: the faster by
    ``ms_per_token_<ranking>``), among the ladder and the per-point baselines; None if none."""
    pool = [*result.get("fixed_ladder", []), *(point["baseline"] for point in result["points"])]
    within = [fixed for fixed in pool if fixed["ppl"] <= limit]
    key = f"ms_per_token_{ranking}"
    return min(within, key=lambda f: (sum(f["budget"]), f.get(key, 0.0)), default=None)


def summarize(result: dict, tolerance: float) -> dict:
    """The ``"summary"`` of a measured result (see the module docstring)."""
    reference = result["reference"]
    timings = [t for t in TIMINGS if f"ms_per_token_{t}" in reference]
    matched = {ranking: matched_quality(result, tolerance, ranking) for ranking in ("steps", *timings)}
    headline = "b1" if "b1" in timings else "steps"
    report = "generate" if "generate" in timings else headline
    within = [row for row in matched[headline] if row["value"] is not None]
    if headline == "steps":
        best = max(within, key=lambda row: row["steps_saved"], default=None)
    else:
        best = max(within, key=lambda row: row[f"speedup_vs_full_{headline}"], default=None)
    cheapest = cheapest_fixed(result, reference["ppl"] * (1.0 + tolerance), headline)
    return {
        "format": SUMMARY_FORMAT,
        "tolerance": tolerance,
        "full_ppl": reference["ppl"],
        "ppl_limit": reference["ppl"] * (1.0 + tolerance),
        "full_steps": sum(result["k_max"]),
        "timings": timings,
        "latency_key": f"ms_per_token_{report}" if report != "steps" else None,
        "report_ranking": report,
        "headline_ranking": headline,
        "matched_quality": matched,
        "matched_fixed_budget": cheapest["budget"] if cheapest else None,
        "best": best,
    }


def summary_of(result: dict) -> dict:
    """The saved summary of a sweep result; a one-line error for a result in an older format."""
    summary = result.get("summary") if isinstance(result, dict) else None
    if not isinstance(summary, dict) or summary.get("format") != SUMMARY_FORMAT:
        found = summary.get("format") if isinstance(summary, dict) else "none"
        raise RdepthError(
            f"this sweep result has summary format {found}, not {SUMMARY_FORMAT} (written by an older rdepth); "
            "rerun rdepth sweep to rebuild it"
        )
    return summary


def load_sweep(path: str | Path) -> dict:
    """A saved ``sweep.json`` (or a folder holding one), checked to be in the current format."""
    path = Path(path)
    if path.is_dir():
        path = path / "sweep.json"
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise RdepthError(f"sweep result not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RdepthError(f"sweep result {path} is not valid JSON") from None
    try:
        summary_of(result)
    except RdepthError as exc:
        raise RdepthError(f"{path}: {exc}") from None
    return result


# ------------------------------------------------------------------ CSV

CSV_FIELDS = (
    "policy", "parameter", "value", "ce", "ppl", "mean_steps", "mean_used",
    "ms_per_token_b1", "ms_per_token_batched", "ms_per_token_generate",
    "baseline_budget", "baseline_ce", "baseline_ppl", "baseline_ms_per_token_b1", "baseline_ms_per_token_batched",
    "baseline_ms_per_token_generate",
)


def sweep_rows(result: dict) -> list[dict]:
    """Flat rows (one per point, then the reference and the ladder) for the CSV."""
    rows = []

    def fixed_row(kind: str, fixed: dict) -> dict:
        return {
            "policy": kind, "parameter": "budget", "value": "|".join(map(str, fixed["budget"])),
            "ce": fixed["ce"], "ppl": fixed["ppl"], "mean_steps": _join(fixed["mean_steps"]),
            "mean_used": _join(fixed["mean_used"]), "ms_per_token_b1": fixed.get("ms_per_token_b1"),
            "ms_per_token_batched": fixed.get("ms_per_token_batched"),
            "ms_per_token_generate": fixed.get("ms_per_token_generate"),
        }

    for point in result["points"]:
        base = point["baseline"]
        rows.append({
            "policy": point["policy"], "parameter": point["parameter"], "value": point["value"],
            "ce": point["ce"], "ppl": point["ppl"], "mean_steps": _join(point["mean_steps"]),
            "mean_used": _join(point["mean_used"]), "ms_per_token_b1": point.get("ms_per_token_b1"),
            "ms_per_token_batched": point.get("ms_per_token_batched"),
            "ms_per_token_generate": point.get("ms_per_token_generate"),
            "baseline_budget": "|".join(map(str, base["budget"])), "baseline_ce": base["ce"],
            "baseline_ppl": base["ppl"], "baseline_ms_per_token_b1": base.get("ms_per_token_b1"),
            "baseline_ms_per_token_batched": base.get("ms_per_token_batched"),
            "baseline_ms_per_token_generate": base.get("ms_per_token_generate"),
        })
    rows.append(fixed_row("fixed_full", result["reference"]))
    rows.extend(fixed_row("fixed", fixed) for fixed in result.get("fixed_ladder", []))
    return rows


def sweep_csv(result: dict) -> str:
    """``sweep.csv``: :data:`CSV_FIELDS` columns, :func:`sweep_rows` rows, empty cells for missing values."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in sweep_rows(result):
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buffer.getvalue()


def _join(values: Sequence[float]) -> str:
    return "|".join(f"{v:.4f}" for v in values)
