"""The vision run's report page, led by the retention table; drawn from the saved numbers only.

Reads ``results.json``, ``dynamics.json``, ``phases.json``, ``config.json``, ``similarity.npz`` and
``metrics.jsonl`` of a run folder written by :mod:`.vision`; nothing is recomputed here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rdepth.io import read_jsonl
from rdepth.report.figures import save_report_figure
from rdepth.surrogate.pages import plots
from rdepth.surrogate.pages.text import PROBE_KINDS as KINDS
from rdepth.surrogate.pages.text import _load, probe_rows


def write_vision_report(out: str | Path) -> Path:
    """Draw the figures and write the run's ``index.html``."""
    from rdepth.report import Report

    out = Path(out)
    results, dynamics = _load(out, "results.json"), _load(out, "dynamics.json")
    phases, config = _load(out, "phases.json"), _load(out, "config.json")
    teacher = config["teacher"]
    images = results["images"]
    report = Report(f"Raptor surrogates of the {config['config']['teacher']} ViT (Fashion-MNIST)",
                    intro=f"A {results['n_layers']}-layer ViT (head test accuracy {teacher.get('test_accuracy', 0):.4f}) "
                          f"and its k-block recurrent surrogates at equal compute (L layer applications), fitted on "
                          f"{images['fit']} training images' states; probes trained on {images['probe']} training "
                          f"images and scored on {images['test']} test images; fidelity and dynamics on the last "
                          f"{images['dynamics']} test images. Seed {results['seed']}.")
    section = report.section("retention", "Downstream retention (linear probes on the final [CLS])", order=10)
    section.table(probe_rows(results), caption=(
        "teacher probe = the ridge probe trained on the teacher's features, applied to the model's; own probe = "
        "retrained on the model's features. % of teacher = accuracy / the teacher's probe accuracy; normalised = "
        "(acc - pixel floor) / (teacher - pixel floor)"))
    section.note("raptor and equal_split make the teacher's L layer applications with k distinct blocks (equal "
                 "compute); truncated = the teacher's first k layers (the same k blocks' parameters, k applications). "
                 "equal_split is fitted exactly like raptor on equal phase lengths; where the two phase lists agree "
                 "they are the same model.")
    section.figures([(save_report_figure(plots.plot_retention(results, probe), out, f"retention_{probe}"),
                      f"{probe.replace('_', ' ')} accuracy against k") for probe in ("teacher_probe", "own_probe")])

    # The model alone decides no verdict (a null can pass the same checks): its column says so
    held = {"reproduced": "all", "partly": "some", "not": "none"}
    rows = [{"model": name, **{key: value for key, value in row.items() if key != "verdict"},
             "checks that hold (model alone)": held.get(row["verdict"], row["verdict"])}
            for name in ("teacher", "raptor") for row in dynamics["findings"][name]]
    findings = report.section("findings", "The paper's dynamics findings, measured", order=20)
    findings.table(rows, caption=f"teacher and the k = {results['k']} surrogate on the held-out images; "
                                 f"perturbation norm {dynamics['perturbation_relative_norm']} of each token's state; "
                                 "the checks on the model alone, not a verdict: the verdicts are against the nulls")
    null = dynamics.get("null")
    if null:
        findings.table([{"finding": row["finding"], "statistic": row["statistic"], "supports the claim": row["direction"],
                         "verdict against the nulls": row["verdict"], "why": row.get("why", "")}
                        for row in null["verdicts"]],
                       caption=f"the teacher against a random-init ViT of its shape and its own layers in a shuffled "
                               f"order, {null['seeds']} seeds of {null['images_per_seed']} held-out images each: "
                               "reproduced only where the teacher is beyond every null by more than the spread over "
                               "seeds and by the finding's minimum effect (and its own checks hold at every seed); "
                               "not reproduced where the random-init null is not beaten. The teacher's spread is one "
                               "trained network on several halves of the images, not several trainings")
    findings.figure(save_report_figure(plots.plot_basins(dynamics), out, "basins"),
                    "class basins: [CLS] angle to its class's mean direction (within) and between class directions")
    findings.figure(save_report_figure(plots.plot_perturbation(dynamics), out, "perturbation"),
                    "self-correction: angle between perturbed and clean [CLS] after a perturbation at each depth")
    findings.figure(save_report_figure(plots.plot_dynamics({n: dynamics[n] for n in ("teacher", "raptor")}), out,
                                       "dynamics"),
                    "teacher (black) and surrogate (blue): per-layer turning angle of [CLS] and patches, coherence "
                    "with the patches' mean direction, effective rank of the updates")

    similarity = report.section("phases", "Phases (fit images)", order=30)
    with np.load(out / "similarity.npz") as data:
        matrices = {name: data[name] for name in data.files}
    similarity.table([{"k": k, "chosen": record["chosen"], "similarity": record["similarity"],
                       "method": record["method"], **{f"{m} contrast": record["by_similarity"][record["similarity"]][m]
                                                      ["contrast"] for m in ("dp", "equal")}}
                      for k, record in phases.items()])
    k = str(results["k"])
    for name, matrix in matrices.items():
        drawn = {m: phases[k]["by_similarity"][name][m]["lengths"] for m in ("dp", "equal")}
        similarity.figure(save_report_figure(plots.plot_similarity(matrix, drawn, f"{name}, fit images"), out,
                                             f"similarity_{name}"), f"{name} similarity, k = {k} phases")
    fidelity = {f"{kind}": results["by_k"][k]["models"][kind] for kind in KINDS}
    report.section("fidelity", f"Layer-wise fidelity (k = {k}, held-out images)", order=40).figure(
        save_report_figure(plots.plot_fidelity(fidelity), out, "fidelity"), "cosine and relative MSE per depth")
    metrics_path = out / "metrics.jsonl"
    if metrics_path.is_file() and read_jsonl(metrics_path):
        report.section("fitting", "Fitting", order=50).table(
            [{"model": name, **{key: v for key, v in fit.items() if key != "tag"}}
             for name, fit in results["fits"].items()]).figure(
            save_report_figure(plots.plot_training(read_jsonl(metrics_path)), out, "training"), "loss per stage")
    return report.write(out)
