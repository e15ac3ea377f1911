"""``rdepth sweep``: exit policies over a threshold grid; latency, perplexity, loop steps."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.exits.config import SweepConfig

    parser = subparsers.add_parser(
        "sweep",
        help="latency / quality of every exit policy over a threshold grid (paper Fig. 4)",
        description="Evaluate held-out text with per-token early exits for each policy over a tau grid "
        "(default 1e-5..1e-2, log scale); record loop steps per group, exit-step histograms, ms/token "
        "(batch 1 and batched), perplexity and cross-entropy, with the fixed budget at the same mean "
        "steps as a baseline. Writes sweep.json (with its summary), sweep.csv, figures/ and an "
        "index.html section into --out.",
    )
    add_dataclass_flags(parser, SweepConfig, title="sweep")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.exits.config import SweepConfig
    from rdepth.exits.sweep import sweep_checkpoint

    result = sweep_checkpoint(build(SweepConfig, {}, args))
    summary = result["summary"]
    ranking = summary["headline_ranking"]
    tolerance = f"{100 * summary['tolerance']:g}%"
    print(f"full budget {result['reference']['budget']}: ppl {summary['full_ppl']:.4f}; "
          f"each policy's {'fewest-steps' if ranking == 'steps' else 'fastest (batch 1)'} point within {tolerance}:")
    for row in summary["matched_quality"][ranking]:
        if row["value"] is None:
            print(f"{row['policy']:>20}: no point within {tolerance} of the full budget's perplexity")
            continue
        speed = f"speedup_vs_full_{ranking}"
        timing = f", {row[speed]:.2f}x the full budget's speed" if speed in row else ""
        print(f"{row['policy']:>20}: value {row['value']:g}, ppl {row['ppl']:.4f} "
              f"({100 * row['ppl_vs_full']:+.2f}%), steps saved {100 * row['steps_saved']:.1f}%{timing}")
    print(f"wrote {result['paths']['json']} and the report {result['paths'].get('report', '')}")
    return 0
