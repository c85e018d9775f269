"""Walking and removing directory trees that a peer or a crash may have shaped, iteratively.

A version directory can hold whatever a peer pushed or an interrupted write left: nested
directories thousands deep, paths longer than PATH_MAX, symlinks, entries that vanish meanwhile.
`os.walk` and `shutil.rmtree` recurse (RecursionError past ~1000 levels on Python 3.11) and
use full paths (ENAMETOOLONG past 4 KiB). These helpers never recurse, work through directory
descriptors, never follow symlinks, and skip what they cannot handle instead of raising.
"""

from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path
from typing import Callable

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str | os.PathLike[str]) -> bool:
    """Remove `path` (a file, a symlink or a directory tree) as far as possible; True if it is gone.

    Every subdirectory is first moved up to be a direct child of `path` (a rename on the same
    file system), so the walk never holds more than two directories open and never goes deep.
    """
    root = Path(path)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(root)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return False
    try:
        counter = itertools.count()
        pending = [name for name in _names(root_fd) if _is_dir(root_fd, name)]
        _empty_files(root_fd, root_fd, pending, counter)
        while pending:
            name = pending.pop()
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
            except OSError:
                continue
            try:
                _empty_files(fd, root_fd, pending, counter)
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=root_fd)
            except OSError:
                pass
    finally:
        os.close(root_fd)
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def tree_bytes(path: str | os.PathLike[str], size_of: Callable[[os.stat_result], int] = lambda s: s.st_size) -> int:
    """Sum of size_of(lstat) over the regular files under `path`: an estimate for reports.

    Iterative; what cannot be read (including anything deeper than PATH_MAX allows) counts 0.
    """
    total = 0
    stack = [os.fspath(path)]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
                    elif stat.S_ISREG(st.st_mode):
                        total += size_of(st)
        except OSError:
            continue
    return total


def _names(dir_fd: int) -> list[str]:
    try:
        return os.listdir(dir_fd)
    except OSError:
        return []


def _is_dir(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _empty_files(fd: int, root_fd: int, pending: list[str], counter: "itertools.count[int]") -> None:
    """Unlink the non-directories in fd; move its subdirectories up into root_fd (queued in pending)."""
    for name in _names(fd):
        if _is_dir(fd, name):
            if fd == root_fd:
                continue  # already queued by the caller
            hoisted = f".removing-{os.getpid()}-{next(counter)}"
            try:
                os.rename(name, hoisted, src_dir_fd=fd, dst_dir_fd=root_fd)
            except OSError:
                continue
            pending.append(hoisted)
        else:
            try:
                os.unlink(name, dir_fd=fd)
            except OSError:
                pass
