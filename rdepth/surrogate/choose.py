"""Phases from a fit set's layer-similarity matrices (every measure and method, the chosen one recorded).

Shared by the text pipeline (:mod:`.run`) and the image pipeline (:mod:`.vision`).
"""

from __future__ import annotations

import numpy as np
import torch

from rdepth.surrogate.bank import StateBank
from rdepth.surrogate.measure.similarity import similarity_matrices
from rdepth.surrogate.phases import PHASE_METHODS, block_structure, equal_phases, segmentation_score


def phase_table(similarity: torch.Tensor, k: int) -> dict:
    """Phases of every method (and the equal split) on an L x L layer-output matrix, with scores."""
    methods = {name: fn(similarity, k) for name, fn in PHASE_METHODS.items()}
    methods["equal"] = equal_phases(similarity.shape[0], k)
    return {name: {"lengths": list(lengths), "score": segmentation_score(similarity, lengths),
                   **block_structure(similarity, lengths)} for name, lengths in methods.items()}


def analyse_similarity(bank: StateBank, k: int) -> tuple[dict[str, np.ndarray], dict]:
    """Similarity matrices over depths 0..L and phases for k from every measure (on depths 1..L)."""
    states, mask = bank.stacked()
    matrices = similarity_matrices(states, mask)
    phases = {name: phase_table(matrix[1:, 1:], k) for name, matrix in matrices.items()}
    return {name: matrix.numpy() for name, matrix in matrices.items()}, phases


def choose_phases(fit_bank: StateBank, eval_bank: StateBank, k: int, similarity: str, method: str
                  ) -> tuple[tuple[int, ...], dict[str, dict[str, np.ndarray]], dict]:
    """Phases from the FIT set's similarity matrix; the held-out set's are measured beside, never used.

    Choosing phases on the evaluation sentences would let the held-out set shape the surrogate
    it then scores. Returns (chosen lengths, {"fit": matrices, "eval": matrices}, the phases.json
    record: ``by_similarity`` = every method on the fit matrices, ``by_similarity_eval`` = the same
    on the held-out ones, ``chosen_on`` = "fit").
    """
    fit_matrices, fit_phases = analyse_similarity(fit_bank, k)
    eval_matrices, eval_phases = analyse_similarity(eval_bank, k)
    chosen = tuple(fit_phases[similarity][method]["lengths"])
    record = {"k": k, "similarity": similarity, "method": method, "chosen_on": "fit", "chosen": list(chosen),
              "by_similarity": fit_phases, "by_similarity_eval": eval_phases}
    return chosen, {"fit": fit_matrices, "eval": eval_matrices}, record
