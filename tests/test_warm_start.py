"""Warm-started loops: teacher-forced evaluation and cached decoding are one computation, exactly."""

from __future__ import annotations

import pytest
import torch

from rdepth.config import get_preset
from rdepth.exits import PolicyController, make_policy
from rdepth.model import RecurrentLM
from rdepth.model.decoder import Decoder
from rdepth.model.generation import generate, teacher_forced
from rdepth.model.noise import StateNoise

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> RecurrentLM:
    torch.manual_seed(0)
    config = get_preset("tiny", n_layer=4, d_model=32, n_head=2, block_size=16, vocab_size=64, groups="1|2")
    return RecurrentLM(config).double().eval()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))


def controller():
    return PolicyController(lambda group: make_policy("step_norm_rel", tau=0.05, k_max=6))  # stops at 5 or 6


@torch.no_grad()
def test_one_call_equals_token_by_token_with_a_cache(model, tokens):
    noise = StateNoise.consecutive(3, 0, tokens.shape[0])
    whole = teacher_forced(model, tokens, controller_factory=controller, noise=noise, warm_start=True)
    decoder = Decoder(model, tokens.shape[0], controller_factory=controller, noise=noise, warm_start=True)
    logits, computed = [decoder.prefill(tokens[:, :5])], [decoder.prompt_computed]
    for t in range(5, tokens.shape[1]):
        logits.append(decoder.step(tokens[:, t:t + 1])[:, None])
        computed.append(decoder.computed[:, :, None].clone())
    torch.testing.assert_close(whole.logits, torch.cat(logits, dim=1), rtol=1e-12, atol=1e-12)
    steps = torch.cat(computed, dim=2)
    for group in range(model.n_groups):
        assert torch.equal(whole.computed[group], steps[group])
    assert steps.min() >= 1 and steps.max() <= 6 and len(set(steps.flatten().tolist())) > 1  # exits did vary


@torch.no_grad()
def test_warm_start_changes_every_position_but_the_first(model, tokens):
    noise = StateNoise.consecutive(3, 0, tokens.shape[0])
    fresh = model(tokens, loop_counts=3, noise=noise)
    warm = teacher_forced(model, tokens, loop_counts=3, noise=noise, warm_start=True)
    torch.testing.assert_close(warm.logits[:, 0], fresh.logits[:, 0], rtol=1e-10, atol=1e-10)  # starts from noise
    assert (warm.logits[:, 1:] - fresh.logits[:, 1:]).abs().amax(-1).min() > 1e-6


@torch.no_grad()
def test_greedy_decoding_with_warm_start_follows_the_teacher_forced_argmax(model, tokens):
    prompt = tokens[:, :4]
    noise = StateNoise.consecutive(5, 0, prompt.shape[0])
    out = generate(model, prompt, 8, temperature=0, controller_factory=controller, noise=noise, warm_start=True)
    forced = teacher_forced(model, out[:, :-1], controller_factory=controller, noise=noise, warm_start=True)
    assert torch.equal(forced.logits[:, 3:].argmax(-1), out[:, 4:])


@pytest.fixture(scope="module")
def one_group() -> RecurrentLM:
    torch.manual_seed(2)
    config = get_preset("tiny", n_layer=3, d_model=32, n_head=2, block_size=16, vocab_size=64, groups="1",
                        backprop_depth=2)
    return RecurrentLM(config).double().eval()


@torch.no_grad()
def test_shifted_warm_start_is_its_definition(one_group, tokens):
    """Loop from noise without gradients, shift the handed-on states one position, loop again."""
    model, noise = one_group, StateNoise.consecutive(3, 0, tokens.shape[0])
    got = model(tokens, loop_counts=4, noise=noise, shifted_warm_start=True).logits
    x = model.run_layers([0], model.embed(tokens))
    start = model.init_state(0, x, noise)
    state = start
    for _ in range(4):
        state = model.loop_step(0, state, model.group_input(0, x))
    state = torch.cat([start[:, :1], state[:, :-1]], dim=1)
    for _ in range(4):
        state = model.loop_step(0, state, model.group_input(0, x))
    assert torch.equal(got, model.readout(model.run_layers([2], state)))


@torch.no_grad()
def test_shifted_warm_start_equals_the_sequential_one_where_the_definitions_meet(one_group, tokens):
    """Position 0 starts from noise in both; position 1 from position 0's noise-started hand-off in
    both; from position 2 on the sequential start has itself been warm-started."""
    model, noise = one_group, StateNoise.consecutive(3, 0, tokens.shape[0])
    shifted = model(tokens, loop_counts=4, noise=noise, shifted_warm_start=True).logits
    sequential = teacher_forced(model, tokens, loop_counts=4, noise=noise, warm_start=True).logits
    torch.testing.assert_close(shifted[:, :2], sequential[:, :2], rtol=1e-12, atol=1e-12)
    assert (shifted[:, 2:] - sequential[:, 2:]).abs().amax() > 1e-8


def test_shifted_warm_start_trains_through_the_second_pass_only(one_group, tokens):
    model = one_group.train()
    try:
        out = model(tokens, tokens, loop_counts=4, noise=StateNoise.consecutive(3, 0, 3),
                    shifted_warm_start=True)
        out.loss.backward()
        assert model.adapters[0].weight.grad is not None and model.adapters[0].weight.grad.abs().sum() > 0
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_train_warm_start_flag_trains_with_the_shifted_start(wiki_small, tmp_path, monkeypatch):
    """--warm-start reaches the model's forward in training, and the run records it."""
    import json

    from rdepth.cli.main import main

    calls = []
    original = RecurrentLM.forward

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("shifted_warm_start", False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RecurrentLM, "forward", spy)
    run = tmp_path / "run"
    assert main(["train", "--data", str(wiki_small), "--out", str(run), "--max-steps", "2", "--batch-size", "2",
                 "--n-layer", "3", "--n-head", "2", "--d-model", "16", "--block-size", "32", "--groups", "1",
                 "--mean-loops", "2", "--backprop-depth", "2", "--eval-batches", "1", "--warm-start"]) == 0
    assert calls.count(True) == 2  # the two training steps; validation starts from noise
    assert json.loads((run / "config.json").read_text())["train"]["warm_start"] is True
