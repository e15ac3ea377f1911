"""Markdown tables of bench/depth_batching.py results, one JSON per seed:

    python scripts/depth_batching_table.py runs/cdb/bench/s0.json runs/cdb/bench/s1.json runs/cdb/bench/s2.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    reports = [json.loads(Path(path).read_text()) for path in paths]
    print("| seed | F (cheapest fixed on A) | rule chosen on A (timed) | steps/position | accuracy on B: rule, F | "
          "paired diff on B (pts, SE) | meets bar on B | share of 200 splits |")
    print("|---|---|---|---|---|---|---|---|")
    for seed, report in enumerate(reports):
        choice, quality = report["choice"], report["quality"]
        fixed = choice["fixed"]
        for name, label in choice["timed"].items():
            if label is None:
                print(f"| {seed} | {fixed} | {name}: none meets the bar on A | | | | | |")
                continue
            mode = report["choice"].get("timed_mode", {}).get(name, "plain")
            judged = report["judged_b"].get(f"{name} {mode}")
            share = report["split_shares"].get(f"{name} {mode}")
            print(f"| {seed} | {fixed} | {label} ({mode}) | {quality[label]['steps']:.2f} | "
                  f"{100 * quality[label]['solved_b']:.1f}, {100 * quality[fixed]['solved_b']:.1f} | "
                  f"{100 * judged['paired_diff']:+.2f} ({100 * judged['paired_se']:.2f}) | "
                  f"{'yes' if judged['meets'] else 'no'} | {100 * share:.0f}% |")
    print()
    widths = sorted({width for report in reports for width in report["timing"]}, key=lambda w: int(w[2:]))
    def family(name: str) -> tuple[str, str]:
        kind, label = name.split(" | ")
        return kind, "F" if label.startswith("fixed") else label.split()[0]

    families = sorted({family(name) for report in reports for width in report["timing"].values()
                       for name in width["rows"]}, key=lambda f: (f[0] != "engine", f[0], f[1] != "F", f[1]))
    print("| B | row | " + " | ".join(f"seed {s}: tokens/s (x fastest path at F), paid steps, share of bound"
                                   for s in range(len(reports))) + " |")
    print("|---|---|" + "---|" * len(reports))
    for width in widths:
        for kind, rule in families:
            cells = []
            for report in reports:
                rows = report["timing"].get(width, {}).get("rows", {})  # a width this seed did not time: -
                hit = next((r for n, r in rows.items() if family(n) == (kind, rule)), None)
                if hit is None:
                    cells.append("-")
                    continue
                extra = f", solved {100 * hit['solved']:.1f}%" if "solved" in hit else ""
                ratio = hit.get("vs_fastest_fixed", hit["vs_engine_fixed"])  # (older reports: the eager engine)
                cells.append(f"{hit['tokens_per_s']:.0f} (x{ratio:.2f}), "
                             f"{hit['paid_steps_per_position']:.2f}, {100 * hit['share_of_bound']:.0f}%{extra}")
            print(f"| {width[2:]} | {kind}, {rule} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
