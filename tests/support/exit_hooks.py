"""Boot hooks for the persistent save worker in tests, module-level so that spawn pickles them by name (not from
__main__)."""

from __future__ import annotations

import os
import signal
import time


def hang_ignoring_sigterm() -> None:
    """A worker boot that never ends; SIGTERM (what multiprocessing sends daemons at exit) does not end it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


def boot_once_path_exists(path: str, timeout_s: float = 120.0) -> None:
    """A worker boot held until the test creates `path` (polled, bounded): saves meanwhile meet a booting worker."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
