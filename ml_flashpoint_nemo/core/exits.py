"""No helper process of ours keeps an exiting trainer alive.

When Python exits (after the trainer raised, or returned), ``multiprocessing.util._exit_function``
terminates the *daemon* children and then joins every child without a bound. Our helpers are not
daemons (Megatron creates its async-save workers so, and a daemon could not start processes of its
own), so a save worker that never booted, a forked worker that is stuck, or a Manager still starting
would hold the trainer in that join forever, and its launcher would count a hang instead of a
failure. Each helper registers here with a bounded stop that runs no collective; one multiprocessing
finalizer, which that exit function runs *before* it joins anything, stops them all, newest first,
the whole within :data:`EXIT_TIMEOUT_S`. Nothing of value is lost: the helpers are tied to the
trainer (parent_death) and would get SIGKILL the moment it is gone, and a save not yet finalized
was never committed.

Stdlib only, like its neighbours the Manager's server process imports.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.util
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

EXIT_TIMEOUT_S = 15.0  # all stops together; each one is bounded on its own as well
EXIT_PRIORITY = 50  # multiprocessing runs finalizers of priority >= 0, highest first, before joining children

T = TypeVar("T")

_lock = threading.Lock()
_order = itertools.count()
_stops: dict[int, tuple["weakref.ref[Any]", Callable[[Any], object], str]] = {}
_finalizer_installed = False


def stop_at_exit(resource: T, stop: Callable[[T], object], what: str) -> None:
    """Run ``stop(resource)`` when this process exits, before multiprocessing joins its children.

    Holds `resource` weakly; registering it again changes nothing. `stop` must be idempotent,
    bounded in time, run no collective and be safe from any thread.
    """
    global _finalizer_installed
    with _lock:
        if any(ref() is resource for ref, _, _ in list(_stops.values())):
            return
        key = next(_order)

        def forget(_: object, key: int = key) -> None:
            _stops.pop(key, None)

        _stops[key] = (weakref.ref(resource, forget), stop, what)
        if not _finalizer_installed:
            # A finalizer without an object lives until the exit; fork children drop it (multiprocessing
            # clears its registry in them), spawned ones never import this module's state.
            multiprocessing.util.Finalize(None, stop_helpers, exitpriority=EXIT_PRIORITY)
            _finalizer_installed = True


def stop_helpers(timeout: float = EXIT_TIMEOUT_S) -> tuple[str, ...]:
    """Stop every registered helper now, newest first, within about `timeout` s; never raises.

    Returns what was still stopping at the time limit (it goes on in a daemon thread).
    """
    with _lock:
        claimed = [entry for _, entry in sorted(_stops.items(), key=lambda kv: -kv[0])]
        _stops.clear()
    done = [0]

    def stop_all() -> None:
        for ref, stop, what in claimed:
            resource = ref()
            try:
                if resource is not None:
                    stop(resource)
            except Exception:  # noqa: BLE001 - one failed stop must not keep the other helpers alive
                logger.error("Stopping %s at exit failed", what, exc_info=True)
            finally:
                resource = None
                done[0] += 1

    if claimed:
        started = time.monotonic()
        worker = threading.Thread(target=stop_all, name="flashpoint-exit", daemon=True)
        worker.start()
        worker.join(timeout)
        logger.debug("Stopped %d helper(s) at exit in %.2f s", done[0], time.monotonic() - started)
    unfinished = tuple(what for _, _, what in claimed[done[0]:])
    if unfinished:
        logger.error("Stopping helper processes at exit took longer than %.1f s: %s; the exit may wait for them",
                     timeout, ", ".join(unfinished))
    return unfinished
