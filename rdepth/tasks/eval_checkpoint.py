"""``rdepth eval`` on task data as one call: answer accuracy per difficulty per loop budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rdepth.config import parse_loop_counts
from rdepth.io import write_json
from rdepth.run.config import EvalConfig
from rdepth.run.opened import open_run
from rdepth.tasks.evaluate import task_accuracy_table


def is_task_data(path: str | Path) -> bool:
    """Whether ``path`` is a prepared folder of task data (its manifest has a ``task`` section)."""
    import json

    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return False
    try:
        return "task" in json.loads(manifest.read_text())
    except (json.JSONDecodeError, TypeError):
        return False


def evaluate_task_checkpoint(config: EvalConfig) -> dict[str, Any]:
    """Accuracy of ``config.checkpoint`` on every held-out difficulty of ``config.data`` at each
    budget in ``config.loops`` (``max_batches`` x ``batch_size`` bounds the problems per set).
    A text checkpoint on task data (or the reverse) fails on the tokenizer check."""
    if config.threads:
        torch.set_num_threads(config.threads)
    run = open_run(config.checkpoint, config.data, config.device)
    others = [open_run(baseline, config.data, config.device) for baseline in config.baseline or []]  # fail early
    budgets = [parse_loop_counts(spec, run.config.n_groups) if spec else run.config.default_eval_loops
               for spec in (config.loops or [None])]
    table = task_accuracy_table(run.model, config.data, budgets, batch_size=config.batch_size, device=run.device,
                                seed=config.seed, max_problems=config.max_windows, warm_start=config.warm_start)
    summary = {"checkpoint": str(run.checkpoint), "data": str(run.data), "task": True, **table, "baselines": []}
    for other in others:
        compared = task_accuracy_table(other.model, config.data, [None], batch_size=config.batch_size,
                                       device=other.device, seed=config.seed, max_problems=config.max_windows)
        summary["baselines"].append({"checkpoint": str(other.checkpoint), "layers": other.config.n_layer,
                                     "groups": other.config.groups, "parameters": other.model.num_parameters(),
                                     **compared})
    if config.json:
        write_json(config.json, summary)
    return summary
