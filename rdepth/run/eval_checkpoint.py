"""``rdepth eval`` as one call: a checkpoint's held-out cross-entropy at each loop budget."""

from __future__ import annotations

from typing import Any

import torch

from rdepth.config import parse_loop_counts
from rdepth.io import write_json
from rdepth.run.config import EvalConfig
from rdepth.run.evaluate import evaluate, unigram_baseline
from rdepth.run.opened import open_run


def evaluate_checkpoint(config: EvalConfig) -> dict[str, Any]:
    """Evaluate ``config.checkpoint`` on ``config.data`` at every budget in ``config.loops``.

    Returns (and writes to ``config.json`` when given) ``{"checkpoint", "data", "windows",
    "seq_len", "results": [{loop_counts, ce, ppl, tokens}], "unigram_baseline",
    "unigram_baseline_val_split"}``. ``unigram_baseline`` is the train-split unigram model on the
    same evaluated tokens (the floor a language model must beat; None when the run's training
    data is gone); ``unigram_baseline_val_split`` is the prepared folder's, over its whole val split.
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    run = open_run(config.checkpoint, config.data, config.device)
    windows = run.windows(config.max_windows)
    budgets = [parse_loop_counts(spec, run.config.n_groups) for spec in (config.loops or [None])]
    results = []
    for counts in budgets:
        results.append(evaluate(run.model, windows, loop_counts=counts, batch_size=config.batch_size,
                                device=run.device, seed=config.seed, progress=config.progress,
                                warm_start=config.warm_start))
    summary = {
        "checkpoint": str(run.checkpoint), "data": str(run.data), "windows": int(windows.shape[0]),
        "seq_len": int(windows.shape[1] - 1), "results": results,
        "unigram_baseline": None if run.unigram is None else unigram_baseline(windows, run.unigram),
        "unigram_baseline_val_split": run.baseline,
    }
    if config.json:
        write_json(config.json, summary)
    return summary
