"""The head and the cross-entropy fused, a chunk of rows at a time: no ``[N, V]`` logits kept.

``lm_loss(model.readout(x), targets)`` makes the whole ``[B*T, V]`` logits (bf16 under autocast), keeps
them for the backward, and writes a gradient of the same size. :func:`readout_loss` computes the same
loss from the final hidden states: each chunk of ``chunk_rows`` rows makes its logits, takes their
log-sum-exp and target logit in fp32, and drops them; the backward makes each chunk's logits again and
turns ``softmax - onehot`` straight into the hidden states' and the head's gradients. Memory for the
head falls from ``N * V`` to ``chunk_rows * V`` elements, for one more head matmul in the backward.
Exact: the same loss and gradients as the unfused path up to summation order (tested in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of one chunk's logits (rows x vocabulary): 8M fp32 values, 32 MB.
FUSED_CHUNK_ELEMENTS = 1 << 23


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (-1 = ignore), in fp32 per chunk.

    Args:
        hidden: ``[N, d]`` final hidden states (after the final norm).
        weight: ``[V, d]`` the head (rows beyond the real vocabulary left out by the caller).
        targets: ``[N]`` long, -1 where nothing is scored.
        chunk_rows: rows per chunk (default: :data:`FUSED_CHUNK_ELEMENTS` / V).
    """
    rows = chunk_rows or max(1, FUSED_CHUNK_ELEMENTS // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, rows)


def readout_loss(model, x: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """``lm_loss(model.readout(x), targets)`` without the logits: the final norm, then the tied head over
    the real vocabulary fused with the cross-entropy. ``x`` ``[B, T, d]``, ``targets`` ``[B, T]``."""
    hidden = model.norm_f(x).reshape(-1, x.shape[-1])
    weight = model.wte.weight[: model.config.vocab_size]
    return linear_cross_entropy(hidden, weight, targets.reshape(-1), chunk_rows)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows):
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        compute = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        valid = targets != -1
        picked_index = targets.clamp_min(0).unsqueeze(1)  # (N, 1)
        log_norm = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            wide = F.linear(hidden[part].to(compute), weight.to(compute)).to(dtype)  # (chunk, V)
            log_norm[part] = torch.logsumexp(wide, dim=-1)
            picked = wide.gather(1, picked_index[part]).squeeze(1)
            total += ((log_norm[part] - picked) * valid[part]).sum()
        count = valid.sum()
        ctx.save_for_backward(hidden, weight, picked_index, valid, log_norm, count)
        ctx.chunk_rows, ctx.compute = chunk_rows, compute
        return total / count  # NaN when every target is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, picked_index, valid, log_norm, count = ctx.saved_tensors
        compute = ctx.compute
        low_weight = weight.to(compute)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=log_norm.dtype, device=weight.device)
        scale = grad_output.to(log_norm.dtype) / count
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            part = slice(start, start + ctx.chunk_rows)
            rows = hidden[part].to(compute)
            wide = F.linear(rows, low_weight).to(log_norm.dtype)
            grad = torch.exp(wide - log_norm[part, None])  # softmax (chunk, V)
            grad.scatter_add_(1, picked_index[part], torch.full_like(log_norm[part, None], -1.0))
            grad *= valid[part, None] * scale
            low = grad.to(compute)
            grad_hidden[part] = (low @ low_weight).to(hidden.dtype)
            grad_weight += (low.t() @ rows).to(grad_weight.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), None, None
