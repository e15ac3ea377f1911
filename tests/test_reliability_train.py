"""Reliability of training runs (issue 16): one writer per folder, resume as saved, divergence
caught, nothing a user wrote overwritten, whole metrics lines, crash debris cleaned, SIGTERM.

Kill and concurrency tests run real processes with a bounded time (every wait has a timeout).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from reliability_helpers import error_line, train_argv  # noqa: E402
from safetensors.torch import load_file

from rdepth import io
from rdepth.cli.main import main
from rdepth.errors import RdepthError
from rdepth.io import read_jsonl
from rdepth.run import checkpoint as ckpt
from rdepth.run.checkpoint import list_checkpoints

LOCK_NAME = ".rdepth.lock"

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rdepth", *argv], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---------------------------------------------------------------- 1. one writer per folder
HOLD = """
import sys, time
from rdepth.io import exclusive
with exclusive(sys.argv[1], sys.argv[2]):
    print("locked", flush=True)
    time.sleep(60)
"""


def hold_lock(folder: Path, command: str = "train") -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), command], env=ENV,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_second_writer_gets_one_line_error(wiki_small, tmp_path, capsys):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 2
        line = error_line(capsys)
        assert "in use by rdepth train (pid" in line, line
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # a killed holder leaves no stale lock
    assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 0


def test_two_trains_started_together_one_wins(wiki_small, tmp_path):
    run = tmp_path / "run"
    argv = train_argv(wiki_small, run, "--max-steps", "6")
    procs = [spawn(argv), spawn(argv)]
    results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "in use by" in loser or "already holds checkpoints" in loser or "not empty" in loser, loser
    assert "Traceback" not in loser
    assert [p.name for p in list_checkpoints(run)] == ["step_000003", "step_000006"]
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 7))  # one run's records, not two interleaved


def test_exclusive_helper(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(RdepthError, match="not a folder"), io.exclusive(afile, "analyze"):
        pass
    fresh = tmp_path / "fresh"
    with io.exclusive(fresh, "analyze") as folder:
        assert (folder / LOCK_NAME).is_file()
    assert not fresh.exists()  # created, nothing written: removed again
    with io.exclusive(fresh, "analyze") as folder:
        (folder / "index.html").write_text("report")
    assert (fresh / "index.html").exists()
    # beside=True: the lock lives next to a folder that is replaced by a rename (prepare)
    with io.exclusive(tmp_path / "data", "prepare", beside=True):
        assert (tmp_path / ".data.rdepth.lock").is_file()
        holder_code = subprocess.run(
            [sys.executable, "-c", "import sys\nfrom rdepth.io import exclusive\n"
             "with exclusive(sys.argv[1], 'prepare', beside=True): pass", str(tmp_path / "data")],
            env=ENV, capture_output=True, text=True, timeout=60)
        assert holder_code.returncode != 0 and "in use by rdepth prepare" in holder_code.stderr


# ---------------------------------------------------------------- 2. resume continues the run as saved
def test_resume_with_only_out_continues_exactly(wiki_small, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    extra = ("--max-steps", "6", "--lr", "3e-3", "--seed", "5")
    assert main(train_argv(wiki_small, straight, *extra)) == 0
    assert main(train_argv(wiki_small, split, *extra, "--stop-at", "3")) == 0
    # every flag not repeated comes from the saved run, not from the defaults
    assert main(["train", "--out", str(split), "--resume"]) == 0
    assert losses(straight) == losses(split)
    a = load_file(str(list_checkpoints(straight)[-1] / "model.safetensors"))
    b = load_file(str(list_checkpoints(split)[-1] / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_changes_and_keeps_config(wiki_small, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 0
    saved = (run / "config.json").read_bytes()
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "6", "--batch-size", "8"]) == 2
    assert "batch_size 4 (saved) vs 8" in error_line(capsys)
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "6", "--preset", "small"]) == 2
    assert "--preset" in error_line(capsys)
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "6", "--d-model", "48"]) == 2
    assert "does not match" in error_line(capsys)
    assert (run / "config.json").read_bytes() == saved  # no failed resume rewrote it
    # an explicit longer schedule is allowed and recorded
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "6"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["max_steps"] == 6 and config["train"]["batch_size"] == 4
    assert config["resumes"] == [{"step": 3, "changed": {"max_steps": [3, 6]}}]
    assert config["preset"] == "tiny"


# ---------------------------------------------------------------- 4. divergence
@pytest.mark.parametrize("flags, fragment", [
    (["--lr", "inf"], "lr must be a finite number"),
    (["--lr", "1e10"], "lr must be a number in"),
    (["--weight-decay", "nan"], "weight_decay must be a finite number"),
    (["--lr", "5", "--weight-decay", "0.5"], "lr x weight_decay"),
    (["--beta1", "2"], "beta1 must be a number in [0, 1)"),
    (["--beta2", "1.5"], "beta2 must be a number in [0, 1)"),
    (["--threads", "-1"], "threads must be"),
    (["--seed", str(2**63)], "seed must be"),
    (["--grad-clip", "nan"], "grad_clip must be a finite number"),
    (["--batch-size", "4000000"], "needs about"),
    (["--eval-batch-size", "4000000"], "a validation batch of 4000000 windows"),
])
def test_bad_optimizer_flags_rejected_up_front(wiki_small, tmp_path, capsys, flags, fragment):
    assert main(train_argv(wiki_small, tmp_path / "r", "--max-steps", "3", *flags)) == 2
    assert fragment in error_line(capsys)
    assert not (tmp_path / "r").exists()


def test_divergence_stops_and_keeps_last_finite_checkpoint(wiki_small, tmp_path, capsys, monkeypatch):
    from rdepth.train.step import TrainStep

    original = TrainStep.train_step

    def poisoned(self, step):
        if step == 4:  # the 5th step's weights turn to NaN, as after a blown-up update
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return original(self, step)

    monkeypatch.setattr(TrainStep, "train_step", poisoned)
    run = tmp_path / "run"
    assert main(train_argv(wiki_small, run, "--max-steps", "9", "--log-every", "100")) == 2
    line = error_line(capsys)
    assert "diverged by step 6" in line and "step_000003" in line, line
    assert [p.name for p in list_checkpoints(run)] == ["step_000003"]
    weights = load_file(str(list_checkpoints(run)[0] / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not (run / "summary.json").exists()
    assert all(math.isfinite(r.get("loss", 0.0)) for r in read_jsonl(run / "metrics.jsonl"))


# ---------------------------------------------------------------- 5. nothing a user wrote is overwritten
def test_train_refuses_a_used_folder_without_checkpoints(wiki_small, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    mine = {"config.json": "{\"mine\": 1}\n", "summary.json": "{}\n", "metrics.jsonl": "{\"step\": 99}\n"}
    for name, text in mine.items():
        (run / name).write_text(text)
    assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 2
    assert "not empty" in error_line(capsys)
    assert {name: (run / name).read_text() for name in mine} == mine
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(train_argv(wiki_small, empty, "--max-steps", "3")) == 0


# ---------------------------------------------------------------- 6. complete outputs, debris, SIGTERM
def test_resume_truncates_metrics_to_the_checkpoint(wiki_small, tmp_path):
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert main(train_argv(wiki_small, straight, "--max-steps", "6")) == 0
    assert main(train_argv(wiki_small, run, "--max-steps", "6")) == 0
    # a crash after step 6 was logged but before its checkpoint, mid-way through a line
    import shutil

    shutil.rmtree(list_checkpoints(run)[-1])
    (run / "checkpoints" / "latest").write_text("step_000003\n")
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 7, "lo')
    staging = run / "checkpoints" / ".step_000006.x1y2"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"half")
    assert main(["train", "--out", str(run), "--resume"]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert [r["step"] for r in records if "val_ce" in r] == [3, 6]
    assert losses(run) == losses(straight)
    assert all(line.startswith("{") and line.endswith("}") for line in
               (run / "metrics.jsonl").read_text().splitlines())
    assert not staging.exists()


def test_append_jsonl_closes_a_cut_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    io.append_jsonl(path, {"step": 3})
    assert read_jsonl(path) == [{"step": 1}, {"step": 3}]


def test_clean_debris_restores_a_checkpoint_caught_between_renames(tmp_path):
    root = tmp_path / "checkpoints"
    (root / ".step_000003.old").mkdir(parents=True)
    (root / ".step_000003.old" / "model.safetensors").write_bytes(b"w")
    (root / ".step_000006.abcd").mkdir()
    assert ckpt.clean_debris(tmp_path) == [".step_000006.abcd"]
    assert (root / "step_000003" / "model.safetensors").read_bytes() == b"w"
    assert sorted(p.name for p in root.iterdir()) == ["step_000003"]


def test_an_interrupt_while_removing_a_checkpoint_leaves_no_debris(tmp_path, monkeypatch):
    """SIGTERM is raised like Ctrl-C: one that lands while rotation deletes a checkpoint must still leave
    the folder gone (not a ``.step_N.removing`` for the next start to clean), and stop the run."""
    checkpoint = tmp_path / "checkpoints" / "step_000003"
    checkpoint.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "state.json"):
        (checkpoint / name).write_text("x")
    real, calls = ckpt.shutil.rmtree, []

    def interrupted(path, *args, **kwargs):
        calls.append(Path(path).name)
        if len(calls) == 2:  # the rmtree after the rename: interrupted part-way
            (Path(path) / "model.safetensors").unlink()
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.remove_checkpoint(checkpoint)
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert calls == [".step_000003.removing"] * 3


def test_sigterm_stops_like_ctrl_c(wiki_small, tmp_path):
    run = tmp_path / "run"
    proc = spawn(train_argv(wiki_small, run, "--max-steps", "100000", "--eval-every", "100000"))
    deadline = time.monotonic() + 120
    while not list_checkpoints(run) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert list_checkpoints(run), proc.stderr.read() if proc.poll() is not None else "no checkpoint in time"
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    err = [line for line in proc.stderr.read().splitlines() if "%|" not in line and line.strip()]
    assert code == 128 + signal.SIGTERM, err
    assert err[-1].endswith("terminated (SIGTERM)") and not any("Traceback" in line for line in err)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not (run / "summary.json").exists()
    # the lock died with the process; the run resumes
    newest = list_checkpoints(run)[-1].name
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "100000",
                 "--stop-at", str(int(newest[5:]) + 1)]) == 0


def test_full_disk_is_one_line_and_keeps_checkpoints(wiki_small, tmp_path):
    """RLIMIT_FSIZE stands in for a full disk (no root needed): writes past it fail with EFBIG."""
    run = tmp_path / "run"
    assert main(train_argv(wiki_small, run, "--max-steps", "3")) == 0
    before = {p.name: p.read_bytes() for p in list_checkpoints(run)[0].iterdir()}
    script = ("import resource, signal, sys\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (60000, 60000))\n"
              "from rdepth.cli.main import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", script, "train", "--out", str(run), "--resume",
                             "--max-steps", "6"], env=ENV, capture_output=True, text=True, timeout=240)
    err = [line for line in result.stderr.splitlines() if line.strip() and "%|" not in line and " INFO " not in line]
    assert result.returncode == 2 and len(err) == 1 and "cannot write checkpoint" in err[0], result.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in list_checkpoints(run)[0].iterdir()} == before
    assert [p.name for p in list_checkpoints(run)] == ["step_000003"]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_second_prepare_of_one_folder_is_refused(tmp_path):
    from rdepth.data.shards import ShardWriter

    holder = hold_lock_beside(tmp_path / "data")
    try:
        with pytest.raises(RdepthError, match="in use by rdepth prepare"), ShardWriter(tmp_path / "data", 100, 99):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with ShardWriter(tmp_path / "data", 100, 99) as writer:
        writer.write_split("train", [[1, 2]])
        writer.write_split("val", [[3]])
        writer.commit({"vocab_size": 100})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no lock or staging left


def hold_lock_beside(folder: Path) -> subprocess.Popen:
    script = ("import sys, time\nfrom rdepth.io import exclusive\n"
              "with exclusive(sys.argv[1], 'prepare', beside=True):\n"
              "    print('locked', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(folder)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


@pytest.mark.parametrize("command", ["analyze", "sweep", "demo", "surrogate"])
def test_cli_writers_lock_their_out_folder(tmp_path, capsys, command):
    out = tmp_path / "out"
    argv = {"analyze": ["analyze", "--checkpoints", "nowhere", "--data", "nowhere", "--out", str(out)],
            "sweep": ["sweep", "--checkpoint", "nowhere", "--data", "nowhere", "--out", str(out)],
            "demo": ["demo", "--out", str(out)],
            "surrogate": ["surrogate", "--out", str(out)]}[command]
    holder = hold_lock(out, "analyze")
    try:
        assert main(argv) == 2
        assert "in use by rdepth analyze" in error_line(capsys)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_exclusive_is_reentrant_within_a_process(tmp_path):
    """A pipeline that locks its folder may run inside a command that already holds it
    (e.g. prepare() around the shard writer); other processes stay locked out until the outer exit."""
    out = tmp_path / "data"
    probe = ("import sys\nfrom rdepth.io import exclusive\n"
             "with exclusive(sys.argv[1], 'prepare', beside=True): pass\n")

    def other_process_refused() -> bool:
        result = subprocess.run([sys.executable, "-c", probe, str(out)], env=ENV, capture_output=True,
                                text=True, timeout=60)
        return result.returncode != 0 and "in use by rdepth prepare" in result.stderr

    with io.exclusive(out, "prepare", beside=True):
        with io.exclusive(out, "prepare", beside=True):
            pass
        assert other_process_refused()
    assert not other_process_refused()
