"""What type checkers see: the package is marked typed, the lazy exports are visible to them, the
C++ extension has a stub.

The lazy exports resolve at run time through `_EXPORTS`; type checkers read the
`if TYPE_CHECKING:` imports instead. The two lists must name the same things from the same
modules, or a checker and the interpreter disagree about the public API.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ml_flashpoint_nemo"
LAZY_PACKAGES = ["ml_flashpoint_nemo", "ml_flashpoint_nemo.core", "ml_flashpoint_nemo.nemo"]


def exports_and_type_imports(init: Path, package: str) -> tuple[dict[str, str], dict[str, str]]:
    """({name: module} of _EXPORTS, {name: module} of the TYPE_CHECKING imports), modules package-relative."""
    tree = ast.parse(init.read_text())
    exports: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            exports = ast.literal_eval(node.value)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module:
                    for alias in statement.names:
                        typed[alias.asname or alias.name] = statement.module.removeprefix(package + ".")
    return exports, typed


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_type_checkers_see_every_lazy_export_from_its_module(package):
    init = ROOT.parent.joinpath(*package.split("."), "__init__.py")
    exports, typed = exports_and_type_imports(init, package)
    assert exports, f"{init} has no _EXPORTS"
    assert typed == exports
    module = importlib.import_module(package)
    assert set(exports) <= set(module.__all__)


def test_the_check_sees_a_missing_type_import(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n'
                    '_EXPORTS = {"X": "a", "Y": "b"}\n')
    exports, typed = exports_and_type_imports(init, "pkg")
    assert exports != typed and typed == {"X": "a"}


def test_the_package_is_marked_typed_and_the_extension_has_a_stub():
    assert (ROOT / "py.typed").is_file()
    stub = ast.parse((ROOT / "_core.pyi").read_text())
    stubbed = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    from ml_flashpoint_nemo import _core

    public = {name for name in dir(_core) if not name.startswith("_")}
    assert stubbed == public  # scripts/lint.sh checks the signatures too (mypy stubtest)


def test_the_typed_keyword_options_are_the_options():
    """wrap_trainer_with_flashpoint's **options are typed by FlashpointOptionValues: same names, same types."""
    import dataclasses
    import typing

    from ml_flashpoint_nemo.nemo import settings

    fields = {f.name: f.type for f in dataclasses.fields(settings.FlashpointOptions)}
    hints = typing.get_type_hints(settings.FlashpointOptionValues)
    assert set(hints) == set(fields)
    resolved = typing.get_type_hints(settings.FlashpointOptions)
    assert {name: resolved[name] for name in fields} == hints
