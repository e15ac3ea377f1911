"""The fused head + cross-entropy (rdepth.model.fused_loss) equals the cross-entropy of model.readout(x) in
float64 (lm_loss itself scores in fp32: equal to fp32 rounding in float32):
the loss and the gradients of the hidden states, the final norm and the tied head, over chunk sizes that
split the rows unevenly, with ignored targets; under bf16 autocast it stays within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from rdepth.model.fused_loss import linear_cross_entropy, readout_loss
from rdepth.model.recurrent import lm_loss


def case(dtype=torch.float64):
    model = tiny_model().to(dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, model.config.d_model, dtype=dtype, generator=generator).requires_grad_()
    targets = torch.randint(0, model.config.vocab_size, (3, 7), generator=generator)
    targets[0, :3] = -1
    targets[2, 6] = -1
    return model, x, targets


def unfused(model, x, targets):
    """The unfused loss in the inputs' dtype (float64 here): the whole logits, then cross-entropy."""
    logits = model.readout(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


def gradients(model, x, loss):
    parameters = [x, model.norm_f.weight, model.wte.weight]
    return torch.autograd.grad(loss, parameters)


@pytest.mark.parametrize("chunk_rows", [1, 5, 21, None])
def test_fused_equals_unfused_in_float64(chunk_rows):
    model, x, targets = case()
    expected = unfused(model, x, targets)
    fused = readout_loss(model, x, targets, chunk_rows)
    assert fused.dtype == torch.float64
    torch.testing.assert_close(fused, expected, rtol=0, atol=1e-13)
    for got, want in zip(gradients(model, x, fused), gradients(model, x, unfused(model, x, targets)), strict=False):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_fused_equals_lm_loss_in_float32():
    model, x, targets = case(torch.float32)
    fused, current = readout_loss(model, x, targets, 5), lm_loss(model.readout(x), targets)
    torch.testing.assert_close(fused, current, rtol=1e-6, atol=1e-6)
    for got, want in zip(gradients(model, x, fused), gradients(model, x, lm_loss(model.readout(x), targets)), strict=False):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_every_target_ignored_is_nan_as_cross_entropy():
    hidden, weight = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    assert torch.isnan(linear_cross_entropy(hidden, weight, torch.full((4,), -1)))


def test_bf16_autocast_stays_within_bf16_rounding():
    model, x, targets = case(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = readout_loss(model, x, targets, 4)
        unfused = lm_loss(model.readout(x), targets)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, unfused.float(), rtol=2e-2, atol=2e-2)
    grad_fused = torch.autograd.grad(fused, x)[0]
    grad_unfused = torch.autograd.grad(unfused, x)[0]
    torch.testing.assert_close(grad_fused, grad_unfused, rtol=5e-2, atol=5e-3)


def test_the_incoming_gradient_scales_the_kept_gradients():
    """The gradients are made in the forward; the backward scales them by the incoming gradient (a loss
    divided by gradient-accumulation steps, or weighted): exact in float64 against the unfused path."""
    model, x, targets = case()
    fused = 0.25 * readout_loss(model, x, targets, 4)
    expected = 0.25 * unfused(model, x, targets)
    for got, want in zip(gradients(model, x, fused), gradients(model, x, expected), strict=False):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_without_gradients_only_the_loss_is_made():
    model, x, targets = case()
    with torch.no_grad():
        loss = readout_loss(model, x, targets, 4)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, unfused(model, x, targets).detach(), rtol=0, atol=1e-13)


def test_the_model_forward_with_the_fused_head_equals_the_logits_head():
    """RecurrentLM.forward(loss_head="fused") (the trainer's fused_loss): no logits, the same loss and
    the same gradient for every parameter as the logits head through the looped groups (the model in
    float64; the logits head scores in fp32, so equal to fp32 rounding)."""
    model = tiny_model().double().train()
    idx = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    targets = idx.clone()
    targets[0, :2] = -1
    results = []
    for head in ("logits", "fused"):
        model.zero_grad()
        out = model(idx, targets, (3, 2), noise=torch.Generator().manual_seed(5), loss_head=head)
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in model.parameters()]))
    (logits_out, logits_grads), (fused_out, fused_grads) = results
    assert fused_out.logits is None and logits_out.logits is not None
    assert fused_out.loss.dtype == torch.float64
    torch.testing.assert_close(fused_out.loss.float(), logits_out.loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(fused_grads, logits_grads, strict=False):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss_head must be one of"):
        model(idx, targets, (1, 1), loss_head="fast")


@pytest.mark.slow
def test_the_compiled_chunk_arithmetic_equals_the_eager_one():
    """``compiled=True`` (the trainer on CUDA): each chunk's softmax arithmetic through Inductor (C++ on a
    CPU) gives the eager loss and gradients to float32 rounding, over an uneven last chunk."""
    model, x, targets = case(torch.float32)
    eager = readout_loss(model, x, targets, 8)
    compiled = readout_loss(model, x, targets, 8, compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    for got, want in zip(gradients(model, x, compiled), gradients(model, x, eager), strict=False):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_training_head_on_cuda_stays_within_bf16_rounding_of_the_unfused_one():
    """What train_step runs with fused_loss on a card (bf16 autocast, the chunk arithmetic compiled by
    Inductor into Triton kernels), at a real vocabulary and several chunks: the unfused loss and input
    gradients to bf16 rounding."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3000, 256, generator=generator).cuda().requires_grad_()
    weight = (0.05 * torch.randn(50257, 256, generator=generator)).cuda().requires_grad_()
    targets = torch.randint(0, 50257, (3000,), generator=generator).cuda()
    targets[:100] = -1
    results = []
    for fused in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(hidden, weight, targets, 1024, compiled=True) if fused \
                else lm_loss(F.linear(hidden, weight), targets)
        results.append((loss.float(), *torch.autograd.grad(loss, (hidden, weight))))
    (loss_u, grad_h_u, grad_w_u), (loss_f, grad_h_f, grad_w_f) = results
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-3, atol=1e-3)
    for got, want in ((grad_h_f, grad_h_u), (grad_w_f, grad_w_u)):  # bf16 rounding: ~0.4% per element
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
