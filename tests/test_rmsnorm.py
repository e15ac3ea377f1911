"""RMSNorm: one fused op when activations and weight share a dtype, float32 maths in every case."""

from __future__ import annotations

import pytest
import torch

from rdepth.model.layers import RMSNorm


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight computed in float64, rounded once to x's dtype."""
    wide = x.double()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return normed.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_model_norms_in_one_op_with_float32_maths(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x32 = torch.randn(4, 7, 96) * 3
    norm.to(dtype)
    out = norm(x32.to(dtype))
    assert out.dtype == dtype
    # the same numbers as normalising the low-precision input in float32 with the rounded weight
    wide = torch.nn.functional.rms_norm(x32.to(dtype).float(), (96,), norm.weight.float(), 1e-6).to(dtype)
    assert torch.equal(out, wide)
    # and within one rounding of the exact value (a norm computed in low precision would not be)
    exact = _reference(x32.to(dtype), norm.weight, 1e-6).float()
    assert (out.float() - exact).abs().max() <= exact.abs().max() * 2 ** -7


def test_mixed_precision_normalises_in_float32_and_returns_the_input_dtype():
    torch.manual_seed(1)
    norm = RMSNorm(64, 1e-6)  # float32 weights, bf16 activations (autocast)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(3, 64) * 2).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.nn.functional.rms_norm(x.float(), (64,), norm.weight, 1e-6).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_matches_the_formula(dtype):
    torch.manual_seed(2)
    norm = RMSNorm(32, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, dtype=dtype))
    x = torch.randn(5, 32, dtype=dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(norm(x), _reference(x, norm.weight, 1e-6), rtol=tolerance, atol=tolerance)
