"""Versions: committing them, listing them, retiring old ones.

A version exists once its commit record exists. The record is written to a
temporary name and renamed into place, so readers see either no version or a
complete record. Retiring removes the record first, so a version never appears
half-deleted.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ml_flashpoint_nemo.core.format import CommitRecord, ObjectRecord
from ml_flashpoint_nemo.core.layout import COMMIT_NAME, CheckpointLayout, rank_of_object, temporary_name
from ml_flashpoint_nemo.core.pool import BufferPool, raise_if_out_of_space
from ml_flashpoint_nemo.core.trees import remove_tree
from ml_flashpoint_nemo.errors import CorruptCheckpointError, FormatVersionError, VersionNotFoundError

logger = logging.getLogger(__name__)


def write_commit(
    layout: CheckpointLayout,
    step: int,
    objects: Sequence[ObjectRecord],
    *,
    world_size: int,
    metadata: dict[str, Any] | None = None,
) -> CommitRecord:
    """Atomically write the commit record of a version whose objects are all written."""
    record = CommitRecord(
        step=step,
        world_size=world_size,
        objects=tuple(sorted(objects, key=lambda o: (o.rank, o.name))),
        created_unix=time.time(),
        metadata=dict(metadata or {}),
    )
    directory = layout.version_dir(step)
    directory.mkdir(parents=True, exist_ok=True)
    write_file_atomically(directory, COMMIT_NAME, record.encode(), f"the commit record of step {step}")
    fsync_directory(directory)
    return record


def write_file_atomically(directory: Path, name: str, data: bytes, what: str) -> None:
    """Write directory/name so that readers see the old file or the whole new one, never a part."""
    temporary = directory / temporary_name(name)
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())  # free on tmpfs; makes a disk base dir crash-safe too
        os.rename(temporary, directory / name)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise_if_out_of_space(exc, what)
        raise


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_commit(layout: CheckpointLayout, step: int) -> CommitRecord:
    path = layout.commit_path(step)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise VersionNotFoundError(
            f"no committed version of step {step} in {layout.base_dir}; committed steps: {committed_steps(layout)}"
        ) from None
    record = CommitRecord.decode(raw, str(path))
    if record.step != step:
        raise CorruptCheckpointError(f"commit record {path} names step {record.step}, not {step}")
    return record


def committed_steps(layout: CheckpointLayout) -> list[int]:
    """Steps that have a commit record, oldest first (the records are not validated here)."""
    return [s for s in layout.version_steps() if layout.is_committed(s)]


@dataclass(frozen=True)
class VersionInfo:
    """One committed version as listed: its record, or why it could not be read."""

    step: int
    path: Path
    record: CommitRecord | None
    error: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.record.objects) if self.record else 0


def list_versions(base_dir: str | os.PathLike[str]) -> list[VersionInfo]:
    """Every committed version under base_dir, oldest first; unreadable records are listed with their error."""
    layout = CheckpointLayout(base_dir)
    infos = []
    for step in committed_steps(layout):
        try:
            infos.append(VersionInfo(step, layout.version_dir(step), read_commit(layout, step)))
        except (CorruptCheckpointError, FormatVersionError, VersionNotFoundError) as exc:
            infos.append(VersionInfo(step, layout.version_dir(step), None, str(exc)))
    return infos


def retire_version(layout: CheckpointLayout, step: int, *, rank: int | None, pool: BufferPool | None = None,
                   world_size: int | None = None) -> None:
    """Remove a version: its commit record first, then the objects of `rank` (all ranks if None).

    Version-level files (commit record, adapter metadata) go with the first caller; objects
    of other ranks are left to those ranks, except those of ranks >= world_size (a version
    saved before the job restarted with fewer ranks: no rank would ever remove them). With a
    pool, this rank's object files go back into it for reuse instead of being deleted.
    """
    directory = layout.version_dir(step)
    layout.commit_path(step).unlink(missing_ok=True)
    for name in _list_dir(directory):
        owner = rank_of_object(name)
        path = directory / name
        if owner is None:
            remove_tree(path)  # a file, or whatever a peer or a crash left (a directory, a deep tree)
        elif rank is None or owner == rank or (world_size is not None and owner >= world_size):
            if pool is not None and owner == pool.rank and not path.is_dir():
                pool.recycle(path)
            else:
                if pool is not None:
                    pool.forget(path)
                remove_tree(path)
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        if rank is None:
            remove_tree(directory)
        # otherwise other ranks' objects are still there; the last rank removes the directory


def _list_dir(directory: Path) -> Iterable[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def superseded_steps(steps: Iterable[int], committed: Iterable[int], *, keep: int) -> list[int]:
    """The retention policy: of the version directories `steps`, those to retire, oldest first.

    All but the newest `keep` committed versions go, and uncommitted leftovers older than the newest
    committed one. Uncommitted versions newer than it may still be being written and stay, and with
    no committed version nothing goes. Held versions (a durable drain is reading them) are not
    decided here: their callers skip them. The savers (retire_superseded) and `flashpoint clean` both
    decide by this function, from their own listing of the base directory.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest committed version is never deleted), got {keep}")
    newest_first = sorted(set(committed), reverse=True)
    if not newest_first:
        return []
    survivors = set(newest_first[:keep])
    return sorted(s for s in set(steps) if s not in survivors and s < newest_first[0])


def retire_superseded(
    base_dir: str | os.PathLike[str], *, keep: int = 1, rank: int | None = None, pool: BufferPool | None = None,
    world_size: int | None = None,
) -> list[int]:
    """Retire (see retire_version) every version superseded_steps names; returns the steps retired."""
    layout = CheckpointLayout(base_dir)
    retired = [s for s in superseded_steps(layout.version_steps(), committed_steps(layout), keep=keep)
               if not layout.is_held(s)]  # a durable drain is reading it; it releases the hold when done
    for step in retired:
        retire_version(layout, step, rank=rank, pool=pool, world_size=world_size)
    if retired:
        logger.debug("Retired versions %s under %s (keeping %d)", retired, layout.base_dir, keep)
    return retired


delete_superseded = retire_superseded  # the name of releases up to 0.1.0 (ml_flashpoint_nemo.core exports it)
