"""Fit a Raptor surrogate to its teacher's layer states.

Loss at depth d: mean squared error between the surrogate's and the teacher's state over
real tokens (the first token weighted by ``first_token_weight``), divided by the teacher's
mean squared entry at that depth, so every depth counts alike; averaged over depths.

Two stages, each with teacher forcing annealed linearly from ``force_start`` to
``force_end`` over the first ``anneal_fraction`` of its steps, then held (free rollout when
``force_end`` = 0):

1. block by block: block p alone, started from the teacher's state at its phase start,
   fitted to the states of its phase;
2. jointly: all blocks, rolled out from the embedding through all L depths.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from rdepth.errors import RdepthError
from rdepth.io import append_jsonl
from rdepth.surrogate.bank import BankBatch, StateBank
from rdepth.surrogate.config import FitConfig
from rdepth.surrogate.model import RaptorSurrogate

log = logging.getLogger(__name__)


def force_probability(step: int, total: int, config: FitConfig) -> float:
    """Teacher-forcing probability at ``step`` of ``total``: linear anneal, then constant."""
    anneal_steps = config.anneal_fraction * total
    if anneal_steps <= 0 or step >= anneal_steps:
        return config.force_end
    return config.force_start + (config.force_end - config.force_start) * step / anneal_steps


def state_loss(predicted: list[torch.Tensor], target: list[torch.Tensor], mask: torch.Tensor,
               scale: torch.Tensor, first_token_weight: float) -> torch.Tensor:
    """Scaled masked MSE averaged over depths. predicted/target: lists of (B, T, D); scale: (len,)."""
    weights = mask.float()
    if first_token_weight != 1.0:
        weights = weights.clone()
        weights[:, 0] *= first_token_weight
    weights = weights / weights.sum()
    total = predicted[0].new_zeros(())
    for depth, (pred, true) in enumerate(zip(predicted, target)):
        error = (pred - true).square().mean(-1)  # (B, T)
        total = total + (error * weights).sum() / scale[depth]
    return total / len(predicted)


def _lr_factor(step: int, total: int) -> float:
    """Short linear warm-up, then cosine decay to 10%."""
    warmup = min(20, max(1, total // 10))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def _run_stage(surrogate: RaptorSurrogate, bank: StateBank, params: list[torch.nn.Parameter], steps: int,
               start: int, stop: int, scale: torch.Tensor, config: FitConfig, stage: str,
               generator: torch.Generator, metrics_path: Path | None) -> float:
    """Optimise ``params`` on depths [start, stop); returns the last logged loss."""
    if steps == 0:
        return float("nan")
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    surrogate.train()
    running, last = 0.0, float("nan")
    bar = tqdm(range(steps), desc=stage, leave=False)
    started = time.perf_counter()
    for step in bar:
        batch: BankBatch = bank.batches[int(torch.randint(len(bank), (1,), generator=generator))]
        teacher_states = batch.state_list()
        force = force_probability(step, steps, config)
        outputs = surrogate.rollout(teacher_states[start], batch.mask, start=start, stop=stop,
                                    teacher_states=teacher_states, force_prob=force)
        loss = state_loss(outputs, teacher_states[start + 1: stop + 1], batch.mask, scale[start + 1: stop + 1],
                          config.first_token_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        optimizer.step()
        scheduler.step()
        running += loss.detach()
        if (step + 1) % config.log_every == 0 or step + 1 == steps:
            count = (step % config.log_every) + 1
            last = float(running) / count
            running = 0.0
            bar.set_postfix(loss=f"{last:.4f}", force=f"{force:.2f}")
            if metrics_path is not None:
                append_jsonl(metrics_path, {"stage": stage, "step": step + 1, "loss": last, "force_prob": force,
                                            "lr": scheduler.get_last_lr()[0],
                                            "seconds": round(time.perf_counter() - started, 2)})
    surrogate.eval()
    return last


def fit_surrogate(surrogate: RaptorSurrogate, bank: StateBank, config: FitConfig,
                  metrics_path: Path | None = None, tag: str = "raptor") -> dict:
    """Fit in place (stage 1 per block, then stage 2 jointly); returns a summary dict."""
    if len(bank) == 0:
        raise RdepthError("fit: no training batches")
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    scale = bank.depth_scale().clamp_min(1e-12)
    started = time.perf_counter()
    summary = {"tag": tag, "lengths": list(surrogate.config.lengths)}
    for p, (start, length) in enumerate(zip(surrogate.phase_start, surrogate.config.lengths)):
        params = [*surrogate.blocks[p].parameters(), surrogate.iteration]
        summary[f"block{p}_loss"] = _run_stage(surrogate, bank, params, config.steps_block, start, start + length,
                                               scale, config, f"{tag}/block{p}", generator, metrics_path)
    summary["joint_loss"] = _run_stage(surrogate, bank, surrogate.trainable_parameters(), config.steps_joint, 0,
                                       surrogate.n_layers, scale, config, f"{tag}/joint", generator, metrics_path)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    log.info("fitted %s %s in %.0f s (joint loss %.4f)", tag, surrogate.config.lengths, summary["seconds"],
             summary["joint_loss"])
    return summary
