"""The loop-geometry section of a run's report page, built from the saved ``summary.json``.

Nothing here computes a number: the headline numbers (step-size decay ratios,
settled cosine, noise-floor step, effective rank, convergence, DLR) were saved
by :mod:`rdepth.geometry.summary` when the analysis ran; this module picks them
out into tables and sentences.

* loop scale, per checkpoint and group, at the summary's ``scale_budget`` (the
  long budget for language models): first step sizes, decay ratios, settled
  cosine, noise-floor step, effective rank of the last update, median
  convergence step;
* drift scale, per checkpoint and boundary, at the training budget: the DLR
  under each definition.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdepth.geometry.summary import load_slowest
from rdepth.report import Section

SECTION = "geometry"


def loop_scale_rows(summary: dict[str, Any], budget: str | None = None) -> list[dict[str, Any]]:
    """One row per checkpoint and group: step-size decay, settled cosine, rank, convergence."""
    budget = budget or summary["scale_budget"]
    rows = []
    for entry in summary["checkpoints"]:
        for group in entry["budgets"][budget]["groups"]:
            headline = group["headline"]
            row = {
                "checkpoint": entry["label"], "group": group["name"], "steps": group["steps"],
                "|Δ0|": headline["first_step_size"], "|Δ1|": headline["second_step_size"],
                "|Δ5|/|Δ0|": headline["decay_5_over_0"], "|Δ10|/|Δ0|": headline["decay_10_over_0"],
                "|Δ10|/|Δ1|": headline["decay_10_over_1"],
                "settled cos": headline["settled_cosine"],
                "noise floor at k": headline["noise_floor_step"],
            }
            if headline["last_effective_rank"] is not None:
                row["eff. rank (last Δ)"] = headline["last_effective_rank"]
            row["median conv. step"] = group["convergence"]["median"]
            row["never conv."] = group["convergence"]["never_fraction"]
            rows.append(row)
    return rows


def drift_scale_rows(summary: dict[str, Any], budget: str = "train") -> list[dict[str, Any]]:
    """One row per checkpoint and boundary: DLR means (and the default's median) per definition."""
    default = summary["dlr_default"]
    rows = []
    for entry in summary["checkpoints"]:
        for boundary, definitions in entry["budgets"][budget]["dlr"].items():
            row = {"checkpoint": entry["label"], "boundary": boundary,
                   f"DLR {default} (mean)": definitions[default]["mean"],
                   f"DLR {default} (median)": definitions[default]["median"]}
            row.update({f"DLR {name} (mean)": stats["mean"] for name, stats in definitions.items() if name != default})
            rows.append(row)
    return rows


def loss_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Validation loss per checkpoint and budget; empty when no budget has a loss (surrogates)."""
    rows = [
        {"checkpoint": entry["label"], "step": entry["step"],
         **{f"val CE, {name} loops {','.join(map(str, b['loop_counts']))}": b["loss"]
            for name, b in entry["budgets"].items() if b.get("loss") is not None}}
        for entry in summary["checkpoints"]
    ]
    return rows if any(len(row) > 2 for row in rows) else []


def at_a_glance(summary: dict[str, Any]) -> str:
    """Two sentences on the last checkpoint: how big hand-offs are vs. loop steps."""
    last = summary["checkpoints"][-1]
    default = summary["dlr_default"]
    dlr = last["budgets"]["train"]["dlr"]
    parts = [f"{b}: {d[default]['median']:.3g}" for b, d in dlr.items()]
    budget = summary["scale_budget"]
    groups = last["budgets"][budget]["groups"]
    decays = [f"{g['name']}: {value:.2g}" for g in groups if (value := g["headline"]["decay_10_over_1"]) is not None]
    settled = [f"{g['name']}: {value:.2f}" for g in groups if (value := g["headline"]["settled_cosine"]) is not None]
    text = (f"At {last['label']}, a hand-off between groups moves a token this many mean loop steps "
            f"(median {default}-iterate DLR): {'; '.join(parts) or 'n/a (one group)'}.")
    if decays:
        text += f" Within a loop, |Δ10|/|Δ1| is {'; '.join(decays)}."
    if settled:
        text += (f" Consecutive steps settle at cosine {'; '.join(settled)} (mean of the last "
                 f"{summary['headline_definitions']['settled_steps']} cosines of the {budget} budget above the "
                 "float noise floor).")
    return text


def geometry_section(out: str | Path, summary: dict[str, Any], figures: list[tuple[str, str]],
                     title: str = "Loop geometry: two scales", order: float = 10) -> Section:
    """The report section: glance text, headline tables, figures, slowest tokens, definitions."""
    section = Section(SECTION, title, order=order)
    section.note(at_a_glance(summary))
    section.table(loop_scale_rows(summary),
                  caption=f"Loop scale ({summary['scale_budget']} budget): step-size decay and settled angle")
    if summary["checkpoints"][0]["budgets"]["train"]["dlr"]:
        section.table(drift_scale_rows(summary), caption="Drift scale (training budget): drift-to-loop ratio")
    if loss_rows(summary):
        section.table(loss_rows(summary), caption="Validation cross-entropy (nats/token) of the analysed windows")
    for path, caption in figures:
        section.figure(path, caption)
    slowest = load_slowest(out)
    if slowest is not None:
        section.table(slowest["rows"], caption=(
            f"Slowest-converging tokens ({slowest['checkpoint']}, {slowest['budget']} budget): first step whose "
            f"relative step size falls under {slowest['threshold']:g} per group (= the step count if never)"))
    definitions = "; ".join(f"{name}: {text}" for name, text in summary["dlr_definitions"].items())
    settings = summary["settings"]
    if settings.get("source_note"):  # not a language model's checkpoints (e.g. a surrogate's phases)
        section.note(settings["source_note"])
        return section
    constants = summary["headline_definitions"]
    section.note(
        f"Measured on {summary['sequences']} held-out windows of {summary['seq_len']} tokens from "
        f"{settings['data']}; window i starts from the same initial-state noise in every checkpoint (and in "
        "`rdepth eval`). Step k's update is "
        f"Δ(k) = x(k+1) - x(k); x(0) is the random initial state. Bands are 1 sigma over tokens. "
        f"DLR definitions: {definitions}. Denominator: the mean step size of the earlier group. "
        f"Settled cosine: mean of the last {constants['settled_steps']} cosines whose steps are above the noise "
        f"floor (mean relative step size {constants['noise_floor']:g}; 'noise floor at k' is the first update "
        "under it, blank if never). "
        "Effective rank: exp of the entropy of the normalised singular values of the N x d matrix of "
        "updates at one step; once steps shrink to float32 rounding level it measures noise (near d). "
        "All numbers are in geometry/summary.json and geometry/<checkpoint>/<budget>.npz.")
    return section


def write_report(out: str | Path, summary: dict[str, Any], figures: list[tuple[str, str]]) -> Path:
    """Add (or replace) the geometry section in OUT's report page; returns index.html's path."""
    from rdepth.report import add_section

    folder = Path(out).resolve()
    name = folder.parent.name if folder.name == "report" else folder.name  # the run, for OUT/report pages
    return add_section(out, geometry_section(out, summary, figures), title=f"rdepth report: {name}")


__all__ = ["at_a_glance", "drift_scale_rows", "geometry_section", "loop_scale_rows", "loss_rows", "write_report"]
