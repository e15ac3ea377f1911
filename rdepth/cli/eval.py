"""``rdepth eval``: validation cross-entropy and perplexity at chosen loop counts."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.run.config import EvalConfig

    parser = subparsers.add_parser(
        "eval",
        help="cross-entropy / perplexity of a checkpoint at given loop counts",
        description="Evaluate a checkpoint on prepared validation shards or a text file, at one or "
        "more loop budgets (N for every group, or N,N,... per group), beside the unigram baseline on the "
        "same tokens. On task data (rdepth prepare --corpus task:NAME): exact-match answer accuracy per "
        "held-out difficulty per loop budget.",
    )
    add_dataclass_flags(parser, EvalConfig, title="evaluation")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.run.config import EvalConfig
    from rdepth.run.eval_checkpoint import evaluate_checkpoint
    from rdepth.tasks.eval_checkpoint import evaluate_task_checkpoint, is_task_data
    from rdepth.tasks.evaluate import format_accuracy_table

    config = build(EvalConfig, {}, args)
    if config.exit_profile is not None:
        from rdepth.exitrun.profile_eval import evaluate_profile_checkpoint, format_profile_eval

        for line in format_profile_eval(evaluate_profile_checkpoint(config)):
            print(line)
        return 0
    if is_task_data(config.data):
        summary = evaluate_task_checkpoint(config)
        print(f"answer accuracy (%) per held-out difficulty; training difficulties {summary['train_difficulties']}")
        for line in format_accuracy_table(summary):
            print(line)
        return 0
    summary = evaluate_checkpoint(config)
    print(f"{summary['windows']} windows of {summary['seq_len']} tokens from {summary['data']}")
    for result in summary["results"]:
        print(f"loops {','.join(map(str, result['loop_counts'])):>12}: ce {result['ce']:.4f}  "
              f"ppl {result['ppl']:.2f}  ({result['tokens']} tokens)")
    baseline = summary["unigram_baseline"]
    if baseline:
        print(f"{'unigram baseline':>18}: ce {baseline['ce']:.4f}  ppl {baseline['ppl']:.2f}  "
              f"({baseline['tokens']} tokens, the same)")
    else:
        print("no unigram baseline: the run's training data folder is not available")
    return 0
