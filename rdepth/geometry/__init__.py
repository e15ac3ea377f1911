"""Loop geometry: step sizes, step angles, cross-block drift and PCA of looped iterates.

``metrics`` holds plain tensor functions on iterates ``states`` [K+1, N, d];
``stream`` accumulates the same statistics from ``model.forward(observer=...)``
without keeping every iterate; ``config`` holds ``AnalyzeConfig``; ``analyze``
drives checkpoints through the run layer (``rdepth.run``) and saves the numbers
in ``summary``'s format (summary.json with the headline numbers) and
``arrays``' (per-token NPZ), plus ``slowest``'s token table; ``plots`` draws
figures from the saved numbers only; ``report_page`` builds the report section
from them. The metric functions are re-exported here, loaded on first use so
that importing the package (``rdepth --help``) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_METRICS = (
    "DLR_DENOMINATORS",
    "DLR_DEFINITIONS",
    "DLR_NUMERATORS",
    "PCA2D",
    "accelerations",
    "convergence_steps",
    "drift_to_loop_ratio",
    "effective_rank",
    "effective_rank_from_gram",
    "mean_step_size",
    "pca_2d",
    "relative_step_sizes",
    "step_cosines",
    "step_sizes",
    "summarize",
    "update_effective_ranks",
    "updates",
)

__all__ = list(_METRICS)


def __getattr__(name: str) -> Any:
    if name in _METRICS:
        return getattr(importlib.import_module("rdepth.geometry.metrics"), name)
    raise AttributeError(f"module 'rdepth.geometry' has no attribute {name!r}")
