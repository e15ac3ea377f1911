"""Reliability round 6 (issue 61), the bench scripts and the held-out loader: an empty held-out set, a text run
on task data, list flags that hold nothing usable, servers left running, refusals that ended with exit 1.
Each test fails without its fix."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
CHASE = json.dumps({"chase": {"nodes": 8, "queries": 4, "ordered": True}})


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and "%|" not in line and " INFO " not in line
            and " WARNING " not in line]


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """Tiny chase data (held-out difficulties 1, 2, 3, 5, 6) and a run of 3 steps on it with one looped group
    (the depth-batching benchmarks take only those)."""
    from rdepth.cli.main import main

    root = tmp_path_factory.mktemp("round6")
    data, run = root / "data", root / "run"
    assert main(["prepare", "--corpus", "task:chase", "--out", str(data), "--train-difficulties", "1,3",
                 "--train-tokens", "4000", "--val-tokens", "1000", "--heldout-problems", "8", "--block-size", "20",
                 "--task-params", CHASE]) == 0
    assert main(["train", "--data", str(data), "--out", str(run), "--n-layer", "3", "--n-head", "2", "--d-model", "16",
                 "--block-size", "20", "--groups", "1", "--mean-loops", "2", "--backprop-depth", "2",
                 "--max-steps", "3", "--batch-size", "4", "--eval-batches", "1", "--threads", "1"]) == 0
    return data, run


@pytest.fixture(scope="module")
def emptied(task_run, tmp_path_factory):
    """A copy of the task data whose every held-out file holds no window (the manifest unchanged)."""
    data, _ = task_run
    copy = tmp_path_factory.mktemp("emptied") / "data"
    shutil.copytree(data, copy)
    for path in copy.glob("heldout_d*.npz"):
        with np.load(path) as saved:
            arrays = {name: saved[name][:0] if saved[name].ndim else saved[name] for name in saved.files}
        np.savez(path, **arrays)
    return copy


def in_process(capsys, label: str, call) -> tuple[int, list[str]]:
    """A bench script's ``main`` as its ``__main__`` runs it: exit status and stderr's lines."""
    from rdepth.cli.main import run_command

    capsys.readouterr()
    try:
        code = run_command(label, call)
    except SystemExit as exc:  # the parser's own error: one line, status 2
        code = exc.code
    return code, error_lines(capsys.readouterr().err)


def bench_module(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import importlib

    return importlib.import_module(name)


# ---------------------------------------------------------------------- item 6: an empty held-out set
def test_the_loader_refuses_a_heldout_set_with_no_problem(task_run, emptied, tmp_path):
    """Issue 61 item 6: ``torch.cat(): expected a non-empty list`` deep in each caller; now the one loader of
    held-out sets names the folder and the difficulty, for no window and for windows that hold no answer."""
    from rdepth.errors import RdepthError
    from rdepth.tasks.data import load_heldout

    data, _ = task_run
    assert load_heldout(data, 2).tokens.shape[0] >= 1  # the intact set still loads
    with pytest.raises(RdepthError, match=r"data: the held-out set of difficulty 2 \(heldout_d2.npz\) holds no problem"):
        load_heldout(emptied, 2)
    padding = tmp_path / "data"  # windows of padding only: every problem id -1, no answer
    shutil.copytree(data, padding)
    with np.load(padding / "heldout_d3.npz") as saved:
        arrays = {name: saved[name] for name in saved.files}
    arrays["problem_ids"] = np.full_like(arrays["problem_ids"], -1)
    arrays["answer_mask"] = np.zeros_like(arrays["answer_mask"])
    np.savez(padding / "heldout_d3.npz", **arrays)
    with pytest.raises(RdepthError, match="difficulty 3 .* holds no problem"):
        load_heldout(padding, 3)
    arrays["problem_ids"] = arrays["problem_ids"][:, :-1]  # arrays of two shapes: damaged
    np.savez(padding / "heldout_d3.npz", **arrays)
    with pytest.raises(RdepthError, match="difficulty 3 .* has arrays of shapes"):
        load_heldout(padding, 3)


@pytest.mark.parametrize("command", ["eval", "sweep"])
def test_eval_and_sweep_on_an_empty_heldout_set_are_one_line(task_run, emptied, tmp_path, capsys, command):
    from rdepth.cli.main import main

    _, run = task_run
    argv = [command, "--checkpoint", str(run), "--data", str(emptied)]
    argv += ["--out", str(tmp_path / "sweep"), "--no-progress"] if command == "sweep" else []
    capsys.readouterr()
    assert main(argv) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"rdepth {command}: error: {emptied}: the held-out set of "
                                                   "difficulty ") and "holds no problem" in lines[0], lines
    assert not (tmp_path / "sweep").exists()


def test_bench_scripts_on_an_empty_heldout_set_are_one_line(task_run, emptied, capsys, monkeypatch):
    _, run = task_run
    cases = {"exit_wall": ["task", "--run", run, "--data", emptied, "--difficulty", "2", "--policies", "step_norm"],
             "depth_batching": ["--run", run, "--data", emptied, "--difficulties", "1,2"],
             "task_accuracy_time": ["--run", run, "--data", emptied, "--budgets", "1,2"]}
    for name, argv in cases.items():
        main = bench_module(name, monkeypatch).main
        code, lines = in_process(capsys, f"bench/{name}.py", lambda main=main, argv=argv: main(list(map(str, argv))))
        assert code == 2 and len(lines) == 1 and f"{emptied}: the held-out set of difficulty" in lines[0], (name, lines)
        assert "holds no problem" in lines[0]


# ---------------------------------------------------------------------- item 5: a text run on task data
@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A run of 2 steps on a small text corpus (a 300-token BPE): a text model's tokenizer."""
    import random

    from rdepth.cli.main import main

    root = tmp_path_factory.mktemp("text")
    words = ["the", "loop", "takes", "a", "step", "and", "the", "state", "moves", "toward", "its", "fixed", "point",
             "while", "tokens", "wait"]
    draw = random.Random(0)
    (root / "corpus").mkdir()
    for index in range(30):
        (root / "corpus" / f"doc{index}.txt").write_text(" ".join(draw.choice(words) for _ in range(200)))
    assert main(["prepare", "--corpus", str(root / "corpus"), "--tokenizer", "bpe:300", "--out",
                 str(root / "data")]) == 0
    assert main(["train", "--data", str(root / "data"), "--out", str(root / "run"), "--n-layer", "3", "--n-head", "2",
                 "--d-model", "16", "--block-size", "20", "--groups", "1", "--mean-loops", "2", "--backprop-depth",
                 "2", "--max-steps", "2", "--batch-size", "4", "--eval-batches", "1", "--threads", "1"]) == 0
    return root / "run"


def test_serve_load_takes_its_prompts_from_a_text_corpus(task_run, text_run, monkeypatch):
    """A text run's prepared folder (no task problems): windows of --prompt-tokens tokens, each a slice of its
    validation split; a task run on that folder is refused in one line (another tokenizer)."""
    from argparse import Namespace

    from rdepth.errors import RdepthError
    from rdepth.run.checkpoint import load_model
    from rdepth.run.heldout import held_out_tokens

    serve_load = bench_module("serve_load", monkeypatch)
    data = text_run.parent / "data"
    args = Namespace(run=str(text_run), data=str(data), requests=5, prompt_tokens=7, difficulties="1")
    prompts = serve_load.heldout_prompts(args)
    val, _ = held_out_tokens(data, text_run, load_model(text_run, "cpu")[0].config)
    text = " ".join(map(str, val.tolist()))
    assert len(prompts) == 5 and all(len(prompt) == 7 for prompt in prompts) and len(set(map(tuple, prompts))) == 5
    assert all(" ".join(map(str, prompt)) in text for prompt in prompts)
    _, run = task_run
    with pytest.raises(RdepthError, match="prepared with tokenizer"):
        serve_load.heldout_prompts(Namespace(run=str(run), data=str(data), requests=5, prompt_tokens=7,
                                             difficulties="1"))


def test_exit_wall_task_mode_refuses_a_text_run_on_task_data(task_run, text_run, capsys, monkeypatch):
    """Issue 61 item 5 (round 5's B03): ``exit_wall.py task`` printed accuracy rows for a text model on task
    data (its ids read through another vocabulary) and exited 0; now the tokenizer check of ``rdepth eval``."""
    data, _ = task_run
    exit_wall = bench_module("exit_wall", monkeypatch)
    capsys.readouterr()
    code = exit_wall.main(["task", "--run", str(text_run), "--data", str(data), "--difficulty", "2", "--policies",
                           "step_norm", "--problems", "4", "--timed-problems", "1", "--batch", "", "--rounds", "1"])
    captured = capsys.readouterr()
    lines = error_lines(captured.err)
    assert code == 2 and len(lines) == 1 and "tokenizer 'task:chase'" in lines[0] and "'bpe:300'" in lines[0], lines
    assert "accuracy" not in captured.out


# ---------------------------------------------------------------------- list flags
@pytest.mark.parametrize("flags, words", [
    (["--widths", ""], "--widths needs at least one integer >= 1"),
    (["--widths", "a"], "--widths takes integers >= 1 separated by commas, got 'a'"),
    (["--widths", "8,0"], "--widths takes integers >= 1"),
    (["--difficulties", ""], "--difficulties needs at least one integer"),
    (["--difficulties", "a,b"], "--difficulties takes integers >= 1 separated by commas, got 'a,b'"),
])
def test_depth_batching_list_flags_are_one_line_before_any_work(task_run, capsys, monkeypatch, flags, words):
    """Issue 61 items 5 and 6: ``--widths ''`` timed nothing and exited 0 (after the whole quality grid);
    ``--widths a`` and the difficulty lists were tracebacks."""
    data, run = task_run
    depth_batching = bench_module("depth_batching", monkeypatch)
    code, lines = in_process(capsys, "bench/depth_batching.py", lambda: depth_batching.main(
        ["--run", str(run), "--data", str(data), "--difficulties", "1,2", "--problems", "2", "--splits", "2",
         "--rounds", "1", "--warmup", "0", "--full-loops", "2", "--no-shared", "--ticks", "eager", *flags]))
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"bench/depth_batching.py: error: {words}"), lines


def test_the_shared_list_parser():
    from bench.flags import positive_ints
    from rdepth.errors import RdepthError

    assert positive_ints("--x", "1, 8,16,") == [1, 8, 16] and positive_ints("--x", "", empty=True) == []
    for bad in ("", " , ", "a", "1,-2", "0", "1.5"):
        with pytest.raises(RdepthError, match="^--x "):
            positive_ints("--x", bad)


# ---------------------------------------------------------------------- item 7: serve_load's servers
def _started_processes(monkeypatch) -> list[subprocess.Popen]:
    """Every process started from now on in this test (recorded as it is made)."""
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return started


def _left_running(started) -> list:
    """The processes of ``started`` still running, stopped here (so that a failing test leaves none)."""
    running = [process for process in started if process.poll() is None]
    for process in running:
        process.kill()
        process.wait()
    return running


@pytest.mark.parametrize("flags, words", [
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--clients", "0"], "--clients must be >= 1, got 0"),
    (["--difficulties", ""], "--difficulties needs at least one integer"),
    (["--difficulties", "1,x"], "--difficulties takes integers"),
    (["--exit", "bogus"], "unknown exit policy 'bogus'"),
    (["--tick", "bogus"], "--tick takes eager, static, compiled, graph, compiled-graph, token, got 'bogus'"),
    (["--fixed-tick", "bogus"], "--fixed-tick takes eager, static, compiled, graph, compiled-graph, token, got 'bogus'"),
    (["--ahead", "0"], "--ahead must be >= 1, got 0"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
])
def test_serve_load_refuses_bad_flags_before_starting_a_server(task_run, capsys, monkeypatch, flags, words):
    """Issue 61 items 6 and 7: ``--requests 0``, ``--clients 0``, ``--difficulties ''`` were tracebacks;
    ``--exit bogus`` and ``--tick bogus`` failed after one server had started and left it running,
    ``--prompt-tokens 0`` after both."""
    data, run = task_run
    serve_load = bench_module("serve_load", monkeypatch)
    started = _started_processes(monkeypatch)
    argv = ["--run", str(run), "--data", str(data), "--difficulties", "1,2,3", "--loops", "2", "--exit", "step_norm",
            "--tau", "0.5", "--k-max", "3", "--requests", "4", "--clients", "2", "--prompt-tokens", "4",
            "--max-tokens", "2", "--rounds", "1", "--batch-size", "2", *flags]
    code, lines = in_process(capsys, "bench/serve_load.py", lambda: serve_load.main(argv))
    assert not _left_running(started)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("bench/serve_load.py: error: ") \
        and words in lines[0], lines


def _fake_servers(monkeypatch, serve_load, healthy):
    """Servers that are a sleeping Python each; ``healthy(index)`` stands for the /health wait."""
    calls = []
    monkeypatch.setattr(serve_load, "server_command",
                        lambda args, port, flags: [sys.executable, "-c", "import time; time.sleep(120)"])

    def wait(process, url, log, seconds=120):
        calls.append(process)
        healthy(len(calls) - 1)

    monkeypatch.setattr(serve_load, "wait_until_healthy", wait)
    return calls


def test_serve_load_stops_every_server_it_started_however_it_ends(monkeypatch):
    """Issue 61 item 7: servers were stopped only after both had started and only for errors in the timed
    rounds; now every one started is stopped when a later one fails to start, on an error, and on Ctrl-C."""
    from argparse import Namespace

    from rdepth.errors import RdepthError

    serve_load = bench_module("serve_load", monkeypatch)
    args = Namespace(run="run", batch_size=2)
    settings = {"fixed 2": (["--loops", "2"], None), "step_norm 0.5": (["--exit", "step_norm"], None)}

    def second_fails(index):
        if index == 1:
            raise RdepthError("the server exited (status 2): rdepth serve: error: bad flag")

    started = _fake_servers(monkeypatch, serve_load, second_fails)
    with pytest.raises(RdepthError, match="the server exited"), serve_load.running_servers(args, settings):
        pass
    assert len(started) == 2 and not _left_running(started)
    for ending in (KeyboardInterrupt, RdepthError):
        started = _fake_servers(monkeypatch, serve_load, lambda index: None)
        with pytest.raises(ending), serve_load.running_servers(args, settings) as urls:
            assert list(urls) == list(settings) and all(p.poll() is None for p in started)
            raise ending()
        assert len(started) == 2 and not _left_running(started)
        assert all(process.returncode == -15 for process in started)  # SIGTERM'd by the context


# ---------------------------------------------------------------------- item 13: exit 2, one line
def test_no_bench_script_refuses_with_exit_1_or_a_usage_dump():
    """Issue 61 item 13: ``raise SystemExit("...")`` exits 1, and argparse's own parser prints its usage
    before the error; every bench script raises RdepthError (one line, exit 2, through run_command) and parses
    with the command line's one-line parser."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name == "fault_campaign.py":  # (the campaign's harness: its set-up failures are not refusals)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", None) == "SystemExit" and node.exc.args and \
                    isinstance(node.exc.args[0], (ast.Constant, ast.JoinedStr)):
                found.append(f"{path.name}:{node.lineno}: SystemExit with a message (exit 1)")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                found.append(f"{path.name}:{node.lineno}: argparse.ArgumentParser (a usage dump before the error)")
    assert found == []


@pytest.mark.parametrize("script, argv, words", [
    ("engine_width.py", ["--run", "r", "--data", "d", "--widths-d", "64,x"], "--widths-d takes integers"),
    ("exit_wall.py", ["task", "--run", "r", "--data", "d", "--rounds", "many"], "argument --rounds: invalid int"),
    ("decode_speed.py", ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bench_script_refusals_are_one_line_with_status_2(script, argv, words):
    result = subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    lines = error_lines(result.stderr)
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"bench/{script}: error: ") \
        and words in lines[0], result.stderr
