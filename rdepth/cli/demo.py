"""``rdepth demo``: the main job on the embedded default data (CPU, minutes)."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.demo import DemoConfig

    parser = subparsers.add_parser(
        "demo",
        help="the main job: prepare the default corpus, train tiny, evaluate, analyse, sweep exits",
        description="Prepare the default Wikipedia corpus, train the tiny preset on the CPU with a series "
        "of checkpoints, evaluate at several loop budgets against the unigram baseline, then write "
        "the loop-geometry and early-exit report to OUT/report/index.html.",
    )
    add_dataclass_flags(parser, DemoConfig, title="demo")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.demo import DemoConfig, run_demo

    config = build(DemoConfig, {}, args)
    result = run_demo(config)
    budgets, base = result["loop_budgets"], result["unigram_baseline"]
    print()
    print("== rdepth demo: done in %.0f s" % result["wall_seconds"])
    at_eval = next((row for row in budgets if row["loops"] == (result["final_val"] or {}).get("loop_counts")),
                   budgets[-1])
    if base:
        print(f"validation perplexity {at_eval['ppl']:.1f} at loops {at_eval['loops']} vs unigram baseline "
              f"{base['ppl']:.1f} on the same {base['tokens']:,} held-out tokens")
    if result["tokens_per_second"]:
        print(f"training throughput {result['tokens_per_second']:,.0f} tokens/s")
    print(f"perplexity by loop budget ({result['loop_budgets'][0]['tokens']:,} held-out tokens): " + ", ".join(
        f"{row['loops'][0]}: {row['ppl']:.1f}" for row in result["loop_budgets"]))
    for name, path in result["outputs"].items():
        print(f"{name:>9}: {path}")
    print(f"  summary: {config.out}/demo.json")
    return 0
