"""FlashpointCallback: when to take a RAM checkpoint, and what each one cost.

Saves every `every_n_steps` optimizer steps, except at steps where a ModelCheckpoint
saves the durable checkpoint anyway; finalizes finished saves without blocking before each
optimizer step and after each batch, and blocking at the end of training; reports each committed save through the
trainer's logger (blocking seconds, bytes, GB/s, committed step and, across nodes, the newest
version replicated everywhere and how many ranks' newest is under-replicated). Added to a trainer's
callbacks (e.g. as run.Config(FlashpointCallback, ...) in a recipe), it wires the trainer
for flashpoint in its setup hook, so no code change is needed.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from ml_flashpoint_nemo.core import capture
from ml_flashpoint_nemo.nemo.settings import FlashpointSettings, checked_options
from ml_flashpoint_nemo.nemo.stale_handlers import OwnedHandler

if TYPE_CHECKING:  # both import NeMo's checkpoint IO stack, which the callback loads only once it wires a trainer
    from typing_extensions import Unpack

    from ml_flashpoint_nemo.nemo.checkpoint_io import FlashpointCheckpointIO, SaveOutcome
    from ml_flashpoint_nemo.nemo.drain import DurableDrain
    from ml_flashpoint_nemo.nemo.settings import FlashpointOptionValues


logger = logging.getLogger(__name__)
# At the end of training: how long the ranks wait for each other's replication pushes of the last version (a safety
# net: a push ends by itself within its I/O timeouts and rate floor), and for their own pushes between two gathers.
LAST_PUSHES_WAIT_S = 600.0
LAST_PUSHES_ROUND_S = 2.0


class FlashpointCallback(Callback):
    """RAM checkpoints of a NeMo MegatronStrategy trainer; options as for wrap_trainer_with_flashpoint."""

    def __init__(self, *, base_dir: str | os.PathLike[str] | None = None,
                 **options: Unpack[FlashpointOptionValues]) -> None:
        self.base_dir = base_dir
        self.options = checked_options(options)  # a bad option fails when the callback is made
        self.settings: FlashpointSettings | None = None
        self.io: FlashpointCheckpointIO | None = None  # the trainer's, set when wired
        self._blocking: dict[int, float] = {}
        self._last_saved_step: int | None = None
        self._save_owed = False  # a due save was deferred while earlier ones were sealing
        self.deferred_saves = 0  # how many due saves were taken late (or not at all) for that reason
        self.saves: list[dict[str, Any]] = []  # every reported save, for whoever wants the numbers
        self.drain: DurableDrain | None = None  # this rank's, while training with durable_every_n_steps
        self._durable_names: dict[int, str] = {}  # RAM step -> its durable checkpoint's NeMo name
        self._drained_up_to = 0  # the newest step asked to drain (or resumed from)
        self._preemption_handler: OwnedHandler | None = None  # installed while drains run with a preemption signal

    # --- wiring ------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from ml_flashpoint_nemo.nemo.wiring import refuse_unguarded_writes, wire_trainer  # NeMo's checkpoint IO stack

        if stage == "fit":  # first: what it drops can then be freed by the wiring's collection of stale trainers
            self._stop_drain()  # one left by an earlier fit of this callback whose teardown was cut short
        wire_trainer(trainer, self, base_dir=self.base_dir, options=self.options, warn_if_wired=False)
        if stage == "fit" and self.io is not None:
            if self.io.settings.overlap_capture:
                refuse_unguarded_writes(trainer, pl_module)
            self.io.begin_fit()  # in each rank's process, from its main thread, before the model is built

    def attach(self, settings: FlashpointSettings, io: FlashpointCheckpointIO) -> None:
        self.settings, self.io = settings, io

    # --- saving ------------------------------------------------------------------------------

    def _durable_saves_at(self, trainer: Any, step: int) -> bool:
        for callback in trainer.callbacks:
            every = getattr(callback, "_every_n_train_steps", 0) if isinstance(callback, ModelCheckpoint) else 0
            if every and every > 0 and step % every == 0:
                return True
        return False

    def should_save(self, trainer: Any, step: int) -> bool:
        """Every every_n_steps steps; a save due while max_saves_in_flight are still sealing is taken at the first
        later step where fewer are (never queued: each queued save would hold a buffer of the state's size)."""
        settings = self.settings
        if settings is None or not settings.enabled or step <= 0 or step == self._last_saved_step:
            return False
        if step % settings.every_n_steps != 0 and not self._save_owed:
            return False
        if settings.skip_durable_steps and self._durable_saves_at(trainer, step):
            self._save_owed = False  # the durable checkpoint of this step is newer than the owed save
            return False
        if self.io is not None and self.io.saves_in_flight() >= settings.max_saves_in_flight:
            if not self._save_owed:
                self.deferred_saves += 1
                logger.debug("Flashpoint save of step %d deferred: %d earlier save(s) still sealing", step,
                             self.io.saves_in_flight())
            self._save_owed = True
            return False
        self._save_owed = False
        return True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.io is None:
            return
        self._finalize(trainer, blocking=False)
        step = trainer.global_step
        if self.should_save(trainer, step):
            self.save(trainer, step)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Commit the previous step's save here, once the next step's forward and backward ran, not a step later.

        Its background sealing is then usually done, so a crash before this step's end loses at most
        this step: with a save every step, a SIGKILL after step S resumes from S or S-1. With
        overlap_capture the step first waits for the save's background copy of the tensors it writes.
        """
        if self.io is not None:
            capture.wait_for_captures("the optimizer step")
            self._finalize(trainer, blocking=False)

    def save(self, trainer: Any, step: int) -> None:
        """Take a RAM checkpoint of the current state as version `step` (every rank must call it)."""
        from ml_flashpoint_nemo.nemo.checkpoint_io import FLASHPOINT_SAVE, version_path

        assert self.settings is not None, "wired in setup"
        started = time.perf_counter()
        if self.drain is not None:
            self._durable_names[step] = durable_name(trainer, step)
        save_without_barrier(trainer, version_path(self.settings, step), {FLASHPOINT_SAVE: True})
        self._blocking[step] = time.perf_counter() - started
        self._last_saved_step = step

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.io is not None:
            self._finalize(trainer, blocking=True)
            self._let_the_last_pushes_land()
        if self.drain is not None:  # the drains in flight land before the process exits
            assert self.settings is not None
            deadline = time.monotonic() + self.settings.durable_timeout_s
            for step in self.drain.busy_with():
                self.drain.wait(step, max(0.0, deadline - time.monotonic()))
            self._stop_drain()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop_drain()

    # --- durable checkpoints drained from RAM --------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.io is not None and self.settings is not None and self.settings.drains and self.drain is None:
            self._start_drain(trainer)

    def _start_drain(self, trainer: Any) -> None:
        """Every rank, main thread: agree on this run's token, stage NeMo's context once, start the drain thread."""
        import uuid

        import torch.distributed as dist

        from ml_flashpoint_nemo.core.topology import problems_of_every_rank
        from ml_flashpoint_nemo.errors import DurableDrainError
        from ml_flashpoint_nemo.nemo.drain import TEMP_PREFIX, DurableDrain

        settings = self.settings
        assert settings is not None and settings.durable_dir is not None and settings.durable_every_n_steps
        token = [uuid.uuid4().hex[:12]]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        drain: DurableDrain | None = None
        problem: str | None = None
        try:  # nothing here may raise on this rank alone: the other ranks would go on training without it
            durable = Path(settings.durable_dir).absolute()
            context = durable / f"{TEMP_PREFIX}{token[0]}-context"
            prepare = _durable_dir_preparer(trainer, durable, context, token[0]) if trainer.is_global_zero else None
            drain = DurableDrain(
                base_dir=settings.base_dir, durable_dir=durable, rank=trainer.global_rank,
                world_size=trainer.world_size, token=token[0], keep=settings.durable_keep,
                bytes_per_s=settings.durable_bytes_per_s, timeout_s=settings.durable_timeout_s, context_dir=context,
                prepare=prepare,
            )
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            problem = f"rank {trainer.global_rank}: {type(exc).__name__}: {exc}"
        failed = problems_of_every_rank(problem) if dist.is_initialized() else [p for p in (problem,) if p]
        if failed:
            if drain is not None:
                drain.close()
            raise DurableDrainError("the durable drain cannot start on every rank, so training does not start: "
                                    + "; ".join(failed) + ". Fix the RAM or durable checkpoint directory of that "
                                    "rank, or run without durable_every_n_steps.")
        self.drain = drain
        self._drained_up_to = trainer.global_step
        if settings.preemption_signal is not None:
            from ml_flashpoint_nemo.nemo.settings import preemption_signal_number

            self._install_preemption_handler(preemption_signal_number(settings.preemption_signal))
        logger.info("Durable checkpoints drained from RAM every %d steps into %s", settings.durable_every_n_steps,
                    durable)

    def _maybe_drain(self, step: int) -> None:
        """A committed RAM version that crosses a multiple of durable_every_n_steps is drained."""
        from ml_flashpoint_nemo.nemo.drain import DrainRequest

        assert self.settings is not None and self.settings.durable_every_n_steps
        every = self.settings.durable_every_n_steps
        if self.drain is None or step // every <= self._drained_up_to // every:
            return
        self._drained_up_to = step
        name = self._durable_names.pop(step, None)
        self.drain.submit(DrainRequest(step, name or fallback_name(step)))
        for old in [s for s in self._durable_names if s < step]:
            del self._durable_names[old]

    def _on_preemption(self, signum: int, frame: FrameType | None) -> None:
        """Drain the newest committed RAM version (bounded by preemption_grace_s), then die of the signal."""
        from ml_flashpoint_nemo.core.layout import CheckpointLayout
        from ml_flashpoint_nemo.core.versions import committed_steps
        from ml_flashpoint_nemo.nemo.drain import DrainRequest

        drain, settings = self.drain, self.settings
        try:
            if drain is not None and settings is not None:
                deadline = time.monotonic() + settings.preemption_grace_s
                drain.throttle.unthrottle()
                newest = committed_steps(CheckpointLayout(settings.base_dir))[-1:]
                if newest and newest[0] > self._drained_up_to:
                    self._drained_up_to = newest[0]
                    drain.submit(DrainRequest(newest[0], self._durable_names.get(newest[0]) or fallback_name(newest[0])))
                for step in drain.busy_with():
                    if not drain.wait(step, max(0.0, deadline - time.monotonic())):
                        logger.error("The durable drain of step %d did not finish within preemption_grace_s=%g s",
                                     step, settings.preemption_grace_s)
                logger.warning("Exiting on signal %d after the durable drain", signum)
        except Exception:  # noqa: BLE001 - the process must still exit as the signal asks
            logger.exception("The durable drain on signal %d failed", signum)
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _install_preemption_handler(self, number: int) -> None:
        """Handle `number` with _on_preemption until this fit ends; a later wiring puts the old handler back if
        this fit's teardown is cut short (nemo/stale_handlers.py), once this fit's checkpoint IO is closed."""
        io = self.io
        assert io is not None, "wired"
        self._preemption_handler = OwnedHandler(number, self._on_preemption, owner_finished=lambda: io.closed,
                                                what="flashpoint's preemption handler")

    def _stop_drain(self) -> None:
        if self._preemption_handler is not None:
            handler, self._preemption_handler = self._preemption_handler, None
            handler.put_back()
        if self.drain is not None:
            self.drain.close()
            self.drain = None

    # --- reporting ---------------------------------------------------------------------------

    def _finalize(self, trainer: Any, *, blocking: bool) -> None:
        io = self.io
        assert io is not None, "called once wired"
        io.finalize_flashpoint(blocking=blocking)
        while io.outcomes:
            self._report(trainer, io.outcomes.pop(0))

    def _let_the_last_pushes_land(self) -> None:
        """End of training, every rank: wait until no rank is still pushing replicas (bounded), in rounds.

        Each rank stops its transfer server when it tears down; a rank that got there first would refuse a
        slower peer's push of the job's last RAM version, which would then not be on the node that has to
        resume from it after a restart on fewer nodes. Each round waits at most LAST_PUSHES_ROUND_S for this
        rank's own pushes and then reduces every rank's state (one fixed-size all-reduce), so no collective of
        this wait outlasts a short process-group timeout, and every rank leaves in the same round.
        """
        import torch.distributed as dist

        from ml_flashpoint_nemo.core.topology import reduced_ints

        assert self.io is not None, "called once wired"
        service = self.io.flashpoint_strategy.replication
        deadline = time.monotonic() + LAST_PUSHES_WAIT_S
        while True:
            done = service is None or service.wait_for_pushes(LAST_PUSHES_ROUND_S)
            late = time.monotonic() >= deadline
            waiting, any_late = int(not done), int(late)
            if dist.is_initialized():  # one fixed-size all-reduce (MAX) per round: anyone still pushing? late?
                waiting, any_late = reduced_ints([waiting, any_late])
            if not waiting:
                return
            if any_late:
                if not done or not dist.is_initialized() or dist.get_rank() == 0:
                    logger.warning("Replication of the last RAM checkpoint still runs after %.1f s%s; training ends "
                                   "anyway, and what is still pushed is refused by the ranks that exit",
                                   LAST_PUSHES_WAIT_S, " on this rank" if not done else " on some ranks")
                return

    def _replication_numbers(self) -> dict[str, float]:
        """Job-wide replication state at this save (collective: every rank reports the same saves).

        replicated_step: the newest version every rank has pushed to all its peers (-1: none yet);
        under_replicated_ranks: ranks with a failed push newer than their newest replicated version
        (a version skipped for a newer one is not a failure).
        """
        import torch.distributed as dist

        from ml_flashpoint_nemo.core.topology import reduced_ints

        assert self.io is not None, "called once wired"
        service = self.io.flashpoint_strategy.replication
        if service is None or not service.enabled or not dist.is_initialized():
            return {}
        try:
            newest, failed = service.progress()
        except Exception as exc:  # noqa: BLE001 - counted as under-replicated; every rank must reach the all-reduce
            logger.warning("Cannot tell the replication progress of this rank (%s: %s)", type(exc).__name__, exc)
            newest, failed = None, True
        # Fixed-size all-reduces whatever the job's size: the lowest newest replicated step, the failing ranks.
        (lowest,) = reduced_ints([-1 if newest is None else newest], dist.ReduceOp.MIN)
        (failing,) = reduced_ints([int(failed)], dist.ReduceOp.SUM)
        return {"flashpoint/replicated_step": float(lowest), "flashpoint/under_replicated_ranks": float(failing)}

    def _report(self, trainer: Any, outcome: SaveOutcome) -> None:
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
            "flashpoint/deferred_saves": float(self.deferred_saves),
        }
        numbers.update(self._replication_numbers())
        if self.drain is not None:
            self._maybe_drain(outcome.step)
        self.saves.append({"step": outcome.step, **numbers})
        if trainer.logger is not None:
            trainer.logger.log_metrics(numbers, step=trainer.global_step)
        if trainer.is_global_zero:
            logger.info("Flashpoint checkpoint of step %d committed: %.1f MB, training blocked %.3f s (%.2f GB/s)",
                        outcome.step, outcome.nbytes / 1e6, blocking, numbers["flashpoint/gbps"])


def durable_name(trainer: Any, step: int) -> str:
    """The name NeMo's ModelCheckpoint gives its newest ("-last") checkpoint at this point of training.

    From Lightning's own monitor candidates (no collective), formatted by the trainer's ModelCheckpoint;
    without one, "step=<step>-last". AutoResume only resumes from names ending in "last".
    """
    checkpoint = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    if checkpoint is None:
        return fallback_name(step)
    candidates = ModelCheckpoint._monitor_candidates(checkpoint, trainer)
    name = Path(checkpoint.format_checkpoint_name(candidates, checkpoint.CHECKPOINT_NAME_LAST)).name
    name = name.removesuffix(checkpoint.FILE_EXTENSION)
    return name if name.endswith("last") else f"{name}-last"


def fallback_name(step: int) -> str:
    return f"step={step}-last"


def _durable_dir_preparer(trainer: Any, durable: Path, context: Path, token: str) -> Callable[[], None]:
    """Rank 0's preparation of the durable directory, run first by its drain thread, off training's path.

    The trainer's NeMo context is captured here (its configs, as NeMo's own checkpoints take them) and
    written there: the dump took ~0.45 s of rank 0's start, which every rank waited for. A failure there
    is logged and the checkpoints are published without context, as NeMo's ModelCheckpoint does.
    """
    from ml_flashpoint_nemo.nemo.drain import remove_stale_drains

    captured: Any = None
    try:
        from nemo.lightning.io.pl import TrainerContext

        captured = TrainerContext.from_trainer(trainer)
    except Exception as exc:  # noqa: BLE001 - as NeMo's ModelCheckpoint: a checkpoint without context
        logger.warning("Could not capture the NeMo context for drained checkpoints: %s", exc)

    def prepare() -> None:
        durable.mkdir(parents=True, exist_ok=True)
        remove_stale_drains(durable, token)
        if captured is not None:
            captured.io_dump(context, yaml_attrs=["model"])

    return prepare


def save_without_barrier(trainer: Any, path: Any, storage_options: dict[str, Any]) -> None:
    """Lightning's Trainer.save_checkpoint without the barrier it ends with.

    That barrier lets file-based saves finish on every rank before any goes on; a RAM save is
    agreed and committed by its own collectives, so there it only made every save wait for the
    slowest rank. Lightning's own steps otherwise (dump_checkpoint, then the strategy's
    save_checkpoint); a trainer whose class overrides save_checkpoint takes its own whole.
    """
    from lightning.pytorch import Trainer

    dump_checkpoint = getattr(getattr(trainer, "_checkpoint_connector", None), "dump_checkpoint", None)
    if trainer.model is None or dump_checkpoint is None or type(trainer).save_checkpoint is not Trainer.save_checkpoint:
        trainer.save_checkpoint(path, storage_options=storage_options)
        return
    checkpoint = dump_checkpoint(False)
    trainer.strategy.save_checkpoint(checkpoint, path, storage_options=storage_options)
