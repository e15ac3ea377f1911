"""The model options Ouro needs (issue 53): ``block="peri"``, ``loop_state="looplm"``, ``tie_head`` and
``exit_gate``, each against its formula written out here, validated in one line, and the looplm loop run by
every driver as the dense forward runs it (cached = teacher-forced, exits included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory
from rdepth.exits.policies import random_ouro_gate
from rdepth.model import RecurrentLM
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise

OURO = dict(n_layer=2, n_head=4, d_model=32, block_size=32, vocab_size=96, groups="0-1", block="peri",
            loop_state="looplm", positions="rotary", rope_pairs="half", mlp="swiglu", mlp_hidden=48, tie_head=False, exit_gate=True,
            init_state_scale=0.0, mean_loops=4.0, eval_loops=(4,), tokenizer="bpe:96")


def ouro_lm(**overrides) -> RecurrentLM:
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(**{**OURO, **overrides})).double().eval()
    with torch.no_grad():  # norm gains off 1, so that every norm's place matters
        for name, param in model.named_parameters():
            if name.endswith("norm_1.weight") or name.endswith("norm_2.weight") or name.endswith("norm_4.weight") \
                    or name == "norm_f.weight":
                param.add_(0.3 * torch.randn_like(param))
    return model


def rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def written_out(model: RecurrentLM, idx: torch.Tensor, steps: int) -> torch.Tensor:
    """Ouro's forward by hand: s_0 = e (unscaled), s_k = norm(peri layers(s_{k-1})), logits head(s_K)."""
    state = model.wte(idx)
    for _ in range(steps):
        for layer in model.layers:
            attn = layer.attn(rms(state, layer.norm_1.weight))
            state = state + rms(attn, layer.norm_2.weight)
            state = state + rms(layer.mlp(rms(state, layer.norm_3.weight)), layer.norm_4.weight)
        state = rms(state, model.norm_f.weight)
    return F.linear(state, model.head.weight)[..., : model.config.vocab_size]


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_the_looplm_forward_is_ouros_formula(steps):
    model = ouro_lm()
    idx = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx, loop_counts=steps).logits, written_out(model, idx, steps),
                                   rtol=0, atol=1e-12)


def test_a_sandwich_norm_in_its_place_would_be_caught():
    """The written-out forward tells the blocks apart: the sandwich block (norm after the residual sum) on the
    same weights gives other logits."""
    model = ouro_lm()
    sandwich = RecurrentLM(ModelConfig(**{**OURO, "block": "sandwich"})).double().eval()
    sandwich.load_state_dict(model.state_dict())
    idx = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (sandwich(idx, loop_counts=2).logits - written_out(model, idx, 2)).abs().max() > 1e-3


def test_the_head_and_the_gate_are_parameters_of_their_own():
    tied, untied = RecurrentLM(ModelConfig(**{**OURO, "tie_head": True, "exit_gate": False})), ouro_lm()
    assert tied.head is None and tied.exit_gate is None and tied.head_weight is tied.wte.weight
    assert tuple(untied.head.weight.shape) == (128, 32) and tuple(untied.exit_gate.weight.shape) == (1, 32)
    assert not untied.adapters  # no adapter in a looplm loop
    extra = untied.num_parameters() - tied.num_parameters()
    assert extra == 128 * 32 + 32 + 1  # the head padded to 64 rows as the embedding


@pytest.mark.parametrize("batch", [1, 3])
def test_cached_equals_teacher_forced_with_the_gate(batch):
    model = ouro_lm()
    idx = torch.randint(0, 96, (batch, 10), generator=torch.Generator().manual_seed(2))
    factory = controller_factory("ouro", 0.5, [4], None, {"gate": random_ouro_gate(32, 1)})
    with torch.no_grad():
        forced = model(idx, controller=factory())
    computed = torch.stack(forced.computed)
    assert computed.min() < computed.max(), "the gate should stop tokens at different steps"
    decoder = Decoder(model, batch, controller_factory=factory, noise=StateNoise(0, range(batch)))
    logits = torch.cat([decoder.prefill(idx[:, :3])[:, -1:]] + [decoder.step(idx[:, t:t + 1])[:, None]
                                                                  for t in range(3, 10)], 1)
    torch.testing.assert_close(logits, forced.logits[:, 2:], rtol=0, atol=1e-10)


def test_rotate_half_is_the_llama_formula_and_not_the_adjacent_one():
    """``rope_pairs="half"``: ``x * cos + rotate_half(x) * sin`` with the angle of pair i on channels i and
    i + hs/2 (Llama's and Ouro's formula written out); the adjacent layout turns other channels."""
    from rdepth.model.layers import Rotary

    head, positions = 8, 5
    x = torch.randn(positions, head, dtype=torch.float64)
    inverse = 1.0 / (10000.0 ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inverse)
    cos, sin = torch.cat([angles, angles], -1).cos().double(), torch.cat([angles, angles], -1).sin().double()
    rotated_half = torch.cat([-x[:, head // 2:], x[:, :head // 2]], -1)
    expected = x * cos + rotated_half * sin
    half, adjacent = Rotary(head, 10000.0, positions, "half"), Rotary(head, 10000.0, positions)
    turn = half.table(torch.device("cpu"))
    torch.testing.assert_close(half.rotate(x, turn), expected, rtol=0, atol=1e-15)
    assert (adjacent.rotate(x, turn) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("change, named", [
    (dict(groups="0"), "one recurrence group ending at the last layer"),
    (dict(n_layer=3, groups="0|1-2"), "one recurrence group"),
    (dict(init_state_scale=1.0), "init_state_scale must be 0"),
    (dict(handoff_norm=True), "handoff_norm must be false"),
    (dict(tie_head="no"), "tie_head must be true or false"),
    (dict(exit_gate=1), "exit_gate must be true or false"),
    (dict(block="ouro"), "block must be one of"),
    (dict(rope_pairs="interleaved"), "rope_pairs must be one of"),
])
def test_bad_looplm_settings_are_refused_in_one_line(change, named):
    with pytest.raises(RdepthError, match=named):
        ModelConfig(**{**OURO, **change})
