"""The state a group hands on after per-token exits, checked through the model itself.

For every registered exit policy, with random initial loop states: the state each
group passes to the next stage equals the iterate the policy named (``used``), and,
for policies that hand on their newest state, the logits equal a run that simply
stops every token at that step. A loop that handed on the wrong state (for example
the newest iterate where Algorithm 1 names the previous one) fails here.
"""

from __future__ import annotations

import pytest
import torch

from rdepth.config import ModelConfig
from rdepth.exits.base import POLICIES
from rdepth.exits.controller import controller_factory
from rdepth.exits.gate import random_gate
from rdepth.exits.policies import random_ouro_gate
from rdepth.model import RecurrentLM
from rdepth.model.decoder import Decoder
from rdepth.model.noise import StateNoise

K_MAX = 6
TAUS = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0)
BOUNDED_TAUS = (0.5, 0.9, 0.95, 0.97, 0.99, 1.0)  # rules with tau in (0, 1]


def model() -> RecurrentLM:
    # every group is followed by a single layer, whose input is the group's hand-off
    config = ModelConfig(n_layer=5, n_head=2, d_model=16, block_size=16, vocab_size=64, groups="1|3",
                         mean_loops=3.0, backprop_depth=2, init_state_scale=1.0, tokenizer="bpe:64")
    torch.manual_seed(0)
    return RecurrentLM(config).double().eval()


class ScheduledController:
    """Stops token r of group g at step ``steps[g][r]`` and hands on its newest state."""

    def __init__(self, steps: list[torch.Tensor]):
        self.steps = [s.flatten() for s in steps]

    def max_steps(self, group: int) -> int:
        return int(self.steps[group].max())

    def begin(self, group, state):
        pass

    def after_step(self, group, step, rows, prev, new):
        done = self.steps[group][rows] <= step
        return done, new, torch.full_like(rows, step)


def run_with_policy(net, idx, name, tau):
    """Logits, per-group (computed, used), every recorded iterate and what each group handed on."""
    iterates: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    handed: dict[int, torch.Tensor] = {}

    def observer(group, step, state, active):
        iterates[group].append(state.detach().clone())

    hooks = [net.layers[layer].register_forward_pre_hook(
        lambda module, args, group=group: handed.__setitem__(group, args[0].detach().clone()))
        for group, layer in ((0, 2), (1, 4))]
    cls = POLICIES[name]
    options = {"tau": tau} if cls.uses_tau else {}
    if name == "learned":  # a gate with random weights: which state is handed on, not the gate's quality
        options["gate"] = random_gate(net.n_groups, net.config.d_model)
    if name == "ouro":
        options["gate"] = random_ouro_gate(net.config.d_model)
    controller = controller_factory(name, None, K_MAX, lambda: net.readout, options)()
    try:
        out = net(idx, controller=controller, noise=StateNoise.consecutive(7, 0, idx.shape[0]),
                  observer=observer)
    finally:
        for hook in hooks:
            hook.remove()
    return out, iterates, handed


@pytest.mark.parametrize("name", sorted(n for n in POLICIES if n != "fixed"))
def test_handed_on_state_is_the_named_iterate(name):
    net = model()
    idx = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    early_exits = 0
    for tau in (BOUNDED_TAUS if POLICIES[name].tau_max else TAUS) if POLICIES[name].uses_tau else (None,):
        with torch.no_grad():
            out, iterates, handed = run_with_policy(net, idx, name, tau)
        for group in (0, 1):
            states = torch.stack(iterates[group])  # [K+1, B, T, d]
            used = out.used[group]  # [B, T]
            expected = states.gather(0, used[None, :, :, None].expand(1, *states.shape[1:])).squeeze(0)
            torch.testing.assert_close(handed[group].view_as(expected), expected, rtol=0, atol=0)
            assert bool((used <= out.computed[group]).all())
            early_exits += int((out.computed[group] < K_MAX).sum())
            if POLICIES[name].hands_on_previous:
                stopped = out.computed[group] < K_MAX
                assert bool((used[stopped] == out.computed[group][stopped] - 1).all())
        if not POLICIES[name].hands_on_previous:
            with torch.no_grad():
                scheduled = net(idx, controller=ScheduledController(out.used),
                                noise=StateNoise.consecutive(7, 0, idx.shape[0]))
            torch.testing.assert_close(scheduled.logits, out.logits, rtol=0, atol=1e-12)
    assert early_exits > 0, f"{name} never exited early on this grid: the test checked nothing"


@pytest.mark.parametrize("name,tau", [("kl", 1e-2), ("acceleration", 3.0), ("step_norm", 3e-1), (None, None)])
def test_random_initial_states_cached_equals_teacher_forced_and_batch_of_one(name, tau):
    """With keyed random initial states, exits decided online agree across the three paths."""
    net = model()
    idx = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(2))

    def controller():
        if name is None:
            return None
        return controller_factory(name, tau, K_MAX, lambda: net.readout)()

    with torch.no_grad():
        noise = StateNoise.consecutive(5, 0, 3)
        counts = (3, 4) if name is None else None
        full = net(idx, loop_counts=counts, controller=controller(), noise=noise)
        decoder = Decoder(net, 3, loop_counts=counts, controller_factory=None if name is None else controller,
                          noise=noise)
        pieces = [decoder.prefill(idx[:, :4])]
        for position in range(4, 10):
            pieces.append(decoder.step(idx[:, position:position + 1])[:, None])
        cached = torch.cat(pieces, dim=1)
        single = torch.cat([net(idx[b:b + 1], loop_counts=counts, controller=controller(),
                                noise=StateNoise(5, [b])).logits for b in range(3)])
    torch.testing.assert_close(cached, full.logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(single, full.logits, rtol=0, atol=1e-10)
    if name is not None:
        assert any(bool((c < K_MAX).any()) for c in full.computed)
