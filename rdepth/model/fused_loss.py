"""The one chunked cross-entropy: of low-precision logits, or fused with the head; fp32 a chunk at a time.

Both run :func:`_chunk_loss` over chunks of rows and make the gradients in the forward, so the backward
only scales them. :func:`logits_cross_entropy` scores given ``[N, V]`` logits (bf16 under autocast:
:func:`rdepth.model.recurrent.lm_loss`) without an fp32 copy of them. The head fused with the loss:

``lm_loss(model.readout(x), targets)`` makes the whole ``[B*T, V]`` logits (bf16 under autocast), keeps
them for the backward, and writes a gradient of the same size. :func:`readout_loss` computes the same
loss from the final hidden states, and its gradients in the same pass: each chunk of ``chunk_rows`` rows
makes its logits, takes their log-sum-exp and target logit in fp32, turns ``softmax - onehot`` (scaled by
1 / the scored rows) straight into that chunk's hidden-state gradient and adds its share of the head's,
and drops the logits. The backward only scales the two kept gradients by the incoming one. So the head
costs the three matmuls of the unfused path (logits, and the two gradients) and no recomputation, and
its memory falls from ``N * V`` to ``chunk_rows * V`` elements. Where no input needs a gradient
(evaluation) only the loss is computed.

Exact: the same loss and gradients as the unfused path up to summation order (tested in float64).
``compiled=True`` (the trainer on CUDA) runs each chunk's softmax arithmetic as one Inductor graph:
the log-sum-exp, the target logit and the scaled ``softmax - onehot`` in a few fused kernels instead
of a dozen elementwise passes over the chunk's logits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Elements of one chunk's logits (rows x vocabulary): 2^26, e.g. 1,335 rows of a 50,257-token vocabulary
# (134 MB of bf16 logits, and the fp32 softmax of the same size where the arithmetic is not compiled).
FUSED_CHUNK_ELEMENTS = 1 << 26


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_rows: int | None = None, compiled: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (-1 = ignore), in fp32 per chunk.

    Args:
        hidden: ``[N, d]`` final hidden states (after the final norm).
        weight: ``[V, d]`` the head (rows beyond the real vocabulary left out by the caller).
        targets: ``[N]`` long, -1 where nothing is scored.
        chunk_rows: rows per chunk (default: :data:`FUSED_CHUNK_ELEMENTS` / V).
        compiled: each chunk's softmax arithmetic through ``torch.compile`` (one graph per chunk shape).
    """
    rows = chunk_rows or max(1, FUSED_CHUNK_ELEMENTS // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, rows, compiled)


def readout_loss(model, x: torch.Tensor, targets: torch.Tensor, chunk_rows: int | None = None,
                 compiled: bool = False) -> torch.Tensor:
    """``lm_loss(model.readout(x), targets)`` without the logits: the final norm, then the tied head over
    the real vocabulary fused with the cross-entropy. ``x`` ``[B, T, d]``, ``targets`` ``[B, T]``."""
    hidden = model.final_hidden(x).reshape(-1, x.shape[-1])
    weight = model.head_weight[: model.config.vocab_size]
    return linear_cross_entropy(hidden, weight, targets.reshape(-1), chunk_rows, compiled)


def _chunk_loss(wide: torch.Tensor, picked: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor,
                want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: the summed loss of its scored rows (fp32, or fp64 for fp64 logits) and, with
    ``want_grad``, ``(softmax - onehot(picked)) * valid * scale`` in the logits' dtype.

    ``wide`` ``[R, V]`` logits, ``picked`` ``[R]`` target ids (ignored rows clamped to 0), ``valid``
    ``[R]`` bool, ``scale`` a 0-d tensor (1 / the scored rows of the whole batch)."""
    logits = wide.to(torch.promote_types(wide.dtype, torch.float32))
    log_norm = torch.logsumexp(logits, dim=-1)  # (R,)
    target = logits.gather(1, picked.unsqueeze(1)).squeeze(1)
    loss = ((log_norm - target) * valid).sum()
    if not want_grad:
        return loss, None
    grad = torch.exp(logits - log_norm.unsqueeze(1))  # softmax
    grad = grad.scatter_add(1, picked.unsqueeze(1), torch.full_like(log_norm.unsqueeze(1), -1.0))
    grad = grad * (valid.to(grad.dtype) * scale).unsqueeze(1)
    return loss, grad.to(wide.dtype)


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[N, V]`` against ``targets`` ``[N]`` (-1 = ignore), in fp32 (fp64
    for fp64 logits) ``chunk_rows`` rows at a time; the gradient, in the logits' dtype, is made in the
    forward when the logits need one (no fp32 ``[N, V]`` tensor is kept). NaN when nothing is scored,
    as ``F.cross_entropy``."""
    return _LogitsCrossEntropy.apply(logits, targets, chunk_rows)


class _LogitsCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, chunk_rows):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        want_grad = ctx.needs_input_grad[0]
        valid, picked = targets != -1, targets.clamp_min(0)
        scale = 1.0 / valid.sum().to(dtype)
        total = torch.zeros((), dtype=dtype, device=logits.device)
        grad_logits = torch.empty_like(logits) if want_grad else None
        for start in range(0, logits.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            loss, grad = _chunk_loss(logits[part], picked[part], valid[part], scale, want_grad)
            total += loss.to(dtype)
            if want_grad:
                grad_logits[part] = grad
        ctx.save_for_backward(grad_logits)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        (grad_logits,) = ctx.saved_tensors
        return grad_logits * grad_output.to(grad_logits.dtype), None, None


@functools.cache
def _compiled_chunk_loss():
    return torch.compile(_chunk_loss, dynamic=False, fullgraph=True)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, compiled):
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        compute = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_grad = need_hidden or need_weight
        chunk_loss = _compiled_chunk_loss() if compiled else _chunk_loss
        valid = targets != -1
        picked_all = targets.clamp_min(0)
        count = valid.sum()
        scale = 1.0 / count.to(dtype)  # inf when nothing is scored: the loss is NaN then, as F.cross_entropy
        low_weight = weight.to(compute)  # once, not per chunk
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            rows = hidden[part].to(compute)
            wide = F.linear(rows, low_weight)  # (chunk, V), the compute dtype
            loss, grad = chunk_loss(wide, picked_all[part], valid[part], scale, want_grad)
            total += loss.to(dtype)
            if need_hidden:
                grad_hidden[part] = (grad @ low_weight).to(hidden.dtype)
            if need_weight:
                grad_weight += (grad.t() @ rows).to(dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output.to(grad_weight.dtype)).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None
