"""The GPU suite's entry (the sections live in :mod:`bench.gpu`): ``python3 -m bench.gpu_suite --help``
from the repository root. Run as a file (``python3 bench/gpu_suite.py ...``), it runs itself again as
that module with the repository root on ``PYTHONPATH``, so older commands keep working."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    root = str(Path(__file__).resolve().parents[1])
    paths = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    # -P: the current folder is not put first on sys.path, so another checkout's bench/ cannot shadow this one.
    os.execve(sys.executable, [sys.executable, "-P", "-m", "bench.gpu_suite", *sys.argv[1:]],
              {**os.environ, "PYTHONPATH": paths})

from bench.gpu.suite import main, parse_args  # noqa: E402

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    from rdepth.cli.main import run_command  # bad input: one line, exit 2, as the command line

    raise SystemExit(run_command("bench/gpu_suite.py", main))
