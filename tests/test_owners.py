"""One owner per name: the names of docs/format.md are built and recognised by core/layout.py alone.

Every other module calls layout's functions and constants; a literal of one of these names in
their code (docstrings, comments and messages' `step-<N>` placeholders aside) would be a second
owner that can drift from the first. Read with ast, so only code counts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "ml_flashpoint_nemo"
OWNER = "core/layout.py"

# What a literal must not contain outside the owner, and the name it stands for.
FORBIDDEN = {
    re.compile(r"buf-"): "a pool buffer name (layout.buffer_name / BUFFER_PREFIX)",
    re.compile(r"\.lock"): "a pool lock name (layout.LOCK_NAME)",
    re.compile(r"spare-"): "a replica spare name (layout.spare_name)",
    re.compile(r"\.tmp-"): "a temporary file name (layout.temporary_name / is_temporary_name)",
    re.compile(r"step-(?!<)"): "a version directory name or pattern (layout.version_dir_name / step_of_version_dir)",
    re.compile(r"rank-(?!<)"): "a pool or object name (layout.pool_dir_name / object_name)",
    re.compile(r"metadata\.json"): "Megatron's config name (layout.MEGATRON_CONFIG_NAME)",
    re.compile(r"common\.pt"): "Megatron's common state name (layout.MEGATRON_COMMON_NAME)",
    re.compile(r"^\.metadata$"): "DCP's metadata name (layout.DCP_METADATA_NAME)",
    re.compile(r"^COMMIT$"): "the commit record name (layout.COMMIT_NAME)",
}

# (module, literal piece): why it is not one of the format's names.
EXEMPT = {
    ("cli/export.py", ".tmp-"): "the export's temporary DEST directory is a DCP checkpoint, not in a base directory",
    ("cli/__init__.py", ".tmp-"): "export's help names that temporary DEST directory",
}


def _code_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant of the code, f-string pieces included; docstrings (bare string statements) left out."""
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def second_owners(root: Path = PACKAGE_ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module == OWNER:
            continue
        for line, text in _code_strings(ast.parse(path.read_text(), str(path))):
            for pattern, what in FORBIDDEN.items():
                match = pattern.search(text)
                if match and (module, match.group(0)) not in EXEMPT:
                    found.append(f"{module}:{line}: {text!r} spells {what}")
    return found


def test_only_the_layout_spells_the_format_names():
    problems = second_owners()
    if problems:
        pytest.fail("names of docs/format.md spelled outside core/layout.py; call layout instead:\n"
                    + "\n".join(problems))


def test_the_check_finds_a_second_owner(tmp_path):
    """A test that cannot fail proves nothing: each kind of literal is found, docstrings and placeholders are not."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "layout.py").write_text('BUFFER_PREFIX = "buf-"\n')
    (tmp_path / "pool.py").write_text(
        '"""Buffers are named buf-<hex> (a docstring may say so)."""\n'
        'def f(step, d):\n'
        '    """step-{step} in a docstring is fine."""\n'
        '    name = f"{d}/step-{step}/x"\n'
        '    return name, "buf-" + "1", ".lock", f".x.tmp-{step}", "metadata.json", ".metadata", "COMMIT", "step-<N>"\n')
    problems = second_owners(tmp_path)
    assert len(problems) == 7, problems
    assert all(p.startswith("pool.py:") for p in problems)
    assert not any("step-<N>" in p or "docstring" in p for p in problems)


def test_the_megatron_names_are_megatrons():
    """layout knows Megatron's file names without importing Megatron: they must stay Megatron's."""
    pytest.importorskip("megatron.core")
    from megatron.core.dist_checkpointing.core import CONFIG_FNAME
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    from ml_flashpoint_nemo.core.layout import MEGATRON_COMMON_NAME, MEGATRON_CONFIG_NAME

    assert (MEGATRON_CONFIG_NAME, MEGATRON_COMMON_NAME) == (CONFIG_FNAME, COMMON_STATE_FNAME)
