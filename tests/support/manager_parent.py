"""Child process for tests/test_manager.py: starts the Manager, prints its pid, then waits to be killed.

Usage: python -m tests.support.manager_parent [--no-pdeathsig]
With --no-pdeathsig the server disarms PR_SET_PDEATHSIG, leaving only its watchdog thread.
"""

from __future__ import annotations

import sys
import time

from ml_flashpoint_nemo.core.sync_manager import start_manager_warmup
from tests.support import manager_hooks


def main() -> None:
    hook = manager_hooks.clear_parent_death_signal if "--no-pdeathsig" in sys.argv else None
    future = start_manager_warmup(timeout=60.0, _server_hook=hook)
    manager = future.result(what="the orphan test")
    shared = manager.dict()
    shared["ok"] = True
    print(f"MANAGER PID {future.pid}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
