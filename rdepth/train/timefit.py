"""Fitting a training schedule to a wall-clock limit (``TrainConfig.time_limit``).

A run planned from a few timed steps can train slower than planned (the loop counts drawn, a
busy host, a slower stretch of the card): on an H100 a ``rdepth reproduce`` run trained at 154k
tokens/s against its probe's 196k and overran its budget by 33 s. With a time limit the trainer
times its own steps at a few points of the run (``FIT_FRACTIONS`` of the planned schedule) and,
when the steps left would overrun, ends the cosine schedule sooner: ``max_steps`` shrinks to what
the time left holds at the step time just measured. It never lengthens a schedule. The first fit,
made before any checkpoint, scales the validation and checkpoint cadences with the schedule, so
a run planned for N evenly spaced checkpoints still gets N.

The pure functions here decide; :class:`rdepth.train.trainer.Trainer` measures and applies.
"""

from __future__ import annotations

import dataclasses
import math

from rdepth.train.config import TrainConfig

# Where the trainer times itself and may shorten the schedule, as fractions of the planned steps.
# The first comes after the compile warm-up; the later ones catch a run that slows down.
FIT_FRACTIONS = (0.1, 0.3, 0.5, 0.7)


def fit_points(max_steps: int) -> list[int]:
    """The steps (counted as steps done) at which a run of ``max_steps`` fits its schedule,
    ascending and distinct, each in ``2..max_steps - 1`` (none for a run too short to fit)."""
    return sorted({round(f * max_steps) for f in FIT_FRACTIONS} & set(range(2, max_steps)))


def first_mark(max_steps: int) -> int | None:
    """The step at which the timing of the first fit starts: half-way to it, after the first
    steps' compilation. None when the run has no fit point."""
    points = fit_points(max_steps)
    return max(1, points[0] // 2) if points else None


def fitted_max_steps(done: int, elapsed: float, step_seconds: float, time_limit: float, max_steps: int) -> int:
    """The schedule end that the time left holds: ``done`` plus the whole steps of ``step_seconds`` in
    ``time_limit - elapsed``, at least ``done + 1`` (the run always ends on a step it takes) and at
    most ``max_steps`` (never longer than planned)."""
    if step_seconds <= 0 or not math.isfinite(step_seconds):
        return max_steps
    left = max(0.0, time_limit - elapsed)
    return max(done + 1, min(max_steps, done + int(left // step_seconds)))


def refit(config: TrainConfig, max_steps: int, scale_cadences: bool) -> TrainConfig:
    """``config`` with its schedule ending at ``max_steps``; with ``scale_cadences``, the validation
    and checkpoint cadences scaled by the same ratio (at least 1 step; a ``milestone_every`` that
    is no longer a multiple of the new checkpoint cadence falls back to the default)."""
    changes: dict = {"max_steps": max_steps}
    if scale_cadences and max_steps != config.max_steps:
        ratio = max_steps / config.max_steps
        changes["eval_every"] = max(1, round(config.eval_every * ratio))
        changes["checkpoint_every"] = max(1, round(config.checkpoint_every * ratio))
        if config.milestone_every is not None and config.milestone_every % changes["checkpoint_every"]:
            changes["milestone_every"] = None
    return dataclasses.replace(config, **changes)


class ScheduleTimer:
    """Where a run with a time limit times itself: the steps at which it may end its schedule
    sooner (``fit_at``), the step that starts the first timing (``mark_at``, past the compiling
    first steps) and the last timing mark. A resumed run keeps its schedule: nothing to time."""

    def __init__(self, config: TrainConfig, start_step: int, started: float):
        fresh = config.time_limit is not None and start_step == 0
        self.fit_at = set(fit_points(config.max_steps)) if fresh else set()
        self.mark_at = first_mark(config.max_steps) if fresh else None
        self.started = started
        self.mark_step, self.mark_time = 0, started
