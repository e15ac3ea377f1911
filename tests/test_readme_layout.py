"""The README's Layout block names every package and top-level module of ``rdepth/`` and nothing else,
and every path it names exists."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layout_entries(readme: str) -> list[str]:
    """The first word of each line of the code block under the README's ``## Layout`` heading."""
    section = readme.split("\n## Layout\n", 1)
    assert len(section) == 2, "the README has no '## Layout' section"
    block = section[1].split("```", 2)
    assert len(block) == 3, "the Layout section has no code block"
    return [line.split()[0] for line in block[1].splitlines() if line.strip()]


def layout_problems(readme: str, repo: Path) -> list[str]:
    """What is wrong with the Layout block against the tree at ``repo`` (empty when it is right)."""
    entries = layout_entries(readme)
    package = repo / "rdepth"
    actual = {f"rdepth/{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    actual |= {f"rdepth/{p.name}" for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    listed = [e for e in entries if e.startswith("rdepth/")]
    problems = [f"missing from the Layout: {name}" for name in sorted(actual - set(listed))]
    problems += [f"not a package or top-level module of rdepth/: {name}" for name in sorted(set(listed) - actual)]
    problems += [f"listed twice: {name}" for name in sorted({e for e in entries if entries.count(e) > 1})]
    problems += [f"does not exist: {name}" for name in entries
                 if not name.startswith("rdepth/") and not (repo / name.rstrip("/")).exists()]
    return problems


def test_the_readme_layout_matches_the_package():
    assert layout_problems((REPO / "README.md").read_text(), REPO) == []


def _tree(root: Path, packages: list[str], modules: list[str]) -> Path:
    for name in packages:
        (root / "rdepth" / name).mkdir(parents=True)
        (root / "rdepth" / name / "__init__.py").write_text("")
    for name in ["__init__.py", "__main__.py", *modules]:
        (root / "rdepth" / name).write_text("")
    (root / "tests").mkdir()
    return root


README = "# x\n\n## Layout\n\n```\nrdepth/config.py   c\nrdepth/model/      m\ntests/             t\n```\n"


def test_the_check_passes_a_layout_that_matches(tmp_path):
    assert layout_problems(README, _tree(tmp_path, ["model"], ["config.py"])) == []


def test_the_check_finds_a_package_the_layout_omits_and_one_it_invents(tmp_path):
    repo = _tree(tmp_path, ["model", "engine"], ["config.py", "io.py"])
    assert layout_problems(README, repo) == ["missing from the Layout: rdepth/engine/",
                                             "missing from the Layout: rdepth/io.py"]
    (repo / "rdepth" / "model" / "__init__.py").unlink()  # a folder that is no longer a package
    assert "not a package or top-level module of rdepth/: rdepth/model/" in layout_problems(README, repo)


def test_the_check_finds_a_folder_that_does_not_exist_and_a_line_given_twice(tmp_path):
    repo = _tree(tmp_path, ["model"], ["config.py"])
    readme = README.replace("tests/             t\n", "tests/  t\nbench/  b\nrdepth/model/  again\n")
    assert layout_problems(readme, repo) == ["listed twice: rdepth/model/", "does not exist: bench/"]
