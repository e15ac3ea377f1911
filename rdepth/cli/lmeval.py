"""``rdepth lm-eval``: EleutherAI lm-eval harness tasks at one or more loop budgets."""

from __future__ import annotations

import argparse

from rdepth.cli.options import add_dataclass_flags, build


def register(subparsers) -> None:
    from rdepth.interop.config import LmEvalConfig

    parser = subparsers.add_parser(
        "lm-eval",
        help="score a checkpoint on lm-eval harness tasks per loop budget",
        description="Run lm-eval harness tasks (hub tasks, or local YAML tasks with --include-path) on a "
        "checkpoint through the registered 'rdepth' model, once per loop budget, and print each task's "
        "metrics per budget. Needs the lm-eval extra (pip install 'rdepth[lm-eval]').",
    )
    add_dataclass_flags(parser, LmEvalConfig, title="lm-eval")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdepth.errors import RdepthError
    from rdepth.interop.config import LmEvalConfig
    from rdepth.io import write_json

    config = build(LmEvalConfig, {}, args)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    try:
        from rdepth.interop.lm_eval_model import evaluate_budgets
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "lm_eval":
            raise RdepthError("lm-eval is not installed: pip install 'rdepth[lm-eval]'") from None
        raise
    summary = evaluate_budgets(config.checkpoint, config.task_list, config.loops or [None], config.include_path,
                               config.limit, config.batch_size, config.seed, config.device, config.bootstrap_iters,
                               config.speculation)
    for budget in summary["budgets"]:
        loops = ",".join(map(str, budget["loops"]))
        for task, metrics in budget["results"].items():
            shown = "  ".join(_with_error(name, value, metrics.get(f"{name}_stderr"))
                              for name, value in metrics.items() if "stderr" not in name and name != "sample_len")
            print(f"loops {loops:>10}  {task}: {shown}  ({metrics.get('sample_len', '?')} examples)")
        if "speculation" in budget:
            counts = budget["speculation"]
            kept = counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0
            print(f"loops {loops:>10}  speculation: {counts['rounds']} rounds, {counts['drafted']} drafts, "
                  f"{100 * kept:.1f}% kept")
    if config.json:
        write_json(config.json, summary)
    return 0


def _with_error(name: str, value: float, stderr: float | None) -> str:
    """``acc 0.4300 ± 0.0350`` (the standard error where the harness computed one)."""
    return f"{name} {value:.4f}" + (f" ± {stderr:.4f}" if isinstance(stderr, (int, float)) else "")
