"""Downstream retention of text surrogates: linear probes for WordNet glosses' 45 lexicographer classes.

The text counterpart of the vision headline (:mod:`.vision`): ``rdepth surrogate --teacher
minilm-l6 --probe wordnet`` fits, for every k of ``--probe-k``, the Raptor surrogate and the
equal-split surrogate on the run's fit sentences (the probe's glosses are never fitted on), then
reads every model's *sentence feature* of each gloss, the mean over real tokens of the readout of
its final state (the teacher's sentence embedding before its L2 normalisation), and scores the
ridge probes of :func:`rdepth.surrogate.measure.retention.probe_retention` on it:

* the teacher's probe (trained on the teacher's features) applied unchanged, and a probe retrained
  on the model's own features, both as % of the teacher's probe accuracy;
* normalised by the floor: the same probe on the mean of the token embeddings (the teacher's depth-0
  state: a bag of contextless tokens), so 0 = no better than the embeddings, 1 = the teacher;
* beside the truncated teacher (first k layers, then the readout) and the equal split.

The glosses (:func:`rdepth.data.wordnet.load_glosses`) are shuffled with the run's seed and cut into
disjoint probe-training and test sets.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from rdepth.data.wordnet import LEXNAMES, N_LEXNAMES, Gloss, load_glosses
from rdepth.errors import RdepthError
from rdepth.surrogate.bank import StateBank
from rdepth.surrogate.choose import choose_phases
from rdepth.surrogate.config import SurrogateRunConfig
from rdepth.surrogate.fit import fit_surrogate
from rdepth.surrogate.measure.fidelity import probe_accuracy, ridge_probe
from rdepth.surrogate.measure.retention import probe_retention
from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig
from rdepth.surrogate.phases import equal_phases
from rdepth.surrogate.teachers.layers import Teacher
from rdepth.surrogate.teachers.minilm import mean_pool

log = logging.getLogger(__name__)

# Ridge penalty of the gloss probes (x N, as in ridge_probe). The sentence features' entries have
# mean square ~0.03-0.07 (the vision probes' LayerNormed [CLS] ~1), so the vision default 1e-2 over-shrinks:
# the teacher's probe on 4,000 glosses scores 0.559 with it, 0.575 with 1e-3, 0.582 with 1e-4.
PROBE_PENALTY = 1e-3
FLOOR = "token_embedding_probe_accuracy"
KINDS = ("raptor", "equal_split", "truncated")


def probe_glosses(config: SurrogateRunConfig) -> tuple[list[Gloss], list[Gloss]]:
    """(probe-training glosses, test glosses): disjoint, drawn with the run's seed."""
    glosses = load_glosses(config.wordnet_dir or None)
    needed = config.probe_train + config.probe_test
    if needed > len(glosses):
        raise RdepthError(f"probe_train + probe_test = {needed} exceeds the {len(glosses)} WordNet glosses")
    order = list(range(len(glosses)))
    random.Random(config.seed).shuffle(order)
    picked = [glosses[i] for i in order[:needed]]
    return picked[:config.probe_train], picked[config.probe_train:]


@torch.no_grad()
def gloss_features(tokenizer, texts: list[str], batch_size: int,
                   features: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
                   desc: str = "features") -> dict[str, torch.Tensor]:
    """``features(ids, mask) -> {name: (B, D)}`` over ``texts`` in length-sorted batches, in text order.

    Returns name -> (N, D) float32, row i belonging to ``texts[i]``.
    """
    lengths = tokenizer.token_counts(texts)
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    parts: dict[str, list[torch.Tensor]] = {}
    for begin in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        encoded = tokenizer.encode([texts[i] for i in order[begin:begin + batch_size]])
        for name, value in features(encoded.ids, encoded.mask).items():
            parts.setdefault(name, []).append(value.float())
    position = torch.empty(len(order), dtype=torch.long)
    position[torch.tensor(order)] = torch.arange(len(order))
    return {name: torch.cat(values)[position] for name, values in parts.items()}


def teacher_features(teacher: Teacher, ks: list[int]) -> Callable:
    """One teacher pass -> the teacher's, the floor's and every truncated_k's sentence features."""
    def run(ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        states = teacher.layer_states(ids, mask)
        out = {"teacher": mean_pool(teacher.readout(states[-1]), mask), "floor": mean_pool(states[0], mask)}
        out.update({f"truncated_k{k}": mean_pool(teacher.readout(states[k]), mask) for k in ks})
        return out
    return run


def surrogate_features(teacher: Teacher, surrogates: dict[str, RaptorSurrogate]) -> Callable:
    """Every surrogate's sentence feature (its free-running final state, the teacher's readout)."""
    def run(ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: mean_pool(teacher.readout(model.layer_states(ids, mask)[-1]), mask)
                for name, model in surrogates.items()}
    return run


def fit_k(config: SurrogateRunConfig, teacher: Teacher, fit_bank: StateBank, eval_bank: StateBank, k: int,
          metrics_path: Path) -> tuple[dict, dict]:
    """Raptor (phases chosen on the fit sentences) and equal-split surrogates with k blocks.

    Returns ({"raptor": model, "equal_split": model}, {"phases", "equal_split", "fits"}); where the
    chosen phases are the equal split, both names hold the same model.
    """
    chosen, _, _ = choose_phases(fit_bank, eval_bank, k, config.similarity, config.phase_method)
    equal = equal_phases(teacher.n_layers, k)
    raptor = RaptorSurrogate(teacher, SurrogateConfig(chosen, config.init))
    fits = {"raptor": fit_surrogate(raptor, fit_bank, config.fit, metrics_path, f"probe_raptor_k{k}")}
    models = {"raptor": raptor, "equal_split": raptor}
    if equal != chosen:
        models["equal_split"] = RaptorSurrogate(teacher, SurrogateConfig(equal, config.init))
        fits["equal_split"] = fit_surrogate(models["equal_split"], fit_bank, config.fit, metrics_path,
                                            f"probe_equal_split_k{k}")
    return models, {"phases": list(chosen), "equal_split": list(equal), "fits": fits}


def retention_table(features: dict[str, tuple[torch.Tensor, torch.Tensor]], train_labels: torch.Tensor,
                    test_labels: torch.Tensor, ks: list[int], records: dict[int, dict]) -> dict:
    """Probe retention of every (kind, k) against the teacher, normalised by the floor's probe.

    ``features``: name -> (train (N_train, D), test (N_test, D)) for "teacher", "floor" and every
    ``{kind}_k{k}``; ``records``: k -> phases of that k. Returns the saved ``probe`` block.
    """
    train_floor, test_floor = features["floor"]
    floor = probe_accuracy(ridge_probe(train_floor, train_labels, N_LEXNAMES, PROBE_PENALTY), test_floor, test_labels)
    models = {name: value for name, value in features.items() if name != "floor"}
    retention = probe_retention(models, train_labels, test_labels, N_LEXNAMES, floor, penalty=PROBE_PENALTY)
    by_k = {str(k): {**records[k], "models": {kind: retention[f"{kind}_k{k}"] for kind in KINDS}} for k in ks}
    return {"teacher": retention["teacher"], "floor": {FLOOR: floor}, "by_k": by_k}


def run_text_probe(config: SurrogateRunConfig, teacher: Teacher, tokenizer, fit_bank: StateBank,
                   eval_bank: StateBank, glosses: tuple[list[Gloss], list[Gloss]], fitted: dict[int, tuple[dict, dict]],
                   metrics_path: Path) -> dict:
    """The WordNet retention table for every k of ``config.probe_k`` (and ``config.k``).

    ``fitted``: k -> (models, record) already fitted by the run (fit_k's return); the other ks are
    fitted here. Returns the ``probe`` block saved in ``results.json``.
    """
    ks = sorted(set(config.probe_k) | {config.k})
    if ks[-1] > teacher.n_layers:
        raise RdepthError(f"probe_k: k = {ks[-1]} exceeds the teacher's {teacher.n_layers} layers")
    for k in ks:
        if k not in fitted:
            fitted[k] = fit_k(config, teacher, fit_bank, eval_bank, k, metrics_path)
            log.info("probe: k = %d fitted, phases %s", k, fitted[k][1]["phases"])
    train, test = glosses
    surrogates = {}
    for k in ks:
        for kind in ("raptor", "equal_split"):
            surrogates[f"{kind}_k{k}"] = fitted[k][0][kind]
    features = {}
    for label, subset in (("train", train), ("test", test)):
        texts = [gloss.text for gloss in subset]
        found = gloss_features(tokenizer, texts, config.batch_size, teacher_features(teacher, ks),
                               f"teacher ({label} glosses)")
        distinct = {}  # a k whose equal split is its Raptor surrogate: one pass
        for name, model in surrogates.items():
            distinct.setdefault(id(model), {})[name] = model
        for group in distinct.values():
            first = next(iter(group))
            fn = surrogate_features(teacher, {first: group[first]})
            value = gloss_features(tokenizer, texts, config.batch_size, fn, f"{first} ({label} glosses)")[first]
            found.update({name: value for name in group})
        for name, value in found.items():
            features.setdefault(name, []).append(value)
    features = {name: (pair[0], pair[1]) for name, pair in features.items()}
    train_labels = torch.tensor([gloss.label for gloss in train])
    test_labels = torch.tensor([gloss.label for gloss in test])
    table = retention_table(features, train_labels, test_labels, ks, {k: fitted[k][1] for k in ks})
    counts = torch.bincount(torch.cat([train_labels, test_labels]), minlength=N_LEXNAMES)
    table.update({"task": "wordnet", "n_classes": N_LEXNAMES, "compare_k": ks, "n_layers": teacher.n_layers,
                  "glosses": {"train": len(train), "test": len(test)}, "penalty": PROBE_PENALTY,
                  "majority_test_accuracy": float(torch.bincount(test_labels, minlength=N_LEXNAMES).max()
                                                  / len(test_labels)),
                  "class_counts": {LEXNAMES[c]: int(counts[c]) for c in range(N_LEXNAMES)},
                  "feature": "mean over real tokens of the readout of the final state (before L2 normalisation)",
                  "floor_feature": "mean over real tokens of the depth-0 state (token + position embeddings, "
                                   "embedding LayerNorm)"})
    return table
