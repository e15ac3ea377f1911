"""Virtual environments holding older ``transformers`` releases, for the export's version tests.

No tests here. ``python tests/hf_venvs.py [DIR]`` builds one venv per entry of :data:`VENVS` under
``DIR`` (default ``.hf-venvs`` in the clone, gitignored); ``.ci/run`` runs it before the tests, and
``tests/test_hf_versions.py`` runs a small script in each venv that exists (it skips the ones that
do not). Each venv sees the packages of the interpreter that builds it (torch, safetensors, numpy) and pins
its own ``transformers`` and what that release needs (``tokenizers``, ``huggingface-hub``), which
shadow those copies inside the venv only. Run from a venv (as most people install), the builder's
packages are the venv's, not the base interpreter's that ``--system-site-packages`` alone would give:
a ``.pth`` file in each new venv adds the builder's own site-packages after the venv's.

A venv already built with the same pins is kept (a ``pins.txt`` inside records them), so a second
run costs nothing.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".hf-venvs"

# name -> pip requirements. The oldest supported release, the last 4.x, the first 5.x; the newest
# (the project's pin) is the system's own and is tested by tests/test_hf_export.py.
VENVS: dict[str, tuple[str, ...]] = {
    "tf4.46": ("transformers==4.46.3", "tokenizers>=0.20,<0.21", "huggingface-hub>=0.23.2,<1"),
    "tf4.57": ("transformers==4.57.6", "tokenizers>=0.22,<=0.23.0", "huggingface-hub>=0.34,<1"),
    "tf5.0": ("transformers==5.0.0", "tokenizers>=0.22,<=0.23.0", "huggingface-hub>=1.3,<2"),
}


def venv_dir() -> Path:
    """Where the venvs live: ``$RDEPTH_HF_VENVS``, else ``.hf-venvs`` in the clone."""
    return Path(os.environ.get("RDEPTH_HF_VENVS") or DEFAULT_DIR)


def python_of(folder: Path) -> Path:
    return folder / "bin" / "python"


def ready(folder: Path, pins: tuple[str, ...]) -> bool:
    """A venv built with exactly these pins (its marker is written last, after pip succeeded)."""
    marker = folder / "pins.txt"
    return (python_of(folder).exists() and marker.exists() and marker.read_text() == "\n".join(pins)
            and any(folder.glob("lib/python*/site-packages/_rdepth_builder.pth")))


def builder_site_packages() -> list[str]:
    """The running interpreter's own package folders (a venv's when run from one), in its order."""
    folders = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        folders.append(site.getusersitepackages())
    return list(dict.fromkeys(folder for folder in folders if os.path.isdir(folder)))


def create(folder: Path, with_pip: bool = True) -> None:
    """An empty venv at ``folder`` that sees the running interpreter's packages after its own."""
    command = [sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(folder)]
    subprocess.run(command + ([] if with_pip else ["--without-pip"]), check=True)
    inner = subprocess.run([str(python_of(folder)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True).stdout.strip()
    Path(inner).mkdir(parents=True, exist_ok=True)
    (Path(inner) / "_rdepth_builder.pth").write_text("".join(f"{path}\n" for path in builder_site_packages()))


def install(folder: Path, pins: tuple[str, ...] | list[str], label: str, what: str | None = None) -> None:
    """A venv at ``folder`` (:func:`create`) holding ``pins``, kept as it is when built with the same pins
    (``pins.txt``); prints ``label`` ready or installing ``what`` (default: the pins)."""
    if ready(folder, pins):
        print(f"{label}: ready", flush=True)
        return
    print(f"{label}: installing {what or ' '.join(pins)}", flush=True)
    (folder / "pins.txt").unlink(missing_ok=True)
    create(folder)
    subprocess.run([str(python_of(folder)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *pins], check=True)
    (folder / "pins.txt").write_text("\n".join(pins))


def build(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, pins in VENVS.items():
        install(root / name, pins, f"hf venv {name}")


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else venv_dir())
