"""Version-level files (adapter metadata, common state) and their checksums in the commit record.

Besides the per-rank objects, an adapter may keep small files in a version directory:
DCP's `.metadata`, Megatron's `metadata.json` and `common.pt`. The commit record lists
each under metadata["files"] with its size and CRC32C, so a flipped or truncated file is
caught like a flipped object. To make a version usable on another node, the coordinator
hands these files and the commit record to that node, which writes them with the commit
record last.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import FILES_KEY, CommitRecord
from ml_flashpoint_nemo.core.layout import COMMIT_NAME, MEGATRON_CONFIG_NAME, CheckpointLayout
from ml_flashpoint_nemo.core.versions import fsync_directory, write_file_atomically
from ml_flashpoint_nemo.errors import ChecksumError, CorruptCheckpointError, FlashpointError

logger = logging.getLogger(__name__)


def describe_bytes(data: bytes) -> dict[str, int]:
    """A file's entry in the commit record: its size and CRC32C."""
    return {"nbytes": len(data), "crc32c": _core.crc32c(data)}


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, int]]:
    """{name: {nbytes, crc32c}} for the named files that exist in directory (for the commit record)."""
    described = {}
    for name in names:
        try:
            described[name] = describe_bytes((directory / name).read_bytes())
        except FileNotFoundError:
            continue
    return described


# Megatron's metadata.json of a flashpoint version, byte for byte as megatron.core.dist_checkpointing's
# save_config writes it (the Megatron adapter's test compares them). Known here, without Megatron, so
# that the CLI repairs what the trainer repairs.
MEGATRON_CONFIG_BYTES = json.dumps({"sharded_backend": "ml_flashpoint", "sharded_backend_version": 1,
                                    "common_backend": "torch", "common_backend_version": 1}).encode()

# name -> its only possible content. Megatron rewrites metadata.json in place (truncate, then
# write) after the save is final, i.e. after our commit; a kill in between leaves it truncated
# in a committed version. Such a file is rewritten from its known content when that content
# matches the commit record, instead of the version being lost.
_REGENERABLE: dict[str, bytes] = {MEGATRON_CONFIG_NAME: MEGATRON_CONFIG_BYTES}


def read_checked_file(layout: CheckpointLayout, commit: CommitRecord, name: str) -> bytes:
    """The bytes of a version-level file, checked against the commit record; raises if they differ."""
    path = layout.version_dir(commit.step) / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = None
    known = _REGENERABLE.get(name)
    if data != known and known is not None and _matches_record(commit, name, known):
        state = "missing" if data is None else "damaged"
        try:
            write_file_atomically(path.parent, name, known, f"{name} of step {commit.step}")
        except (OSError, FlashpointError) as exc:  # a read-only base: the version is usable, not repaired
            logger.warning("%s of committed version %d is %s (interrupted rewrite); its known content is used, but "
                           "it could not be rewritten: %s", path, commit.step, state, exc)
            return known
        logger.warning("%s of committed version %d was %s (interrupted rewrite); restored from its known content",
                       path, commit.step, state)
        return known
    if data is None:
        raise CorruptCheckpointError(
            f"{path} of committed version {commit.step} is missing. Load an older version or the durable checkpoint."
        )
    _check_bytes(commit, name, data, str(path))
    return data


def _matches_record(commit: CommitRecord, name: str, data: bytes) -> bool:
    return (commit.metadata.get(FILES_KEY) or {}).get(name) == describe_bytes(data)


def check_version_files(layout: CheckpointLayout, commit: CommitRecord) -> int:
    """Check every version-level file the commit record lists; returns how many were checked."""
    listed = commit.metadata.get(FILES_KEY) or {}
    for name in listed:
        read_checked_file(layout, commit, name)
    return len(listed)


def version_copy(layout: CheckpointLayout, commit: CommitRecord,
                 names: Iterable[str] | None = None) -> dict[str, bytes]:
    """What another node needs to hold this version's files: each listed file (or those of `names` among
    them, which the other node lacks) and the commit record, checked."""
    listed = commit.metadata.get(FILES_KEY) or {}
    files = {name: read_checked_file(layout, commit, name) for name in listed if names is None or name in names}
    files[COMMIT_NAME] = layout.commit_path(commit.step).read_bytes()
    return files


def reusable_version_file(layout: CheckpointLayout, from_step: int, name: str, commit: CommitRecord) -> bytes | None:
    """The bytes of file `name` of version from_step on this node, if they are what `commit` lists; else None.

    A node leader receives a file that repeats from save to save (DCP's `.metadata`) once, and
    takes it from its previous version afterwards (core.node_copies.NodeCopies).
    """
    if os.sep in name or name in ("", ".", ".."):
        return None
    try:
        data = (layout.version_dir(from_step) / name).read_bytes()
    except (OSError, ValueError):
        return None
    return data if _matches_record(commit, name, data) else None


def write_version_copy(layout: CheckpointLayout, step: int, files: Mapping[str, bytes]) -> None:
    """Write a version's files received from its coordinator, the commit record last and atomically."""
    if COMMIT_NAME not in files:
        raise CorruptCheckpointError(f"the copy of step {step} has no commit record")
    commit = CommitRecord.decode(files[COMMIT_NAME], f"the commit record of step {step} received")
    if commit.step != step:
        raise CorruptCheckpointError(f"the commit record received for step {step} names step {commit.step}")
    directory = layout.version_dir(step)
    directory.mkdir(parents=True, exist_ok=True)
    for name in sorted(files, key=lambda n: n == COMMIT_NAME):
        if os.sep in name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"refusing version file name {name!r}: it must be a plain file name")
        if name != COMMIT_NAME:
            _check_bytes(commit, name, files[name], f"{name} of step {step} as received")
        write_file_atomically(directory, name, files[name], f"{name} of step {step}")
    fsync_directory(directory)


def _expected(commit: CommitRecord, name: str) -> Mapping[str, Any]:
    try:
        return commit.metadata[FILES_KEY][name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(
            f"the commit record of step {commit.step} lists no file {name!r}; it was not saved with this version"
        ) from None


def _check_bytes(commit: CommitRecord, name: str, data: bytes, where: str) -> None:
    expected = _expected(commit, name)
    if len(data) != expected["nbytes"] or _core.crc32c(data) != expected["crc32c"]:
        raise ChecksumError(
            f"{where} does not match the checksum in its commit record. Load an older version or the durable "
            "checkpoint.",
            path=where,
        )
