"""The sweep's section of a run's HTML report (built with :mod:`rdepth.report`).

Reads a saved sweep result and its summary (:mod:`rdepth.exits.summary`);
computes nothing. :func:`render_sweep` draws the figures and writes the section
from a result, e.g. one re-read with :func:`rdepth.exits.summary.load_sweep`.
"""

from __future__ import annotations

import os
from pathlib import Path

from rdepth.exits.plots import save_sweep_figures
from rdepth.exits.summary import summary_of
from rdepth.report.html import Section, add_section

SECTION_NAME = "early_exit"


def _round(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) else value


def _matched_row(row: dict, ranking: str, tolerance: float) -> dict:
    """The columns of a matched-quality row worth a table cell."""
    if row["value"] is None:
        return {"policy": row["policy"], "setting": f"none within {100 * tolerance:g}%"}
    cells = {
        "policy": row["policy"], "setting": row["value"], "ppl vs full": f"{100 * row['ppl_vs_full']:+.2f}%",
        "loop steps (all groups)": _round(row["steps"], 2), "steps saved": f"{100 * row['steps_saved']:.1f}%",
    }
    if ranking != "steps":
        cells.update({
            f"ms/token ({ranking})": _round(row.get(f"ms_per_token_{ranking}")),
            "speedup vs full": _round(row.get(f"speedup_vs_full_{ranking}"), 3),
            "speedup vs matched fixed": _round(row.get(f"speedup_vs_fixed_{ranking}"), 3),
        })
    cells["matched fixed budget"] = row.get("matched_fixed_budget")
    return cells


def write_report_section(result: dict, run_dir: str | os.PathLike, figures: dict[str, Path]) -> Path:
    """Add (or replace) the "Early exit" section of ``run_dir/index.html``; returns the page path."""
    summary = summary_of(result)
    run_dir = Path(run_dir)
    reference = result["reference"]
    tolerance = summary["tolerance"]
    ranking = summary["report_ranking"]
    section = Section(SECTION_NAME, "Early exit: latency and quality across thresholds", order=30)
    env = result["environment"]
    timing_note = (
        f" Timing on {env.get('device')} (median of {result['config']['repeats']} warm, synchronised runs)."
        if summary["timings"] else " Latency was not measured."
    )
    section.note(
        f"Teacher-forced evaluation on {reference['tokens']} held-out tokens per point; per-token exits per "
        f"group with step cap k_max = {result['k_max']}. Reference: the full fixed budget, perplexity "
        f"{summary['full_ppl']:.4f}.{timing_note}"
    )
    if ranking == "steps":
        caption = "Each policy at its fewest loop steps"
    else:
        caption = f"Each policy at its fastest point ({ranking} timing)"
    caption += f" within {100 * tolerance:g}% of the full budget's perplexity"
    if ranking != "steps":
        caption += ("; speedups > 1 mean faster than the full budget / than the cheapest fixed budget "
                    "of the same quality")
    section.table([_matched_row(row, ranking, tolerance) for row in summary["matched_quality"][ranking]],
                  caption=caption)
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
        "fig_pareto": f"Perplexity against latency: every policy, the fixed budgets, the +{100 * tolerance:g}% line",
        "fig_exit_histograms": "Loop steps computed per token, per group",
    }
    for name, path in figures.items():
        section.figure(Path(path).relative_to(run_dir), captions.get(name, name))
    return add_section(run_dir, section, title="rdepth sweep")


def render_sweep(result: dict, out: str | os.PathLike, *, report: bool = True) -> dict[str, Path]:
    """Draw the figures into ``out/figures`` and (``report``) write the page section; returns the paths."""
    summary_of(result)  # an older result fails here, before anything is written
    out = Path(out)
    paths = save_sweep_figures(result, out / "figures")
    if report:
        paths["report"] = write_report_section(result, out, dict(paths))
    return paths
