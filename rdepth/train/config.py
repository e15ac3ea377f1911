"""Training configuration (validated; every field is a ``rdepth train`` flag)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rdepth.errors import RdepthError


@dataclass
class TrainConfig:
    """Optimisation, schedule, evaluation and checkpointing of one run.

    ``batch_size`` is the global batch in sequences per optimizer step, split
    over ``grad_accum`` micro-steps and over data-parallel ranks.
    """

    data: str = "data/wiki"
    out: str = "runs/tiny"
    max_steps: int = 400
    stop_at: int | None = None  # end early at this step (same schedule as max_steps)
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 16
    eval_batch_size: int = 16
    checkpoint_every: int = 100
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    compile: bool = False
    threads: int = 0  # CPU threads for torch (0 = leave as is)

    def __post_init__(self) -> None:
        positive = (
            "max_steps", "batch_size", "grad_accum", "eval_every", "eval_batches",
            "eval_batch_size", "checkpoint_every", "log_every",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RdepthError(f"train config: {name} must be a positive integer, got {value!r}")
        if self.stop_at is not None and not (1 <= self.stop_at <= self.max_steps):
            raise RdepthError(f"train config: stop_at must be in 1..max_steps, got {self.stop_at!r}")
        if self.warmup_steps < 0:
            raise RdepthError(f"train config: warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if not (self.lr > 0):
            raise RdepthError(f"train config: lr must be > 0, got {self.lr!r}")
        if not (0 <= self.min_lr_ratio <= 1):
            raise RdepthError(f"train config: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.batch_size % self.grad_accum:
            raise RdepthError(
                f"train config: batch_size {self.batch_size} is not divisible by grad_accum {self.grad_accum}"
            )
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise RdepthError("train config: grad_clip and weight_decay must be >= 0")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise RdepthError(f"train config: device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.seed < 0:
            raise RdepthError(f"train config: seed must be >= 0, got {self.seed!r}")

    @property
    def end_step(self) -> int:
        return self.stop_at if self.stop_at is not None else self.max_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        from rdepth.io import dataclass_from_dict

        return dataclass_from_dict(cls, data, "train config")
