"""Reliability round 6 (issue 61), the command line: flags that would be ignored are refused, ``generate
--prompts-file`` writes each result as it finishes (an interrupted run keeps them), a Ctrl-C while torch
imports never aborts, and two messages that named the wrong problem. Each test fails without its fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import sigint_at_default
from test_hf_helpers import tiny_run

import rdepth.run.generate_many as generate_many_module
from rdepth.cli import main as cli_main
from rdepth.cli.main import main
from rdepth.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
PROMPTS = ["A", "The city of the river and the", "In 1900 the", "Music", "The"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder, _ = tiny_run(tmp_path_factory.mktemp("round6") / "run")
    return folder


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and " INFO " not in line and " WARNING " not in line
            and "%|" not in line]


def generate(capsys, run, *flags) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", "--checkpoint", str(run), "--device", "cpu", "--max-new-tokens", "4", *flags])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ item 8: flags that would be ignored
def test_generate_refuses_the_flags_it_would_ignore(capsys, run, tmp_path):
    """``--batch-size`` sizes the engine only (with --prompts-file), and --prompts-file replaces --prompt: both were
    accepted and ignored. Judged on what was typed: --batch-size 8, the default's value, is refused too."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The\n")
    for flags, words in ((["--batch-size", "4"], "--batch-size is the engine's (with --prompts-file)"),
                         (["--batch-size", "8", "--prompt", "A"], "--batch-size is the engine's"),
                         (["--prompt", "A", "--prompts-file", str(prompts)], "give --prompt or --prompts-file, not both")):
        code, out, err = generate(capsys, run, *flags)
        lines = error_lines(err)
        assert code == 2 and out == "" and len(lines) == 1, (flags, err)
        assert lines[0].startswith("rdepth generate: error: generate: ") and words in lines[0], (flags, lines)
    # what each applies to still runs
    assert generate(capsys, run, "--prompt", "A", "--temperature", "0")[0] == 0
    assert generate(capsys, run, "--prompts-file", str(prompts), "--batch-size", "2", "--temperature", "0")[0] == 0


# ------------------------------------------------------------------ item 13: the messages name the problem
def test_prompts_file_that_is_a_directory_says_so(capsys, run, tmp_path):
    code, _, err = generate(capsys, run, "--prompts-file", str(tmp_path))
    lines = error_lines(err)
    assert code == 2 and lines == [f"rdepth generate: error: generate: --prompts-file {tmp_path} is a directory; "
                                   "give a text file of prompts, one per line"], err


def test_resume_of_a_finished_run_says_it_is_finished_and_how_to_go_on():
    """A run saved at its --max-steps (40) and resumed as it was said "--max-steps 40 ends before the checkpoint's
    step 40"; a --max-steps below the checkpoint's step names both and the way on."""
    from rdepth.errors import RdepthError
    from rdepth.train.config import TrainConfig
    from rdepth.train.resume import check_resume_config

    saved = TrainConfig(max_steps=40)
    with pytest.raises(RdepthError) as error:
        check_resume_config(saved, TrainConfig(max_steps=40), 40)
    assert str(error.value) == ("--resume: the run is already finished (it reached its --max-steps, step 40); to "
                                "train it further, resume with --max-steps above 40")
    for wanted, step in ((30, 40), (20, 20)):  # below the checkpoint; a stopped run's step given as its end
        with pytest.raises(RdepthError) as error:
            check_resume_config(TrainConfig(max_steps=40 if step == 40 else 60), TrainConfig(max_steps=wanted), step)
        assert str(error.value) == (f"--resume: --max-steps {wanted} ends at or before the checkpoint's step {step}, "
                                    f"leaving nothing to train; to train the run further, give --max-steps above {step}")
    assert check_resume_config(saved, TrainConfig(max_steps=41), 40) == {"max_steps": [40, 41]}


# ------------------------------------------------------------------ item 12: results written as they finish
def blocks(out: str) -> list[str]:
    """The output cut after each '--- prompt i, sample s: ...' line (one block per result)."""
    found, current = [], []
    for line in out.splitlines(keepends=True):
        current.append(line)
        if line.startswith("--- prompt "):
            found.append("".join(current))
            current = []
    assert not current, f"a partial block at the end: {current}"
    return found


# (batch, requests finished before the Ctrl-C, results kept): one slot finishes the prompts in file order; three
# finish the short prompts 0 and 2 first and the long prompt 1 last, so result 2 waits for result 1 (file order)
@pytest.mark.parametrize("batch, finished_before_interrupt, kept", [(1, 3, 3), (3, 2, 1), (3, 4, 1)])
def test_an_interrupted_prompts_file_run_keeps_the_results_it_finished(capsys, monkeypatch, run, tmp_path, batch,
                                                                       finished_before_interrupt, kept):
    """A Ctrl-C after k requests finished: the output holds exactly the first results of the full run, those whose
    requests, and every one before them in the file, had finished (file order kept); before, nothing."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    flags = ("--prompts-file", str(prompts), "--batch-size", str(batch), "--temperature", "0", "--max-new-tokens", "5")
    code, out, _ = generate(capsys, run, *flags)
    full = blocks(out)
    assert code == 0 and len(full) == len(PROMPTS)

    order = []

    class Interrupted(Engine):
        def run(self):
            for done in super().run():
                order.append(done.request.tag[0])
                yield done
                if len(order) == finished_before_interrupt:
                    raise KeyboardInterrupt

    monkeypatch.setattr(generate_many_module, "Engine", Interrupted)
    code, out, err = generate(capsys, run, *flags)
    done_in_file_order = 0
    while done_in_file_order in order:
        done_in_file_order += 1
    assert code == 130 and error_lines(err) == ["rdepth generate: interrupted"], err
    assert len(order) == finished_before_interrupt and done_in_file_order == kept, order
    assert blocks(out) == full[:kept]


def test_a_prompts_file_run_writes_each_result_before_the_next_is_done(run, tmp_path):
    """Through a pipe (block-buffered): two results are read while the engine still runs (before, every result came
    after the engine's last), then SIGINT ends it with one line, status 130, and stdout holds whole results, in
    file order."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"{PROMPTS[n % len(PROMPTS)]} {n}" for n in range(400)) + "\n")
    child = subprocess.Popen([sys.executable, "-m", "rdepth", "generate", "--checkpoint", str(run), "--prompts-file",
                              str(prompts), "--batch-size", "1", "--max-new-tokens", "40", "--device", "cpu",
                              "--threads", "1"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=sigint_at_default)
    try:
        read = []
        while sum(line.startswith("--- prompt ") for line in read) < 2:
            line = child.stdout.readline()
            assert line, "the run ended (or wrote nothing) before two results were written"
            read.append(line)
        child.send_signal(signal.SIGINT)
        rest, err = child.stdout.read(), child.stderr.read()  # (through the readers that read ahead)
        child.wait(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "engine: " not in err, "the engine had finished (its summary logged) before the interrupt: more prompts"
    assert child.returncode == 130 and error_lines(err) == ["rdepth generate: interrupted"], err
    written = blocks("".join(read) + rest)
    assert len(written) >= 2
    assert [block.splitlines()[-1].split(":")[0] for block in written] == \
        [f"--- prompt {n + 1}, sample 1" for n in range(len(written))]


# ------------------------------------------------------------------ item 11: Ctrl-C while torch imports
def test_ctrl_c_while_the_parser_is_built_raises_nothing_inside_it(monkeypatch, capsys, python_sigint):
    """Building the parser imports torch; a KeyboardInterrupt raised in the middle of torch's native import can
    abort the process (SIGABRT). The Ctrl-C must raise nothing there: the import completes, then the command
    line ends with one line, status 130, and Ctrl-C's handler is the one before."""
    real = cli_main.build_parser
    reached = []

    def build_parser():
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, in the middle of the imports
        for _ in range(100_000):  # (Python runs a pending signal's handler between bytecodes)
            pass
        reached.append(True)
        return real()

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli_main, "build_parser", build_parser)
    assert main(["generate", "--checkpoint", "missing"]) == 130  # (the command does not run)
    assert reached == [True] and capsys.readouterr().err == "rdepth: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before


def test_a_process_that_ignores_ctrl_c_keeps_ignoring_it():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with cli_main.deferred_interrupt() as interrupted:
            os.kill(os.getpid(), signal.SIGINT)
        assert interrupted == [] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


CHILD = ("import sys, time\n"
         "from rdepth.cli import main as cli\n"
         "cli._run = lambda args: time.sleep(60)  # the command: a minute of waiting\n"
         "print('ready', flush=True)\n"
         "sys.exit(cli.main(['generate', '--checkpoint', 'run']))\n")


def test_ctrl_c_at_any_moment_of_the_start_is_one_line_never_an_abort():
    """SIGINT at several delays after the command line starts (while torch imports, and after): status 130 and one
    line every time; never SIGABRT ('terminate called after throwing an instance of pybind11::error_already_set')."""
    delays = (0.0, 0.5, 2.5)  # (each try imports torch: a few)
    children = [subprocess.Popen([sys.executable, "-c", CHILD], env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, preexec_fn=sigint_at_default) for _ in delays]
    try:
        for child in children:
            assert child.stdout.readline() == "ready\n"
        start = time.monotonic()
        for delay, child in zip(delays, children, strict=True):  # (delays ascending)
            time.sleep(max(0.0, start + delay - time.monotonic()))
            child.send_signal(signal.SIGINT)
        results = [(delay, child.communicate(timeout=120)[1], child.returncode)
                   for delay, child in zip(delays, children, strict=True)]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    for delay, err, code in results:
        assert code == 130 and err.splitlines() in (["rdepth: interrupted"], ["rdepth generate: interrupted"]), \
            (delay, code, err)
    assert results[0][1] == "rdepth: interrupted\n"  # (the first: while the parser is built, torch imported)


def test_train_resume_of_a_finished_run_is_one_line_and_changes_nothing(capsys, tiny_text_run, tmp_path):
    """``rdepth train --resume`` on a run that reached its --max-steps (8): the run is finished, and how to go on."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_text_run, run)
    before = sorted((path.relative_to(run), path.stat().st_size, path.stat().st_mtime_ns) for path in run.rglob("*"))
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--threads", "1"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "rdepth train: error: --resume: the run is already finished (it reached its --max-steps, step 8); to train it "
        "further, resume with --max-steps above 8"]
    assert sorted((path.relative_to(run), path.stat().st_size, path.stat().st_mtime_ns)
                  for path in run.rglob("*")) == before
