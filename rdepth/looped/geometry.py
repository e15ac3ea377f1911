"""Loop geometry of an adapter model: rdepth's metrics (:mod:`rdepth.geometry.metrics`) over its iterates.

:func:`record_iterates` runs the adapter's forward once and keeps every iterate of every loop, one
trajectory ``[K+1, N, d]`` per run of a loop (N = batch x positions, sequence-major): HRM-Text gives the
H loop once (``H``) and the L loop once per H step (``L@h0``, ``L@h1``, ...); Inkling-2 its passes
(``passes``). :func:`loop_geometry` measures each trajectory (step sizes, relative step sizes,
consecutive-step cosines, update effective ranks, per-token convergence, a 2-D PCA of the first
sequence) and, between consecutive runs of the same inner loop (HRM's L loops of H steps h and h+1:
the fast loop restarting where it stopped, after the slow state moved), the drift-to-loop ratios and the
hand-off ratio. :func:`analyze_looped` saves it as ``OUT/looped_geometry.json`` plus the per-token
arrays and PCA coordinates in ``OUT/looped_geometry.npz``.

This is a Python API, not ``rdepth analyze``: that command reads rdepth runs with their held-out data
and noise; an adapter model comes with its own tokenizer and no held-out split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.geometry import metrics
from rdepth.looped.protocol import LoopedAdapter, forward

SUMMARY_FILE = "looped_geometry.json"
ARRAYS_FILE = "looped_geometry.npz"
DLR_SHOWN = ("first", "first_refine", "output")


def trajectory_name(loop: str, outer: tuple[int, ...]) -> str:
    """``H``; ``L@h0`` for the L loop inside H step 0 (``@`` then the outer step numbers)."""
    return loop if not outer else f"{loop}@" + ",".join(f"h{i}" for i in outer)


def record_iterates(adapter: LoopedAdapter, input_ids: torch.Tensor, budgets: dict[str, int] | None = None,
                    **extra: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits ``[B, T, V]`` and every loop run's iterates ``{name: [K+1, B*T, d]}`` (float64, in run order)."""
    recorded: dict[str, list[torch.Tensor]] = {}

    def observe(loop: str, outer: tuple[int, ...], step: int, state: torch.Tensor) -> None:
        recorded.setdefault(trajectory_name(loop, outer), []).append(state.detach().double().reshape(-1, state.shape[-1]))

    with torch.no_grad():
        logits = forward(adapter, input_ids, budgets=budgets, observe=observe, **extra)
    return logits, {name: torch.stack(states) for name, states in recorded.items()}


def _per_step(values: torch.Tensor) -> list[float]:
    return [float(v) for v in values.double().mean(dim=-1)]


def trajectory_summary(states: torch.Tensor, threshold: float, tokens_per_sequence: int) -> tuple[dict, dict]:
    """Headline numbers and per-token arrays of one trajectory ``[K+1, N, d]``."""
    steps = states.shape[0] - 1
    sizes = metrics.step_sizes(states)
    relative = metrics.relative_step_sizes(states)
    convergence = metrics.convergence_steps(states, threshold)
    summary: dict[str, Any] = {
        "steps": steps,
        "step_size": _per_step(sizes),
        "relative_step_size": _per_step(relative),
        "step_cosine": _per_step(metrics.step_cosines(states)) if steps >= 2 else [],
        "update_effective_rank": [float(r) for r in metrics.update_effective_ranks(states)],
        "converged_share": float((convergence < steps).double().mean()),
        "convergence_threshold": threshold,
    }
    first = states[:, :tokens_per_sequence]  # the first sequence: PCA of its computed iterates
    arrays = {"step_size": sizes.numpy().astype(np.float32), "convergence_step": convergence.numpy()}
    if first.shape[0] > 2 and first.shape[1] > 1:
        fit = metrics.pca_2d(first[1:].reshape(-1, first.shape[-1]))
        summary["pca_explained"] = [float(v) for v in fit.explained_variance_ratio]
        arrays["pca_coords"] = fit.project(first).numpy().astype(np.float32)  # [K+1, T, 2]
    return summary, arrays


def boundary_summary(prev_states: torch.Tensor, next_states: torch.Tensor) -> tuple[dict, dict]:
    """Median drift-to-loop ratios (:data:`DLR_SHOWN`) and hand-off ratio between two runs of a loop."""
    summary: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for definition in DLR_SHOWN:
        values = metrics.drift_to_loop_ratio(prev_states, next_states, definition)
        summary[f"dlr_{definition}_median"] = float(values.nanmedian())
        arrays[f"dlr_{definition}"] = values.numpy().astype(np.float32)
    handoff = metrics.handoff_ratio(prev_states, next_states)
    summary["handoff_median"] = float(handoff.nanmedian())
    arrays["handoff"] = handoff.numpy().astype(np.float32)
    return summary, arrays


def loop_geometry(adapter: LoopedAdapter, input_ids: torch.Tensor, budgets: dict[str, int] | None = None,
                  threshold: float = 1e-3, **extra: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The summary (JSON-ready) and the per-token arrays (NPZ keys ``<trajectory>/<name>``) of every loop of
    ``adapter`` on ``input_ids`` ``[B, T]``."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise RdepthError(f"loop geometry needs token ids [B, T >= 2], got {tuple(input_ids.shape)}")
    _, iterates = record_iterates(adapter, input_ids, budgets, **extra)
    tokens_per_sequence = input_ids.shape[1]
    summary: dict[str, Any] = {"model_type": adapter.model_type, "budgets": adapter.budgets(budgets),
                               "tokens": int(input_ids.numel()), "trajectories": {}, "boundaries": {}}
    arrays: dict[str, np.ndarray] = {}
    for name, states in iterates.items():
        summary["trajectories"][name], found = trajectory_summary(states, threshold, tokens_per_sequence)
        arrays.update({f"{name}/{key}": value for key, value in found.items()})
    for spec in adapter.loops:
        runs = [name for name in iterates if name.split("@")[0] == spec.name]
        for before, after in zip(runs, runs[1:], strict=False):
            boundary = f"{before}->{after}"
            summary["boundaries"][boundary], found = boundary_summary(iterates[before], iterates[after])
            arrays.update({f"{boundary}/{key}": value for key, value in found.items()})
    return summary, arrays


def analyze_looped(adapter: LoopedAdapter, input_ids: torch.Tensor, out: str | Path,
                   budgets: dict[str, int] | None = None, threshold: float = 1e-3, **extra: Any) -> dict[str, Any]:
    """:func:`loop_geometry`, saved as ``OUT/looped_geometry.json`` and ``OUT/looped_geometry.npz``; returns
    the summary."""
    from rdepth.geometry.arrays import save_npz
    from rdepth.io import write_json

    summary, arrays = loop_geometry(adapter, input_ids, budgets, threshold, **extra)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_npz(out / ARRAYS_FILE, arrays)
    write_json(out / SUMMARY_FILE, summary)
    return summary
