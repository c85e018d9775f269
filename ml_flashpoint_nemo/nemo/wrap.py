"""wrap_trainer_with_flashpoint: one line that wires a NeMo trainer for RAM checkpoints.

It only arranges things and starts background work, so it returns in milliseconds and
may run before the process group exists: the checkpoint IO is wrapped, the callback
added, the Manager for async saves starts warming up in a background thread (its future
goes to the save strategy), this rank's buffer pool starts pre-faulting in the
background, and the trainer's restore is taught to consider RAM versions. Everything that
needs collectives happens later, inside the trainer's own hooks.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from nemo.lightning.pytorch.strategies import MegatronStrategy

from ml_flashpoint_nemo.core.manager import start_manager_warmup
from ml_flashpoint_nemo.nemo.checkpoint_io import FlashpointCheckpointIO
from ml_flashpoint_nemo.nemo.resume import install_resume_choice
from ml_flashpoint_nemo.errors import TrainerSetupError
from ml_flashpoint_nemo.nemo.callback import FlashpointCallback
from ml_flashpoint_nemo.nemo.settings import FlashpointSettings

logger = logging.getLogger(__name__)

_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


@dataclass(frozen=True)
class FlashpointWiring:
    """What wrap_trainer_with_flashpoint attached to a trainer (trainer._flashpoint)."""

    settings: FlashpointSettings
    callback: FlashpointCallback
    io: Any  # FlashpointCheckpointIO


def flashpoint_settings_of(trainer: Any) -> FlashpointSettings | None:
    wiring = getattr(trainer, "_flashpoint", None)
    return wiring.settings if wiring is not None else None


def wrap_trainer_with_flashpoint(
    trainer: Any,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    _callback: FlashpointCallback | None = None,
    **options: Any,
) -> FlashpointCallback:
    """Wire a NeMo trainer (MegatronStrategy) for RAM checkpoints; returns its FlashpointCallback.

    base_dir: where RAM versions live; default FLASHPOINT_BASE_DIR, else
    /dev/shm/ml_flashpoint/<job id from SLURM / torchelastic / ...>. Options (keywords):
    every_n_steps (50), skip_durable_steps (True), keep (1), replication_factor (2),
    threads, async_save (None: as the strategy's ckpt_async_save), checksum (True),
    persistent_worker (True), worker_timeout_s (600), parallel_save (True), enabled (True), resume (True).
    Calling it again on the same trainer returns the same callback and changes nothing.
    """
    wiring: FlashpointWiring | None = getattr(trainer, "_flashpoint", None)
    if wiring is not None:
        if _callback is None and (options or base_dir is not None):  # not the callback's own setup
            logger.warning("wrap_trainer_with_flashpoint: this trainer is already wired; new options are ignored")
        _rewrap_checkpoint_io_if_replaced(trainer, wiring)
        return wiring.callback

    strategy = trainer.strategy
    if not isinstance(strategy, MegatronStrategy):
        raise TrainerSetupError(
            f"flashpoint checkpoints need a NeMo MegatronStrategy trainer, this one uses {type(strategy).__name__}"
        )
    settings = FlashpointSettings.create(base_dir, **options)

    manager_future = start_manager_warmup() if settings.enabled else None
    io = FlashpointCheckpointIO(strategy.checkpoint_io, settings, manager_future=manager_future)
    strategy.checkpoint_io = io
    callback = _callback or next((c for c in trainer.callbacks if isinstance(c, FlashpointCallback)), None)
    if callback is None:
        callback = FlashpointCallback(base_dir=settings.base_dir, **options)
        trainer.callbacks.append(callback)
    callback.attach(settings, io)
    trainer._flashpoint = FlashpointWiring(settings, callback, io)
    install_resume_choice(trainer, settings)
    if settings.enabled:
        _start_pool_warmup(settings)
    logger.info("Flashpoint RAM checkpoints every %d steps under %s", settings.every_n_steps, settings.base_dir)
    return callback


def _rewrap_checkpoint_io_if_replaced(trainer: Any, wiring: FlashpointWiring) -> None:
    """If something replaced the strategy's checkpoint IO since wrapping, wrap the new one too."""
    current = trainer.strategy.checkpoint_io
    if current is not wiring.io:
        logger.warning("The strategy's checkpoint IO was replaced after wrap_trainer_with_flashpoint; wrapping the new one")
        wiring.io._checkpoint_io = current  # Lightning's setter refuses wrapping IOs
        trainer.strategy.checkpoint_io = wiring.io


def _start_pool_warmup(settings: FlashpointSettings) -> None:
    """Adopt and pre-fault this rank's pool buffers left by an earlier run, in the background.

    The rank comes from the launcher's environment (the process group may not exist yet);
    without it the first save pre-faults instead.
    """
    rank = next((int(os.environ[v]) for v in _RANK_VARIABLES if os.environ.get(v, "").isdigit()), None)
    if rank is None:
        return

    def warm() -> None:
        try:
            from ml_flashpoint_nemo.dcp.writer import warm_up_rank_pool

            warm_up_rank_pool(settings.base_dir, rank)
        except Exception:  # noqa: BLE001 - an optimisation only; the first save reports real problems
            logger.debug("Pre-faulting the buffer pool of rank %d failed", rank, exc_info=True)

    threading.Thread(target=warm, name="flashpoint-pool-warmup", daemon=True).start()
