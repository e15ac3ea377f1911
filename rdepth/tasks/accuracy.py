"""Exact-match answer accuracy, computed only on answer positions (numpy; torch tensors accepted).

A problem counts as solved when every one of its answer tokens is predicted
exactly; tokens outside the answer mask never matter.
"""

from __future__ import annotations

import numpy as np

from rdepth.errors import RdepthError


def _numpy(array) -> np.ndarray:
    if hasattr(array, "detach"):  # a torch tensor, without importing torch
        array = array.detach().float().cpu() if array.is_floating_point() else array.detach().cpu()
        return array.numpy()
    return np.asarray(array)


def problem_correct(logits_or_predictions, targets, answer_mask, problem_ids) -> tuple[np.ndarray, np.ndarray]:
    """(ids, solved): the distinct problem ids at answer positions (sorted) and whether each is solved.

    logits_or_predictions: logits [..., V] or predicted ids [...] (same shape as ``targets``);
    targets, answer_mask, problem_ids: [...]. Position i of ``targets`` is the token the
    prediction at i should equal (already shifted for next-token models).
    """
    predictions = _numpy(logits_or_predictions)
    targets, mask, ids = _numpy(targets), _numpy(answer_mask).astype(bool), _numpy(problem_ids)
    if predictions.ndim == targets.ndim + 1:
        predictions = predictions.argmax(axis=-1)
    if not predictions.shape == targets.shape == mask.shape == ids.shape:
        raise RdepthError(f"accuracy: shapes differ (predictions {predictions.shape}, targets {targets.shape}, "
                          f"mask {mask.shape}, problem ids {ids.shape})")
    if (ids[mask] < 0).any():
        raise RdepthError("accuracy: an answer position has no problem id")
    right = predictions[mask] == targets[mask]
    unique, inverse = np.unique(ids[mask], return_inverse=True)
    wrong_per_problem = np.bincount(inverse, weights=(~right).astype(np.float64), minlength=unique.size)
    return unique, wrong_per_problem == 0


def answer_accuracy(logits_or_predictions, targets, answer_mask, problem_ids) -> float:
    """Share of problems whose answer tokens are all right (see :func:`problem_correct`); NaN if none."""
    _, solved = problem_correct(logits_or_predictions, targets, answer_mask, problem_ids)
    return float(solved.mean()) if solved.size else float("nan")
