"""Will a training step fit? A rough estimate of one micro-step's memory against the device's, checked
before any work, so a size off by orders of magnitude is a one-line error, not an allocator crash."""

from __future__ import annotations

import os

import torch

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError


def estimate_step_bytes(model_config: ModelConfig, rows: int) -> int:
    """A rough upper estimate of one micro-step's memory, in bytes: weights with AdamW state
    (4 copies), activations kept for backward (~16 floats per token, width unit and unrolled
    layer), and the logits with their gradient. Only meant to refuse sizes off by orders of magnitude."""
    tokens = rows * model_config.block_size
    looped = sum(len(g.layers) for g in model_config.group_specs)
    unrolled = model_config.n_layer - looped + looped * model_config.backprop_depth
    width = model_config.d_model
    weights = 12 * width * width * model_config.n_layer + model_config.padded_vocab_size * width
    return 4 * (4 * weights + 16 * tokens * width * unrolled + 2 * tokens * model_config.padded_vocab_size)


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (the GPU's, or the machine's RAM for the CPU); None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def check_fits(model_config: ModelConfig, rows: int, device: torch.device, what: str) -> None:
    """A one-line error before any work when ``rows`` windows per step cannot fit ``device``."""
    need, have = estimate_step_bytes(model_config, rows), device_memory_bytes(device)
    if have is not None and need > have:
        raise RdepthError(f"{what} of {rows} windows of {model_config.block_size} tokens needs about "
                          f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB of {device}: "
                          "lower --batch-size (or raise --grad-accum) or the model's sizes")
