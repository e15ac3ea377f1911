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

Besides tables, figures and notes a section may hold a ``headline`` (one large
paragraph), ``facts`` (label/value pairs), ``bullets`` (sentences), a row of
``figures`` side by side and ``links``. Text between ``$`` signs in notes,
headlines, bullets, captions and table headers is formula source
(``||x_{g+1}^(0) - x_g^(K)||``) and is rendered with Unicode and sub/superscripts
(:func:`formula_html`). Table cells are formatted by :func:`format_value`:
significant figures, no exponent notation that can wrap, numeric cells never
wrap, columns empty in every row dropped.
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
from rdepth.io import output_folder_name, write_json, write_text

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

    def table(self, rows: list[dict[str, Any]], caption: str | None = None) -> Section:
        """A table with one row per dict; columns are the union of keys in first-seen order."""
        self.blocks.append({"kind": "table", "rows": [dict(row) for row in rows], "caption": caption})
        return self

    def figure(self, path: str | os.PathLike, caption: str = "") -> Section:
        """An image at ``path`` relative to the run directory."""
        self.blocks.append({"kind": "figure", "path": Path(path).as_posix(), "caption": caption})
        return self

    def note(self, text: str) -> Section:
        """A paragraph of plain text (escaped; blank lines separate paragraphs; ``$...$`` is a formula)."""
        self.blocks.append({"kind": "note", "text": text})
        return self

    def headline(self, text: str) -> Section:
        """One prominent paragraph: the result a reader should see first."""
        self.blocks.append({"kind": "headline", "text": text})
        return self

    def facts(self, pairs: list[tuple[str, Any]], caption: str | None = None) -> Section:
        """Label/value pairs shown as a compact two-column table (values through :func:`format_value`)."""
        self.blocks.append({"kind": "facts", "pairs": [[str(k), v] for k, v in pairs], "caption": caption})
        return self

    def bullets(self, items: list[str], caption: str | None = None) -> Section:
        """A bulleted list of sentences."""
        self.blocks.append({"kind": "bullets", "items": list(items), "caption": caption})
        return self

    def figures(self, figures: list[tuple[str | os.PathLike, str]], aside: bool = False) -> Section:
        """Figures side by side (each ``(path, caption)``, paths relative to the run directory);
        ``aside``: stacked in a column at the right that the blocks after it flow around."""
        self.blocks.append({"kind": "figures", "aside": aside,
                            "figures": [{"path": Path(p).as_posix(), "caption": c} for p, c in figures]})
        return self

    def links(self, links: list[tuple[str, str]], caption: str | None = None) -> Section:
        """Links ``(href, label)``; hrefs relative to the page (e.g. ``../demo.json``) or absolute."""
        self.blocks.append({"kind": "links", "links": [[h, t] for h, t in links], "caption": caption})
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "order": self.order, "blocks": self.blocks}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Section:
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
        check_page_folder(run_dir)
        write_json(run_dir / META_FILE, {"title": self.title, "intro": self.intro})
        for section in self.sections.values():
            write_json(run_dir / SECTIONS_DIR / f"{section.name}.json", section.to_dict(), non_finite=format_number)
        return render(run_dir)


def add_section(run_dir: str | os.PathLike, section: Section, title: str | None = None) -> Path:
    """Add or replace one section of ``run_dir``'s page and re-render it.

    ``title`` sets the page title when the run has no page yet (default: the
    run directory's name).
    """
    run_dir = Path(run_dir)
    check_page_folder(run_dir)
    if not (run_dir / META_FILE).exists():
        write_json(run_dir / META_FILE, {"title": title or output_folder_name(run_dir), "intro": ""})
    # a non-finite cell is saved as the text the page shows for it ("nan", "∞"): standard JSON, same page
    write_json(run_dir / SECTIONS_DIR / f"{section.name}.json", section.to_dict(), non_finite=format_number)
    return render(run_dir)


def check_page_folder(run_dir: str | os.PathLike) -> None:
    """A one-line error when ``run_dir`` already holds an ``index.html`` that is not an rdepth
    report page (no ``report/report.json`` beside it): it is someone's file, never replaced."""
    run_dir = Path(run_dir)
    if (run_dir / INDEX_FILE).exists() and not (run_dir / META_FILE).exists():
        raise RdepthError(f"{run_dir / INDEX_FILE} exists and is not an rdepth report page; "
                          "choose another --out")


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
    title = meta.get("title") or output_folder_name(run_dir)
    sections = load_sections(run_dir)
    parts = [_HEAD.format(title=html.escape(title)), f"<h1>{html.escape(title)}</h1>"]
    if meta.get("intro"):
        parts.append(_paragraphs(meta["intro"]))
    if len(sections) > 1:
        links = " · ".join(f'<a href="#{s.name}">{html.escape(s.title or s.name)}</a>' for s in sections)
        parts.append(f"<nav>On this page: {links}</nav>")
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


_SUPERSCRIPT = str.maketrans("0123456789-+", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺")


def format_number(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` significant figures, written so that it cannot wrap or mislead.

    Thousands get separators (``12,346``), very large or small magnitudes a Unicode power of
    ten (``4.886×10⁻⁴``, never ``4.886e-04``), and a value that rounds to zero loses its sign
    (never ``-0``).
    """
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e6 or magnitude < 1e-3:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
        return f"{mantissa}×10{str(int(exponent)).translate(_SUPERSCRIPT)}"
    if magnitude >= 10 ** digits:
        text = f"{value:,.0f}"
    else:
        text = f"{value:,.{digits}g}"
        if "e" in text:  # .4g of 1234.5 is 1235, but of 12345.0 it would be 1.234e+04
            text = f"{value:,.0f}"
    return text.lstrip("-") if float(text.replace(",", "")) == 0 else text


def format_value(value: Any) -> str:
    """Numbers to 4 significant figures (:func:`format_number`); integers from 10,000 with
    separators; lists joined; everything else as text."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        return format_number(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value)
    return str(value)


def format_percent(fraction: float, digits: int = 2, signed: bool = True) -> str:
    """``fraction`` as a percentage with ``digits`` decimals; a value that rounds to zero is
    ``0.00%`` (never ``-0.00%``)."""
    text = f"{100 * fraction:{'+' if signed else ''}.{digits}f}"
    if float(text) == 0:
        text = text.lstrip("+-")
    return f"{text}%"


_NUMERIC = re.compile(r"^[\s⚠]*[-+−]?(∞|\d[\d,]*(\.\d*)?|\.\d+)(×10[⁰-⁹⁻]+)?(%|x|×|\s|$)")


def _is_numeric(value: Any) -> bool:
    """A number, a list of numbers or a string that starts with one (``1.2x [1.0-1.4]``, ``+0.5%``)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_is_numeric(v) for v in value)
    return isinstance(value, str) and bool(_NUMERIC.match(value))


# ------------------------------------------------------------------ formulas


_WORDS = [("Delta", "Δ"), ("delta", "δ"), ("sum", "∑"), ("sqrt", "√"), ("tau", "τ"), ("sigma", "σ")]


def _script_end(text: str, start: int) -> int:
    """Index just past the script argument that begins at ``text[start]``: a braced group, a
    parenthesised group (kept with its parentheses) or one character."""
    opening = text[start]
    closing = {"{": "}", "(": ")"}.get(opening)
    if closing is None:
        return start + 1
    depth = 0
    for index in range(start, len(text)):
        depth += (text[index] == opening) - (text[index] == closing)
        if depth == 0:
            return index + 1
    return len(text)


def _takes_script(text: str, index: int) -> bool:
    """Whether the ``_``/``^`` at ``index`` is a script: after a symbol, a closing bracket or a
    one-letter name (``x_g``, ``K_{g+1}``), never inside a word like ``first_refine``."""
    before, argument = text[index - 1], text[index + 1]
    if before in ")}Δδ∑":
        return True
    if not before.isalnum():
        return False
    standalone = index < 2 or not text[index - 2].isalnum()
    return standalone or (argument in "{(" and not text[index - 2].isalpha())


def _scripts(text: str) -> str:
    """``_x``, ``_{..}``, ``^(..)``, ``^{..}`` -> <sub>/<sup> (nested), on already-escaped text."""
    out, index = [], 0
    while index < len(text):
        char = text[index]
        if char in "_^" and index + 1 < len(text) and index > 0 and _takes_script(text, index):
            end = _script_end(text, index + 1)
            argument = text[index + 1:end]
            if argument.startswith("{"):
                argument = argument[1:-1]
            tag = "sub" if char == "_" else "sup"
            out.append(f"<{tag}>{_scripts(argument)}</{tag}>")
            index = end
            continue
        out.append(char)
        index += 1
    return "".join(out)


def formula_html(source: str) -> str:
    """Plain formula source as HTML: ``||`` -> ‖, Delta/sum/sqrt -> Δ/∑/√, ``>=``/``<=`` -> ≥/≤,
    `` - `` -> a minus sign, ``_``/``^`` scripts (braced, parenthesised or one character) as
    sub/superscripts. Prose around the formula is left as it is, so whole sentences may be given."""
    text = source.replace(">=", "≥").replace("<=", "≤").replace("||", "‖").replace(" - ", " − ")
    for word, symbol in _WORDS:
        text = re.sub(rf"\b{word}(?=[_^(\s]|\b)", symbol, text)
    return f'<span class="math">{_scripts(html.escape(text, quote=False))}</span>'


def rich_text(text: str) -> str:
    """Escaped text in which each ``$...$`` span is rendered by :func:`formula_html`."""
    parts = str(text).split("$")
    if len(parts) % 2 == 0:  # an unpaired $: show the text as it is
        return html.escape(str(text))
    return "".join(formula_html(part) if index % 2 else html.escape(part) for index, part in enumerate(parts))


# ------------------------------------------------------------------ blocks


def _cell(value: Any) -> str:
    text = html.escape(format_value(value))
    return f'<td class="num">{text}</td>' if _is_numeric(value) else f"<td>{text}</td>"


def _caption(block: dict[str, Any]) -> str:
    return f"<caption>{rich_text(block['caption'])}</caption>" if block.get("caption") else ""


def _table(block: dict[str, Any], run_dir: Path) -> str:
    rows = block.get("rows", [])
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    # a column no row fills (e.g. a latency that was not measured) says nothing: leave it out
    columns = [c for c in columns if any(row.get(c) not in (None, "") for row in rows)]
    numeric = {c for c in columns if all(_is_numeric(row[c]) for row in rows if row.get(c) not in (None, ""))}
    head = "".join(f'<th class="num">{rich_text(str(c))}</th>' if c in numeric else f"<th>{rich_text(str(c))}</th>"
                   for c in columns)
    body = "".join("<tr>" + "".join(_cell(row.get(c)) for c in columns) + "</tr>" for row in rows)
    wide = ' class="wide"' if len(columns) > 8 else ""
    # a table wider than the page scrolls sideways on its own, never the page
    return (f'<div class="table-wrap"><table{wide}>{_caption(block)}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def _figure(block: dict[str, Any], run_dir: Path) -> str:
    path = block["path"]
    if "://" not in path and not path.startswith("/"):
        path = Path(path).as_posix()
    if not (run_dir / path).exists():
        log.warning("report figure %s is missing in %s", path, run_dir)
    src = html.escape(path, quote=True)
    vector = Path(path).with_suffix(".svg").as_posix()
    link = ""
    if vector != path and (run_dir / vector).exists():
        link = f' (<a href="{html.escape(vector, quote=True)}">SVG</a>)'
    caption = block.get("caption", "")
    return (
        f'<figure><a href="{src}"><img src="{src}" alt="{html.escape(caption, quote=True)}"></a>'
        f"<figcaption>{rich_text(caption)}{link}</figcaption></figure>"
    )


def _figures(block: dict[str, Any], run_dir: Path) -> str:
    inner = "".join(_figure(figure, run_dir) for figure in block.get("figures", []))
    return f'<div class="figures{" aside" if block.get("aside") else ""}">{inner}</div>'


def _paragraphs(text: str, css: str = "") -> str:
    attribute = f' class="{css}"' if css else ""
    return "".join(f"<p{attribute}>{rich_text(p.strip())}</p>" for p in re.split(r"\n\s*\n", text) if p.strip())


def _headline(block: dict[str, Any], run_dir: Path) -> str:
    return _paragraphs(block.get("text", ""), "headline")


def _facts(block: dict[str, Any], run_dir: Path) -> str:
    rows = "".join(f"<tr><th>{rich_text(label)}</th><td>{html.escape(format_value(value))}</td></tr>"
                   for label, value in block.get("pairs", []))
    return f'<table class="facts">{_caption(block)}<tbody>{rows}</tbody></table>'


def _bullets(block: dict[str, Any], run_dir: Path) -> str:
    items = "".join(f"<li>{rich_text(item)}</li>" for item in block.get("items", []))
    title = f'<p class="list-caption">{rich_text(block["caption"])}</p>' if block.get("caption") else ""
    return f"{title}<ul class=\"bullets\">{items}</ul>"


def _links(block: dict[str, Any], run_dir: Path) -> str:
    items = " · ".join(f'<a href="{html.escape(href, quote=True)}">{html.escape(label)}</a>'
                       for href, label in block.get("links", []))
    title = f"{rich_text(block['caption'])}: " if block.get("caption") else ""
    return f'<p class="links">{title}{items}</p>'


def _note(block: dict[str, Any], run_dir: Path) -> str:
    return _paragraphs(block.get("text", ""))


def _unknown(block: dict[str, Any], run_dir: Path) -> str:
    return f"<p>(unknown report block {html.escape(str(block.get('kind')))})</p>"


_BLOCKS = {"table": _table, "figure": _figure, "note": _note, "headline": _headline, "facts": _facts,
           "bullets": _bullets, "figures": _figures, "links": _links}

_HEAD = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }}
h1 {{ font-size: 1.6em; }} h2 {{ border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }}
section:first-of-type h2 {{ margin-top: 1em; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: .9em; }}
caption {{ text-align: left; font-weight: 600; padding-bottom: .3em; }}
th, td {{ border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; min-width: 4.5em; font-weight: 600; }} td.num, th.num {{ text-align: right; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #eee; }}
figcaption {{ font-size: .9em; color: #555; }} nav {{ font-size: .95em; color: #555; }}
td.num {{ white-space: nowrap; font-variant-numeric: tabular-nums; }}
div.table-wrap {{ overflow-x: auto; max-width: 100%; }} table.wide {{ font-size: .8em; }}
sub, sup {{ font-size: .75em; line-height: 0; }}
p.headline {{ font-size: 1.25em; margin: .6em 0; }}
table.facts th {{ text-align: left; font-weight: 600; background: none; border: none; padding: .1em 1em .1em 0;
                 vertical-align: top; white-space: nowrap; }}
table.facts td {{ text-align: left; border: none; padding: .1em 0; }} table.facts {{ margin: .5em 0; }}
ul.bullets {{ margin: .3em 0; padding-left: 1.3em; }} ul.bullets li {{ margin: .25em 0; }}
p.list-caption {{ font-weight: 600; margin: .8em 0 .2em; }}
div.figures {{ display: flex; gap: 1em; flex-wrap: wrap; }}
div.figures figure {{ flex: 1 1 300px; margin: .5em 0; }} div.figures img {{ max-height: 300px; }}
p.links {{ font-size: .95em; clear: both; }} section::after {{ content: ""; display: block; clear: both; }}
div.figures.aside {{ float: right; width: 38%; margin: 0 0 .5em 1.5em; display: block; }}
div.figures.aside figure {{ margin: 0 0 .6em; }} div.figures.aside img {{ max-height: none; width: 100%; }}
@media (max-width: 800px) {{ div.figures.aside {{ float: none; width: 100%; margin: 0; }} }}
</style></head><body>"""
