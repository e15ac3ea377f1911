"""FSDP2 training (rdepth train --parallel fsdp): parity with one process, DCP resume, consolidation, errors.

Two ranks run under torchrun (gloo, one thread each); the other tests run FSDP in this process at
world size 1 (RANK/WORLD_SIZE set as torchrun would), which shards nothing but runs every FSDP path
(fully_shard units, DTensor parameters and optimizer state, DCP save/load). Float64 weights: the
runs then differ only by the order of reductions (the loss itself is computed in float32)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rdepth.cli.main import main
from rdepth.config import ModelConfig
from rdepth.io import read_jsonl
from rdepth.run.checkpoint import list_checkpoints, load_model
from rdepth.train.config import TrainConfig
from rdepth.train.ranks import free_port
from rdepth.train.trainer import Trainer

WORKER = Path(__file__).with_name("fsdp_worker.py")
TINY = ["--n-layer", "3", "--n-head", "2", "--d-model", "32", "--block-size", "32", "--groups", "1",
        "--mean-loops", "3", "--backprop-depth", "2", "--threads", "1"]
TINY_MODEL = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=32, vocab_size=512, groups="1", mean_loops=3.0,
                         backprop_depth=2, tokenizer="bpe:512")  # tests/fsdp_worker.py's
# 50 steps: the length of the loss-curve comparison.
STEPS = 50
# Float64 weights; the loss is computed in float32, so two runs whose weights differ in the last
# float64 bits may log losses one float32 ulp apart (~5e-7 at a loss of 6).
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-12


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def train_fields(data, out, **extra) -> dict:
    return {"data": str(data), "out": str(out), "max_steps": STEPS, "batch_size": 4,
            "warmup_steps": 5, "log_every": 1, "eval_every": 25, "eval_batches": 1, "eval_batch_size": 4,
            "checkpoint_every": 25, "threads": 1, **extra}


def worker(spec: dict, world: int | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, str(WORKER), json.dumps(spec)]
    if world is not None:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(world),
                    "--master_port", str(free_port())]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.fixture
def one_rank(monkeypatch):
    """This process as rank 0 of 1, as ``torchrun --nproc-per-node 1`` would start it."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def train_cli(data, out, *extra) -> int:
    return main(["train", "--data", str(data), "--out", str(out), "--batch-size", "4", "--log-every", "1",
                 "--eval-every", "4", "--eval-batches", "1", "--eval-batch-size", "4", "--checkpoint-every", "4",
                 "--warmup-steps", "2", *TINY, *extra])


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------- two ranks
@pytest.mark.slow
def test_two_ranks_match_one_process_and_resume_after_kill_is_exact(wiki_small, tmp_path, float64, one_rank):
    """50 steps on 2 FSDP ranks (2 rows each per step, a looped layer applied 3 times
    on average): the loss curve and the weights equal one plain process's within LOSS_TOL/WEIGHT_TOL.
    The FSDP run is killed (SIGKILL) after step 30 and resumed from its step-25 DCP checkpoint: the
    steps it logged before the kill come out again bit for bit. The DCP checkpoint then resumes at
    world size 1 (resharded), and consolidates to a model.safetensors that `load_model` reads."""
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    Trainer(TINY_MODEL, TrainConfig(**train_fields(wiki_small, single))).run()  # one plain process, here
    spec = {"train": train_fields(wiki_small, sharded, parallel="fsdp"), "kill_at": 30}
    killed = worker(spec, 2)
    assert killed.returncode != 0  # rank 0 killed itself at step 30
    assert [p.name for p in list_checkpoints(sharded)] == ["step_000025"]
    before_kill = losses(sharded)
    assert sorted(before_kill) == list(range(1, 31))  # killed as the 31st step started
    reshard = tmp_path / "reshard"
    shutil.copytree(sharded, reshard)
    resumed = worker({"train": spec["train"], "resume": True}, 2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    after = losses(sharded)
    assert sorted(after) == list(range(1, STEPS + 1))
    assert all(after[step] == before_kill[step] for step in range(26, 31)), "resume is not bit-exact"
    reference = losses(single)
    worst = max(abs(after[step] - reference[step]) for step in reference)
    assert worst < LOSS_TOL, worst

    # consolidate the final DCP checkpoint: the usual folder, weights equal to one process's
    assert main(["consolidate", "--checkpoint", str(sharded)]) == 0
    final = list_checkpoints(sharded)[-1]
    ours = load_file(str(final / "model.safetensors"))
    theirs = load_file(str(list_checkpoints(single)[-1] / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == torch.float64
        assert (ours[name] - theirs[name]).abs().max() < WEIGHT_TOL, name
    model_a, model_b = load_model(sharded)[0], load_model(single)[0]
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model_a(idx, loop_counts=(4,), noise=torch.Generator().manual_seed(1)).logits
        b = model_b(idx, loop_counts=(4,), noise=torch.Generator().manual_seed(1)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9)

    # the 2-rank step-25 checkpoint resumes here at world size 1: DCP re-cuts the shards
    assert main(["train", "--data", str(wiki_small), "--out", str(reshard), "--resume", "--stop-at", "30"]) == 0
    again = losses(reshard)
    assert max(abs(again[step] - before_kill[step]) for step in range(26, 31)) < LOSS_TOL


# --------------------------------------------------- one rank, in-process
def test_fsdp_one_rank_resume_is_exact_and_activation_checkpointing_changes_nothing(wiki_small, tmp_path, float64,
                                                                                     one_rank, monkeypatch):
    straight, split, recompute = tmp_path / "straight", tmp_path / "split", tmp_path / "recompute"
    assert train_cli(wiki_small, straight, "--max-steps", "8", "--parallel", "fsdp") == 0
    assert sorted(p.name for p in (list_checkpoints(straight)[-1]).iterdir()) == ["config.json", "dcp", "state.json"]
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train_cli(wiki_small, split, "--max-steps", "8", "--stop-at", "4", "--parallel", "fsdp") == 0
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train_cli(wiki_small, split, "--max-steps", "8", "--resume") == 0  # --parallel fsdp from the run
    assert losses(straight) == losses(split)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train_cli(wiki_small, recompute, "--max-steps", "8", "--parallel", "fsdp",
                     "--activation-checkpointing") == 0
    assert losses(recompute) == losses(straight)
    for run in (straight, split):
        assert main(["consolidate", "--checkpoint", str(run)]) == 0
    a = load_file(str(list_checkpoints(straight)[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(split)[-1] / "model.safetensors"))
    assert all(torch.equal(a[name], b[name]) for name in a)
    # the consolidated run is an ordinary one for the commands that read checkpoints
    assert main(["generate", "--checkpoint", str(straight), "--prompt", "The", "--max-new-tokens", "3",
                 "--temperature", "0", "--threads", "1"]) == 0


def test_looped_layer_gradients_accumulate_over_applications(float64, one_rank):
    """A looped layer is one FSDP unit applied many times: its gradient is the sum over the
    applications, exactly one process's."""
    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM
    from rdepth.train.fsdp import shard_model

    config = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=16, vocab_size=64, groups="1",
                         mean_loops=3.0, backprop_depth=3, tokenizer="bpe:512")
    torch.manual_seed(0)
    plain = RecurrentLM(config)
    torch.manual_seed(0)
    sharded = shard_model(RecurrentLM(config), torch.device("cpu"))
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for model in (plain, sharded):
        model(idx, idx, (5,), noise=torch.Generator().manual_seed(2)).loss.backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters(), strict=False):
        assert torch.equal(p.grad, q.grad.full_tensor()), name
    assert plain.layers[1].attn.qkv.weight.grad.abs().sum() > 0  # the looped layer


def test_bf16_mixed_precision_trains_near_float32(wiki_small, tmp_path, one_rank, monkeypatch):
    full, half = tmp_path / "fp32", tmp_path / "bf16"
    assert train_cli(wiki_small, full, "--max-steps", "4", "--parallel", "fsdp") == 0
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train_cli(wiki_small, half, "--max-steps", "4", "--parallel", "fsdp", "--mixed-precision", "bf16") == 0
    a, b = losses(full), losses(half)
    assert a != b  # the layers did compute in bfloat16
    assert max(abs(a[s] - b[s]) for s in a) < 0.05


# ------------------------------------------------------------- bad input
def test_fsdp_without_torchrun_is_one_line(wiki_small, tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert train_cli(wiki_small, tmp_path / "r", "--max-steps", "2", "--parallel", "fsdp") == 2
    assert "torchrun" in _error_line(capsys)
    assert not (tmp_path / "r").exists()
    assert train_cli(wiki_small, tmp_path / "r", "--max-steps", "2", "--mixed-precision", "bf16") == 2
    assert "--parallel fsdp" in _error_line(capsys)
    assert train_cli(wiki_small, tmp_path / "r", "--max-steps", "2", "--parallel", "zero3") == 2
    assert "parallel must be one of ddp, fsdp" in _error_line(capsys)


def test_consolidate_and_load_errors_are_one_line(wiki_small, tmp_path, capsys, float64, one_rank, monkeypatch):
    plain = tmp_path / "plain"
    monkeypatch.delenv("RANK")
    assert train_cli(wiki_small, plain, "--max-steps", "2") == 0
    capsys.readouterr()
    assert main(["consolidate", "--checkpoint", str(plain)]) == 2
    assert "no distributed checkpoint" in _error_line(capsys)
    assert main(["consolidate", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "not found" in _error_line(capsys)
    monkeypatch.setenv("RANK", "0")
    sharded = tmp_path / "sharded"
    assert train_cli(wiki_small, sharded, "--max-steps", "4", "--parallel", "fsdp") == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(sharded), "--data", str(wiki_small)]) == 2  # not consolidated yet
    assert "rdepth consolidate" in _error_line(capsys)
    # a plain run resumed with --parallel fsdp, and an FSDP run resumed without it
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train_cli(wiki_small, plain, "--max-steps", "4", "--resume", "--parallel", "fsdp") == 2
    assert "not a sharded" in _error_line(capsys)
    assert train_cli(wiki_small, sharded, "--max-steps", "6", "--resume", "--parallel", "ddp") == 2
    assert "parallel" in _error_line(capsys)
    # a corrupt shard file
    shard = next((list_checkpoints(sharded)[-1] / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["consolidate", "--checkpoint", str(sharded)]) == 2
    assert "corrupt" in _error_line(capsys)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train_cli(wiki_small, sharded, "--max-steps", "6", "--resume") == 2
    assert "corrupt" in _error_line(capsys)


def test_memory_estimate_shards_the_state():
    from rdepth.config import get_preset
    from rdepth.train.fsdp import estimate_memory

    paper = get_preset("paper")
    one, two, eight = (estimate_memory(paper, n) for n in (1, 2, 8))
    assert one.ddp == one.fsdp_state == one.fsdp_peak == 16 * one.parameters
    assert two.ddp == one.ddp and two.fsdp_state * 2 == two.ddp  # the state halves exactly
    assert two.fsdp_peak == two.fsdp_state + 8 * two.largest_unit
    assert eight.fsdp_state * 8 == eight.ddp
    big = get_preset("1b")
    assert 0.9e9 < estimate_memory(big, 1).parameters < 1.3e9


def test_local_shard_bytes_at_one_rank_are_whole(float64, one_rank):
    """The measured side: at world size 1 the local shards are whole (the DDP figure); the
    two-rank test's worker measures half (tests/fsdp_worker.py, docs/results.md)."""
    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM
    from rdepth.train.config import TrainConfig
    from rdepth.train.fsdp import local_state_bytes, shard_model
    from rdepth.train.optim import make_optimizer

    config = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=16, vocab_size=64, groups="1",
                         tokenizer="bpe:512")
    model = shard_model(RecurrentLM(config), torch.device("cpu"))
    optimizer = make_optimizer(model, TrainConfig(), torch.device("cpu"))
    idx = torch.zeros((1, 16), dtype=torch.long)
    model(idx, idx, (2,)).loss.backward()
    optimizer.step()
    sizes = local_state_bytes(model, optimizer)
    whole = 8 * sum(p.numel() for p in RecurrentLM(config).parameters())
    assert sizes == {"parameters": whole, "gradients": whole, "optimizer": 2 * whole}


def test_the_fused_loss_head_trains_under_fsdp_as_the_logits_head(wiki_small, tmp_path, float64, one_rank, monkeypatch):
    """--fused-loss under FSDP2 (the tied head a slice of the root's gathered embedding, its gradient made
    in the forward): the logits head's losses, step for step (the model in float64)."""
    plain, fused = tmp_path / "plain", tmp_path / "fused"
    assert train_cli(wiki_small, plain, "--max-steps", "4", "--parallel", "fsdp") == 0
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert train_cli(wiki_small, fused, "--max-steps", "4", "--parallel", "fsdp", "--fused-loss") == 0
    expected, got = losses(plain), losses(fused)
    assert sorted(got) == sorted(expected)
    # (the logits head scores in fp32 whatever the model's dtype: equal to fp32 rounding)
    assert all(abs(got[step] - expected[step]) <= 1e-6 * abs(expected[step]) for step in expected)


def _dcp_checkpoint(folder: Path, config: ModelConfig, weights: dict) -> Path:
    """A DCP checkpoint folder as --parallel fsdp writes one (config.json and dcp/), saved in this process."""
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    dcp.save({"model": weights}, checkpoint_id=folder / "dcp", no_dist=True)
    return folder


def test_consolidate_refuses_weights_that_do_not_fit_the_config_or_are_not_finite(tmp_path, capsys):
    """Key names alone matched before: a d_model-32 run's shards under a d_model-64 config.json were written
    out as model.safetensors with exit 0. Now the shapes, the dtypes and finiteness are checked, and
    nothing is written."""
    from rdepth.model import RecurrentLM

    torch.manual_seed(0)
    weights = RecurrentLM(TINY_MODEL).state_dict()
    other = _dcp_checkpoint(tmp_path / "other", TINY_MODEL.replace(d_model=64), weights)
    assert main(["consolidate", "--checkpoint", str(other)]) == 2
    assert "does not fit its config.json" in _error_line(capsys)
    assert not (other / "model.safetensors").exists()
    broken = dict(weights)
    name = sorted(broken)[0]
    broken[name] = torch.full_like(broken[name], float("nan"))
    nan = _dcp_checkpoint(tmp_path / "nan", TINY_MODEL, broken)
    assert main(["consolidate", "--checkpoint", str(nan)]) == 2
    assert "NaN or infinite" in _error_line(capsys)
    assert not (nan / "model.safetensors").exists()
    integers = {key: value.to(torch.int32) for key, value in weights.items()}
    ints = _dcp_checkpoint(tmp_path / "ints", TINY_MODEL, integers)
    assert main(["consolidate", "--checkpoint", str(ints)]) == 2
    assert "not a floating-point weight" in _error_line(capsys)
    good = _dcp_checkpoint(tmp_path / "good", TINY_MODEL, weights)
    assert main(["consolidate", "--checkpoint", str(good)]) == 0
    assert torch.equal(load_file(str(good / "model.safetensors"))[name], weights[name])
