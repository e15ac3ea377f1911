"""The run report: ``index.html`` with figures (PNG + SVG) and tables, built from saved numbers.

Pages use the project's shared report format (:mod:`rdepth.report`). :func:`write_report` reads ``results.json``, ``phases.json``, ``similarity.npz``,
``dynamics.json`` and ``metrics.jsonl`` from a run folder; nothing is recomputed here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from rdepth.errors import RdepthError
from rdepth.io import read_jsonl
from rdepth.report.figures import save_report_figure
from rdepth.surrogate.pages import plots

RETENTION_COLUMNS = ["final_cosine", "final_rel_mse", "embedding_cosine", "pairwise_spearman", "nn_top1",
                     "nn_overlap@10", "probe_accuracy", "probe_retention", "teacher_probe_accuracy"]


def format_value(value) -> str:
    """Plain-text cell for markdown tables: floats to 4 decimals, lists in brackets."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_value(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _load(out: Path, name: str):
    path = out / name
    if not path.is_file():
        raise RdepthError(f"{path} is missing: cannot build the report")
    return json.loads(path.read_text())


# Table headers for the saved metric names (what each measures, and its scale).
RETENTION_LABELS = {
    "final_cosine": "final-state cosine", "final_rel_mse": "final-state relative MSE",
    "embedding_cosine": "sentence-embedding cosine", "pairwise_spearman": "pairwise-similarity Spearman ρ",
    "nn_top1": "nearest-neighbour top-1 (fraction)", "nn_overlap@10": "nearest-neighbour overlap@10 (fraction)",
    "probe_accuracy": "probe accuracy (fraction)", "probe_retention": "probe retention (÷ teacher's)",
    "teacher_probe_accuracy": "teacher's probe accuracy (fraction)",
}


def retention_rows(results: dict) -> list[dict]:
    """One row per model: its phase lengths and the retention metrics, headed by readable names."""
    rows = []
    for name, metrics in results["models"].items():
        lengths = results["phases"].get(name, "")
        rows.append({"model": name, "phase lengths (layers)": lengths,
                     **{RETENTION_LABELS.get(c, c): metrics[c] for c in RETENTION_COLUMNS if c in metrics}})
    return rows


PROBE_KINDS = ("raptor", "equal_split", "truncated")


def probe_rows(results: dict, floor_key: str = "pixel_probe_accuracy",
                   floor_label: str = "pixel probe (floor)") -> list[dict]:
    """The headline table: one row per (k, model) plus the teacher and the floor.

    ``results``: a block with ``teacher``, ``floor`` and ``by_k`` (a vision run's results, or a text
    run's ``probe``); ``floor_key`` names the floor's accuracy in ``results["floor"]``.
    """
    teacher = results["teacher"]
    floor = results["floor"][floor_key]
    rows = [{"k": "-", "model": f"teacher (L = {results['n_layers']})", "phases": "",
             "teacher probe acc": teacher["teacher_probe_accuracy"], "teacher probe % of teacher": 100.0,
             "teacher probe normalised": 1.0, "own probe acc": teacher["own_probe_accuracy"],
             "own probe % of teacher": 100.0, "own probe normalised": 1.0, "final cosine": 1.0},
            {"k": "-", "model": floor_label, "phases": "", "own probe acc": floor,
             "own probe % of teacher": 100.0 * floor / teacher["own_probe_accuracy"], "own probe normalised": 0.0}]
    for k, entry in results["by_k"].items():
        for kind in PROBE_KINDS:
            metrics = entry["models"][kind]
            phases = entry["phases"] if kind == "raptor" else (entry["equal_split"] if kind == "equal_split"
                                                                else f"first {k} layers")
            rows.append({"k": int(k), "model": kind, "phases": phases,
                         "teacher probe acc": metrics["teacher_probe_accuracy"],
                         "teacher probe % of teacher": 100.0 * metrics["teacher_probe_retention"],
                         "teacher probe normalised": metrics["teacher_probe_normalised"],
                         "own probe acc": metrics["own_probe_accuracy"],
                         "own probe % of teacher": 100.0 * metrics["own_probe_retention"],
                         "own probe normalised": metrics["own_probe_normalised"],
                         "final cosine": metrics.get("final_cosine", "")})
    if not any(row["final cosine"] != "" for row in rows[2:]):  # a text probe: no state fidelity saved here
        for row in rows:
            row.pop("final cosine", None)
    return rows


def write_report(out: str | Path) -> Path:
    """Draw the figures and write the run's ``index.html`` (shared :mod:`rdepth.report` format)."""
    from rdepth.report import Report

    out = Path(out)
    results, phases, dynamics = _load(out, "results.json"), _load(out, "phases.json"), _load(out, "dynamics.json")
    config = _load(out, "config.json")
    with np.load(out / "similarity.npz") as data:
        matrices = {name: data[name] for name in data.files}
    report = Report(f"Raptor surrogate of {config['config']['teacher']}",
                    intro=f"A {results['k']}-block recurrent surrogate of a {config['n_layers']}-layer teacher, "
                          f"fitted on {results['n_fit']} sentences and evaluated on {results['n_eval']} held-out ones.")
    if "probe" in results:
        probe = results["probe"]
        section = report.section("probe", "Downstream retention: WordNet glosses' 45 lexicographer classes", order=5)
        section.table(probe_rows(probe, "token_embedding_probe_accuracy", "token-embedding mean (floor)"), caption=(
            f"ridge probes (penalty {probe['penalty']} x N) on each model's sentence feature (mean over real tokens "
            f"of the final state), trained on {probe['glosses']['train']} glosses and scored on "
            f"{probe['glosses']['test']} held-out ones (majority class {probe['majority_test_accuracy']:.3f}). "
            "teacher probe = trained on the teacher's features, applied to the model's; own probe = retrained. "
            "normalised = (acc - floor) / (teacher - floor), the floor being the same probe on the mean token "
            "embedding"))
        section.note("raptor and equal_split: k distinct blocks making the teacher's L layer applications, fitted "
                     "on the run's fit sentences (never on the glosses); truncated = the teacher's first k layers. "
                     "Where the chosen phases are the equal split, both rows are the same model.")
        section.figures([(save_report_figure(plots.plot_retention(probe, name, "token_embedding_probe_accuracy",
                                                                  "token-embedding mean (floor)"),
                                             out, f"probe_{name}"), f"{name.replace('_', ' ')} accuracy against k")
                         for name in ("teacher_probe", "own_probe")])
    rows = retention_rows(results)
    note = ("truncated = the teacher's first k layers (the surrogate's parameter budget, k layer applications); "
            "equal_split = a surrogate fitted identically on equal phases (L layer applications, like raptor).")
    if results.get("equal_split_is_raptor"):
        note += " Here the similarity phases are the equal split, so both rows are the same model."
    report.section("retention", "Retention and final-state fidelity (held-out)", order=10).table(
        rows, caption="beside the two baselines").note(note)

    sets = {"fit": phases["by_similarity"], "held-out": phases.get("by_similarity_eval", {})}
    phase_rows = [{"sentences": label, "similarity": similarity, "method": method,
                   **{key.replace("_", " ") + (" (layers)" if key == "lengths" else ""): value
                      for key, value in entry.items()}}
                  for label, by_similarity in sets.items()
                  for similarity, methods in by_similarity.items() for method, entry in methods.items()]
    similarity = report.section("phases", f"Phases for k = {phases['k']} (layer outputs 1..L)", order=20)
    similarity.table(phase_rows, caption=(
        f"score = average association; contrast = within - between. The surrogate's phases are "
        f"{phases['method']} on the {phases['similarity']} matrix of the fit sentences; the held-out rows show "
        "what the same methods would pick on the evaluation sentences (not used)"))
    for name, matrix in matrices.items():
        drawn = {m: phases["by_similarity"][name][m]["lengths"] for m in ("dp", "maxcut")}
        figure = plots.plot_similarity(matrix, drawn, f"{name}, fit sentences (depth 0 = embedding)")
        similarity.figure(save_report_figure(figure, out, f"similarity_{name}"),
                          f"{name} similarity of the fit sentences with DP and max-cut phases")
    report.section("fidelity", "Layer-wise fidelity", order=30).figure(
        save_report_figure(plots.plot_fidelity(results["models"]), out, "fidelity"),
        "cosine and relative MSE per depth")
    report.section("dynamics", "Dynamics", order=40).figure(
        save_report_figure(plots.plot_dynamics(dynamics), out, "dynamics"),
        "teacher (black) and surrogate (blue): per-layer turning angle, coherence with the others' mean "
        "direction, effective rank of the updates")
    geometry_rows = [{"model": name, "phase": entry["phase"], "layers": entry["layers"],
                      "step size per iteration": entry["step_size"], "step cosine": entry["cosine"]}
                     for name in ("teacher", "raptor") for entry in dynamics[name].get("loop_geometry", [])]
    if geometry_rows:
        report.section("dynamics").table(
            geometry_rows, caption="each phase read as a loop (rdepth.geometry step sizes and consecutive-step "
            "cosines over real tokens): the teacher's layers of the phase vs the surrogate's iterated block")
    metrics_path = out / "metrics.jsonl"
    if metrics_path.is_file() and read_jsonl(metrics_path):
        fit_rows = [{"model": name, **{k: v for k, v in fit.items() if k != "tag"}}
                    for name, fit in results["fits"].items()]
        report.section("fitting", "Fitting", order=50).table(fit_rows).figure(
            save_report_figure(plots.plot_training(read_jsonl(metrics_path)), out, "training"), "loss per stage")
    return report.write(out)
