"""Lazy package exports: a name is imported from its submodule the first time it is used.

So a process that needs one light module (the Manager's server imports core.sync_manager)
does not pay for torch, NeMo or the C++ extension.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module __getattr__ for `package` that imports exports[name] (a submodule) on first use."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
