"""Boot hooks for tests/test_exits.py, module-level so that spawn pickles them by name (not from __main__)."""

from __future__ import annotations

import signal
import time


def hang_ignoring_sigterm() -> None:
    """A worker boot that never ends; SIGTERM (what multiprocessing sends daemons at exit) does not end it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
