"""The sweep's section of a run's HTML report (built with :mod:`rdepth.report`)."""

from __future__ import annotations

import os
from pathlib import Path

from rdepth.exits.sweep import matched_quality
from rdepth.report.html import Section, add_section

SECTION_NAME = "early_exit"


def _round(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) else value


def _matched_row(row: dict, timing: str) -> dict:
    """The columns of a matched-quality row worth a table cell."""
    if row["value"] is None:
        return {"policy": row["policy"], "setting": "none within 1%"}
    return {
        "policy": row["policy"], "setting": row["value"], "ppl vs full": f"{100 * row['ppl_vs_full']:+.2f}%",
        "loop steps (all groups)": _round(row["steps"], 2), "steps saved": f"{100 * row['steps_saved']:.1f}%",
        f"ms/token ({timing})": _round(row.get(f"ms_per_token_{timing}")),
        "speedup vs full": _round(row.get(f"speedup_vs_full_{timing}"), 3),
        "speedup vs matched fixed": _round(row.get(f"speedup_vs_fixed_{timing}"), 3),
        "matched fixed budget": row.get("matched_fixed_budget"),
    }


def write_report_section(result: dict, run_dir: str | os.PathLike, figures: dict[str, Path]) -> Path:
    """Add (or replace) the "Early exit" section of ``run_dir/index.html``; returns the page path."""
    run_dir = Path(run_dir)
    reference = result["reference"]
    section = Section(SECTION_NAME, "Early exit: latency and quality across thresholds", order=30)
    env = result["environment"]
    section.note(
        f"Teacher-forced evaluation on {reference['tokens']} held-out tokens per point; per-token exits per "
        f"group with step cap k_max = {result['k_max']}. Reference: the full fixed budget, perplexity "
        f"{reference['ppl']:.4f}. Timing on {env.get('device')} (median of {result['config']['repeats']} "
        f"warm, synchronised runs)."
    )
    timing = "generate" if "ms_per_token_generate" in reference else "b1"
    section.table(
        [_matched_row(row, timing) for row in matched_quality(result, timing=timing)],
        caption=f"Each policy at its fastest point ({timing} timing) within 1% of the full budget's perplexity; "
        "speedups > 1 mean faster than the full budget / than the cheapest fixed budget of the same quality",
    )
    rows = []
    for point in result["points"]:
        rows.append({
            "policy": point["policy"], "setting": f"{point['parameter']}={point['value']:g}",
            "steps per group": [round(m, 2) for m in point["mean_steps"]],
            "ms/token b1": _round(point.get("ms_per_token_b1")),
            "ms/token batched": _round(point.get("ms_per_token_batched")),
            "ms/token generate": _round(point.get("ms_per_token_generate")),
            "ppl": _round(point["ppl"]), "ce": _round(point["ce"]),
            "fixed at same steps": point["baseline"]["budget"],
            "fixed ppl": _round(point["baseline"]["ppl"]),
        })
    section.table(rows, caption="Every sweep point and the fixed budget at its mean steps")
    captions = {
        "fig_latency_quality": "Latency, perplexity and cross-entropy against tau per policy (the paper's Figure 4)",
        "fig_pareto": "Perplexity against latency: every policy, the fixed budgets, the +1% line",
        "fig_exit_histograms": "Loop steps computed per token, per group",
    }
    for name, path in figures.items():
        section.figure(Path(path).relative_to(run_dir), captions.get(name, name))
    return add_section(run_dir, section, title="rdepth sweep")
