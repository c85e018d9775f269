"""Resuming a NeMo trainer from RAM: the newest version complete across the job, else the durable checkpoint.

The choice needs collectives (every rank must resume from the same version, checked on
every rank), and NeMo's AutoResume runs before the process group exists. So the choice is
made where the process group is up and the checkpoint has not been read yet: at the start
of Lightning's checkpoint restore (`_CheckpointConnector.resume_start`, which every rank
calls, with or without a path). There the trainer's own choice (the durable checkpoint
NeMo's AutoResume found, or none) is compared with the agreed RAM version; the newer one
is loaded, the RAM version on a tie, and every skipped RAM version is logged with why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from nemo.lightning.resume import AutoResume

from ml_flashpoint_nemo.errors import FlashpointError
from ml_flashpoint_nemo.nemo.settings import FlashpointSettings, flashpoint_settings_of
from ml_flashpoint_nemo.replication.choice import choose_version

logger = logging.getLogger(__name__)

_INSTALLED_MARK = "_flashpoint"  # a function attribute on our resume_start (benchmarks mark their wrapper too)

def durable_step(path: Any) -> int | None:
    """The global step saved in a durable NeMo checkpoint (its common state), None if it cannot be read."""
    if not path:
        return None
    try:
        from megatron.core import dist_checkpointing

        return int(dist_checkpointing.load_common_state_dict(str(path))["global_step"])
    except Exception as exc:  # noqa: BLE001 - an unreadable durable checkpoint is reported, RAM preferred
        logger.warning("Cannot read the global step of the durable checkpoint %s (%s); preferring RAM", path, exc)
        return None


@dataclass(frozen=True)
class ResumeDecision:
    path: Any
    source: str  # "ram", "durable" or "none"
    ram_step: int | None


def decide(settings: FlashpointSettings, trainer_path: Any,
           durable_error: BaseException | None = None) -> ResumeDecision:
    """Collective. RAM version if one is complete everywhere and not older than the durable checkpoint.

    Every rank takes the same decision from what every rank sees: the durable checkpoint counts
    only when every rank read the same step from it (else the RAM version is preferred, and with
    no RAM version every rank raises). durable_error: why this rank's AutoResume found none.
    """
    choice = choose_version(settings.base_dir)
    why_none = None if durable_error is None else f"{type(durable_error).__name__}: {durable_error}"
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (trainer_path is not None, durable_step(trainer_path), why_none))
    steps = {step for _, step, _ in seen}
    with_path = {has for has, _, _ in seen}
    durable = steps.pop() if len(steps) == 1 else None
    if len(with_path) > 1 or len(steps) > 1:
        views = "; ".join(f"rank {r}: " + (("unreadable" if step is None else f"step {step}") if has else "none")
                          for r, (has, step, _) in enumerate(seen))
        if choice.step is None:
            raise FlashpointError(f"the ranks do not see the same durable checkpoint ({views}) and no RAM version is "
                                  "usable; make the durable checkpoint directory readable on every node")
        logger.warning("The ranks do not see the same durable checkpoint (%s); every rank resumes from RAM step %d",
                       views, choice.step)
    if choice.step is None and with_path == {False}:
        failures = [f"rank {r}: {error}" for r, (_, _, error) in enumerate(seen) if error]
        if durable_error is not None:
            raise durable_error  # neither RAM nor durable: NeMo's own message says what to do
        if failures:
            raise FlashpointError("no RAM version is usable and NeMo's AutoResume found no durable checkpoint on "
                                  "other ranks: " + "; ".join(failures))
    if choice.step is not None and (durable is None or choice.step >= durable):
        return ResumeDecision(choice.path(settings.base_dir), "ram", choice.step)
    if choice.step is not None:
        logger.info("Durable checkpoint %s (step %s) is newer than RAM step %d; resuming from it",
                    trainer_path, durable, choice.step)
    elif choice.skipped or trainer_path:
        logger.warning("No RAM checkpoint usable on every rank; %s",
                       f"falling back to the durable checkpoint {trainer_path}" if trainer_path
                       else "no durable checkpoint either: training starts from scratch")
    return ResumeDecision(trainer_path, "durable" if trainer_path else "none", choice.step)


def install_resume_choice(trainer: Any, settings: FlashpointSettings, *, enabled: bool | None = None) -> None:
    """Make the trainer's checkpoint restore pick the RAM version when it should (idempotent).

    enabled (default: settings.resume) can be changed by a later call, e.g. by FlashpointAutoResume.
    """
    if enabled is not None or not hasattr(trainer, "_flashpoint_resume_enabled"):
        trainer._flashpoint_resume_enabled = settings.resume if enabled is None else enabled
    connector = trainer._checkpoint_connector
    if getattr(connector.resume_start, _INSTALLED_MARK, False):
        return
    original: Callable[..., None] = connector.resume_start

    def resume_start(checkpoint_path: Any = None) -> None:
        started = time.perf_counter()
        if trainer._flashpoint_resume_enabled and trainer.state.fn == TrainerFn.FITTING:
            decision = decide(settings, checkpoint_path, getattr(trainer, "_flashpoint_durable_error", None))
            trainer._flashpoint_resume = decision
            checkpoint_path = decision.path
        original(checkpoint_path)
        trainer._flashpoint_restore_seconds = time.perf_counter() - started  # choosing + reading

    setattr(resume_start, _INSTALLED_MARK, True)
    connector.resume_start = resume_start


@dataclass(kw_only=True)
class FlashpointAutoResume(AutoResume):
    """NeMo's AutoResume, plus resuming from the newest RAM version complete across the job.

    The durable checkpoint is found exactly as NeMo's AutoResume finds it, from this
    object's own AutoResume fields or from `durable`, an AutoResume to wrap; it is the
    fallback when no RAM version is complete and intact on every rank. The trainer must be
    wired for flashpoint (wrap_trainer_with_flashpoint or FlashpointCallback); the RAM
    version is chosen when the trainer restores, once the process group is up.
    """

    durable: AutoResume | None = None
    flashpoint: bool = True

    def __post_init__(self) -> None:
        if self.durable is not None:  # NeMoLogger reads resume_if_exists from the resume it is given
            self.resume_if_exists = self.durable.resume_if_exists

    def setup(self, trainer: Any, model: Any = None) -> None:
        durable_setup = self.durable.setup if self.durable is not None else super().setup
        try:
            durable_setup(trainer, model)
        except Exception as exc:
            # E.g. the newest durable checkpoint is unfinished because the job was killed during
            # an async durable save: exactly when a RAM version helps. It is raised at restore
            # time if no RAM version can be used either.
            if not self.flashpoint:
                raise
            logger.warning("NeMo's AutoResume found no usable durable checkpoint (%s); resuming from RAM if a "
                           "version is complete on every rank", exc)
            trainer._flashpoint_durable_error = exc
        settings = flashpoint_settings_of(trainer)
        if settings is not None:
            install_resume_choice(trainer, settings, enabled=self.flashpoint)
