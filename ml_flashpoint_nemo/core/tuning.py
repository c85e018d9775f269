"""Defaults that depend on the machine."""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

MAX_DEFAULT_THREADS = 8
READ_METHODS = ("auto", "file", "map", "pread")


def default_copy_threads() -> int:
    """Threads per rank for copies and checksums: the CPUs this process may use, at most 8.

    FLASHPOINT_COPY_THREADS overrides it, e.g. to share cores among several ranks per node.
    """
    configured = os.environ.get("FLASHPOINT_COPY_THREADS")
    if configured:
        return max(1, int(configured))
    return max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))


def _configured_read_method() -> str:
    configured = os.environ.get("FLASHPOINT_READ_METHOD", "auto").strip().lower() or "auto"
    if configured not in READ_METHODS:
        # Not an error: loads run between collectives, where one rank must not fail alone.
        _warn_once(f"FLASHPOINT_READ_METHOD={configured!r} is not one of {', '.join(READ_METHODS)}; using auto. "
                   "Fix or unset the variable.")
        return "auto"
    return configured


def read_method() -> str:
    """How loads read object files: "auto" (the default), "map" or "pread" (the extension's names).

    auto maps files whose pages are huge (cheap to map) and preads the others;
    FLASHPOINT_READ_METHOD overrides it, e.g. pread to never map an object file (a
    mapped read takes a SIGBUS handler to survive a file truncated under it).
    FLASHPOINT_READ_METHOD=file reads files as auto does (see reads_pool_mappings).
    """
    configured = _configured_read_method()
    return "auto" if configured == "file" else configured


def reads_pool_mappings() -> bool:
    """Whether a load may copy from this process's pool buffer of the object instead of its file.

    Only with FLASHPOINT_READ_METHOD=auto (the default): file, map and pread always read
    the object file.
    """
    return _configured_read_method() == "auto"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)
