"""Framework-free core: format v1, buffer pool, saver, loader, Manager warm-up (torch only).

Names are imported lazily, so that a process which needs one light module (the Manager's
server process imports core.manager) does not pay for torch and the C++ extension.
"""

from __future__ import annotations

from ml_flashpoint_nemo._lazy import lazy_exports

_EXPORTS = {
    "FORMAT_VERSION": "format",
    "CommitRecord": "format",
    "ObjectRecord": "format",
    "CheckpointLayout": "layout",
    "CloseReport": "lifecycle",
    "close_live_resources": "lifecycle",
    "live_resources": "lifecycle",
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


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
