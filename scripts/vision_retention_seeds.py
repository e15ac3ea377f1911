"""Mean +- sd over seeds of the retention table of several ``rdepth surrogate --teacher vit-fmnist`` runs.

Reads each run folder's ``results.json`` (nothing is recomputed) and prints a markdown table:
for every k and model present in all runs, the teacher-probe and own-probe accuracies as % of
the teacher's and normalised by the pixel floor, with the margin of Raptor over each baseline
in units of the larger seed sd.

    python scripts/vision_retention_seeds.py runs/vit_s0 runs/vit_s1 runs/vit_s2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

METRICS = ("teacher_probe_retention", "teacher_probe_normalised", "own_probe_retention", "own_probe_normalised",
           "final_cosine")


def mean_sd(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (one per seed)")
    args = parser.parse_args()
    results = [json.loads((Path(run) / "results.json").read_text()) for run in args.runs]
    ks = sorted(set.intersection(*(set(r["by_k"]) for r in results)), key=int)
    seeds = [r["seed"] for r in results]
    teacher = mean_sd([r["teacher"]["own_probe_accuracy"] for r in results])
    floor = mean_sd([r["floor"]["pixel_probe_accuracy"] for r in results])
    print(f"seeds {seeds}; teacher probe accuracy {teacher[0]:.4f} +- {teacher[1]:.4f}; "
          f"pixel floor {floor[0]:.4f} +- {floor[1]:.4f}\n")
    print("| k | model | phases | teacher probe, % of teacher | teacher probe, normalised | own probe, % of teacher "
          "| own probe, normalised | final-state cosine |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for k in ks:
        for kind in ("raptor", "equal_split", "truncated"):
            values = {m: mean_sd([r["by_k"][k]["models"][kind][m] for r in results]) for m in METRICS}
            summary[(k, kind)] = values
            phases = sorted({str(r["by_k"][k]["phases"] if kind == "raptor" else r["by_k"][k]["equal_split"])
                             for r in results}) if kind != "truncated" else [f"first {k}"]
            cells = []
            for m in METRICS:
                scale = 100.0 if m.endswith("retention") else 1.0
                cells.append(f"{scale * values[m][0]:.2f} +- {scale * values[m][1]:.2f}" if scale == 100.0
                             else f"{values[m][0]:.3f} +- {values[m][1]:.3f}")
            print(f"| {k} | {kind} | {' / '.join(phases)} | " + " | ".join(cells) + " |")
    print()
    for k in ks:
        for probe in ("teacher_probe_normalised", "own_probe_normalised"):
            raptor = summary[(k, "raptor")][probe]
            for base in ("equal_split", "truncated"):
                other = summary[(k, base)][probe]
                spread = max(raptor[1], other[1])
                print(f"k = {k}, {probe}: raptor - {base} = {raptor[0] - other[0]:+.3f} "
                      f"({(raptor[0] - other[0]) / spread:+.1f} x the larger seed sd {spread:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
