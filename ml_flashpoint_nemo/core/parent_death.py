"""Tying a helper process's life to the trainer that started it, so that none outlives a killed trainer.

An orphaned helper (our Manager, Megatron's persistent async-save worker) would keep its
memory, and on a GPU machine possibly device memory, across an NVRx in-job restart. Linux's
PR_SET_PDEATHSIG(SIGKILL) ends the helper with its parent, SIGKILL included; a watchdog
thread backs it up (and covers other systems): it exits when the parent's end of the
multiprocessing pipe closes or when the helper is re-parented.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCHDOG_POLL_S = 0.5

_tied_to: int | None = None  # the parent this process is tied to (once per process)


def tie_to_parent(parent_pid: int, *, watchdog_name: str = "flashpoint-parent-watchdog") -> None:
    """In a helper process: exit when `parent_pid` dies; at once if it is already gone. Idempotent.

    Linux sends the signal when the *thread* that started this process exits, so the parent
    must start helpers from a thread that lives as long as it needs them.
    """
    global _tied_to
    if _tied_to == parent_pid:
        return
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name=watchdog_name, daemon=True).start()
    _tied_to = parent_pid


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            logger.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable (%s); relying on the watchdog", exc)


def _watch_parent(parent_pid: int) -> None:
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    while os.getppid() == parent_pid:
        if sentinel is None:
            time.sleep(WATCHDOG_POLL_S)
            continue
        try:
            if multiprocessing.connection.wait([sentinel], timeout=WATCHDOG_POLL_S):
                break  # EOF: the parent's end of the pipe is closed
        except (OSError, ValueError):
            sentinel = None
    os._exit(1)  # nobody is left to shut us down or to use what we do
