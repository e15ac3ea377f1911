"""Exit policies on constructed trajectories with answers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rdepth.errors import RdepthError
from rdepth.exits import POLICIES, PolicyController, drive_recorded, make_policy, replay
from rdepth.exits.controller import controller_factory
from rdepth.exits.gate import random_gate
from rdepth.exits.policies import random_ouro_gate

D = 16  # embedding dimension of the constructed trajectories


def _rotation(dim: int, seed: int = 0) -> torch.Tensor:
    """A random orthogonal matrix [dim, dim] (float64): norms and angles are kept."""
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
    return q


def _from_steps(start: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """States [K+1, 1, d] from x^(0) [d] and updates Delta^(0..K-1) [K, d]."""
    states = torch.cat([start[None], start[None] + torch.cumsum(deltas, dim=0)])
    return states[:, None, :]


def _embed(vectors: torch.Tensor) -> torch.Tensor:
    """Pad [..., m] vectors to D dims and rotate them into a random direction."""
    padded = torch.zeros(*vectors.shape[:-1], D, dtype=torch.float64)
    padded[..., : vectors.shape[-1]] = vectors
    return padded @ _rotation(D).T


def helix(steps: int, speed: float = 1.0, turn: float = 0.1, warmup_angles=(2.0, 1.5)) -> torch.Tensor:
    """A helix walked at constant speed: the update Delta^(k) has norm ``speed``
    and turns by a constant angle ``turn`` from k = len(warmup_angles) + 1 on; the
    first turns are ``warmup_angles`` (irregular, large). States [K+1, 1, D]."""
    angles = [0.0]
    for k in range(1, steps):
        angles.append(angles[-1] + (warmup_angles[k - 1] if k - 1 < len(warmup_angles) else turn))
    angles_t = torch.tensor(angles, dtype=torch.float64)
    radial, lift = 0.8, 0.6  # radial**2 + lift**2 = 1
    deltas = speed * torch.stack(
        [radial * torch.cos(angles_t), radial * torch.sin(angles_t), torch.full_like(angles_t, lift)], dim=-1
    )
    return _from_steps(_embed(torch.tensor([3.0, -1.0, 0.5], dtype=torch.float64)), _embed(deltas))


def contraction(steps: int, ratio: float = 0.5) -> torch.Tensor:
    """x^(k) = x* + ratio^k e with ||e|| = ||x*|| = 1, e orthogonal to x*. States [K+1, 1, D]."""
    k = torch.arange(steps + 1, dtype=torch.float64)
    vectors = torch.stack([ratio**k, torch.ones_like(k)], dim=-1)  # (e, x*) coordinates
    return _embed(vectors)[:, None, :]


def line(deltas: list[float]) -> torch.Tensor:
    """Updates along one direction with the given signed lengths. States [K+1, 1, D]."""
    values = torch.tensor(deltas, dtype=torch.float64)[:, None]
    return _from_steps(torch.zeros(D, dtype=torch.float64), _embed(values))


def run(name: str, states: torch.Tensor, tau=None, **options) -> tuple[int, int]:
    used, computed = replay(name, states, tau=tau, **options)
    return int(used[0]), int(computed[0])


# ---------------------------------------------------------------- spiral / helix


def test_helix_has_the_intended_geometry():
    states = helix(30)
    deltas = states[1:, 0] - states[:-1, 0]
    assert torch.allclose(deltas.norm(dim=-1), torch.ones(30, dtype=torch.float64))
    accel = (deltas[1:] - deltas[:-1]).norm(dim=-1)
    steady = 2 * 0.8 * math.sin(0.1 / 2)  # chord of the turning radial part
    assert torch.allclose(accel[2:], torch.full_like(accel[2:], steady))
    assert (accel[:2] > 0.5).all()


def test_step_norm_never_fires_below_the_constant_speed():
    states = helix(30)
    assert run("step_norm", states, tau=0.99) == (30, 30)
    assert run("step_norm", states, tau=1.01) == (1, 1)  # above the speed: the first step


def test_acceleration_fires_once_the_turning_is_steady():
    # a^(1), a^(2) are large (warm-up turns); a^(k) = 2*0.8*sin(0.05) ~ 0.08 for k >= 3.
    # a^(k) is evaluated on step k+1: hits on steps 4 and 5, so the token exits on
    # step 5 (computed) and hands on x^(4), the state before that step.
    states = helix(30)
    assert run("acceleration", states, tau=0.2) == (4, 5)
    # Below the steady acceleration it never fires: used = computed = K.
    assert run("acceleration", states, tau=0.05) == (30, 30)


# ---------------------------------------------------------------- two hits


def test_a_single_spurious_dip_does_not_exit():
    # Delta lengths 1, 2, 2.001, 4, 8, 16: a = 1, 0.001 (dip, step 3), 1.999, 4, 8.
    states = line([1, 2, 2.001, 4, 8, 16])
    assert run("acceleration", states, tau=0.01) == (6, 6)


def test_two_consecutive_hits_exit():
    # a = 1, 0.001 (hit, step 3), 1.999, 0.0005 (hit, step 5), 0.0005 (hit, step 6):
    # the second consecutive hit is on step 6 -> computed 6, hands on x^(5).
    states = line([1, 2, 2.001, 4, 4.0005, 4.001, 10, 20])
    assert run("acceleration", states, tau=0.01) == (5, 6)


def test_earliest_acceleration_exit_is_step_three():
    states = line([1.0] * 10)  # a = 0 from step 2 on
    assert run("acceleration", states, tau=1e-3) == (2, 3)


def test_hit_on_the_last_step_hands_on_the_previous_state():
    # Algorithm 1 breaks on the k_max-th computed step too, returning x0 = x^(k_max - 1).
    states = line([1, 2, 3, 3, 3, 3])  # a = 1, 1, 0 (step 4), 0 (step 5), 0
    assert run("acceleration", states, tau=0.5, k_max=5) == (4, 5)
    assert run("acceleration", states, tau=0.5, k_max=4) == (4, 4)


# ---------------------------------------------------------------- contraction


@pytest.mark.parametrize(
    "name, tau, expected",
    [
        # ||Delta^(s-1)|| = 0.5^s: first below 0.01 at s = 7 (0.0078; 0.0156 at s = 6).
        ("step_norm", 0.01, (7, 7)),
        # ||x^(s-1)|| = sqrt(1 + 0.25^(s-1)) ~ 1, so the same step.
        ("step_norm_rel", 0.01, (7, 7)),
        # a on step s = 0.5^(s-2) * 0.25 = 0.5^s: hits from s = 7, second hit on 8.
        ("acceleration", 0.01, (7, 8)),
        # Eq. 6: (1 - r) / (1 + r) = 1/3 on every step from 2: hits on 2 and 3.
        ("acceleration_rel", 0.5, (2, 3)),
        # (eps = 0: with the default eps the ratio drops once ||Delta|| ~ eps, near step 20.)
        ("acceleration_rel", 0.3, (20, 20)),
        # a / ||x^(s-1)|| = 0.5^s / sqrt(1 + 0.25^(s-1)): hits from s = 7.
        ("acceleration_state", 0.01, (7, 8)),
        # angle(x^k) = atan(0.5^k); 1 - cos(step angle) first < 1e-4 at s = 7
        # (angles 0.01562, 0.00781 -> 1 - cos(0.007812) = 3.05e-5; s = 6: 1.22e-4).
        ("cosine", 1e-4, (7, 7)),
    ],
)
def test_geometric_contraction_exits_at_the_hand_computed_step(name, tau, expected):
    options = {"eps": 0.0} if name == "acceleration_rel" else {}
    assert run(name, contraction(20), tau=tau, **options) == expected


def test_contraction_hand_numbers_match_the_closed_form():
    states = contraction(20)[:, 0]
    deltas = states[1:] - states[:-1]
    assert deltas[6].norm().item() == pytest.approx(0.5**7)
    assert deltas[5].norm().item() == pytest.approx(0.5**6)
    cos7 = torch.nn.functional.cosine_similarity(states[7], states[6], dim=0).item()
    cos6 = torch.nn.functional.cosine_similarity(states[6], states[5], dim=0).item()
    assert 1 - cos7 < 1e-4 < 1 - cos6


# ---------------------------------------------------------------- fixed, caps


def test_fixed_returns_k():
    states = contraction(9)
    assert run("fixed", states) == (9, 9)
    used, computed = replay("fixed", states.expand(-1, 5, -1), k_max=4)
    assert used.tolist() == [4] * 5 and computed.tolist() == [4] * 5


def test_never_exiting_acceleration_uses_every_step():
    states = helix(12)
    used, computed = replay("acceleration", states, tau=1e-6)
    assert used.dtype == torch.long and computed.dtype == torch.long
    assert (used.item(), computed.item()) == (12, 12)


def test_replay_rejects_too_few_recorded_steps():
    with pytest.raises(RdepthError, match="still loop"):
        replay("acceleration", helix(5), tau=1e-6, k_max=8)


# ---------------------------------------------------------------- hand-off


@pytest.mark.parametrize("name, tau", [("acceleration", 0.3), ("step_norm", 0.5), ("acceleration_rel", 0.2)])
def test_handoff_is_the_state_at_index_used(name, tau):
    generator = torch.Generator().manual_seed(3)
    states = torch.cumsum(torch.randn(9, 40, 6, generator=generator, dtype=torch.float64) * 0.3, dim=0)
    policy = make_policy(name, tau=tau, k_max=8)
    policy.begin(states[0])
    rows = torch.arange(40)
    seen = 0
    for step in range(1, 9):
        done, handoff, used = policy.after_step(step, rows, states[step - 1, rows], states[step, rows])
        assert torch.equal(handoff[done], states[used[done], rows[done]])
        seen += int(done.sum())
        rows = rows[~done]
    assert seen == 40 and rows.numel() == 0


# ---------------------------------------------------------------- decoded rules


def _identity_decode(state: torch.Tensor) -> torch.Tensor:
    return state[:, :3]  # a linear head: logits are the first three coordinates


def _logit_states(logits: list[list[float]]) -> torch.Tensor:
    """States [K+1, 1, 3] whose decode is ``logits[k]`` (``s0`` first)."""
    return torch.tensor(logits, dtype=torch.float64)[:, None, :]


def test_kl_on_a_linear_decode_and_its_direction():
    # p1 uniform; p2 = (1/2, 1/4, 1/4); p3 = p2.
    # KL(p2 || p1) = 0.5 log 1.125 = 0.05889; the reverse KL(p1 || p2) = 0.05663.
    log2 = math.log(2.0)
    states = _logit_states([[9.0, -3.0, 1.0], [0, 0, 0], [log2, 0, 0], [log2, 0, 0], [0, 5, 0]])
    assert run("kl", states, tau=0.1, decode=_identity_decode) == (2, 2)
    assert run("kl", states, tau=0.058, decode=_identity_decode) == (3, 3)  # not the reverse direction
    assert run("kl", states, tau=0.0595, decode=_identity_decode) == (2, 2)
    # s0 is never decoded: a huge jump from s0 cannot make step 1 exit, nor can it count.
    assert run("kl", states, tau=1e9, decode=_identity_decode) == (2, 2)


def test_kl_matches_a_direct_computation_on_random_logits():
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(6, 50, 3, generator=generator, dtype=torch.float64)
    p = torch.softmax(states[1:], dim=-1)
    kl = (p[1:] * (p[1:].log() - p[:-1].log())).sum(-1)  # (K-1, N): KL on steps 2..K
    ordered = kl.flatten().sort().values
    tau = float(ordered[99] + ordered[100]) / 2  # between two values: no ties
    below = kl < tau
    first = torch.where(below.any(0), below.float().argmax(0) + 2, torch.full((50,), 5))
    used, computed = replay("kl", states, tau=tau, decode=_identity_decode)
    assert torch.equal(computed, first) and torch.equal(used, first)


def test_entropy_difference_and_argmax_stability():
    states = _logit_states([[0, 0, 0], [3, 0, 0], [0, 3, 0], [0, 3.2, 0], [0, 3.2, 0.1], [0, 3.3, 0]])
    # Entropies: step 2 and 3 equal (permuted logits) -> |dH| = 0 on step 2.
    assert run("entropy_diff", states, tau=1e-9, decode=_identity_decode) == (2, 2)
    # Top tokens: 0, 1, 1, 1, 1 on steps 1..5 -> unchanged on 3, 4, 5.
    assert run("argmax_stable", states, decode=_identity_decode, patience=1) == (3, 3)
    assert run("argmax_stable", states, decode=_identity_decode, patience=2) == (4, 4)
    assert run("argmax_stable", states, decode=_identity_decode, patience=9) == (5, 5)


def test_latent_rules_never_decode():
    def forbidden(state):
        raise AssertionError("a latent rule decoded")

    states = torch.cumsum(torch.randn(8, 30, 6, dtype=torch.float64), dim=0)
    for name, cls in POLICIES.items():
        if cls.needs_decode:
            continue
        tau = 0.5 if cls.uses_tau else None
        options = {"gate": random_gate(1, states.shape[-1])} if name == "learned" else {}
        if name == "ouro":
            options = {"gate": random_ouro_gate(states.shape[-1])}
        controller = PolicyController([make_policy(name, tau=tau, k_max=7, **options)], decode=forbidden)
        drive_recorded(controller, 0, states)


def test_decoded_rule_without_decode_is_a_user_error():
    with pytest.raises(RdepthError, match="decode"):
        replay("kl", helix(4), tau=0.1)


# ---------------------------------------------------------------- registry, validation


def test_unknown_policy_name_is_a_user_error():
    with pytest.raises(RdepthError, match="unknown exit policy 'nope'"):
        make_policy("nope", tau=1e-3)
    with pytest.raises(RdepthError, match="unknown exit policy"):
        replay("nope", helix(4), tau=1e-3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="acceleration"), "needs a threshold tau"),
        (dict(name="acceleration", tau=-1.0), "tau must be positive"),
        (dict(name="acceleration", tau=float("nan")), "tau must be positive"),
        (dict(name="fixed", tau=0.1), "takes no tau"),
        (dict(name="step_norm", tau=0.1, k_max=0), "k_max"),
        (dict(name="step_norm", tau=0.1, window=3), "unknown option"),
        (dict(name="argmax_stable", patience=0), "patience"),
        (dict(name="step_norm_rel", tau=0.1, eps=-1.0), "eps"),
    ],
)
def test_bad_settings_are_user_errors(kwargs, message):
    with pytest.raises(RdepthError, match=message):
        make_policy(**kwargs)


def test_controller_keeps_groups_independent():
    states = contraction(20)
    controller = controller_factory("step_norm", 0.01, [20, 5])()
    assert controller.max_steps(0) == 20 and controller.max_steps(1) == 5
    assert [t.item() for t in drive_recorded(controller, 0, states)] == [7, 7]
    assert [t.item() for t in drive_recorded(controller, 1, states)] == [5, 5]
    with pytest.raises(RdepthError, match="same policy object"):
        policy = make_policy("fixed", k_max=3)
        PolicyController([policy, policy])


def test_kl_every_reads_the_head_at_every_kth_step_and_compares_consecutive_readings():
    """Constructed logits (the decode is the identity): the distribution settles at step 2; the exact
    rule exits at step 3 (KL(p3 || p2) = 0), ``every=2`` reads steps 2 and 4 only and exits at 4."""
    from rdepth.exits.recorded import replay

    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [5.0, 0.0, 0.0], [5.0, 0.0, 0.0],
                           [5.0, 0.0, 0.0]], dtype=torch.float64).unsqueeze(1)  # [K+1 = 6, N = 1, 3]
    reads = []

    def decode(state):
        reads.append(state.shape[0])
        return state

    used, computed = replay("kl", logits, 1e-6, decode=decode)
    assert (int(computed[0]), int(used[0])) == (3, 3) and len(reads) == 3
    reads.clear()
    used, computed = replay("kl", logits, 1e-6, decode=decode, every=2)
    assert (int(computed[0]), int(used[0])) == (4, 4) and len(reads) == 2  # the head read at steps 2 and 4
    with pytest.raises(RdepthError, match="every must be a positive integer"):
        replay("kl", logits, 1e-6, decode=decode, every=0)
