"""Megatron AsyncCallsQueue workers: a lean persistent worker started early, and stopping workers without collectives.

Megatron spawns the persistent worker at the first save, so the first version waits seconds
for the worker's interpreter to boot (importing torch and Megatron), and the worker is tied
to the trainer only once it runs a job of ours. PersistentWorkerQueue starts it at trainer
set-up, from the main thread: it boots while the model is built, dies with the trainer from
the start, does not re-run the training script's top level, and saves made before it is up
fork a worker each instead of waiting. Its worker runs core/save_worker.py's loop, which
imports neither torch nor Megatron (about 0.1 s of CPU to boot instead of ~3.5 s, which a
restart on a busy host paid in its restore and first steps): the calls it is sent carry only
the function and its arguments (LeanPersistentCaller), not Megatron's AsyncRequest.

Megatron's own ``AsyncCallsQueue.close(abort=True)`` stops a persistent worker but leaves
the forked worker of every unfinalized temporal call running, and both of Megatron's
callers log ``torch.distributed.get_rank()`` while closing, which raises once an abort has
destroyed the process group. A restart in the same process (NVRx in-process restart) and a
teardown after a failure need the workers gone regardless, so this stops them directly.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
import multiprocessing.synchronize
import os
from typing import Any, Callable

import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)

from ml_flashpoint_nemo.core import exits
from ml_flashpoint_nemo.core.save_worker import SaveCall, serve
from ml_flashpoint_nemo.core.sync_manager import main_module_not_reimported

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 5.0
EXIT_GRACE_S = 1.0  # at the process's exit an idle worker gets this long to leave before SIGKILL


class LeanPersistentCaller(PersistentAsyncCaller):
    """Megatron's persistent caller, whose worker (core/save_worker.py) needs no Megatron type to unpickle a call.

    It only sends calls to a worker that PersistentWorkerQueue started; it never starts one.
    """

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Queue the call for the worker, even one without a function (a rank whose staging failed).

        Megatron's caller skips a call without a function, yet still counts it in flight: the worker
        never completes it, the call waits out worker_timeout_s, and the next call's completion is taken
        for it. Here the worker completes it in order without running anything. A worker stopped
        meanwhile (an abort from another thread) gets nothing: the call then reads as ended without
        a report and its save fails on every rank, as a save on a dead worker does.
        """
        if async_req.preload_fn is not None:  # the same on every rank: our requests never carry one
            raise TypeError(f"the flashpoint save worker runs preload-free calls only, not {async_req!r}")
        if self.process is None:
            return
        self.queue.put(SaveCall(async_req.call_idx, async_req.async_fn, tuple(async_req.async_fn_args or ()),
                                dict(async_req.async_fn_kwargs or {})))


class PersistentWorkerQueue(AsyncCallsQueue):
    """Megatron's AsyncCallsQueue(persistent=True), with the worker started ahead of its first save.

    Until the worker has booted, each save forks a worker of its own (Megatron's temporal
    caller), so no save waits for the boot; after that every save goes to the persistent
    worker, which costs the trainer no fork. Finalization stays in scheduling order: Megatron
    asks each call's own caller whether it is done, oldest call first.
    """

    persistent_caller: PersistentAsyncCaller | None  # Megatron's attribute (set by its __init__)

    def __init__(self, *, _boot_hook: Callable[[], Any] | None = None) -> None:
        """`_boot_hook` is for tests only: a picklable module-level callable the worker runs as it boots."""
        super().__init__(persistent=True)
        self._started: tuple[PersistentAsyncCaller, multiprocessing.synchronize.Event] | None = None  # (the caller we started, the event its worker sets when up)
        self._boot_failure: str | None = None  # set once a worker died before it was up: no more tries
        self._boot_hook = _boot_hook
        stop_workers_at_exit(self)

    def start_worker(self) -> bool:
        """Spawn the persistent worker now if none runs; True if it started one.

        Call it from the thread that lives as long as the trainer (the main thread): the worker
        gets SIGKILL when the thread that started it ends. Costs the caller a few milliseconds;
        the boot (about 0.1 s of CPU: no torch, no Megatron) happens in the worker.
        """
        caller = self.persistent_caller
        if caller is not None and self._started is not None and self._started[0] is caller and caller.process:
            return False
        caller = self.persistent_caller = LeanPersistentCaller()
        context = multiprocessing.get_context("spawn")
        ready = context.Event()
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        caller.process = context.Process(
            target=serve, name=f"flashpoint-save-worker-{rank}",
            args=(os.getpid(), ready, self._boot_hook, rank, caller.queue, caller.preload_q, caller.comp_q,
                  logger.getEffectiveLevel()),
        )
        with main_module_not_reimported():  # the worker needs nothing of the training script
            caller.process.start()
        self._started = (caller, ready)
        logger.debug("Persistent async-save worker of rank %d started (pid %d)", rank, caller.process.pid)
        return True

    def worker_ready(self, timeout: float | None = 0.0) -> bool:
        """Whether the persistent worker is up, waiting up to timeout seconds (None: without bound)."""
        if self._started is None or self._started[0] is not self.persistent_caller:
            return False
        return bool(self._started[1].wait(timeout))

    def close(self, abort: bool = False) -> None:
        """Megatron's close (finalizing first unless abort), but stopping the workers cannot wait forever on a
        worker that died or never booted: Megatron's own joins the worker's queue, which only a live worker
        empties. Saves already given to a dead worker still block the finalize (Megatron's); the NeMo IO
        bounds that with its own finalize and closes with stop_async_workers."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
        stop_async_workers(self)

    def _get_async_caller(self) -> PersistentAsyncCaller | TemporalAsyncCaller:
        if self.worker_ready():
            return self.persistent_caller
        if self._boot_failure is None:
            self._boot_failure = self._died_booting()
            if self._boot_failure is None:
                self.start_worker()  # no-op while it boots; again after stop_async_workers dropped it
            else:
                logger.warning("%s; every async save forks a worker of its own from now on", self._boot_failure)
        return TemporalAsyncCaller()

    def _died_booting(self) -> str | None:
        process = self._started[0].process if self._started is not None else None
        if process is None or process.is_alive() or self.worker_ready():
            return None
        return f"The persistent async-save worker (pid {process.pid}) exited with code {process.exitcode} while booting"


def stop_workers_at_exit(queue: AsyncCallsQueue) -> None:
    """Stop `queue`'s workers when the process exits, so that none keeps it in multiprocessing's exit join.

    Megatron's workers are not daemons: one that never booted or is stuck would otherwise hold a
    failing trainer forever (see core/exits.py).
    """
    exits.stop_at_exit(queue, _stop_at_exit, f"async-save workers of {type(queue).__name__} at {id(queue):#x}")


def _stop_at_exit(queue: AsyncCallsQueue) -> None:
    stop_async_workers(queue, grace_s=EXIT_GRACE_S)


def stop_async_workers(queue: AsyncCallsQueue, *, grace_s: float = DEFAULT_GRACE_S) -> int:
    """Kill the workers of `queue`'s unfinalized calls, stop its persistent worker, drop those calls.

    Saves still in flight are lost (they were never committed). An idle persistent worker is
    asked to exit and killed only if it does not within `grace_s`; one still booting (it reads
    no message yet) is killed at once. Runs no collective and no torch.distributed call, so it
    works after an abort, at exit and from another thread. Returns the number of worker
    processes that were still running.
    """
    booting = isinstance(queue, PersistentWorkerQueue) and not queue.worker_ready()
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
        stopped += _stop_persistent(persistent, kill=bool(calls) or booting, grace_s=grace_s)
    if calls:
        logger.info("Dropped %d unfinalized async save(s); %d worker process(es) stopped", len(calls), stopped)
    return stopped


def dead_persistent_worker(queue: AsyncCallsQueue) -> str | None:
    """Why `queue`'s persistent worker can no longer finish its calls (None: it can, or it has none).

    Megatron never checks: its blocking finalize polls for the dead worker's completions forever.
    """
    caller = queue.persistent_caller
    process = getattr(caller, "process", None)
    if process is None or process.is_alive() or not any(call.async_caller is caller for call in queue.async_calls):
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
    caller.close = _nothing_left_to_close
    return stopped


def _nothing_left_to_close(abort: bool = False) -> None:
    return None


def _end_process(process: multiprocessing.process.BaseProcess | None, *, kill: bool, grace_s: float) -> int:
    """Join (after SIGKILL if `kill`) and release a multiprocessing process; 1 if it was still running."""
    if process is None:
        return 0
    try:
        running = process.is_alive()
    except ValueError:  # its process object was closed already: nothing is left to end or release
        return 0
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
