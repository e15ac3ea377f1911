"""``rdepth analyze``: drive checkpoints through held-out text and save every loop-geometry number.

For each checkpoint and each loop budget ("train": the config's eval loop
counts; "long": a fixed long budget, 30 by default as in the paper's Figure 5)
the model runs the same held-out windows through the run layer's one
evaluation loop (:func:`rdepth.run.evaluate.eval_outputs`), with a
:class:`~rdepth.geometry.stream.GeometryObserver` attached. Window i starts
from the same initial-state noise in every checkpoint, every budget and in
``rdepth eval``, so the saved loss equals ``rdepth eval``'s (on the model in the analysis precision,
float64 by default) for the same
checkpoint, windows, budget and seed, whatever the batch size.

The numbers are saved in :mod:`rdepth.geometry.summary`'s format; figures
(:mod:`rdepth.geometry.plots`) and the report section
(:mod:`rdepth.geometry.report_page`) are drawn from the saved files only.
:func:`run_analysis` does all three.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rdepth.errors import RdepthError
from rdepth.geometry.config import AnalyzeConfig
from rdepth.geometry.slowest import slowest_tokens
from rdepth.geometry.stream import GeometryObserver, StreamResult
from rdepth.geometry.summary import (
    GEOMETRY_DIR,
    NOISE_FLOORS,
    checkpoint_entry,
    new_summary,
    save_budget,
    write_slowest,
    write_summary,
)
from rdepth.model import RecurrentLM
from rdepth.run.checkpoint import checkpoint_step, find_checkpoints, load_model
from rdepth.run.device import resolve_device
from rdepth.run.evaluate import eval_outputs
from rdepth.run.heldout import tokenizer_for
from rdepth.run.opened import open_run

log = logging.getLogger(__name__)


def run_budget(
    model: RecurrentLM,
    windows: torch.Tensor,
    loop_counts: tuple[int, ...],
    config: AnalyzeConfig,
    device: torch.device,
    masks: torch.Tensor | None = None,
) -> tuple[StreamResult, float]:
    """Run every window ``[S, T + 1]`` through ``model`` at ``loop_counts`` with an observer attached.

    Returns the observer's statistics and the mean next-token cross-entropy (nats/token),
    computed exactly as :func:`rdepth.run.evaluate.evaluate` computes it: over the targets where
    ``masks`` (bool ``[S, T + 1]``; a task's answers) is True, else over every token. The observer
    sees every token either way.
    """
    observer = GeometryObserver(config.threshold, config.keep_sequence, config.rank)

    def forward(x, y, noise):
        return model(x, y, loop_counts, noise=noise, observer=observer)

    total_loss, total_tokens = 0.0, 0
    with torch.no_grad():
        for output, tokens in eval_outputs(model, windows, forward, batch_size=config.batch_size, device=device,
                                           seed=config.seed, progress=config.progress, masks=masks,
                                           desc=f"loops {','.join(map(str, loop_counts))}"):
            total_loss += output.loss.item() * tokens
            total_tokens += tokens
    return observer.result(), total_loss / max(total_tokens, 1)


def answer_masks(opened, count: int, seq_len: int | None) -> torch.Tensor | None:
    """On data with loss masks (a task, trained on its answers only): bool ``[S, T + 1]`` masks aligned
    with ``opened.windows(count, seq_len)``, True at the answers; None for plain text."""
    from rdepth.data.shards import TokenShards
    from rdepth.run.heldout import held_out_problem_windows, held_out_windows

    if not (Path(opened.data) / "val_mask.bin").is_file():  # plain text, or a text file given as data
        return None
    mask = TokenShards.open(opened.data).loss_mask("val")
    if mask is None:
        return None
    length = opened.seq_len(seq_len)
    if opened.starts is not None:
        return held_out_problem_windows(mask, opened.starts, length, count).bool()
    return held_out_windows(mask, length, count).bool()


DTYPES = {"float64": torch.float64, "float32": torch.float32}
DLR_CURVE_FILE = "dlr_curve.npz"


def dlr_curve(model: RecurrentLM, windows: torch.Tensor, group_names: list[str], config: AnalyzeConfig,
              device: torch.device, out: Path, label: str) -> dict[str, Any]:
    """DLR against the loop budget: every group at K = 1..``config.dlr_curve_loops`` on the first
    ``config.dlr_curve_sequences`` windows (same noise per window as every other budget).

    Saves the per-token ratios as ``OUT/geometry/<label>/dlr_curve.npz`` (keys
    ``<boundary>/<definition>/<K>``) and returns, per boundary and definition, the median and the
    10th/90th percentiles over tokens at each K.
    """
    from rdepth.geometry.arrays import save_npz
    from rdepth.geometry.summary import _stats

    small = windows[: config.dlr_curve_sequences]
    quiet = AnalyzeConfig(**{**asdict(config), "rank": False, "progress": False, "keep_sequence": 0})
    budgets = list(range(1, config.dlr_curve_loops + 1))
    curve: dict[str, dict[str, dict[str, list]]] = {}
    arrays: dict[str, Any] = {}
    for loops in budgets:
        result, _ = run_budget(model, small, (loops,) * len(group_names), quiet, device)
        for boundary, definitions in result.boundaries.items():
            a, b = (int(part) for part in boundary.split("->"))
            name = f"{group_names[a]}->{group_names[b]}"
            for definition, values in definitions.items():
                stats = _stats(values)
                entry = curve.setdefault(name, {}).setdefault(definition, {"median": [], "p10": [], "p90": []})
                for key in entry:
                    entry[key].append(stats[key])
                arrays[f"{name}/{definition}/{loops}"] = values.astype("float32")
    path = out / GEOMETRY_DIR / label / DLR_CURVE_FILE
    save_npz(path, arrays)
    return {"checkpoint": label, "loops": budgets, "sequences": int(small.shape[0]), "boundaries": curve,
            "arrays": path.relative_to(out).as_posix()}


def jacobian_spectra(model: RecurrentLM, windows: torch.Tensor, loop_counts: tuple[int, ...],
                     config: AnalyzeConfig, device: torch.device) -> dict[str, Any]:
    """The own-state Jacobian spectra (:mod:`rdepth.geometry.jacobian`) at each group's last iterate after
    ``loop_counts`` steps: one position per window in the first ``config.jacobian_positions`` windows,
    drawn from ``config.seed`` among the positions past the first quarter of the window."""
    from rdepth.geometry.jacobian import TOP_EIGENVALUES, spectra
    from rdepth.model.noise import StateNoise

    count = min(config.jacobian_positions, windows.shape[0])
    idx = windows[:count, :-1].to(device)
    length = idx.shape[1]
    generator = torch.Generator().manual_seed(config.seed)
    low = length // 4
    positions = [int(p) for p in torch.randint(low, length, (count,), generator=generator)]
    was_training = model.training
    model.eval()
    try:
        groups = spectra(model, idx, positions, loop_counts, StateNoise.consecutive(config.seed, 0, count))
    finally:
        model.train(was_training)
    return {"loop_counts": list(loop_counts), "positions": positions, "windows": list(range(count)),
            "top": TOP_EIGENVALUES, "groups": groups}


def _architecture(config) -> tuple:
    return config.to_dict()["groups"], config.d_model, config.n_layer


def analyze(config: AnalyzeConfig) -> dict[str, Any]:
    """Measure every checkpoint of ``config.checkpoints`` at both budgets; write summary.json, the
    NPZs and the slowest-token table under ``OUT/geometry``; return the summary."""
    if not config.data or not config.out:
        raise RdepthError("analyze: data and out are required")
    if config.threads:
        torch.set_num_threads(config.threads)
    checkpoints = find_checkpoints(config.checkpoints)
    device = resolve_device(config.device)
    out = Path(config.out)
    opened = open_run(checkpoints[0], config.data, device)
    windows = opened.windows(config.sequences, config.seq_len)
    masks = answer_masks(opened, config.sequences, config.seq_len)
    tokenizer = tokenizer_for(config.data, opened.checkpoint)
    group_names = [spec.name for spec in opened.config.group_specs]
    if not group_names:
        raise RdepthError(f"checkpoint {checkpoints[0]} has no recurrence groups: nothing to analyze")
    reference = _architecture(opened.config)
    summary = new_summary(asdict(config), group_names, windows.shape[0], windows.shape[1] - 1)
    # The loss is on what the model was trained to predict: a task's answers, or every token of text.
    summary["loss_tokens"] = "all" if masks is None else "answers"
    loaded: tuple | None = (opened.model, opened.config)
    del opened
    last_long: StreamResult | None = None
    for checkpoint in checkpoints:
        started = time.perf_counter()
        model, model_config = loaded or load_model(checkpoint, device)
        model = model.to(DTYPES[config.precision])
        loaded = None
        if _architecture(model_config) != reference:
            raise RdepthError(f"checkpoint {checkpoint} has a different architecture from {checkpoints[0]}")
        budgets = {"train": model.resolve_loop_counts(config.train_loops),
                   "long": (config.long_loops,) * len(group_names)}
        saved: dict[str, Any] = {}
        for budget, counts in budgets.items():
            result, loss = run_budget(model, windows, counts, config, device, masks)
            saved[budget] = save_budget(out, checkpoint.name, budget, result, group_names, list(counts), loss,
                                        NOISE_FLOORS[config.precision])
            if budget == "long":
                last_long = result
        entry = checkpoint_entry(checkpoint.name, checkpoint_step(checkpoint), str(checkpoint), saved)
        if config.jacobian_positions:
            entry["jacobian"] = jacobian_spectra(model, windows, budgets["long"], config, device)
        if config.dlr_curve_loops and checkpoint == checkpoints[-1] and len(group_names) > 1:
            summary["dlr_curve"] = dlr_curve(model, windows, group_names, config, device, out, checkpoint.name)
        entry["seconds"] = time.perf_counter() - started
        log.info("%s: train-budget loss %.4f, long-budget loss %.4f (%.1f s)", checkpoint.name,
                 saved["train"]["loss"], saved["long"]["loss"], entry["seconds"])
        summary["checkpoints"].append(entry)
        del model
    summary["budgets"] = {name: budget["loop_counts"] for name, budget in summary["checkpoints"][-1]["budgets"].items()}
    if last_long is not None:
        convergence = {name: group["convergence_step"] for name, group in zip(group_names, last_long.groups, strict=False)}
        rows = slowest_tokens(convergence, last_long.groups[-1]["final_relative_step_size"], windows, tokenizer,
                              config.top_tokens)
        write_slowest(out, summary["checkpoints"][-1]["label"], "long", config.threshold, rows)
    write_summary(out, summary)
    return summary


def run_analysis(config: AnalyzeConfig) -> Path:
    """Measure, draw and report: the whole of ``rdepth analyze``. Returns ``OUT/index.html``."""
    from dataclasses import replace

    from rdepth.geometry.plots import draw_all
    from rdepth.geometry.report_page import write_report
    from rdepth.geometry.summary import write_summary
    from rdepth.io import REPORT_SEED, final_path, staged_output
    from rdepth.report.html import check_page_folder

    check_page_folder(config.out)  # before any work: someone's index.html is never replaced
    # Written whole into a staging folder, then swapped in: a kill leaves the old analysis or the new one.
    with staged_output(config.out, seed=REPORT_SEED) as staging:
        summary = analyze(replace(config, out=str(staging)))
        summary["settings"]["out"] = str(config.out)
        write_summary(staging, summary)
        figures = draw_all(staging, summary)
        page = write_report(staging, summary, figures)
    return final_path(page)


__all__ = ["AnalyzeConfig", "analyze", "run_analysis", "run_budget"]
