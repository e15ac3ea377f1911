"""The Raptor surrogate: exact at k = L, fitting lowers the error, checkpoints round-trip."""

from __future__ import annotations

import gzip
import json
import struct

import pytest
import torch
from torch import nn

from rdepth.errors import RdepthError
from rdepth.surrogate.bank import build_bank
from rdepth.surrogate.fit import FitConfig, fit_surrogate, force_probability, stage_force, stage_loss, state_loss
from rdepth.surrogate.measure.fidelity import collect_states, fidelity, surrogate_fn, truncated_fn
from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig, load_surrogate
from rdepth.surrogate.teachers.hf_loader import Gpt2Embedding
from rdepth.surrogate.teachers.layers import LayerSpec, Teacher, TransformerLayer

pytestmark = pytest.mark.usefixtures("one_thread")

def random_teacher(n_layers=4, norm_position="post", causal=False, seed=0) -> Teacher:
    torch.manual_seed(seed)
    spec = LayerSpec(d_model=16, n_heads=2, d_ff=24, norm_position=norm_position, causal=causal, norm_eps=1e-5)
    teacher = Teacher(Gpt2Embedding(30, 20, 16), [TransformerLayer(spec) for _ in range(n_layers)],
                      nn.LayerNorm(16) if norm_position == "pre" else None, spec)
    teacher.eval().requires_grad_(False)
    return teacher


def batches(n_batches=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(n_batches):
        ids = torch.randint(0, 30, (6, 9), generator=g)
        mask = torch.ones(6, 9, dtype=torch.bool)
        mask[0, 5:] = False
        result.append((ids, mask, None))
    return result


@pytest.mark.parametrize("norm_position,causal", [("post", False), ("pre", True)])
def test_k_equals_l_reproduces_teacher_exactly(norm_position, causal):
    teacher = random_teacher(norm_position=norm_position, causal=causal)
    surrogate = RaptorSurrogate(teacher, SurrogateConfig((1, 1, 1, 1))).eval()
    ids, mask, _ = batches(1)[0]
    with torch.no_grad():
        for a, b in zip(teacher.layer_states(ids, mask), surrogate.layer_states(ids, mask), strict=False):
            assert torch.equal(a, b)
        assert torch.equal(teacher(ids, mask), surrogate(ids, mask))


def test_shared_block_is_applied_per_phase_with_iteration_embedding():
    teacher = random_teacher()
    surrogate = RaptorSurrogate(teacher, SurrogateConfig((3, 1))).eval()
    assert surrogate.block_of == [0, 0, 0, 1]
    with torch.no_grad():
        surrogate.iteration[1] = 0.5
    ids, mask, _ = batches(1)[0]
    with torch.no_grad():
        states = surrogate.layer_states(ids, mask)
        expected = teacher.embedding(ids)
        for depth in range(4):
            layer = teacher.layers[0] if depth < 3 else teacher.layers[3]
            expected = layer(expected + (0.5 if depth == 1 else 0.0), mask)
            assert torch.allclose(states[depth + 1], expected, atol=1e-6)


def test_full_teacher_forcing_is_one_step_prediction():
    teacher = random_teacher()
    bank = build_bank(teacher, batches(1))
    surrogate = RaptorSurrogate(teacher, SurrogateConfig((2, 2))).eval()
    batch = bank.batches[0]
    states = batch.state_list()
    with torch.no_grad():
        forced = surrogate.rollout(states[0], batch.mask, teacher_states=states, force_prob=1.0)
        for depth in range(4):
            assert torch.allclose(forced[depth], surrogate.step(states[depth], depth, batch.mask))


def test_fit_lowers_error_and_checkpoint_round_trips(tmp_path):
    teacher = random_teacher(seed=3)
    bank = build_bank(teacher, batches(4))
    surrogate = RaptorSurrogate(teacher, SurrogateConfig((2, 2)))
    true, mask = bank.stacked()
    before = fidelity(collect_states(surrogate_fn(surrogate), bank)[0], true, mask, teacher.readout)
    config = FitConfig(steps_block=10, steps_joint=15, lr=3e-3, log_every=5)
    summary = fit_surrogate(surrogate, bank, config, tmp_path / "metrics.jsonl")
    after = fidelity(collect_states(surrogate_fn(surrogate), bank)[0], true, mask, teacher.readout)
    assert after["final_rel_mse"] < before["final_rel_mse"]
    assert summary["lengths"] == [2, 2] and (tmp_path / "metrics.jsonl").read_text().count("\n") == 2 + 2 + 3
    surrogate.save(tmp_path / "ckpt")
    loaded = load_surrogate(tmp_path / "ckpt", teacher)
    ids, mask_, _ = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(surrogate(ids, mask_), loaded(ids, mask_))
    with pytest.raises(RdepthError, match="another shape"):
        load_surrogate(tmp_path / "ckpt", random_teacher(norm_position="pre"))


def test_mixed_forcing_weighs_one_step_and_free_rollout_losses():
    """The reference code's scheme: r x one-step loss + (1 - r) x free-rollout loss, on hand-built rollouts."""
    teacher = random_teacher(seed=3)
    bank = build_bank(teacher, batches(1))
    surrogate = RaptorSurrogate(teacher, SurrogateConfig((1, 3))).eval()  # block 1 stands in for 3 layers
    batch = bank.batches[0]
    states, mask = batch.state_list(), batch.mask
    scale = bank.depth_scale().clamp_min(1e-12)
    mixed, anneal = FitConfig(forcing="mixed"), FitConfig()
    with torch.no_grad():
        for start, stop in ((0, 4), (1, 4)):  # the whole stack (stage 2) and one phase (stage 1)
            one_step = state_loss([surrogate.step(states[d], d, mask) for d in range(start, stop)],
                                  states[start + 1: stop + 1], mask, scale[start + 1: stop + 1], 1.0)
            free_states, state = [], states[start]
            for depth in range(start, stop):
                state = surrogate.step(state, depth, mask)
                free_states.append(state)
            free = state_loss(free_states, states[start + 1: stop + 1], mask, scale[start + 1: stop + 1], 1.0)
            assert not torch.isclose(one_step, free, rtol=1e-3)  # the two losses differ here
            for weight in (0.0, 0.3, 1.0):
                got = stage_loss(surrogate, states, mask, start, stop, scale, mixed, weight)
                assert torch.allclose(got, weight * one_step + (1 - weight) * free, rtol=1e-6)
            # "anneal" at probability 1 / 0 is the same one-step / free-rollout loss
            assert torch.allclose(stage_loss(surrogate, states, mask, start, stop, scale, anneal, 1.0), one_step)
            assert torch.allclose(stage_loss(surrogate, states, mask, start, stop, scale, anneal, 0.0), free)
    # schedules: "mixed" anneals r in stage 1 and rolls out freely throughout stage 2, as the reference's runs
    config = FitConfig(forcing="mixed", anneal_fraction=0.5)
    assert [stage_force(s, 10, config, joint=False) for s in (0, 2, 5, 9)] == [1.0, 0.6, 0.0, 0.0]
    assert [stage_force(s, 10, config, joint=True) for s in range(10)] == [0.0] * 10
    assert [stage_force(s, 10, FitConfig(anneal_fraction=0.5), joint=True) for s in (0, 2)] == [1.0, 0.6]


def test_input_noise_is_added_to_every_block_input():
    teacher = random_teacher()
    surrogate = RaptorSurrogate(teacher, SurrogateConfig((2, 2))).eval()
    ids, mask, _ = batches(1)[0]
    with torch.no_grad():
        start = teacher.embedding(ids)
        torch.manual_seed(7)
        noisy = surrogate.rollout(start, mask, input_noise=0.1)
        torch.manual_seed(7)
        state = start
        for depth in range(4):
            state = surrogate.step(state + 0.1 * torch.randn_like(state), depth, mask)
            assert torch.equal(noisy[depth], state)
        assert not torch.allclose(noisy[-1], surrogate.rollout(start, mask)[-1])


def test_fit_with_the_reference_scheme_lowers_error(tmp_path):
    teacher = random_teacher(seed=3)
    bank = build_bank(teacher, batches(4))
    surrogate = RaptorSurrogate(teacher, SurrogateConfig((2, 2)))
    true, mask = bank.stacked()
    before = fidelity(collect_states(surrogate_fn(surrogate), bank)[0], true, mask, teacher.readout)
    config = FitConfig(steps_block=10, steps_joint=15, lr=3e-3, log_every=5, forcing="mixed", input_noise=1e-3)
    summary = fit_surrogate(surrogate, bank, config, tmp_path / "metrics.jsonl")
    after = fidelity(collect_states(surrogate_fn(surrogate), bank)[0], true, mask, teacher.readout)
    assert after["final_rel_mse"] < before["final_rel_mse"] and summary["forcing"] == "mixed"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["forcing"] for r in records} == {"mixed"}
    assert [r["force_prob"] for r in records if r["stage"].endswith("joint")] == [0.0, 0.0, 0.0]
    assert records[0]["force_prob"] > 0.0  # stage 1 starts mostly one-step
    with pytest.raises(RdepthError, match="forcing"):
        FitConfig(forcing="scheduled")
    with pytest.raises(RdepthError, match="input_noise"):
        FitConfig(input_noise=-1.0)


def test_truncated_baseline_holds_state_after_k():
    teacher = random_teacher()
    bank = build_bank(teacher, batches(1))
    states = truncated_fn(2)(bank.batches[0])
    assert torch.equal(states[2], states[3]) and torch.equal(states[4], bank.batches[0].states[2])


def test_config_validation():
    teacher = random_teacher()
    with pytest.raises(RdepthError, match="sum to 5"):
        RaptorSurrogate(teacher, SurrogateConfig((2, 3)))
    with pytest.raises(RdepthError, match="positive"):
        SurrogateConfig((0, 4))
    with pytest.raises(RdepthError, match="force_end"):
        FitConfig(force_end=1.5)
    with pytest.raises(RdepthError, match="lr"):
        FitConfig(lr=0.0)
    config = FitConfig(force_start=1.0, force_end=0.0, anneal_fraction=0.5)
    assert [force_probability(s, 10, config) for s in (0, 2, 5, 9)] == [1.0, 0.6, 0.0, 0.0]


def test_fashion_mnist_reader_and_tiny_vit(tmp_path):
    from rdepth.surrogate.teachers.vit import ViTClassifier, ViTConfig, load_fashion_mnist

    images = torch.arange(2 * 28 * 28, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(2, 28, 28)
    for name, tensor in (("t10k-images-idx3-ubyte.gz", images), ("t10k-labels-idx1-ubyte.gz", torch.tensor([3, 7]))):
        header = struct.pack(">HBB", 0, 8, tensor.ndim) + struct.pack(">" + "I" * tensor.ndim, *tensor.shape)
        (tmp_path / name).write_bytes(gzip.compress(header + tensor.to(torch.uint8).numpy().tobytes()))
    x, y = load_fashion_mnist("test", tmp_path)
    assert x.shape == (2, 1, 28, 28) and y.tolist() == [3, 7]
    assert float(x[0, 0, 0, 1]) == pytest.approx((1 / 255 - 0.2860) / 0.3530)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(RdepthError, match="gzip"):
        load_fashion_mnist("test", tmp_path)
    model = ViTClassifier(ViTConfig(d_model=16, n_heads=2, d_ff=16, n_layers=2, drop_path=0.2)).eval()
    assert model(x).shape == (2, 10)
    assert len(model.backbone.layer_states(x)) == 3 and model.backbone.layer_states(x)[0].shape == (2, 17, 16)
