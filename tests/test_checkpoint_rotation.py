"""Checkpoint rotation (``rdepth train --keep-last``): which steps stay, resume after rotation, safe deletion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rdepth.cli.main import main
from rdepth.errors import RdepthError
from rdepth.io import read_jsonl
from rdepth.run import checkpoint as ckpt
from rdepth.train.config import TrainConfig

TINY = [
    "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--block-size", "16",
    "--groups", "1", "--mean-loops", "2", "--backprop-depth", "1", "--threads", "1",
]


def train_cli(data, out, *extra) -> int:
    return main(["train", "--data", str(data), "--out", str(out), "--batch-size", "2", "--log-every", "1",
                 "--eval-every", "100", "--eval-batches", "1", "--eval-batch-size", "2", "--checkpoint-every", "1",
                 "--warmup-steps", "2", *TINY, *extra])


def steps_of(run: Path) -> list[int]:
    return [ckpt.checkpoint_step(path) for path in ckpt.list_checkpoints(run)]


def test_keep_last_leaves_milestones_and_the_newest(wiki_small, tmp_path):
    run = tmp_path / "run"
    assert train_cli(wiki_small, run, "--max-steps", "10", "--keep-last", "2", "--milestone-every", "4") == 0
    # milestones 4 and 8 (the grid) and 10 (the end of the schedule); the newest two, 9 and 10
    assert steps_of(run) == [4, 8, 9, 10]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest", "step_000004", "step_000008", "step_000009", "step_000010"]  # no debris left
    marks = {step: json.loads((run / "checkpoints" / ckpt.checkpoint_name(step) / "state.json").read_text())
             ["milestone"] for step in steps_of(run)}
    assert marks == {4: True, 8: True, 9: False, 10: True}


def test_resume_after_rotation_is_exact_and_keeps_the_checkpoint_resumed_from(wiki_small, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    rotation = ("--keep-last", "2", "--milestone-every", "4")
    assert train_cli(wiki_small, straight, "--max-steps", "10", *rotation) == 0
    assert train_cli(wiki_small, split, "--max-steps", "10", "--stop-at", "5", *rotation) == 0
    assert steps_of(split) == [4, 5]  # 1-3 rotated away; 5 is the newest, not a milestone
    assert train_cli(wiki_small, split, "--max-steps", "10", "--resume", *rotation) == 0
    assert steps_of(split) == [4, 5, 8, 9, 10]  # 5 was resumed from: kept for the whole run
    losses = [{r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}
              for run in (straight, split)]
    assert losses[0] == losses[1]
    a, b = (load_file(str(ckpt.list_checkpoints(run)[-1] / "model.safetensors")) for run in (straight, split))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    # and a resume from a run whose older checkpoints were rotated away goes on
    assert train_cli(wiki_small, split, "--max-steps", "12", "--resume", *rotation) == 0
    assert steps_of(split) == [4, 8, 10, 11, 12]


def test_keep_last_zero_keeps_every_checkpoint(wiki_small, tmp_path):
    run = tmp_path / "run"
    assert train_cli(wiki_small, run, "--max-steps", "5", "--keep-last", "0", "--milestone-every", "4") == 0
    assert steps_of(run) == [1, 2, 3, 4, 5]


def test_default_milestones_spread_over_the_schedule():
    assert TrainConfig().keep_last == 3
    assert TrainConfig(max_steps=400, checkpoint_every=100).milestone_interval == 100  # every checkpoint
    assert TrainConfig(max_steps=6, checkpoint_every=3).milestone_interval == 3
    assert TrainConfig(max_steps=100_000, checkpoint_every=100).milestone_interval == 12_500  # 8 milestones
    assert TrainConfig(max_steps=1000, checkpoint_every=30).milestone_interval == 150  # a multiple of 30
    assert TrainConfig(max_steps=1000, checkpoint_every=30, milestone_every=90).milestone_interval == 90
    with pytest.raises(RdepthError, match="milestone_every must be a positive multiple of checkpoint_every 30"):
        TrainConfig(checkpoint_every=30, milestone_every=45)
    with pytest.raises(RdepthError, match="keep_last"):
        TrainConfig(keep_last=-1)


def test_bad_rotation_flags_are_one_line(capsys):
    assert main(["train", "--checkpoint-every", "10", "--milestone-every", "15"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "milestone_every" in line


# ------------------------------------------------------------------ deletion is safe

def _fake_checkpoint(root: Path, step: int, milestone: bool = False, extra: str | None = None) -> Path:
    path = root / ckpt.checkpoint_name(step)
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w")
    (path / "config.json").write_text("{}")
    (path / "state.json").write_text(json.dumps({"step": step, "milestone": milestone}))
    if extra:
        (path / extra).write_text("someone's notes")
    return path


def test_rotation_removes_only_what_it_recognises(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 5, 6, 7):
        _fake_checkpoint(root, step, milestone=step == 2)
    _fake_checkpoint(root, 4, extra="notes.txt")  # a file rdepth never writes: left alone
    outside = tmp_path / "elsewhere"
    _fake_checkpoint(outside, 0)
    (root / "step_000000").symlink_to(outside / "step_000000")  # a link: never followed nor removed
    (root / "latest").write_text("step_000003\n")  # latest names an old one: kept
    removed = ckpt.rotate_checkpoints(tmp_path, keep_last=2, protect=(root / "step_000005",))
    assert removed == ["step_000001"]
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step_000000", "step_000002", "step_000003", "step_000004", "step_000005", "step_000006",
        "step_000007"]
    assert (outside / "step_000000" / "model.safetensors").exists()
    assert ckpt.rotate_checkpoints(tmp_path, keep_last=0) == []
    # the grid makes milestones of unmarked checkpoints too
    (root / "latest").write_text("step_000007\n")
    assert ckpt.rotate_checkpoints(tmp_path, keep_last=1, milestone_every=3) == ["step_000005"]
    assert steps_of(tmp_path) == [0, 2, 3, 4, 6, 7]


def test_an_interrupted_removal_leaves_debris_the_next_start_cleans(tmp_path):
    root = tmp_path / "checkpoints"
    doomed = _fake_checkpoint(root, 1)
    _fake_checkpoint(root, 2)
    # a kill between the rename and the removal: the folder is already out of the listing
    (root / ".step_000001.removing").mkdir()
    doomed.rename(root / ".step_000001.removing" / "inner")
    assert steps_of(tmp_path) == [2]
    assert ckpt.clean_debris(tmp_path) == [".step_000001.removing"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
    with pytest.raises(RdepthError, match="not a checkpoint folder"):
        ckpt.remove_checkpoint(tmp_path)
