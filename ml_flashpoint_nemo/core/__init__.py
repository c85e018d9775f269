"""Framework-free core: format v1, buffer pool, saver, loader, Manager warm-up (torch only).

Names are imported lazily, so that a process which needs one light module (the Manager's
server process imports core.sync_manager) does not pay for torch and the C++ extension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ml_flashpoint_nemo._lazy import lazy_exports

if TYPE_CHECKING:  # what the lazy exports below resolve to, for type checkers and IDEs
    from ml_flashpoint_nemo.core.format import FORMAT_VERSION, CommitRecord, ObjectRecord
    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.core.lifecycle import CloseReport, close_live_resources, live_resources
    from ml_flashpoint_nemo.core.loader import VerifyReport, load_newest_valid, load_version, verify_version
    from ml_flashpoint_nemo.core.pool import BufferPool
    from ml_flashpoint_nemo.core.saver import CheckpointSaver, SaveResult, WrittenObject
    from ml_flashpoint_nemo.core.sync_manager import (
        ManagerFuture,
        SyncManagerFuture,
        shutdown_manager,
        start_manager_warmup,
        wait_for_manager,
    )
    from ml_flashpoint_nemo.core.versions import (
        VersionInfo,
        committed_steps,
        delete_superseded,
        list_versions,
        read_commit,
        retire_superseded,
        retire_version,
        superseded_steps,
        write_commit,
    )

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
    "ManagerFuture": "sync_manager",
    "SyncManagerFuture": "sync_manager",
    "shutdown_manager": "sync_manager",
    "start_manager_warmup": "sync_manager",
    "wait_for_manager": "sync_manager",
    "BufferPool": "pool",
    "CheckpointSaver": "saver",
    "SaveResult": "saver",
    "WrittenObject": "saver",
    "VersionInfo": "versions",
    "committed_steps": "versions",
    "delete_superseded": "versions",
    "retire_superseded": "versions",
    "superseded_steps": "versions",
    "list_versions": "versions",
    "read_commit": "versions",
    "retire_version": "versions",
    "write_commit": "versions",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return __all__
