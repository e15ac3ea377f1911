"""Training configuration (validated; every field is a ``rdepth train`` flag)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rdepth.config import COMPILE_MODES
from rdepth.errors import RdepthError
from rdepth.fields import check_fields, option
from rdepth.threads import THREADS_HELP

MAX_LR = 10.0  # AdamW steps are about lr in size: beyond this, weights are noise
MAX_COUNT = 10**9  # steps, batch sizes and cadences beyond this are typing errors, not plans
# Milestone checkpoints over a schedule by default: the loop-geometry series of a run (rdepth analyze)
# keeps this many checkpoints spread over training, whatever --keep-last removes.
MILESTONES = 8


COMPILE_SCOPES = ("layer", "step")  # what one compiled graph covers (TrainConfig.compile_scope)
STATE_NOISES = ("sequence", "counter")  # how training rows draw their initial loop states (TrainConfig.state_noise)

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
    max_steps: int = option(400, "optimizer steps (the cosine schedule ends here)", bounds=f"[1, {MAX_COUNT}]")
    stop_at: int | None = option(None, "stop early at this step, keeping the max_steps schedule",
                                 default_text="max_steps", bounds="[1, inf)")
    time_limit: float | None = option(
        None, "seconds the training loop may take (a fresh run): at 10, 30, 50 and 70 percent of the steps the "
              "trainer times itself and ends the cosine schedule sooner if the rest would overrun; never later. "
              "Refused with --resume (a resumed run keeps its saved schedule; --stop-at ends it sooner)",
        default_text="none", metavar="SECONDS", bounds="(0, inf)")
    batch_size: int = option(16, "sequences per optimizer step (all ranks and micro-steps together)", bounds=f"[1, {MAX_COUNT}]")
    grad_accum: int = option(1, "micro-steps per optimizer step", bounds=f"[1, {MAX_COUNT}]")
    lr: float = option(2e-3, "peak learning rate", bounds=f"(0, {MAX_LR}]")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of lr", bounds="[0, 1]")
    warmup_steps: int = option(40, "linear warm-up steps", bounds="[0, inf)")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only)", bounds="[0, inf)")
    beta1: float = option(0.9, "AdamW beta1", bounds="[0, 1)")
    beta2: float = option(0.95, "AdamW beta2", bounds="[0, 1)")
    grad_clip: float = option(1.0, "gradient-norm clip (0: off)", bounds="[0, inf)")
    eval_every: int = option(100, "steps between validations", bounds=f"[1, {MAX_COUNT}]")
    eval_batches: int = option(16, "validation batches per evaluation", bounds=f"[1, {MAX_COUNT}]")
    eval_batch_size: int = option(16, "windows per validation batch", bounds=f"[1, {MAX_COUNT}]")
    checkpoint_every: int = option(100, "steps between checkpoints", bounds=f"[1, {MAX_COUNT}]")
    keep_last: int = option(
        3, "after each checkpoint, delete all but the newest N, keeping milestones and the checkpoint resumed "
        "from (0: keep every checkpoint)", bounds=f"[0, {MAX_COUNT}]")
    milestone_every: int | None = option(
        None, "steps between milestone checkpoints, which --keep-last never deletes (a multiple of "
        "--checkpoint-every)", default_text=f"max_steps / {MILESTONES} rounded up to a multiple of checkpoint_every", bounds=f"[1, {MAX_COUNT}]")
    log_every: int = option(10, "steps between metrics.jsonl records", bounds=f"[1, {MAX_COUNT}]")
    seed: int = option(0, "seed of the weights, batches, loop counts and loop-state noise", bounds=f"[0, {2**63})")
    device: str = option("auto", "auto (CUDA when present), cpu or cuda[:N]")
    compile: bool | None = option(
        None, "torch.compile each layer (regional: one graph per block, reused at every loop step and count; "
        "fuses the norms' casts)", default_text="on with CUDA, off on CPU")
    compile_scope: str = option(
        "layer", "what one compiled graph covers with compile: layer (each layer) or step (each loop step: the "
        "adapter and the group's layers, a few graphs per group, the same for every step and loop count; "
        "single-pass layers per layer)", choices=COMPILE_SCOPES)
    compile_mode: str = option(
        "default", "Inductor's mode with compile: default, or max-autotune-no-cudagraphs (benchmarks matmul and "
        "kernel configurations while compiling: minutes more start-up; the same maths)", choices=COMPILE_MODES)
    fused_loss: bool = option(
        False, "compute the loss and its gradients chunk by chunk from the final hidden states, without the "
        "[batch x tokens x vocabulary] logits (rdepth.model.fused_loss; each chunk's softmax compiled when the "
        "layers are); the same loss up to summation order")
    threads: int = option(0, THREADS_HELP, bounds="[0, 4096]")
    curriculum_steps: int = option(
        0, "task data: the top training difficulty rises linearly from the lowest + 1 to the highest over "
        "this many steps (0: every difficulty from the start); ignored on text", bounds=f"[0, {MAX_COUNT}]")
    warm_start: bool = option(
        False, "train for warm-started loops (each group's loop for a token starts from the state the "
        "previous position handed on): the parallel stand-in, a no-grad loop from noise whose hand-offs, "
        "shifted one position, start the loop that trains (twice the groups' forward cost)")
    state_noise: str = option(
        "sequence", "initial loop-state noise of the training rows, both keyed by (seed, row, position, group) "
        "so ranks and batchings agree: sequence (a seeded generator per row and group: every documented "
        "figure) or counter (a hash of those keys computed on the device in one pass per group, fused into "
        "one kernel with compile: far fewer kernels and no host work; other values of the same "
        "distribution). Evaluation always uses sequence", choices=STATE_NOISES)
    init_from: str | None = option(None, "start from the weights of this checkpoint or run (rdepth retrofit, "
                                   "import-hf): its model config is the base, flags override loop settings",
                                   default_text="fresh weights from --seed")
    parallel: str = option(
        "ddp", "how torchrun's processes share the work: ddp (each holds the whole model; gradients averaged) "
        "or fsdp (FSDP2: parameters, gradients and AdamW state sharded per layer, checkpoints through "
        "torch.distributed.checkpoint; torchrun only, see docs/distributed.md). One process: ddp is plain training", choices=("ddp", "fsdp"))
    mixed_precision: str = option(
        "none", "with --parallel fsdp: none, or bf16 (layers compute on bfloat16 copies of the gathered weights, "
        "gradients reduced in float32; the sharded weights and AdamW state stay float32)", choices=("none", "bf16"))
    activation_checkpointing: bool = option(
        False, "with --parallel fsdp: recompute each layer's activations in backward instead of keeping them "
        "(less memory, about one more forward of compute; the same numbers)")
    fp8: bool = option(
        False, "float8 matmuls (torchao float8 training, dynamic tensorwise scales) in every layer's Linear "
        "modules (qkv, attention proj, MLP fc and proj; looped and single-pass layers) and the adapters; the "
        "tied head, embeddings and norms stay bf16, weights, AdamW state and checkpoints float32 as without it. "
        "Needs a CUDA card of compute capability >= 8.9 and torchao (pip install 'rdepth[fp8]'); not with "
        "--parallel fsdp")

    def __post_init__(self) -> None:
        _check_kinds(self)
        check_fields(self, "train config")
        # The rules between fields.
        _check_compile_flags(self)
        _check_schedule(self)
        _check_optimizer(self)
        _check_batching(self)
        _check_device(self)
        _check_parallel(self)

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
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        from rdepth.io import dataclass_from_dict

        return dataclass_from_dict(cls, data, "train config")


def _check_kinds(config: TrainConfig) -> None:
    """The fields no interval describes: non-empty strings and true/false flags (None: the default decides)."""
    for name in ("data", "out", "device"):
        if not isinstance(getattr(config, name), str) or not getattr(config, name):
            raise RdepthError(f"train config: {name} must be a non-empty string, got {getattr(config, name)!r}")
    for name in ("compile", "activation_checkpointing", "fused_loss", "fp8"):
        value = getattr(config, name)
        if not isinstance(value, bool) and not (value is None and name == "compile"):
            raise RdepthError(f"train config: {name} must be true or false, got {value!r}")


def _check_compile_flags(config: TrainConfig) -> None:
    """--compile-mode and --compile-scope only with compiling on."""
    if config.compile is False and (config.compile_mode != "default" or config.compile_scope != "layer"):
        flag = "--compile-mode" if config.compile_mode != "default" else "--compile-scope"
        raise RdepthError(f"train config: {flag} applies when compiling, and --no-compile turns compiling off: "
                          "drop one of them")


def _check_schedule(config: TrainConfig) -> None:
    """Where a run ends and which checkpoints are milestones: stop_at within the schedule, one early end,
    milestones on the checkpoint grid."""
    if config.stop_at is not None and config.stop_at > config.max_steps:
        raise RdepthError(f"train config: stop_at must be in 1..max_steps, got {config.stop_at!r}")
    if config.time_limit is not None and config.stop_at is not None:
        raise RdepthError("train config: time_limit and stop_at both end a run early; give one of them")
    if config.milestone_every is not None and config.milestone_every % config.checkpoint_every:
        raise RdepthError(f"train config: milestone_every must be a positive multiple of checkpoint_every "
                          f"{config.checkpoint_every}, got {config.milestone_every!r}")


def _check_optimizer(config: TrainConfig) -> None:
    """AdamW's decoupled decay shrinking the weights, not flipping their sign."""
    if config.lr * config.weight_decay >= 1:  # AdamW multiplies weights by (1 - lr * wd) each step
        raise RdepthError(f"train config: lr x weight_decay must be below 1 (AdamW's decoupled decay), "
                          f"got {config.lr!r} x {config.weight_decay!r}")


def _check_batching(config: TrainConfig) -> None:
    """The global batch splitting evenly into micro-steps."""
    if config.batch_size % config.grad_accum:
        raise RdepthError(
            f"train config: batch_size {config.batch_size} is not divisible by grad_accum {config.grad_accum}"
        )


def _check_device(config: TrainConfig) -> None:
    """auto, cpu, cuda or cuda:N."""
    if config.device not in ("auto", "cpu", "cuda") and not (
            config.device.startswith("cuda:") and config.device[5:].isdigit()):
        raise RdepthError(f"train config: device must be auto, cpu or cuda[:N], got {config.device!r}")


def _check_parallel(config: TrainConfig) -> None:
    """The FSDP-only options only with --parallel fsdp, and fp8 never with it."""
    if config.parallel != "fsdp" and (config.mixed_precision != "none" or config.activation_checkpointing):
        raise RdepthError("train config: mixed_precision and activation_checkpointing are --parallel fsdp "
                          "options: add --parallel fsdp (under torchrun)")
    if config.fp8 and config.parallel == "fsdp":
        raise RdepthError("train config: fp8 is not supported with --parallel fsdp (torchao's float8 "
                          "all-gather of sharded weights is not wired in): use --parallel ddp")
