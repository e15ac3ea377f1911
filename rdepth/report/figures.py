"""The one figure saver: every plot of every analysis is written as PNG + SVG here.

Plot functions (``geometry.plots``, ``surrogate.plots``, ``exits.plots``) only
draw from saved numbers and return a matplotlib Figure; :func:`save_figure`
writes it atomically and closes it. matplotlib is imported lazily, with the Agg
backend, so importing this module costs nothing.
"""

from __future__ import annotations

from pathlib import Path

from rdepth.io import atomic_path

FIGURES_DIR = "figures"  # the usual folder, relative to a report page
FORMATS = ("png", "svg")
DPI = 130


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, folder: str | Path, name: str, *, dpi: int = DPI) -> dict[str, Path]:
    """Write ``folder/name.png`` and ``folder/name.svg`` atomically (tight bounding box), close
    ``figure``, and return ``{"png": path, "svg": path}``."""
    folder = Path(folder)
    paths: dict[str, Path] = {}
    try:
        for suffix in FORMATS:
            path = folder / f"{name}.{suffix}"
            with atomic_path(path) as tmp:
                figure.savefig(tmp, format=suffix, dpi=dpi, bbox_inches="tight")
            paths[suffix] = path
    finally:
        pyplot().close(figure)
    return paths


def save_report_figure(figure, out: str | Path, name: str, *, dpi: int = DPI) -> str:
    """:func:`save_figure` into ``out/figures``; returns the PNG's path relative to ``out``
    (what a report page in ``out`` links)."""
    save_figure(figure, Path(out) / FIGURES_DIR, name, dpi=dpi)
    return f"{FIGURES_DIR}/{name}.png"
