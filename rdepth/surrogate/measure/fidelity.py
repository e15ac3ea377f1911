"""Fidelity and retention of a surrogate, always beside the same-budget baselines.

Models are compared through *state functions*: ``fn(batch) -> list of L+1 states (B, T, D)``
(before the readout). The teacher's own states come from the bank. Baselines:

* ``truncated``: the teacher cut to its first k layers (the surrogate's k distinct blocks, so
  the same parameters); beyond depth k its state stays put, and its output is
  ``readout(state_k)``;
* ``equal_split``: a surrogate fitted the same way with equal phase lengths.

Metrics are plain functions of tensors returning floats / lists, saved as JSON by the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rdepth.surrogate.bank import BankBatch, StateBank
from rdepth.surrogate.model import RaptorSurrogate
from rdepth.surrogate.teachers.layers import Teacher
from rdepth.surrogate.teachers.minilm import sentence_embedding

StatesFn = Callable[[BankBatch], list[torch.Tensor]]


def truncated_fn(k: int) -> StatesFn:
    """The teacher's first k layers; the state is held constant after depth k."""
    def run(batch: BankBatch) -> list[torch.Tensor]:
        states = batch.state_list()
        return [states[min(d, k)] for d in range(len(states))]
    return run


def surrogate_fn(surrogate: RaptorSurrogate) -> StatesFn:
    """Free-running surrogate from the teacher's embedding state."""
    def run(batch: BankBatch) -> list[torch.Tensor]:
        start = batch.states[0]
        return [start, *surrogate.rollout(start, batch.mask)]
    return run


@torch.no_grad()
def collect_states(fn: StatesFn, bank: StateBank) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``fn`` over the bank: stacked (L+1, N, T_max, D) states and the (N, T_max) mask."""
    length = max(b.mask.shape[1] for b in bank)
    states, masks = [], []
    for batch in bank:
        pad = length - batch.mask.shape[1]
        states.append(torch.nn.functional.pad(torch.stack(fn(batch)), (0, 0, 0, pad)))
        masks.append(torch.nn.functional.pad(batch.mask, (0, pad)))
    return torch.cat(states, 1), torch.cat(masks, 0)


def token_cosine(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean cosine between predicted and true token states over real tokens. (N, T, D) each."""
    return float(torch.nn.functional.cosine_similarity(pred[mask].double(), true[mask].double(), dim=-1).mean())


def relative_mse(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> float:
    """sum ||pred - true||^2 / sum ||true||^2 over real tokens (0 = exact)."""
    return float((pred[mask].double() - true[mask].double()).square().sum() / true[mask].double().square().sum())


def fidelity(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor, readout: torch.nn.Module) -> dict:
    """Layer-wise (depths 1..L) and final-state (after readout) cosine and relative MSE.

    pred, true: (L+1, N, T, D); mask (N, T).
    """
    with torch.no_grad():
        final_pred, final_true = readout(pred[-1]), readout(true[-1])
    return {
        "layer_cosine": [token_cosine(pred[d], true[d], mask) for d in range(1, pred.shape[0])],
        "layer_rel_mse": [relative_mse(pred[d], true[d], mask) for d in range(1, pred.shape[0])],
        "final_cosine": token_cosine(final_pred, final_true, mask),
        "final_rel_mse": relative_mse(final_pred, final_true, mask),
    }


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (ties broken by position)."""
    def ranks(v: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(v)
        r = torch.empty_like(order, dtype=torch.float64)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        return r
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def text_retention(embeddings: torch.Tensor, reference: torch.Tensor, top: int = 10) -> dict:
    """Agreement of sentence embeddings (N, D) with the original's (N, D), both L2-normalised.

    * ``embedding_cosine``: mean cos(e_i, ref_i);
    * ``pairwise_spearman``: rank correlation of all pairwise similarities (i < j);
    * ``nn_top1``: fraction of sentences whose nearest other sentence is the original's;
    * ``nn_overlap@top``: mean overlap of the ``top`` nearest neighbours.
    """
    n = embeddings.shape[0]
    sims, ref_sims = embeddings @ embeddings.T, reference @ reference.T
    upper = torch.triu_indices(n, n, offset=1)
    eye = torch.eye(n, dtype=torch.bool)
    sims_nn, ref_nn = sims.masked_fill(eye, -2.0), ref_sims.masked_fill(eye, -2.0)
    top = min(top, n - 1)
    mine, theirs = sims_nn.topk(top, dim=1).indices, ref_nn.topk(top, dim=1).indices
    overlap = [len(set(a.tolist()) & set(b.tolist())) / top for a, b in zip(mine, theirs, strict=False)]
    return {
        "embedding_cosine": float((embeddings * reference).sum(-1).mean()),
        "pairwise_spearman": spearman(sims[upper[0], upper[1]], ref_sims[upper[0], upper[1]]),
        "nn_top1": float((mine[:, 0] == theirs[:, 0]).float().mean()),
        f"nn_overlap@{top}": float(sum(overlap) / n),
    }


def ridge_probe(features: torch.Tensor, labels: torch.Tensor, n_classes: int, penalty: float = 1e-2) -> torch.Tensor:
    """Closed-form ridge-regression linear probe on one-hot targets: weights (D+1, C)."""
    x = torch.cat([features.double(), torch.ones(features.shape[0], 1, dtype=torch.float64)], 1)
    targets = torch.nn.functional.one_hot(labels, n_classes).double()
    gram = x.T @ x + penalty * features.shape[0] * torch.eye(x.shape[1], dtype=torch.float64)
    return torch.linalg.solve(gram, x.T @ targets)


def probe_accuracy(weights: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> float:
    x = torch.cat([features.double(), torch.ones(features.shape[0], 1, dtype=torch.float64)], 1)
    return float(((x @ weights).argmax(1) == labels).float().mean())


def first_token_features(final_states: torch.Tensor, readout: torch.nn.Module) -> torch.Tensor:
    """CLS features for a probe: readout of the final state's first token. (N, T, D) -> (N, D)."""
    with torch.no_grad():
        return readout(final_states[:, 0])


def evaluate_text(models: dict[str, StatesFn], teacher: Teacher, bank: StateBank) -> tuple[dict, dict]:
    """Fidelity + sentence-embedding retention of every model against the teacher.

    Returns (metrics by model name, stacked states by model name incl. "teacher").
    """
    true, mask = bank.stacked()
    reference = sentence_embedding(teacher.readout(true[-1]), mask)
    results, states = {}, {"teacher": true}
    for name, fn in models.items():
        pred, _ = collect_states(fn, bank)
        states[name] = pred
        with torch.no_grad():
            embedding = sentence_embedding(teacher.readout(pred[-1]), mask)
        results[name] = {**fidelity(pred, true, mask, teacher.readout), **text_retention(embedding, reference)}
    return results, states


def evaluate_vision(models: dict[str, StatesFn], teacher: Teacher, train_bank: StateBank,
                    test_bank: StateBank, n_classes: int) -> tuple[dict, dict]:
    """Fidelity + linear-probe accuracy (own probe, and the teacher's probe) on the test bank."""
    true, mask = test_bank.stacked()
    train_true, _ = train_bank.stacked()
    train_labels = torch.cat([b.labels for b in train_bank])
    test_labels = torch.cat([b.labels for b in test_bank])
    teacher_probe = ridge_probe(first_token_features(train_true[-1], teacher.readout), train_labels, n_classes)
    teacher_acc = probe_accuracy(teacher_probe, first_token_features(true[-1], teacher.readout), test_labels)
    results, states = {"teacher": {"probe_accuracy": teacher_acc}}, {"teacher": true}
    for name, fn in models.items():
        pred, _ = collect_states(fn, test_bank)
        train_pred, _ = collect_states(fn, train_bank)
        states[name] = pred
        own_probe = ridge_probe(first_token_features(train_pred[-1], teacher.readout), train_labels, n_classes)
        test_features = first_token_features(pred[-1], teacher.readout)
        own_acc = probe_accuracy(own_probe, test_features, test_labels)
        results[name] = {**fidelity(pred, true, mask, teacher.readout), "probe_accuracy": own_acc,
                         "probe_retention": own_acc / teacher_acc if teacher_acc > 0 else float("nan"),
                         "teacher_probe_accuracy": probe_accuracy(teacher_probe, test_features, test_labels)}
    return results, states

