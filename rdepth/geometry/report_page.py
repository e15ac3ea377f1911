"""The loop-geometry section of a run's report page, built from ``summary.json``.

Headline numbers (computed here from the saved curves, not from the model):

* loop scale, per checkpoint and group, at the long budget: the first step
  sizes, their decay ratios ||Delta^(5)|| / ||Delta^(0)|| and ||Delta^(10)|| /
  ||Delta^(0)|| (Delta^(0) leaves the random initial state, so the ratio to
  Delta^(1) is shown too), the settled cosine, the step where the loop reaches
  the float noise floor, the effective rank of the last update and the median
  convergence step;
* drift scale, per checkpoint and boundary, at the training budget: the DLR
  under each definition.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rdepth.geometry.analyze import GEOMETRY_DIR, SLOWEST_FILE
from rdepth.report import Section

SECTION = "geometry"
SETTLED_STEPS = 5
# A mean relative step size ||Delta|| / ||x|| under this is float32 rounding
# noise (eps ~1.2e-7 per coordinate): cosines between such steps are random.
NOISE_FLOOR = 1e-5


def noise_floor_step(group: dict[str, Any]) -> int | None:
    """First update index whose mean relative step size is under NOISE_FLOOR (None: never)."""
    below = [k for k, value in enumerate(group["relative_step_size"]["mean"]) if value < NOISE_FLOOR]
    return below[0] if below else None


def settled_cosine(group: dict[str, Any]) -> float | None:
    """Mean of the last SETTLED_STEPS cosines between steps still above the noise floor.

    Cosine j compares updates j and j+1; it counts while update j+1 is above the floor.
    """
    cosines = group["cosine"]["mean"]
    floor = noise_floor_step(group)
    usable = cosines if floor is None else cosines[: max(floor - 1, 0)]
    return float(np.mean(usable[-SETTLED_STEPS:])) if usable else None


def _ratio(values: list[float], k: int, base: int) -> float | None:
    if len(values) <= k or values[base] == 0:
        return None
    return values[k] / values[base]


def scale_budget(summary: dict[str, Any]) -> str:
    """The budget the loop-scale numbers come from: "long" when measured (language models), else "train"."""
    return "long" if "long" in summary.get("budgets", {}) else "train"


def loop_scale_rows(summary: dict[str, Any], budget: str | None = None) -> list[dict[str, Any]]:
    """One row per checkpoint and group: step-size decay, settled cosine, rank, convergence."""
    budget = budget or scale_budget(summary)
    rows = []
    for entry in summary["checkpoints"]:
        for group in entry["budgets"][budget]["groups"]:
            sizes = group["step_size"]["mean"]
            row = {
                "checkpoint": entry["label"], "group": group["name"], "steps": group["steps"],
                "|Δ0|": sizes[0], "|Δ1|": sizes[1] if len(sizes) > 1 else None,
                "|Δ5|/|Δ0|": _ratio(sizes, 5, 0), "|Δ10|/|Δ0|": _ratio(sizes, 10, 0),
                "|Δ10|/|Δ1|": _ratio(sizes, 10, 1),
                "settled cos": settled_cosine(group),
                "noise floor at k": noise_floor_step(group),
            }
            if group.get("effective_rank"):
                row["eff. rank (last Δ)"] = group["effective_rank"][-1]
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
    budget = scale_budget(summary)
    groups = last["budgets"][budget]["groups"]
    decays = [f"{g['name']}: {g['step_size']['mean'][10] / g['step_size']['mean'][1]:.2g}"
              for g in groups if len(g["step_size"]["mean"]) > 10 and g["step_size"]["mean"][1] > 0]
    settled = [f"{g['name']}: {value:.2f}" for g in groups if (value := settled_cosine(g)) is not None]
    text = (f"At {last['label']}, a hand-off between groups moves a token this many mean loop steps "
            f"(median {default}-iterate DLR): {'; '.join(parts) or 'n/a (one group)'}.")
    if decays:
        text += f" Within a loop, |Δ10|/|Δ1| is {'; '.join(decays)}."
    if settled:
        text += (f" Consecutive steps settle at cosine {'; '.join(settled)} (mean of the last {SETTLED_STEPS} "
                 f"cosines of the {budget} budget above the float noise floor).")
    return text


def geometry_section(out: str | Path, summary: dict[str, Any], figures: list[tuple[str, str]]) -> Section:
    """The report section: glance text, headline tables, figures, slowest tokens, definitions."""
    out = Path(out)
    section = Section(SECTION, "Loop geometry: two scales", order=10)
    section.note(at_a_glance(summary))
    section.table(loop_scale_rows(summary),
                  caption=f"Loop scale ({scale_budget(summary)} budget): step-size decay and settled angle")
    if summary["checkpoints"][0]["budgets"]["train"]["dlr"]:
        section.table(drift_scale_rows(summary), caption="Drift scale (training budget): drift-to-loop ratio")
    if loss_rows(summary):
        section.table(loss_rows(summary), caption="Validation cross-entropy (nats/token) of the analysed windows")
    for path, caption in figures:
        section.figure(path, caption)
    slowest_path = out / GEOMETRY_DIR / SLOWEST_FILE
    if slowest_path.exists():
        slowest = json.loads(slowest_path.read_text())
        section.table(slowest["rows"], caption=(
            f"Slowest-converging tokens ({slowest['checkpoint']}, {slowest['budget']} budget): first step whose "
            f"relative step size falls under {slowest['threshold']:g} per group (= the step count if never)"))
    definitions = "; ".join(f"{name}: {text}" for name, text in summary["dlr_definitions"].items())
    settings = summary["settings"]
    if settings.get("source_note"):  # not a language model's checkpoints (e.g. a surrogate's phases)
        section.note(settings["source_note"])
        return section
    section.note(
        f"Measured on {summary['sequences']} held-out windows of {summary['seq_len']} tokens from "
        f"{settings['data']}; every checkpoint starts from the same initial-state noise. Step k's update is "
        f"Δ(k) = x(k+1) - x(k); x(0) is the random initial state. Bands are 1 sigma over tokens. "
        f"DLR definitions: {definitions}. Denominator: the mean step size of the earlier group. "
        f"Settled cosine: mean of the last {SETTLED_STEPS} cosines whose steps are above the noise floor "
        f"(mean relative step size {NOISE_FLOOR:g}; 'noise floor at k' is the first update under it, blank if never). "
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


__all__ = ["at_a_glance", "drift_scale_rows", "geometry_section", "loop_scale_rows", "scale_budget", "write_report"]
