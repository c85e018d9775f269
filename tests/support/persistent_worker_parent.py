"""Child process for tests/test_megatron.py: a 1-rank trainer with a persistent save worker; prints the
worker's pid, then waits to be SIGKILLed (the worker must not outlive it).

Usage: python -m tests.support.persistent_worker_parent BASE_DIR megatron|prestarted
  megatron:   Megatron's AsyncCallsQueue(persistent=True) spawned the worker, which ran one save
  prestarted: the NeMo IO's PersistentWorkerQueue started the worker, which is up and never ran a save
"""

from __future__ import annotations

import os
import sys
import time

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import torch.distributed as dist  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402

from ml_flashpoint_nemo.megatron import FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.megatron.async_workers import PersistentWorkerQueue  # noqa: E402
from tests.support.megatron_scenarios import save  # noqa: E402
from tests.support.multiproc import free_port  # noqa: E402


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    if sys.argv[2] == "megatron":
        queue = AsyncCallsQueue(persistent=True)
        save({"base": sys.argv[1]}, 1, queue, FlashpointSaveStrategy())  # scheduled and finalized: the worker ran it
    else:
        queue = PersistentWorkerQueue()
        queue.start_worker()
        assert queue.worker_ready(timeout=120)
    print(f"WORKER PID {queue.persistent_caller.process.pid}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
