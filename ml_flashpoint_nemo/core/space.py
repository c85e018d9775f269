"""Room for a save's small files on every node, agreed by every rank before Megatron writes them.

Megatron's dist_checkpointing.save writes the common state (common.pt) on global rank 0 alone,
before any save strategy runs, and metadata.json on rank 0 alone when the save is finalized. On
a full tmpfs that write fails on rank 0 only: rank 0 raises while the other ranks enter the
strategy's collectives and wait for it, and the job dies instead of skipping one RAM save. The
pool's buffers are reused, so a full tmpfs is noticed nowhere else. Checking free space on every
rank first, and failing the save on every rank together, keeps the failure a skipped save.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.topology import any_rank, problems_of_every_rank
from ml_flashpoint_nemo.core.version_files import FILES_KEY
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.errors import BaseDirError, CorruptCheckpointError, FormatVersionError, OutOfSpaceError

MIN_FREE_BYTES = 4 << 20  # room for a first save's common state and metadata, whose size is not known yet


def bytes_needed(layout: CheckpointLayout) -> int:
    """Twice the version-level files of the newest committed version (they grow little), at least MIN_FREE_BYTES.

    Counts the files its commit record lists and the record itself, never the directory: peers'
    replicas arrive there as temporary files at any time, and a version may be deleted meanwhile.
    A record that cannot be read (damaged, or just retired) leaves the minimum: a damaged old
    version must not stop every later save.
    """
    steps = committed_steps(layout)
    if not steps:
        return MIN_FREE_BYTES
    try:
        record = read_commit(layout, steps[-1])
        small = layout.commit_path(steps[-1]).stat().st_size
    except (OSError, CorruptCheckpointError, FormatVersionError):
        return MIN_FREE_BYTES
    small += sum(int(entry["nbytes"]) for entry in record.metadata.get(FILES_KEY, {}).values())
    return max(MIN_FREE_BYTES, 2 * small)


def room_problem(base_dir: str | os.PathLike[str]) -> str | None:
    """Why this rank's node cannot take the next version's small files (None: it can); never raises.

    Every rank must reach the collective that follows, so a failure to check is a problem to
    report, not an exception. Before the first save the base may not exist yet: the file system
    that will hold it is checked.
    """
    try:
        needed = bytes_needed(CheckpointLayout(base_dir))
        existing = Path(base_dir).absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        vfs = os.statvfs(existing)
    except Exception as exc:  # noqa: BLE001 - returned to every rank by the caller's collective
        return f"cannot check free space in {base_dir}: {type(exc).__name__}: {exc}"
    free = vfs.f_bavail * vfs.f_frsize
    if free < needed:
        return f"{base_dir} has {free} bytes free, the save needs at least {needed}"
    return None


def version_dir_problem(version_dir: str | os.PathLike[str]) -> str | None:
    """Create a version's directory; why this rank cannot (None: it exists now). Never raises."""
    try:
        Path(version_dir).mkdir(parents=True, exist_ok=True)
    except Exception as exc:  # noqa: BLE001 - returned to every rank by the caller's collective
        return f"cannot create the version directory {version_dir}: {type(exc).__name__}: {exc}"
    return None


NO_PROBLEM, DIR_PROBLEM, ROOM_PROBLEM = 0, 1, 2  # a rank's start problem, ordered: MAX over ranks says which is raised


def start_problem(base_dir: str | os.PathLike[str],
                  version_dir: str | os.PathLike[str] | None = None) -> tuple[int, str | None]:
    """This rank's room problem (ROOM_PROBLEM), else its version directory's (DIR_PROBLEM), else (NO_PROBLEM, None).

    Local and never raises: the caller shares it with every rank in one all-reduce.
    """
    room = room_problem(base_dir)
    if room is not None:
        return ROOM_PROBLEM, room
    made = version_dir_problem(version_dir) if version_dir is not None else None
    return (DIR_PROBLEM, made) if made is not None else (NO_PROBLEM, None)


def raise_start_problems(highest: int, failed: list[str]) -> NoReturn:
    """Raise, on every rank alike, the error of every rank's start problems; highest: the largest kind of any rank."""
    if highest < ROOM_PROBLEM:
        raise BaseDirError("flashpoint save skipped on every rank: " + "; ".join(failed)
                           + ". Make the RAM checkpoint directory writable on that node.")
    raise OutOfSpaceError(
        "flashpoint save skipped on every rank: " + "; ".join(failed)
        + ". If a tmpfs is full: free memory on that node (other jobs' files in /dev/shm?), lower `keep`, "
        "or give the tmpfs more room."
    )


def check_room_on_every_rank(base_dir: str | os.PathLike[str], *,
                             version_dir: str | os.PathLike[str] | None = None) -> None:
    """Collective: raise OutOfSpaceError on every rank if any rank's node lacks room for the next save.

    Call it right before megatron.core.dist_checkpointing.save of a RAM version (the NeMo
    checkpoint IO does on a save that cannot fold it into the strategy's all-reduce); the
    previous versions stay intact and training can go on. With version_dir, each rank also
    creates that directory (Megatron requires it on rank 0); a rank that cannot makes every
    rank raise BaseDirError instead.
    """
    kind, problem = start_problem(base_dir, version_dir)
    failed = problems_of_every_rank(problem)
    if not failed:
        return
    # every rank is here: the problems above are every rank's
    raise_start_problems(ROOM_PROBLEM if any_rank(kind == ROOM_PROBLEM) else DIR_PROBLEM, failed)
