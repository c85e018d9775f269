"""Closing flashpoint resources for a restart, on real gloo ranks, for tests/test_lifecycle.py.

Each scenario prints one JSON line ("RESULT {...}") for the test to assert on.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

cpu_shims.install_for_checkpointing()

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest  # noqa: E402

from ml_flashpoint_nemo.core.layout import CheckpointLayout  # noqa: E402
from ml_flashpoint_nemo.core.lifecycle import live_resources  # noqa: E402
from ml_flashpoint_nemo.core.pool import BufferPool  # noqa: E402
from ml_flashpoint_nemo.core.versions import committed_steps  # noqa: E402
from ml_flashpoint_nemo.megatron import FlashpointLoadStrategy, FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.megatron.async_workers import stop_async_workers  # noqa: E402
from tests.support.megatron_scenarios import check_loaded, sharded_state  # noqa: E402
from tests.support.multiproc import scenario_main  # noqa: E402

DEADLINE_S = 60.0  # every wait below polls its condition, and fails after this long


def wait_for(condition: Any, what: str, timeout: float = DEADLINE_S) -> None:
    """Poll condition() until it is true; RuntimeError naming what did not happen within timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


def thread_is_in(thread_id: int, function: str) -> bool:
    """True while the thread's Python stack holds a frame of the named function."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def report(**values: Any) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def alive(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def save(strategy: FlashpointSaveStrategy, base: str, step: int) -> None:
    """One async save through Megatron's AsyncCallsQueue, finalized (collective)."""
    queue = AsyncCallsQueue()
    Path(base, f"step-{step}").mkdir(parents=True, exist_ok=True)  # Megatron saves into an existing directory
    request = dist_checkpointing.save(sharded_state(step), f"{base}/step-{step}", sharded_strategy=strategy,
                                      async_sharded_save=True)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)


def close_takes_only_its_own_pools(params: dict[str, Any]) -> None:
    """Two strategies of one process save to two bases; closing one (twice) leaves the other's pool open."""
    first, second = FlashpointSaveStrategy(), FlashpointSaveStrategy()
    save(first, f"{params['base']}/first", 1)
    save(second, f"{params['base']}/second", 1)
    first.close()
    first.close()  # a late second close, as the IO's after an abort's
    pools = [what for what in live_resources() if what.startswith("buffer pool")]
    save(second, f"{params['base']}/second", 2)  # its pool was never closed under it
    second.close()
    report(pools_after_first_close=pools, live_at_end=live_resources())


def abort_while_blocked(params: dict[str, Any]) -> None:
    """Rank 0's main thread waits in an all_reduce while another thread runs FlashpointAbort, as NVRx's monitor
    thread does; then both ranks save and load again in the same processes."""
    from nvidia_resiliency_ext.inprocess.state import State

    from ml_flashpoint_nemo import FlashpointAbort

    base, rank = params["base"], dist.get_rank()
    strategy = FlashpointSaveStrategy()
    save(strategy, base, 1)  # the strategy now holds its Manager and (through the writer) a buffer pool
    manager_pid = strategy.manager_future.pid
    before = live_resources()
    outcome: dict[str, Any] = {}
    returned = threading.Event()
    aborted = Path(base) / "rank-0-aborted"
    main_thread = threading.get_ident()

    def monitor() -> None:
        wait_for(lambda: thread_is_in(main_thread, "all_reduce"), "rank 0's main thread entering the all_reduce")
        outcome["main_thread_blocked"] = not returned.is_set()
        started = time.monotonic()
        state = State(rank=rank, world_size=dist.get_world_size()).freeze()
        outcome["state_returned"] = FlashpointAbort(timeout=10.0)(state) is state
        outcome["abort_s"] = time.monotonic() - started
        outcome["live_after"] = live_resources()
        outcome["manager_alive_after"] = alive(manager_pid)
        aborted.touch()

    if rank == 0:
        thread = threading.Thread(target=monitor)
        thread.start()
    else:  # keeps rank 0's main thread waiting in the all_reduce until its abort is done
        wait_for(aborted.exists, "rank 0's abort")
    dist.all_reduce(torch.ones(1))
    returned.set()
    if rank == 0:
        thread.join()
    else:
        strategy.close()
    # The pool lock was released: this process can take its rank's pool again, and save and load afresh.
    BufferPool(CheckpointLayout(base), rank).close()
    again = FlashpointSaveStrategy()
    save(again, base, 2)
    loaded = dist_checkpointing.load(sharded_state(2, zeros=True), f"{base}/step-2",
                                     sharded_strategy=FlashpointLoadStrategy())
    check_loaded(loaded, 2)
    again.close()
    report(rank=rank, before=before, manager_pid=manager_pid, committed=committed_steps(CheckpointLayout(base)),
           live_at_end=live_resources(), **outcome)


def sleep_then_touch(started: str, path: str, seconds: float) -> None:
    """A background 'save' that is still running when the workers are stopped; it marks its start."""
    Path(started).touch()
    time.sleep(seconds)
    Path(path).touch()


def stop_workers(params: dict[str, Any]) -> None:
    """An unfinalized async call of a temporal or persistent AsyncCallsQueue is stopped after the process group
    is gone (as after an abort): no collective, no torch.distributed call, nothing left running."""
    marker = Path(params["base"]) / "worker-finished"
    started = Path(params["base"]) / "worker-started"
    Path(params["base"]).mkdir(parents=True, exist_ok=True)
    queue = AsyncCallsQueue(persistent=params["persistent"])
    queue.schedule_async_request(AsyncRequest(sleep_then_touch, (str(started), str(marker), 30.0), []))
    wait_for(started.exists, "the async call starting in its worker")  # a spawned persistent one imports torch first
    workers = [child.pid for child in psutil.Process().children() if "resource_tracker" not in " ".join(child.cmdline())]
    dist.destroy_process_group()
    unraisable: list[str] = []
    sys.unraisablehook = lambda hook_args: unraisable.append(f"{hook_args.exc_type.__name__}: {hook_args.exc_value}")
    stopping = time.monotonic()
    stopped = stop_async_workers(queue, grace_s=5.0)
    seconds = time.monotonic() - stopping
    del queue
    gc.collect()  # Megatron's callers close themselves in __del__
    report(workers=workers, stopped=stopped, seconds=seconds, workers_alive=[pid for pid in workers if alive(pid)],
           marker_written=marker.exists(), unraisable=unraisable)
    dist.init_process_group("gloo")  # scenario_main destroys it


if __name__ == "__main__":
    scenario_main({"abort_while_blocked": abort_while_blocked, "stop_workers": stop_workers,
                   "close_takes_only_its_own_pools": close_takes_only_its_own_pools})
