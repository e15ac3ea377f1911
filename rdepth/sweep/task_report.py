"""Figures and the report section of a task exit sweep, drawn from the saved ``task_sweep.json`` only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdepth.report import Section, add_section
from rdepth.report.figures import pyplot, save_report_figure

SECTION = "task_exits"


def accuracy_vs_steps(result: dict) -> Any:
    """Per difficulty: accuracy against mean loop steps per token (the fixed ladder as a line, each
    policy's grid as points), and each point's steps on answer tokens against the other tokens."""
    plt = pyplot()
    blocks = result["difficulties"]
    figure, axes = plt.subplots(len(blocks), 2, figsize=(10, 3.6 * len(blocks)), squeeze=False)
    for row, block in zip(axes, blocks):
        left, right = row
        fixed = block["fixed"]
        left.plot([e["steps"] for e in fixed], [100 * e["accuracy"] for e in fixed], "-o", color="0.4",
                  markersize=3, label="fixed budgets")
        policies: dict[str, list[dict]] = {}
        for point in block["points"]:
            policies.setdefault(point["policy"], []).append(point)
        for name, points in policies.items():
            left.plot([p["steps"] for p in points], [100 * p["accuracy"] for p in points], "o", label=name,
                      alpha=0.8)
            right.plot([p["mean_steps_other"] for p in points], [p["mean_steps_answer"] for p in points], "o",
                       label=name, alpha=0.8)
        top = max(max(e["mean_steps_answer"], e["mean_steps_other"]) for e in fixed + block["points"])
        right.plot([0, top], [0, top], ":", color="0.5", label="equal steps")
        left.set(xlabel="mean loop steps per token (all groups)", ylabel="exact match (%)",
                 title=f"difficulty {block['difficulty']}: accuracy vs compute")
        right.set(xlabel="steps on other tokens", ylabel="steps on answer tokens",
                  title="where the policies spend their steps")
        left.legend(fontsize=7)
        right.legend(fontsize=7)
    figure.tight_layout()
    return figure


def render_task_sweep(result: dict, out: str | Path, *, report: bool = True) -> dict[str, Path]:
    """Save the figure and (``report``) add the section to ``out``'s page; returns name -> path."""
    out = Path(out)
    figure_path = save_report_figure(accuracy_vs_steps(result), out, "task_exits")
    paths = {"figure": out / figure_path}
    if report:
        paths["report"] = add_section(out, task_section(result, figure_path))
    return paths


def _percent(fraction: float | None) -> float | None:
    """A saved fraction as percent, like the table's accuracies (None stays None)."""
    return None if fraction is None else 100 * fraction


def task_section(result: dict, figure_path: str) -> Section:
    tolerance = 100 * result["summary"]["tolerance"]
    section = Section(SECTION, "Early exit on the task", order=21)
    rows = []
    for summary in result["summary"]["difficulties"]:
        best, full = summary.get("best"), summary["full"]
        cheapest = summary.get("cheapest_fixed_as_accurate") or {}
        rows.append({
            "difficulty": summary["difficulty"],
            "full budget": full["label"], "full accuracy %": 100 * full["accuracy"], "full steps": full["steps"],
            f"best policy within {tolerance:g} pt": best["label"] if best else "none",
            "its accuracy %": 100 * best["accuracy"] if best else None,
            "its steps": best["steps"] if best else None,
            "steps on answers": best["mean_steps_answer"] if best else None,
            "steps on the rest": best["mean_steps_other"] if best else None,
            "steps saved vs full %": _percent(summary.get("steps_saved_vs_full")),
            "cheapest fixed as accurate": cheapest.get("label"),
            "steps saved vs it %": _percent(summary.get("steps_saved_vs_cheapest_fixed")),
            "wall time saved vs full %": _percent(summary.get("time_saved_vs_full")),
            "wall time saved vs that fixed %": _percent(summary.get("time_saved_vs_cheapest_fixed")),
        })
    section.table(rows, caption="The cheapest exit policy that stays within the tolerance of the full budget's "
                                "exact-match accuracy, against the full budget and the cheapest fixed budget at "
                                "least as accurate")
    section.figure(figure_path, "Left: accuracy against mean loop steps per token (fixed budgets and every "
                                "policy setting on the same packed path). Right: steps on answer tokens against "
                                "steps on the other tokens; points above the diagonal spend more on answers.")
    section.note("Steps are loop steps per token summed over groups; wall time is teacher-forced ms per token "
                 f"(median of {result['config']['repeats']} interleaved rounds, batch "
                 f"{result['config']['timing_batch_size']}) on {result['environment'].get('device', '?')}.")
    return section
