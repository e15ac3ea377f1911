"""Every relative Markdown link in README.md and docs/ reaches an existing file, and its anchor, if it
has one, a heading of that file (GitHub's heading ids)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(INLINE_CODE.sub("x", line))
    return lines


def heading_ids(text: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated id suffixed -1, -2, ..."""
    seen: Counter[str] = Counter()
    ids = set()
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        ids.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return ids


def broken_links(path: Path) -> list[str]:
    """``path``'s relative links whose file, or whose anchor in a Markdown file, does not exist."""
    problems = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                problems.append(f"{path.name}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_ids(resolved.read_text()):
                problems.append(f"{path.name}: {target}: no such heading")
    return problems


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    assert len(documents()) > 10
    assert [problem for path in documents() for problem in broken_links(path)] == []


def test_heading_ids_follow_github():
    text = ("# The one decoder: `rdepth generate`'s path\n## FSDP2 on two CPU ranks (`--parallel fsdp`)\n"
            "## Notes\n## Notes\n```\n# not a heading\n```\n## A [linked](x.md) title\n")
    assert heading_ids(text) == {"the-one-decoder-rdepth-generates-path", "fsdp2-on-two-cpu-ranks---parallel-fsdp",
                                 "notes", "notes-1", "a-linked-title"}


def test_a_missing_file_and_a_missing_heading_are_found(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "page.md").write_text("# Page\n## Two words\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](sub/page.md#two-words) [dir](sub/) [self](#top) ![img](sub/none.png)\n"
                   "[bad anchor](sub/page.md#three-words) `[code](nowhere.md)` [web](https://example.org/x)\n"
                   "```\n[fenced](nowhere.md)\n```\n# Top\n")
    assert broken_links(doc) == ["doc.md: sub/none.png: no such file",
                                 "doc.md: sub/page.md#three-words: no such heading"]



def length_problems(repo: Path) -> list[str]:
    """The README over 120 lines, the results index over 200, a results page over 500; issue numbers on
    the README; its two set-up commands more than 15 lines apart."""
    pages = [repo / "README.md", repo / "docs" / "results.md", *sorted((repo / "docs" / "results").glob("*.md"))]
    limits = {"README.md": 120, "docs/results.md": 200}
    problems = []
    for path in pages:
        name, n = path.relative_to(repo).as_posix(), len(path.read_text().splitlines())
        if n > limits.get(name, 500):
            problems.append(f"{name}: {n} lines")
    readme = (repo / "README.md").read_text()
    if re.search(r"\bissues? \d", readme, re.IGNORECASE):
        problems.append("README.md names an issue")
    setup = [i for i, line in enumerate(readme.splitlines()) if line.startswith("python3 -m pip install torch")]
    if len(setup) != 2 or setup[1] - setup[0] > 15:
        problems.append(f"README.md: the set-up commands at lines {setup}")
    return problems


def test_the_readme_and_the_results_pages_stay_short():
    """A newcomer reads the README in five minutes and the results index on one page."""
    assert length_problems(REPO) == []


def test_the_length_check_finds_a_long_page_an_issue_number_and_scattered_set_up(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results.md").write_text("x\n" * 201)
    (tmp_path / "docs" / "results" / "a.md").write_text("x\n" * 500)
    (tmp_path / "README.md").write_text("python3 -m pip install torch\n" + "Fixed in issue 12.\n" * 15
                                        + "python3 -m pip install torch\n")
    assert length_problems(tmp_path) == ["docs/results.md: 201 lines", "README.md names an issue",
                                         "README.md: the set-up commands at lines [0, 16]"]
