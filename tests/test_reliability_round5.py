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
