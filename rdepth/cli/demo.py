"""``rdepth demo``: the main job on the embedded default data (CPU, minutes)."""

from __future__ import annotations

import argparse
import contextlib
import logging

from rdepth.cli.options import add_dataclass_flags, build

# Loggers whose per-setting lines (the exit sweep's grid, the geometry's checkpoints, matplotlib's font
# cache) the demo's terminal leaves out: the report and demo.json hold the numbers. --verbose shows them.
CHATTY_LOGGERS = ("rdepth.exits", "rdepth.geometry", "matplotlib")


def register(subparsers) -> None:
    from rdepth.demo.run import DemoConfig

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
    from rdepth.demo.run import DemoConfig, run_demo

    config = build(DemoConfig, {}, args)
    with quiet(CHATTY_LOGGERS, enabled=not getattr(args, "verbose", False)):
        result = run_demo(config)
    if config.mode == "task":
        return _print_task(config, result)
    budgets, base = result["loop_budgets"], result["unigram_baseline"]
    print()
    print("== rdepth demo: done in {:.0f} s".format(result["wall_seconds"]))
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


@contextlib.contextmanager
def quiet(names: tuple[str, ...], enabled: bool = True):
    """Raise ``names``' loggers to WARNING while the block runs (their levels are restored after)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    if enabled:
        for logger in loggers:
            logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=False):
            logger.setLevel(level)


def task_table_lines(accuracy: dict) -> list[str]:
    """The final table: the looped model's row per test loop budget, then one row per baseline
    (labelled by name) under the same difficulty columns."""
    from rdepth.demo.task_report import SHORT_NAMES
    from rdepth.tasks.evaluate import format_accuracy_table

    looped = accuracy["looped"]
    lines = format_accuracy_table(looped)
    for name, table in accuracy.items():
        if name == "looped":
            continue
        rows = format_accuracy_table({"difficulties": looped["difficulties"], "rows": table["rows"]})[1:]
        lines += [SHORT_NAMES.get(name, name).rjust(12) + row[12:] for row in rows]
    return lines


def _print_task(config, result: dict) -> int:
    from rdepth.demo.task_report import findings, headline_text

    overview = result["overview"]
    print()
    print("== rdepth demo (task): done in {:.0f} s".format(result["wall_seconds"]))
    print(headline_text(overview))
    print("exact match (%) per held-out difficulty: the looped model at each test loop budget, then the baselines "
          "(trained on the same data and steps):")
    for line in task_table_lines(result["accuracy"]):
        print(line)
    for line in findings(overview):
        print("- " + line)
    for name, path in result["outputs"].items():
        print(f"{name:>12}: {path}")
    print(f"      report: {config.out}/report/index.html")
    print(f"     summary: {config.out}/demo.json")
    return 0
