"""The sweep's section of a run's HTML report (built with :mod:`rdepth.report`).

Reads a saved sweep result and its summary (:mod:`rdepth.sweep.summary`);
computes nothing. :func:`render_sweep` draws the figures and writes the section
from a result, e.g. one re-read with :func:`rdepth.sweep.summary.load_sweep`.
"""

from __future__ import annotations

import os
from pathlib import Path

from rdepth.report.html import Section, add_section, format_percent, format_value
from rdepth.sweep.plots import group_names, save_sweep_figures
from rdepth.sweep.stats import format_ratio
from rdepth.sweep.summary import TIMING_LABELS, setting_value, summary_of

SECTION_NAME = "early_exit"


def _round(value, digits: int = 4):
    return round(value, digits) if isinstance(value, float) else value


def _matched_row(row: dict, ranking: str, tolerance: float, groups: str) -> dict:
    """The columns of a matched-quality row worth a table cell."""
    if row["value"] is None:
        return {"policy": row["policy"], "setting": f"none within {100 * tolerance:g}%"}
    cells = {
        "policy": row["policy"], "setting": setting_value(row) if "values" in row else row["value"],
        "ppl vs full (%)": format_percent(row["ppl_vs_full"]),
        "loop steps per token (all groups)": _round(row["steps"], 2),
        "steps saved (%)": format_percent(row["steps_saved"], 1, signed=False),
    }
    if ranking != "steps":
        cells[f"ms/token ({TIMING_LABELS[ranking]}, packed)"] = _round(row.get(f"ms_per_token_{ranking}"))
        cells["speedup vs full (packed) [IQR range]"] = _ratio(row, f"speedup_vs_full_{ranking}")
        cells["speedup vs matched fixed (packed)"] = _ratio(row, f"speedup_vs_fixed_{ranking}")
        if f"speedup_vs_dense_full_{ranking}" in row:
            cells["speedup vs full (dense path, reference)"] = _ratio(row, f"speedup_vs_dense_full_{ranking}")
    cells[f"matched fixed budget (loops, groups {groups})"] = row.get("matched_fixed_budget")
    return cells


def _short_ratio(compared: dict) -> str:
    """``1.23x [1.10-1.35]``, marked \u26a0 when within noise (the reason is in the note above the table)."""
    text = format_ratio({**compared, "noise": None})
    return ("\u26a0 " + text) if compared.get("noise") else text


def _ratio(row: dict, name: str) -> str:
    """A saved speedup with its range, and the noise flag when it is within noise."""
    if name not in row:
        return "-"
    # the cell stays short (the reason is in the warning list above the tables); the mark says "within noise"
    text = format_ratio({"ratio": row[name], "range": row[f"{name}_range"], "noise": None})
    return ("\u26a0 " + text) if row[f"{name}_noise"] else text


def _timing_note(result: dict, summary: dict) -> str:
    """What was timed, how, and on which path (all read from the saved result)."""
    if not summary["timings"]:
        return " Latency was not measured."
    env = result["environment"]
    config = result["config"]
    definitions = summary["latency_definitions"]
    text = (
        f" Timing on {env.get('device')}: {config.get('warmup')} warm-up calls per setting, then "
        f"{config['repeats']} rounds that each time every setting once in a shuffled order (so the full budget "
        f"and every policy run under the same load); median and interquartile range (IQR) per setting. "
        f"A speedup is flagged within noise when the two IQRs overlap or either IQR exceeds "
        f"{100 * summary['noise_threshold']:g}% of its median. Policies and fixed budgets are timed on the same "
        f"({summary['timing_path']}) path: active rows gathered, per-token keys/values; the dense fixed-budget "
        f"path is shown only as a reference. Latency 'b1' is {definitions['ms_per_token_b1']}."
    )
    if "ms_per_token_generate" in definitions:
        text += f" Decode latency ('generate'): {definitions['ms_per_token_generate']}."
    full = next((row for row in summary["packed_over_dense"] if row["budget"] == result["reference"]["budget"]),
                None)
    if full and "b1" in full:
        text += (f" For identical work (the full budget) the packed path takes {format_ratio(full['b1'])} the "
                 f"dense path's time at batch 1.")
    return text


def write_report_section(result: dict, run_dir: str | os.PathLike, figures: dict[str, Path]) -> Path:
    """Add (or replace) the "Early exit" section of ``run_dir/index.html``; returns the page path."""
    summary = summary_of(result)
    run_dir = Path(run_dir)
    reference = result["reference"]
    tolerance = summary["tolerance"]
    ranking = summary["report_ranking"]
    section = Section(SECTION_NAME, "Early exit: latency and quality across thresholds", order=30)
    if summary["noisy"]:
        section.note(
            f"\u26a0 WARNING: {len(summary['noise_warnings'])} timing comparison(s) below are within noise "
            f"(IQRs overlap or spread above {100 * summary['noise_threshold']:g}%); do not read those ratios as "
            "speedups. Each is listed after the tables.")
    decode = summary["decode"]
    names = group_names(result)
    groups = ", ".join(names)
    windows = result["config"].get("windows")
    subset = f" ({windows} windows × {result['config']['block_size']})" if windows and \
        result["config"].get("block_size") else ""
    section.note(
        f"Teacher-forced evaluation on this section's own {reference['tokens']:,} held-out tokens{subset} per "
        f"point; per-token exits per group (groups {groups}, named by 0-based layer range) with step cap "
        f"k_max = {', '.join(map(str, result['k_max']))} loops. Reference: the full fixed budget (every group at "
        f"k_max), perplexity {summary['full_ppl']:.4g} on these tokens; it differs from perplexities elsewhere on "
        "the page, which use other held-out tokens or loop budgets. Decoded rules (kl, entropy_diff, argmax_stable) "
        "read with "
        f"decode = {decode['mode']}: {decode['description']}.{_timing_note(result, summary)}"
    )
    if ranking == "steps":
        caption = "Each policy at its fewest loop steps"
    else:
        caption = f"Each policy at its fastest point ({ranking} timing)"
    caption += f" within {100 * tolerance:g}% of the full budget's perplexity"
    if ranking != "steps":
        caption += ("; speedups > 1 mean faster than the full budget / than the cheapest fixed budget "
                    "of the same quality, timed on the same packed path; [low-high] is the ratio the two "
                    "IQRs allow; \u26a0 marks a ratio within noise")
    section.table([_matched_row(row, ranking, tolerance, groups) for row in summary["matched_quality"][ranking]],
                  caption=caption)
    rows = []
    for point in result["points"]:
        rows.append({
            "policy": point["policy"],
            "setting": f"{point['parameter']}=" + (setting_value(point) if "values" in point else format_value(point["value"])),
            f"mean loop steps (groups {groups})": [round(m, 2) for m in point["mean_steps"]],
            "teacher-forced ms/token b1": _round(point.get("ms_per_token_b1")),
            "teacher-forced ms/token batched": _round(point.get("ms_per_token_batched")),
            "decode ms/token (generate)": _round(point.get("ms_per_token_generate")),
            "ppl": _round(point["ppl"]), "CE (nats/token)": _round(point["ce"]),
            "fixed budget at same steps (loops)": point["baseline"]["budget"],
            "fixed budget's ppl": _round(point["baseline"]["ppl"]),
        })
    section.table(rows, caption="Every sweep point and the fixed budget at its mean steps (latencies: medians, "
                                "packed path)")
    if summary["packed_over_dense"]:
        section.table([
            {"fixed budget": row["budget"],
             **{f"packed / dense time ({TIMING_LABELS[t]})": _short_ratio(row[t]) for t in ("b1", "batched")
                if t in row}}
            for row in summary["packed_over_dense"]
        ], caption="The packed path against the dense path for identical work (fixed budgets); > 1: packed is "
                   "slower; \u26a0 marks a ratio within noise (IQRs overlap or spread above the threshold)")
    if summary["noisy"]:
        section.bullets([f"{warning}." for warning in summary["noise_warnings"]],
                        caption="\u26a0 Timing comparisons within noise")
    captions = {
        "fig_latency_quality": "Latency, perplexity and cross-entropy against tau per policy (the paper's Figure 4)",
        "fig_pareto": f"Perplexity against latency: every policy, the fixed budgets, the +{100 * tolerance:g}% line",
        "fig_exit_histograms": "Loop steps computed per token, per group (groups named by layer range)",
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
