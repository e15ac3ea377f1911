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
  under each definition, led by the default numerator over both denominators (Eq. 2's
  mean over all steps, and the mean over refinement steps k >= 1).
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
                "settled cos": headline["settled_cosine"] if headline["settled_cosine"] is not None else "no plateau",
                "± (tokens)": headline.get("settled_cosine_std"),
                "cosines above floor": (headline.get("settled_cosine_window") or {}).get("usable"),
                "plateau (last/first, 10 steps)": (headline.get("plateau") or {}).get("ratio"),
                "noise floor at k": headline["noise_floor_step"],
            }
            if headline["last_effective_rank"] is not None:
                row["eff. rank (last Δ)"] = headline["last_effective_rank"]
            row["median conv. step"] = group["convergence"]["median"]
            never = group["convergence"]["never_fraction"]  # a share: in percent, as the page's other shares
            row["never conv. %"] = None if never is None else f"{100 * never:.1f}"
            rows.append(row)
    return rows


def jacobian_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checkpoint and group: the own-state Jacobian's leading eigenvalue at the last iterate
    (median, min, max over the sampled positions)."""
    rows = []
    for entry in summary["checkpoints"]:
        spectra = entry.get("jacobian")
        if not spectra:
            continue
        for name, group in zip(summary["groups"], spectra["groups"], strict=False):
            radius, angle = group["spectral_radius"], group["leading_angle_deg"]
            rows.append({"checkpoint": entry["label"], "group": name, "positions": len(spectra["positions"]),
                         "|λ1| median": radius["median"], "|λ1| min-max": f"{radius['min']:.3g}-{radius['max']:.3g}",
                         "∠λ1 median (deg)": angle["median"],
                         "∠λ1 min-max": f"{angle['min']:.0f}-{angle['max']:.0f}"})
    return rows


def dlr_budget_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The DLR loop-budget curve at a few budgets: Eq. 2 and the start-free hand-off drift, medians."""
    curve = summary.get("dlr_curve")
    if not curve:
        return []
    rows = []
    for index, loops in enumerate(curve["loops"]):
        if loops not in (1, 2, 4, 8, 12, 16, 20, 30) and loops != curve["loops"][-1]:
            continue
        row: dict[str, Any] = {"K": loops}
        for boundary, definitions in curve["boundaries"].items():
            row[f"{boundary} Eq. 2"] = (definitions.get("literal") or {}).get("median", [None] * (index + 1))[index]
            row[f"{boundary} hand-off/refine"] = (definitions.get("output_refine") or {}).get(
                "median", [None] * (index + 1))[index]
            row[f"{boundary} hand-off/extent"] = (definitions.get("handoff") or {}).get(
                "median", [None] * (index + 1))[index]
        rows.append(row)
    return rows


def _dlr_label(summary: dict[str, Any], name: str) -> str:
    return f"{summary.get('dlr_labels', {}).get(name, name)} [{name}]"


def drift_scale_rows(summary: dict[str, Any], budget: str = "train") -> list[dict[str, Any]]:
    """One row per checkpoint and boundary: DLR mean per definition (column: its label and saved name).

    The default definition (Eq. 2's all-step denominator) and its refinement-step variant come
    first, each with its median; the other definitions follow with their means.
    """
    lead = [name for name in (summary["dlr_default"], summary.get("dlr_default_refine")) if name]
    rows = []
    for entry in summary["checkpoints"]:
        for boundary, definitions in entry["budgets"][budget]["dlr"].items():
            row = {"checkpoint": entry["label"], "boundary": boundary}
            for name in lead:
                if name in definitions:
                    row[f"{_dlr_label(summary, name)} mean"] = definitions[name]["mean"]
                    row[f"{_dlr_label(summary, name)} median"] = definitions[name]["median"]
            row.update({f"{_dlr_label(summary, name)} mean": stats["mean"]
                        for name, stats in definitions.items() if name not in lead})
            rows.append(row)
    return rows


def drift_scale_long_rows(summary: dict[str, Any], budget: str = "train") -> list[dict[str, Any]]:
    """The last checkpoint's DLR, one row per boundary and definition (the lead definitions first):
    mean, median and the 10th/90th percentiles over tokens. Narrow enough to read; the whole
    series is in Fig. 2 and in :func:`drift_scale_rows`."""
    lead = [name for name in (summary["dlr_default"], summary.get("dlr_default_refine")) if name]
    entry = summary["checkpoints"][-1]
    rows = []
    for boundary, definitions in entry["budgets"][budget]["dlr"].items():
        for name in lead + [n for n in definitions if n not in lead]:
            if name not in definitions:
                continue
            stats = definitions[name]
            rows.append({"checkpoint": entry["label"], "boundary": boundary,
                         "definition (drift ÷ loop step) [saved name]": _dlr_label(summary, name),
                         "mean": stats["mean"], "median": stats["median"], "p10": stats.get("p10"),
                         "p90": stats.get("p90")})
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


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def at_a_glance(summary: dict[str, Any]) -> str:
    """Two sentences on the last checkpoint: how big hand-offs are vs. loop steps."""
    last = summary["checkpoints"][-1]
    default, refine = summary["dlr_default"], summary.get("dlr_default_refine")
    dlr = last["budgets"]["train"]["dlr"]

    def medians(name: str) -> str:
        shown = [f"{b}: {_number(d[name]['median'])}" for b, d in dlr.items() if name in d]
        return "; ".join(shown) or "n/a (one group)"

    budget = summary["scale_budget"]
    groups = last["budgets"][budget]["groups"]
    decays = [f"group {g['name']}: {value:.2g}" for g in groups
              if (value := g["headline"]["decay_10_over_1"]) is not None]
    settled = [f"group {g['name']}: {value:.2f}" for g in groups
               if (value := g["headline"]["settled_cosine"]) is not None]
    if not dlr:
        text = f"At {last['label']}: one looped group, so no hand-offs between groups to measure."
    else:
        text = (f"At {last['label']}, a hand-off between groups moves a token this many mean loop steps "
                f"(median DLR, drift to the next group's first iterate, '{default}'): {medians(default)} against "
                "the mean of all loop steps (Eq. 2's denominator, which includes the jump Δ(0) from the random "
                "initial state)")
        if refine and any(refine in d for d in dlr.values()):
            text += f"; {medians(refine)} against the mean refinement step Δ(k), k ≥ 1 ('{refine}')"
        text += "."
    if decays:
        text += f" Within a loop, the step-size decay |Δ10|/|Δ1| per group is {'; '.join(decays)}."
    if settled:
        text += (f" Settled cosine of consecutive steps per group: {'; '.join(settled)} (mean of the last "
                 f"{summary['headline_definitions']['settled_steps']} cosines of the {budget} budget after the "
                 "step-size decay whose steps are above "
                 f"{summary['headline_definitions']['noise_floor']:g} of the first refinement step, when they "
                 "neither spread nor trend, measured in "
                 f"{(summary.get('settings') or {}).get('precision', 'float32')}).")
    return text


def _formula(text: str) -> str:
    """Saved formula source (``||x_{g+1}^(0) - x_g^(K_g)||, ...``) marked for the page builder to render
    with sub/superscripts and Unicode symbols."""
    return f"${text.replace('$', '')}$"


def dlr_note(summary: dict[str, Any]) -> str:
    """The sentence that says which DLR is which: numerators, the two denominators, saved names."""
    terms = summary.get("dlr_terms")
    if not terms:  # a hand-made summary: list the saved descriptions
        definitions = summary["dlr_definitions"].items()
        return "DLR definitions: " + "; ".join(f"{n}: {_formula(t)}" for n, t in definitions) + "."
    numerators = "; ".join(f"{label}: {_formula(text)}" for label, text in terms["numerators"].items())
    denominators = "; ".join(f"{label}: {_formula(text)}" for label, text in terms["denominators"].items())
    labels = summary.get("dlr_labels", {})
    names = ", ".join(f"{name} = {labels.get(name, name)}" for name in summary["dlr_definitions"])
    return (f"DLR = drift / loop step. Drift (numerator): {numerators}. Loop step (denominator, of the earlier "
            f"group g): {denominators}. Eq. 2 as written is 'literal'. The k≥0 mean is dominated by the jump Δ(0) "
            "from the random initial state (it is about |Δ(0)|/K); the k≥1 ('_refine') mean leaves that jump out "
            "and "
            "compares the hand-off with the refinement steps themselves. Both are means over the loop's steps, so "
            "when steps contract both ratios grow with the loop budget: compare them at equal budgets. "
            f"Saved names: {names}.")


def geometry_section(out: str | Path, summary: dict[str, Any], figures: list[tuple[str, str]],
                     title: str = "Loop geometry: two scales", order: float = 10) -> Section:
    """The report section: glance text, headline tables, figures, slowest tokens, definitions."""
    section = Section(SECTION, title, order=order)
    section.note(at_a_glance(summary))
    section.table(loop_scale_rows(summary),
                  caption=f"Loop scale ({summary['scale_budget']} budget): step-size decay and settled angle")
    if summary["checkpoints"][0]["budgets"]["train"]["dlr"]:
        section.table(drift_scale_long_rows(summary), caption=(
            f"Drift scale (training budget, {summary['checkpoints'][-1]['label']}): drift-to-loop ratio over tokens "
            "(p10/p90: 10th/90th percentiles); every checkpoint is in Fig. 2 and geometry/summary.json"))
    else:
        section.note("No drift-to-loop ratio (Fig. 2): the model has one looped group, so no state is handed on "
                     "from one group to another.")
    if dlr_budget_rows(summary):
        curve = summary["dlr_curve"]
        section.table(dlr_budget_rows(summary), caption=(
            f"DLR against the loop budget ({curve['checkpoint']}, {curve['sequences']} windows, median over tokens): "
            "Eq. 2 as written grows about like K (its denominator is dominated by the jump from the random start), "
            "so a verdict must name its K; 'hand-off/refine' is the two groups' output states over the earlier "
            "group's refinement steps, free of the random start"))
    if jacobian_rows(summary):
        section.table(jacobian_rows(summary), caption=(
            "Own-state Jacobian at each group's last iterate of the long budget: |λ1| is the contraction per step of "
            "the leading direction, ∠λ1 its turning per step (180°: each step flips the last, a negative cosine; "
            "0°: steps keep their direction)"))
    if loss_rows(summary):
        scored = ("the answer tokens (what the model is trained to predict) among "
                  if summary.get("loss_tokens") == "answers" else "")
        section.table(loss_rows(summary), caption=(
            f"Validation cross-entropy (nats/token) on {scored}this section's "
            f"{summary['sequences'] * summary['seq_len']:,} held-out tokens ({summary['sequences']} windows × "
            f"{summary['seq_len']}), a subset of the held-out split: other sections' evaluations use other windows, "
            "so their numbers differ"))
    for path, caption in figures:
        section.figure(path, caption)
    slowest = load_slowest(out)
    if slowest is not None:
        section.table(slowest["rows"], caption=(
            f"Slowest-converging tokens ({slowest['checkpoint']}, {slowest['budget']} budget): first step whose "
            f"relative step size falls under {slowest['threshold']:g} per group (= the step count if never)"))
    definitions = dlr_note(summary)
    settings = summary["settings"]
    if settings.get("source_note"):  # not a language model's checkpoints (e.g. a surrogate's phases)
        section.note(settings["source_note"])
        return section
    constants = summary["headline_definitions"]
    section.note(
        f"Measured in {settings.get('precision', 'float32')} on {summary['sequences']} held-out windows of "
        f"{summary['seq_len']} tokens "
        f"({summary['sequences'] * summary['seq_len']:,} tokens) from {settings['data']}; groups are named by "
        "their 0-based layer range; window i starts from the same initial-state noise in every checkpoint (and in "
        "rdepth eval). Step k's update is "
        f"Δ(k) = x(k+1) - x(k); x(0) is the random initial state. Bands are 1 sigma over tokens. "
        f"{definitions} "
        f"Settled cosine: mean of the last {constants['settled_steps']} cosines after the step-size decay (a "
        "tenth of the first refinement step) whose steps are above the noise floor (mean step size "
        f"{constants['noise_floor']:g} x the first refinement step ||Δ(1)||, or 32 x the precision's epsilon x the "
        "state's norm when larger; 'noise floor at k' is the first update under it, blank if never), when they stay "
        f"within {constants.get('settled_range', 0.2):g} of each other and trend by at most "
        f"{constants.get('settled_slope', 0.01):g} a step (or within 3.18 standard errors of no trend). "
        "Effective rank: exp of the entropy of the normalised singular values of the N x d matrix of "
        "updates at one step; once steps shrink to rounding level it measures noise (near d). "
        "All numbers are in geometry/summary.json and geometry/<checkpoint>/<budget>.npz.")
    return section


def write_report(out: str | Path, summary: dict[str, Any], figures: list[tuple[str, str]]) -> Path:
    """Add (or replace) the geometry section in OUT's report page; returns index.html's path."""
    from rdepth.io import final_path
    from rdepth.report import add_section

    folder = final_path(Path(out).resolve())  # OUT itself, also while written in its staging folder
    name = folder.parent.name if folder.name == "report" else folder.name  # the run, for OUT/report pages
    return add_section(out, geometry_section(out, summary, figures), title=f"rdepth report: {name}")


__all__ = ["at_a_glance", "dlr_note", "drift_scale_long_rows", "drift_scale_rows", "geometry_section",
           "loop_scale_rows", "loss_rows", "write_report"]
