"""Per-token arrays of one analysed budget, saved as NPZ beside ``summary.json``.

Keys of ``OUT/geometry/<checkpoint>/<budget>.npz``:

* ``convergence_step/<group>`` [N] int: first step under the convergence threshold (K if never);
* ``final_relative_step_size/<group>`` [N] float32: the last relative step size;
* ``dlr/<group>-><group>/<definition>`` [N] float32: per-token drift-to-loop ratio, for every
  definition of :data:`rdepth.geometry.metrics.DLR_DEFINITIONS`: ``<numerator>`` over Eq. 2's
  mean step over all K_g steps, ``<numerator>_refine`` over the mean of steps k >= 1 (NaN
  where the earlier group ran one step);
* ``pca_coords`` [M, T, 2], ``pca_group`` [M], ``pca_step`` [M], ``pca_explained`` [2]: the
  2-D PCA projection of the kept sequence's M = sum_g (K_g + 1) iterates (when one was kept).

N = windows x positions, rows sequence-major.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rdepth.errors import RdepthError
from rdepth.geometry.metrics import pca_2d
from rdepth.geometry.stream import StreamResult
from rdepth.io import atomic_path


def pca_projection(kept_states: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Fit 2-D PCA on the union of the kept sequence's computed states (steps >= 1 of
    every group; the random x^(0) are left out of the fit) and project every state.

    ``kept_states[g]``: [K_g + 1, T, d]. Returns the ``pca_*`` arrays described above.
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


def budget_arrays(result: StreamResult, group_names: list[str]) -> dict[str, np.ndarray]:
    """The NPZ contents of one budget (keys above) from the observer's result."""
    arrays: dict[str, np.ndarray] = {}
    for name, group in zip(group_names, result.groups, strict=False):
        arrays[f"convergence_step/{name}"] = group["convergence_step"]
        arrays[f"final_relative_step_size/{name}"] = group["final_relative_step_size"].astype(np.float32)
    for boundary, definitions in result.boundaries.items():
        a, b = (int(part) for part in boundary.split("->"))
        for definition, values in definitions.items():
            arrays[f"dlr/{group_names[a]}->{group_names[b]}/{definition}"] = values.astype(np.float32)
    if result.kept_states:
        arrays.update(pca_projection(result.kept_states))
    return arrays


def save_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` compressed, atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def load_arrays(path: str | Path, prefix: str = "") -> dict[str, np.ndarray]:
    """The arrays of a saved NPZ whose key starts with ``prefix`` (RdepthError if it is missing)."""
    path = Path(path)
    if not path.is_file():
        raise RdepthError(f"geometry arrays {path} are missing (rerun `rdepth analyze`)")
    with np.load(path) as npz:
        return {key: npz[key] for key in npz.files if key.startswith(prefix)}
