"""What every `flashpoint` command shares: exit codes, base directory checks, pool locks, formatting.

Nothing here imports torch, so `flashpoint ls` and `flashpoint clean` start in a blink.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, TextIO

from ml_flashpoint_nemo.core.layout import (
    LOCK_NAME,
    POOL_DIR,
    VERSION_DIR_PREFIX,
    CheckpointLayout,
    is_buffer_name,
    rank_of_pool_dir,
    step_of_version_dir,
)

# Exit codes (documented in `flashpoint --help`).
EXIT_OK = 0
EXIT_CORRUPT = 1  # corruption found (verify, export)
EXIT_USAGE = 2  # bad arguments, missing/foreign base dir, no such step, nothing to verify
EXIT_BUSY = 3  # a live process holds a rank's pool lock (clean without --force)
EXIT_FAILED = 4  # any other failure (I/O error, out of space, ...)
EXIT_FORMAT = 5  # written in a checkpoint format this release cannot read (not corrupt: use the release that wrote it)

EXIT_CODES_HELP = """exit codes:
  0  success (verify: every byte intact)
  1  corruption found (verify, export): the message names the object, key or file
  2  usage error: bad arguments, BASE missing or not a flashpoint base directory,
     no such (committed) step, nothing to verify, export DEST not empty
  3  refused: a live process holds a rank's pool lock (clean; --force overrides)
  4  any other failure (I/O error, out of space, ...)
  5  unsupported format (verify, export): a file was written in a checkpoint format this
     release cannot read, e.g. by a newer release; it is not corrupt, read it with that release"""



class CliError(Exception):
    """A failure the command reports as one clear message and an exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def open_base(path: str) -> CheckpointLayout:
    """The layout of an existing flashpoint base directory; CliError (exit 2) if it is missing or foreign.

    An empty directory is an (empty) base. A non-empty one must hold pool/ or a step-<N>/ directory.
    """
    base = Path(path)
    if not base.exists():
        raise CliError(f"base directory {base} does not exist")
    if not base.is_dir():
        raise CliError(f"{base} is not a directory; BASE is a flashpoint base directory (e.g. /dev/shm/<job>)")
    try:
        names = os.listdir(base)
    except OSError as exc:
        raise CliError(f"cannot list {base}: {exc.strerror}", EXIT_FAILED) from None
    if names and POOL_DIR not in names and not any(step_of_version_dir(n) is not None for n in names):
        raise CliError(
            f"{base} is not a flashpoint base directory: it holds neither pool/ nor step-<N>/ directories"
        )
    return CheckpointLayout(base)


def parse_step(text: str) -> int:
    """A step given on the command line: N or step-N."""
    raw = text.removeprefix(VERSION_DIR_PREFIX)
    if not raw.isdigit():
        raise CliError(f"STEP must be a non-negative integer (or step-<N>), got {text!r}")
    return int(raw)


# --- pool ------------------------------------------------------------------------------------


@dataclass
class PoolRank:
    rank: int
    directory: Path
    buffers: int
    nbytes: int
    lock_holder: int | None  # pid of the live process holding the lock (0: held, pid unknown)
    lock_known: bool  # False when the lock state could not be determined

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "path": str(self.directory),
            "free_buffers": self.buffers,
            "nbytes": self.nbytes,  # allocated in the filesystem
            "locked": (self.lock_holder is not None) if self.lock_known else None,
            "holder_pid": self.lock_holder or None,
        }


def pool_ranks(layout: CheckpointLayout) -> list[tuple[int, Path]]:
    pool = layout.pool_root
    try:
        names = os.listdir(pool)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(rank, pool / n) for n in names if (rank := rank_of_pool_dir(n)) is not None]
    return sorted(found)


def scan_pool(layout: CheckpointLayout) -> list[PoolRank]:
    """Every rank's pool: free buffers, their bytes, and who holds its lock (read passively from /proc/locks)."""
    held = _proc_flocks()
    ranks = []
    for rank, directory in pool_ranks(layout):
        count = nbytes = 0
        try:
            entries = list(os.scandir(directory))
        except OSError:
            entries = []
        for entry in entries:
            if is_buffer_name(entry.name):
                try:
                    st = entry.stat(follow_symlinks=False)
                    nbytes += st.st_blocks * 512
                    count += 1
                except FileNotFoundError:
                    continue
        holder: int | None = None
        known = held is not None
        try:
            st = os.stat(directory / LOCK_NAME)
            if held is not None:
                holder = held.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
        except FileNotFoundError:
            pass
        ranks.append(PoolRank(rank, directory, count, nbytes, holder, known))
    return ranks


@dataclass
class ReplicaSpares:
    """Files of retired replicas kept so received replicas reuse their pages (never checkpoint objects)."""

    directory: Path
    files: int
    nbytes: int  # allocated in the filesystem

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.directory), "files": self.files, "nbytes": self.nbytes}


def scan_replica_spares(layout: CheckpointLayout) -> ReplicaSpares:
    """The replica spare directory's plain files and the memory they hold (zero when it does not exist)."""
    directory = layout.replica_spares_dir
    files = nbytes = 0
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False):
                nbytes += entry.stat(follow_symlinks=False).st_blocks * 512
                files += 1
        except FileNotFoundError:
            continue  # taken by a transfer meanwhile
    return ReplicaSpares(directory, files, nbytes)


def _proc_flocks() -> dict[tuple[int, int, int], int] | None:
    """{(major, minor, inode): pid} of every granted flock, from /proc/locks; None if unreadable.

    Reading /proc/locks is passive: unlike a trial flock it can never make a saver that starts at
    the same moment fail to take its pool.
    """
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.readlines()
    except OSError:
        return None
    held = {}
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or "->" in fields or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            held[(int(major, 16), int(minor, 16), int(inode))] = max(int(fields[4]), 0)
        except ValueError:
            continue
    return held


class PoolLocks:
    """Take every rank's pool lock without blocking, and hold them; reports the ranks held by live processes."""

    def __init__(self, layout: CheckpointLayout) -> None:
        self.layout = layout
        self.fds: list[int] = []
        self.busy: list[tuple[int, int | None]] = []  # (rank, holder pid if known)

    def acquire(self) -> "PoolLocks":
        held = _proc_flocks() or {}
        for rank, directory in pool_ranks(self.layout):
            path = directory / LOCK_NAME
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # no process ever took this pool
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                st = os.stat(path)
                self.busy.append((rank, held.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)) or None))
                continue
            self.fds.append(fd)
        return self

    def release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())  # closing the descriptor drops its flock

    def __enter__(self) -> "PoolLocks":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# --- formatting --------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


INVALID_TIME = "invalid"


def local_time(unix: float) -> time.struct_time | None:
    """unix as local time, or None when it is no time at all (NaN, infinite, beyond the platform's range).

    A commit record's created_unix is read from a file: a NaN or a number too large to be a
    date must print as invalid, not end the listing.
    """
    if not math.isfinite(unix):
        return None
    try:
        return time.localtime(unix)
    except (OverflowError, OSError, ValueError):
        return None


def valid_time(unix: float | None) -> float | None:
    """unix when it is a time local_time can show, else None (what JSON output carries instead of NaN)."""
    return unix if unix is not None and local_time(unix) is not None else None


def format_time(unix: float | None) -> str:
    if unix is None:
        return "-"
    when = local_time(unix)
    return INVALID_TIME if when is None else time.strftime("%Y-%m-%d %H:%M:%S", when)


def iso_time(unix: float | None) -> str | None:
    if unix is None:
        return None
    when = local_time(unix)
    return None if when is None else time.strftime("%Y-%m-%dT%H:%M:%S%z", when)


def compact_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "-"
    parts, start, prev = [], ordered[0], ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(parts)


def print_table(rows: list[list[str]], out: TextIO | None = None) -> None:
    """Rows in aligned columns, to out or the sys.stdout of the moment (so redirections of it apply)."""
    out = out or sys.stdout
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")


def print_json(document: Any, out: TextIO | None = None) -> None:
    """Strict JSON: a NaN or infinity raises here instead of printing a token JSON parsers refuse."""
    out = out or sys.stdout
    out.write(json.dumps(document, indent=2, sort_keys=False, allow_nan=False) + "\n")
