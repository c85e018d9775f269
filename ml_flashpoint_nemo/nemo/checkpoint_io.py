"""FlashpointCheckpointIO: RAM saves for flashpoint checkpoints, the trainer's own IO for everything else.

It wraps the strategy's existing checkpoint IO (MegatronCheckpointIO, possibly inside
AsyncFinalizableCheckpointIO). A save goes to RAM only when it carries the explicit
marker (storage_options[FLASHPOINT_SAVE]) and its path really lies inside the RAM base
directory; every other save goes to the wrapped IO unchanged. RAM saves finalize on their
own queue, so they never wait behind a slow durable save. Loads of paths inside the base
directory go through the flashpoint load strategy (found from metadata.json), others to
the wrapped IO.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from nemo.lightning.io.pl import MegatronCheckpointIO
from nemo.utils.callbacks.dist_ckpt_io import AsyncFinalizableCheckpointIO

from ml_flashpoint_nemo.core import capture, lifecycle, remote_objects
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.sync_manager import SyncManagerFuture
from ml_flashpoint_nemo.core.topology import any_rank, problems_of_every_rank
from ml_flashpoint_nemo.core.versions import read_commit, retire_version
from ml_flashpoint_nemo.dcp.storage_info import step_of_checkpoint_id
from ml_flashpoint_nemo.dcp.writer import release_process_savers
from ml_flashpoint_nemo.errors import BaseDirError, FlashpointError, TrainerSetupError
from ml_flashpoint_nemo.megatron.async_workers import (
    PersistentWorkerQueue,
    dead_persistent_worker,
    stop_async_workers,
    stop_workers_at_exit,
)
from ml_flashpoint_nemo.megatron.strategies import FlashpointSaveStrategy
from ml_flashpoint_nemo.nemo.settings import FlashpointSettings
from ml_flashpoint_nemo.replication.service import ReplicationConfig

logger = logging.getLogger(__name__)

FLASHPOINT_SAVE = "flashpoint_save"  # the storage_options key that marks a RAM save
_FINALIZE_POLL_S = 0.05  # a blocking finalize checks the workers this often
FORK_SAFE_PYTHON = (3, 11, 10)  # the first 3.11 whose os.fork() child cannot hang on the interpreter's HEAD_LOCK


@dataclass(frozen=True)
class SaveOutcome:
    """One flashpoint save as the callback reports it."""

    step: int
    staging_s: float  # dist_checkpointing.save's blocking part: planning and the staging copy
    nbytes: int = 0  # of the whole job's version, from its commit record
    error: str | None = None


def innermost_checkpoint_io(checkpoint_io: CheckpointIO | None) -> CheckpointIO | None:
    """The IO at the bottom of a chain of Lightning wrappers (None if a wrapper has none)."""
    while isinstance(checkpoint_io, _WrappingCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


class FlashpointCheckpointIO(AsyncFinalizableCheckpointIO):
    """Routes marked saves to RAM versions under settings.base_dir; everything else to `durable`.

    It is an AsyncFinalizableCheckpointIO so that NeMo's ModelCheckpoint and
    AsyncFinalizerCallback keep working when the durable save is async; its own
    flashpoint queue is finalized by maybe_finalize_save_checkpoint too.
    """

    def __init__(
        self, durable: CheckpointIO, settings: FlashpointSettings, *, manager_future: SyncManagerFuture | None = None
    ) -> None:
        if not isinstance(innermost_checkpoint_io(durable), MegatronCheckpointIO):
            raise TrainerSetupError(
                f"flashpoint needs the strategy's checkpoint IO to be NeMo's MegatronCheckpointIO (possibly wrapped), "
                f"got {type(innermost_checkpoint_io(durable)).__name__}"
            )
        # Not AsyncFinalizableCheckpointIO.__init__: the durable IO may well be synchronous.
        _WrappingCheckpointIO.__init__(self, durable)
        self.settings = settings
        self.layout = CheckpointLayout(settings.base_dir)
        self.flashpoint_strategy = FlashpointSaveStrategy(
            keep=settings.keep, checksum=settings.checksum, threads=settings.threads, manager_future=manager_future,
            replication=ReplicationConfig(factor=settings.replication_factor), overlap_capture=settings.overlap_capture,
        )
        self.flashpoint_queue = PersistentWorkerQueue() if settings.persistent_worker else AsyncCallsQueue()
        stop_workers_at_exit(self.flashpoint_queue)  # forked workers are not daemons either: none may block the exit
        if not settings.persistent_worker and sys.version_info < FORK_SAFE_PYTHON:
            _warn_fork_can_deadlock()
        self.outcomes: list[SaveOutcome] = []  # finalized saves not yet reported by the callback
        self._pending: deque[tuple[int, float]] = deque()  # (step, time.monotonic() when scheduled), oldest first
        self._save_strategy: FlashpointSaveStrategy | FullyParallelSaveStrategyWrapper | None = None
        self._validated = False
        self._closing = threading.Lock()
        self.closed = False  # True once close() ran to its end, until the next fit begins (begin_fit)
        # first: its workers must be stopped before the pools they write into are released
        lifecycle.register(self, _close_dropping_saves, first=True)

    # --- routing ------------------------------------------------------------------------------

    def is_ram_path(self, path: str | os.PathLike[str]) -> bool:
        """True when path resolves inside the base directory (real containment, symlinks resolved)."""
        base = os.path.realpath(self.layout.base_dir)
        target = os.path.realpath(path)
        return os.path.commonpath([base, target]) == base

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options and storage_options.get(FLASHPOINT_SAVE):
            options = dict(storage_options)
            options.pop(FLASHPOINT_SAVE)
            self._save_to_ram(checkpoint, path, options)
            return
        if self.is_ram_path(path):
            raise BaseDirError(
                f"a durable checkpoint was asked to go to {path}, inside the RAM checkpoint directory "
                f"{self.layout.base_dir}; point the durable checkpoint directory elsewhere"
            )
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        capture.wait_for_captures("a load")  # it overwrites tensors a save may still be copying
        if not self.is_ram_path(path):
            return self.checkpoint_io.load_checkpoint(path, *args, **kwargs)
        # A RAM version's metadata.json names the flashpoint load strategy, which Megatron picks.
        # After a restart on several nodes each node holds its own ranks' objects and fetches any
        # other it reads (core.remote_objects): with parallel saves, which spread the replicated
        # tensors over the data-parallel ranks, NeMo's parallel load makes each rank read the part
        # it saved and receive the rest over the process group, instead of every node fetching
        # almost every object. Otherwise every object a rank reads is on its node, and a local copy
        # is faster than that exchange.
        inner = innermost_checkpoint_io(self.checkpoint_io)
        assert isinstance(inner, MegatronCheckpointIO), "checked when this IO was made"
        parallel_load = getattr(inner, "parallel_load", False)
        inner.parallel_load = self.settings.parallel_save and remote_objects.fetching(self.layout.base_dir)
        try:
            return inner.load_checkpoint(path, *args, **kwargs)
        finally:
            inner.parallel_load = parallel_load

    def remove_checkpoint(self, path: Any) -> None:
        if not self.is_ram_path(path):
            self.checkpoint_io.remove_checkpoint(path)
            return
        # Lightning calls this on global rank 0 only: it removes that node's copy of the version.
        # Every node's copies of superseded versions are retired by that node's own next save.
        step = step_of_checkpoint_id(self.layout, path)
        retire_version(self.layout, step, rank=None)

    # --- RAM saves ----------------------------------------------------------------------------

    @property
    def save_strategy(self) -> FlashpointSaveStrategy | FullyParallelSaveStrategyWrapper:
        if self._save_strategy is None:
            strategy: FlashpointSaveStrategy | FullyParallelSaveStrategyWrapper = self.flashpoint_strategy
            if self.settings.parallel_save:
                from megatron.core.parallel_state import get_data_parallel_group

                group = get_data_parallel_group(with_context_parallel=True)
                strategy = FullyParallelSaveStrategyWrapper(strategy, group, do_cache_distribution=True)
            self._save_strategy = strategy
        return self._save_strategy

    def _save_to_ram(self, checkpoint: dict[str, Any], path: Any, options: dict[str, Any]) -> None:
        step = step_of_checkpoint_id(self.layout, path)
        directory = self.layout.version_dir(step)
        started = time.perf_counter()
        strategy = self.save_strategy
        # Steady: Megatron's save runs no collective before the strategy's first (no integrity validation, a cached
        # distribution), so the room check rides that all-reduce. A full tmpfs, or a version directory one rank
        # cannot create, skips the save on every rank.
        steady = self._validated and getattr(strategy, "cached_distribution", True) is not None
        request, skipped = self.flashpoint_strategy.save_if_room(
            lambda: dist_checkpointing.save(
                sharded_state_dict=checkpoint,
                checkpoint_dir=str(directory),
                sharded_strategy=strategy,
                validate_access_integrity=not self._validated,
                async_sharded_save=self._async,
                content_metadata=options.get("content_metadata"),
            ),
            self.layout.base_dir, directory, steady=steady)
        if skipped is not None:
            logger.error("Flashpoint save of step %d skipped, training continues: %s", step, skipped)
            self.outcomes.append(SaveOutcome(step=step, staging_s=0.0, error=str(skipped)))
            return
        self._validated = True
        blocking = time.perf_counter() - started
        if request is None:
            self.outcomes.append(self._outcome(step, blocking))
            return
        request.add_finalize_fn(lambda: self.outcomes.append(self._outcome(self._pending.popleft()[0], blocking)))
        self._pending.append((step, time.monotonic()))
        lifecycle.register(self, _close_dropping_saves, first=True)  # again, in case it was closed and is used once more
        self.flashpoint_queue.schedule_async_request(request)

    def saves_in_flight(self) -> int:
        """RAM saves scheduled and not yet finalized: the same on every rank (both are collective)."""
        return len(self._pending)

    def begin_fit(self) -> None:
        """A fit starts with this IO (main thread, at trainer set-up): it counts as open again, and the
        persistent save worker is spawned now, so that it boots while the model is built (no-op when it runs
        or is not used; saves before it is up fork a worker each)."""
        self.closed = False
        if self.settings.enabled and isinstance(self.flashpoint_queue, PersistentWorkerQueue) and self._async:
            self.flashpoint_queue.start_worker()

    @property
    def _async(self) -> bool:
        if self.settings.async_save is not None:
            return self.settings.async_save
        return isinstance(self.checkpoint_io, AsyncFinalizableCheckpointIO)

    def _outcome(self, step: int, staging_s: float) -> SaveOutcome:
        """A committed save's outcome; never raises (every rank reports the save, between Megatron's collectives)."""
        try:
            nbytes = sum(o.nbytes for o in read_commit(self.layout, step).objects)
        except Exception as exc:  # noqa: BLE001 - the save is committed on every rank: only its size is unknown here
            logger.warning("Flashpoint save of step %d is committed, but this rank cannot read its commit record to "
                           "count its bytes (%s: %s); reported as 0 bytes", step, type(exc).__name__, exc)
            nbytes = 0
        return SaveOutcome(step, staging_s, nbytes)

    def finalize_flashpoint(self, blocking: bool = False) -> bool:
        """Finalize finished RAM saves (collective); blocking: every save in flight, waiting for them.

        A failed save is logged and reported, never raised: the previous version is intact and
        training goes on. Megatron stops finalizing at a failed save (it is dropped from the
        queue first), so the saves after it are finalized by the next round here. The wait is
        bounded: a save whose worker died, or that is not done within worker_timeout_s, fails on
        every rank (Megatron's own blocking finalize would wait for it forever).
        """
        finalized = False
        while self.flashpoint_queue.get_num_unfinalized_calls():
            finalized = self._drop_stuck_saves() or finalized
            try:
                finalized = bool(self.flashpoint_queue.maybe_finalize_async_calls(blocking=False)) or finalized
            except FlashpointError as exc:
                self._fail_oldest(exc)
                finalized = True
                continue  # the saves after it may be done as well
            if not blocking:
                break
            if self.flashpoint_queue.get_num_unfinalized_calls():
                time.sleep(_FINALIZE_POLL_S)
        return finalized

    def _drop_stuck_saves(self) -> bool:
        """Collective: if any rank's worker died (OOM-killed, say) or its oldest save is overdue, finalize
        what every rank finished and drop the rest everywhere, stopping the workers; True if it did.

        The next save starts a new worker.
        """
        problem = self._stuck_save_problem()
        if not any_rank(problem is not None):
            return False
        failed = problems_of_every_rank(problem and f"rank {dist.get_rank()}: {problem}")
        try:
            self.flashpoint_queue.maybe_finalize_async_calls(blocking=False)
        except FlashpointError as exc:
            self._fail_oldest(exc)
        dropped = [step for step, _ in self._pending]
        stop_async_workers(self.flashpoint_queue)
        self._pending.clear()
        for step in dropped:
            self._report_failure(step, "; ".join(failed) + ". The unfinished saves are dropped and their workers "
                                 "stopped; the next save starts a new worker")
        return True

    def _stuck_save_problem(self) -> str | None:
        """Why this rank's saves in flight cannot finish (None: they can); never raises, the ranks decide together."""
        try:
            problem = dead_persistent_worker(self.flashpoint_queue) if self.flashpoint_queue.persistent else None
            if problem is None and self._pending:
                step, scheduled = self._pending[0]
                age = time.monotonic() - scheduled
                if age > self.settings.worker_timeout_s:
                    problem = (f"the background write of step {step} is not done after {age:.0f} s "
                               f"(worker_timeout_s={self.settings.worker_timeout_s:g}; a hung worker?)")
        except Exception as exc:  # noqa: BLE001 - a worker this rank cannot inspect is treated as stuck, on every rank
            logger.debug("inspecting the flashpoint save worker failed", exc_info=True)
            problem = f"its save worker cannot be inspected ({type(exc).__name__}: {exc})"
        return problem

    def _fail_oldest(self, exc: FlashpointError) -> None:
        """Megatron raised from the oldest save's finalize (and dropped it from its queue)."""
        self._report_failure(self._pending.popleft()[0] if self._pending else -1, str(exc))

    def _report_failure(self, step: int, error: str) -> None:
        logger.error("Flashpoint save of step %d failed, training continues and the previous RAM version is kept: %s",
                     step, error)
        self.outcomes.append(SaveOutcome(step=step, staging_s=0.0, error=error))

    # --- AsyncFinalizableCheckpointIO ---------------------------------------------------------

    @property
    def async_calls_queue(self) -> AsyncCallsQueue:
        """The durable IO's queue when it has one (NeMo's finalizer callback inspects it)."""
        return getattr(self.checkpoint_io, "async_calls_queue", self.flashpoint_queue)

    def maybe_finalize_save_checkpoint(self, blocking: bool = False) -> bool:
        finalized = self.finalize_flashpoint(blocking)
        durable_finalize = getattr(self.checkpoint_io, "maybe_finalize_save_checkpoint", None)
        if durable_finalize is not None:
            finalized = bool(durable_finalize(blocking)) or finalized
        return finalized

    def close(self, *, finalize: bool = True) -> None:
        """Stop the flashpoint worker, replication and Manager (RAM versions stay).

        finalize=True (collective) commits saves still in flight; without it they are dropped and
        the newest committed version stays the one to resume from. Without finalize it runs no
        collective, so an abort may call it from another thread; a close already running in
        another thread makes this call return at once.
        """
        if not self._closing.acquire(blocking=False):
            return
        try:
            if finalize:
                self.finalize_flashpoint(blocking=True)
            pending = self.flashpoint_queue.get_num_unfinalized_calls()
            if pending:
                logger.warning("%d flashpoint save(s) still in flight are dropped; the newest committed RAM version "
                               "is kept", pending)
            stop_async_workers(self.flashpoint_queue)
            self._pending.clear()
            self.flashpoint_strategy.close()
            release_process_savers([self.layout.base_dir])  # the pool warmed at set-up, saved to or not
            lifecycle.unregister(self)
            self.closed = True
        finally:
            self._closing.release()

    def teardown(self) -> None:
        # Lightning also tears down after an error, when other ranks may be gone: no collectives here.
        # The callback finalizes at the end of training, on every rank.
        self.close(finalize=False)
        self.checkpoint_io.teardown()


@functools.lru_cache(maxsize=1)
def _warn_fork_can_deadlock() -> None:
    logger.warning(
        "Python %s can deadlock a forked process when another thread starts or ends at the moment of the fork "
        "(CPython gh-112275, fixed in 3.11.10), and Megatron forks a worker for every async save. A stuck worker "
        "fails its save on every rank after worker_timeout_s; to avoid it, use Python >= 3.11.10 or "
        "persistent_worker=True.", platform.python_version())


def _close_dropping_saves(io: FlashpointCheckpointIO) -> None:
    """How the restart registry closes an IO: no collective, saves in flight dropped."""
    io.close(finalize=False)


def version_path(settings: FlashpointSettings, step: int) -> Path:
    """Where the RAM version of a global step lives."""
    return CheckpointLayout(settings.base_dir).version_dir(step)
