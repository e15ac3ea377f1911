"""Device selection and naming, shared by every command that runs a model."""

from __future__ import annotations

import torch

from rdepth.errors import RdepthError


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when present, else CPU), ``cpu`` or ``cuda[:N]``; a one-line error otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise RdepthError(f"unknown device {name!r} (use auto, cpu or cuda[:N])") from None
    if device.type not in ("cpu", "cuda"):
        raise RdepthError(f"unsupported device {name!r} (use auto, cpu or cuda[:N])")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RdepthError(f"device {name!r} requested but no CUDA device is available")
    return device


def device_name(device: torch.device) -> str:
    """A readable name for result files: the GPU model, or the CPU and its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''})"
