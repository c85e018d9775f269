"""wrap_trainer_with_flashpoint: one line that wires a NeMo trainer for RAM checkpoints.

It finds the trainer's FlashpointCallback (or adds one) and wires the trainer with it
(nemo/wiring.py). It only arranges things and starts background work, so it returns in
milliseconds and may run before the process group exists; everything that needs
collectives happens later, inside the trainer's own hooks.
"""

from __future__ import annotations

import os
from typing import Any

from typing_extensions import Unpack

from ml_flashpoint_nemo.nemo.callback import FlashpointCallback
from ml_flashpoint_nemo.nemo.settings import FlashpointOptionValues, FlashpointWiring, flashpoint_settings_of, wiring_of
from ml_flashpoint_nemo.nemo.wiring import wire_trainer

__all__ = ["FlashpointWiring", "flashpoint_settings_of", "wrap_trainer_with_flashpoint"]


def wrap_trainer_with_flashpoint(
    trainer: Any,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    **options: Unpack[FlashpointOptionValues],
) -> FlashpointCallback:
    """Wire a NeMo trainer (MegatronStrategy) for RAM checkpoints; returns its FlashpointCallback.

    base_dir: where RAM versions live; default FLASHPOINT_BASE_DIR, else
    /dev/shm/ml_flashpoint/<job id from SLURM / torchelastic / ...>. Options (keywords, typed by
    FlashpointOptionValues, defaults and meanings in settings.FlashpointOptions):
    every_n_steps (50), skip_durable_steps (True), keep (1), replication_factor (2),
    threads, async_save (None: as the strategy's ckpt_async_save), checksum (True),
    persistent_worker (True), worker_timeout_s (600), max_saves_in_flight (1), overlap_capture (False), parallel_save (True), enabled (True), resume (True).
    Calling it again on the same trainer returns the same callback and ignores the new options
    (with a warning); a checkpoint IO that replaced flashpoint's since the first call is wrapped in turn.
    """
    wiring = wiring_of(trainer)
    if wiring is not None:
        callback = wiring.callback
    else:
        callback = next((c for c in trainer.callbacks if isinstance(c, FlashpointCallback)), None) \
            or FlashpointCallback(base_dir=base_dir, **options)
    return wire_trainer(trainer, callback, base_dir=base_dir, options=options.copy(), warn_if_wired=True).callback
