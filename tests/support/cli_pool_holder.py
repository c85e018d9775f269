"""Holds rank R's buffer pool of BASE (its flock) like a live saver, until stdin closes.

    python -m tests.support.cli_pool_holder BASE RANK
Prints READY once the lock is held. Imports no torch, so it starts fast.
"""

from __future__ import annotations

import sys

from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.pool import BufferPool


def main() -> None:
    base, rank = sys.argv[1], int(sys.argv[2])
    pool = BufferPool(CheckpointLayout(base), rank)
    print("READY", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies)
    pool.close()


if __name__ == "__main__":
    main()
