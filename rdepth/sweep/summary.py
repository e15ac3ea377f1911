"""The saved format of a sweep and its headline numbers, computed once.

A sweep result (``sweep.json``) holds the measured points (``reference``: the
full fixed budget; ``points``: one per policy setting, each with its
``baseline``, the fixed budget at its mean steps; ``fixed_ladder``) and, under
``"summary"``, every number the command line, the report page, the plots and
``bench/exit_speed.py`` show.

Latency keys of an entry (see :class:`rdepth.sweep.measure.SweepMeasurer`;
:data:`LATENCY_DEFINITIONS` is saved in the summary): ``ms_per_token_b1`` and
``ms_per_token_batched`` are *teacher-forced* ms/token (one window of T tokens
in one forward, wall time / tokens: every position in parallel, not decode
latency); ``ms_per_token_generate`` is the *decode latency* (greedy cached
generation). All three are timed on the packed path, for policies and fixed
budgets alike; fixed budgets also carry ``dense_ms_per_token_b1``/``_batched``
(the dense path). Each has ``<key>_iqr`` ``[q1, q3]`` and per-round samples in
``timing_samples``. The summary's keys:

``format``
    :data:`SUMMARY_FORMAT`; a result without it is from an older rdepth.
``tolerance``, ``full_ppl``, ``ppl_limit``
    matched quality means perplexity <= ``ppl_limit = full_ppl * (1 + tolerance)``.
``full_steps``
    loop steps per token of the full budget, summed over groups.
``timings``
    the latencies measured, a subset of ``b1``, ``batched``, ``generate``.
``timing_path``, ``latency_definitions``
    the path every ``ms_per_token_*`` was timed on (``"packed"``; None without
    timing) and a sentence per measured latency key saying what it is.
``latency_key``
    the latency the plots and the report show (``ms_per_token_generate`` when
    measured, else ``ms_per_token_b1``; None without timing).
``report_ranking``, ``headline_ranking``
    which ``matched_quality`` ranking the report page shows (generation when
    measured) and which the command line and the benchmark print (batch-1
    teacher-forced forward); ``steps`` without timing.
``matched_quality``
    per ranking (``steps`` and every measured timing), one row per policy:
    its fastest point within tolerance (see :func:`matched_quality`), with
    every speedup as ``ratio``, ``_range`` and ``_noise``.
``matched_fixed_budget``
    the cheapest fixed budget within tolerance (fewest steps), or None.
``best``
    the headline row that saves the most (largest speedup over the full budget
    with timing, most steps saved without), or None.
``noise_threshold``, ``noise_warnings``, ``noisy``
    the relative-IQR threshold of the noise rule (:mod:`rdepth.sweep.stats`);
    one sentence per headline or report speedup within noise and per noisy
    full-budget timing; whether there is any.
``packed_over_dense``
    per fixed budget timed on both paths: ``budget`` and, per teacher-forced
    timing, packed time / dense time for identical work (``ratio``, ``range``,
    ``noise``; > 1: the packed path is slower).
``decode``
    how decoded rules read a group's state: ``mode`` (``head``/``rest``),
    ``loops`` (later groups' steps with ``rest``), ``kl_direction`` and a
    ``description`` (see :mod:`rdepth.exits.decode`).

Nothing here imports torch: a saved sweep is summarised and read anywhere.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.sweep.stats import NOISE_THRESHOLD, compare, format_ratio, rel_iqr

SUMMARY_FORMAT = 3
TIMINGS = ("b1", "batched", "generate")
DENSE_TIMINGS = ("b1", "batched")  # generation needs the cache: packed only
RANKINGS = ("steps", *TIMINGS)

LATENCY_DEFINITIONS = {
    "ms_per_token_b1": "teacher-forced ms/token at batch 1 on the packed path: one window of T tokens in one "
                       "forward, wall time / T (every position in parallel; not decode latency)",
    "ms_per_token_batched": "teacher-forced ms/token on the packed path with timing_batch_size windows per forward",
    "ms_per_token_generate": "decode latency: greedy cached generation at batch 1 on the packed path (key/value "
                             "cache), wall time / new tokens, the prompt's forward amortised",
    "dense_ms_per_token_b1": "fixed budgets only: teacher-forced ms/token at batch 1 on the dense path (the layout "
                             "of training and rdepth eval), a reference",
    "dense_ms_per_token_batched": "fixed budgets only: teacher-forced ms/token, batched, on the dense path",
}
TIMING_LABELS = {
    "b1": "teacher-forced, batch 1", "batched": "teacher-forced, batched", "generate": "cached generation (decode)",
}
DECODE_DESCRIPTIONS = {
    "head": "a group's state straight through the final norm and head (a logit-lens reading for a middle group)",
    "rest": "a group's state through the layers after it (later groups at {loops} loop step(s) from fixed "
            "initial states, every position of the window at its current state), then the final norm and head",
}
KL_FORMULAS = {"new_old": "KL(p_new || p_old), the paper's Eq. 4",
               "old_new": "KL(p_old || p_new), Geiping et al.'s code"}


def measurement(entry: dict, key: str) -> tuple[float, list[float]] | None:
    """``(median, [q1, q3])`` of a saved latency (no ``_iqr``: a zero-width range); None if not measured."""
    if key not in entry:
        return None
    median = entry[key]
    return median, list(entry.get(f"{key}_iqr", [median, median]))


def speedup(reference: dict, candidate: dict, key: str, reference_key: str | None = None,
            threshold: float = NOISE_THRESHOLD) -> dict | None:
    """``reference[reference_key] / candidate[key]`` with its range and noise flag; None if either is missing."""
    ref = measurement(reference, reference_key or key)
    cand = measurement(candidate, key)
    if ref is None or cand is None:
        return None
    return compare(ref, cand, threshold)


def matched_quality(result: dict, tolerance: float = 0.01, ranking: str = "b1",
                    noise_threshold: float = NOISE_THRESHOLD) -> list[dict]:
    """Per policy, its fastest point within ``tolerance`` of the full budget's perplexity.

    "Fastest" by ``ms_per_token_<ranking>`` (by mean loop steps for ranking
    ``steps`` or where that timing was not measured). The chosen point is
    compared with the full budget and with the cheapest fixed budget (fewest
    steps, among the ladder and the per-point baselines) reaching the same
    quality. Rows: policy, value, ppl, ppl_vs_full, steps (mean, summed over
    groups), steps_saved (vs the full budget) and, per measured timing t,
    ``ms_per_token_t`` (and ``_iqr``), ``speedup_vs_full_t`` and
    ``speedup_vs_fixed_t`` (> 1: the policy is faster; both on the packed
    path), and, for the teacher-forced timings, ``speedup_vs_dense_full_t`` and
    ``speedup_vs_dense_fixed_t`` (against the same budgets on the dense path, a
    reference). Every speedup ``s`` comes with ``s_range`` (what the two IQRs
    allow) and ``s_noise`` (None, or why it is within noise);
    ``matched_fixed_budget``. A policy with no point within tolerance gets
    ``value`` None.
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
                value=best["value"], parameter=best.get("parameter", "tau"), ppl=best["ppl"],
                ppl_vs_full=best["ppl"] / reference["ppl"] - 1.0, steps=steps, steps_saved=1.0 - steps / full_steps,
            )
            if "values" in best:  # a calibrated profile
                row["values"] = best["values"]
            for timing in TIMINGS:
                key = f"ms_per_token_{timing}"
                if key not in best:
                    continue
                row[key] = best[key]
                if f"{key}_iqr" in best:
                    row[f"{key}_iqr"] = best[f"{key}_iqr"]
                against = [("full", reference, key), ("fixed", best_fixed, key)]
                if timing in DENSE_TIMINGS:
                    against += [("dense_full", reference, f"dense_{key}"), ("dense_fixed", best_fixed, f"dense_{key}")]
                for kind, baseline, baseline_key in against:
                    if baseline is None:
                        continue
                    compared = speedup(baseline, best, key, baseline_key, noise_threshold)
                    if compared is None:
                        continue
                    name_ = f"speedup_vs_{kind}_{timing}"
                    row[name_] = compared["ratio"]
                    row[f"{name_}_range"] = compared["range"]
                    row[f"{name_}_noise"] = compared["noise"]
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


def fixed_entries(result: dict) -> list[dict]:
    """Every distinct fixed budget measured (the reference, the ladder, the baselines), by total steps."""
    pool = [result["reference"], *result.get("fixed_ladder", []), *(p["baseline"] for p in result["points"])]
    unique = {tuple(entry["budget"]): entry for entry in pool}
    return [unique[budget] for budget in sorted(unique, key=lambda b: (sum(b), b))]


def packed_over_dense(result: dict, noise_threshold: float = NOISE_THRESHOLD) -> list[dict]:
    """Per fixed budget timed on both paths: packed time / dense time for identical work, per
    teacher-forced timing (``ratio`` > 1: the packed path is slower), with range and noise flag."""
    rows = []
    for entry in fixed_entries(result):
        row: dict[str, Any] = {"budget": entry["budget"]}
        for timing in DENSE_TIMINGS:
            key = f"ms_per_token_{timing}"
            compared = speedup(entry, entry, f"dense_{key}", key, noise_threshold)
            if compared is not None:
                row[timing] = compared
        if len(row) > 1:
            rows.append(row)
    return rows


def setting_value(row: dict) -> str:
    """A row's parameter value as shown: one value, or one per group for a calibrated profile."""
    values = row.get("values")
    return ",".join(f"{v:g}" for v in values) if values else f"{row['value']:g}"


def _setting(row: dict) -> str:
    return f"{row['policy']} ({row.get('parameter', 'tau')}={setting_value(row)})"


def noise_warnings(result: dict, matched: dict, rankings: Sequence[str], noise_threshold: float) -> list[str]:
    """Sentences for the speedups within noise in ``matched[ranking]`` (same-path ones: vs the full budget
    and vs the matched fixed budget) and for full-budget timings whose spread exceeds the threshold."""
    warnings = []
    reference = result["reference"]
    for key in (f"ms_per_token_{t}" for t in TIMINGS):
        saved = measurement(reference, key)
        if saved is not None and rel_iqr(*saved) > noise_threshold:
            warnings.append(
                f"the full budget's {key} varies by {100 * rel_iqr(*saved):.1f}% of its median (IQR) across "
                f"rounds, above the {100 * noise_threshold:g}% threshold: every ratio against it is uncertain"
            )
    for ranking in dict.fromkeys(rankings):
        if ranking == "steps":
            continue
        for row in matched[ranking]:
            if row["value"] is None:
                continue
            for kind, against in (("full", "the full budget"), ("fixed", "the matched fixed budget")):
                if kind == "fixed" and row.get("matched_fixed_budget") == reference["budget"]:
                    continue  # the same ratio as against the full budget
                name = f"speedup_vs_{kind}_{ranking}"
                if row.get(f"{name}_noise"):
                    compared = {"ratio": row[name], "range": row[f"{name}_range"], "noise": row[f"{name}_noise"]}
                    warnings.append(f"{_setting(row)}: speedup over {against} ({TIMING_LABELS[ranking]}) "
                                    f"{format_ratio(compared)}")
    return warnings


def decode_summary(config: dict) -> dict:
    """How the decoded rules read a state, from the saved sweep config (older configs: the head)."""
    mode = config.get("decode", "head")
    loops = config.get("decode_loops", 1) if mode == "rest" else None
    direction, prior = config.get("kl_direction", "new_old"), config.get("kl_prior", "none")
    start = ", its first reading compared with the uniform distribution" if prior == "uniform" else ""
    return {
        "mode": mode, "loops": loops, "kl_direction": direction, "kl_prior": prior,
        "description": DECODE_DESCRIPTIONS[mode].format(loops=loops) + f"; kl is {KL_FORMULAS[direction]}{start}",
    }


def summarize(result: dict, tolerance: float, noise_threshold: float = NOISE_THRESHOLD) -> dict:
    """The ``"summary"`` of a measured result (see the module docstring)."""
    reference = result["reference"]
    timings = [t for t in TIMINGS if f"ms_per_token_{t}" in reference]
    matched = {ranking: matched_quality(result, tolerance, ranking, noise_threshold)
               for ranking in ("steps", *timings)}
    headline = "b1" if "b1" in timings else "steps"
    report = "generate" if "generate" in timings else headline
    within = [row for row in matched[headline] if row["value"] is not None]
    if headline == "steps":
        best = max(within, key=lambda row: row["steps_saved"], default=None)
    else:
        best = max(within, key=lambda row: row[f"speedup_vs_full_{headline}"], default=None)
    cheapest = cheapest_fixed(result, reference["ppl"] * (1.0 + tolerance), headline)
    warnings = noise_warnings(result, matched, (headline, report), noise_threshold)
    measured_keys = [key for key in LATENCY_DEFINITIONS if key in reference]
    return {
        "format": SUMMARY_FORMAT,
        "tolerance": tolerance,
        "full_ppl": reference["ppl"],
        "ppl_limit": reference["ppl"] * (1.0 + tolerance),
        "full_steps": sum(result["k_max"]),
        "timings": timings,
        "timing_path": reference.get("timing_path") if timings else None,
        "latency_definitions": {key: LATENCY_DEFINITIONS[key] for key in measured_keys},
        "latency_key": f"ms_per_token_{report}" if report != "steps" else None,
        "report_ranking": report,
        "headline_ranking": headline,
        "matched_quality": matched,
        "matched_fixed_budget": cheapest["budget"] if cheapest else None,
        "best": best,
        "noise_threshold": noise_threshold,
        "noise_warnings": warnings,
        "noisy": bool(warnings),
        "packed_over_dense": packed_over_dense(result, noise_threshold),
        "decode": decode_summary(result.get("config", {})),
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

LATENCY_COLUMNS = ("ms_per_token_b1", "ms_per_token_batched", "ms_per_token_generate", "dense_ms_per_token_b1",
                   "dense_ms_per_token_batched")
CSV_FIELDS = (
    "policy", "parameter", "value", "ce", "ppl", "mean_steps", "mean_used",
    *(f"{key}{part}" for key in LATENCY_COLUMNS for part in ("", "_q1", "_q3")),
    "baseline_budget", "baseline_ce", "baseline_ppl", "baseline_ms_per_token_b1", "baseline_ms_per_token_batched",
    "baseline_ms_per_token_generate",
)


def sweep_rows(result: dict) -> list[dict]:
    """Flat rows (one per point, then the reference and the ladder) for the CSV."""
    rows = []

    def latencies(entry: dict) -> dict:
        cells = {}
        for key in LATENCY_COLUMNS:
            cells[key] = entry.get(key)
            q1, q3 = entry.get(f"{key}_iqr", (None, None))
            cells.update({f"{key}_q1": q1, f"{key}_q3": q3})
        return cells

    def fixed_row(kind: str, fixed: dict) -> dict:
        return {
            "policy": kind, "parameter": "budget", "value": "|".join(map(str, fixed["budget"])),
            "ce": fixed["ce"], "ppl": fixed["ppl"], "mean_steps": _join(fixed["mean_steps"]),
            "mean_used": _join(fixed["mean_used"]), **latencies(fixed),
        }

    for point in result["points"]:
        base = point["baseline"]
        rows.append({
            "policy": point["policy"], "parameter": point["parameter"],
            "value": "|".join(f"{v:g}" for v in point["values"]) if "values" in point else point["value"],
            "ce": point["ce"], "ppl": point["ppl"], "mean_steps": _join(point["mean_steps"]),
            "mean_used": _join(point["mean_used"]), **latencies(point),
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
