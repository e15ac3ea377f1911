"""How decoded exit rules read a state: the head, or the rest of the model; and the KL direction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rdepth.config import get_preset
from rdepth.errors import RdepthError
from rdepth.exits import PolicyController, make_policy
from rdepth.exits.base import ExitPolicy
from rdepth.exits.decode import RestDecode, make_decode
from rdepth.model import RecurrentLM
from rdepth.run.heldout import held_out_windows
from rdepth.sweep.config import SweepConfig
from rdepth.sweep.run import run_sweep

pytestmark = pytest.mark.usefixtures("one_thread")

B, T = 2, 6


def _model(scale: float = 1.0) -> RecurrentLM:
    """Stages: layer 0 | group 0 (layer 1) | group 1 (layer 2) | layer 3."""
    torch.manual_seed(0)
    config = get_preset("tiny", n_layer=4, d_model=16, n_head=2, block_size=8, vocab_size=40, groups="1|2",
                        init_state_scale=scale)
    return RecurrentLM(config).double().eval()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(1))


class Probe(ExitPolicy):
    """Reads every step through its decode and records the logits; rows in ``stop_at`` stop at that step
    (handing on the previous state when ``hands_on_previous``)."""

    name = "probe"
    uses_tau = False
    needs_decode = True

    def __init__(self, k_max, stop_at=None, previous=False):
        super().__init__(k_max=k_max)
        self.stop_at = stop_at or {}
        self.hands_on_previous = previous
        self.readings: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _exits(self, step, rows, prev, new):
        self.readings[step] = (rows.clone(), self.decode(new))
        return torch.tensor([self.stop_at.get(int(r)) == step for r in rows], dtype=torch.bool)


class Recorder:
    def __init__(self):
        self.states: dict[int, list[torch.Tensor]] = {}

    def __call__(self, group, step, state, active):
        self.states.setdefault(group, []).append(state.detach().clone().reshape(B * T, -1))


def _run(model, tokens, probes, decode, counts=(3, 3)):
    recorder = Recorder()
    controller = PolicyController(probes, decode=decode)
    with torch.no_grad():
        out = model(tokens, controller=controller, observer=recorder, noise=torch.Generator().manual_seed(2))
    return out, recorder


def test_head_reads_the_final_norm_and_head():
    model = _model()
    assert make_decode(model, "head", seq_len=T) == model.readout
    with pytest.raises(RdepthError, match="decode must be one of"):
        make_decode(model, "lens", seq_len=T)


def test_rest_of_the_last_group_is_the_later_layers_then_the_head(tokens):
    """Group 1 is the last group: its reading is layer 3 + readout, and at the last step the model's logits."""
    model = _model()
    probes = [Probe(2), Probe(3)]
    out, recorder = _run(model, tokens, probes, RestDecode(model, T))
    with torch.no_grad():
        for step in (1, 2, 3):
            rows, logits = probes[1].readings[step]
            state = recorder.states[1][step]  # [B*T, d]: every row loops to 3 here
            expected = model.readout(model.run_layers([3], state.view(B, T, -1))).reshape(B * T, -1)
            torch.testing.assert_close(logits, expected[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(probes[1].readings[3][1], out.logits.reshape(B * T, -1), rtol=0, atol=1e-12)
    # The head alone (today's reading) skips layer 3: a different distribution.
    assert not torch.allclose(model.readout(recorder.states[1][3]), probes[1].readings[3][1])


@pytest.mark.parametrize("loops", [1, 2])
def test_rest_of_a_middle_group_is_the_model_with_later_groups_at_a_fixed_budget(tokens, loops):
    """With zero initial states, group 0's reading after step s is exactly the model at budget (s, loops)."""
    model = _model(scale=0.0)
    probes = [Probe(3), Probe(1)]
    _run(model, tokens, probes, RestDecode(model, T, loops=loops))
    with torch.no_grad():
        for step in (1, 2, 3):
            expected = model(tokens, loop_counts=[step, loops]).logits.reshape(B * T, -1)
            rows, logits = probes[0].readings[step]
            torch.testing.assert_close(logits, expected[rows], rtol=0, atol=1e-12)


def test_rest_reads_stopped_rows_at_the_state_they_handed_on(tokens):
    """Rows that stopped keep the state they handed on (here the previous one), not their last iterate."""
    model = _model()
    stop = {row: 2 for row in range(0, B * T, 2)}  # even rows stop at step 2 and hand on x^(1)
    probes = [Probe(2), Probe(4, stop_at=stop, previous=True)]
    _, recorder = _run(model, tokens, probes, RestDecode(model, T))
    states = recorder.states[1]
    outputs = states[3].clone()
    even = torch.arange(0, B * T, 2)
    outputs[even] = states[1][even]  # handed on x^(1), although they computed x^(2)
    with torch.no_grad():
        expected = model.readout(model.run_layers([3], outputs.view(B, T, -1))).reshape(B * T, -1)
    rows, logits = probes[1].readings[3]
    assert rows.tolist() == list(range(1, B * T, 2))
    torch.testing.assert_close(logits, expected[rows], rtol=0, atol=1e-12)


def test_rest_needs_the_controller(tokens):
    model = _model()
    policy = make_policy("kl", tau=1e-3, k_max=3, decode=RestDecode(model, T))
    with pytest.raises(RdepthError, match="PolicyController"), torch.no_grad():
        model(tokens, controller=PolicyController([make_policy("fixed", k_max=2), policy]))
    with pytest.raises(RdepthError, match="whole windows"):
        RestDecode(model, 5).begin(0, torch.zeros(B * T, 16))


def test_kl_direction_paper_and_geiping():
    """``new_old`` is Eq. 4, KL(p_new || p_old); ``old_new`` is Geiping et al.'s
    ``F.kl_div(log_p_new, log_p_old, log_target=True)`` = KL(p_old || p_new)."""
    logits = torch.tensor([[[3.0, 0.0, 0.0]], [[3.0, 0.0, 0.0]], [[0.0, 3.0, 0.0]]], dtype=torch.float64)  # [K+1,N,V]
    old, new = torch.log_softmax(logits[1], -1), torch.log_softmax(logits[2], -1)
    eq4 = (new.exp() * (new - old)).sum(-1).item()
    geiping = F.kl_div(new, old, log_target=True, reduction="none").sum(-1).item()
    kl_old_new = (old.exp() * (old - new)).sum(-1).item()
    assert geiping == pytest.approx(kl_old_new)
    for direction, value in (("new_old", eq4), ("old_new", geiping)):
        signals = []
        for tau in (value * 0.999, value * 1.001):
            policy = make_policy("kl", tau=tau, k_max=3, decode=lambda x: x, direction=direction)
            rows = torch.arange(1)
            policy.begin(logits[0])
            policy.after_step(1, rows, logits[0], logits[1])
            signals.append(bool(policy.after_step(2, rows, logits[1], logits[2])[0]))
        assert signals == [False, True]  # the rule compares exactly this direction's value with tau
    with pytest.raises(RdepthError, match="direction"):
        make_policy("kl", tau=1e-3, direction="both")


def test_sweep_config_for_decoding():
    with pytest.raises(RdepthError, match="decode must be"):
        SweepConfig(decode="lens")
    with pytest.raises(RdepthError, match="decode_loops"):
        SweepConfig(decode="rest", decode_loops=0)
    with pytest.raises(RdepthError, match="teacher-forced windows only"):
        SweepConfig(decode="rest", generate_tokens=4)
    with pytest.raises(RdepthError, match="kl_direction"):
        SweepConfig(kl_direction="both")
    assert SweepConfig(kl_direction="old_new").policy_options("kl") == {"direction": "old_new", "prior": "none"}
    assert SweepConfig(kl_prior="uniform").policy_options("kl") == {"direction": "new_old", "prior": "uniform"}
    with pytest.raises(RdepthError, match="kl_prior must be one of none, uniform"):
        SweepConfig(kl_prior="flat")
    assert SweepConfig().policy_options("step_norm") == {}


def test_sweep_saves_the_decode_mode_and_kl_direction():
    model = _model().float()
    windows = held_out_windows(np.random.default_rng(0).integers(0, 40, size=8 * 4 + 1), 8)
    results = {}
    for decode in ("head", "rest"):
        config = SweepConfig(policies=("kl",), taus=(1e-1,), k_max=(3,), batch_size=2, timing=False, decode=decode,
                             decode_loops=2 if decode == "rest" else 1, kl_direction="old_new")
        results[decode] = run_sweep(model, windows, config)
    rest = results["rest"]
    assert rest["config"]["decode"] == "rest" and rest["config"]["decode_loops"] == 2
    assert rest["summary"]["decode"]["mode"] == "rest" and rest["summary"]["decode"]["loops"] == 2
    assert rest["summary"]["decode"]["kl_direction"] == "old_new"
    assert "later groups at 2 loop step(s)" in rest["summary"]["decode"]["description"]
    assert results["head"]["summary"]["decode"]["loops"] is None
    # The two readings give different exits on this model (group 0: 2.75 steps with the head, 2.53 with the rest).
    assert rest["points"][0]["mean_steps"] != results["head"]["points"][0]["mean_steps"]


def test_a_rest_reading_is_a_function_of_the_state_alone():
    """The later groups start from the same initial states at every reading: two readings of one state agree,
    so the KL between consecutive steps measures group 0's change, not fresh noise."""
    model = _model()
    decode = RestDecode(model, T, loops=2, seed=5)
    x = torch.randn(B, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first, second = decode.rest(0, x), decode.rest(0, x)
        other_seed = RestDecode(model, T, loops=2, seed=6).rest(0, x)
    assert torch.equal(first, second)
    assert not torch.allclose(first, other_seed)  # the later group's initial state does enter the reading
