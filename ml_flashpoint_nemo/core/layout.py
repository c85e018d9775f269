"""Where things live under a base directory (format v1 layout, specified in docs/format.md).

    <base>/pool/rank-<R:05d>/.lock             flock of the live process that saves as rank R
    <base>/pool/rank-<R:05d>/buf-<hex>         free buffers of rank R, reused across saves
    <base>/pool/replica-spares/spare-<hex>     files of retired replicas, overwritten by the next received one
    <base>/step-<N>/rank-<R:05d>-<i>.fpo       object i written by rank R for version N
    <base>/step-<N>/COMMIT                     commit record; without it version N does not exist
    <base>/step-<N>/.drain-hold-<R>            rank R is copying version N to durable storage: not retired yet
    <base>/step-<N>/.<name>.tmp-<pid>-<hex>    a file being written atomically (ignored by readers)
    <base>/step-<N>/.metadata                  DCP's metadata (DCP and Megatron adapters)
    <base>/step-<N>/metadata.json, common.pt   Megatron's config and common state (Megatron adapter)

This module owns these names: every other module builds and recognises them through it
(tests/test_layering.py checks that no literal of them appears elsewhere).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from ml_flashpoint_nemo.errors import BaseDirError

logger = logging.getLogger(__name__)

COMMIT_NAME = "COMMIT"
POOL_DIR = "pool"
REPLICA_SPARES = f"{POOL_DIR}/replica-spares"  # relative to the base directory (the transfer server's form)
OBJECT_SUFFIX = ".fpo"
LOCK_NAME = ".lock"
FETCH_LOCK_NAME = ".fetch.lock"  # in a node's base directory: one rank of the node at a time checks or fetches an object
HOLD_PREFIX = ".drain-hold-"
BUFFER_PREFIX = "buf-"
SPARE_PREFIX = "spare-"
VERSION_DIR_PREFIX = "step-"
DCP_METADATA_NAME = ".metadata"
# Megatron's names (megatron.core.dist_checkpointing CONFIG_FNAME and COMMON_STATE_FNAME; the Megatron
# adapter's tests check they agree), known here so that core and the CLI need no Megatron.
MEGATRON_CONFIG_NAME = "metadata.json"
MEGATRON_COMMON_NAME = "common.pt"
_TEMPORARY_MARK = ".tmp-"
# The names above as str.format patterns: the transfer server's policy (replication) matches peers'
# paths against exactly these, so a version directory or an object has one name, this one.
VERSION_DIR_PATTERN = VERSION_DIR_PREFIX + "{step}"
OBJECT_NAME_PATTERN = "rank-{rank:05d}-{index}" + OBJECT_SUFFIX
# The version-level files a peer may fetch from a version directory (besides objects): the commit
# record and the adapters' files. Peers never push them: every node writes its own.
PEER_VERSION_FILES = (COMMIT_NAME, DCP_METADATA_NAME, MEGATRON_CONFIG_NAME, MEGATRON_COMMON_NAME)
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)", re.ASCII)  # canonical: version_dir_name(N) and nothing else
_POOL_RANK_DIR = re.compile(r"rank-(\d+)", re.ASCII)
_OBJECT_NAME = re.compile(r"^rank-(\d+)-(\d+)\.fpo$")
_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}


def version_dir_name(step: int) -> str:
    """The directory name of version `step` (decimal, no padding)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return VERSION_DIR_PATTERN.format(step=step)


def step_of_version_dir(name: str) -> int | None:
    """The step a version directory name stands for, or None (also for non-canonical names like step-07)."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def version_relpath(step: int, name: str) -> str:
    """A version-level file or object relative to the base directory (the transfer server's form)."""
    return f"{version_dir_name(step)}/{name}"


def pool_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def rank_of_pool_dir(name: str) -> int | None:
    match = _POOL_RANK_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def buffer_name() -> str:
    """A fresh name for a free pool buffer."""
    return f"{BUFFER_PREFIX}{uuid.uuid4().hex}"


def is_buffer_name(name: str) -> bool:
    return name.startswith(BUFFER_PREFIX)


def spare_name() -> str:
    """A fresh name for a retired replica kept in the replica spare directory."""
    return f"{SPARE_PREFIX}{uuid.uuid4().hex}"


def temporary_name(name: str) -> str:
    """Where a file `name` is written before it is renamed into place: hidden, unique to this process."""
    return f".{name.lstrip('.')}{_TEMPORARY_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_temporary_name(name: str) -> bool:
    """A file being written atomically (see temporary_name): ignored by readers."""
    return name.startswith(".") and _TEMPORARY_MARK in name


def object_name(rank: int, index: int = 0) -> str:
    return OBJECT_NAME_PATTERN.format(rank=rank, index=index)


def rank_of_object(name: str) -> int | None:
    match = _OBJECT_NAME.match(name)
    return int(match.group(1)) if match else None


def version_file_name_problem(name: str) -> str | None:
    """Why name cannot be a version-level file (.metadata, common.pt, ...) of a version directory, or None.

    Such names come from commit records, which a peer may have sent: each must stay a plain
    file inside the version directory and never alias the commit record or an object.
    """
    if not name or len(name.encode("utf-8", "surrogatepass")) > 255 or "/" in name or "\0" in name:
        return "it must be a plain file name of 1 to 255 bytes"
    if name in (".", "..", COMMIT_NAME) or name.startswith(f".{COMMIT_NAME}.tmp") or is_temporary_name(name) \
            or _OBJECT_NAME.match(name):
        return "it names a directory, the commit record, a file being written or an object"
    return None


@dataclass(frozen=True)
class CheckpointLayout:
    """Paths of one job's RAM checkpoints; the base directory is the job's own."""

    base_dir: Path

    def __init__(self, base_dir: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "base_dir", Path(base_dir).absolute())

    def pool_dir(self, rank: int) -> Path:
        return self.pool_root / pool_dir_name(rank)

    @property
    def pool_root(self) -> Path:
        """The directory of every rank's pool (and of the replica spares)."""
        return self.base_dir / POOL_DIR

    @property
    def replica_spares_dir(self) -> Path:
        """Spare files for received replicas: never checkpoint objects, only warm tmpfs pages to reuse."""
        return self.base_dir / REPLICA_SPARES

    def version_dir(self, step: int) -> Path:
        return self.base_dir / version_dir_name(step)

    def commit_path(self, step: int) -> Path:
        return self.version_dir(step) / COMMIT_NAME

    def object_path(self, step: int, name: str) -> Path:
        return self.version_dir(step) / name

    def hold_path(self, step: int, rank: int) -> Path:
        """The file that keeps version `step` from being retired while rank `rank` drains it."""
        return self.version_dir(step) / f"{HOLD_PREFIX}{rank}"

    def is_held(self, step: int) -> bool:
        try:
            return any(name.startswith(HOLD_PREFIX) for name in os.listdir(self.version_dir(step)))
        except FileNotFoundError:
            return False

    def version_steps(self) -> list[int]:
        """Steps of every version directory, committed or not, oldest first."""
        try:
            names = os.listdir(self.base_dir)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(step_of_version_dir, names) if s is not None)

    def ensure_private(self) -> None:
        """Raise BaseDirError when the base directory exists but is not private (not_private_problem)."""
        problem = not_private_problem(self.base_dir)
        if problem is not None:
            raise BaseDirError(problem)

    def is_committed(self, step: int) -> bool:
        return self.commit_path(step).is_file()

    def ensure_writable(self) -> None:
        """Create the base directory if needed (mode 0700) and check it is private and can hold checkpoints."""
        if self.base_dir.exists() and not self.base_dir.is_dir():
            raise BaseDirError(f"checkpoint base directory {self.base_dir} exists but is not a directory")
        try:
            self.base_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise BaseDirError(
                f"cannot create checkpoint base directory {self.base_dir}: {exc.strerror}. "
                "Pick a directory on a tmpfs you can write (e.g. under /dev/shm) or set FLASHPOINT_BASE_DIR."
            ) from exc
        self.ensure_private()
        if not os.access(self.base_dir, os.W_OK | os.X_OK):
            raise BaseDirError(
                f"checkpoint base directory {self.base_dir} is not writable by this process (uid {os.getuid()}). "
                "Fix its permissions or pick another directory."
            )
        fs_type = filesystem_type(self.base_dir)
        if fs_type not in _MEMORY_FILESYSTEMS:
            logger.warning(
                "Checkpoint base directory %s is on %s, not on a tmpfs: saves and loads will run at disk speed "
                "and checkpoints survive reboots. Use a directory under /dev/shm for RAM checkpoints.",
                self.base_dir,
                fs_type or "an unknown filesystem",
            )


def not_private_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why an existing directory is not private to this process's user (None: it is, or it does not exist).

    The rule ssh applies to ~/.ssh: anyone else who owns the base directory, or may write it,
    can plant a version that the next restart loads (and whose pickled parts run code).
    """
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot inspect checkpoint base directory {directory}: {exc.strerror}"
    me = os.geteuid()
    if st.st_uid != me:
        return (f"checkpoint base directory {directory} is owned by uid {st.st_uid}, not by this job's user (uid {me}), "
                f"so that user decides what a restart loads. Remove it, or take it over and check what it holds: "
                f"chown -R {me} {directory} && chmod 700 {directory}")
    if st.st_mode & 0o022:
        return (f"checkpoint base directory {directory} is writable by group or others (mode "
                f"{st.st_mode & 0o7777:04o}), so they can change what a restart loads. Run: chmod 700 {directory}")
    return unsafe_parent_problem(directory)


def unsafe_parent_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why a directory above the base lets another user replace the base (None: none does).

    Whoever owns a directory above the base, or may write it without the sticky bit, can rename
    the base away and put a directory of their own in its place. Directories of root and of this
    process's user are trusted; one that others may write needs the sticky bit (as /dev/shm and
    /tmp have). Both the path as given and its resolved form (symlinks followed) are checked.
    """
    me = os.geteuid()
    seen: set[str] = set()
    for path in (os.path.abspath(directory), os.path.realpath(directory)):
        parent = os.path.dirname(path)
        while parent not in seen:
            seen.add(parent)
            try:
                st = os.stat(parent)
            except OSError as exc:
                return (f"cannot inspect {parent}, a directory above checkpoint base directory {directory}: "
                        f"{exc.strerror}")
            if st.st_uid not in (0, me):
                return (f"{parent}, a directory above checkpoint base directory {directory}, is owned by uid "
                        f"{st.st_uid}, not by root or this job's user (uid {me}): that user can replace the base "
                        "directory and so decide what a restart loads. Put the base directory under a directory "
                        "of yours or root's (e.g. /dev/shm/<job>).")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                return (f"{parent}, a directory above checkpoint base directory {directory}, is writable by group "
                        f"or others without the sticky bit (mode {st.st_mode & 0o7777:04o}): they can replace the "
                        f"base directory and so decide what a restart loads. Run: chmod +t {parent} (or chmod "
                        f"go-w {parent}), or put the base directory elsewhere (e.g. under /dev/shm).")
            parent = os.path.dirname(parent)
    return None


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """Filesystem type of the mount holding path, from /proc/self/mounts (None if unknown)."""
    target = os.path.realpath(path)
    best, best_type = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, best_type = mount_point, fields[2]
    except OSError:
        return None
    return best_type
