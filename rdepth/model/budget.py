"""How long each group loops, as every decoding path reads it: a fixed count per group, or a loop controller
(per-token exits). The lock-step decoder (:mod:`rdepth.model.decoder`) and the engine (:mod:`rdepth.engine`)
read a user's ``loop_counts`` / ``controller_factory`` through :func:`resolve_budget`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rdepth.config import parse_loop_counts
from rdepth.errors import RdepthError
from rdepth.model.control import LoopController
from rdepth.model.recurrent import RecurrentLM


@dataclass(frozen=True)
class Budget:
    """How long each group loops: ``counts`` (fixed) or a ``controller_factory`` (exits)."""

    counts: tuple[int, ...] | None = None
    controller_factory: Callable[[], LoopController] | None = None

    @property
    def fixed(self) -> bool:
        return self.controller_factory is None


def resolve_budget(model: RecurrentLM, loop_counts, controller_factory, default: Budget | None = None) -> Budget:
    """Fixed ``loop_counts``, else exits by ``controller_factory``, else ``default`` (the model's eval loops
    when None)."""
    if loop_counts is not None and controller_factory is not None:
        raise RdepthError("decoder: give loop_counts or controller_factory, not both")
    if controller_factory is not None:
        return Budget(controller_factory=controller_factory)
    if loop_counts is None and default is not None:
        return default
    counts = model.config.default_eval_loops if loop_counts is None else loop_counts
    return Budget(counts=parse_loop_counts(counts, model.n_groups) if model.n_groups else ())
