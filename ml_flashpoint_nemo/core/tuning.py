"""Defaults that depend on the machine."""

from __future__ import annotations

import os

MAX_DEFAULT_THREADS = 8


def default_copy_threads() -> int:
    """Threads per rank for copies and checksums: the CPUs this process may use, at most 8.

    FLASHPOINT_COPY_THREADS overrides it, e.g. to share cores among several ranks per node.
    """
    configured = os.environ.get("FLASHPOINT_COPY_THREADS")
    if configured:
        return max(1, int(configured))
    return max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))
