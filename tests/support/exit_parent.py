"""Child process for tests/test_exits.py: a trainer whose helper never boots raises, and must then exit.

Usage: python -m tests.support.exit_parent worker|manager
  worker:  the persistent save worker hangs while booting (ignoring SIGTERM); the rank gives up on it
  manager: the Manager's server hangs before it serves; the rank raises without waiting for it
"""

from __future__ import annotations

import sys
import time

from tests.support import exit_hooks, manager_hooks


def main() -> None:
    if sys.argv[1] == "worker":
        from ml_flashpoint_nemo.megatron.async_workers import PersistentWorkerQueue

        queue = PersistentWorkerQueue(_boot_hook=exit_hooks.hang_ignoring_sigterm)
        queue.start_worker()
        print(f"HELPER PID {queue.persistent_caller.process.pid}", flush=True)
        if not queue.worker_ready(timeout=3.0) and queue.persistent_caller.process.is_alive():
            raise TimeoutError("the persistent save worker was not up within 3 s")
    else:
        from ml_flashpoint_nemo.core.sync_manager import start_manager_warmup
        future = start_manager_warmup(timeout=90.0, _server_hook=manager_hooks.hang)
        give_up = time.monotonic() + 60
        while future.pid is None and time.monotonic() < give_up:
            time.sleep(0.01)
        print(f"HELPER PID {future.pid}", flush=True)
        raise RuntimeError("the trainer failed while its Manager was starting")


if __name__ == "__main__":
    main()
