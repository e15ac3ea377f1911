"""Data-parallel ranks spawned by rdepth itself (rdepth.train.ranks): the same run as one process, to
rounding; the same run again bit for bit; a run that finished is reused; a failing rank is one error."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from rdepth.config import ModelConfig
from rdepth.errors import RdepthError
from rdepth.train.config import TrainConfig
from rdepth.train.ranks import rank_environment, train_ranks


def _configs(data, out):
    model = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=42, groups="1", mean_loops=3.0,
                        backprop_depth=2, tokenizer="task:chase")
    train = TrainConfig(data=str(data), out=str(out), max_steps=6, batch_size=8, lr=3e-3, warmup_steps=2,
                        eval_every=6, checkpoint_every=6, eval_batches=1, log_every=1, threads=1, seed=3)
    return model, train


def _losses(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def _weights(run):
    return load_file(str(run / "checkpoints" / "step_000006" / "model.safetensors"))


def test_the_torchrun_environment_of_a_rank():
    env = rank_environment(1, 2, 29511)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


@pytest.mark.slow
def test_two_ranks_train_the_one_process_run_and_repeat_exactly(small_chase_data, tmp_path):
    model, train = _configs(small_chase_data, tmp_path / "two")
    assert train_ranks(model, train, 2, tmp_path / "logs") == tmp_path / "two"
    again = train_ranks(model, replace(train, out=str(tmp_path / "again")), 2, tmp_path / "logs")
    single = train_ranks(model, replace(train, out=str(tmp_path / "one")), 1, tmp_path / "logs")
    two, repeat, one = _weights(tmp_path / "two"), _weights(again), _weights(single)
    for name in one:
        assert torch.equal(two[name], repeat[name]), name  # the split is fixed: the same numbers every time
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5)  # a sum in another order
    assert _losses(tmp_path / "two").keys() == _losses(single).keys()
    for step, loss in _losses(single).items():
        assert abs(_losses(tmp_path / "two")[step] - loss) < 1e-4
    assert (tmp_path / "logs" / "two.rank1.log").exists()
    before = (tmp_path / "two" / "summary.json").stat().st_mtime_ns
    train_ranks(model, train, 2, tmp_path / "logs")  # finished with the same settings: reused, nothing retrained
    assert (tmp_path / "two" / "summary.json").stat().st_mtime_ns == before


def test_a_failing_rank_is_one_error_and_stops_the_others(small_chase_data, tmp_path):
    model, train = _configs(small_chase_data, tmp_path / "run")
    with pytest.raises(RdepthError, match=r"training run \(rank \d\): .*") as caught:
        train_ranks(model, replace(train, data=str(tmp_path / "missing")), 2, tmp_path / "logs")
    assert "\n" not in str(caught.value)
