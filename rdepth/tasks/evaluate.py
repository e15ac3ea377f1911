"""Answer accuracy of a model on a task's held-out sets: per difficulty, per loop budget.

Each held-out set (``heldout_d{D}.npz``) holds whole problems packed into windows
of ``block_size + 1`` tokens. The windows run through the one held-out
evaluation loop (:func:`rdepth.run.evaluate.eval_outputs`, the same initial-state
noise as every other evaluation); a problem counts as solved when the greedy
prediction at every one of its answer positions is right. The answer-token
cross-entropy comes with it. This gives the test-time-compute curve: accuracy
against loops, at the training difficulties and above them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from rdepth.model import RecurrentLM
from rdepth.model.control import LoopController
from rdepth.run.evaluate import eval_outputs
from rdepth.tasks.accuracy import problem_correct
from rdepth.tasks.data import HeldOut, load_heldout, task_manifest


@torch.no_grad()
def heldout_accuracy(
    model: RecurrentLM,
    heldout: HeldOut,
    *,
    loop_counts: Sequence[int] | int | None = None,
    controller_factory: Callable[[], LoopController] | None = None,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    warm_start: bool = False,
) -> dict[str, Any]:
    """Exact-match accuracy on one held-out set at a fixed budget (``loop_counts``) or under
    per-token exits (``controller_factory``). Returns ``{difficulty, accuracy, problems,
    answer_ce, answer_tokens}`` plus, with exits, ``mean_steps_answer`` / ``mean_steps_other``
    (loop steps per token summed over groups, on answer tokens and on the rest). ``warm_start``:
    every group's loop starts from the state it handed on at the previous position (token by token)."""
    windows = torch.from_numpy(np.asarray(heldout.tokens, dtype=np.int64))
    masks = torch.from_numpy(np.asarray(heldout.answer_mask, dtype=bool))
    counts = None if controller_factory is not None else (
        model.config.default_eval_loops if loop_counts is None else model.resolve_loop_counts(loop_counts))

    def forward(x, y, noise):
        if controller_factory is not None:
            return model(x, y, controller=controller_factory(), generator=noise, warm_start=warm_start)
        return model(x, y, counts, generator=noise, warm_start=warm_start)

    predictions, loss_sum, scored = [], 0.0, 0
    steps_answer, steps_other = 0.0, 0.0
    first = 0
    for output, n_scored in eval_outputs(model, windows, forward, batch_size=batch_size, device=device, seed=seed,
                                         masks=masks):
        predictions.append(output.logits.argmax(-1).cpu())
        loss_sum += float(output.loss) * n_scored
        scored += n_scored
        if output.computed is not None:
            batch_masks = masks[first : first + output.logits.shape[0], 1:]
            total = sum(c.cpu().double() for c in output.computed)  # [B, T] steps over groups
            steps_answer += float(total[batch_masks].sum())
            steps_other += float(total[~batch_masks].sum())
        first += output.logits.shape[0]
    predicted = torch.cat(predictions).numpy()
    targets = heldout.tokens[:, 1:]
    _, solved = problem_correct(predicted, targets, heldout.answer_mask[:, 1:], heldout.problem_ids[:, 1:])
    result = {
        "difficulty": int(heldout.difficulty),
        "accuracy": float(solved.mean()) if solved.size else float("nan"),
        "problems": int(solved.size),
        "answer_ce": loss_sum / max(scored, 1),
        "answer_tokens": scored,
    }
    if counts is not None:
        result["loop_counts"] = list(counts)
    if controller_factory is not None:
        n_answer = int(masks[:, 1:].sum())
        n_other = int((~masks[:, 1:]).sum())
        result["mean_steps_answer"] = steps_answer / max(n_answer, 1)
        result["mean_steps_other"] = steps_other / max(n_other, 1)
    return result


def task_accuracy_table(
    model: RecurrentLM,
    data: str | Path,
    budgets: Sequence[Sequence[int] | int | None],
    *,
    difficulties: Sequence[int] | None = None,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    max_problems: int | None = None,
    warm_start: bool = False,
) -> dict[str, Any]:
    """Accuracy per held-out difficulty (default: every recorded one) per loop budget.

    Returns ``{"train_difficulties", "difficulties", "rows": [{loop_counts, difficulty, accuracy,
    problems, answer_ce, answer_tokens}]}``; ``max_problems`` keeps the first windows holding
    about that many problems (quicker runs).
    """
    manifest = task_manifest(data)
    recorded = sorted(int(d) for d in manifest["heldout"])
    chosen = recorded if difficulties is None else [int(d) for d in difficulties]
    sets = [load_heldout(data, d).first_problems(max_problems) for d in chosen]
    rows = []
    for budget in budgets:
        for heldout in sets:
            rows.append(heldout_accuracy(model, heldout, loop_counts=budget, batch_size=batch_size, device=device,
                                         seed=seed, warm_start=warm_start))
    return {"train_difficulties": manifest.get("train_difficulties"), "difficulties": chosen, "rows": rows}


def format_accuracy_table(table: dict[str, Any]) -> list[str]:
    """Rows of text: one line per loop budget, accuracy (%) per difficulty; then one line per
    baseline in ``table["baselines"]`` (each at its own loop counts), when present."""
    difficulties = table["difficulties"]
    header = "loops".rjust(12) + "".join(f"{'d=' + str(d):>8}" for d in difficulties)
    lines = [header]

    def rows_of(rows: list[dict], label=None) -> None:
        by_budget: dict[tuple, dict[int, float]] = {}
        for row in rows:
            by_budget.setdefault(tuple(row.get("loop_counts", ())), {})[row["difficulty"]] = row["accuracy"]
        for budget, accuracies in by_budget.items():
            cells = "".join(f"{100 * accuracies[d]:8.1f}" if d in accuracies and not math.isnan(accuracies[d])
                            else f"{'n/a':>8}" for d in difficulties)
            name = label or ",".join(map(str, budget))
            lines.append(name.rjust(12) + cells)

    rows_of(table["rows"])
    for index, baseline in enumerate(table.get("baselines") or [], 1):
        loops = ",".join(map(str, baseline["rows"][0].get("loop_counts", ()))) or "no loop"
        lines.append(f"  baseline {index}: {baseline['checkpoint']} ({baseline['layers']} layers, groups "
                     f"{baseline['groups'] or 'none'}, {baseline['parameters']:,} parameters), at {loops}:")
        rows_of(baseline["rows"], f"baseline {index}")
    return lines
