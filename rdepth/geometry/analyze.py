"""Drive checkpoints through held-out text and save every loop-geometry number.

For each checkpoint and each loop budget ("train": the config's eval loop
counts; "long": a fixed long budget, 30 by default as in the paper's Figure 5)
the model runs the same held-out windows with the same initial-state noise, a
:class:`~rdepth.geometry.stream.GeometryObserver` attached. Output layout::

    OUT/geometry/summary.json              settings, per checkpoint and budget:
                                           per-group step curves (mean/std),
                                           DLR stats per boundary, val loss
    OUT/geometry/<checkpoint>/<budget>.npz per-token arrays (convergence step,
                                           DLR per definition) and the PCA
                                           projection of the kept sequence
    OUT/geometry/slowest_tokens.json       tokens that need the longest loops

Figures and the report page are built from these files only
(:mod:`rdepth.geometry.plots`, :mod:`rdepth.geometry.report_page`); :func:`run_analysis`
does all three.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.geometry.config import AnalyzeConfig
from rdepth.geometry.metrics import DEFAULT_DLR, DLR_DEFINITIONS, pca_2d
from rdepth.geometry.stream import STEP_METRICS, GeometryObserver, StreamResult
from rdepth.io import environment_info, write_json

log = logging.getLogger(__name__)

GEOMETRY_DIR = "geometry"
SUMMARY_FILE = "summary.json"
SLOWEST_FILE = "slowest_tokens.json"
FORMAT_VERSION = 1

DLR_DESCRIPTIONS = {
    "literal": "paper Eq. 2 as written: ||x_{g+1}^(0) - x_g^(K)||, x^(0) the random initial state",
    "first": "real drift: ||x_{g+1}^(1) - x_g^(K)||, the next group's first computed iterate",
    "output": "output drift: ||x_{g+1}^(K) - x_g^(K)||, the two groups' hand-off states",
}


# ------------------------------------------------------------------ inputs


def find_checkpoints(paths: list[str | Path]) -> list[Path]:
    """Checkpoint folders from checkpoint paths and run folders (every checkpoint of a run),
    ordered by training step, duplicates dropped."""
    from rdepth.train.checkpoint import list_checkpoints, resolve_checkpoint

    found: list[Path] = []
    for path in paths:
        path = Path(path)
        run_list = list_checkpoints(path.parent if path.name == "checkpoints" else path)
        for checkpoint in run_list or [resolve_checkpoint(path)]:
            if checkpoint.resolve() not in {p.resolve() for p in found}:
                found.append(checkpoint)
    if not found:
        raise RdepthError("no checkpoints given")
    return sorted(found, key=lambda p: (checkpoint_step(p), str(p)))


def checkpoint_step(checkpoint: Path) -> int:
    """Training step of a checkpoint folder (state.json, else its step_N name, else -1)."""
    state = checkpoint / "state.json"
    if state.exists():
        try:
            return int(json.loads(state.read_text())["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            pass
    match = re.search(r"(\d+)$", checkpoint.name)
    return int(match.group(1)) if match else -1


def held_out_windows(tokens: np.ndarray, sequences: int, seq_len: int) -> torch.Tensor:
    """The first ``sequences`` consecutive windows of ``seq_len + 1`` tokens (inputs and
    next-token targets overlap by one): -> int64 [S, seq_len + 1]. Fewer if the text is short."""
    available = (len(tokens) - 1) // seq_len
    if available < 1:
        raise RdepthError(f"held-out text has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    count = min(sequences, available)
    if count < sequences:
        log.warning("held-out text holds only %d windows of %d tokens (asked for %d)", count, seq_len, sequences)
    rows = [np.asarray(tokens[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64) for i in range(count)]
    return torch.from_numpy(np.stack(rows))


def load_tokenizer_for(data: str | Path, checkpoint: Path):
    """The tokenizer to show token text with (None if none can be found)."""
    from rdepth.data.shards import TokenShards
    from rdepth.train.data_source import run_tokenizer

    try:
        if Path(data).is_dir():
            return TokenShards.open(data).tokenizer
        return run_tokenizer(checkpoint)
    except RdepthError as exc:
        log.warning("token text unavailable: %s", exc)
        return None


# ------------------------------------------------------------------ driving


def run_budget(
    model: torch.nn.Module,
    windows: torch.Tensor,
    loop_counts: tuple[int, ...],
    config: AnalyzeConfig,
    device: torch.device,
) -> tuple[StreamResult, float]:
    """Run every window through ``model`` at ``loop_counts`` with an observer attached.

    The initial-state noise of batch b comes from a generator seeded with
    ``seed + b``, so every checkpoint and budget starts from the same x^(0).
    Returns the observer's statistics and the mean next-token cross-entropy (nats).
    """
    from tqdm import tqdm

    observer = GeometryObserver(config.threshold, config.keep_sequence, config.rank)
    total_loss, total_tokens = 0.0, 0
    batches = list(windows.split(config.batch_size))
    with torch.no_grad():
        for number, batch in enumerate(tqdm(batches, desc=f"loops {','.join(map(str, loop_counts))}",
                                            leave=False, disable=len(batches) < 2)):
            batch = batch.to(device)
            generator = torch.Generator(device=device).manual_seed(config.seed + number)
            output = model(batch[:, :-1], batch[:, 1:], loop_counts, generator=generator, observer=observer)
            total_loss += float(output.loss) * batch[:, 1:].numel()
            total_tokens += batch[:, 1:].numel()
            del output
    return observer.result(), total_loss / total_tokens


def pca_projection(kept_states: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Fit 2-D PCA on the union of the kept sequence's computed states (steps >= 1 of
    every group; the random x^(0) are left out of the fit) and project every state.

    Returns ``pca_coords`` [M, T, 2] for the M = sum_g (K_g + 1) iterates in depth
    order, ``pca_group`` [M], ``pca_step`` [M] and ``pca_explained`` [2].
    """
    fit_points = torch.cat([torch.from_numpy(states[1:]).reshape(-1, states.shape[-1]) for states in kept_states])
    fit = pca_2d(fit_points)
    coords = [fit.project(torch.from_numpy(states)).numpy().astype(np.float32) for states in kept_states]
    return {
        "pca_coords": np.concatenate(coords),
        "pca_group": np.concatenate([np.full(len(s), g) for g, s in enumerate(kept_states)]),
        "pca_step": np.concatenate([np.arange(len(s)) for s in kept_states]),
        "pca_explained": fit.explained_variance_ratio.numpy(),
    }


def _stats(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(values.mean()), "std": float(values.std()), "median": float(np.median(values)),
        "p10": float(np.quantile(values, 0.1)), "p90": float(np.quantile(values, 0.9)),
    }


def summarize_budget(result: StreamResult, group_names: list[str], loss: float) -> dict[str, Any]:
    """The JSON summary of one budget: per-group curves, convergence and DLR statistics."""
    groups = []
    for name, arrays in zip(group_names, result.groups):
        entry: dict[str, Any] = {"name": name, "steps": int(arrays["steps"])}
        for metric in STEP_METRICS:
            entry[metric] = {"mean": arrays[f"{metric}_mean"].tolist(), "std": arrays[f"{metric}_std"].tolist()}
        if "effective_rank" in arrays:
            entry["effective_rank"] = arrays["effective_rank"].tolist()
        convergence = arrays["convergence_step"]
        entry["convergence"] = {
            **_stats(convergence.astype(np.float64)),
            "never_fraction": float((convergence >= entry["steps"]).mean()),
        }
        groups.append(entry)
    dlr = {}
    for boundary, definitions in result.boundaries.items():
        a, b = (int(part) for part in boundary.split("->"))
        dlr[f"{group_names[a]}->{group_names[b]}"] = {name: _stats(v) for name, v in definitions.items()}
    return {"loss": loss, "tokens": result.tokens, "groups": groups, "dlr": dlr}


def budget_arrays(result: StreamResult, group_names: list[str]) -> dict[str, np.ndarray]:
    """Per-token arrays (and the PCA projection) saved as NPZ beside the summary."""
    arrays: dict[str, np.ndarray] = {}
    for name, group in zip(group_names, result.groups):
        arrays[f"convergence_step/{name}"] = group["convergence_step"]
        arrays[f"final_relative_step_size/{name}"] = group["final_relative_step_size"].astype(np.float32)
    for boundary, definitions in result.boundaries.items():
        a, b = (int(part) for part in boundary.split("->"))
        for definition, values in definitions.items():
            arrays[f"dlr/{group_names[a]}->{group_names[b]}/{definition}"] = values.astype(np.float32)
    if result.kept_states:
        arrays.update(pca_projection(result.kept_states))
    return arrays


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    from rdepth.io import atomic_path

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, **arrays)


def slowest_tokens(
    convergence: dict[str, np.ndarray],
    final_relative: np.ndarray,
    windows: torch.Tensor,
    tokenizer,
    top: int,
    context: int = 8,
) -> list[dict[str, Any]]:
    """The ``top`` tokens with the largest total convergence step over groups.

    ``convergence`` maps group name -> [N] steps (rows: sequence-major over the
    windows' input positions); ties go to the larger ``final_relative`` [N] (the
    last relative step size in the last group).
    """
    names = list(convergence)
    total = sum(convergence[name].astype(np.int64) for name in names)
    order = np.lexsort((-final_relative, -total))[:top]
    seq_len = windows.shape[1] - 1

    def text(ids) -> str:
        if tokenizer is None:
            return " ".join(map(str, ids))
        try:
            return tokenizer.decode([int(i) for i in ids])
        except Exception:  # a tokenizer may reject a partial byte sequence
            return " ".join(map(str, ids))

    rows = []
    for row in order:
        sequence, position = divmod(int(row), seq_len)
        ids = windows[sequence, : seq_len].tolist()
        entry = {
            "token": repr(text([ids[position]])),
            "context": text(ids[max(0, position - context) : position + 1]).replace("\n", "\\n"),
            "sequence": sequence,
            "position": position,
        }
        entry.update({f"steps {name}": int(convergence[name][row]) for name in names})
        entry[f"last rel. step {names[-1]}"] = float(final_relative[row])
        rows.append(entry)
    return rows


def analyze(
    checkpoints: list[Path], data: str | Path, out: str | Path, config: AnalyzeConfig
) -> dict[str, Any]:
    """Measure every checkpoint at both budgets; write summary.json, NPZs and the slowest-token
    table under ``OUT/geometry``; return the summary."""
    from rdepth.train.checkpoint import load_model
    from rdepth.train.data_source import held_out_tokens
    from rdepth.train.trainer import resolve_device

    device = resolve_device(config.device)
    out = Path(out)
    folder = out / GEOMETRY_DIR
    summary: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "settings": {**asdict(config), "data": str(data)},
        "environment": environment_info(), "dlr_definitions": DLR_DESCRIPTIONS,
        "dlr_default": DEFAULT_DLR, "checkpoints": [],
    }
    windows, tokenizer, reference = None, None, None
    last_long: tuple[StreamResult, list[str]] | None = None
    for checkpoint in checkpoints:
        started = time.perf_counter()
        model, model_config = load_model(checkpoint, device)
        group_names = [spec.name for spec in model_config.group_specs]
        if not group_names:
            raise RdepthError(f"checkpoint {checkpoint} has no recurrence groups: nothing to analyze")
        shape = (model_config.to_dict()["groups"], model_config.d_model, model_config.n_layer)
        if reference is None:
            reference = shape
            seq_len = min(config.seq_len or model_config.block_size, model_config.block_size)
            tokens, _ = held_out_tokens(data, checkpoint, model_config)
            windows = held_out_windows(tokens, config.sequences, seq_len)
            if int(windows.max()) >= model_config.vocab_size:
                raise RdepthError(f"held-out tokens exceed the model's vocabulary of {model_config.vocab_size}")
            tokenizer = load_tokenizer_for(data, checkpoint)
            summary.update(groups=group_names, sequences=int(windows.shape[0]), seq_len=seq_len)
        elif shape != reference:
            raise RdepthError(f"checkpoint {checkpoint} has a different architecture from {checkpoints[0]}")
        train_counts = model.resolve_loop_counts(config.train_loops)
        budgets = {"train": train_counts, "long": (config.long_loops,) * len(group_names)}
        entry: dict[str, Any] = {"label": checkpoint.name, "step": checkpoint_step(checkpoint),
                                 "path": str(checkpoint), "budgets": {}}
        for budget, counts in budgets.items():
            result, loss = run_budget(model, windows, counts, config, device)
            arrays_path = folder / checkpoint.name / f"{budget}.npz"
            save_npz(arrays_path, budget_arrays(result, group_names))
            entry["budgets"][budget] = {
                "loop_counts": list(counts), **summarize_budget(result, group_names, loss),
                "arrays": arrays_path.relative_to(out).as_posix(),
            }
            if budget == "long":
                last_long = (result, group_names)
        entry["seconds"] = time.perf_counter() - started
        log.info("%s: train-budget loss %.4f, long-budget loss %.4f (%.1f s)", checkpoint.name,
                 entry["budgets"]["train"]["loss"], entry["budgets"]["long"]["loss"], entry["seconds"])
        summary["checkpoints"].append(entry)
        del model
    summary["budgets"] = {name: entry["budgets"][name]["loop_counts"] for name in ("train", "long")}
    if last_long is not None:
        result, group_names = last_long
        convergence = {name: g["convergence_step"] for name, g in zip(group_names, result.groups)}
        rows = slowest_tokens(convergence, result.groups[-1]["final_relative_step_size"], windows, tokenizer,
                              config.top_tokens)
        write_json(folder / SLOWEST_FILE, {"checkpoint": summary["checkpoints"][-1]["label"], "budget": "long",
                                           "threshold": config.threshold, "rows": rows})
    write_json(folder / SUMMARY_FILE, summary)
    return summary


def load_summary(out: str | Path) -> dict[str, Any]:
    """Read ``OUT/geometry/summary.json`` (RdepthError if missing or corrupt)."""
    path = Path(out) / GEOMETRY_DIR / SUMMARY_FILE
    if not path.is_file():
        raise RdepthError(f"no geometry summary at {path} (run `rdepth analyze` first)")
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise RdepthError(f"geometry summary {path} is corrupt") from None
    if summary.get("format_version") != FORMAT_VERSION or not summary.get("checkpoints"):
        raise RdepthError(f"geometry summary {path} has an unknown format or no checkpoints")
    return summary


def run_analysis(checkpoints: list[str | Path], data: str | Path, out: str | Path, config: AnalyzeConfig) -> Path:
    """Measure, draw and report: the whole of ``rdepth analyze``. Returns OUT/index.html."""
    from rdepth.geometry.plots import draw_all
    from rdepth.geometry.report_page import write_report

    summary = analyze(find_checkpoints(checkpoints), data, out, config)
    figures = draw_all(out, summary)
    return write_report(out, summary, figures)


__all__ = ["AnalyzeConfig", "DLR_DEFINITIONS", "analyze", "find_checkpoints", "load_summary", "run_analysis"]
