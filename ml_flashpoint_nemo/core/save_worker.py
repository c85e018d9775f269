"""The background side of an async RAM save: sealing a staged object and reporting the outcome, and the
persistent save worker's main loop.

Imports neither torch nor Megatron, so that the persistent worker (spawned at trainer set-up,
megatron/async_workers.py) boots in about 0.1 s of CPU instead of the ~3.5 s an interpreter
importing them took per rank, CPU that the restore and the first steps lost on a busy host.
The loop speaks the protocol of Megatron's persistent caller (its queues, "DONE", the call
index put on the completion queue) for the lean calls that megatron/async_workers.py sends.
"""

from __future__ import annotations

import logging
import multiprocessing.synchronize
import os
import queue
import sys
from typing import Any, Callable, NamedTuple

from ml_flashpoint_nemo.core.parent_death import tie_to_parent
from ml_flashpoint_nemo.core.seal import SealJob, seal_object

logger = logging.getLogger(__name__)

STOP = "DONE"  # the message that ends the loop (Megatron's persistent caller sends it too)


class SaveCall(NamedTuple):
    """One background call, as it travels to the worker: only picklable plain parts, no Megatron type."""

    call_idx: int
    fn: Callable[..., Any] | None  # None: nothing to run, only to complete in order (a rank whose staging failed)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def seal_and_report(job: SealJob, threads: int, report_queue: Any, token: str, trainer_pid: int,
                    copy_outcome: Any = None) -> None:
    """The save's background function: seal the staged object, then report the outcome under token; never raises.

    Runs in the trainer (sync saves), in a forked worker or in the persistent worker; the
    trainer's finalize reads the report (megatron/worker_reports.py). A worker process ties
    its life to the trainer first, so that it cannot outlive a SIGKILLed trainer, holding its
    memory across an in-job restart. copy_outcome (a Manager queue) is given when the trainer
    still copies into the buffer in the background (overlapped capture): the seal waits for
    its one message, None or why the copy failed.
    """
    if os.getpid() != trainer_pid:
        tie_to_parent(trainer_pid, watchdog_name="flashpoint-save-worker-watchdog")
    try:
        if copy_outcome is not None:
            try:
                failure = copy_outcome.get(timeout=COPY_WAIT_S)
            except queue.Empty:
                failure = f"the trainer's background copy sent no word in {COPY_WAIT_S:.0f} s"
            if failure is not None:
                raise RuntimeError(failure)
        seal_object(job, threads)
        outcome = None
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, raised there on every rank
        outcome = f"{type(exc).__name__}: {exc}"
    try:
        report_queue.put((token, outcome))
    except Exception as exc:  # noqa: BLE001 - the Manager is gone: finalize reports "ended without reporting"
        # Raising would end the persistent worker's loop before it signals completion, and a
        # blocking finalize would then wait for it until its bound.
        print(f"flashpoint: the background write could not report its outcome ({outcome or 'sealed'}): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


# A background copy ends within seconds (a memory copy) or fails the save; this bounds the wait of a
# seal whose trainer lost the message, which then fails its save (NeMo's worker_timeout_s is 600 s too).
COPY_WAIT_S = 600.0


def serve(trainer_pid: int, ready: multiprocessing.synchronize.Event, boot_hook: Callable[[], Any] | None,
          rank: int, calls: Any, preloads: Any, completions: Any, log_level: int) -> None:
    """The persistent worker's main: tie it to the trainer, say it is up, run calls in order until STOP.

    `calls` and `completions` are the queues of Megatron's PersistentAsyncCaller; `preloads` is
    unused (no call of ours preloads in the worker). A call that raises is logged and still
    completed, so the trainer's finalize sees it end (seal_and_report itself never raises).
    """
    tie_to_parent(trainer_pid, watchdog_name="flashpoint-save-worker-watchdog")
    logger.setLevel(log_level)
    if boot_hook is not None:
        boot_hook()
    ready.set()
    logger.debug("Persistent save worker of rank %d is up (pid %d)", rank, os.getpid())
    while True:
        call = calls.get()
        if isinstance(call, str) and call == STOP:
            calls.task_done()
            return
        try:
            if call.fn is not None:
                call.fn(*call.args, **call.kwargs)
        except Exception:  # noqa: BLE001 - the worker serves the next save; its finalize reports this one
            logger.exception("Rank %d: a background save call failed in the persistent worker", rank)
        completions.put(call.call_idx)
        calls.task_done()
