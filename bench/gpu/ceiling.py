"""Section ``ceiling``: the card's measured bf16 matrix rate and copy bandwidth (CUDA only)."""

from __future__ import annotations

from bench.gpu.common import CUDA_ONLY, stats


def ceiling_section(args, device, deadline, context) -> dict:
    """The card's measured bf16 matrix rate and copy bandwidth (the roofline's two numbers)."""
    if device.type != "cuda":
        return {"status": CUDA_ONLY}
    import torch

    from bench.decode_speed import _timed

    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)  # random, never zeros (METHOD.md)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = [_timed(lambda: a @ b, device) for _ in range(10)]
    matmul = stats([2 * size**3 / (t / 1000) / 1e12 for t in times])
    source = torch.randn(2**28, device=device, dtype=torch.bfloat16)  # 512 MiB
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = [_timed(lambda: target.copy_(source), device) for _ in range(10)]
    copy = stats([2 * source.numel() * 2 / (t / 1000) / 1e9 for t in times])
    context["measured_peak_tflops"] = matmul["median"]
    return {"status": "ok", "bf16_matmul_tflops": matmul, "matmul_size": size,
            "copy_gb_per_s": copy, "copy_note": "bytes read plus bytes written"}

