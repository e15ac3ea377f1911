"""Extractors: a file's bytes -> documents, each a list of raw paragraphs (cleaned later, in clean.py).

Each extractor is ``extract(path, data) -> Iterator[list[str]]`` and is chosen by
name from ``EXTRACTORS`` in a source's registry entry (sources.py):

- ``html``: one document per page; the text of block elements (``p``, ``li``,
  ``dd``, headings, ...) becomes paragraphs; ``pre``, ``script``, ``style``,
  ``table`` and navigation/sidebars/footers are skipped (stdlib ``html.parser``).
- ``pod``: one document per Perl POD file; verbatim (indented) blocks are code
  and dropped, formatting codes such as ``B<...>`` and ``L<text|target>`` keep
  their text.
- ``text``: one document per plain-text file, paragraphs at blank lines, line
  breaks kept (verse stays verse).
- ``wiki_json``: the Wikipedia leads JSON, one document per article in title order.
- ``verses_jsonl``: a Bible as JSON lines of verses, one document per book and
  one paragraph per chapter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from html import unescape
from html.parser import HTMLParser

from rdepth.errors import RdepthError

Document = list[str]

# Elements whose end closes a paragraph.
BLOCK_TAGS = frozenset(
    ["p", "li", "dd", "dt", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "div", "section", "article", "header", "footer", "ul", "ol", "dl", "figcaption", "caption", "br", "hr", "title", "body", "tr", "td", "th"]
)
# Elements whose whole content is skipped (their end tags are reliable in generated HTML).
SKIP_TAGS = frozenset(["script", "style", "pre", "head", "nav", "table", "textarea", "svg", "math", "button", "select"])
# A <div> (or <section>/<span>...) with one of these class names (or exactly this id) is page furniture.
FURNITURE = re.compile(
    r"nav|navbar|navigation|sidebar|sphinxsidebar|related|footer|header|breadcrumbs?|toc|"
    r"toctree-wrapper|menu|search|headerlink|highlight|sig|signature|copyright|topbar|bottom-nav|"
    r"subnav|skip-nav|code-header|example-wrap|wy-nav-side|wy-side-scroll|rst-footer-buttons",
    re.I,
)  # whole class names only: "wy-nav-content" is the page itself
FURNITURE_CONTAINERS = frozenset(["div", "section", "aside", "span", "a"])


class _ParagraphParser(HTMLParser):
    """Collects the text of an HTML page as paragraphs (whitespace collapsed, HTML-style)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._buffer: list[str] = []
        self._skip_depth = 0  # inside SKIP_TAGS
        self._containers: list[tuple[str, bool]] = []  # open furniture-capable tags: (tag, skipped)

    @property
    def _skipping(self) -> bool:
        return self._skip_depth > 0 or any(skipped for _, skipped in self._containers)

    def _flush(self) -> None:
        text = " ".join("".join(self._buffer).split())
        self._buffer.clear()
        if text:
            self.paragraphs.append(text)

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in SKIP_TAGS:
            self._skip_depth += 1
            return
        if tag in FURNITURE_CONTAINERS:
            # class and role name furniture; an id only when it is exactly such a word (section
            # ids are made from headings: "header-files" is content)
            names = " ".join(value or "" for key, value in attrs if key in ("class", "role"))
            element_id = next((value or "" for key, value in attrs if key == "id"), "")
            furniture = any(FURNITURE.fullmatch(name) for name in names.split() + [element_id])
            self._containers.append((tag, furniture))
        if tag in BLOCK_TAGS:
            self._flush()

    def handle_startendtag(self, tag: str, attrs) -> None:
        if tag in BLOCK_TAGS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in SKIP_TAGS:
            self._skip_depth = max(0, self._skip_depth - 1)
            return
        if tag in FURNITURE_CONTAINERS:
            # close the innermost open element of this tag (and anything left open inside it)
            for index in range(len(self._containers) - 1, -1, -1):
                if self._containers[index][0] == tag:
                    del self._containers[index:]
                    break
        if tag in BLOCK_TAGS:
            self._flush()

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self._buffer.append(data)

    def close(self) -> None:
        super().close()
        self._flush()


def html_paragraphs(html: str) -> list[str]:
    """The paragraphs of an HTML page in reading order (see the module docstring)."""
    parser = _ParagraphParser()
    parser.feed(html)
    parser.close()
    return parser.paragraphs


def decode_text(data: bytes) -> str:
    """UTF-8 text of ``data``, Latin-1 where it is not UTF-8 (old documentation files are)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def extract_html(path: str, data: bytes) -> Iterator[Document]:
    yield html_paragraphs(decode_text(data))


# ---------------------------------------------------------------- Perl POD

_POD_CODE = re.compile(r"([A-Z])<(<+\s|)(.*?)(\s>+|)>", re.S)  # B<x>, C<< x >>, L<text|target>


def _pod_inline(text: str) -> str:
    """The text of POD formatting codes: ``L<text|target>`` -> text, ``E<gt>`` -> '>', ``Z<>`` -> ''."""
    def replace(match: re.Match) -> str:
        code, inner = match.group(1), match.group(3)
        if code == "E":
            return {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}.get(inner, unescape(f"&{inner};"))
        if code in "XZ":
            return ""
        if code == "L":
            inner = inner.split("|", 1)[0] if "|" in inner else inner.split("/")[-1].strip('"')
        return inner

    for _ in range(4):  # nested codes: innermost first, a few levels deep at most
        new = _POD_CODE.sub(replace, text)
        if new == text:
            break
        text = new
    return text


def pod_paragraphs(pod: str) -> list[str]:
    """Ordinary paragraphs and headings of a POD text; verbatim blocks and ``=begin`` regions dropped."""
    paragraphs, in_region = [], False
    for block in re.split(r"\n[ \t]*\n", pod.replace("\r\n", "\n")):
        if not block.strip():
            continue
        if block.startswith("="):
            command, _, rest = block.partition(" ")
            command = command.split("\n", 1)[0]
            if command in ("=begin", "=for"):
                in_region = command == "=begin"
            elif command == "=end":
                in_region = False
            elif command.startswith("=head") or command == "=item":
                heading = _pod_inline(" ".join(rest.split()))
                if heading and heading != "*" and not in_region:
                    paragraphs.append(heading)
            continue
        if in_region or block[0] in " \t":  # verbatim: code
            continue
        paragraphs.append(_pod_inline(" ".join(block.split())))
    return paragraphs


def extract_pod(path: str, data: bytes) -> Iterator[Document]:
    yield pod_paragraphs(decode_text(data))


# ---------------------------------------------------------------- plain text and JSON


def text_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of ``text``, line breaks inside a paragraph kept."""
    return [part for part in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")) if part.strip()]


def extract_text(path: str, data: bytes) -> Iterator[Document]:
    yield text_paragraphs(decode_text(data))


def extract_wiki_json(path: str, data: bytes) -> Iterator[Document]:
    try:
        articles = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RdepthError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(articles, dict) or not all(isinstance(e, dict) for e in articles.values()):
        raise RdepthError(f"{path} is not a JSON object of articles")
    for _, entry in sorted((entry.get("title") or key, entry) for key, entry in articles.items()):
        yield text_paragraphs((entry.get("extract") or "").replace("\n", "\n\n"))


def extract_verses_jsonl(path: str, data: bytes) -> Iterator[Document]:
    """Records ``{"book", "chapter", "text"}`` in reading order -> one document per book."""
    book, chapters, current = None, [], []
    for number, line in enumerate(decode_text(data).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            verse = json.loads(line)
            key, text = (verse["book"], verse["chapter"]), verse["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise RdepthError(f"{path}:{number}: not a verse record with book, chapter and text") from None
        if current and key != current[0]:
            chapters.append(" ".join(current[1:]))
            current = []
            if key[0] != book:
                yield chapters
                chapters = []
        if not current:
            current, book = [key], key[0]
        current.append(str(text).strip())
    if current:
        chapters.append(" ".join(current[1:]))
    if chapters:
        yield chapters


EXTRACTORS: dict[str, Callable[[str, bytes], Iterator[Document]]] = {
    "html": extract_html,
    "pod": extract_pod,
    "text": extract_text,
    "wiki_json": extract_wiki_json,
    "verses_jsonl": extract_verses_jsonl,
}
