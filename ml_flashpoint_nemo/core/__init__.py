"""Framework-free core: format v1, buffer pool, saver and loader (depends on torch only)."""

from ml_flashpoint_nemo.core.format import FORMAT_VERSION, CommitRecord, ObjectRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import VerifyReport, load_newest_valid, load_version, verify_version
from ml_flashpoint_nemo.core.pool import BufferPool
from ml_flashpoint_nemo.core.saver import CheckpointSaver, SaveResult, WrittenObject
from ml_flashpoint_nemo.core.versions import (
    VersionInfo,
    committed_steps,
    delete_superseded,
    list_versions,
    read_commit,
    retire_version,
    write_commit,
)

__all__ = [
    "FORMAT_VERSION",
    "BufferPool",
    "CheckpointLayout",
    "CheckpointSaver",
    "CommitRecord",
    "ObjectRecord",
    "SaveResult",
    "VerifyReport",
    "VersionInfo",
    "WrittenObject",
    "committed_steps",
    "delete_superseded",
    "list_versions",
    "load_newest_valid",
    "load_version",
    "read_commit",
    "retire_version",
    "verify_version",
    "write_commit",
]
