"""The block options Huginn-0125 needs (ModelConfig.positions, mlp, mlp_hidden, qk_bias, handoff_norm):
their defaults leave the model as it was, the decoder equals the teacher-forced passes with all of them
on (float64), and rotary positions are relative."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config, tiny_model

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError
from rdepth.exits.controller import controller_factory
from rdepth.model.decoder import Decoder
from rdepth.model.layers import Rotary
from rdepth.model.noise import StateNoise

RAVEN = dict(positions="rotary", rope_base=500.0, mlp="swiglu", mlp_hidden=40, qk_bias=True, handoff_norm=True)
PROMPT = 5


def raven_like(**overrides) -> torch.nn.Module:
    """A tiny float64 model with every option on; norm gains and the query/key bias moved off their init
    so that they matter."""
    model = tiny_model(**{**RAVEN, **overrides})
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 or name.endswith("qk_bias"):
                param.add_(0.2 * torch.randn_like(param))
    return model


def tokens(batch: int, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(batch))


def decode_all(decoder: Decoder, idx: torch.Tensor) -> torch.Tensor:
    """Prefill ``idx[:, :PROMPT]``, then one step per token: logits [B, T, V]."""
    logits = [decoder.prefill(idx[:, :PROMPT])]
    logits += [decoder.step(idx[:, t : t + 1])[:, None] for t in range(PROMPT, idx.shape[1])]
    return torch.cat(logits, 1)


def test_defaults_build_the_model_as_before():
    config = tiny_config()
    assert (config.positions, config.mlp, config.mlp_hidden, config.qk_bias, config.handoff_norm) == (
        "learned", "plain", None, False, False)
    names = set(tiny_model().state_dict())
    assert "wpe.weight" in names and not any("qk_bias" in name for name in names)
    assert tiny_model().layers[0].mlp.fc.weight.shape == (config.mlp_ratio * config.d_model, config.d_model)


def test_options_shape_the_weights():
    model = raven_like()
    names = set(model.state_dict())
    assert "wpe.weight" not in names
    d = model.config.d_model
    assert model.layers[0].mlp.fc.weight.shape == (80, d) and model.layers[0].mlp.proj.weight.shape == (d, 40)
    assert model.layers[0].attn.qk_bias.shape == (2, model.config.n_head, model.config.head_dim)


@pytest.mark.parametrize("batch", [1, 3])
def test_decoder_equals_teacher_forced_with_every_option(batch):
    model = raven_like()
    idx = tokens(batch)
    noise = StateNoise(3, range(batch))
    counts = (4, 3)
    forced = model(idx, loop_counts=counts, noise=noise).logits
    decoder = Decoder(model, batch, loop_counts=counts, noise=noise)
    torch.testing.assert_close(decode_all(decoder, idx), forced, rtol=0, atol=1e-10)


def test_exits_decoder_equals_the_packed_pass_with_every_option():
    """Per-token exits: the packed teacher-forced pass (rows at their own positions) and the decoder agree."""
    model = raven_like()
    idx = tokens(2)
    noise = StateNoise(1, range(2))
    factory = controller_factory("acceleration", 0.3, [6, 5])
    forced = model(idx, controller=factory(), noise=noise)
    computed = torch.stack(forced.computed)
    assert computed.min() < computed.max(), "the threshold should make exits vary"
    decoder = Decoder(model, 2, controller_factory=factory, noise=noise)
    torch.testing.assert_close(decode_all(decoder, idx), forced.logits, rtol=0, atol=1e-10)


def test_handoff_norm_normalises_what_the_next_stage_reads():
    on, off = raven_like(), raven_like(handoff_norm=False)
    state = torch.randn(2, 3, on.config.d_model, dtype=torch.float64)
    torch.testing.assert_close(on.hand_on(state), on.norm_f(state), rtol=0, atol=0)
    assert off.hand_on(state) is state
    idx = tokens(1)
    assert not torch.allclose(on(idx, loop_counts=2).logits, off(idx, loop_counts=2).logits)


def test_rotary_scores_depend_on_relative_position_only():
    rotary = Rotary(8, 500.0, 64)
    table = rotary.table(torch.device("cpu")).double()
    q, k = torch.randn(2, 8, dtype=torch.float64).unbind(0)

    def score(i: int, j: int) -> torch.Tensor:
        return (rotary.rotate(q, table[i]) * rotary.rotate(k, table[j])).sum()

    assert not torch.allclose(score(9, 2), score(9, 3))
    for shift in (1, 17, 40):
        torch.testing.assert_close(score(9 + shift, 2 + shift), score(9, 2), rtol=0, atol=1e-6)


def test_a_shifted_sequence_gives_the_same_logits():
    """The whole model with every position moved by 17 (the rotary table read from row 17 on): the same
    logits up to the float32 angle table's rounding, since only relative positions enter attention
    (a zero initial state, which has no position)."""
    model = raven_like(init_state_scale=0.0)
    idx = tokens(2)
    plain = model(idx, loop_counts=3).logits
    rotary = model.rotary
    table = rotary.table(torch.device("cpu"))
    rotary._tables[torch.device("cpu")] = table[17:]
    try:
        shifted = model(idx, loop_counts=3).logits
    finally:
        rotary._tables[torch.device("cpu")] = table
    torch.testing.assert_close(shifted, plain, rtol=0, atol=1e-5)
    assert (shifted - plain).abs().max() > 0  # the angles differ: the test does move the positions


@pytest.mark.parametrize("change, named", [
    (dict(positions="alibi"), "positions"), (dict(mlp="geglu"), "mlp"), (dict(mlp_hidden=0), "mlp_hidden"),
    (dict(rope_base=1.0), "rope_base"), (dict(qk_bias="yes"), "qk_bias"), (dict(handoff_norm=1), "handoff_norm"),
    (dict(positions="rotary", n_head=4, d_model=36), "even head_dim"),
])
def test_bad_options_are_named(change, named):
    with pytest.raises(RdepthError, match=named):
        ModelConfig.from_dict({**tiny_config().to_dict(), **change})


@pytest.mark.parametrize("exits", [False, True])
def test_the_decoder_follows_the_dense_pass_under_bf16_autocast(exits):
    """Under autocast the query/key bias is added in the queries' dtype, as the rotation is: keys and values
    reach the cache in one dtype (a float32 bias once promoted the keys alone, and the cached decoder
    raised, so ``rdepth generate --autocast bf16`` failed on every Huginn import)."""
    model = raven_like().float()
    idx = tokens(2)
    noise = StateNoise(1, range(2))
    settings = dict(controller_factory=controller_factory("acceleration", 0.3, [6, 5])) if exits else \
        dict(loop_counts=(4, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if exits:
            forced = model(idx, controller=settings["controller_factory"](), noise=noise).logits
        else:
            forced = model(idx, loop_counts=(4, 3), noise=noise).logits
        decoded = decode_all(Decoder(model, 2, noise=noise, **settings), idx)
    assert decoded.shape == forced.shape
    torch.testing.assert_close(decoded.float(), forced.float(), rtol=0.05, atol=0.1)
