"""The Raptor surrogate: exact at k = L, fitting lowers the error, checkpoints round-trip."""

from __future__ import annotations

import gzip
import struct

import pytest
import torch
from torch import nn

from rdepth.errors import RdepthError
from rdepth.surrogate.bank import build_bank
from rdepth.surrogate.evaluate import collect_states, fidelity, surrogate_fn, truncated_fn
from rdepth.surrogate.fit import FitConfig, fit_surrogate, force_probability
from rdepth.surrogate.hf_loader import Gpt2Embedding
from rdepth.surrogate.layers import LayerSpec, Teacher, TransformerLayer
from rdepth.surrogate.model import RaptorSurrogate, SurrogateConfig, load_surrogate

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
        for a, b in zip(teacher.layer_states(ids, mask), surrogate.layer_states(ids, mask)):
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
    from rdepth.surrogate.vit import ViTClassifier, ViTConfig, load_fashion_mnist

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
