"""Server hooks for tests/test_manager.py: run inside the Manager's server process before it serves.

They are module-level so that spawn can pickle them by name.
"""

from __future__ import annotations

import ctypes
import time

PR_SET_PDEATHSIG = 1


def fail() -> None:
    raise RuntimeError("injected failure in the Manager server")


def hang() -> None:
    time.sleep(600)


def clear_parent_death_signal() -> None:
    """Disarm PR_SET_PDEATHSIG so that only the watchdog thread can end an orphaned server."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
