"""Fit a Raptor surrogate to its teacher's layer states.

Loss at depth d: mean squared error between the surrogate's and the teacher's state over
real tokens (the first token weighted by ``first_token_weight``), divided by the teacher's
mean squared entry at that depth, so every depth counts alike; averaged over depths.

Two stages:

1. block by block: block p alone, started from the teacher's state at its phase start,
   fitted to the states of its phase;
2. jointly: all blocks, rolled out from the embedding through all L depths.

Teacher forcing (``FitConfig.forcing``; :func:`stage_loss`), with a forcing value annealed
linearly from ``force_start`` to ``force_end`` over the first ``anneal_fraction`` of a
stage's steps, then held (:func:`force_probability`):

* ``"anneal"`` (default): in both stages, each block input is, per sequence, the teacher's
  state with that probability, else the surrogate's own (scheduled sampling); one loss.
* ``"mixed"``: the reference code's scheme (KempnerInstitute/raptor ``raptor/trainer.py``,
  ``--teacher_force`` for the per-block runs, ``--autoreg`` for the joint ones): stage 1 loss
  = r * one-step loss (every input the teacher's state) + (1 - r) * free-rollout loss, with r
  the annealed value; stage 2 is free rollout only.

``input_noise`` adds Gaussian noise to every block input in either scheme (the reference's
``sigma``).
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


def stage_force(step: int, total: int, config: FitConfig, joint: bool) -> float:
    """The forcing value of a step: annealed per stage, except "mixed"'s joint stage (always 0)."""
    if joint and config.forcing == "mixed":
        return 0.0
    return force_probability(step, total, config)


def stage_loss(surrogate: RaptorSurrogate, teacher_states: list[torch.Tensor], mask: torch.Tensor, start: int,
               stop: int, scale: torch.Tensor, config: FitConfig, force: float) -> torch.Tensor:
    """The fitting loss of depths [start, stop) on one batch under ``config.forcing`` at forcing ``force``.

    "anneal": the loss of one rollout whose inputs are the teacher's with probability ``force``.
    "mixed": ``force`` x the one-step loss + (1 - ``force``) x the free-rollout loss (a term
    whose weight is 0 is not computed). ``teacher_states``: the L+1 states (B, T, D).
    """
    target = teacher_states[start + 1: stop + 1]

    def loss_of(force_prob: float) -> torch.Tensor:
        outputs = surrogate.rollout(teacher_states[start], mask, start=start, stop=stop,
                                    teacher_states=teacher_states, force_prob=force_prob,
                                    input_noise=config.input_noise)
        return state_loss(outputs, target, mask, scale[start + 1: stop + 1], config.first_token_weight)

    if config.forcing == "anneal":
        return loss_of(force)
    loss = loss_of(1.0) * force if force > 0.0 else None
    if force < 1.0:
        free = loss_of(0.0) * (1.0 - force)
        loss = free if loss is None else loss + free
    return loss


def state_loss(predicted: list[torch.Tensor], target: list[torch.Tensor], mask: torch.Tensor,
               scale: torch.Tensor, first_token_weight: float) -> torch.Tensor:
    """Scaled masked MSE averaged over depths. predicted/target: lists of (B, T, D); scale: (len,)."""
    weights = mask.float()
    if first_token_weight != 1.0:
        weights = weights.clone()
        weights[:, 0] *= first_token_weight
    weights = weights / weights.sum()
    total = predicted[0].new_zeros(())
    for depth, (pred, true) in enumerate(zip(predicted, target, strict=False)):
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
               generator: torch.Generator, metrics_path: Path | None, joint: bool = False) -> float:
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
        force = stage_force(step, steps, config, joint)
        loss = stage_loss(surrogate, batch.state_list(), batch.mask, start, stop, scale, config, force)
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
                                            "forcing": config.forcing, "lr": scheduler.get_last_lr()[0],
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
    summary = {"tag": tag, "lengths": list(surrogate.config.lengths), "forcing": config.forcing}
    for p, (start, length) in enumerate(zip(surrogate.phase_start, surrogate.config.lengths, strict=False)):
        params = [*surrogate.blocks[p].parameters(), surrogate.iteration]
        summary[f"block{p}_loss"] = _run_stage(surrogate, bank, params, config.steps_block, start, start + length,
                                               scale, config, f"{tag}/block{p}", generator, metrics_path)
    summary["joint_loss"] = _run_stage(surrogate, bank, surrogate.trainable_parameters(), config.steps_joint, 0,
                                       surrogate.n_layers, scale, config, f"{tag}/joint", generator, metrics_path,
                                       joint=True)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    log.info("fitted %s %s in %.0f s (joint loss %.4f)", tag, surrogate.config.lengths, summary["seconds"],
             summary["joint_loss"])
    return summary
