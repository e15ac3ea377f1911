"""CounterNoise (TrainConfig.state_noise = "counter"): the initial loop states as a counter-based hash of
(seed, group, sequence, position, channel). Bit for bit the same whatever the batching, equal to the
hash on unbounded ints at extreme ids (no int64 overflow), the 3-sigma truncated normal, and a training
run with it that two ranks reproduce and that learns."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rdepth.model.noise import (
    _MUL1,
    _MUL2,
    _SPREAD,
    CounterNoise,
    _bits_tensor,
    _element_keys,
    _group_lanes,
    _sequence_lanes,
    counter_bits_reference,
    counter_draw,
    counter_truncated_normal,
)

STD = 0.5


def _hash_bits(seed: int, group: int, ids: list[int], start: int, length: int, width: int) -> torch.Tensor:
    """The tensor code's 32-bit hashes ``[B, length, width]`` (int64)."""
    lanes = _group_lanes(_sequence_lanes(seed, torch.tensor(ids, dtype=torch.int64)), group).view(2, -1, 1, 1)
    return _bits_tensor(lanes[0], lanes[1], _element_keys(start, length, width, "cpu"))


def test_a_row_is_the_same_whatever_the_batch_and_positions_drawn():
    full = CounterNoise.consecutive(7, 100, 6).draw(1, 6, 0, 12, 24, STD, "cpu", 32)  # [6, 12, 24]
    assert full.dtype == torch.float32 and full.shape == (6, 12, 24)
    # other compositions: a rank's slice, rows out of order, one row
    assert torch.equal(CounterNoise.consecutive(7, 102, 3).draw(1, 3, 0, 12, 24, STD, "cpu", 32), full[2:5])
    assert torch.equal(CounterNoise(7, [105, 100, 103]).draw(1, 3, 0, 12, 24, STD, "cpu", 32), full[[5, 0, 3]])
    assert torch.equal(CounterNoise(7, torch.tensor([104])).draw(1, 1, 0, 12, 24, STD, "cpu", 32), full[4:5])
    # a position range, and one position at a time (as cached decoding asks), from one noise object
    noise = CounterNoise.consecutive(7, 100, 6)
    assert torch.equal(noise.draw(1, 6, 5, 4, 24, STD, "cpu", 32), full[:, 5:9])
    steps = [noise.draw(1, 6, position, 1, 24, STD, "cpu", 32) for position in range(12)]
    assert torch.equal(torch.cat(steps, dim=1), full)
    # the whole-draw function (no caching) is the same computation
    ids = torch.arange(100, 106)
    assert torch.equal(counter_truncated_normal(ids, 7, 1, 0, 12, 24, STD), full)
    # a longer block or another block size does not move a position's values
    assert torch.equal(noise.draw(1, 6, 0, 20, 24, STD, "cpu", 64)[:, :12], full)


def test_through_the_model_as_state_noise_is_used():
    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM

    model = RecurrentLM(ModelConfig(n_layer=3, n_head=2, d_model=16, block_size=8, vocab_size=32, groups="1",
                                    init_state_scale=1.0))
    inputs = torch.zeros(4, 6, 16)
    full = model.init_state(0, inputs, CounterNoise.consecutive(3, 0, 4))
    split = torch.cat([model.init_state(0, inputs[:2], CounterNoise.consecutive(3, 0, 2)),
                       model.init_state(0, inputs[2:], CounterNoise(3, [2, 3]))])
    assert torch.equal(split, full)
    assert torch.equal(model.init_state(0, inputs[:, 2:4], CounterNoise.consecutive(3, 0, 4), start=2), full[:, 2:4])
    assert full.abs().max() <= 3 * model.init_state_std + 1e-6
    assert model.init_state(0, inputs.to(torch.bfloat16), CounterNoise.consecutive(3, 0, 4)).dtype == torch.bfloat16


def test_keys_that_differ_in_one_part_give_unrelated_values():
    base = dict(seed=5, group=0, ids=[0], start=0)

    def draw(seed=5, group=0, ids=(0,), start=0):
        return CounterNoise(seed, list(ids)).draw(group, len(ids), start, 16, 64, STD, "cpu", 64)

    reference = draw()
    others = [draw(seed=6), draw(seed=5 + 2**32), draw(group=1), draw(ids=(1,)), draw(ids=(2**32,)), draw(start=16)]
    for other in others:  # equal 24-bit values by chance only: ~2**-24 of the elements
        assert float((other == reference).float().mean()) < 1e-3
    # neighbouring channels and positions within a row, and rows within a batch, differ too
    assert float((reference[0, :, 1:] == reference[0, :, :-1]).float().mean()) < 1e-3
    assert base  # (the keys above span every part: seed low and high word, group, id low and high word, position)


def test_hashes_collide_only_as_often_as_a_uniform_32_bit_hash_would():
    """1,572,864 elements over seeds, groups, sequence ids (low and high words), positions and channels: a
    uniform 32-bit hash gives n(n-1)/2**33 ~ 288 equal pairs (sd ~17); a mixing flaw (a key part that
    cancels out or is ignored) gives thousands. Within a row no two elements may share one (a bijection)."""
    ids = list(range(32)) + [2**32 + i for i in range(32)]
    rows = [_hash_bits(seed, group, ids, 0, 64, 64).flatten(1) for seed in (0, 1) for group in (0, 1, 2)]
    values = torch.cat(rows).flatten()
    n = values.numel()
    assert n == 1572864 and int(values.min()) >= 0 and int(values.max()) < 2**32
    expected = n * (n - 1) / 2**33
    assert abs((n - torch.unique(values).numel()) - expected) < 5 * math.sqrt(expected)
    for row in torch.cat(rows):
        assert torch.unique(row).numel() == row.numel()


def test_the_tensor_hash_equals_the_hash_on_unbounded_ints_at_extreme_ids():
    """Python ints never overflow, so equality shows the int64 code never wrapped. Bound, analytically:
    every operand is below 2**32 and the multipliers below 2**31, so a product is below 2**63."""
    assert max(_MUL1, _MUL2, _SPREAD) < 2**31 and (2**32 - 1) * max(_MUL1, _MUL2, _SPREAD) < 2**63
    ids = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**40 + 1, 2**62, 2**63 - 1]
    width, start, length = 768, 2**22 - 2, 2  # flat element index near 2**32
    for seed in (0, 2**40 + 3, 2**63 - 1):
        for group in (0, 2):
            tensor = _hash_bits(seed, group, ids, start, length, width)
            for row, sequence in enumerate(ids):
                for position in (0, 1):
                    for channel in (0, 1, width - 1):
                        expected = counter_bits_reference(seed, group, sequence, start + position, channel, width)
                        assert int(tensor[row, position, channel]) == expected, (seed, group, sequence)
    # the value is the inverse truncated-normal CDF of the hash's top 24 bits (float64 reference)
    draw = CounterNoise(2**63 - 1, [2**63 - 1, 2**40]).draw(2, 2, 3, 2, 8, STD, "cpu", 8)
    low = math.erf(-3 / math.sqrt(2))
    for row, sequence in enumerate((2**63 - 1, 2**40)):
        for position in (0, 1):
            for channel in range(8):
                top = counter_bits_reference(2**63 - 1, 2, sequence, 3 + position, channel, 8) >> 8
                expected = math.sqrt(2) * STD * _erfinv(low + top * 2.0**-24 * (-2 * low))
                assert float(draw[row, position, channel]) == pytest.approx(expected, abs=2e-5)
    with pytest.raises(ValueError, match="sequence ids"):
        CounterNoise(0, [-1])
    with pytest.raises(ValueError, match="seed"):
        CounterNoise(2**63, [0])
    with pytest.raises(ValueError, match="exceed 2\\*\\*32"):
        CounterNoise(0, [0]).draw(0, 1, 2**22, 1, 1024, STD, "cpu", 2**23)
    with pytest.raises(ValueError, match="for a batch of 3"):
        CounterNoise(0, [0, 1]).draw(0, 3, 0, 1, 8, STD, "cpu", 8)


def _erfinv(y: float) -> float:
    """erfinv by Newton's method on math.erf (float64)."""
    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


def _phi(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def test_the_values_follow_the_three_sigma_truncated_normal():
    values = CounterNoise.consecutive(11, 0, 8).draw(0, 8, 0, 64, 256, STD, "cpu", 64)  # 131,072 values
    flat = values.double().flatten()
    n = flat.numel()
    # the exact std of the normal truncated at +-3 sigma: sqrt(1 - 6 phi(3) / (Phi(3) - Phi(-3)))
    density = math.exp(-4.5) / math.sqrt(2 * math.pi)
    mass = math.erf(3 / math.sqrt(2))
    factor = math.sqrt(1 - 6 * density / mass)
    assert factor == pytest.approx(0.98658, abs=1e-5)
    assert abs(float(flat.mean())) < 4 * STD / math.sqrt(n)
    assert float(flat.std()) == pytest.approx(STD * factor, rel=0.005)  # ~2.5 standard errors
    assert float(flat.abs().max()) <= 3 * STD
    # Kolmogorov-Smirnov against the truncated normal's CDF: 1.95 / sqrt(n) is the 0.1% critical value
    ordered = flat.sort().values
    cdf = (_phi(ordered / STD) - _phi(torch.tensor(-3.0, dtype=torch.float64))) / mass
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    statistic = float(torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max())
    assert statistic < 1.95 / math.sqrt(n)
    # neighbours are uncorrelated: channels, positions, rows, groups, seeds
    def correlation(a, b):
        return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])

    bound = 5 / math.sqrt(values[..., 1:].numel())
    assert abs(correlation(values[..., 1:], values[..., :-1])) < bound
    assert abs(correlation(values[:, 1:], values[:, :-1])) < bound
    assert abs(correlation(values[1:], values[:-1])) < bound
    other_group = CounterNoise.consecutive(11, 0, 8).draw(1, 8, 0, 64, 256, STD, "cpu", 64)
    other_seed = CounterNoise.consecutive(12, 0, 8).draw(0, 8, 0, 64, 256, STD, "cpu", 64)
    assert abs(correlation(values, other_group)) < bound and abs(correlation(values, other_seed)) < bound


def test_the_draw_compiles_into_one_graph_for_every_group_with_the_same_values(monkeypatch):
    """fullgraph=True: no graph break, no host sync (an .item() or a data-dependent branch would break it);
    one graph serves every group and step (the group travels as a tensor; a recompile per group would hit
    dynamo's limit of 8 and, with fullgraph, fail). The counting backend runs the traced aten ops, so the
    values are the eager ones bit for bit (Inductor fuses them; its erfinv may differ in the last bit)."""
    from torch._dynamo.testing import CompileCounter

    import rdepth.model.noise as noise

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(noise, "_compiled_draw",
                        torch.compile(counter_draw, fullgraph=True, dynamic=False, backend=counter))
    for group in range(10):
        for first in (2**40, 2**40 + 3):  # two steps' rows
            eager = CounterNoise.consecutive(4, first, 3).draw(group, 3, 0, 8, 16, STD, "cpu", 8)
            compiled = CounterNoise.consecutive(4, first, 3, compile=True).draw(group, 3, 0, 8, 16, STD, "cpu", 8)
            assert torch.equal(compiled, eager), group
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_draw_on_cuda_follows_the_eager_one():
    """Inductor on CUDA: the draw compiles (at b5dbf74 it folded the seed's keys into an index literal
    out of int32's range and failed) and gives the eager CUDA values and the CPU ones to erfinv's last
    bits, for every group (sequence ids past 2**40, positions from 100)."""
    import rdepth.model.noise as noise

    torch._dynamo.reset()
    noise._compiled_draw = None
    for group in range(3):
        cpu = CounterNoise.consecutive(4, 2**40, 8).draw(group, 8, 100, 64, 256, STD, "cpu", 256)
        eager = CounterNoise.consecutive(4, 2**40, 8).draw(group, 8, 100, 64, 256, STD, "cuda", 256)
        compiled = CounterNoise.consecutive(4, 2**40, 8, compile=True).draw(group, 8, 100, 64, 256, STD, "cuda", 256)
        torch.testing.assert_close(eager.cpu(), cpu, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- training with state_noise = counter
def _configs(data, out, **train):
    from rdepth.config import ModelConfig
    from rdepth.train.config import TrainConfig

    model = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=42, groups="1", mean_loops=3.0,
                        backprop_depth=2, tokenizer="task:chase")
    settings = dict(data=str(data), out=str(out), max_steps=6, batch_size=8, lr=3e-3, warmup_steps=2, eval_every=6,
                    checkpoint_every=6, eval_batches=1, log_every=1, threads=1, seed=3, state_noise="counter")
    settings.update(train)
    return model, TrainConfig(**settings)


def test_the_trainer_draws_counter_noise_keyed_by_the_global_row(tmp_path):
    """Each micro-batch's noise holds its rows' places in the global batch; counter and sequence noise
    are different draws (the field is used)."""
    from rdepth.config import ModelConfig
    from rdepth.model.noise import StateNoise
    from rdepth.train.config import TrainConfig
    from rdepth.train.step import TrainStep

    model_config = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=64, groups="1",
                               mean_loops=3.0, backprop_depth=2, tokenizer="bpe:512")
    config = TrainConfig(data=str(tmp_path / "none"), out=str(tmp_path / "none"), batch_size=8, grad_accum=2,
                         device="cpu", seed=3, max_steps=10, warmup_steps=1, threads=1, state_noise="counter")
    trainer = TrainStep.on_tokens(model_config, config)
    batches = list(trainer._micro_batches(5))
    assert [type(noise) for *_, noise in batches] == [CounterNoise, CounterNoise]
    assert [noise.sequence_ids for *_, noise in batches] == [list(range(40, 44)), list(range(44, 48))]
    assert not batches[0][3].compile  # the CPU run compiles nothing
    plain = TrainStep.on_tokens(model_config, replace(config, state_noise="sequence"))
    assert [type(noise) for *_, noise in plain._micro_batches(5)] == [StateNoise, StateNoise]
    losses = [float(t.train_step(0)[0]) for t in (trainer, plain)]
    assert losses[0] != losses[1]


def test_the_gpu_suite_trainer_takes_counter_noise_and_compiles_its_draw_when_it_compiles(tmp_path):
    """``bench.gpu_suite --train-set state_noise=counter`` reaches the trainer; a compiling trainer (the
    default on CUDA) hands the draw to torch.compile too (nothing is compiled until a step runs)."""
    from bench.gpu.suite import parse_args
    from bench.gpu.train import bench_trainer
    from rdepth.config import ModelConfig

    args = parse_args(["--out", str(tmp_path), "--train-set", "state_noise=counter"])
    assert args.train_set == {"state_noise": "counter"}
    model_config = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=64, groups="1",
                               mean_loops=3.0, backprop_depth=2, tokenizer="bpe:512")
    for compile_layers in (False, True):
        trainer = bench_trainer(model_config, 2, torch.device("cpu"), compile_layers, **args.train_set)
        [(_, _, _, noise)] = list(trainer._micro_batches(0))
        assert isinstance(noise, CounterNoise) and noise.compile == compile_layers


@pytest.mark.slow
def test_two_ranks_with_counter_noise_train_the_one_process_run(small_chase_data, tmp_path):
    from safetensors.torch import load_file

    from rdepth.train.ranks import train_ranks

    model, train = _configs(small_chase_data, tmp_path / "two")
    train_ranks(model, train, 2, tmp_path / "logs")
    train_ranks(model, replace(train, out=str(tmp_path / "one")), 1, tmp_path / "logs")
    two = load_file(str(tmp_path / "two" / "checkpoints" / "step_000006" / "model.safetensors"))
    one = load_file(str(tmp_path / "one" / "checkpoints" / "step_000006" / "model.safetensors"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5)  # a sum in another order


def test_a_counter_noise_run_learns_evaluates_and_resumes_only_with_the_same_noise(small_chase_data, tmp_path, capsys):
    import json

    from rdepth.cli.main import main
    from rdepth.train.trainer import train

    model, config = _configs(small_chase_data, tmp_path / "run", max_steps=30, eval_every=30, checkpoint_every=15)
    train(model, replace(config, stop_at=15))
    train(model, config, resume=True)  # the same noise continues
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert losses[30] < losses[1] - 0.5
    assert math.isfinite(json.loads((tmp_path / "run" / "summary.json").read_text())["final_val"]["ce"])
    # evaluation draws sequence noise whatever trained the model: the same distribution
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(small_chase_data), "--max-batches", "1",
                 "--threads", "1"]) == 0
    capsys.readouterr()
    code = main(["train", "--data", str(small_chase_data), "--out", str(tmp_path / "run"), "--resume", "--max-steps", "40",
                 "--state-noise", "sequence", "--threads", "1"])
    assert code == 2
    assert "state_noise 'counter' (saved) vs 'sequence'" in capsys.readouterr().err
