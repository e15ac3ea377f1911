"""The package's import graph: layers point one way and no module imports itself in a circle.

Lazy imports (inside functions) count: they hide a cycle, they do not remove it; so does
``importlib.import_module`` of a literal rdepth module name.
Run ``python tests/test_architecture.py`` to print the package-level graph.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rdepth"

# Who may import whom, by top-level part of the package (a subpackage or a module).
BASE = {"errors", "io", "fields", "threads"}
ALLOWED = {
    "errors": set(),
    "io": {"errors"},
    "fields": {"errors"},  # a bound that does not hold is a one-line error
    "threads": set(),  # the thread plan: os and torch only
    "config": BASE,
    "model": BASE | {"config"},
    # continuous depth batching: the model's pieces driven with every row at its own position and step
    "engine": BASE | {"config", "model"},
    # the exit rules: policies, their registry, the gate's head, policies as a loop controller; no file and
    # no run (those are exitrun's), so they sit beside the engine, below the run layer
    "exits": {"errors", "config", "model"},
    "data": BASE,
    "report": BASE,
    "run": BASE | {"config", "model", "data", "engine"},
    "train": BASE | {"config", "model", "data", "run"},
    "tasks": BASE | {"config", "model", "data", "run", "report"},
    # the exit rules on a run: the gate's file and exit profiles beside it, held-out evaluation with exits;
    # a profile evaluated on a reasoning task reads its held-out sets and accuracy
    "exitrun": BASE | {"config", "model", "run", "tasks", "exits"},
    # the workflows on the exit rules: the latency-quality sweep and the calibration of profiles
    "sweep": BASE | {"config", "model", "data", "run", "report", "tasks", "exits", "exitrun"},
    "calibrate": BASE | {"config", "model", "data", "run", "report", "tasks", "exits", "exitrun"},
    "geometry": BASE | {"config", "model", "data", "run", "report"},
    # a surrogate's phases are read as loops with the geometry tools
    "surrogate": BASE | {"config", "model", "data", "run", "report", "geometry"},
    # exported Hugging Face models bundle the model and the exit rules; lm-eval's local chase task
    # draws problems with a task data folder's own parameters
    "interop": BASE | {"config", "model", "data", "run", "exits", "exitrun", "tasks", "engine"},
    # rdepth serve: the HTTP API on the engine, a run's model and tokenizer, the exit rules by name; a looped
    # transformers folder through its adapter's engine
    "serve": BASE | {"config", "model", "run", "exits", "exitrun", "engine", "looped"},
    # the main job (rdepth/demo/; the rules inside it: DEMO_ROOM)
    "demo": BASE | {"config", "model", "data", "run", "train", "exits", "sweep", "geometry", "report", "tasks"},
    # rdepth reproduce: trains and runs the analyses like the demo, then judges the paper's claims
    "reproduce": BASE | {"config", "model", "data", "run", "train", "exits", "sweep", "geometry", "report"},
    # looped models that ship in transformers (HRM-Text, Inkling-2) driven step by step: the geometry metrics
    # and the exit rules over their iterates; rdepth analyze / sweep / generate on their folders use the run
    # layer's window maker and device, the model's sampling, the page builder, and reproduce's claim judges
    # (pure functions on a geometry summary) for the page's verdicts; the engine's host side and client API
    # over a tick of their own (rdepth.looped.engine)
    "looped": BASE | {"geometry", "exits", "model", "run", "report", "reproduce", "engine"},
    # vLLM's model plugin for rdepth exports (loaded by vLLM through an entry point): rdepth's model and stage
    # walk with vLLM's attention, the export's config read as interop reads it
    "vllm": BASE | {"config", "model", "interop"},
    "cli": None,  # the command line sits above everything
    "__main__": None,
    "__init__": set(),
}

# Imports that run up a layer on purpose, by module: (importer, imported, why). Each must exist (a stale
# entry fails) and nothing else may run up.
LATE_BINDINGS = {
    # the learned rule given a run folder reads the gate saved beside its checkpoint; imported when asked
    # for, because the exported model bundles the rules without rdepth's run-folder code
    ("rdepth.exits.policies", "rdepth.exitrun.gate_file"),
    # the ouro rule given a run folder reads the gate tensors of its checkpoint's model file, the same way
    ("rdepth.exits.policies", "rdepth.run.checkpoint"),
}

# Inside the demo's room, by module: each mode's first screen reads the saved files and renders with the
# page builder only; the task mode does not import the demo's entry (rdepth.demo.run calls it, never the
# reverse). A name with a dot is a module of the room; without one, a part of the package.
DEMO_ROOM = {
    "rdepth.demo.report": BASE | {"report"},
    "rdepth.demo.task_report": BASE | {"report"},
    "rdepth.demo.task": ALLOWED["demo"] | {"demo.task_report"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every ``rdepth`` module that ``path`` imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("rdepth"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rdepth"):
            found.add(node.module)
            for alias in node.names:  # `from rdepth.run import checkpoint` imports a module
                if (ROOT.parent / (node.module.replace(".", "/") + "/" + alias.name + ".py")).exists():
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("rdepth"):
            found.add(node.args[0].value)
    return found


def module_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for target in imports_of(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which part imports which, the late bindings left out (printed apart)."""
    edges = defaultdict(set)
    for source, targets in graph.items():
        for target in targets:
            if part_of(source) != part_of(target) and (source, target) not in LATE_BINDINGS:
                edges[part_of(source)].add(part_of(target))
    return edges


def test_no_import_cycles():
    assert cycles(module_graph()) == []


def test_layers_point_one_way():
    violations = []
    for source, targets in module_graph().items():
        allowed = ALLOWED.get(part_of(source), set())
        if allowed is None:
            continue
        for target in targets:
            if part_of(target) != part_of(source) and part_of(target) not in allowed \
                    and (source, target) not in LATE_BINDINGS:
                violations.append(f"{source} -> {target}")
    assert violations == []


def test_the_late_bindings_exist():
    graph = module_graph()
    assert [pair for pair in sorted(LATE_BINDINGS) if pair[1] not in graph.get(pair[0], set())] == []


def test_inside_the_demo_room():
    graph = module_graph()
    violations = []
    for source, allowed in DEMO_ROOM.items():
        for target in graph[source]:
            name = target.removeprefix("rdepth.") if part_of(target) == "demo" else part_of(target)
            if name not in allowed:
                violations.append(f"{source} -> {target}")
    assert violations == []


def test_only_the_cli_and_the_demo_import_training():
    users = {part_of(source) for source, targets in module_graph().items()
             if any(part_of(t) == "train" for t in targets)} - {"train"}
    assert users <= {"cli", "demo", "reproduce"}


# The loop bookkeeping (issue 39): which rows stop, the state and iterate index each hands on, the steps each
# computed. Written once, in this function; every driver of a group's loop under a controller reaches it
# through LoopRows (model/loop.py).
BOOKKEEPING = ("model/loop.py", "stop_and_hand_on")
LOOP_DRIVERS = ("model/walk.py", "model/decoder.py", "exits/recorded.py")
# The engine's rows loop at their own steps: the same bookkeeping row-indexed (the eager tick, on the host) and
# predicated (the static tick, on the device), written beside it; who calls each.
ROW_BOOKKEEPING = {"rows_leaving": {"engine/eager.py"}, "next_steps": {"engine/static.py"}}
# What a second copy of the bookkeeping would write: a step count masked by the looping rows, a hand-off
# written by the stopping rows, the rows leaving picked by the stopping mask, a step count restarted where rows
# stopped.
BOOKKEEPING_MARKS = ("masked_fill_(active", "masked_fill(active", "handed_on[", "stopping[:, None]",
                     "computed[self.rows]", "rows[stopping]", "steps[stopping]", "where(done, 1", "where(stopped, 1",
                     "where(stopping, 1")


def bookkeeping_copies(sources: dict[str, str]) -> dict:
    """Where the loop bookkeeping is defined, who calls it, and the marks of a copy outside model/loop.py, over
    ``sources`` (path relative to rdepth/ -> text)."""
    found = {"defined": [], "called": set(), "marked": [], "drivers": set(),
             "row_defined": {name: [] for name in ROW_BOOKKEEPING}, "row_called": {name: set() for name in
                                                                                    ROW_BOOKKEEPING}}
    for relative, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == BOOKKEEPING[1]:
                found["defined"].append(relative)
            if isinstance(node, ast.FunctionDef) and node.name in ROW_BOOKKEEPING:
                found["row_defined"][node.name].append(relative)
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name == BOOKKEEPING[1]:
                    found["called"].add(relative)
                if name in ROW_BOOKKEEPING:
                    found["row_called"][name].add(relative)
                if name == "LoopRows":
                    found["drivers"].add(relative)
        if relative != BOOKKEEPING[0]:
            found["marked"] += [f"{relative}: {mark}" for mark in BOOKKEEPING_MARKS if mark in text]
    return found


def bookkeeping_problems(found: dict) -> list[str]:
    problems = []
    if found["defined"] != [BOOKKEEPING[0]]:
        problems.append(f"stop_and_hand_on defined in {found['defined']}")
    if found["called"] != {BOOKKEEPING[0]}:  # only the loop routine calls it
        problems.append(f"stop_and_hand_on called from {sorted(found['called'])}")
    problems += [f"a copy of the bookkeeping: {mark}" for mark in found["marked"]]
    if found["drivers"] != set(LOOP_DRIVERS):
        problems.append(f"LoopRows driven from {sorted(found['drivers'])}")
    for name, callers in ROW_BOOKKEEPING.items():
        if found["row_defined"][name] != [BOOKKEEPING[0]]:
            problems.append(f"{name} defined in {found['row_defined'][name]}")
        if found["row_called"][name] != callers:
            problems.append(f"{name} called from {sorted(found['row_called'][name])}")
    return problems


def _sources() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text() for path in sorted(ROOT.rglob("*.py"))}


def test_the_loop_bookkeeping_is_written_once():
    assert bookkeeping_problems(bookkeeping_copies(_sources())) == []


def test_the_bookkeeping_check_sees_a_second_copy():
    """A constructed second copy in the engine (the eager tick picking its leaving rows itself, the static tick
    restarting its step count itself) and a row function defined twice: each is named."""
    sources = _sources()
    sources["engine/eager.py"] += "\n\ndef _copy(rows, steps, stopping):\n    return rows[stopping], steps[stopping]\n"
    sources["engine/static.py"] += "\n\ndef _again(torch, done, steps):\n    return torch.where(done, 1, steps + 1)\n"
    sources["engine/scheduler.py"] += "\n\ndef next_steps(steps, stopping):\n    return steps\n"
    problems = bookkeeping_problems(bookkeeping_copies(sources))
    assert "a copy of the bookkeeping: engine/eager.py: rows[stopping]" in problems
    assert "a copy of the bookkeeping: engine/static.py: where(done, 1" in problems
    assert "next_steps defined in ['engine/scheduler.py', 'model/loop.py']" in problems


# The latest-KV rule (a row's key of loop step s in the slots of steps s..K) is written in one method of the
# model's cache that every store calls; these are the shapes a second copy takes.
LATEST_KV = ("model/kv.py", "KVCache.write_latest")


def latest_kv_copies(sources: dict[str, str]) -> list[str]:
    """Writes over the loop-step slots from a step on, outside :data:`LATEST_KV`: an assignment to a slice of
    the steps' dim that starts at a step (``tensor[step - 1:, rows, :, positions] = ...``), a ``narrow`` of the
    steps' dim copied into (``tensor.narrow(0, step - 1, n)...copy_(...)``), and a masked write of every step's
    slot of a column (``tensor[:, rows, :, positions] = torch.where(...)``); each as ``path: function``."""
    found = []
    for relative, text in sorted(sources.items()):
        tree = ast.parse(text)
        for scope in ast.walk(tree):
            if not isinstance(scope, ast.ClassDef | ast.Module):
                continue
            prefix = f"{scope.name}." if isinstance(scope, ast.ClassDef) else ""
            for function in scope.body:
                if not isinstance(function, ast.FunctionDef):
                    continue
                name = prefix + function.name
                if (relative, name) == LATEST_KV:
                    continue
                found += [f"{relative}: {name}" for node in ast.walk(function) if _writes_step_slots(node)]
    return sorted(set(found))


def _writes_step_slots(node: ast.AST) -> bool:
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Tuple) and target.slice.elts:
                first = target.slice.elts[0]
                if isinstance(first, ast.Slice) and first.lower is not None and not isinstance(first.lower, ast.Constant):
                    # [step - 1:, ...]
                    return True
                where = isinstance(node.value, ast.Call) and getattr(node.value.func, "attr", None) == "where"
                if isinstance(first, ast.Slice) and first.lower is None and len(target.slice.elts) == 4 and where:
                    return True  # [:, rows, :, positions] = torch.where(...)
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "copy_":
        inner = node.func.value
        while isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
            if inner.func.attr == "narrow" and inner.args and isinstance(inner.args[0], ast.Constant) \
                    and inner.args[0].value == 0:
                return True  # .narrow(0, step - 1, n)... .copy_(new)
            inner = inner.func.value
    return False


def test_the_latest_kv_rule_is_written_once():
    """Every store (the decoder's settle, the lock-step passes', the engine's eager and static stores) calls
    KVCache.write_latest; no other function writes the step slots from a step on."""
    sources = _sources()
    assert latest_kv_copies(sources) == []
    callers = {relative for relative, text in sources.items() if ".write_latest(" in text}
    assert callers == {"model/kv.py", "engine/slots.py", "engine/static.py"}


def test_the_latest_kv_check_sees_a_second_copy():
    """Constructed second copies, one of each shape: the static tick's masked write, the eager store's
    broadcast copy through the later slots, a lock-step pass's slice from the step on."""
    sources = _sources()
    sources["engine/static.py"] += ("\n\nclass _Copy:\n    def update(self, tensor, rows, positions, through, new, "
                                    "column, torch):\n        tensor[:, rows, :, positions] = torch.where(through, "
                                    "new, column)\n")
    sources["engine/slots.py"] += ("\n\ndef _again(tensor, step, first, new):\n    tensor.narrow(0, step - 1, "
                                   "tensor.shape[0] - step + 1).narrow(3, first, 1).copy_(new)\n")
    sources["model/decoder.py"] += ("\n\ndef _through(tensor, step, rows, positions, new):\n    tensor[step - 1:, rows, "
                                    ":, positions] = new.unsqueeze(1)\n")
    assert latest_kv_copies(sources) == ["engine/slots.py: _again", "engine/static.py: _Copy.update",
                                         "model/decoder.py: _through"]


def test_the_checker_sees_lazy_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from rdepth.train.trainer import train\n")
    assert imports_of(source) == {"rdepth.train.trainer"}
    source.write_text("import importlib\n\ndef f():\n    return importlib.import_module('rdepth.exitrun.profile')\n")
    assert imports_of(source) == {"rdepth.exitrun.profile"}


if __name__ == "__main__":
    graph = module_graph()
    for source, targets in sorted(package_edges(graph).items()):
        print(f"{source:>10} -> {', '.join(sorted(targets))}")
    for source, target in sorted(LATE_BINDINGS):
        print(f"late binding: {source} -> {target}")
    print("cycles:", cycles(graph) or "none")
