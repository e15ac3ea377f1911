"""The rules that can stop at step 1: ``confidence`` (the decoded prediction's confidence) and ``learned`` (a
trained gate on the loop state). Constructed inputs with known answers, and exactness like every rule:
the one decoder (prefill, then a token at a time) = teacher-forced packed = batch of one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model

from rdepth.errors import RdepthError
from rdepth.exits import make_policy, replay
from rdepth.exits.controller import controller_factory
from rdepth.exits.gate import ExitGate, gate_features, random_gate, stable_from
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise
from rdepth.sweep.depth import oracle_steps

K_MAX = (5, 4)
PROMPT, LENGTH, BATCH = 4, 11, 3


# ------------------------------------------------------------------ constructed inputs: confidence


def _states(first: torch.Tensor, later: torch.Tensor, start: torch.Tensor, steps: int = 4) -> torch.Tensor:
    """[steps + 1, N, V]: ``start`` as s0, ``first`` after step 1, ``later`` after every further step."""
    return torch.stack([start, first] + [later] * (steps - 1))


def test_confidence_stops_at_step_one_when_confident_and_never_when_not():
    """The decode is the identity (a state is its logits). Row 0's first iterate decodes to one token with
    probability ~1: it stops at step 1 and hands on x^(1). Row 1 decodes to the uniform distribution at every
    step: it never stops (it runs to k_max). Row 2's random start s0 is confident but x^(1) is not: the rule
    reads x^(1), never s0, so it does not stop at step 1; it stops at step 2, where the state turns confident."""
    vocab = 8
    confident, uniform = torch.full((vocab,), -30.0), torch.zeros(vocab)
    confident[3] = 30.0
    states = torch.stack([
        _states(confident, confident, uniform),
        _states(uniform, uniform, uniform),
        _states(uniform, confident, confident),
    ], dim=1).double()  # (5, 3, V)
    read = []

    def decode(state):
        read.append(state.clone())
        return state

    used, computed = replay("confidence", states, tau=0.01, decode=decode)
    assert computed.tolist() == [1, 4, 2] and used.tolist() == [1, 4, 2]
    assert not any(torch.equal(r, states[0]) for r in read), "the random start was decoded"
    # uniform: 1 - max p = 7/8 for every k; a tau above it stops every row at step 1
    assert replay("confidence", states, tau=0.9, decode=lambda s: s)[1].tolist() == [1, 1, 1]
    assert replay("confidence", states, tau=0.875, decode=lambda s: s)[1].tolist() == [1, 4, 2]  # strictly below


def test_confidence_margin_reads_the_top_two():
    """Two tied top tokens: max probability 0.5 (stops under max_prob at tau 0.6) but margin 0 (never stops)."""
    tied = torch.full((6,), -40.0, dtype=torch.float64)
    tied[[1, 4]] = 5.0
    states = torch.stack([tied] * 4)[:, None]  # (4, 1, V)
    assert replay("confidence", states, tau=0.6, decode=lambda s: s)[1].tolist() == [1]
    assert replay("confidence", states, tau=0.6, decode=lambda s: s, signal="margin")[1].tolist() == [3]
    with pytest.raises(RdepthError, match="signal must be one of"):
        make_policy("confidence", tau=0.5, signal="entropy")


@pytest.mark.parametrize("name", ["confidence", "learned"])
@pytest.mark.parametrize("tau", [0.0, -0.1, 1.5, float("inf")])
def test_a_threshold_outside_zero_one_is_a_one_line_error(name, tau):
    with pytest.raises(RdepthError, match=f"exit policy {name}: tau must be"):
        make_policy(name, tau=tau, gate=random_gate(1, 4)) if name == "learned" else make_policy(name, tau=tau)


# ------------------------------------------------------------------ constructed inputs: learned


def test_learned_fires_on_the_gates_probability_from_step_one():
    """A gate that reads only the log relative update: p = sigmoid(-2 log(update)) (bias 0). A row whose
    first step barely moves it (update 1e-3: p ~ 1) stops at step 1; a row moving by a tenth of its norm
    at every step (p = sigmoid(2 log 10) ~ 0.99) stops once tau lets 1 - p ~ 0.0099 under it, else never."""
    d = 4
    weight = torch.zeros(1, d + 1, dtype=torch.float64)
    weight[0, -1] = -2.0
    gate = ExitGate(weight, torch.zeros(1, dtype=torch.float64))
    start = torch.ones(2, d, dtype=torch.float64)
    still = [start[0]] + [start[0] * 1.001] * 4  # moves by 1e-3 of its norm at step 1, then not at all
    moving = [start[1] * 1.1 ** k for k in range(5)]  # grows by 10% per step
    states = torch.stack([torch.stack(still), torch.stack(moving)], dim=1)  # (5, 2, d)
    p = gate.probability(0, states[0], states[1])
    assert p[0] > 0.999 and 0.98 < p[1] < 0.995
    assert replay("learned", states, tau=1e-3, gate=gate)[1].tolist() == [1, 4]
    assert replay("learned", states, tau=0.02, gate=gate)[1].tolist() == [1, 1]
    # the features are the rms-normed state and the log relative update, as the gate was trained on
    features = gate_features(states[0], states[1])
    torch.testing.assert_close(features[:, :d], states[1] / states[1].pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())


def test_the_rules_score_is_the_trained_probe_on_the_features():
    """The policy's hot path (no features built) gives the probe's score on gate_features, as trained."""
    gate = random_gate(3, 16, seed=5, scale=3.0)
    generator = torch.Generator().manual_seed(6)
    prev, new = (torch.randn(40, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    for group in range(3):
        expected = gate_features(prev, new) @ gate.weight[group] + gate.bias[group]
        torch.testing.assert_close(gate.score(group, prev, new), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gate.probability(group, prev, new), torch.sigmoid(expected), rtol=1e-12, atol=0)


def test_the_gates_target_is_the_per_token_oracle_on_tokens_right_at_the_cap():
    """stable_from (the first step from which the prediction no longer changes) equals the sweep's per-token
    oracle (the fewest steps from which it is right and stays right) on every token right at the cap."""
    generator = torch.Generator().manual_seed(0)
    predictions = torch.randint(0, 3, (6, 400), generator=generator)
    answers = torch.randint(0, 3, (400,), generator=generator)
    stable = stable_from(predictions)
    oracle = oracle_steps((predictions == answers).numpy(), np.arange(1, 7))
    right = predictions[-1] == answers
    assert right.sum() > 50
    assert np.array_equal(stable[right].numpy().astype(float), oracle[right.numpy()])
    assert stable_from(torch.tensor([[1, 2], [2, 2], [1, 2]])).tolist() == [3, 1]


def test_learned_without_a_gate_or_with_a_gate_of_another_shape_is_a_one_line_error():
    with pytest.raises(RdepthError, match="needs a trained exit gate"):
        make_policy("learned", tau=0.5)
    with pytest.raises(RdepthError, match="gate must be a run folder or an ExitGate"):
        make_policy("learned", tau=0.5, gate=3)
    model = tiny_model()
    narrow = random_gate(model.n_groups, model.config.d_model - 1)
    controller = controller_factory("learned", 0.5, list(K_MAX), None, {"gate": narrow})()
    with pytest.raises(RdepthError, match="a gate for another model"):
        model(torch.zeros(1, 4, dtype=torch.long), controller=controller)
    one_group = random_gate(1, model.config.d_model)
    controller = controller_factory("learned", 0.5, list(K_MAX), None, {"gate": one_group})()
    with pytest.raises(RdepthError, match="1 group head"):
        model(torch.zeros(1, 4, dtype=torch.long), controller=controller)


# ------------------------------------------------------------------ exactness


def _factory(model, name: str, tau: float):
    if name == "learned":
        gate = random_gate(model.n_groups, model.config.d_model, seed=3)
        return lambda: controller_factory(name, tau, list(K_MAX), None, {"gate": gate})()
    return lambda: controller_factory(name, tau, list(K_MAX), lambda: model.readout)()


def _decode(model, idx: torch.Tensor, factory, noise: StateNoise):
    """The one decoder: prefill ``idx[:, :PROMPT]``, then a token at a time -> logits [B, T, V], computed and
    used [G, B, T - PROMPT] of the stepped tokens, and the prompt's computed [G, B, PROMPT]."""
    decoder = Decoder(model, idx.shape[0], controller_factory=factory, noise=noise)
    logits = [decoder.prefill(idx[:, :PROMPT])]
    prompt_computed = decoder.prompt_computed.clone()
    computed, used = [], []
    for t in range(PROMPT, idx.shape[1]):
        logits.append(decoder.step(idx[:, t : t + 1])[:, None])
        computed.append(decoder.computed.clone()[:, :, None])
        used.append(decoder.used.clone()[:, :, None])
    return torch.cat(logits, 1), torch.cat(computed, 2), torch.cat(used, 2), prompt_computed


def _tau_with_step_one_exits(model, idx, name, noise) -> float:
    """A threshold under which some token stops at step 1 and some later (so the test checks something)."""
    for tau in (0.9, 0.93, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995, 0.5, 0.7, 0.8):
        computed = torch.stack(model(idx, controller=_factory(model, name, tau)(), noise=noise).computed)
        if (computed == 1).any() and (computed > 1).any():
            return tau
    raise AssertionError(f"no threshold on the grid stops some tokens of {name} at step 1 and others later")


@pytest.mark.parametrize("name", ["confidence", "learned"])
def test_decoder_equals_teacher_forced_equals_batch_of_one(name):
    """Cached (the Decoder's prefill and steps), teacher-forced (the packed forward) and each row alone agree
    exactly: logits, the steps each token computed and the iterate it handed on, with some tokens leaving at
    step 1."""
    model = tiny_model()
    idx = torch.randint(0, 50, (BATCH, LENGTH), generator=torch.Generator().manual_seed(7))
    noise = StateNoise(11, range(BATCH))
    tau = _tau_with_step_one_exits(model, idx, name, noise)
    factory = _factory(model, name, tau)
    with torch.no_grad():
        forced = model(idx, controller=factory(), noise=noise)
        computed_forced, used_forced = torch.stack(forced.computed), torch.stack(forced.used)
        logits, computed, used, prompt_computed = _decode(model, idx, factory, noise)
        torch.testing.assert_close(logits, forced.logits, rtol=0, atol=1e-10)
        assert torch.equal(computed, computed_forced[:, :, PROMPT:])
        assert torch.equal(used, used_forced[:, :, PROMPT:])
        assert torch.equal(prompt_computed, computed_forced[:, :, :PROMPT])
        for row in range(BATCH):
            alone = StateNoise(11, [row])
            single = model(idx[row : row + 1], controller=factory(), noise=alone)
            torch.testing.assert_close(single.logits[0], forced.logits[row], rtol=0, atol=1e-10)
            assert torch.equal(torch.stack(single.computed)[:, 0], computed_forced[:, row])
            assert torch.equal(torch.stack(single.used)[:, 0], used_forced[:, row])
            cached = _decode(model, idx[row : row + 1], factory, alone)
            torch.testing.assert_close(cached[0][0], forced.logits[row], rtol=0, atol=1e-10)
            assert torch.equal(cached[1][:, 0], computed_forced[:, row, PROMPT:])
    assert (computed_forced == 1).any() and (computed_forced > 1).any()


def test_the_sweeps_shared_taus_keep_a_bounded_rules_range_and_its_own_grid_must_fit():
    from rdepth.sweep.config import SweepConfig

    config = SweepConfig(policies=("kl", "confidence"), taus=(1e-3, 0.5, 2.0))
    assert config.values("kl") == (1e-3, 0.5, 2.0) and config.values("confidence") == (1e-3, 0.5)
    with pytest.raises(RdepthError, match="confidence takes tau in \\(0, 1\\]; the grid holds 2"):
        SweepConfig(policies=("confidence",), grid={"confidence": (0.5, 2.0)})
    with pytest.raises(RdepthError, match="--taus holds none"):
        SweepConfig(policies=("confidence",), taus=(2.0, 3.0))
