"""The package's layers, read from its source with ast: core imports nothing above it, no import cycles.

Layers, lowest first: the top-level modules (errors, _lazy, the C++ _core), core/, then
dcp/ and replication/, megatron/, and nemo/, nvrx/ and cli/ on top. A module may import its own
layer and those below (ALLOWED). Which imports count:
- module-level imports and imports inside functions ("deferred") both count: a deferred
  import is a dependency as real as any other, it only runs later, and a cycle through it
  still ties the two modules into one;
- imports under `if TYPE_CHECKING:` count for the layer rule (a type from above is a
  dependency on above) but not for cycles (they never run);
- importing `a.b.c` also runs the `__init__` of `a` and `a.b`; those implicit edges are left
  out, each package's `__init__` is a module with its own (lazy) imports.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "ml_flashpoint_nemo"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Subpackage -> the subpackages it may import ("" is the top level: errors, _lazy, _core).
ALLOWED: dict[str, set[str]] = {
    "": {""},
    "core": {"", "core"},
    "dcp": {"", "core", "dcp"},
    "replication": {"", "core", "replication"},
    "megatron": {"", "core", "dcp", "replication", "megatron"},
    "nemo": {"", "core", "dcp", "replication", "megatron", "nemo"},
    "nvrx": {"", "core", "dcp", "replication", "megatron", "nvrx"},  # NVRx's manager interface, beside nemo
    "cli": {"", "core", "dcp", "cli"},
    "testing": {"", "testing"},  # CPU stand-ins for tests and examples: imported by nothing of the package
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module of this package
    kind: str  # "module", "deferred" or "typing"
    line: int


def module_names(root: Path = ROOT) -> dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a module of this package in one file, with where it runs."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def target_of(node: ast.ImportFrom, name: str) -> str:
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        return f"{base}.{name}" if f"{base}.{name}" in modules else base

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    visit_one(statement, "typing")
                for statement in child.orelse:
                    visit_one(statement, kind)
            else:
                visit_one(child, kind)

    def visit_one(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = [target_of(node, alias.name) for alias in node.names]
        else:
            targets = []
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append(Import(module, target, kind, getattr(node, "lineno", 0)))
        inner = "deferred" if kind == "module" and isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else kind
        visit(node, inner)

    visit(ast.parse(path.read_text(), str(path)), "module")
    return found


def all_imports(root: Path = ROOT) -> list[Import]:
    modules = module_names(root)
    return [i for name, path in modules.items() for i in imports_of(name, path, modules)]


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else ""


def layer_violations(imports: list[Import]) -> list[str]:
    """Imports from above the importer's layer. The package's own __init__ is its facade: it names the
    lazy exports of every layer for type checkers (type-only imports, never run)."""
    return [f"{i.source} (line {i.line}, {i.kind}) imports {i.target}: {layer_of(i.source) or 'top level'} "
            f"may import only {sorted(ALLOWED[layer_of(i.source)])}"
            for i in imports if layer_of(i.target) not in ALLOWED[layer_of(i.source)]
            and not (i.source == PACKAGE and i.kind == "typing")]


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import), run-time imports only."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.kind != "typing":
            graph.setdefault(i.source, set()).add(i.target)
            graph.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


def test_core_imports_nothing_above_it():
    imports = all_imports()
    assert any(i.source.startswith(f"{PACKAGE}.core.") for i in imports), "the scan found core's modules"
    above = [i for i in imports if i.source.startswith(f"{PACKAGE}.core")
             and layer_of(i.target) not in ("", "core")]
    if above:
        pytest.fail("\n".join(f"{i.source}:{i.line} ({i.kind}) imports {i.target}" for i in above))


def test_every_layer_imports_only_its_own_and_lower_layers():
    violations = layer_violations(all_imports())
    if violations:
        pytest.fail("\n".join(violations))


def test_no_import_cycles_between_the_package_modules():
    cycles = import_cycles(all_imports())
    if cycles:
        pytest.fail("import cycles (module-level and deferred imports):\n" + "\n".join(" <-> ".join(c) for c in cycles))


def _write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / PACKAGE
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_the_checks_see_deferred_relative_and_typing_imports(tmp_path):
    """The checks find what they must (a test that cannot fail would prove nothing)."""
    package = _write_package(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "core/__init__.py": "",
        "core/a.py": "def f():\n    from ml_flashpoint_nemo.nemo import b\n",
        "nemo/__init__.py": "",
        "nemo/b.py": "from ..core import a\nfrom . import c\n",
        "nemo/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ml_flashpoint_nemo.nemo import b\n"
                      "def g():\n    import ml_flashpoint_nemo.nemo.b\n"),
        "cli/__init__.py": "",
        "cli/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ml_flashpoint_nemo.nemo.b import x\n",
    })
    imports = all_imports(package)
    kinds = {(i.source.rpartition(".")[2], i.target.rpartition(".")[2], i.kind) for i in imports}
    assert {("a", "b", "deferred"), ("b", "a", "module"), ("b", "c", "module"), ("c", "b", "typing"),
            ("c", "b", "deferred"), ("d", "b", "typing")} <= kinds
    violations = layer_violations(imports)
    assert any("core.a" in v and "nemo.b" in v for v in violations)  # a deferred import from above
    assert any("cli.d" in v and "nemo.b" in v for v in violations)  # a type-only import from above
    assert sorted(map(tuple, import_cycles(imports))) == [  # b -> a -> b (deferred) and b -> c -> b (deferred)
        (f"{PACKAGE}.core.a", f"{PACKAGE}.nemo.b", f"{PACKAGE}.nemo.c")]


def test_a_type_only_import_makes_no_cycle(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "",
        "nemo/__init__.py": "",
        "nemo/b.py": "from . import c\n",
        "nemo/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
    })
    assert import_cycles(all_imports(package)) == []
