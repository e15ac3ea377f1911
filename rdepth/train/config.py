"""Training configuration (validated; every field is a ``rdepth train`` flag)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rdepth.errors import RdepthError
from rdepth.fields import option
from rdepth.threads import THREADS_HELP

MAX_LR = 10.0  # AdamW steps are about lr in size: beyond this, weights are noise
MAX_COUNT = 10**9  # steps, batch sizes and cadences beyond this are typing errors, not plans
# Milestone checkpoints over a schedule by default: the loop-geometry series of a run (rdepth analyze)
# keeps this many checkpoints spread over training, whatever --keep-last removes.
MILESTONES = 8


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


COMPILE_SCOPES = ("layer", "step")  # what one compiled graph covers (TrainConfig.compile_scope)

@dataclass
class TrainConfig:
    """Optimisation, schedule, evaluation and checkpointing of one run.

    ``batch_size`` is the global batch in sequences per optimizer step, split
    over ``grad_accum`` micro-steps and over data-parallel ranks.

    Checkpoint rotation: after each save, checkpoints older than the newest
    ``keep_last`` are deleted unless they are milestones (a step on the
    ``milestone_interval`` grid, or the end of the schedule; recorded in the
    checkpoint's state.json when saved) or the checkpoint the run resumed from.
    The defaults (``keep_last`` 3, about ``MILESTONES`` milestones over
    ``max_steps``) keep every checkpoint of a run of up to 8 checkpoints (every
    CPU recipe) and bound a long one: the ``paper`` preset's ~1.5 GB checkpoints
    every 100 of 100,000 steps are 11 folders (~17 GB), not 1,000 (~1.5 TB),
    with 8 of them spread over training for ``rdepth analyze``.
    """

    data: str = option("data/wiki-bpe4096", "prepared data folder (from rdepth prepare)")
    out: str = option("runs/tiny", "run folder: checkpoints, metrics.jsonl, summary.json")
    max_steps: int = option(400, "optimizer steps (the cosine schedule ends here)")
    stop_at: int | None = option(None, "stop early at this step, keeping the max_steps schedule",
                                 default_text="max_steps")
    time_limit: float | None = option(
        None, "seconds the training loop may take (a fresh run): at 10, 30, 50 and 70 percent of the steps the "
              "trainer times itself and ends the cosine schedule sooner if the rest would overrun; never later. "
              "Refused with --resume (a resumed run keeps its saved schedule; --stop-at ends it sooner)",
        default_text="none", metavar="SECONDS")
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
    keep_last: int = option(
        3, "after each checkpoint, delete all but the newest N, keeping milestones and the checkpoint resumed "
        "from (0: keep every checkpoint)")
    milestone_every: int | None = option(
        None, "steps between milestone checkpoints, which --keep-last never deletes (a multiple of "
        "--checkpoint-every)", default_text=f"max_steps / {MILESTONES} rounded up to a multiple of checkpoint_every")
    log_every: int = option(10, "steps between metrics.jsonl records")
    seed: int = option(0, "seed of the weights, batches, loop counts and loop-state noise")
    device: str = option("auto", "auto (CUDA when present), cpu or cuda[:N]")
    compile: bool | None = option(
        None, "torch.compile each layer (regional: one graph per block, reused at every loop step and count; "
        "fuses the norms' casts)", default_text="on with CUDA, off on CPU")
    compile_scope: str = option(
        "layer", "what one compiled graph covers with compile: layer (each layer) or step (each loop step: the "
        "adapter and the group's layers, a few graphs per group, the same for every step and loop count; "
        "single-pass layers per layer)")
    threads: int = option(0, THREADS_HELP)
    curriculum_steps: int = option(
        0, "task data: the top training difficulty rises linearly from the lowest + 1 to the highest over "
        "this many steps (0: every difficulty from the start); ignored on text")
    warm_start: bool = option(
        False, "train for warm-started loops (each group's loop for a token starts from the state the "
        "previous position handed on): the parallel stand-in, a no-grad loop from noise whose hand-offs, "
        "shifted one position, start the loop that trains (twice the groups' forward cost)")
    init_from: str | None = option(None, "start from the weights of this checkpoint or run (rdepth retrofit, "
                                   "import-hf): its model config is the base, flags override loop settings",
                                   default_text="fresh weights from --seed")
    parallel: str = option(
        "ddp", "how torchrun's processes share the work: ddp (each holds the whole model; gradients averaged) "
        "or fsdp (FSDP2: parameters, gradients and AdamW state sharded per layer, checkpoints through "
        "torch.distributed.checkpoint; torchrun only, see docs/distributed.md). One process: ddp is plain training")
    mixed_precision: str = option(
        "none", "with --parallel fsdp: none, or bf16 (layers compute on bfloat16 copies of the gathered weights, "
        "gradients reduced in float32; the sharded weights and AdamW state stay float32)")
    activation_checkpointing: bool = option(
        False, "with --parallel fsdp: recompute each layer's activations in backward instead of keeping them "
        "(less memory, about one more forward of compute; the same numbers)")

    def __post_init__(self) -> None:
        for name in ("data", "out", "device"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RdepthError(f"train config: {name} must be a non-empty string, got {getattr(self, name)!r}")
        positive = (
            "max_steps", "batch_size", "grad_accum", "eval_every", "eval_batches",
            "eval_batch_size", "checkpoint_every", "log_every",
        )
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise RdepthError(f"train config: {name} must be a positive integer, got {value!r}")
            if value > MAX_COUNT:
                raise RdepthError(f"train config: {name} must be at most {MAX_COUNT:,}, got {value!r}")
        if self.stop_at is not None and not (_is_int(self.stop_at) and 1 <= self.stop_at <= self.max_steps):
            raise RdepthError(f"train config: stop_at must be in 1..max_steps, got {self.stop_at!r}")
        if self.time_limit is not None and (not _is_number(self.time_limit) or not math.isfinite(self.time_limit)
                                            or self.time_limit <= 0):
            raise RdepthError(f"train config: time_limit must be a positive number of seconds, got {self.time_limit!r}")
        if self.time_limit is not None and self.stop_at is not None:
            raise RdepthError("train config: time_limit and stop_at both end a run early; give one of them")
        if not _is_int(self.curriculum_steps) or not 0 <= self.curriculum_steps <= MAX_COUNT:
            raise RdepthError(f"train config: curriculum_steps must be an integer in [0, {MAX_COUNT:,}], "
                              f"got {self.curriculum_steps!r}")
        if not _is_int(self.keep_last) or not 0 <= self.keep_last <= MAX_COUNT:
            raise RdepthError(f"train config: keep_last must be an integer >= 0 (0: keep all), got {self.keep_last!r}")
        if self.milestone_every is not None and not (
                _is_int(self.milestone_every) and 1 <= self.milestone_every <= MAX_COUNT
                and self.milestone_every % self.checkpoint_every == 0):
            raise RdepthError(f"train config: milestone_every must be a positive multiple of checkpoint_every "
                              f"{self.checkpoint_every}, got {self.milestone_every!r}")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise RdepthError(f"train config: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "grad_clip"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise RdepthError(f"train config: {name} must be a finite number, got {value!r}")
        if not 0 < self.lr <= MAX_LR:
            raise RdepthError(f"train config: lr must be in (0, {MAX_LR}], got {self.lr!r}")
        if not (0 <= self.min_lr_ratio <= 1):
            raise RdepthError(f"train config: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise RdepthError("train config: grad_clip and weight_decay must be >= 0")
        if self.lr * self.weight_decay >= 1:  # AdamW multiplies weights by (1 - lr * wd) each step
            raise RdepthError(f"train config: lr x weight_decay must be below 1 (AdamW's decoupled decay), "
                              f"got {self.lr!r} x {self.weight_decay!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise RdepthError(f"train config: {name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.batch_size % self.grad_accum:
            raise RdepthError(
                f"train config: batch_size {self.batch_size} is not divisible by grad_accum {self.grad_accum}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not (
                self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise RdepthError(f"train config: device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise RdepthError(f"train config: seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not _is_int(self.threads) or not 0 <= self.threads <= 4096:
            raise RdepthError(f"train config: threads must be an integer in [0, 4096], got {self.threads!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise RdepthError(f"train config: compile must be true or false, got {self.compile!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise RdepthError(f"train config: compile_scope must be one of {', '.join(COMPILE_SCOPES)}, "
                              f"got {self.compile_scope!r}")

        if self.parallel not in ("ddp", "fsdp"):
            raise RdepthError(f"train config: parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.mixed_precision not in ("none", "bf16"):
            raise RdepthError(f"train config: mixed_precision must be none or bf16, got {self.mixed_precision!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise RdepthError(f"train config: activation_checkpointing must be true or false, "
                              f"got {self.activation_checkpointing!r}")
        if self.parallel != "fsdp" and (self.mixed_precision != "none" or self.activation_checkpointing):
            raise RdepthError("train config: mixed_precision and activation_checkpointing are --parallel fsdp "
                              "options: add --parallel fsdp (under torchrun)")

    @property
    def milestone_interval(self) -> int:
        """Steps between milestone checkpoints: ``milestone_every``, else about ``max_steps / MILESTONES``
        rounded up to a multiple of ``checkpoint_every`` (every checkpoint, for a run of at most
        ``MILESTONES`` checkpoints)."""
        if self.milestone_every is not None:
            return self.milestone_every
        return self.checkpoint_every * max(1, math.ceil(self.max_steps / (MILESTONES * self.checkpoint_every)))

    @property
    def end_step(self) -> int:
        return self.stop_at if self.stop_at is not None else self.max_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        from rdepth.io import dataclass_from_dict

        return dataclass_from_dict(cls, data, "train config")
