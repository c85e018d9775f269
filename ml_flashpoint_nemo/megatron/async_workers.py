"""Stopping the worker processes of a Megatron AsyncCallsQueue without collectives.

Megatron's own ``AsyncCallsQueue.close(abort=True)`` stops a persistent worker but leaves
the forked worker of every unfinalized temporal call running, and both of Megatron's
callers log ``torch.distributed.get_rank()`` while closing, which raises once an abort has
destroyed the process group. A restart in the same process (NVRx in-process restart) and a
teardown after a failure need the workers gone regardless, so this stops them directly.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, PersistentAsyncCaller

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0


def stop_async_workers(queue: AsyncCallsQueue, *, grace_s: float = DEFAULT_GRACE_S) -> int:
    """Kill the workers of `queue`'s unfinalized calls, stop its persistent worker, drop those calls.

    Saves still in flight are lost (they were never committed). An idle persistent worker is
    asked to exit and killed only if it does not within `grace_s`. Runs no collective and no
    torch.distributed call, so it works after an abort and from another thread. Returns the
    number of worker processes that were still running.
    """
    calls = list(queue.async_calls)
    queue.async_calls.clear()
    stopped = 0
    for call in calls:
        caller = call.async_caller
        if isinstance(caller, PersistentAsyncCaller):
            continue  # one process for every call, stopped below
        process, caller.process = getattr(caller, "process", None), None
        stopped += _end_process(process, kill=True, grace_s=grace_s)
    persistent, queue.persistent_caller = queue.persistent_caller, None
    if isinstance(persistent, PersistentAsyncCaller):
        stopped += _stop_persistent(persistent, kill=bool(calls), grace_s=grace_s)
    if calls:
        logger.info("Dropped %d unfinalized async save(s); %d worker process(es) stopped", len(calls), stopped)
    return stopped


def dead_persistent_worker(queue: AsyncCallsQueue) -> str | None:
    """Why `queue`'s persistent worker can no longer finish its calls (None: it can, or there is none).

    Megatron never checks: its blocking finalize polls for the dead worker's completions forever.
    """
    caller = queue.persistent_caller
    process = getattr(caller, "process", None)
    if process is None or process.is_alive():
        return None
    return f"its persistent save worker (pid {process.pid}) exited with code {process.exitcode}"


def _stop_persistent(caller: PersistentAsyncCaller, *, kill: bool, grace_s: float) -> int:
    process, caller.process = caller.process, None
    if process is not None and not kill and process.is_alive():
        try:
            caller.queue.put("DONE")  # its loop's exit message
        except (OSError, ValueError):
            kill = True
    stopped = _end_process(process, kill=kill, grace_s=grace_s)
    for channel in (caller.queue, caller.preload_q, caller.comp_q):
        channel.cancel_join_thread()  # the reader may be dead: never block on flushing to it
        channel.close()
    # Its __del__ calls close(), which logs torch.distributed.get_rank() and so raises without a process group;
    # there is nothing left for it to close.
    caller.close = _nothing_left_to_close  # type: ignore[method-assign]
    return stopped


def _nothing_left_to_close(abort: bool = False) -> None:
    return None


def _end_process(process: Any, *, kill: bool, grace_s: float) -> int:
    """Join (after SIGKILL if `kill`) and release a multiprocessing process; 1 if it was still running."""
    if process is None:
        return 0
    running = process.is_alive()
    if running and kill:
        process.kill()
    process.join(grace_s)
    if process.is_alive():  # asked to exit but did not
        process.kill()
        process.join(grace_s)
    try:
        process.close()  # its sentinel pipe
    except ValueError:
        asked = "SIGKILL" if kill else "being asked to exit (and SIGKILL after %.1f s)" % grace_s
        logger.warning("Async save worker %s did not exit within %.1f s of %s", process.pid, 2 * grace_s, asked)
    return int(running)
