"""``tests/hf_venvs.py`` run from a virtual environment: the venvs it builds see that venv's packages
(torch there, not in the base interpreter, is how most people install), not only the base's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_a_venv_built_from_inside_a_venv_sees_the_outer_venvs_packages(tmp_path):
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True)
    outer_python = outer / "bin" / "python"
    purelib = subprocess.run([str(outer_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # a package only the outer venv holds (as torch is in a user's venv)
    Path(purelib, "outer_only_probe.py").write_text("WHERE = 'outer'\n")
    inner = tmp_path / "inner"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import hf_venvs
        hf_venvs.create(__import__('pathlib').Path({str(inner)!r}), with_pip=False)
    """)
    subprocess.run([str(outer_python), "-c", script], check=True)
    seen = subprocess.run([str(inner / "bin" / "python"), "-c", "import outer_only_probe; print(outer_only_probe.WHERE)"],
                          capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.strip() == "outer"
    # the inner venv's own packages come first (its pins shadow the builder's copies)
    order = subprocess.run([str(inner / "bin" / "python"), "-c",
                            "import sys, sysconfig; p = sysconfig.get_paths()['purelib'];"
                            f"print(sys.path.index(p) < sys.path.index({purelib!r}))"],
                           check=True, capture_output=True, text=True).stdout.strip()
    assert order == "True"
