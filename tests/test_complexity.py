"""The code under radon's bar: no function, method or class in rdepth/, bench/ or scripts/ ranks D or worse
(cyclomatic complexity above 20), as ``radon cc -n D bench scripts`` would list it (closures count in the
function that holds them only through their call, as radon's own default). radon is pinned in pyproject's
``test`` extra."""

from __future__ import annotations

from pathlib import Path

import pytest

complexity = pytest.importorskip("radon.complexity", reason="pip install -e '.[test]' (radon)")

ROOT = Path(__file__).resolve().parents[1]
PLACES = ("rdepth", "bench", "scripts")
# The one exception: the CLI's flag generator (one branch per field type the config dataclasses use)
ALLOWED = {"rdepth/cli/options.py add_dataclass_flags"}
WORST_ALLOWED = "C"  # radon's ranks: A 1-5, B 6-10, C 11-20, D 21-30, E 31-40, F 41+


def over_the_bar(source: str, where: str) -> list[str]:
    """``where:line name rank (complexity)`` for each block of ``source`` ranked worse than C."""
    return [f"{where}:{block.lineno} {block.name} {complexity.cc_rank(block.complexity)} ({block.complexity})"
            for block in complexity.cc_visit(source) if complexity.cc_rank(block.complexity) > WORST_ALLOWED]


def test_the_package_bench_and_scripts_rank_c_or_better():
    found = []
    for place in PLACES:
        for path in sorted((ROOT / place).rglob("*.py")):
            found += over_the_bar(path.read_text(), path.relative_to(ROOT).as_posix())
    assert [f for f in found if f"{f.split(':')[0]} {f.split()[1]}" not in ALLOWED] == []


def test_the_bar_catches_a_function_of_21_paths_and_passes_one_of_20():
    def function(branches: int) -> str:
        body = "".join(f"    if x == {k}:\n        return {k}\n" for k in range(branches - 1))
        return f"def f(x):\n{body}    return -1\n"

    assert over_the_bar(function(20), "probe.py") == []
    assert over_the_bar(function(21), "probe.py") == ["probe.py:1 f D (21)"]
    method = "class K:\n" + "".join("    " + line + "\n" for line in function(41).splitlines()).replace("f(x)", "f(self, x)")
    assert "probe.py:2 f F (41)" in over_the_bar(method, "probe.py")
