"""Figures and the report section of a task exit sweep, drawn from the saved ``task_sweep.json`` only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rdepth.report import Section, add_section
from rdepth.report.figures import pyplot, save_report_figure
from rdepth.sweep.depth import DEPTH_FIGURE
from rdepth.sweep.summary import decode_summary

SECTION = "task_exits"


def accuracy_vs_steps(result: dict) -> Any:
    """Per difficulty: accuracy against mean loop steps per token (the fixed ladder as a line, each
    policy's grid as points), and each point's steps on answer tokens against the other tokens."""
    plt = pyplot()
    blocks = result["difficulties"]
    figure, axes = plt.subplots(len(blocks), 2, figsize=(10, 3.6 * len(blocks)), squeeze=False)
    for row, block in zip(axes, blocks, strict=False):
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


def steps_per_hop(result: dict) -> Any:
    """Mean executed loop steps per hop count on answer tokens: one line per policy (its setting chosen in
    the saved summary, ``summary.depth.shown``), the per-token oracle in black; Spearman's rho in the legend."""
    plt = pyplot()
    depth, shown = result["depth"], result["summary"]["depth"]["shown"]
    by_label = {row["label"]: row for row in depth["settings"]}
    figure, axis = plt.subplots(figsize=(7, 4.2))

    def line(row: dict, label: str, **style) -> None:
        rho = row["spearman"]
        axis.plot(row["hops"], row["mean_steps_by_hops"], "-o", markersize=4,
                  label=f"{label} (rho {rho:.2f})" if rho is not None and rho == rho else f"{label} (rho n/a)", **style)

    for _policy, chosen in shown.items():
        line(by_label[chosen["label"]], chosen["label"], alpha=0.85)
    line(depth["oracle"], "per-token oracle", color="black", linewidth=2)
    hops = sorted({h for row in depth["settings"] + [depth["oracle"]] for h in row["hops"]})
    axis.set_xticks(hops)
    axis.set(xlabel="hops the answer needs", ylabel="loop steps executed (mean, all groups)",
             title="Does depth track difficulty? (answer tokens)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def render_task_sweep(result: dict, out: str | Path, *, report: bool = True) -> dict[str, Path]:
    """Save the figures and (``report``) add the section to ``out``'s page; returns name -> path."""
    out = Path(out)
    figure_path = save_report_figure(accuracy_vs_steps(result), out, "task_exits")
    paths = {"figure": out / figure_path}
    depth_path = None
    if "depth" in result:
        depth_path = save_report_figure(steps_per_hop(result), out, DEPTH_FIGURE)
        paths["depth_figure"] = out / depth_path
    if report:
        paths["report"] = add_section(out, task_section(result, figure_path, depth_path))
    return paths


def _percent(fraction: float | None) -> float | None:
    """A saved fraction as percent, like the table's accuracies (None stays None)."""
    return None if fraction is None else 100 * fraction


def _rho(value: float | None) -> float | None:
    """A saved correlation for a table cell (NaN is saved as null: None)."""
    return None if value is None or value != value else value


def task_section(result: dict, figure_path: str, depth_path: str | None = None) -> Section:
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
    if depth_path is not None:
        depth = result["depth"]
        rows = [{"setting": row["label"], "Spearman rho": _rho(row["spearman"]),
                 "rho on the oracle's tokens": _rho(row.get("spearman_oracle_tokens", row["spearman"])),
                 "mean steps": row["mean_steps"], "answer tokens": row["tokens"]}
                for row in depth["settings"] + [depth["oracle"]]]
        section.table(rows, caption="Does depth track difficulty? Spearman's rank correlation of the loop steps each "
                                    "setting executes with the hops each answer token needs, on every swept "
                                    "difficulty's answer tokens pooled (depth_vs_hops.csv: mean steps per hop count)")
        section.figure(depth_path, "Mean loop steps executed per hop count on answer tokens: each policy at its "
                                   "cheapest setting within the tolerance (else its most accurate), and the per-token "
                                   "oracle (the fewest fixed-budget steps from which the token's greedy prediction "
                                   f"stays right up to the cap; {depth['oracle']['undefined']} token(s) wrong at the cap "
                                   "left out).")
    config = result["config"]
    timing = (f"; wall time is teacher-forced ms per token (median of {config['repeats']} interleaved rounds, batch "
              f"{config['timing_batch_size']}) on {result['environment'].get('device', '?')}"
              if config.get("timing", True) else "; wall time was not measured (--no-timing)")
    section.note(f"Steps are loop steps per token summed over groups{timing}. Decoded rules read "
                 f"{decode_summary(config)['description']}.")
    return section
