"""A small static HTML report shared by every command that writes a run directory.

A report page is rendered from a registry of section files, so that several
commands can contribute to the same run's page without knowing about each
other::

    RUN/index.html                   the page (re-rendered on every write)
    RUN/report/report.json           {"title": ..., "intro": ...}
    RUN/report/sections/<name>.json  one section each: title, order, blocks

Building a page::

    report = Report("Loop geometry", intro="...")
    report.section("geometry", "Loop geometry", order=10) \\
        .table(rows, caption="Headline numbers") \\
        .figure("figures/fig1_pca.png", "PCA trajectories") \\
        .note("How to read this.")
    report.write(run_dir)

Adding or replacing one section of an existing run's page (e.g. from
``rdepth sweep``)::

    section = Section("early_exit", "Early exit", order=20).table(rows)
    add_section(run_dir, section)

Sections are listed by ``order`` then name. Figure paths are relative to the
run directory; a figure given with a ``.png`` path whose ``.svg`` sibling
exists gets a link to the vector version.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdepth.errors import RdepthError
from rdepth.io import write_json, write_text

log = logging.getLogger(__name__)

SECTIONS_DIR = Path("report") / "sections"
META_FILE = Path("report") / "report.json"
INDEX_FILE = "index.html"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class Section:
    """One titled part of the page: an ordered list of blocks (tables, figures, notes)."""

    name: str
    title: str | None = None
    order: float = 50.0
    blocks: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise RdepthError(f"report section name {self.name!r} must be letters, digits, '_', '-' or '.'")
        if self.title is None:
            self.title = self.name.replace("_", " ").capitalize()

    def table(self, rows: list[dict[str, Any]], caption: str | None = None) -> "Section":
        """A table with one row per dict; columns are the union of keys in first-seen order."""
        self.blocks.append({"kind": "table", "rows": [dict(row) for row in rows], "caption": caption})
        return self

    def figure(self, path: str | os.PathLike, caption: str = "") -> "Section":
        """An image at ``path`` relative to the run directory."""
        self.blocks.append({"kind": "figure", "path": Path(path).as_posix(), "caption": caption})
        return self

    def note(self, text: str) -> "Section":
        """A paragraph of plain text (escaped; blank lines separate paragraphs)."""
        self.blocks.append({"kind": "note", "text": text})
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "order": self.order, "blocks": self.blocks}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Section":
        return cls(
            name=data["name"], title=data.get("title"), order=float(data.get("order", 50.0)),
            blocks=list(data.get("blocks", [])),
        )


class Report:
    """A page title, an introduction and named sections; :meth:`write` saves and renders them."""

    def __init__(self, title: str, intro: str = ""):
        self.title = title
        self.intro = intro
        self.sections: dict[str, Section] = {}

    def section(self, name: str, title: str | None = None, order: float | None = None) -> Section:
        """The section called ``name``, created on first use."""
        if name not in self.sections:
            self.sections[name] = Section(name, title, 50.0 if order is None else order)
        section = self.sections[name]
        if title is not None:
            section.title = title
        if order is not None:
            section.order = order
        return section

    def write(self, run_dir: str | os.PathLike) -> Path:
        """Save title and sections into ``run_dir`` (replacing same-named ones, keeping others)
        and render ``index.html``; returns its path."""
        run_dir = Path(run_dir)
        write_json(run_dir / META_FILE, {"title": self.title, "intro": self.intro})
        for section in self.sections.values():
            write_json(run_dir / SECTIONS_DIR / f"{section.name}.json", section.to_dict())
        return render(run_dir)


def add_section(run_dir: str | os.PathLike, section: Section, title: str | None = None) -> Path:
    """Add or replace one section of ``run_dir``'s page and re-render it.

    ``title`` sets the page title when the run has no page yet (default: the
    run directory's name).
    """
    run_dir = Path(run_dir)
    if not (run_dir / META_FILE).exists():
        write_json(run_dir / META_FILE, {"title": title or run_dir.resolve().name, "intro": ""})
    write_json(run_dir / SECTIONS_DIR / f"{section.name}.json", section.to_dict())
    return render(run_dir)


def load_sections(run_dir: str | os.PathLike) -> list[Section]:
    """The sections registered in ``run_dir``, in page order."""
    folder = Path(run_dir) / SECTIONS_DIR
    sections = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            sections.append(Section.from_dict(json.loads(path.read_text())))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise RdepthError(f"corrupt report section {path}: {exc}") from None
    return sorted(sections, key=lambda s: (s.order, s.name))


def render(run_dir: str | os.PathLike) -> Path:
    """Render ``run_dir/index.html`` from the saved title and sections (atomic write)."""
    run_dir = Path(run_dir)
    meta_path = run_dir / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    title = meta.get("title") or run_dir.resolve().name
    sections = load_sections(run_dir)
    parts = [_HEAD.format(title=html.escape(title)), f"<h1>{html.escape(title)}</h1>"]
    if meta.get("intro"):
        parts.append(_paragraphs(meta["intro"]))
    if len(sections) > 1:
        links = "".join(f'<li><a href="#{s.name}">{html.escape(s.title or s.name)}</a></li>' for s in sections)
        parts.append(f"<nav><ul>{links}</ul></nav>")
    for section in sections:
        parts.append(f'<section id="{section.name}"><h2>{html.escape(section.title or section.name)}</h2>')
        for block in section.blocks:
            parts.append(_BLOCKS.get(block.get("kind"), _unknown)(block, run_dir))
        parts.append("</section>")
    parts.append("</body></html>\n")
    path = run_dir / INDEX_FILE
    write_text(path, "\n".join(parts))
    return path


# ------------------------------------------------------------------ blocks


def format_value(value: Any) -> str:
    """Numbers to 4 significant digits; lists joined; everything else as text."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value)
    return str(value)


def _table(block: dict[str, Any], run_dir: Path) -> str:
    rows = block.get("rows", [])
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_value(row.get(c)))}</td>" for c in columns) + "</tr>"
        for row in rows
    )
    caption = f"<caption>{html.escape(block['caption'])}</caption>" if block.get("caption") else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(block: dict[str, Any], run_dir: Path) -> str:
    path = block["path"]
    if not (run_dir / path).exists():
        log.warning("report figure %s is missing in %s", path, run_dir)
    src = html.escape(path, quote=True)
    vector = Path(path).with_suffix(".svg").as_posix()
    link = ""
    if vector != path and (run_dir / vector).exists():
        link = f' (<a href="{html.escape(vector, quote=True)}">SVG</a>)'
    caption = html.escape(block.get("caption", ""))
    return (
        f'<figure><a href="{src}"><img src="{src}" alt="{caption}"></a>'
        f"<figcaption>{caption}{link}</figcaption></figure>"
    )


def _paragraphs(text: str) -> str:
    return "".join(f"<p>{html.escape(p.strip())}</p>" for p in re.split(r"\n\s*\n", text) if p.strip())


def _note(block: dict[str, Any], run_dir: Path) -> str:
    return _paragraphs(block.get("text", ""))


def _unknown(block: dict[str, Any], run_dir: Path) -> str:
    return f"<p>(unknown report block {html.escape(str(block.get('kind')))})</p>"


_BLOCKS = {"table": _table, "figure": _figure, "note": _note}

_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }}
h1 {{ font-size: 1.6em; }} h2 {{ border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: .9em; }}
caption {{ text-align: left; font-weight: 600; padding-bottom: .3em; }}
th, td {{ border: 1px solid #ccc; padding: .25em .6em; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ font-size: .9em; color: #555; }} nav ul {{ columns: 2; }}
</style></head><body>"""
