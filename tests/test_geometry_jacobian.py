"""The own-state Jacobian spectrum: planted linear maps with known eigenvalues, and the model's loop step."""

from __future__ import annotations

import math

import pytest
import torch

from rdepth.config import get_preset
from rdepth.geometry.jacobian import eigen_rows, group_fixed_points, leading_eigenvalues, own_state_jacobian, spectra
from rdepth.model import RecurrentLM
from rdepth.model.noise import StateNoise


def _planted(d: int = 6) -> tuple[torch.Tensor, list[complex]]:
    """A map with eigenvalues 0.8 e^{+-i 70 deg}, -0.6, 0.3, 0.2, 0.1, hidden by a change of basis."""
    block = torch.zeros(d, d, dtype=torch.float64)
    angle = math.radians(70.0)
    block[:2, :2] = 0.8 * torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=torch.float64)
    block[2, 2], block[3, 3], block[4, 4], block[5, 5] = -0.6, 0.3, 0.2, 0.1
    basis = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))[0]
    basis = basis + 0.3 * torch.eye(d, dtype=torch.float64)  # not orthogonal: eigenvalues survive, singular values do not
    matrix = basis @ block @ torch.linalg.inv(basis)
    expected = [0.8 * complex(math.cos(angle), -math.sin(angle)), 0.8 * complex(math.cos(angle), math.sin(angle)),
                -0.6, 0.3, 0.2, 0.1]
    return matrix, expected


def test_planted_linear_map_gives_its_eigenvalues():
    matrix, expected = _planted()
    other = torch.randn(4, 6, dtype=torch.float64)

    def step(states):  # each position: A s_t + (mean of the earlier positions), so others matter but not own
        mixed = states.cumsum(0) - states
        return states @ matrix.T + 0.5 * mixed

    jacobian = own_state_jacobian(step, torch.cat([other, torch.randn(1, 6, dtype=torch.float64)]))
    torch.testing.assert_close(jacobian, matrix)
    values = leading_eigenvalues(jacobian, 6)
    for got, want in zip(values.tolist(), expected, strict=False):
        assert abs(got - want) < 1e-10
    rows = eigen_rows(values)
    assert rows[0]["modulus"] == pytest.approx(0.8) and rows[0]["angle_deg"] == pytest.approx(-70.0)
    assert rows[1]["angle_deg"] == pytest.approx(70.0)
    assert rows[2]["modulus"] == pytest.approx(0.6) and rows[2]["angle_deg"] == pytest.approx(180.0)


def test_residual_identity_map_has_unit_eigenvalues():
    """A step s -> s + c (a residual update that does not depend on s) has Jacobian I: every eigenvalue 1 at 0 deg."""
    constant = torch.randn(3, 5, dtype=torch.float64)
    jacobian = own_state_jacobian(lambda s: s + constant, torch.randn(3, 5, dtype=torch.float64))
    torch.testing.assert_close(jacobian, torch.eye(5, dtype=torch.float64))
    assert all(row["modulus"] == pytest.approx(1.0) and row["angle_deg"] == 0.0
               for row in eigen_rows(leading_eigenvalues(jacobian, 5)))


@pytest.mark.parametrize("loop_state", ["sandwich", "residual"])
def test_model_spectrum_matches_finite_differences(loop_state):
    """The model's own-state Jacobian (jacrev through loop_step) against central differences in float64,
    and group_fixed_points' states against the forward's hand-off."""
    config = get_preset("tiny", n_layer=4, n_head=2, d_model=16, block_size=12, vocab_size=50, groups="1|2",
                        mean_loops=3.0, loop_state=loop_state)
    torch.manual_seed(0)
    model = RecurrentLM(config).double().eval()
    idx = torch.randint(0, 50, (2, 10))
    finals, inputs = group_fixed_points(model, idx, 5, StateNoise.consecutive(0, 0, 2))
    with torch.no_grad():  # the last group's state is what the coda reads: the readout of it equals forward's
        x = model.run_layers((3,), finals[1])
        torch.testing.assert_close(model.readout(x), model(idx, loop_counts=5,
                                                           noise=StateNoise.consecutive(0, 0, 2)).logits)
    position = 6
    prefix = finals[0][0, :position + 1]
    projected = inputs[0][:1, :position + 1]

    def step(states):
        return model.loop_step(0, states.unsqueeze(0), projected)[0]

    jacobian = own_state_jacobian(step, prefix)
    for column in (0, 7, 15):
        bump = torch.zeros_like(prefix)
        bump[-1, column] = 1e-6
        with torch.no_grad():
            numeric = (step(prefix + bump)[-1] - step(prefix - bump)[-1]) / 2e-6
        torch.testing.assert_close(jacobian[:, column], numeric, rtol=1e-5, atol=1e-7)
    result = spectra(model, idx, [6, 9], 5, StateNoise.consecutive(0, 0, 2), count=3)
    assert len(result) == 2 and len(result[0]["eigenvalues"]) == 2 and len(result[0]["eigenvalues"][0]) == 3
    radius = result[0]["spectral_radius"]
    assert radius["min"] <= radius["median"] <= radius["max"]


def test_a_chunked_jacobian_equals_the_whole_and_the_chunk_fits_its_budget():
    """jacrev in chunks of 3 of d = 16 backward passes gives the same matrix as all 16 at once (float64);
    the chunk shrinks as the prefix grows so that one chunk's activations stay inside the budget, and is
    None (all at once) when every pass fits. On Huginn-0125's width (d 5,280, MLP 17,920, 55 heads, 4
    looped layers) the default 2 GiB budget at 200 positions allows fewer than d passes: the unchunked jacrev
    asked an H200 for 38 GiB at once."""
    from rdepth.geometry.jacobian import jacobian_chunk

    config = get_preset("tiny", n_layer=3, n_head=2, d_model=16, block_size=12, vocab_size=50, groups="1",
                        mean_loops=3.0)
    torch.manual_seed(1)
    model = RecurrentLM(config).double().eval()
    idx = torch.randint(0, 50, (1, 9))
    finals, inputs = group_fixed_points(model, idx, 4, StateNoise.consecutive(0, 0, 1))

    def step(states):
        return model.loop_step(0, states.unsqueeze(0), inputs[0][:1])[0]

    whole = own_state_jacobian(step, finals[0][0])
    chunked = own_state_jacobian(step, finals[0][0], chunk=3)
    assert torch.equal(whole, chunked) or torch.allclose(whole, chunked, rtol=0, atol=1e-15)
    assert jacobian_chunk(model, 0, 9) is None  # 16 tiny passes fit the budget
    per_pass = 9 * 1 * (8 * 16 + 3 * config.hidden_width + 2 * 2 * 9) * 8
    assert jacobian_chunk(model, 0, 9, budget=5 * per_pass) == 5
    assert jacobian_chunk(model, 0, 9, budget=1) == 1
    from pathlib import Path

    from rdepth.config import ModelConfig
    from rdepth.interop.hf_raven import HUGINN_0125, raven_model_config

    huginn = ModelConfig.from_dict({**raven_model_config(Path("h"), HUGINN_0125), "tokenizer": "bpe:65536"})
    with torch.device("meta"):
        big = RecurrentLM(huginn)
    chunk = jacobian_chunk(big, 0, 200)
    assert chunk is not None and 1 <= chunk < 5280
    assert chunk * 200 * 4 * (8 * 5280 + 3 * 17920 + 2 * 55 * 200) * 4 <= 2**31


def test_spectra_differentiate_the_state_only_and_give_the_weights_back_as_they_were():
    """While the Jacobian runs, no weight requires grad (their gradient paths filled an H200); afterwards
    every weight requires grad exactly as before (a frozen one stays frozen) and none holds a gradient."""
    import rdepth.geometry.jacobian as jacobian_module

    config = get_preset("tiny", n_layer=3, n_head=2, d_model=8, block_size=8, vocab_size=30, groups="1",
                        mean_loops=2.0)
    model = RecurrentLM(config).double().eval()
    model.layers[0].requires_grad_(False)
    before = {name: p.requires_grad for name, p in model.named_parameters()}
    seen = []
    original = jacobian_module.own_state_jacobian

    def spy(step, states, chunk=None):
        seen.append(any(p.requires_grad for p in model.parameters()))
        return original(step, states, chunk)

    jacobian_module.own_state_jacobian = spy
    try:
        spectra(model, torch.randint(0, 30, (1, 6)), [4], 3, StateNoise.consecutive(0, 0, 1), count=2)
    finally:
        jacobian_module.own_state_jacobian = original
    assert seen == [False]
    assert {name: p.requires_grad for name, p in model.named_parameters()} == before
    assert not before["layers.0.attn.qkv.weight"] and before["layers.1.attn.qkv.weight"]
    assert all(p.grad is None for p in model.parameters())
