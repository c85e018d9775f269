"""Checking a rank's objects of the newest RAM version in the background, while the trainer is set up.

The recovery choice (choice.choose_version) reads every byte of each rank's own objects to check
their CRC32Cs before the ranks agree on a version, and the load reads them once more, checking
each record's CRC32C as it copies. Started when the trainer is wired (before the model is built),
the choice's pass runs while the process imports and builds instead of while the restore waits.

A check done ahead counts only for the same file and the same commit record entry: device,
inode, size and modification and change times equal before and after the check and when the
choice asks, and the record's name, size and checksum equal. Anything else (a file rewritten,
replaced by a peer's replica, or not checked yet) the choice checks itself. Bytes that change
without a write in between (a stray store through a mapping, a memory fault) are still caught by
the load, which checks every record it copies; that load then fails on every rank, where a check
in the choice would have fallen back to an older version.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import verify_object_file
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit

logger = logging.getLogger(__name__)

WAIT_S = 600.0  # longest wait for a check in progress; after it the choice checks the object itself


@dataclass(frozen=True)
class _FileIdentity:
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> "_FileIdentity | None":
        try:
            stat = os.stat(path)
        except OSError:
            return None
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


_lock = threading.Lock()
# (real base dir, rank) -> {(real path, record): the file that passed}, of that rank's newest check only: a
# new check replaces the table, so in-process restarts do not add to it.
_passed: dict[tuple[str, int], dict[tuple[str, ObjectRecord], _FileIdentity]] = {}
_running: dict[tuple[str, int], threading.Thread] = {}  # (real base dir, rank) -> its check


def verify_ahead(base_dir: str | os.PathLike[str], rank: int) -> None:
    """Start checking rank's objects of the newest committed version under base_dir (background thread).

    No-op while a check of the same base and rank runs. Never raises: a failed check only
    leaves the object to the choice, which reports why it cannot be used.
    """
    key = (os.path.realpath(base_dir), rank)
    with _lock:
        running = _running.get(key)
        if running is not None and running.is_alive():
            return
        _passed[key] = {}
        thread = threading.Thread(target=_verify_newest, args=(CheckpointLayout(base_dir), rank, key),
                                  name=f"flashpoint-verify-ahead-{rank}", daemon=True)
        _running[key] = thread
        thread.start()


def _verify_newest(layout: CheckpointLayout, rank: int, key: tuple[str, int]) -> None:
    try:
        steps = committed_steps(layout)
        if not steps:
            return
        step = steps[-1]
        for record in read_commit(layout, step).objects_of_rank(rank):
            path = os.path.realpath(layout.object_path(step, record.name))
            before = _FileIdentity.of(path)
            verify_object_file(path, record, default_copy_threads())
            if before is not None and _FileIdentity.of(path) == before:  # not written while it was read
                with _lock:
                    _passed.setdefault(key, {})[(path, record)] = before
    except Exception as exc:  # noqa: BLE001 - the choice checks (and reports) whatever did not pass here
        logger.debug("Checking the objects of rank %d in %s ahead of recovery stopped: %s", rank, layout.base_dir,
                     exc)


def verified_ahead(base_dir: str | os.PathLike[str], rank: int, path: str | os.PathLike[str],
                   record: ObjectRecord) -> bool:
    """Whether the object at path passed a check ahead (waiting for one in progress) and is still that file."""
    key = (os.path.realpath(base_dir), rank)
    with _lock:
        running = _running.get(key)
    if running is not None:
        running.join(WAIT_S)
    real = os.path.realpath(path)
    with _lock:
        passed = _passed.get(key, {}).get((real, record))
    return passed is not None and _FileIdentity.of(real) == passed
