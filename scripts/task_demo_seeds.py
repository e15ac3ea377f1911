"""Summarise several task-demo folders (one per seed) as Markdown: accuracy per difficulty and loop budget
with the per-seed values, the baselines, and the best exit policy of each seed.

    python scripts/task_demo_seeds.py runs/demo_s0 runs/demo_s1 runs/demo_s2

Reads only each folder's ``demo.json`` (written by ``rdepth demo``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _grid(table: dict) -> dict[int, dict[int, float]]:
    grid: dict[int, dict[int, float]] = {}
    for row in table["rows"]:
        loops = row["loop_counts"][0] if row.get("loop_counts") else 0
        grid.setdefault(row["difficulty"], {})[loops] = 100 * row["accuracy"]
    return grid


def _cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    mean = sum(values) / len(values)
    return f"{mean:.1f} ({min(values):.1f}-{max(values):.1f})"


def main(folders: list[str]) -> int:
    demos = [json.loads((Path(f) / "demo.json").read_text()) for f in folders]
    seeds = [d["config"].get("seed", 0) for d in demos]
    table = accuracy_lines(demos)
    print(f"seeds {', '.join(map(str, seeds))}: mean (min-max) exact match %")
    print()
    print("\n".join(table))
    print()
    for seed, demo in zip(seeds, demos, strict=False):
        print(best_policy_line(seed, demo))
    return 0


def accuracy_lines(demos: list[dict]) -> list[str]:
    """The table: per difficulty, each loop budget's accuracy over the seeds, then each baseline's."""
    looped = [_grid(d["accuracy"]["looped"]) for d in demos]
    budgets = sorted(set.intersection(*(set(next(iter(g.values()))) for g in looped)))
    difficulties = sorted(looped[0])
    baselines = sorted({name for d in demos for name in d["accuracy"] if name != "looped"})
    lines = ["| difficulty | " + " | ".join([f"{b} loop{'s' if b > 1 else ''}" for b in budgets] + baselines) + " |",
             "|---" * (1 + len(budgets) + len(baselines)) + "|"]
    for d in difficulties:
        cells = [_cell([g[d][b] for g in looped]) for b in budgets]
        for name in baselines:
            values = [_grid(demo["accuracy"][name])[d][0] for demo in demos if name in demo["accuracy"]]
            cells.append(_cell(values) + (f" [{len(values)} seeds]" if len(values) != len(demos) else ""))
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines


def best_policy_line(seed, demo: dict) -> str:
    """One seed's best exit policy within the tolerance against the full and the cheapest fixed budget."""
    summary = (demo.get("sweep_summary") or {}).get("difficulties", [{}])[0]
    best, full = summary.get("best"), summary.get("full")
    if not best:
        return f"- seed {seed}: no exit policy within the tolerance"
    cheapest = summary.get("cheapest_fixed_as_accurate") or {}
    return (f"- seed {seed}: {best['label']} {100 * best['accuracy']:.1f}% at {best['steps']:.2f} steps "
            f"(answers {best['mean_steps_answer']:.2f}, other {best['mean_steps_other']:.2f}); full "
            f"{full['label']} {100 * full['accuracy']:.1f}%; steps saved vs full "
            f"{100 * summary['steps_saved_vs_full']:.0f}%, vs {cheapest.get('label')} "
            f"{100 * summary.get('steps_saved_vs_cheapest_fixed', float('nan')):.0f}%; wall time vs full "
            f"{100 * summary.get('time_saved_vs_full', float('nan')):.0f}%, vs {cheapest.get('label')} "
            f"{100 * summary.get('time_saved_vs_cheapest_fixed', float('nan')):.0f}%")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
