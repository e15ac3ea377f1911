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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rdepth.model import RecurrentLM
from rdepth.model.control import LoopController
from rdepth.model.generation import teacher_forced
from rdepth.model.recurrent import lm_loss
from rdepth.run.evaluate import eval_outputs
from rdepth.tasks.accuracy import problem_correct
from rdepth.tasks.data import HeldOut, load_heldout, task_manifest


class _Tally:
    """Greedy predictions and the answer cross-entropy of one budget, batch by batch."""

    def __init__(self):
        self.predictions: list[torch.Tensor] = []
        self.loss_sum = 0.0
        self.scored = 0

    def add(self, logits: torch.Tensor, loss: torch.Tensor, n_scored: int) -> None:
        self.predictions.append(logits.argmax(-1).cpu())
        self.loss_sum += float(loss) * n_scored
        self.scored += n_scored

    def answer_right(self, heldout: HeldOut) -> np.ndarray:
        """bool [N]: whether the greedy prediction of each answer target is right, row-major."""
        predicted = torch.cat(self.predictions).numpy()
        mask = heldout.answer_mask[:, 1:].astype(bool)
        return predicted[mask] == heldout.tokens[:, 1:][mask]

    def result(self, heldout: HeldOut) -> dict[str, Any]:
        predicted = torch.cat(self.predictions).numpy()
        _, solved = problem_correct(predicted, heldout.tokens[:, 1:], heldout.answer_mask[:, 1:],
                                    heldout.problem_ids[:, 1:])
        return {
            "difficulty": int(heldout.difficulty),
            "accuracy": float(solved.mean()) if solved.size else float("nan"),
            "problems": int(solved.size),
            "answer_ce": self.loss_sum / max(self.scored, 1),
            "answer_tokens": self.scored,
        }


def _arrays(heldout: HeldOut) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(np.asarray(heldout.tokens, dtype=np.int64)),
            torch.from_numpy(np.asarray(heldout.answer_mask, dtype=bool)))


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
    per_token: bool = False,
) -> dict[str, Any]:
    """Exact-match accuracy on one held-out set at a fixed budget (``loop_counts``) or under
    per-token exits (``controller_factory``). Returns ``{difficulty, accuracy, problems,
    answer_ce, answer_tokens}`` plus, with exits, ``mean_steps_answer`` / ``mean_steps_other``
    (loop steps per token summed over groups, on answer tokens and on the rest). ``warm_start``:
    every group's loop starts from the state it handed on at the previous position (token by token).
    ``per_token``: also ``answer_right`` (bool [N]) and ``answer_steps`` (float64 [N], loop steps
    executed, summed over groups), one entry per answer target (``answer_mask[:, 1:]``) in row-major
    order: numpy arrays, for the caller to reduce before saving."""
    windows, masks = _arrays(heldout)
    counts = None if controller_factory is not None else (
        model.config.default_eval_loops if loop_counts is None else model.resolve_loop_counts(loop_counts))

    def forward(x, y, noise):
        if controller_factory is not None:
            return teacher_forced(model, x, y, controller_factory=controller_factory, noise=noise,
                                  warm_start=warm_start)
        return teacher_forced(model, x, y, loop_counts=counts, noise=noise, warm_start=warm_start)

    tally = _Tally()
    steps_answer, steps_other = 0.0, 0.0
    answer_steps: list[torch.Tensor] = []
    first = 0
    for output, n_scored in eval_outputs(model, windows, forward, batch_size=batch_size, device=device, seed=seed,
                                         masks=masks):
        tally.add(output.logits, output.loss, n_scored)
        batch_masks = masks[first : first + output.logits.shape[0], 1:]
        if output.computed is not None:
            total = sum(c.cpu().double() for c in output.computed)  # [B, T] steps over groups
            steps_answer += float(total[batch_masks].sum())
            steps_other += float(total[~batch_masks].sum())
            answer_steps.append(total[batch_masks])
        else:  # dense fixed budget: every token runs the counts
            answer_steps.append(torch.full((int(batch_masks.sum()),), float(sum(counts)), dtype=torch.float64))
        first += output.logits.shape[0]
    result = tally.result(heldout)
    if per_token:
        result["answer_right"] = tally.answer_right(heldout)
        result["answer_steps"] = torch.cat(answer_steps).numpy() if answer_steps else np.zeros(0)
    if counts is not None:
        result["loop_counts"] = list(counts)
    if controller_factory is not None:
        n_answer = int(masks[:, 1:].sum())
        n_other = int((~masks[:, 1:]).sum())
        result["mean_steps_answer"] = steps_answer / max(n_answer, 1)
        result["mean_steps_other"] = steps_other / max(n_other, 1)
    return result


@torch.no_grad()
def heldout_accuracy_budgets(
    model: RecurrentLM,
    heldout: HeldOut,
    budgets: Sequence[Sequence[int] | int | None],
    *,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """:func:`heldout_accuracy` at each of several fixed ``budgets``, one result per budget, in order,
    equal to separate calls but cheaper.

    Budgets that differ only in the last group's count share that group's trajectory: without exits
    every position takes the same steps in lock-step, so the state after k steps is the same whatever
    the budget beyond k. One dense pass runs the last group to the largest count of the family, and
    at each requested step an observer hands the state to the stages after the group
    (:meth:`RecurrentLM.run_after`) and the readout. The same operations on the same tensors as a
    run at that budget, so the numbers are identical (tested), for about max(k) loop steps instead
    of sum(k).
    """
    windows, masks = _arrays(heldout)
    resolved = [model.config.default_eval_loops if budget is None else model.resolve_loop_counts(budget)
                for budget in budgets]
    last = model.n_groups - 1
    families: dict[tuple[int, ...], list[int]] = {}
    for index, counts in enumerate(resolved):
        families.setdefault(tuple(counts[:last]), []).append(index)
    tallies = [_Tally() for _ in resolved]
    for head, members in families.items():
        steps = {resolved[index][last] for index in members} if last >= 0 else set()
        longest = (*head, max(steps)) if last >= 0 else ()
        logits_at: dict[int, torch.Tensor] = {}
        batch: dict[str, torch.Tensor] = {}

        def observe(group, step, state, active, steps=steps, logits_at=logits_at, longest=longest, batch=batch):
            if group == last and step in steps:
                logits_at[step] = model.readout(model.run_after(group, state, longest, batch["noise"]))

        def forward(x, y, noise, logits_at=logits_at, batch=batch, longest=longest, observe=observe):
            logits_at.clear()
            batch.update(targets=y, noise=noise)
            return model(x, y, longest, noise=noise, observer=observe if last >= 0 else None)

        for output, n_scored in eval_outputs(model, windows, forward, batch_size=batch_size, device=device,
                                             seed=seed, masks=masks):
            for index in members:
                if last < 0:  # no loop: every budget is the one pass
                    tallies[index].add(output.logits, output.loss, n_scored)
                else:
                    logits = logits_at[resolved[index][last]]
                    tallies[index].add(logits, lm_loss(logits, batch["targets"]), n_scored)
    results = []
    for counts, tally in zip(resolved, tallies, strict=False):
        result = tally.result(heldout)
        result["loop_counts"] = list(counts)
        results.append(result)
    return results


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
    if warm_start:  # positions one at a time: no shared trajectory
        per_set = [[heldout_accuracy(model, heldout, loop_counts=budget, batch_size=batch_size, device=device,
                                     seed=seed, warm_start=True) for budget in budgets] for heldout in sets]
    else:
        per_set = [heldout_accuracy_budgets(model, heldout, budgets, batch_size=batch_size, device=device, seed=seed)
                   for heldout in sets]
    rows = [results[index] for index in range(len(budgets)) for results in per_set]  # budget-major, as before
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
