"""The optimizer and its schedule: AdamW with weight decay on matrices, linear warm-up then cosine
decay, and the check that a saved optimizer state fits the model it is loaded into."""

from __future__ import annotations

import math

import torch

from rdepth.model import RecurrentLM
from rdepth.train.config import TrainConfig


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``max_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    min_lr = config.lr * config.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - min_lr)


def make_optimizer(model: RecurrentLM, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms); fused kernels on CUDA."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=device.type == "cuda"
    )


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every saved moment must have its parameter's shape (a mismatch would fail mid-step)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if name in ("exp_avg", "exp_avg_sq") and (not isinstance(value, torch.Tensor)
                                                          or value.shape != param.shape):
                    raise ValueError(f"{name} has the wrong shape")
