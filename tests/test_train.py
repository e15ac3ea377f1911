"""Training: exact resume, DDP parity, checkpoints, CLI errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rdepth.cli.main import main
from rdepth.io import read_jsonl
from rdepth.run.checkpoint import list_checkpoints, load_model
from rdepth.train.ranks import free_port

TINY = [
    "--n-layer", "3", "--n-head", "2", "--d-model", "32", "--block-size", "32",
    "--groups", "1", "--mean-loops", "3", "--backprop-depth", "2", "--threads", "1",
]


def train_cli(data, out, *extra) -> int:
    return main([
        "train", "--data", str(data), "--out", str(out), "--batch-size", "4", "--log-every", "1",
        "--eval-every", "3", "--eval-batches", "1", "--checkpoint-every", "3", "--warmup-steps", "2",
        *TINY, *extra,
    ])


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(list_checkpoints(run)[-1] / "model.safetensors"))


def test_resume_is_exact(wiki_small, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train_cli(wiki_small, straight, "--max-steps", "6") == 0
    assert train_cli(wiki_small, split, "--max-steps", "6", "--stop-at", "3") == 0
    assert [p.name for p in list_checkpoints(split)] == ["step_000003"]
    assert train_cli(wiki_small, split, "--max-steps", "6", "--resume") == 0
    assert losses(straight) == losses(split)
    a, b = weights(straight), weights(split)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # checkpoints are kept as a series
    assert [p.name for p in list_checkpoints(straight)] == ["step_000003", "step_000006"]


def test_training_lowers_loss_and_writes_run(wiki_small, tmp_path):
    run = tmp_path / "run"
    assert train_cli(wiki_small, run, "--max-steps", "30", "--lr", "3e-3") == 0
    record = losses(run)
    assert record[30] < record[1] - 0.5
    for name in ("config.json", "environment.json", "summary.json", "metrics.jsonl", "tokenizer"):
        assert (run / name).exists(), name
    model, config = load_model(run)
    assert config.groups == "1" and config.vocab_size == 512
    assert main(["eval", "--checkpoint", str(run), "--data", str(wiki_small), "--loops", "1",
                 "--loops", "3", "--max-batches", "2"]) == 0
    assert main(["generate", "--checkpoint", str(run), "--prompt", "The city", "--max-new-tokens", "5"]) == 0


@pytest.mark.slow
def test_two_process_ddp_matches_single_process(wiki_small, tmp_path):
    worker = Path(__file__).with_name("ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    for world, name in ((2, "ddp"), (1, "single")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_port", str(free_port()), str(worker),
               str(wiki_small), str(tmp_path / name), str(tmp_path / f"{name}_rank")]
        if world == 1:
            cmd = [sys.executable, str(worker), str(wiki_small), str(tmp_path / name), str(tmp_path / f"{name}_rank")]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    rank0 = load_file(str(tmp_path / "ddp_rank0.safetensors"))
    rank1 = load_file(str(tmp_path / "ddp_rank1.safetensors"))
    single = load_file(str(tmp_path / "single_rank0.safetensors"))
    for name in single:
        assert torch.equal(rank0[name], rank1[name]), f"ranks diverged at {name}"
        torch.testing.assert_close(rank0[name], single[name], rtol=1e-4, atol=1e-5)
    assert losses(tmp_path / "ddp").keys() == losses(tmp_path / "single").keys()
    for step, loss in losses(tmp_path / "single").items():
        assert abs(losses(tmp_path / "ddp")[step] - loss) < 1e-4


# ---------------------------------------------------------------- bad input
def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_group_spec_is_one_line(wiki_small, tmp_path, capsys):
    assert train_cli(wiki_small, tmp_path / "r", "--groups", "2-1", "--max-steps", "1") == 2
    assert "runs backwards" in _error_line(capsys)
    assert not (tmp_path / "r").exists()


def test_missing_and_empty_data(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "not found" in _error_line(capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    assert main(["prepare", "--corpus", str(empty), "--out", str(tmp_path / "d")]) == 2
    assert "empty" in _error_line(capsys).lower()


def test_existing_run_is_not_overwritten_and_mismatch_rejected(wiki_small, tmp_path, capsys):
    run = tmp_path / "run"
    assert train_cli(wiki_small, run, "--max-steps", "3") == 0
    before = (list_checkpoints(run)[-1] / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert train_cli(wiki_small, run, "--max-steps", "3") == 2
    assert "--resume" in _error_line(capsys)
    assert train_cli(wiki_small, run, "--max-steps", "6", "--resume", "--d-model", "48") == 2
    assert "does not match" in _error_line(capsys)
    assert (list_checkpoints(run)[-1] / "model.safetensors").read_bytes() == before


def test_corrupt_checkpoint_is_one_line(wiki_small, tmp_path, capsys):
    run = tmp_path / "run"
    assert train_cli(wiki_small, run, "--max-steps", "3") == 0
    capsys.readouterr()
    weights_file = list_checkpoints(run)[-1] / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[: len(data) // 2])
    assert main(["eval", "--checkpoint", str(run), "--data", str(wiki_small)]) == 2
    assert "corrupt or truncated" in _error_line(capsys)
    config_file = list_checkpoints(run)[-1] / "config.json"
    config_file.write_text("{not json")
    assert main(["eval", "--checkpoint", str(run), "--data", str(wiki_small)]) == 2
    assert "not valid JSON" in _error_line(capsys)


def test_lr_schedule():
    from rdepth.train.config import TrainConfig
    from rdepth.train.optim import lr_at

    config = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(60, config) == pytest.approx(0.55)
    assert lr_at(110, config) == pytest.approx(0.1)


@pytest.mark.parametrize("command", [None, "prepare", "train", "eval", "generate", "analyze", "sweep", "surrogate", "demo"])
def test_help(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


def _exit_code(argv) -> int:
    """main()'s return value, or the status of the SystemExit argparse raises."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["train", "--preset", "huge"], "invalid choice: 'huge'"),
        (["train", "--max-steps", "x"], "expects int"),
        (["prepare", "--tokenizer", "wordpiece", "--out", "unused"], "tokenizer"),
        (["eval", "--checkpoint", "nowhere", "--data", "nowhere"], "not found"),
    ],
)
def test_bad_flags_are_one_line(argv, fragment, capsys):
    assert _exit_code(argv) == 2
    assert fragment in _error_line(capsys)


def test_batches_go_to_the_cpu_as_they_are():
    from rdepth.train.step import host_for_copy

    batch = torch.arange(12).view(3, 4)
    assert host_for_copy(batch, torch.device("cpu")) is batch  # no pinning, no copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_go_to_cuda_through_pinned_memory():
    from rdepth.train.step import host_for_copy

    batch = torch.arange(12).view(3, 4)
    pinned = host_for_copy(batch, torch.device("cuda"))
    assert pinned.is_pinned() and torch.equal(pinned, batch)
    assert host_for_copy(pinned, torch.device("cuda")) is pinned  # pinned once
    on_device = pinned[1:].to("cuda", non_blocking=True)
    assert torch.equal(on_device.cpu(), batch[1:])


def test_a_train_step_on_random_tokens_needs_no_folders_and_steps_as_its_seed_says(tmp_path):
    """TrainStep.on_tokens (the GPU suite's trainer): no data or run folder is read or made; the
    steps train (the weights move, the loss is finite) and are a function of the seed alone."""
    from rdepth.config import ModelConfig
    from rdepth.train.config import TrainConfig
    from rdepth.train.step import TrainStep

    model_config = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=16, vocab_size=64, groups="1",
                               mean_loops=3.0, backprop_depth=2, tokenizer="bpe:512")
    config = TrainConfig(data=str(tmp_path / "no-data"), out=str(tmp_path / "no-run"), batch_size=4, device="cpu",
                         seed=3, max_steps=10, warmup_steps=1, threads=1)
    runs = []
    for _ in range(2):
        trainer = TrainStep.on_tokens(model_config, config)
        start = [param.detach().clone() for param in trainer.model.parameters()]
        step_losses = [float(trainer.train_step(step)[0]) for step in range(2)]
        runs.append((step_losses, [param.detach().clone() for param in trainer.model.parameters()]))
    assert all(torch.isfinite(torch.tensor(runs[0][0]))) and runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=False))
    assert any(not torch.equal(a, b) for a, b in zip(start, runs[0][1], strict=False))
    x, y = trainer.sampler.batch(0)
    assert x.shape == (4, 16) and int(x.max()) < 64 and torch.equal(x[:, 1:], y[:, :-1])
    assert not (tmp_path / "no-run").exists() and not (tmp_path / "no-data").exists()


def _random_token_trainer(tmp_path, **fields):
    from rdepth.config import ModelConfig
    from rdepth.train.config import TrainConfig
    from rdepth.train.step import TrainStep

    model_config = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=16, vocab_size=64, groups="1",
                               mean_loops=3.0, backprop_depth=2, tokenizer="bpe:512")
    config = TrainConfig(data=str(tmp_path / "no-data"), out=str(tmp_path / "no-run"), batch_size=4, device="cpu",
                         seed=3, max_steps=10, warmup_steps=1, threads=1, **fields)
    return TrainStep.on_tokens(model_config, config)


def test_training_with_the_fused_loss_head_follows_the_logits_head(tmp_path):
    """TrainConfig.fused_loss: the trainer's steps with the fused head (no logits) give the logits head's
    losses and weights to float32 rounding, over steps whose AdamW updates depend on every gradient."""
    runs = []
    for fused in (False, True):
        trainer = _random_token_trainer(tmp_path, fused_loss=fused)
        assert trainer.loss_head == ("fused" if fused else "logits")
        losses = [float(trainer.train_step(step)[0]) for step in range(3)]
        runs.append((losses, [p.detach().clone() for p in trainer.model.parameters()]))
    (logit_losses, logit_weights), (fused_losses, fused_weights) = runs
    assert fused_losses == pytest.approx(logit_losses, rel=1e-5)
    for got, want in zip(fused_weights, logit_weights, strict=False):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_compile_mode_reaches_every_compiled_region(tmp_path, monkeypatch):
    """TrainConfig.compile_mode is handed to every torch.compile the trainer makes, per layer and per loop
    step (a spy in place of torch.compile: no compilation runs); the default passes no mode; a mode
    with CUDA graphs (the loop counts vary) is refused."""
    from rdepth.errors import RdepthError
    from rdepth.train.config import TrainConfig

    calls = []

    def spy(fn, **kwargs):
        calls.append(kwargs.get("mode"))
        return fn

    monkeypatch.setattr(torch, "compile", spy)
    _random_token_trainer(tmp_path, compile=True, compile_mode="max-autotune-no-cudagraphs")
    assert calls == ["max-autotune-no-cudagraphs"] * 3  # three layers
    calls.clear()
    _random_token_trainer(tmp_path, compile=True, compile_scope="step", compile_mode="max-autotune-no-cudagraphs")
    assert calls == ["max-autotune-no-cudagraphs"] * 3  # the loop step, then the two single-pass layers
    calls.clear()
    _random_token_trainer(tmp_path, compile=True)
    assert calls == [None] * 3
    with pytest.raises(RdepthError, match="compile_mode must be one of default, max-autotune-no-cudagraphs"):
        TrainConfig(compile_mode="max-autotune")


def test_a_trainer_on_given_tokens_draws_its_windows_from_them():
    """TrainStep.on_tokens on given tokens (the GPU suite's fp8 section): the batches are the
    BatchSampler's windows of those tokens; an id outside the model's vocabulary is a one-line error."""
    import numpy as np

    from rdepth.config import ModelConfig
    from rdepth.data.loader import BatchSampler
    from rdepth.errors import RdepthError
    from rdepth.train.config import TrainConfig
    from rdepth.train.step import TrainStep

    model_config = ModelConfig(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=64, groups="1",
                               mean_loops=2.0, backprop_depth=1, tokenizer="bpe:512")
    config = TrainConfig(data="(none)", out="(none)", batch_size=2, device="cpu", seed=5, max_steps=10, threads=1)
    tokens = (np.arange(200) * 7 % 60).astype(np.uint16)
    trainer = TrainStep.on_tokens(model_config, config, tokens)
    expected = BatchSampler(tokens, 2, 8, 5)
    for step in (0, 3):
        assert all(torch.equal(a, b) for a, b in zip(trainer.sampler.batch(step), expected.batch(step), strict=False))
    assert torch.isfinite(trainer.train_step(0)[0])
    with pytest.raises(RdepthError, match="token id 64 is not below the model's vocabulary size 64"):
        TrainStep.on_tokens(model_config, config, np.append(tokens, 64).astype(np.uint16))
