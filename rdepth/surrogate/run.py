"""The text surrogate pipeline behind ``rdepth surrogate``.

teacher states -> similarity matrices -> phases (DP and max-cut, chosen on the fit sentences)
-> fit the Raptor surrogate and the equal-split baseline -> fidelity / retention on the held-out
sentences beside the truncated baseline -> dynamics -> numbers saved (JSON/NPZ) -> report page
drawn from the saved numbers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.io import atomic_path, environment_info, write_json
from rdepth.surrogate.bank import build_bank
from rdepth.surrogate.choose import analyse_similarity, choose_phases, phase_table  # noqa: F401 (API)
from rdepth.surrogate.config import SurrogateRunConfig
from rdepth.surrogate.fit import fit_surrogate
from rdepth.surrogate.measure.dynamics import dynamics_summary
from rdepth.surrogate.measure.fidelity import evaluate_text, surrogate_fn, truncated_fn
from rdepth.surrogate.measure.geometry import write_phase_geometry
from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig
from rdepth.surrogate.phases import equal_phases
from rdepth.surrogate.teachers.registry import is_vision_teacher, load_teacher, resolve_teacher, text_tokenizer
from rdepth.surrogate.teachers.text import text_batches

log = logging.getLogger(__name__)


def run_surrogate(config: SurrogateRunConfig) -> Path:
    """Run the whole pipeline into ``config.out``; returns the report's path.

    A vision teacher (``vit-fmnist``, a saved ViT folder) runs the image pipeline of
    :mod:`rdepth.surrogate.vision` instead.
    """
    from rdepth.surrogate.pages.text import write_report
    from rdepth.surrogate.teachers.sentences import corpus_sentences
    from rdepth.surrogate.vision import run_vision_surrogate

    if is_vision_teacher(config.teacher):
        if config.probe != "none":
            raise RdepthError(f"--probe {config.probe} applies to text teachers; a vision run always probes "
                              "Fashion-MNIST's classes")
        return run_vision_surrogate(config)

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.out)
    glosses = None
    if config.probe == "wordnet":  # read before anything is loaded or fitted: missing or corrupt data fails fast
        from rdepth.surrogate.text_probe import probe_glosses
        glosses = probe_glosses(config)
    directory = resolve_teacher(config.teacher)
    teacher = load_teacher(config.teacher)
    if config.k > teacher.n_layers:
        raise RdepthError(f"k = {config.k} exceeds the teacher's {teacher.n_layers} layers")
    tokenizer = text_tokenizer(config.teacher, config.max_length)
    fit_sentences, eval_sentences = corpus_sentences(config.corpus, config.n_fit, config.n_eval, config.seed)
    if glosses is not None and max(config.probe_k) > teacher.n_layers:
        raise RdepthError(f"probe_k: k = {max(config.probe_k)} exceeds the teacher's {teacher.n_layers} layers")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", {"config": config.to_dict(), "teacher_dir": str(directory),
                                     "layer_spec": teacher.spec.to_dict(), "n_layers": teacher.n_layers})
    write_json(out / "environment.json", environment_info())
    fit_bank = build_bank(teacher, text_batches(tokenizer, fit_sentences, config.batch_size), "teacher (fit)")
    eval_bank = build_bank(teacher, text_batches(tokenizer, eval_sentences, config.batch_size), "teacher (eval)")

    chosen, matrices, record = choose_phases(fit_bank, eval_bank, config.k, config.similarity, config.phase_method)
    for name, stem in (("fit", "similarity"), ("eval", "similarity_eval")):  # phases come from the fit set's
        with atomic_path(out / f"{stem}.npz") as tmp, open(tmp, "wb") as handle:
            np.savez(handle, **matrices[name])
    write_json(out / "phases.json", record)
    equal = equal_phases(teacher.n_layers, config.k)
    held_out = tuple(record["by_similarity_eval"][config.similarity][config.phase_method]["lengths"])
    log.info("phases (%s, %s, fit set): %s; on the held-out set: %s; equal split: %s", config.similarity,
             config.phase_method, chosen, held_out, equal)

    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()
    surrogate = RaptorSurrogate(teacher, SurrogateConfig(chosen, config.init))
    fits = {"raptor": fit_surrogate(surrogate, fit_bank, config.fit, metrics_path, "raptor")}
    surrogate.save(out / "surrogate")
    models = {"raptor": surrogate_fn(surrogate)}
    equal_surrogate = surrogate
    if equal != chosen:
        equal_surrogate = RaptorSurrogate(teacher, SurrogateConfig(equal, config.init))
        fits["equal_split"] = fit_surrogate(equal_surrogate, fit_bank, config.fit, metrics_path, "equal_split")
        models["equal_split"] = surrogate_fn(equal_surrogate)
    else:
        log.info("the chosen phases are the equal split: the equal-split baseline is the Raptor surrogate itself")
        models["equal_split"] = models["raptor"]
    models["truncated"] = truncated_fn(config.k)
    results, states = evaluate_text(models, teacher, eval_bank)
    mask = eval_bank.stacked()[1]
    dynamics = {name: dynamics_summary(states[name], mask, chosen) for name in ("teacher", "raptor")}
    saved = {"k": config.k, "phases": {"raptor": list(chosen), "equal_split": list(equal)},
             "equal_split_is_raptor": equal == chosen, "fits": fits, "models": results,
             "n_fit": fit_bank.n_examples, "n_eval": eval_bank.n_examples}
    if glosses is not None:
        from rdepth.surrogate.text_probe import run_text_probe
        fitted = {config.k: ({"raptor": surrogate, "equal_split": equal_surrogate},
                             {"phases": list(chosen), "equal_split": list(equal), "fits": fits})}
        saved["probe"] = run_text_probe(config, teacher, tokenizer, fit_bank, eval_bank, glosses, fitted, metrics_path)
    write_json(out / "results.json", saved)
    write_json(out / "dynamics.json", dynamics)
    page = write_report(out)
    write_phase_geometry(out, {"teacher": states["teacher"], "raptor": states["raptor"]}, mask, chosen)
    return page

