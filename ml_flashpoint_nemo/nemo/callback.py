"""FlashpointCallback: when to take a RAM checkpoint, and what each one cost.

Saves every `every_n_steps` optimizer steps, except at steps where a ModelCheckpoint
saves the durable checkpoint anyway; finalizes finished saves without blocking on each
batch and blocking at the end of training; reports each committed save through the
trainer's logger (blocking seconds, bytes, GB/s, committed step and, across nodes, the newest
version replicated everywhere and how many ranks' newest is under-replicated). Added to a trainer's
callbacks (e.g. as run.Config(FlashpointCallback, ...) in a recipe), it wires the trainer
for flashpoint in its setup hook, so no code change is needed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from ml_flashpoint_nemo.nemo.settings import FlashpointSettings, checked_options

logger = logging.getLogger(__name__)


class FlashpointCallback(Callback):
    """RAM checkpoints of a NeMo MegatronStrategy trainer; options as for wrap_trainer_with_flashpoint."""

    def __init__(self, *, base_dir: str | os.PathLike[str] | None = None, **options: Any) -> None:
        self.base_dir = base_dir
        self.options = checked_options(options)  # a bad option fails when the callback is made
        self.settings: FlashpointSettings | None = None
        self.io: Any = None  # the trainer's FlashpointCheckpointIO, set when wired
        self._blocking: dict[int, float] = {}
        self._last_saved_step: int | None = None
        self.saves: list[dict[str, Any]] = []  # every reported save, for whoever wants the numbers

    # --- wiring ------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from ml_flashpoint_nemo.nemo.wiring import wire_trainer  # imports NeMo's checkpoint IO stack

        wire_trainer(trainer, self, base_dir=self.base_dir, options=self.options, warn_if_wired=False)
        if stage == "fit" and self.io is not None:
            self.io.start_worker()  # in each rank's process, from its main thread, before the model is built

    def attach(self, settings: FlashpointSettings, io: Any) -> None:
        self.settings, self.io = settings, io

    # --- saving ------------------------------------------------------------------------------

    def _durable_saves_at(self, trainer: Any, step: int) -> bool:
        for callback in trainer.callbacks:
            every = getattr(callback, "_every_n_train_steps", 0) if isinstance(callback, ModelCheckpoint) else 0
            if every and every > 0 and step % every == 0:
                return True
        return False

    def should_save(self, trainer: Any, step: int) -> bool:
        settings = self.settings
        if settings is None or not settings.enabled or step <= 0 or step == self._last_saved_step:
            return False
        if step % settings.every_n_steps != 0:
            return False
        return not (settings.skip_durable_steps and self._durable_saves_at(trainer, step))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.io is None:
            return
        self._finalize(trainer, blocking=False)
        step = trainer.global_step
        if self.should_save(trainer, step):
            self.save(trainer, step)

    def save(self, trainer: Any, step: int) -> None:
        """Take a RAM checkpoint of the current state as version `step` (every rank must call it)."""
        from ml_flashpoint_nemo.nemo.checkpoint_io import FLASHPOINT_SAVE, version_path

        assert self.settings is not None, "wired in setup"
        started = time.perf_counter()
        trainer.save_checkpoint(version_path(self.settings, step), storage_options={FLASHPOINT_SAVE: True})
        self._blocking[step] = time.perf_counter() - started
        self._last_saved_step = step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.io is not None:
            self._finalize(trainer, blocking=True)

    # --- reporting ---------------------------------------------------------------------------

    def _finalize(self, trainer: Any, *, blocking: bool) -> None:
        self.io.finalize_flashpoint(blocking=blocking)
        while self.io.outcomes:
            self._report(trainer, self.io.outcomes.pop(0))

    def _replication_numbers(self) -> dict[str, float]:
        """Job-wide replication state at this save (collective: every rank reports the same saves).

        replicated_step: the newest version every rank has pushed to all its peers (-1: none yet);
        under_replicated_ranks: ranks with a failed push newer than their newest replicated version
        (a version skipped for a newer one is not a failure).
        """
        import torch.distributed as dist

        service = getattr(self.io.flashpoint_strategy, "replication", None)
        if service is None or not service.enabled or not dist.is_initialized():
            return {}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, service.progress())
        replicated = [-1 if newest is None else newest for newest, _ in everyone]
        return {"flashpoint/replicated_step": float(min(replicated)),
                "flashpoint/under_replicated_ranks": float(sum(1 for _, failed in everyone if failed))}

    def _report(self, trainer: Any, outcome: Any) -> None:
        blocking = self._blocking.pop(outcome.step, outcome.staging_s)
        if outcome.error:
            self.saves.append({"step": outcome.step, "error": outcome.error})
            return  # logged as an error by the checkpoint IO
        numbers = {
            "flashpoint/committed_step": float(outcome.step),
            "flashpoint/blocking_s": blocking,
            "flashpoint/staging_s": outcome.staging_s,
            "flashpoint/bytes": float(outcome.nbytes),
            "flashpoint/gbps": outcome.nbytes / blocking / 1e9 if blocking > 0 else 0.0,
        }
        numbers.update(self._replication_numbers())
        self.saves.append({"step": outcome.step, **numbers})
        if trainer.logger is not None:
            trainer.logger.log_metrics(numbers, step=trainer.global_step)
        if trainer.is_global_zero:
            logger.info("Flashpoint checkpoint of step %d committed: %.1f MB, training blocked %.3f s (%.2f GB/s)",
                        outcome.step, outcome.nbytes / 1e6, blocking, numbers["flashpoint/gbps"])
