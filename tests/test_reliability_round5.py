"""Reliability round 5 (issue 55): writers that never trace back, flags that apply, bench scripts that fail
as the command line does. Each test fails without its fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hf_helpers import tiny_run

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
FULL_DISK = ("import resource, signal, sys\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
             "from rdepth.cli.main import main\n"
             "sys.exit(main(sys.argv[1:]))\n")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and "%|" not in line and " INFO " not in line
            and " WARNING " not in line]


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """Issue 55: a full disk under ``rdepth export`` was a SafetensorError traceback."""
    run, _ = tiny_run(tmp_path / "run")
    size = (run / "checkpoints" / "step_000007" / "model.safetensors").stat().st_size
    result = subprocess.run([sys.executable, "-c", FULL_DISK.format(limit=size // 2), "export", "--checkpoint",
                             str(run), "--out", str(tmp_path / "hf")], env=ENV, capture_output=True, text=True,
                            timeout=300)
    lines = error_lines(result.stderr)
    assert result.returncode == 2 and len(lines) == 1 and "cannot write model.safetensors" in lines[0], result.stderr
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("command, flags, words", [
    ("sweep", ["--policies", "acceleration", "--kl-prior", "none"], "--kl-prior applies to the kl policy"),
    ("sweep", ["--policies", "acceleration,entropy_diff", "--kl-direction", "old_new"], "--kl-direction applies"),
    ("sweep", ["--policies", "acceleration", "--decode", "rest", "--no-timing"], "--decode applies to the decoded"),
    ("sweep", ["--policies", "kl", "--decode-loops", "2"], "--decode-loops applies with --decode rest only"),
    ("calibrate", ["--policy", "acceleration", "--kl-prior", "uniform"], "--kl-prior applies to the kl policy"),
    ("calibrate", ["--policy", "step_norm", "--kl-direction", "new_old"], "--kl-direction applies"),
])
def test_a_flag_no_chosen_policy_reads_is_a_one_line_error(tmp_path, capsys, command, flags, words):
    """Issue 55: sweep and calibrate ignored --kl-prior, --kl-direction, --decode and --decode-loops with
    policies that do not read them (given at their default value too)."""
    from rdepth.cli.main import main

    argv = [command, "--checkpoint", str(tmp_path / "run"), "--data", str(tmp_path / "data")]
    argv += ["--out", str(tmp_path / "out")] if command == "sweep" else ["--max-quality-loss", "0.1"]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_rule_flags_that_apply_are_taken(tmp_path):
    """The same flags where a chosen policy reads them (the Python API too: a value off its default)."""
    from rdepth.calibrate.config import CalibrateConfig
    from rdepth.errors import RdepthError
    from rdepth.sweep.config import SweepConfig

    common = dict(checkpoint=str(tmp_path), data=str(tmp_path), out=str(tmp_path / "o"))
    assert SweepConfig(**common, policies=("kl",), kl_prior="uniform", decode="rest", decode_loops=2,
                       timing=False).kl_prior == "uniform"
    assert SweepConfig(**common, policies=("acceleration",), decode="rest", timing=False,
                       exit_profile=str(tmp_path / "p.json")).decode == "rest"  # the profile's rule may read it
    with pytest.raises(RdepthError, match="--kl-prior applies"):
        SweepConfig(**common, policies=("acceleration",), kl_prior="uniform")
    assert CalibrateConfig(checkpoint="x", data="y", policy="kl", kl_prior="uniform", mean_steps=3).kl_prior == "uniform"


def test_a_key_given_twice_in_exit_options_is_an_error():
    """Issue 55: the last of two values of one key was kept silently."""
    from rdepth.errors import RdepthError
    from rdepth.run.config import policy_options

    assert policy_options("generate", "kl", "prior=uniform,direction=old_new", "run") == \
        {"prior": "uniform", "direction": "old_new"}
    with pytest.raises(RdepthError, match="gives prior twice"):
        policy_options("generate", "kl", "prior=uniform,direction=old_new, prior=none", "run")


def _exit_wall(capsys, *argv) -> tuple[int, str]:
    import exit_wall

    capsys.readouterr()
    code = exit_wall.main(list(map(str, argv)))
    return code, capsys.readouterr().err


def test_exit_wall_bad_input_is_one_line_as_the_command_line(tiny_text_run, small_chase_data, wiki_small, tmp_path,
                                                             capsys, monkeypatch):
    """Issue 55: bench/exit_wall.py gave tracebacks for a missing run, an unknown policy, a difficulty with no
    held-out set, a text run on task data, and accuracy rows for --problems 0."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    run, task = tiny_text_run, small_chase_data
    cases = [
        (["task", "--run", tmp_path / "nope", "--data", task], "not found"),
        (["task", "--run", run, "--data", task, "--policies", "nope"], "nope"),
        (["task", "--run", run, "--data", task, "--policies", "entropy_diff"], "no tau grid for entropy_diff"),
        (["task", "--run", run, "--data", task, "--problems", "0"], "--problems must be >= 1"),
        (["text", "--run", run, "--data", task, "--timed-problems", "0"], "--timed-problems must be >= 1"),
        (["task", "--run", run, "--data", task, "--difficulty", "9", "--policies", "step_norm"], ""),
        (["text", "--run", run, "--data", task, "--policies", "step_norm", "--problems", "2"], ""),
        (["task", "--run", run, "--data", tmp_path, "--policies", "step_norm"], ""),
        (["text", "--run", run, "--data", wiki_small, "--policies", "step_norm", "--problems", "2", "--timed-problems", "1",
          "--batch", "4"],
         "4 windows are timed"),  # more than the held-out set gives: a traceback before
    ]
    for argv, words in cases:
        code, err = _exit_wall(capsys, *argv)
        lines = error_lines(err)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("bench/exit_wall.py: error:"), (argv, err)
        assert words in lines[0], (argv, lines)


def test_ctrl_c_while_the_command_line_imports_is_one_line(monkeypatch, capsys):
    """Issue 55: a Ctrl-C in the first seconds (building the parser imports torch) was a traceback; so was
    one while ``python -m rdepth`` imports the command line."""
    import runpy

    from rdepth.cli import main as cli_main

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "build_parser", interrupted)
    assert cli_main.main(["eval", "--help"]) == 130
    assert capsys.readouterr().err == "rdepth: interrupted\n"

    class Interrupting:  # an import of the command line interrupted
        def find_spec(self, name, path=None, target=None):
            if name == "rdepth.cli.main":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "rdepth.cli.main")
    monkeypatch.setattr(sys, "meta_path", [Interrupting(), *sys.meta_path])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("rdepth", run_name="__main__")
    assert exit_.value.code == 130 and capsys.readouterr().err == "rdepth: interrupted\n"


def test_bench_scripts_end_as_the_command_line_does(capsys):
    """Every bench script's ``__main__`` goes through :func:`rdepth.cli.main.run_command`."""
    from rdepth.cli.main import run_command
    from rdepth.errors import RdepthError

    def bad():
        raise RdepthError("no such run")

    assert run_command("bench/x.py", bad) == 2 and capsys.readouterr().err == "bench/x.py: error: no such run\n"
    for script in sorted((ROOT / "bench").glob("*.py")):
        if script.name not in ("fault_campaign.py", "exit_workload.py", "depth_timing.py", "flags.py"):  # (no main)
            assert f'run_command("bench/{script.name}"' in script.read_text(), script.name
