"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for ``rdepth train``.

``torchrun --nproc-per-node N -m rdepth train --parallel fsdp ...`` shards every
transformer layer on its own (one all-gather per layer call) and the rest (the
embeddings, the tied head, the loop adapters, the final norm) in the root unit.
Parameters, gradients and AdamW's moments then live 1/N per rank.

A looped layer is one module that the forward applies many times: it is sharded
once, each application all-gathers its weights and, under backward, every
application's gradient is reduce-scattered and added into the same sharded
gradient (checked against one process in tests/test_fsdp.py). The head is
``wte`` itself (``readout`` multiplies by ``wte.weight``), so the tie needs no
care: both uses are in the root unit and see one parameter.

The model is built whole on the host (the same seeded initial weights as one
process), sharded there, and only the shards move to the device.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError

log = logging.getLogger(__name__)

PARALLEL_MODES = ("ddp", "fsdp")  # TrainConfig.parallel
MIXED_PRECISION = ("none", "bf16")  # TrainConfig.mixed_precision


def check_launch(parallel: str) -> None:
    """FSDP runs under torchrun only (it sets RANK and WORLD_SIZE): a one-line error otherwise."""
    if parallel == "fsdp" and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        raise RdepthError("--parallel fsdp shards the model over the processes torchrun starts: launch with "
                          "torchrun --nproc-per-node N -m rdepth train --parallel fsdp ... (RANK and WORLD_SIZE "
                          "are not set)")


def join_process_group(device: torch.device) -> None:
    """FSDP needs a process group even at world size 1 (torchrun --nproc-per-node 1)."""
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def mixed_precision_policy(name: str):
    """``none``: parameters and gradient reductions in the training dtype; ``bf16``: layers compute
    with bfloat16 copies of the gathered parameters, gradients reduced in float32 (the sharded
    parameters and AdamW's moments stay float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name == "none":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, device: torch.device, mixed_precision: str = "none",
                activation_checkpointing: bool = False) -> torch.nn.Module:
    """Shard ``model`` (a :class:`rdepth.model.RecurrentLM`) in place: each layer one FSDP unit, the
    root the rest; ``activation_checkpointing`` recomputes each layer's activations in backward
    (per application of a looped layer). Returns the model, now on ``device`` in shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    quiet_view_warning()
    join_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision_policy(mixed_precision)
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for layer in model.layers:
            checkpoint(layer)
    for layer in model.layers:  # a looped layer is one module: one unit, however often it is applied
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to(device)
    return model


def full_norm(value: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor (clipping sharded gradients returns a DTensor)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def quiet_view_warning() -> None:
    """The root unit returns logits sliced to the real vocabulary (a view); nothing in rdepth
    writes into them in place, so FSDP2's warning about in-place ops on views is noise."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


# ----------------------------------------------------------------- memory
@dataclass
class MemoryEstimate:
    """Bytes per rank of the training state at ``gpus`` ranks: parameters, gradients and AdamW's
    two moments (``bytes_per_value`` each; 4 for float32). ``ddp``: every rank holds all of it.
    ``fsdp_state``: what a rank keeps between steps, 1/N of it. ``fsdp_peak``: that plus the
    largest unit gathered whole in a step (its parameters and, in backward, its full gradient
    before the reduce-scatter); the largest unit is the root (the tied embedding, position
    embedding, adapters and final norm), which stays gathered through the forward and backward."""

    parameters: int
    largest_unit: int
    gpus: int
    ddp: int
    fsdp_state: int
    fsdp_peak: int


def parameter_counts(model_config: ModelConfig) -> tuple[int, int]:
    """(all parameters, the largest FSDP unit's) of the model, counted on the meta device."""
    from rdepth.model import RecurrentLM

    with torch.device("meta"):
        model = RecurrentLM(model_config)
    total = sum(p.numel() for p in model.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    root = total - sum(layers)
    return total, max(max(layers), root)


def estimate_memory(model_config: ModelConfig, gpus: int, bytes_per_value: int = 4) -> MemoryEstimate:
    """Per-rank training-state bytes at ``gpus`` ranks, DDP (replicated) against FSDP (sharded).
    Activations are left out: at a fixed per-rank batch they are the same either way (less with
    activation checkpointing)."""
    total, largest = parameter_counts(model_config)
    state = 4 * bytes_per_value  # weights, gradients, exp_avg, exp_avg_sq
    sharded = -(-state * total // gpus)
    gathered = 2 * bytes_per_value * largest if gpus > 1 else 0
    return MemoryEstimate(total, largest, gpus, state * total, sharded, sharded + gathered)


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the parameters, gradients and optimizer state (the local shards
    of sharded tensors, the whole tensor otherwise): the measured side of :func:`estimate_memory`."""
    from torch.distributed.tensor import DTensor

    def local(tensor: torch.Tensor) -> int:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        return tensor.numel() * tensor.element_size()

    params = list(model.parameters())
    moments = [value for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor) and value.dim() > 0]
    return {"parameters": sum(local(p) for p in params),
            "gradients": sum(local(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local(m) for m in moments)}
