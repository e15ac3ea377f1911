"""Training configuration (validated; every field is a ``rdepth train`` flag)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rdepth.errors import RdepthError
from rdepth.fields import option


@dataclass
class TrainConfig:
    """Optimisation, schedule, evaluation and checkpointing of one run.

    ``batch_size`` is the global batch in sequences per optimizer step, split
    over ``grad_accum`` micro-steps and over data-parallel ranks.
    """

    data: str = option("data/wiki-bpe4096", "prepared data folder (from rdepth prepare)")
    out: str = option("runs/tiny", "run folder: checkpoints, metrics.jsonl, summary.json")
    max_steps: int = option(400, "optimizer steps (the cosine schedule ends here)")
    stop_at: int | None = option(None, "stop early at this step, keeping the max_steps schedule",
                                 default_text="max_steps")
    batch_size: int = option(16, "sequences per optimizer step (all ranks and micro-steps together)")
    grad_accum: int = option(1, "micro-steps per optimizer step")
    lr: float = option(2e-3, "peak learning rate")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of lr")
    warmup_steps: int = option(40, "linear warm-up steps")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "gradient-norm clip (0: off)")
    eval_every: int = option(100, "steps between validations")
    eval_batches: int = option(16, "validation batches per evaluation")
    eval_batch_size: int = option(16, "windows per validation batch")
    checkpoint_every: int = option(100, "steps between checkpoints")
    log_every: int = option(10, "steps between metrics.jsonl records")
    seed: int = option(0, "seed of the weights, batches, loop counts and loop-state noise")
    device: str = option("auto", "auto (CUDA when present), cpu or cuda[:N]")
    compile: bool = option(False, "torch.compile each layer")
    threads: int = option(0, "torch CPU threads (0: torch's default)")

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
