"""`flashpoint ls BASE`: every version (committed or not), every rank's buffer pool and the replica spares."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ml_flashpoint_nemo.cli.common import (
    EXIT_OK,
    compact_ranks,
    format_time,
    human_bytes,
    iso_time,
    open_base,
    print_json,
    print_table,
    scan_pool,
    scan_replica_spares,
    valid_time,
)
from ml_flashpoint_nemo.core.format import CommitRecord
from ml_flashpoint_nemo.core.layout import (
    COMMIT_NAME,
    CheckpointLayout,
    filesystem_type,
    is_temporary_name,
    rank_of_object,
)
from ml_flashpoint_nemo.core.versions import read_commit, superseded_steps
from ml_flashpoint_nemo.errors import CorruptCheckpointError, FormatVersionError, VersionNotFoundError

UNKNOWN = "unknown"


def replication_state(layout: CheckpointLayout, record: CommitRecord | None) -> str | None:
    """Replication state of a version as recorded on this node, or None when nothing records it.

    There is no on-memory replication marker yet (format v1): this is where one will be read.
    A recorded state is any string ("replicated", "under-replicated", ...); None prints "unknown".
    """
    if record is None:
        return None
    state = record.metadata.get("replication")
    if isinstance(state, dict):
        state = state.get("state")
    return state if isinstance(state, str) else None


def allocated_bytes(st: os.stat_result) -> int:
    """Bytes a file takes in its filesystem (a pool buffer is larger than the object it holds)."""
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


@dataclass
class VersionEntry:
    step: int
    path: Path
    state: str  # "committed" | "unreadable" (COMMIT present but unusable) | "uncommitted"
    record: CommitRecord | None = None
    error: str | None = None
    object_files: dict[str, int] = field(default_factory=dict)  # name -> size on disk
    temp_files: list[str] = field(default_factory=list)
    mtime: float | None = None
    allocated: int = 0  # bytes the directory's files take in the filesystem (RAM on a tmpfs)
    leftover: bool = False  # uncommitted and older than the newest committed version (clean removes it)

    @property
    def committed(self) -> bool:
        return self.state != "uncommitted"

    @property
    def ranks(self) -> list[int]:
        if self.record is not None:
            return sorted({o.rank for o in self.record.objects})
        return sorted({r for r in map(rank_of_object, self.object_files) if r is not None})

    @property
    def object_count(self) -> int:
        return len(self.record.objects) if self.record is not None else len(self.object_files)

    @property
    def object_nbytes(self) -> int:
        if self.record is not None:
            return sum(o.nbytes for o in self.record.objects)
        return sum(self.object_files.values())

    @property
    def file_nbytes(self) -> int:
        if self.record is None:
            return 0
        files = self.record.metadata.get("files") or {}
        return sum(int(f.get("nbytes", 0)) for f in files.values() if isinstance(f, dict))

    @property
    def kind(self) -> str | None:
        if self.record is None:
            return None
        return str(self.record.metadata.get("kind") or "core")

    @property
    def created_unix(self) -> float | None:
        """When the commit record says it was made (as read: possibly NaN or out of range), else the mtime."""
        return self.record.created_unix if self.record is not None else self.mtime

    @property
    def missing_objects(self) -> list[str]:
        if self.record is None:
            return []
        return [o.name for o in self.record.objects if o.name not in self.object_files]

    def to_json(self, layout: CheckpointLayout) -> dict[str, Any]:
        record = self.record
        return {
            "step": self.step,
            "path": str(self.path),
            "state": self.state,
            "committed": self.committed,
            "commit_readable": record is not None if self.committed else None,
            "error": self.error,
            "kind": self.kind,
            "world_size": record.world_size if record else None,
            "objects": self.object_count,
            "ranks": self.ranks,
            "nbytes": self.object_nbytes + self.file_nbytes,
            "object_nbytes": self.object_nbytes,
            "file_nbytes": self.file_nbytes,
            "files": sorted((record.metadata.get("files") or {}) if record else []),
            "created_unix": valid_time(self.created_unix),
            "created": iso_time(self.created_unix),
            "created_valid": valid_time(self.created_unix) is not None,
            "replication": replication_state(layout, record),
            "allocated_nbytes": self.allocated,
            "missing_objects": self.missing_objects,
            "temp_files": self.temp_files,
            "leftover": self.leftover,
        }


def scan_versions(layout: CheckpointLayout) -> list[VersionEntry]:
    """Every step-<N> directory, oldest first, with what its commit record (if any) says."""
    entries = []
    for step in layout.version_steps():
        directory = layout.version_dir(step)
        try:
            scanned = list(os.scandir(directory))
            mtime = directory.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed meanwhile
        names = {e.name: e for e in scanned}
        objects = {}
        allocated = 0
        for name, e in names.items():
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            allocated += allocated_bytes(st)
            if rank_of_object(name) is not None:
                objects[name] = st.st_size
        temps = sorted(n for n in names if is_temporary_name(n))
        entry = VersionEntry(step, directory, "uncommitted", object_files=objects, temp_files=temps, mtime=mtime,
                             allocated=allocated)
        if COMMIT_NAME in names:
            try:
                entry.record = read_commit(layout, step)
                entry.state = "committed"
            except (CorruptCheckpointError, FormatVersionError, VersionNotFoundError, OSError,
                    OverflowError, ValueError) as exc:  # a number no float holds (e.g. created_unix 1e400 as digits)
                entry.state = "unreadable"
                entry.error = str(exc)
        entries.append(entry)
    superseded = set(superseded_steps([e.step for e in entries], [e.step for e in entries if e.committed], keep=1))
    for version in entries:
        version.leftover = not version.committed and version.step in superseded
    return entries


def run(args: argparse.Namespace) -> int:
    layout = open_base(args.base)
    versions = scan_versions(layout)
    pool = scan_pool(layout)
    spares = scan_replica_spares(layout)
    if args.json:
        print_json({
            "base": str(layout.base_dir),
            "filesystem": filesystem_type(layout.base_dir),
            "versions": [v.to_json(layout) for v in versions],
            "newest_committed": max((v.step for v in versions if v.state == "committed"), default=None),
            "pool": [p.to_json() for p in pool],
            "replica_spares": spares.to_json(),
        })
        return EXIT_OK
    print(f"base {layout.base_dir} ({filesystem_type(layout.base_dir) or 'unknown filesystem'})")
    if not versions:
        print("no versions")
    else:
        rows = [["STEP", "STATE", "KIND", "WORLD", "RANKS", "OBJECTS", "SIZE", "ALLOCATED", "CREATED", "REPLICATED", "NOTE"]]
        for v in versions:
            rows.append([
                str(v.step),
                v.state,
                v.kind or "-",
                str(v.record.world_size) if v.record else "-",
                compact_ranks(v.ranks),
                str(v.object_count),
                human_bytes(v.object_nbytes + v.file_nbytes),
                human_bytes(v.allocated),
                format_time(v.created_unix),
                (replication_state(layout, v.record) or UNKNOWN) if v.record else "-",
                _note(v),
            ])
        print_table(rows)
        for v in versions:
            if v.error:
                print(f"step {v.step}: commit record unreadable: {v.error}")
    if pool:
        print("pool")
        rows = [["RANK", "FREE BUFFERS", "ALLOCATED", "LOCK"]]
        for p in pool:
            if not p.lock_known:
                lock = UNKNOWN
            elif p.lock_holder is None:
                lock = "free"
            else:
                lock = f"held by pid {p.lock_holder}" if p.lock_holder else "held"
            rows.append([str(p.rank), str(p.buffers), human_bytes(p.nbytes), lock])
        print_table(rows)
    else:
        print("pool: none")
    if spares.files:
        print(f"replica spares: {spares.files} file(s), {human_bytes(spares.nbytes)} (pages reused by received "
              f"replicas; not checkpoints) in {spares.directory}")
    return EXIT_OK


def _note(v: VersionEntry) -> str:
    notes = []
    if v.state == "unreadable":
        notes.append("commit record unreadable (see below)")
    if v.state == "uncommitted":
        notes.append("leftover of an unfinished save" if v.leftover else "uncommitted (save in progress or crashed)")
    if v.record is not None and valid_time(v.created_unix) is None:
        notes.append("commit record's creation time is invalid")
    if v.missing_objects:
        notes.append(f"{len(v.missing_objects)} object(s) not on this node")
    if v.temp_files:
        notes.append(f"{len(v.temp_files)} temp file(s)")
    return "; ".join(notes)
