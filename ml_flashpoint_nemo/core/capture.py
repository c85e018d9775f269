"""Copies of a save still running after it returned, and the waits that keep them from being torn.

A save with overlapped capture (CheckpointSaver.stage_object(in_background=True)) copies the
tensors into its pool buffer in a background thread while training goes on. Training must not
write to a captured tensor before its copy is done: every write site waits here first. The
optimizer step is the write that always comes (NeMo's FlashpointCallback waits in
on_before_optimizer_step; install_optimizer_step_guard makes every torch optimizer's step wait,
for the Megatron adapter used without NeMo); loads into the same tensors and the pool's release
wait as well. Writes in the forward (a BatchNorm's running statistics, say) are not guarded:
overlapped capture is for states that only the optimizer step and loads write (docs/design.md).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_in_flight: set["Future[object]"] = set()
_guard_installed = False


def track(future: "Future[object]") -> None:
    """Count a background copy as in flight until it ends (however it ends)."""
    with _lock:
        _in_flight.add(future)
    future.add_done_callback(_forget)


def _forget(future: "Future[object]") -> None:
    with _lock:
        _in_flight.discard(future)


def copies_in_flight() -> int:
    with _lock:
        return len(_in_flight)


def wait_for_captures(why: str = "a write to captured tensors") -> float:
    """Block until every background copy of this process has ended; returns the seconds waited.

    Never raises: a failed copy fails its own save on every rank at finalize.
    """
    with _lock:
        pending = list(_in_flight)
    if not pending:
        return 0.0
    started = time.perf_counter()
    wait(pending)
    waited = time.perf_counter() - started
    logger.debug("%s waited %.3f s for %d background checkpoint copies", why, waited, len(pending))
    return waited


def install_optimizer_step_guard() -> None:
    """Make every torch optimizer's step wait for the background copies first (once per process).

    torch calls global step pre-hooks for every torch.optim.Optimizer subclass, which covers the
    optimizers inside Megatron's and NeMo's wrappers; with no copy in flight the hook only takes a lock.
    """
    global _guard_installed
    with _lock:
        if _guard_installed:
            return
        _guard_installed = True
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: _wait_before_step())


def _wait_before_step() -> None:
    wait_for_captures("an optimizer step")
