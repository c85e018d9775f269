"""Framework-free core: format v1, buffer pool, saver, loader, Manager warm-up (torch only).

Names are imported lazily, so that a process which needs one light module (the Manager's
server process imports core.manager) does not pay for torch and the C++ extension.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FORMAT_VERSION": "format",
    "CommitRecord": "format",
    "ObjectRecord": "format",
    "CheckpointLayout": "layout",
    "VerifyReport": "loader",
    "load_newest_valid": "loader",
    "load_version": "loader",
    "verify_version": "loader",
    "ManagerFuture": "manager",
    "shutdown_manager": "manager",
    "start_manager_warmup": "manager",
    "wait_for_manager": "manager",
    "BufferPool": "pool",
    "CheckpointSaver": "saver",
    "SaveResult": "saver",
    "WrittenObject": "saver",
    "VersionInfo": "versions",
    "committed_steps": "versions",
    "delete_superseded": "versions",
    "list_versions": "versions",
    "read_commit": "versions",
    "retire_version": "versions",
    "write_commit": "versions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
