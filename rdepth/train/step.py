"""One training step and what it needs: the step machinery the trainer runs, usable on its own.

:class:`TrainStep` holds the model (its initial weights a function of the seed alone) and its AdamW,
placed on the device (FSDP shards with ``--parallel fsdp``, bf16 autocast on CUDA, float8 matmuls with
``config.fp8``), the compiled regions, a :class:`~rdepth.data.loader.BatchSampler`, and the draws of a
step (each micro-batch's loop counts and initial-state noise, functions of ``(seed, step)``).
:class:`rdepth.train.trainer.Trainer` holds a ``TrainStep`` and adds the run around it: data, run folder,
validation, checkpoints, resume. Benchmarks and tests build a complete ``TrainStep`` on any tokens with
:meth:`TrainStep.on_tokens`, through the same set-up (:func:`start_run`), constructor, placement and
compilation as a run.
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import torch

from rdepth.config import ModelConfig, check_fits_memory
from rdepth.data.loader import BatchSampler
from rdepth.data.shards import token_dtype
from rdepth.errors import RdepthError
from rdepth.model import RecurrentLM, sample_loop_counts, step_generator
from rdepth.model.noise import CounterNoise, StateNoise
from rdepth.run.device import resolve_device
from rdepth.train.config import TrainConfig
from rdepth.train.distributed import DistInfo, init_distributed
from rdepth.train.fp8 import check_fp8_device, convert_to_fp8, require_torchao
from rdepth.train.fsdp import check_launch, full_norm
from rdepth.train.optim import lr_at, make_optimizer

# TrainConfig.state_noise -> the noise of ``count`` consecutive training rows from global row ``first``:
# (seed, first, count, compile) -> StateNoise or CounterNoise.
NOISE_SOURCES = {
    "sequence": lambda seed, first, count, compile: StateNoise.consecutive(seed, first, count),
    "counter": lambda seed, first, count, compile: CounterNoise.consecutive(seed, first, count, compile=compile),
}


class TrainStep:
    """The model, its optimizer and a sampler, ready for :meth:`train_step` once placed
    (:meth:`place_model`), compiled (:meth:`compile_layers`) and given a ``sampler``.

    Args:
        model_config: the model's config (a run's: the data's vocabulary and block size).
        config: the training settings (a trainer may end the schedule sooner by setting a new one).
        device: where the model trains, and
        dist: this process's place in the process group (default: one process), both from
            :func:`start_run`, which has checked the batch split.
    """

    def __init__(self, model_config: ModelConfig, config: TrainConfig, device: torch.device,
                 dist: DistInfo | None = None):
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dist = dist or DistInfo()
        self.fsdp = config.parallel == "fsdp"  # sharded model (rdepth.train.fsdp), DCP checkpoints
        self.fp8_plan = None  # what runs in float8 (rdepth.train.fp8.FP8Plan), set in place_model
        self.ddp = None  # the DistributedDataParallel wrapper, when the trainer runs several processes
        self.sampler: BatchSampler | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self._new_model()

    @classmethod
    def on_tokens(cls, model_config: ModelConfig, config: TrainConfig, tokens: np.ndarray | None = None,
                  windows: int = 4) -> TrainStep:
        """A complete step on ``tokens`` (a 1-D array of ids below the model's vocabulary size, e.g. a
        prepared folder's ``TokenShards.train``), or on ``windows`` batches' worth of uniformly random ids
        drawn once from ``config.seed``: the same model, placement, compilation and draws as a run, in
        one process, with no data or run folder (``config.data`` and ``config.out`` are not read). For
        speed measurements and tests: the same windows at every step for every setting of one seed."""
        device, dist = start_run(config)
        step = cls(model_config, config, device, dist)
        if tokens is None:
            count = windows * config.batch_size * (model_config.block_size + 1)
            ids = np.random.default_rng(config.seed).integers(0, model_config.vocab_size, size=count)
            tokens = ids.astype(token_dtype(model_config.vocab_size))
        elif len(tokens) and int(np.max(tokens)) >= model_config.vocab_size:
            raise RdepthError(f"token id {int(np.max(tokens))} is not below the model's vocabulary size "
                              f"{model_config.vocab_size}")
        step.place_model()
        step.sampler = BatchSampler(tokens, config.batch_size, model_config.block_size, config.seed)
        step.compile_layers()
        return step

    def _new_model(self) -> None:
        """The model with its initial weights (a function of the seed alone) and its optimizer."""
        check_fits_memory(self.model_config, "train", copies=4)
        torch.manual_seed(self.config.seed)
        self.model = RecurrentLM(self.model_config)
        self.optimizer = make_optimizer(self.model, self.config, self.device)
        # Set when a step's loss or gradient norm is not finite; read (one host sync) only at
        # log points and before validating or saving, so a diverged run never saves its weights.
        self.nonfinite = torch.zeros((), dtype=torch.bool)

    def place_model(self, resumed_from=None) -> None:
        """The model on the device (its shards, with --parallel fsdp); bf16 autocast there on CUDA; its
        layers' and adapters' matmuls in float8 with ``config.fp8`` (:mod:`rdepth.train.fp8`). With FSDP the
        weights and optimizer state of ``resumed_from`` (a checkpoint folder) load once sharded."""
        if self.fsdp:
            from rdepth.train import dcp
            from rdepth.train.fsdp import shard_model

            shard_model(self.model, self.device, self.config.mixed_precision, self.config.activation_checkpointing)
            self.optimizer = make_optimizer(self.model, self.config, self.device)  # over the sharded parameters
            if resumed_from is not None:
                dcp.load(resumed_from, self.model, self.optimizer)
        self.model.to(self.device)
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        if self.config.fp8:  # the same parameters, so the optimizer and checkpoints are unchanged
            self.fp8_plan = convert_to_fp8(self.model)

    def compile_layers(self) -> None:
        """``torch.compile`` each layer, or each loop step and the single-pass layers
        (``config.compile``, default on CUDA; ``config.compile_scope``, ``config.compile_mode``)."""
        config = self.config
        if self.compiled:
            options = {} if config.compile_mode == "default" else {"mode": config.compile_mode}
            if config.compile_scope == "step":
                compile_loop_steps(self.model, **options)
            looped = {layer for layers in self.model.group_layers for layer in layers}
            for index, layer in enumerate(self.model.layers):  # per block: loop counts vary, shapes do not
                if config.compile_scope == "layer" or index not in looped:
                    layer.compile(**options)

    @property
    def compiled(self) -> bool:
        """Whether this run compiles (``config.compile``, default on CUDA): the layers, the fused loss
        head's chunk arithmetic and the counter noise's draw (one fused kernel per group)."""
        return self.config.compile if self.config.compile is not None else self.device.type == "cuda"

    @property
    def loss_head(self) -> str:
        """The model's ``loss_head`` for training steps (``config.fused_loss``; compiled with the layers)."""
        if not self.config.fused_loss:
            return "logits"
        return "fused_compiled" if self.compiled else "fused"

    def _micro_batches(self, step: int):
        """This rank's micro-batches of the global batch at ``step``:
        (x, y, loop counts, initial-state noise). The noise of a row is keyed by its
        place in the global batch of ``step``, so ranks draw only their own rows and
        together reproduce the single-process run."""
        config, dist = self.config, self.dist
        x_all, y_all = (host_for_copy(batch, self.device) for batch in self.sampler.batch(step))
        micro = config.batch_size // config.grad_accum
        per_rank = micro // dist.world_size
        for index in range(config.grad_accum):
            lo = index * micro + dist.rank * per_rank
            counts = sample_loop_counts(self.model_config, step_generator(config.seed, step, 1 + index))
            noise = NOISE_SOURCES[config.state_noise](config.seed, step * config.batch_size + lo, per_rank,
                                                      self.compiled)
            yield (
                x_all[lo : lo + per_rank].to(self.device, non_blocking=True),
                y_all[lo : lo + per_rank].to(self.device, non_blocking=True),
                counts,
                noise,
            )

    def train_step(self, step: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """One optimizer step; returns the mean loss (a device tensor, no host sync)."""
        config = self.config
        model = self.ddp or self.model
        model.train()
        lr = lr_at(step, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        used_counts = []
        batches = list(self._micro_batches(step))
        for index, (x, y, counts, noise) in enumerate(batches):
            last = index == len(batches) - 1
            sync = self.ddp.no_sync() if (self.ddp is not None and not last) else contextlib.nullcontext()
            with sync, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_dtype is not None):
                out = model(x, y, counts, noise=noise, shifted_warm_start=config.warm_start,
                            loss_head=self.loss_head)
                loss = out.loss / config.grad_accum
            loss.backward()
            total += loss.detach()
            used_counts.append(counts)
        # The norm is always measured (max_norm inf: no clipping) for the divergence check.
        grad_norm = full_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                             config.grad_clip if config.grad_clip > 0 else math.inf))
        bad = ~(torch.isfinite(total) & torch.isfinite(grad_norm))
        self.nonfinite = self.nonfinite.to(bad.device) | bad  # on the device: no host sync
        self.last_grad_norm = grad_norm.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, used_counts


def start_run(config: TrainConfig, distributed: bool = False) -> tuple[torch.device, DistInfo]:
    """Where a run trains and its place in the process group, checked before any data is read (one call
    per run: :meth:`TrainStep.on_tokens`, the trainer). With ``config.fp8``, no float8 card or no torchao
    stops at once; ``config.threads`` sets torch's thread count. With ``distributed`` (the trainer), the
    process group from torchrun's environment (FSDP runs under torchrun only), each rank on its own
    card; without, one process. Last, the batch must split over accumulation and ranks."""
    device = resolve_device(config.device)
    if config.fp8:
        check_fp8_device(device)
        require_torchao()
    if config.threads:
        torch.set_num_threads(config.threads)
    dist = DistInfo()
    if distributed:
        check_launch(config.parallel)
        dist = init_distributed(device.type)
        if dist.enabled and device.type == "cuda":
            device = torch.device("cuda", dist.local_rank)
    check_batch_split(config, dist)
    return device, dist


def check_batch_split(config: TrainConfig, dist: DistInfo) -> None:
    per_step = config.grad_accum * dist.world_size
    if config.batch_size % per_step:
        raise RdepthError(
            f"batch_size {config.batch_size} is not divisible by grad_accum x world size = {per_step}"
        )


def host_for_copy(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` ready for ``.to(device, non_blocking=True)``: in pinned (page-locked) memory when
    ``device`` is CUDA, so the copy runs asynchronously from the host; unchanged otherwise (the
    copy is then synchronous whatever ``non_blocking`` says). Pinned buffers are kept alive by
    torch's host allocator until their copies complete."""
    if device.type != "cuda" or batch.is_pinned():
        return batch
    return batch.pin_memory()


def compile_loop_steps(model, **options) -> None:
    """One compiled region per loop step: ``model.loop_step`` (the adapter and the group's layers) through
    ``torch.compile(fullgraph=True, dynamic=False)``, set on the instance, so every driver of the dense
    loop calls it. Shapes do not change with the step or the loop count, so dynamo keeps three graphs per
    group (steps without gradients, the first step with them, the later ones) and one more per group in
    evaluation, and recompiles nothing when the drawn loop counts change (``options``: e.g. a
    ``backend``, for tests). The graphs of every group belong to one function, so dynamo's recompile
    limit (8 by default; with fullgraph=True an error past it) is raised to their number around each call:
    the ``paper`` preset's three groups need 9 in training (on the H200 at c9ab2bb the 9th failed and
    the trainer fell back to eager)."""
    compiled = torch.compile(model.loop_step, fullgraph=True, dynamic=False, **options)
    graphs = 4 * model.n_groups

    config = torch._dynamo.config

    @functools.wraps(compiled)
    def loop_step(*args, **kwargs):  # set and restored directly: config.patch costs ~50 us a call here, ~4 us
        previous = config.recompile_limit
        if previous < graphs:
            config.recompile_limit = graphs
        try:
            return compiled(*args, **kwargs)
        finally:
            config.recompile_limit = previous

    model.loop_step = loop_step
