"""The one figure saver: every plot of every analysis is written as PNG + SVG here.

Plot functions (``geometry.plots``, ``surrogate.pages.plots``, ``sweep.plots``) only
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
    # Labels, titles, legends and ticks often carry text a user chose (folder names, run labels): a '$'
    # there must be a dollar sign, never the start of a formula (an unbalanced one is a parse error).
    # A plot that means a formula passes ``parse_math=True`` to that one text.
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def plain_log_ticks(axis) -> None:
    """Label a log-scaled matplotlib ``axis`` (``ax.xaxis`` / ``ax.yaxis``) with plain numbers
    (0.3, 2, 6), not powers of ten (3×10⁻¹, 2×10⁰); minor ticks labelled only on short ranges."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axis.set_major_formatter(plain)
    low, high = sorted(abs(v) for v in axis.get_view_interval())
    if low > 0 and high / low < 20:  # less than about a decade: label the minor ticks too
        axis.set_minor_formatter(plain)
    else:
        axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        axis.set_minor_formatter(plain)


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
