"""rdepth's rules against the exit criteria of Geiping et al.'s released code (issue 42), definition by
definition.

Each ``reference_*`` below restates, in a plain per-step loop in float64, what one criterion of the
reference's ``get_adaptive_exit_evaluator`` computes (recpre/raven_modeling_minimal.py at commit 59e0b69
of seal-rg/recurrent-pretraining; read there, not copied): its state before the first step, the value
it compares after step k, and the comparison. On constructed trajectories (tokens converging at
different rates, with a turn, so exits spread over the steps) the step at which each token stops must
be the same under rdepth's rule with the named options, for every threshold of a grid.

| reference | rdepth |
|---|---|
| ``entropy-diff`` (start entropy 100, ``H = -sum p log(p + 1e-10)``) | ``entropy_diff`` |
| ``latent-diff`` (``||x_k - x_{k-1}|| / ||x_k||``, x_0 the start state) | ``latent_diff`` |
| ``cosine`` (``1 - cos(x_k, x_{k-1})``) | ``cosine`` |
| ``kl`` (``KL(p_{k-1} || p_k)``, p_0 uniform over V) | ``kl`` with ``direction="old_new", prior="uniform"`` |
| ``minp-kl`` (the same on min-p filtered distributions, min-p 0.1) | ``minp_kl`` |
| ``argmax-stability`` (a streak of equal top tokens, from -1) | ``argmax_stable`` with ``patience`` = its threshold |
"""

from __future__ import annotations

import math

import pytest
import torch

from rdepth.exits import replay

K, N, D, V = 14, 24, 6, 7


def trajectories(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[K+1, N, d]`` states: each token contracts towards its own fixed point at its own rate (0.25 to
    0.9 a step) while turning by its own angle, from a random start; and a decode matrix ``[V, d]``."""
    generator = torch.Generator().manual_seed(seed)
    fixed = torch.randn(N, D, generator=generator, dtype=torch.float64) * 2
    start = torch.randn(N, D, generator=generator, dtype=torch.float64) * 3
    rate = torch.linspace(0.25, 0.9, N, dtype=torch.float64)
    angle = torch.linspace(0.1, 1.2, N, dtype=torch.float64)
    states = [start]
    offset = start - fixed
    for _ in range(K):
        turned = offset.clone()
        c, s = torch.cos(angle), torch.sin(angle)
        turned[:, 0], turned[:, 1] = c * offset[:, 0] - s * offset[:, 1], s * offset[:, 0] + c * offset[:, 1]
        offset = rate[:, None] * turned
        states.append(fixed + offset)
    return torch.stack(states), torch.randn(V, D, generator=generator, dtype=torch.float64)


def reference_exit_steps(states: torch.Tensor, weight: torch.Tensor, criterion: str, threshold) -> torch.Tensor:
    """The step (1..K) at which each token stops under the reference criterion (K when it never fires)."""
    steps = torch.full((N,), K, dtype=torch.long)
    done = torch.zeros(N, dtype=torch.bool)
    prev_latent = states[0]
    prev_entropy = torch.full((N,), 100.0, dtype=torch.float64)
    prev_log_probs = torch.full((N, V), math.log(1.0 / V), dtype=torch.float64)
    prev_top = torch.full((N,), -1, dtype=torch.long)
    streak = torch.zeros(N, dtype=torch.long)
    for k in range(1, K + 1):
        latent = states[k]
        logits = latent @ weight.T
        if criterion == "entropy-diff":
            probs = torch.softmax(logits, dim=-1)
            entropy = -(probs * torch.log(probs + 1e-10)).sum(-1)
            fire = (entropy - prev_entropy).abs() < threshold
            prev_entropy = entropy
        elif criterion == "latent-diff":
            fire = (latent - prev_latent).norm(dim=-1) / latent.norm(dim=-1) < threshold
        elif criterion == "cosine":
            cosine = (latent * prev_latent).sum(-1) / latent.norm(dim=-1) / prev_latent.norm(dim=-1)
            fire = 1 - cosine < threshold
        elif criterion in ("kl", "minp-kl"):
            probs = torch.softmax(logits, dim=-1)
            if criterion == "minp-kl":
                probs = torch.where(probs < 0.1 * probs.max(dim=-1, keepdim=True).values,
                                    torch.full_like(probs, 1.0 / V), probs)
                probs = probs / probs.sum(dim=-1, keepdim=True)
            log_probs = probs.log()
            fire = (prev_log_probs.exp() * (prev_log_probs - log_probs)).sum(-1) < threshold
            prev_log_probs = log_probs
        elif criterion == "argmax-stability":
            top = logits.argmax(dim=-1)
            streak = torch.where(top == prev_top, streak + 1, torch.zeros_like(streak))
            prev_top = top
            fire = streak >= threshold
        else:
            raise ValueError(criterion)
        prev_latent = latent
        new = fire & ~done
        steps[new] = k
        done |= fire
    return steps


CASES = [
    ("entropy-diff", "entropy_diff", {}, [10.0 ** e for e in range(-7, 1)]),
    ("latent-diff", "latent_diff", {}, [10.0 ** (e / 2) for e in range(-10, 1)]),
    ("cosine", "cosine", {}, [10.0 ** e for e in range(-10, 0)]),
    ("kl", "kl", {"direction": "old_new", "prior": "uniform"}, [10.0 ** e for e in range(-9, 1)]),
    ("minp-kl", "minp_kl", {}, [10.0 ** e for e in range(-9, 1)]),
    ("argmax-stability", "argmax_stable", None, [1, 2, 3, 5]),
]


@pytest.mark.parametrize("criterion,name,options,grid", CASES, ids=[case[0] for case in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_rule_stops_where_the_reference_criterion_does(criterion, name, options, grid, seed):
    states, weight = trajectories(seed)

    def decode(state):
        return state @ weight.T

    spread = set()
    for threshold in grid:
        expected = reference_exit_steps(states, weight, criterion, threshold)
        if options is None:  # argmax_stable: the threshold is the patience
            _, computed = replay(name, states, decode=decode, patience=threshold)
        else:
            _, computed = replay(name, states, threshold, decode=decode, **options)
        assert torch.equal(computed, expected), f"{criterion} at {threshold}: {computed} vs {expected}"
        spread.update(expected.tolist())
    assert len(spread) >= 4, f"{criterion}: the grid's exits do not spread ({sorted(spread)})"


def test_the_defaults_differ_from_the_reference_where_documented():
    """rdepth's own defaults are not the reference's, and the difference shows: ``kl`` without the uniform
    prior never stops at step 1 (the reference can), ``step_norm_rel`` divides by the older state's norm
    (``latent-diff`` by the newer one), and Eq. 4's direction is the other KL."""
    states, weight = trajectories(0)

    def decode(state):
        return state @ weight.T

    # a loose KL threshold: the reference stops some tokens at step 1, rdepth's default never does
    reference = reference_exit_steps(states, weight, "kl", 10.0)
    _, default = replay("kl", states, 10.0, decode=decode, direction="old_new")
    assert (reference == 1).any() and not (default == 1).any()
    differs = False
    for tau in [10.0 ** (e / 4) for e in range(-20, 1)]:
        _, latent = replay("latent_diff", states, tau)
        _, relative = replay("step_norm_rel", states, tau)
        differs |= not torch.equal(latent, relative)
    assert differs
    differs = False
    for tau in [10.0 ** (e / 2) for e in range(-18, 1)]:
        _, old_new = replay("kl", states, tau, decode=decode, direction="old_new")
        _, new_old = replay("kl", states, tau, decode=decode)
        differs |= not torch.equal(old_new, new_old)
    assert differs


def test_bad_options_of_the_reference_rules_are_one_line_errors():
    from rdepth.errors import RdepthError
    from rdepth.exits.registry import make_policy

    with pytest.raises(RdepthError, match="prior must be one of none, uniform"):
        make_policy("kl", 1e-3, prior="flat")
    with pytest.raises(RdepthError, match="min_p must be in"):
        make_policy("minp_kl", 1e-3, min_p=0.0)
    with pytest.raises(RdepthError, match="eps must be"):
        make_policy("latent_diff", 1e-3, eps=-1.0)
