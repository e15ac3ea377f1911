"""``rdepth demo``: the main job on the embedded default data (CPU, minutes)."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.demo import DemoConfig

    parser = subparsers.add_parser(
        "demo",
        help="the main job: a reasoning task whose answers need the loops (or --mode text), end to end",
        description="Task mode (the default): generate a pointer-chasing task, train a looped model on it "
        "beside its no-loop baseline (same data, steps and seed), report exact-match accuracy per difficulty "
        "at 1..32 test loops (including difficulties above training), sweep the exit policies on answer and "
        "other tokens, analyse the loop geometry, and write OUT/report/index.html. Text mode: prepare the "
        "default Wikipedia corpus, train the tiny preset with a series of checkpoints, evaluate at several "
        "loop budgets against the unigram baseline, then write the loop-geometry and early-exit report.",
    )
    add_dataclass_flags(parser, DemoConfig, title="demo")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.demo import DemoConfig, run_demo

    config = build(DemoConfig, {}, args)
    result = run_demo(config)
    if config.mode == "task":
        return _print_task(config, result)
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


def _print_task(config, result: dict) -> int:
    from rdepth.demo_task_report import findings, headline_text
    from rdepth.tasks.evaluate import format_accuracy_table

    overview = result["overview"]
    print()
    print("== rdepth demo (task): done in %.0f s" % result["wall_seconds"])
    print(headline_text(overview))
    print("exact match (%) of the looped model per held-out difficulty and test loops:")
    for line in format_accuracy_table(result["accuracy"]["looped"]):
        print(line)
    for name, table in result["accuracy"].items():
        if name != "looped":
            print(f"baseline {name}: " + ", ".join(f"d={row['difficulty']} {100 * row['accuracy']:.1f}"
                                                   for row in table["rows"]))
    for line in findings(overview):
        print("- " + line)
    for name, path in result["outputs"].items():
        print(f"{name:>12}: {path}")
    print(f"      report: {config.out}/report/index.html")
    print(f"     summary: {config.out}/demo.json")
    return 0
