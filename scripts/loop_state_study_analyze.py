"""Issue 26's CPU study, second half: analyse every finished run of scripts/loop_state_study.sh and
tabulate the default (sandwich) against the residual-stream loop state, per seed and as mean ± std.

For each run: ``rdepth analyze`` (float64; long budget 30; the DLR loop-budget curve; the own-state
Jacobian spectrum at 4 sampled positions) into RUN/analysis, and the validation cross-entropy at 1, 4
and 12 loops per group on the same held-out windows and noise (how much the loops matter). Writes
OUT/study.json and prints the Markdown tables of docs/results.md.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python scripts/loop_state_study_analyze.py runs/study26 data/wiki-bpe4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

LOOPS = (1, 4, 12)


def analyse(run: Path, data: str, sequences: int, windows: int) -> dict:
    import torch

    from rdepth.geometry.analyze import run_analysis
    from rdepth.geometry.config import AnalyzeConfig
    from rdepth.geometry.summary import load_summary
    from rdepth.run.evaluate import evaluate
    from rdepth.run.opened import open_run

    out = run / "analysis"
    if not (out / "geometry" / "summary.json").is_file():
        run_analysis(AnalyzeConfig(checkpoints=[str(run)], data=data, out=str(out), sequences=sequences, seq_len=64,
                                   batch_size=sequences, long_loops=30, dlr_curve_loops=30, dlr_curve_sequences=2,
                                   jacobian_positions=4, threads=1, progress=False, device="cpu"))
    summary = load_summary(out)
    opened = open_run(run, data, "cpu")
    held_out = opened.windows(windows, 64)
    ce = {loops: evaluate(opened.model, held_out, loop_counts=loops, batch_size=8)["ce"] for loops in LOOPS}
    final = summary["checkpoints"][-1]
    groups = final["budgets"]["long"]["groups"]
    spectra = final["jacobian"]["groups"]
    curve = summary.get("dlr_curve") or {}
    index = curve["loops"].index(12) if 12 in curve.get("loops", []) else None
    record = {
        "run": str(run), "loop_state": opened.config.loop_state, "checkpoint": final["label"],
        "ce": {str(k): v for k, v in ce.items()},
        "groups": {},
        "trend": [{"step": entry["step"], "settled_cosine": {g["name"]: g["headline"]["settled_cosine"]
                                                              for g in entry["budgets"]["long"]["groups"]}}
                  for entry in summary["checkpoints"]],
        "dlr_at_12": {boundary: {name: stats["median"][index] for name, stats in definitions.items()
                                 if name in ("literal", "output_refine")}
                      for boundary, definitions in curve.get("boundaries", {}).items()} if index is not None else None,
    }
    for group, spectrum in zip(groups, spectra, strict=False):
        headline = group["headline"]
        plateau = headline.get("plateau") or {}
        record["groups"][group["name"]] = {
            "settled_cosine": headline["settled_cosine"], "settled_cosine_std": headline["settled_cosine_std"],
            "noise_floor_step": headline["noise_floor_step"], "plateau_ratio": plateau.get("ratio"),
            "plateau": plateau.get("holds"), "last_relative_step": plateau.get("last_relative"),
            "spectral_radius": spectrum["spectral_radius"]["median"],
            "leading_angle_deg": spectrum["leading_angle_deg"]["median"],
        }
    del torch
    return record


def _fmt(values: list[float | None], digits: int = 2) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "n/a"
    each = " / ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)
    if len(present) < 2:
        return each
    return f"{statistics.mean(present):.{digits}f} ± {statistics.stdev(present):.{digits}f} ({each})"


def tables(records: list[dict]) -> str:
    states = sorted({r["loop_state"] for r in records}, key=lambda s: s != "sandwich")
    lines = (_ce_table(records, states) + [""] + _group_table(records, states) + [""]
             + _dlr_table(records, states) + [""] + _trend_lines(records))
    return "\n".join(lines) + "\n"


def _ce_table(records: list[dict], states: list[str]) -> list[str]:
    """Cross-entropy at 1, 4 and 12 loops per loop state, and the gains between them."""
    lines = ["| loop state | seeds | ce 1 loop | ce 4 loops | ce 12 loops | ce(1) - ce(4) | ce(4) - ce(12) |",
             "|---|---|---|---|---|---|---|"]
    for state in states:
        rows = [r for r in records if r["loop_state"] == state]
        ce = {k: [r["ce"][str(k)] for r in rows] for k in LOOPS}
        lines.append(f"| {state} | {len(rows)} | {_fmt(ce[1], 3)} | {_fmt(ce[4], 3)} | {_fmt(ce[12], 3)} | "
                     f"{_fmt([a - b for a, b in zip(ce[1], ce[4], strict=False)], 3)} | "
                     f"{_fmt([a - b for a, b in zip(ce[4], ce[12], strict=False)], 3)} |")
    return lines


def _group_table(records: list[dict], states: list[str]) -> list[str]:
    """Per loop state and group: settled cosine, plateau, the Jacobian's spectral radius and leading angle."""
    groups = list(records[0]["groups"])
    lines = ["| loop state | group | settled cosine | plateau (last/first over 10 steps) | plateau? | "
             "Jacobian spectral radius | leading eigenvalue angle (deg) |",
             "|---|---|---|---|---|---|---|"]
    for state in states:
        rows = [r for r in records if r["loop_state"] == state]
        for group in groups:
            values = [r["groups"][group] for r in rows]
            plateaus = "/".join("yes" if v["plateau"] else "no" for v in values)
            lines.append(f"| {state} | {group} | {_fmt([v['settled_cosine'] for v in values])} | "
                         f"{_fmt([v['plateau_ratio'] for v in values], 3)} | {plateaus} | "
                         f"{_fmt([v['spectral_radius'] for v in values])} | "
                         f"{_fmt([v['leading_angle_deg'] for v in values], 0)} |")
    return lines


def _dlr_table(records: list[dict], states: list[str]) -> list[str]:
    """Per loop state and boundary: DLR (Eq. 2) and the hand-off drift at K = 12."""
    lines = ["| loop state | boundary | DLR Eq. 2 at K = 12 | hand-off drift over refinement steps at K = 12 |",
             "|---|---|---|---|"]
    for state in states:
        rows = [r for r in records if r["loop_state"] == state and r["dlr_at_12"]]
        if not rows:
            continue
        for boundary in rows[0]["dlr_at_12"]:
            lines.append(f"| {state} | {boundary} | {_fmt([r['dlr_at_12'][boundary]['literal'] for r in rows], 1)} | "
                         f"{_fmt([r['dlr_at_12'][boundary]['output_refine'] for r in rows], 1)} |")
    return lines


def _trend_lines(records: list[dict]) -> list[str]:
    """The settled cosine over each run's checkpoint series (the mean over its groups)."""
    lines = ["Settled cosine over the checkpoint series (group mean, per seed):", ""]
    for record in records:
        series = ", ".join(f"step {p['step']}: " + _fmt([_group_mean(p["settled_cosine"])]) for p in record["trend"])
        lines.append(f"- {Path(record['run']).name}: {series}")
    return lines


def _group_mean(values: dict) -> float | None:
    present = [v for v in values.values() if v is not None]
    return statistics.mean(present) if present else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study", type=Path)
    parser.add_argument("data")
    parser.add_argument("--sequences", type=int, default=8, help="held-out windows of the geometry analysis")
    parser.add_argument("--windows", type=int, default=64, help="held-out windows of the cross-entropies")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    records = []
    for run in sorted(p for p in args.study.iterdir() if (p / "summary.json").is_file()):
        print(f"analysing {run}", file=sys.stderr, flush=True)
        records.append(analyse(run, args.data, args.sequences, args.windows))
    if not records:
        print("no finished runs", file=sys.stderr)
        return 2
    from rdepth.io import json_text  # standard JSON: a NaN or infinity is null
    (args.study / "study.json").write_text(json_text(records, indent=1))
    print(tables(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
