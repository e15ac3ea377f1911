"""``rdepth consolidate`` beside a training run and after a kill (issue 43): it holds the run's lock; while
``rdepth train`` holds it, a checkpoint rotated away mid-read is read again from the newest (never
"corrupt" after logged tracebacks); ``model.safetensors`` is written under rdepth's temporary naming, so a
kill leaves the old file whole and a temporary file that the next consolidate removes.

The DCP checkpoints are written in this process (no training): the folders ``--parallel fsdp`` writes."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from rdepth.cli.main import main
from rdepth.config import ModelConfig
from rdepth.io import is_leftover_tmp, lock_path
from rdepth.model import RecurrentLM
from rdepth.run import checkpoint as ckpt

TINY = ModelConfig(n_layer=3, n_head=2, d_model=32, block_size=32, vocab_size=512, groups="1", mean_loops=3.0,
                   backprop_depth=2, tokenizer="bpe:512")
ROOT = Path(__file__).parents[1]
# dcp.save without a process group, as consolidate's reads: "assuming the intent is to save in a single process"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return RecurrentLM(TINY).state_dict()


def save_dcp(run: Path, step: int, weights: dict, latest: bool = True) -> Path:
    """RUN/checkpoints/step_N as ``--parallel fsdp`` writes it (config.json, state.json, dcp/)."""
    folder = run / "checkpoints" / ckpt.checkpoint_name(step)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY.to_dict()))
    (folder / "state.json").write_text(json.dumps({"step": step}))
    dcp.save({"model": weights}, checkpoint_id=folder / "dcp", no_dist=True)
    if latest:
        (run / "checkpoints" / "latest").write_text(folder.name + "\n")
    return folder


def hold_lock_as_training(run: Path):
    """The lock ``rdepth train`` holds on its run folder (flock on another open file: held against this
    process too), with its holder record."""
    handle = open(lock_path(run), "a+")  # noqa: SIM115 (returned to the caller, who holds the lock)
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.write(json.dumps({"command": "train", "pid": 4242}) + "\n")
    handle.flush()
    return handle


def lock_is_held(run: Path) -> bool:
    with open(lock_path(run), "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


def temporary_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.endswith(".tmp") or path.name.startswith(".tmp"))


def equal_weights(path: Path, weights: dict) -> bool:
    loaded = load_file(str(path))
    return sorted(loaded) == sorted(weights) and all(torch.equal(loaded[name], weights[name]) for name in weights)


def test_consolidate_holds_the_runs_lock(tmp_path, weights, monkeypatch, capsys):
    """While it reads, ``rdepth train --resume`` (the same lock) cannot start and rotate the checkpoint away."""
    run = tmp_path / "run"
    folder = save_dcp(run, 4, weights)
    held = []
    real_load = dcp.load

    def load(*args, **kwargs):
        held.append(lock_is_held(run))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", load)
    assert main(["consolidate", "--checkpoint", str(run)]) == 0
    assert held == [True]
    assert not lock_path(run).exists()  # released and removed after
    assert equal_weights(folder / "model.safetensors", weights)
    assert capsys.readouterr().out.strip() == f"consolidated {folder / 'model.safetensors'}"


def test_a_checkpoint_rotated_away_mid_read_beside_training_is_read_again_from_the_newest(
        tmp_path, weights, monkeypatch, capsys, caplog):
    """Training holds the lock, saves step 8 and, with --keep-last 1, removes step 4 while consolidate reads
    it: before, "corrupt" after two logged DCP tracebacks; now the newest checkpoint is consolidated."""
    run = tmp_path / "run"
    old = save_dcp(run, 4, weights)
    new = save_dcp(run, 8, weights, latest=False)  # written by training while consolidate starts on step 4
    real_load = dcp.load

    def rotate_then_load(*args, **kwargs):
        if old.exists():  # the trainer's save then rotation: latest names step 8, step 4 is removed
            (run / "checkpoints" / "latest").write_text(new.name + "\n")
            assert old.name in ckpt.rotate_checkpoints(run, keep_last=1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", rotate_then_load)
    training = hold_lock_as_training(run)
    try:
        with caplog.at_level(logging.INFO):
            assert main(["consolidate", "--checkpoint", str(run)]) == 0
        captured = capsys.readouterr()
        assert captured.out.strip() == f"consolidated {new / 'model.safetensors'}"
        assert "corrupt" not in captured.err and "Traceback" not in captured.err
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info]  # DCP's tracebacks
        assert any("in use by rdepth train (pid 4242)" in r.getMessage() for r in caplog.records)
        assert equal_weights(new / "model.safetensors", weights)
        assert ckpt.list_checkpoints(run) == [new] and temporary_files(new) == []

        # that very checkpoint named, and removed mid-read: one line naming what happened, nothing written
        old = save_dcp(run, 12, weights, latest=False)  # (step 12 stands in for "an older one" again)
        new = save_dcp(run, 16, weights, latest=False)
        (run / "checkpoints" / "latest").write_text(old.name + "\n")
        assert main(["consolidate", "--checkpoint", str(old)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "was removed while being read" in err[0] and "corrupt" not in err[0], err
        assert not old.exists() and not (new / "model.safetensors").exists()
    finally:
        training.close()


def test_a_checkpoint_rotated_away_mid_write_beside_training_is_written_into_the_newest(
        tmp_path, weights, monkeypatch, capsys):
    """The rotation comes while model.safetensors is written: safetensors' I/O error (a SafetensorError,
    a traceback before) is one more checkpoint gone, and the newest is consolidated instead."""
    import safetensors.torch

    run = tmp_path / "run"
    old = save_dcp(run, 4, weights)
    new = save_dcp(run, 8, weights, latest=False)
    real_save = safetensors.torch.save_file

    def rotate_then_save(*args, **kwargs):
        if old.exists():
            (run / "checkpoints" / "latest").write_text(new.name + "\n")
            assert ckpt.rotate_checkpoints(run, keep_last=1) == [old.name]
        return real_save(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", rotate_then_save)
    training = hold_lock_as_training(run)
    try:
        assert main(["consolidate", "--checkpoint", str(run)]) == 0
    finally:
        training.close()
    assert capsys.readouterr().out.strip() == f"consolidated {new / 'model.safetensors'}"
    assert equal_weights(new / "model.safetensors", weights) and not old.exists()
    assert temporary_files(new) == []


def test_the_checks_stay_errors_beside_training(tmp_path, weights, capsys):
    """Reading beside training retries only a checkpoint that went away: a damaged one still exists and
    is the usual one-line "corrupt"."""
    run = tmp_path / "run"
    folder = save_dcp(run, 4, weights)
    shard = next((folder / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    training = hold_lock_as_training(run)
    try:
        assert main(["consolidate", "--checkpoint", str(run)]) == 2
    finally:
        training.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "corrupt" in err[0], err
    assert not (folder / "model.safetensors").exists() and temporary_files(folder) == []


# What a SIGKILL inside safetensors' save_file leaves: the file it was given (consolidate's temporary file)
# still empty, and safetensors' own temporary file (.tmpXXXXXX beside it, renamed over the first when whole)
# half-written.
KILLED_WRITE = """
import os, signal, sys
import safetensors.torch
def half_then_killed(tensors, filename, metadata=None):
    data = safetensors.torch.save(tensors, metadata=metadata)
    with open(os.path.join(os.path.dirname(filename), ".tmpAb12Cd"), "wb") as handle:
        handle.write(data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
safetensors.torch.save_file = half_then_killed
from rdepth.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def killed_consolidate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", KILLED_WRITE, "consolidate", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("in_run", [True, False], ids=["run", "lone-checkpoint"])
def test_a_consolidate_killed_mid_write_leaves_the_old_file_whole_and_the_next_removes_its_debris(
        tmp_path, weights, in_run):
    """SIGKILL with half of model.safetensors written: no model.safetensors (or the earlier one, whole),
    one temporary file in rdepth's naming; the next consolidate removes it and writes the whole file."""
    run = tmp_path / "run"
    folder = save_dcp(run, 4, weights)
    if not in_run:
        folder = folder.rename(tmp_path / "lone")
    killed = killed_consolidate("--checkpoint", str(folder))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (folder / "model.safetensors").exists()
    ours, theirs = temporary_files(folder)
    assert ours.startswith(".model.safetensors.") and is_leftover_tmp(folder / ours) and theirs == ".tmpAb12Cd"
    (folder / ".model.safetensors.tmp").write_bytes(b"half")  # the fixed name of earlier versions

    assert main(["consolidate", "--checkpoint", str(folder)]) == 0
    assert temporary_files(folder) == [] and equal_weights(folder / "model.safetensors", weights)

    killed = killed_consolidate("--checkpoint", str(folder), "--overwrite")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert equal_weights(folder / "model.safetensors", weights)  # the earlier file, whole
    assert len(temporary_files(folder)) == 2
    assert main(["consolidate", "--checkpoint", str(folder), "--overwrite"]) == 0
    assert temporary_files(folder) == [] and equal_weights(folder / "model.safetensors", weights)


def test_a_killed_consolidates_temporary_file_neither_blocks_rotation_nor_outlives_the_next_training(tmp_path,
                                                                                                     weights):
    """Rotation recognises a checkpoint holding consolidate's temporary file (it would be kept forever
    otherwise), and a training start removes such files (as well as the fixed name of earlier versions)."""
    run = tmp_path / "run"
    old, new = save_dcp(run, 4, weights), save_dcp(run, 8, weights)
    (old / ".model.safetensors.ab12cd34.tmp").write_bytes(b"half")
    (old / ".tmpAb12Cd").write_bytes(b"half")  # safetensors' own
    (new / ".model.safetensors.tmp").write_bytes(b"half")
    (new / ".model.safetensors.x.tmp").write_bytes(b"someone else's")  # not rdepth's naming: kept
    assert ckpt.is_checkpoint_folder(old)
    assert ckpt.clean_debris(run) == [f"{old.name}/.model.safetensors.ab12cd34.tmp", f"{old.name}/.tmpAb12Cd",
                                      f"{new.name}/.model.safetensors.tmp"]
    assert temporary_files(old) == [] and temporary_files(new) == [".model.safetensors.x.tmp"]
    assert not ckpt.is_checkpoint_folder(new)  # a file rdepth did not write: rotation leaves the folder
    (old / ".model.safetensors.ab12cd34.tmp").write_bytes(b"half")
    assert ckpt.rotate_checkpoints(run, keep_last=1) == [old.name]
