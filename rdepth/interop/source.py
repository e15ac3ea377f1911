"""The exported modeling code, generated from rdepth's own source (one source of truth).

An exported folder must load with ``trust_remote_code=True`` where rdepth is not
installed, so its ``modeling_rdepth.py`` cannot import rdepth. Instead of a
hand-kept copy of the model, :func:`modeling_source` bundles the modules the
Hugging Face wrapper (:mod:`rdepth.interop.hf_model`) needs, verbatim, in
dependency order:

- each module's top-level imports of other packages are hoisted (deduplicated);
- imports of rdepth modules, top level or inside functions, are dropped: every
  name they bring is defined in the bundle, and a module imported whole for its
  side effects (the exit-policy registrations) is bundled before (checked);
- a name defined at top level by two modules is an error (they would shadow);
- the result compiles and imports nothing from rdepth (checked here, and a test
  loads an exported folder in a process where ``import rdepth`` fails and compares
  its logits with rdepth's).

``configuration_rdepth.py`` is :mod:`rdepth.interop.hf_config` as it stands (it
imports nothing from rdepth); the modeling file imports it relatively.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from pathlib import Path

from rdepth.errors import RdepthError

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../rdepth

MODELING_FILE = "modeling_rdepth.py"
CONFIG_FILE = "configuration_rdepth.py"
CONFIG_MODULE = "rdepth.interop.hf_config"


@dataclass(frozen=True)
class Part:
    """A module bundled into the modeling file: all of it, or only the named top-level definitions."""

    module: str
    only: tuple[str, ...] | None = None


# In dependency order: a part may use names from the parts above it.
MODELING_PARTS: tuple[Part, ...] = (
    Part("rdepth.errors"),
    Part("rdepth.fields"),
    Part("rdepth.io", only=("dataclass_from_dict",)),
    Part("rdepth.config"),
    Part("rdepth.model.kv"),
    Part("rdepth.model.layers"),
    Part("rdepth.model.control"),
    Part("rdepth.model.loop"),
    Part("rdepth.model.noise"),
    Part("rdepth.model.schedule"),
    Part("rdepth.model.walk"),
    Part("rdepth.model.fused_loss"),
    Part("rdepth.model.recurrent"),
    Part("rdepth.model.budget"),
    Part("rdepth.model.executors.eager"),
    Part("rdepth.model.sampling"),
    Part("rdepth.model.decoder"),
    Part("rdepth.exits.base"),
    Part("rdepth.exits.gate"),
    Part("rdepth.exits.policies"),
    Part("rdepth.exits.registry"),
    Part("rdepth.exits.controller"),
    Part("rdepth.interop.hf_model"),
)


def module_path(module: str) -> Path:
    """The source file of an rdepth module (``rdepth.model.kv`` -> ``.../rdepth/model/kv.py``)."""
    parts = module.split(".")
    if parts[0] != "rdepth":
        raise RdepthError(f"not an rdepth module: {module}")
    path = PACKAGE_ROOT.joinpath(*parts[1:]).with_suffix(".py")
    if not path.is_file():
        raise RdepthError(f"rdepth source file missing: {path}")
    return path


def _is_rdepth_import(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.module) and (node.module == "rdepth" or node.module.startswith("rdepth."))
    if isinstance(node, ast.Import):
        return any(alias.name == "rdepth" or alias.name.startswith("rdepth.") for alias in node.names)
    return False


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [d.lineno for d in decorators])


class _Bundle:
    """Collects hoisted imports, bodies, defined names and the rdepth names used."""

    def __init__(self) -> None:
        self.imports: list[str] = []  # "import x" statements
        self.from_imports: dict[str, list[str]] = {}  # module -> names, in first-seen order
        self.bodies: list[str] = []
        self.defined: dict[str, str] = {}  # name -> module that defines it
        self.needed: list[tuple[str, str, int]] = []  # (name, module that imports it, line)
        self.relative: dict[str, str] = {}  # name -> relative module (the config file)
        self.side_effects: list[tuple[str, str, int]] = []  # (module imported whole, by module, line)
        self.modules: list[str] = []  # bundled so far, in order

    def add(self, part: Part) -> None:
        self.modules.append(part.module)
        path = module_path(part.module)
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.splitlines()
        body = tree.body
        drop, hoisted = self._read_imports(tree, part.module)
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            drop.update(range(body[0].lineno, body[0].end_lineno + 1))  # module docstring
        kept = [node for node in body if part.only is None or set(_defined_names(node)) & set(part.only)]
        self._hoist(hoisted, kept, part.only)
        for node in kept:
            for name in _defined_names(node):
                if name in self.defined:
                    raise RdepthError(f"cannot bundle {part.module}: {name!r} is also defined in "
                                      f"{self.defined[name]}")
                self.defined[name] = part.module
        if part.only is not None:
            chunks = ["\n".join(lines[_first_line(n) - 1 : n.end_lineno]) for n in kept]
            source = "\n\n\n".join(chunks)
        else:
            source = "\n".join(line for number, line in enumerate(lines, 1) if number not in drop)
        self.bodies.append(f"# {'-' * 20} {part.module} ({path.relative_to(PACKAGE_ROOT.parent)})\n\n"
                           + source.strip() + "\n")

    def _read_imports(self, tree: ast.Module, module: str) -> tuple[set[int], list[ast.stmt]]:
        """The module's imports: rdepth's are dropped and recorded (names needed from other bundled modules,
        the config module's names, imports for side effects); other packages' top-level imports are
        hoisted. Returns the 1-based line numbers left out of the body and the hoisted imports."""
        drop: set[int] = set()
        hoisted: list[ast.stmt] = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if _is_rdepth_import(node):
                drop.update(range(node.lineno, node.end_lineno + 1))
                for alias in node.names:
                    if isinstance(node, ast.Import):  # imported for its side effects (registration)
                        self.side_effects.append((alias.name, module, node.lineno))
                    elif node.module == CONFIG_MODULE:
                        self.relative[alias.asname or alias.name] = CONFIG_FILE[:-3]
                    else:
                        self.needed.append((alias.name, module, node.lineno))
            elif node in tree.body:  # a top-level import of another package: hoisted
                drop.update(range(node.lineno, node.end_lineno + 1))
                if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                    hoisted.append(node)
        return drop, hoisted

    def _hoist(self, hoisted: list[ast.stmt], kept: list[ast.stmt], only) -> None:
        """Add the hoisted imports to the bundle's header, merged per module; a partial module (``only``)
        brings only the imports its kept definitions use."""
        used = {n.id for node in kept for n in ast.walk(node) if isinstance(n, ast.Name)}
        for node in hoisted:
            bound = {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            if only is not None and not bound & used:
                continue
            if isinstance(node, ast.ImportFrom):  # merged per module: one "from typing import ..." line
                names = self.from_imports.setdefault(node.module, [])
                names += [ast.unparse(alias) for alias in node.names if ast.unparse(alias) not in names]
            elif ast.unparse(node) not in self.imports:
                self.imports.append(ast.unparse(node))

    def check(self) -> None:
        for name, module, line in self.side_effects:
            if name not in self.modules[: self.modules.index(module)]:
                raise RdepthError(f"cannot bundle {module}: it imports {name} (line {line}), which is not "
                                  "bundled before it")
        for name, module, line in self.needed:
            if name not in self.defined and name not in self.relative:
                raise RdepthError(f"cannot bundle {module}: it imports {name!r} (line {line}), "
                                  "which no bundled module defines")


def _header(kind: str, digest: str) -> str:
    return (
        f'"""{kind} of an rdepth recurrent-depth model for Hugging Face transformers.\n\n'
        "GENERATED by `rdepth export` from rdepth's own source (rdepth.interop.source); do not\n"
        "edit by hand. Every section below is an rdepth module verbatim, minus its imports.\n"
        f"Source digest: {digest}\n"
        '"""\n\n'
    )


def _digest(parts: tuple[Part, ...]) -> str:
    sha = hashlib.sha256()
    for part in parts:
        sha.update(module_path(part.module).read_bytes())
    return sha.hexdigest()[:16]


def modeling_source(parts: tuple[Part, ...] = MODELING_PARTS) -> str:
    """The text of ``modeling_rdepth.py``: the bundled modules, checked to compile and to
    import nothing from rdepth."""
    bundle = _Bundle()
    for part in parts:
        bundle.add(part)
    bundle.check()
    relative = {}
    for name, module in bundle.relative.items():
        relative.setdefault(module, []).append(name)
    imports = ["from __future__ import annotations", ""] + bundle.imports
    imports += [f"from {module} import {', '.join(names)}" for module, names in bundle.from_imports.items()]
    imports += [f"from .{module} import {', '.join(sorted(names))}" for module, names in relative.items()]
    text = _header("Modeling code", _digest(parts)) + "\n".join(imports) + "\n\n\n" + "\n\n".join(bundle.bodies)
    _check_standalone(text, MODELING_FILE)
    return text


def config_source() -> str:
    """The text of ``configuration_rdepth.py`` (:mod:`rdepth.interop.hf_config`, which imports no rdepth)."""
    text = module_path(CONFIG_MODULE).read_text()
    _check_standalone(text, CONFIG_FILE)
    return text


def _check_standalone(text: str, name: str) -> None:
    tree = ast.parse(text)
    compile(tree, name, "exec")
    for node in ast.walk(tree):
        if _is_rdepth_import(node):
            raise RdepthError(f"generated {name} still imports rdepth (line {node.lineno})")


def write_modeling_files(directory: Path) -> list[Path]:
    """Write ``modeling_rdepth.py`` and ``configuration_rdepth.py`` into ``directory``."""
    written = []
    for name, text in ((MODELING_FILE, modeling_source()), (CONFIG_FILE, config_source())):
        (directory / name).write_text(text)
        written.append(directory / name)
    return written
