"""The image pipeline behind ``rdepth surrogate --teacher vit-fmnist``: Raptor's headline on our own ViT.

Fashion-MNIST (Debian) -> the ViT teacher (trained into ``OUT/teacher``, or reused from there or
from a given teacher folder) -> the teacher's states on the fit images -> phases (fit images)
-> for every k of ``--compare-k``: the Raptor surrogate, the equal-split surrogate (fitted the
same way) and the truncated teacher -> final-[CLS] features on the probe and test images ->
probe retention against the teacher, normalised by the pixel probe (:mod:`.retention`) ->
fidelity and dynamics (class basins, self-correction, token dynamics, update rank) of the
teacher and the k = ``--k`` surrogate on held-out images -> numbers saved (JSON/NPZ) -> the
report page drawn from them (:mod:`.vision_report`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.io import atomic_path, environment_info, write_json
from rdepth.surrogate.bank import build_bank
from rdepth.surrogate.choose import choose_phases
from rdepth.surrogate.config import SurrogateRunConfig
from rdepth.surrogate.fit import fit_surrogate
from rdepth.surrogate.measure.basins import class_basins, findings, perturbation_recovery
from rdepth.surrogate.measure.dynamics import dynamics_summary
from rdepth.surrogate.measure.fidelity import collect_states, fidelity, surrogate_fn, truncated_fn
from rdepth.surrogate.measure.retention import pixel_floor, probe_retention
from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig
from rdepth.surrogate.phases import equal_phases
from rdepth.surrogate.teachers.layers import Teacher
from rdepth.surrogate.teachers.vit import (
    N_CLASSES,
    ViTClassifier,
    accuracy,
    image_batches,
    is_vit_folder,
    load_fashion_mnist,
    load_vit,
    save_vit,
    train_vit,
    vision_teacher_config,
)

log = logging.getLogger(__name__)



def vision_teacher(config: SurrogateRunConfig, out: Path, train: tuple, test: tuple) -> tuple[ViTClassifier, dict]:
    """The run's ViT: a given teacher folder, the one saved in ``OUT/teacher`` with the same settings, or a new one."""
    if is_vit_folder(config.teacher):
        model, record = load_vit(config.teacher)
        log.info("teacher: %s (test accuracy %.4f)", config.teacher, record.get("test_accuracy", float("nan")))
        return model, {**record, "folder": str(Path(config.teacher).resolve()), "trained_here": False}
    settings = vision_teacher_config(config.teacher, config.vision.vit_epochs, config.seed)
    folder = out / "teacher"
    if is_vit_folder(folder):
        model, record = load_vit(folder)
        if record.get("vit") == settings.to_dict():
            log.info("teacher: reusing %s (test accuracy %.4f)", folder, record["test_accuracy"])
            return model, {**record, "folder": str(folder.resolve()), "trained_here": False}
        log.info("teacher: %s was trained with other settings; training anew", folder)
    log.info("teacher: training %s (%d epochs on %d images)", config.teacher, settings.epochs, len(train[0]))
    model, train_log = train_vit(settings, *train)
    record = {"name": config.teacher, "test_accuracy": accuracy(model, *test), "train": train_log}
    save_vit(model, settings, folder, record)
    log.info("teacher: test accuracy %.4f after %.0f s", record["test_accuracy"], train_log["seconds"])
    return model, {"vit": settings.to_dict(), **record, "folder": str(folder.resolve()), "trained_here": True}


def cls_feature(teacher: Teacher, final_state: torch.Tensor) -> torch.Tensor:
    """The probes' feature: the readout (final LayerNorm) of the [CLS] state. (B, T, D) -> (B, D)."""
    return teacher.readout(final_state[:, 0])


@torch.no_grad()
def features_of(fn, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """``fn`` over ``images`` in batches, concatenated: (N, D)."""
    return torch.cat([fn(images[begin:begin + batch]) for begin in range(0, len(images), batch)])


def feature_fns(teacher: Teacher, models: dict) -> dict:
    """name -> images -> final [CLS] features, for the teacher and every (kind, k) model."""
    fns = {"teacher": lambda x: cls_feature(teacher, teacher.layer_states(x)[-1])}
    for name, (kind, model) in models.items():
        if kind == "truncated":
            fns[name] = (lambda k: lambda x: cls_feature(teacher, teacher.layer_states(x, n_layers=k)[-1]))(model)
        else:
            fns[name] = (lambda m: lambda x: cls_feature(teacher, m.layer_states(x)[-1]))(model)
    return fns


def step_sizes(states: torch.Tensor) -> list[float]:
    """Mean relative update ||h_d - h_(d-1)|| / ||h_(d-1)|| over all tokens, d = 1..L. states (S, N, T, D)."""
    return [float(((states[d] - states[d - 1]).norm(dim=-1) / states[d - 1].norm(dim=-1).clamp_min(1e-12)).mean())
            for d in range(1, states.shape[0])]


@torch.no_grad()
def vision_dynamics(step, states: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, lengths: tuple[int, ...],
                    relative: float, seed: int) -> dict:
    """All dynamics measurements of one model's (S, N, T, D) states; ``step(state, d)`` reruns depth d."""
    summary = dynamics_summary(states, mask, lengths)
    summary["basins"] = class_basins(states[:, :, 0], labels, N_CLASSES)
    summary["step_size"] = step_sizes(states)
    generator = torch.Generator().manual_seed(seed)
    clean = list(states.unbind(0))
    summary["perturbation"] = [perturbation_recovery(step, clean, depth, relative, generator)
                               for depth in range(states.shape[0] - 1)]
    return summary


def _seeded_order(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def _fit_surrogates(teacher, fit_bank, held_bank, ks: list[int], config: SurrogateRunConfig, out: Path,
                    metrics_path: Path):
    """For each k: the phases from layer similarity, the Raptor surrogate on them and the equal split
    (fitted unless it is the same phases), the truncated baseline; the run's own k is saved."""
    n_layers = teacher.n_layers
    phase_records, matrices, fits, models, by_k = {}, None, {}, {}, {}
    for k in ks:
        chosen, k_matrices, record = choose_phases(fit_bank, held_bank, k, config.similarity, config.phase_method)
        matrices = matrices or k_matrices
        phase_records[str(k)] = record
        equal = equal_phases(n_layers, k)
        surrogate = RaptorSurrogate(teacher, SurrogateConfig(chosen, config.init))
        fits[f"raptor_k{k}"] = fit_surrogate(surrogate, fit_bank, config.fit, metrics_path, f"raptor_k{k}")
        models[f"raptor_k{k}"] = ("surrogate", surrogate)
        if equal != chosen:
            equal_surrogate = RaptorSurrogate(teacher, SurrogateConfig(equal, config.init))
            fits[f"equal_split_k{k}"] = fit_surrogate(equal_surrogate, fit_bank, config.fit, metrics_path,
                                                      f"equal_split_k{k}")
            models[f"equal_split_k{k}"] = ("surrogate", equal_surrogate)
        else:
            models[f"equal_split_k{k}"] = models[f"raptor_k{k}"]
        models[f"truncated_k{k}"] = ("truncated", k)
        by_k[str(k)] = {"phases": list(chosen), "equal_split": list(equal), "equal_split_is_raptor": equal == chosen}
        if k == config.k:
            surrogate.save(out / "surrogate")
        log.info("k = %d: phases %s (equal split %s)", k, chosen, equal)
    return phase_records, matrices, fits, models, by_k


def run_vision_surrogate(config: SurrogateRunConfig) -> Path:
    """The image pipeline into ``config.out``; returns the report's path."""
    from rdepth.surrogate.pages.vision import write_vision_report

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    vision = config.vision
    train = load_fashion_mnist("train", vision.data_dir)
    test = load_fashion_mnist("test", vision.data_dir)
    for name, value, limit in (("images_fit", vision.images_fit, len(train[0])),
                               ("images_probe", vision.images_probe, len(train[0])),
                               ("images_test", vision.images_test, len(test[0])),
                               ("images_dynamics", vision.images_dynamics, len(test[0]))):
        if value > limit:
            raise RdepthError(f"{name} = {value} exceeds the {limit} images of the split")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model, teacher_record = vision_teacher(config, out, train, test)
    teacher = model.backbone
    n_layers = teacher.n_layers
    ks = sorted(set(vision.compare_k) | {config.k})
    if ks[-1] > n_layers:
        raise RdepthError(f"k = {ks[-1]} exceeds the teacher's {n_layers} layers")
    write_json(out / "config.json", {"config": config.to_dict(), "teacher": teacher_record, "n_layers": n_layers,
                                     "layer_spec": teacher.spec.to_dict(), "pipeline": "vision"})
    write_json(out / "environment.json", environment_info())

    order = _seeded_order(len(train[0]), config.seed)
    fit_index, probe_index = order[:vision.images_fit], order[:vision.images_probe]
    test_images, test_labels = test[0][:vision.images_test], test[1][:vision.images_test]
    n_tokens = (teacher.embedding.position.shape[1])
    fit_bank = build_bank(teacher, image_batches(train[0][fit_index], train[1][fit_index], vision.image_batch, n_tokens),
                          "teacher (fit images)")
    held_out = slice(len(test[0]) - vision.images_dynamics, len(test[0]))  # the test set's end: dynamics, fidelity
    held_bank = build_bank(teacher, image_batches(test[0][held_out], test[1][held_out], vision.image_batch, n_tokens),
                           "teacher (held-out images)")
    true, mask = held_bank.stacked()
    held_labels = test[1][held_out]

    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()
    phase_records, matrices, fits, models, by_k = _fit_surrogates(teacher, fit_bank, held_bank, ks, config, out,
                                                                  metrics_path)

    # probes: final [CLS] features of every model on the probe (training) and test images
    fns, features, done = feature_fns(teacher, models), {}, {}
    for name, fn in fns.items():
        key = id(models[name][1]) if name in models and models[name][0] == "surrogate" else name
        if key not in done:  # k = 1's equal split is its Raptor surrogate: computed once
            done[key] = (features_of(fn, train[0][probe_index]), features_of(fn, test_images))
        features[name] = done[key]
    floor = pixel_floor(train[0][probe_index], train[1][probe_index], test_images, test_labels, N_CLASSES)
    retention = probe_retention(features, train[1][probe_index], test_labels, N_CLASSES, floor)

    # fidelity on the held-out images (states against the teacher's), every model
    fidelity_by_model, raptor_states = {}, None
    for name, (kind, model_or_k) in models.items():
        fn = truncated_fn(model_or_k) if kind == "truncated" else surrogate_fn(model_or_k)
        pred, _ = collect_states(fn, held_bank)
        fidelity_by_model[name] = fidelity(pred, true, mask, teacher.readout)
        if name == f"raptor_k{config.k}":
            raptor_states = pred
    for k in ks:
        by_k[str(k)]["models"] = {kind: {**retention[f"{kind}_k{k}"], **fidelity_by_model[f"{kind}_k{k}"]}
                                  for kind in ("raptor", "equal_split", "truncated")}
    results = {"k": config.k, "compare_k": ks, "n_layers": n_layers, "floor": {"pixel_probe_accuracy": floor},
               "teacher": {**retention["teacher"], "head_accuracy": teacher_record.get("test_accuracy")},
               "by_k": by_k, "fits": fits, "images": {"fit": len(fit_index), "probe": len(probe_index),
                                                      "test": len(test_labels), "dynamics": len(held_labels)},
               "seed": config.seed}

    # dynamics of the teacher and the k = --k surrogate on the held-out images
    surrogate = models[f"raptor_k{config.k}"][1]
    lengths = tuple(by_k[str(config.k)]["phases"])
    dynamics = {
        "teacher": vision_dynamics(lambda s, d: teacher.layers[d](s), true, mask, held_labels, lengths,
                                   vision.perturbation, config.seed),
        "raptor": vision_dynamics(lambda s, d: surrogate.step(s, d, None), raptor_states, mask, held_labels, lengths,
                                  vision.perturbation, config.seed),
    }
    dynamics["findings"] = {name: findings(dynamics, name) for name in ("teacher", "raptor")}
    if vision.null_seeds:
        from rdepth.surrogate.vision_null import null_dynamics

        def measure(step, states, mask, labels, seed):
            return vision_dynamics(step, states, mask, labels, None, vision.perturbation, seed)

        held_images = test[0][held_out]
        dynamics["null"] = null_dynamics(model, teacher_record["vit"], held_images, held_labels, vision.null_seeds,
                                         vision.perturbation, measure)
    dynamics["perturbation_relative_norm"] = vision.perturbation
    for name, stem in (("fit", "similarity"), ("eval", "similarity_eval")):
        with atomic_path(out / f"{stem}.npz") as tmp, open(tmp, "wb") as handle:
            np.savez(handle, **matrices[name])
    results["seconds"] = round(time.perf_counter() - started, 1)
    write_json(out / "phases.json", phase_records)
    write_json(out / "dynamics.json", dynamics)
    write_json(out / "results.json", results)
    return write_vision_report(out)
