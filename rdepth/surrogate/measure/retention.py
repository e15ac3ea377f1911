"""Downstream retention: how much of the teacher's linear-probe accuracy a surrogate keeps.

Raptor's headline (96% of DINOv2's ImageNet linear-probe accuracy with 2 blocks) is a ratio
of probe accuracies. Two probes are read for every model, both ridge-regression probes
(:func:`rdepth.surrogate.measure.fidelity.ridge_probe`) on the final [CLS] feature:

* ``teacher_probe``: the probe trained on the *teacher's* training features, applied unchanged
  to the model's test features (does the surrogate land where the teacher's readout expects?);
* ``own_probe``: a probe retrained on the model's own training features (is the information
  still there, in whatever coordinates?).

Each accuracy is reported raw, as a fraction of the teacher's probe accuracy (``retention``),
and normalised by a floor (``normalised = (acc - floor) / (teacher - floor)``), the floor being
a linear probe on the raw pixels: a model that adds nothing over the pixels scores 0, the
teacher scores 1. A ratio near 1 means little on its own when the pixel probe already
reaches most of the teacher's accuracy; the normalised figure says how much of the gap over
the pixels is kept.
"""

from __future__ import annotations

import math

import torch

from rdepth.surrogate.measure.fidelity import probe_accuracy, ridge_probe


def normalised(accuracy: float, teacher: float, floor: float) -> float:
    """(accuracy - floor) / (teacher - floor); nan when the teacher is not above the floor."""
    gap = teacher - floor
    return (accuracy - floor) / gap if gap > 0 else math.nan


def probe_retention(features: dict[str, tuple[torch.Tensor, torch.Tensor]], train_labels: torch.Tensor,
                    test_labels: torch.Tensor, n_classes: int, floor: float,
                    teacher: str = "teacher", penalty: float = 1e-2) -> dict[str, dict]:
    """Probe accuracies and retention of every model against ``features[teacher]``.

    ``features``: model name -> (train features (N_train, D), test features (N_test, D)); the
    teacher's entry trains the teacher's probe. ``floor``: the floor probe's test accuracy.
    Returns name -> {teacher_probe_accuracy, own_probe_accuracy, *_retention, *_normalised}.
    """
    teacher_train, teacher_test = features[teacher]
    teacher_weights = ridge_probe(teacher_train, train_labels, n_classes, penalty)
    reference = probe_accuracy(teacher_weights, teacher_test, test_labels)
    results = {}
    for name, (train, test) in features.items():
        via_teacher = probe_accuracy(teacher_weights, test, test_labels)
        own = reference if name == teacher else probe_accuracy(ridge_probe(train, train_labels, n_classes, penalty),
                                                               test, test_labels)
        results[name] = {
            "teacher_probe_accuracy": via_teacher, "own_probe_accuracy": own,
            "teacher_probe_retention": via_teacher / reference if reference > 0 else math.nan,
            "own_probe_retention": own / reference if reference > 0 else math.nan,
            "teacher_probe_normalised": normalised(via_teacher, reference, floor),
            "own_probe_normalised": normalised(own, reference, floor),
        }
    return results


def pixel_floor(train_images: torch.Tensor, train_labels: torch.Tensor, test_images: torch.Tensor,
                test_labels: torch.Tensor, n_classes: int, penalty: float = 1e-2) -> float:
    """Test accuracy of the same ridge probe on the flattened pixels. images: (N, ...)."""
    weights = ridge_probe(train_images.flatten(1), train_labels, n_classes, penalty)
    return probe_accuracy(weights, test_images.flatten(1), test_labels)
