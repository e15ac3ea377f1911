"""Training on task data: windows start at problems, a step-keyed curriculum, aligned validation windows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rdepth.cli.main import main
from rdepth.data.loader import BatchSampler, curriculum_level
from rdepth.data.shards import TokenShards
from rdepth.data.task_vocab import EOT_ID
from rdepth.errors import RdepthError
from rdepth.run.heldout import held_out_problem_windows
from rdepth.tasks.data import TaskDataConfig, prepare_task_data

PARAMS = {"chase": {"nodes": 8, "queries": 4, "ordered": True}}  # 8 + 12 tokens + <eot> = 21 per problem


@pytest.fixture(scope="module")
def task_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("curriculum") / "chase"
    return prepare_task_data(TaskDataConfig(task="chase", train_difficulties=(1, 4), train_tokens=8000,
                                            val_tokens=2000, heldout_problems=8, block_size=20,
                                            task_params=json.dumps(PARAMS), out=out))


def test_curriculum_level_rises_linearly_from_low_plus_one():
    assert [curriculum_level(s, 1, 4, 100) for s in (0, 49, 50, 99, 100, 10**6)] == [2, 2, 3, 3, 4, 4]
    assert curriculum_level(0, 1, 4, 0) == 4  # off
    assert curriculum_level(0, 3, 3, 100) == 3  # one difficulty


def test_problem_index_matches_the_shard(task_data):
    shards = TokenShards.open(task_data)
    starts, levels = shards.problem_index("train")
    tokens = np.asarray(shards.train)
    assert starts[0] == 0 and np.all(np.diff(starts) == 21)  # every chase problem here has 20 tokens
    assert np.all(tokens[starts[1:] - 1] == EOT_ID)  # each problem follows a separator
    assert set(levels.tolist()) == {1, 2, 3, 4}
    masks = np.asarray(shards.loss_mask("train"))
    assert masks[starts[0]:starts[0] + 21].sum() == 4  # four answers per problem


def test_sampler_draws_problem_starts_up_to_the_step_level(task_data):
    shards = TokenShards.open(task_data)
    starts, levels = shards.problem_index("train")
    sampler = BatchSampler(shards.train, 64, 20, seed=3, starts=starts, levels=levels, curriculum_steps=100)
    by_start = dict(zip(starts.tolist(), levels.tolist(), strict=False))
    for step, top in ((0, 2), (60, 3), (200, 4)):
        offsets = sampler.offsets(step)
        assert all(int(o) in by_start for o in offsets)
        drawn = {by_start[int(o)] for o in offsets}
        assert max(drawn) == top and sampler.level(step) == top
    assert np.array_equal(sampler.offsets(7), BatchSampler(shards.train, 64, 20, seed=3, starts=starts,
                                                           levels=levels, curriculum_steps=100).offsets(7))
    x, _ = sampler.batch(5)
    assert x.shape == (64, 20) and bool((x[:, 0] != EOT_ID).all())


def test_problem_windows_start_at_problems_and_do_not_overlap():
    tokens = np.arange(100)
    windows = held_out_problem_windows(tokens, np.array([0, 3, 10, 15, 40, 95]), 9, max_windows=10)
    assert windows[:, 0].tolist() == [0, 10, 40]  # 3 and 15 begin inside a window; 95 has no room
    with pytest.raises(RdepthError):
        held_out_problem_windows(tokens, np.array([95]), 9)


def test_corrupt_problem_index_is_an_error(task_data, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(task_data, copy)
    np.save(copy / "train_problems.npy", np.array([[5, 1], [3, 1]], dtype=np.int64))
    with pytest.raises(RdepthError, match="problem index"):
        TokenShards.open(copy).problem_index("train")


def test_train_with_a_curriculum_logs_the_level(task_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(task_data), "--out", str(run), "--n-layer", "2", "--n-head", "2",
                 "--d-model", "16", "--block-size", "20", "--groups", "1", "--mean-loops", "2",
                 "--backprop-depth", "2", "--max-steps", "6", "--batch-size", "4", "--eval-batches", "1",
                 "--eval-batch-size", "4", "--log-every", "1", "--curriculum-steps", "4"]) == 0
    capsys.readouterr()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    levels = [r["max_difficulty"] for r in records if "max_difficulty" in r]
    assert levels == [2, 2, 3, 3, 4, 4]


def test_task_sweep_counts_answer_and_other_steps_on_one_path(task_data, tmp_path, capsys):
    import torch

    from rdepth.config import ModelConfig
    from rdepth.model import RecurrentLM
    from rdepth.sweep.config import SweepConfig
    from rdepth.sweep.task import pareto_front, run_task_sweep
    from rdepth.tasks.data import load_heldout
    from rdepth.tasks.evaluate import heldout_accuracy

    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig(n_layer=2, n_head=2, d_model=16, block_size=20, vocab_size=42, groups="1",
                                    mean_loops=2.0, backprop_depth=2, tokenizer="task:chase")).eval()
    heldout = load_heldout(task_data, 4)
    config = SweepConfig(checkpoint="x", data="x", out="x", policies=("acceleration", "step_norm"),
                         taus=(1e-3, 1e-1), k_max=(3,), repeats=1, warmup=0, timing_batch_size=2, progress=False)
    result = run_task_sweep(model, [heldout], config)
    block = result["difficulties"][0]
    assert [f["budget"] for f in block["fixed"]] == [[1], [2], [3]]
    for k, entry in enumerate(block["fixed"], 1):  # a fixed budget spends exactly k steps on every token
        assert entry["mean_steps_answer"] == entry["mean_steps_other"] == pytest.approx(k)
        direct = heldout_accuracy(model, heldout, loop_counts=k, batch_size=8)
        assert entry["accuracy"] == direct["accuracy"]  # the packed path equals the dense one
        assert entry["ms_per_token"] > 0
    assert len(block["points"]) == 4 and all(1 <= p["steps"] <= 3 for p in block["points"])
    summary = result["summary"]["difficulties"][0]
    assert summary["full"]["label"] == "fixed 3"
    front = pareto_front([{"steps": 1, "accuracy": 0.5, "label": "a"}, {"steps": 2, "accuracy": 0.4, "label": "b"},
                          {"steps": 3, "accuracy": 0.9, "label": "c"}])
    assert [e["label"] for e in front] == ["a", "c"]


def test_sweep_cli_on_task_data(task_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(task_data), "--out", str(run), "--n-layer", "2", "--n-head", "2",
                 "--d-model", "16", "--block-size", "20", "--groups", "1", "--mean-loops", "2",
                 "--backprop-depth", "2", "--max-steps", "2", "--batch-size", "4", "--eval-batches", "1"]) == 0
    capsys.readouterr()
    out = tmp_path / "sweep"
    from rdepth.exitrun.profile import make_profile

    profile = tmp_path / "profile.json"
    from rdepth.run.checkpoint import resolve_checkpoint, run_identity

    profile.write_text(json.dumps(make_profile("step_norm", [0.1], [2], run=run_identity(resolve_checkpoint(run)))))
    assert main(["sweep", "--checkpoint", str(run), "--data", str(task_data), "--out", str(out),
                 "--policies", "acceleration", "--taus", "1e-2", "--k-max", "2", "--repeats", "1",
                 "--no-progress", "--difficulties", "2,6", "--exit-profile", str(profile)]) == 0
    printed = capsys.readouterr().out
    assert "difficulty 2" in printed and "difficulty 6" in printed and "answer tokens" in printed
    saved = json.loads((out / "task_sweep.json").read_text())
    assert [b["difficulty"] for b in saved["difficulties"]] == [2, 6]
    assert [p["label"] for p in saved["difficulties"][0]["points"]] == ["acceleration tau=0.01",
                                                                        "profile step_norm 0.1"]
    assert (out / "figures" / "task_exits.png").is_file() and (out / "index.html").is_file()
