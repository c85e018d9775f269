"""Wiring a NeMo trainer for RAM checkpoints with a given FlashpointCallback, once per trainer.

Both ways in end here: wrap_trainer_with_flashpoint (which finds or makes the callback) and
the callback's own setup hook (a recipe that only lists the callback). Nothing here needs
collectives, so it runs before the process group exists: the strategy's checkpoint IO is
wrapped, the callback linked to it, the Manager for async saves and this rank's buffer pool
start warming up in background threads, this rank's objects of the newest RAM version are
checked in another (for the restore's choice), and the trainer's restore learns to consider
RAM versions. Signal handlers that an earlier trainer, cut short, left installed are put back
first (nemo/stale_handlers.py).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from nemo.lightning.pytorch.strategies import MegatronStrategy

from ml_flashpoint_nemo.core.sync_manager import start_manager_warmup
from ml_flashpoint_nemo.errors import TrainerSetupError
from ml_flashpoint_nemo.nemo.checkpoint_io import FlashpointCheckpointIO
from ml_flashpoint_nemo.nemo.resume import install_resume_choice
from ml_flashpoint_nemo.nemo.settings import FlashpointSettings, FlashpointWiring, wiring_of
from ml_flashpoint_nemo.nemo.stale_handlers import note_wired_trainer, release_stale_signal_handlers

if TYPE_CHECKING:
    from ml_flashpoint_nemo.nemo.callback import FlashpointCallback
    from ml_flashpoint_nemo.nemo.settings import FlashpointOptionValues

logger = logging.getLogger(__name__)

_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def wire_trainer(
    trainer: Any,
    callback: FlashpointCallback,
    *,
    base_dir: str | os.PathLike[str] | None,
    options: FlashpointOptionValues,
    warn_if_wired: bool,
) -> FlashpointWiring:
    """Wire trainer with callback and these options; a trainer already wired keeps its wiring.

    On a wired trainer the options are ignored (with a warning if warn_if_wired and any were
    given), and a checkpoint IO that replaced flashpoint's since is wrapped in turn.
    """
    wiring = wiring_of(trainer)
    if wiring is not None:
        if warn_if_wired and (options or base_dir is not None):
            logger.warning("wrap_trainer_with_flashpoint: this trainer is already wired; new options are ignored")
        _rewrap_checkpoint_io_if_replaced(trainer, wiring)
        return wiring

    strategy = trainer.strategy
    if not isinstance(strategy, MegatronStrategy):
        raise TrainerSetupError(
            f"flashpoint checkpoints need a NeMo MegatronStrategy trainer, this one uses {type(strategy).__name__}"
        )
    settings = FlashpointSettings.create(base_dir, **options)
    release_stale_signal_handlers(trainer)  # before this trainer's fit chains them into its own

    manager_future = start_manager_warmup() if settings.enabled else None
    io = FlashpointCheckpointIO(strategy.checkpoint_io, settings, manager_future=manager_future)
    strategy.checkpoint_io = io
    if not any(c is callback for c in trainer.callbacks):
        trainer.callbacks.append(callback)
    callback.attach(settings, io)
    wiring = FlashpointWiring(settings, callback, io)
    trainer._flashpoint = wiring
    note_wired_trainer(trainer, io)
    install_resume_choice(trainer, settings)
    if settings.enabled:
        _start_pool_warmup(settings)
        if settings.resume:
            _start_verifying_ahead(settings)
    logger.info("Flashpoint RAM checkpoints every %d steps under %s", settings.every_n_steps, settings.base_dir)
    return wiring


def refuse_unguarded_writes(trainer: Any, pl_module: Any) -> None:
    """overlap_capture: refuse what writes saved tensors before the next optimizer step, where no wait can go.

    NeMo's EMA callback swaps weights into the parameters through .data around validation; Megatron's MoE
    router updates its expert bias buffer in place right after the backward (docs/design.md lists each write).
    """
    if any(cls.__name__ == "EMA" for c in trainer.callbacks for cls in type(c).__mro__):  # and its subclasses
        raise TrainerSetupError("flashpoint option overlap_capture cannot be used with NeMo's EMA callback (it writes "
                                "the parameters while a save may still copy them); drop one of the two")
    if getattr(getattr(pl_module, "config", None), "moe_router_enable_expert_bias", False):
        raise TrainerSetupError("flashpoint option overlap_capture cannot be used with moe_router_enable_expert_bias "
                                "(the router updates a saved buffer before the optimizer step); turn one off")


def _rewrap_checkpoint_io_if_replaced(trainer: Any, wiring: FlashpointWiring) -> None:
    """If something replaced the strategy's checkpoint IO since wiring, wrap the new one too."""
    current = trainer.strategy.checkpoint_io
    if current is not wiring.io:
        logger.warning("The strategy's checkpoint IO was replaced after wrap_trainer_with_flashpoint; wrapping the new one")
        wiring.io._checkpoint_io = current  # Lightning's setter refuses wrapping IOs
        trainer.strategy.checkpoint_io = wiring.io


def _launcher_rank() -> int | None:
    """This process's rank from the launcher's environment (the process group may not exist yet)."""
    return next((int(os.environ[v]) for v in _RANK_VARIABLES if os.environ.get(v, "").isdigit()), None)


def _start_verifying_ahead(settings: FlashpointSettings) -> None:
    """Check this rank's objects of the newest RAM version in the background, for the restore's choice."""
    rank = _launcher_rank()
    if rank is not None:
        from ml_flashpoint_nemo.replication.preverify import verify_ahead

        verify_ahead(settings.base_dir, rank)


def _start_pool_warmup(settings: FlashpointSettings) -> None:
    """Adopt and pre-fault this rank's pool buffers left by an earlier run, in the background.

    The rank comes from the launcher's environment; without it the first save pre-faults instead.
    """
    rank = _launcher_rank()
    if rank is None:
        return

    def warm() -> None:
        try:
            from ml_flashpoint_nemo.dcp.writer import warm_up_rank_pool

            warm_up_rank_pool(settings.base_dir, rank)
        except Exception:  # noqa: BLE001 - an optimisation only; the first save reports real problems
            logger.debug("Pre-faulting the buffer pool of rank %d failed", rank, exc_info=True)

    threading.Thread(target=warm, name="flashpoint-pool-warmup", daemon=True).start()
