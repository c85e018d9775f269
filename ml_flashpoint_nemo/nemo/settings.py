"""What a user can set for flashpoint checkpoints of a NeMo trainer, checked once, up front, and what a wired
trainer carries (its settings, callback and checkpoint IO)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, TypedDict, cast

from ml_flashpoint_nemo.errors import TrainerSetupError
from ml_flashpoint_nemo.nemo.job import default_base_dir

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ml_flashpoint_nemo.nemo.callback import FlashpointCallback
    from ml_flashpoint_nemo.nemo.checkpoint_io import FlashpointCheckpointIO

DEFAULT_EVERY_N_STEPS = 50


@dataclass(kw_only=True)
class FlashpointOptions:
    """Options of wrap_trainer_with_flashpoint, FlashpointCallback and FlashpointPlugin."""

    every_n_steps: int = DEFAULT_EVERY_N_STEPS
    skip_durable_steps: bool = True
    keep: int = 1
    replication_factor: int = 2
    threads: int | None = None
    async_save: bool | None = None  # None: follow the strategy's ckpt_async_save
    checksum: bool = True
    persistent_worker: bool = True  # one spawned worker for every save; False: a fork per save (blocks longer)
    worker_timeout_s: float = 600.0  # a background write not done by then is stopped and fails on every rank
    max_saves_in_flight: int = 1  # a due save waits (untaken) while this many are still sealing: RAM stays bounded
    overlap_capture: bool = False  # async saves return before host tensors are copied; the next optimizer step waits
    parallel_save: bool = True  # spread replicated tensors over the data-parallel ranks
    enabled: bool = True
    resume: bool = True
    # durable checkpoints drained from RAM (nemo/drain.py); off unless durable_every_n_steps is set
    durable_every_n_steps: int | None = None
    durable_dir: str | None = None  # where plain NeMo finds them: the ModelCheckpoint dirpath (<log_dir>/checkpoints)
    durable_keep: int = 2  # newest drained checkpoints kept
    durable_bytes_per_s: float | None = None  # per rank; None: as fast as the filesystem takes it
    durable_timeout_s: float = 600.0  # rank 0 waits this long for the other ranks' shares
    preemption_signal: str | None = "SIGTERM"  # drain the newest RAM version on it, then exit; None: off
    preemption_grace_s: float = 20.0  # bound of that drain (SLURM's default KillWait is 30 s)

    def option_values(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in FlashpointOptions.__dataclass_fields__}

    def check(self) -> None:
        for name in ("every_n_steps", "keep", "replication_factor", "max_saves_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainerSetupError(f"flashpoint option {name} must be an integer >= 1, got {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise TrainerSetupError(f"flashpoint option threads must be None or an integer >= 1, got {self.threads!r}")
        for name in ("worker_timeout_s", "durable_timeout_s", "preemption_grace_s"):
            _check_positive(name, getattr(self, name))
        if self.durable_bytes_per_s is not None:
            _check_positive("durable_bytes_per_s", self.durable_bytes_per_s)
        every = self.durable_every_n_steps
        if every is not None:
            if not isinstance(every, int) or isinstance(every, bool) or every < 1:
                raise TrainerSetupError(f"flashpoint option durable_every_n_steps must be None or an integer >= 1, "
                                        f"got {every!r}")
            if not self.durable_dir:
                raise TrainerSetupError("flashpoint option durable_every_n_steps needs durable_dir: the directory "
                                        "NeMo's ModelCheckpoint writes to (<log_dir>/checkpoints)")
        if not isinstance(self.durable_keep, int) or isinstance(self.durable_keep, bool) or self.durable_keep < 1:
            raise TrainerSetupError(f"flashpoint option durable_keep must be an integer >= 1, got {self.durable_keep!r}")
        if self.preemption_signal is not None:
            preemption_signal_number(self.preemption_signal)

    @property
    def drains(self) -> bool:
        """Durable checkpoints are drained from RAM versions."""
        return self.enabled and self.durable_every_n_steps is not None


def preemption_signal_number(name: str) -> int:
    """The signal number of a name such as "SIGTERM" or "SIGUSR1"; TrainerSetupError if there is none."""
    import signal

    number = getattr(signal, str(name), None) if str(name).startswith("SIG") else None
    if not isinstance(number, signal.Signals) or number in (signal.SIGKILL, signal.SIGSTOP):
        raise TrainerSetupError(f"flashpoint option preemption_signal must name a catchable signal such as "
                                f"'SIGTERM' or 'SIGUSR1', or be None; got {name!r}")
    return int(number)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise TrainerSetupError(f"flashpoint option {name} must be a number > 0, got {value!r}")


class FlashpointOptionValues(TypedDict, total=False):
    """FlashpointOptions as keyword arguments (`**options: Unpack[FlashpointOptionValues]`): type checkers
    then know each option's name and type. Defaults and meanings are FlashpointOptions'; a test keeps the two equal."""

    every_n_steps: int
    skip_durable_steps: bool
    keep: int
    replication_factor: int
    threads: int | None
    async_save: bool | None
    checksum: bool
    persistent_worker: bool
    worker_timeout_s: float
    max_saves_in_flight: int
    overlap_capture: bool
    parallel_save: bool
    enabled: bool
    resume: bool
    durable_every_n_steps: int | None
    durable_dir: str | None
    durable_keep: int
    durable_bytes_per_s: float | None
    durable_timeout_s: float
    preemption_signal: str | None
    preemption_grace_s: float


@dataclass(kw_only=True)
class FlashpointSettings(FlashpointOptions):
    """The options plus the resolved base directory of a wired trainer."""

    base_dir: Path

    @classmethod
    def create(cls, base_dir: str | os.PathLike[str] | None = None,
               **options: Unpack[FlashpointOptionValues]) -> "FlashpointSettings":
        """Settings with the base directory resolved (FLASHPOINT_BASE_DIR or the job id) and options checked."""
        settings = cls(base_dir=Path(base_dir) if base_dir else default_base_dir(), **checked_options(options))
        if settings.durable_dir is not None:
            base, durable = os.path.realpath(settings.base_dir), os.path.realpath(settings.durable_dir)
            if os.path.commonpath([base, durable]) in (base, durable):
                raise TrainerSetupError(f"flashpoint option durable_dir {settings.durable_dir} overlaps the RAM "
                                        f"checkpoint directory {settings.base_dir}; put durable checkpoints on disk")
        return settings


def checked_options(options: Mapping[str, object]) -> FlashpointOptionValues:
    """The options if every name is known and every value is valid; TrainerSetupError otherwise."""
    known = set(FlashpointOptions.__dataclass_fields__)
    unknown = set(options) - known
    if unknown:
        raise TrainerSetupError(f"unknown flashpoint option(s) {sorted(unknown)}; known: {sorted(known)}")
    named = cast(FlashpointOptionValues, options)  # every name is an option's; check() tests the values
    FlashpointOptions(**named).check()
    return named


@dataclass(frozen=True)
class FlashpointWiring:
    """What wiring attached to a trainer, kept as trainer._flashpoint."""

    settings: FlashpointSettings
    callback: FlashpointCallback
    io: FlashpointCheckpointIO


def wiring_of(trainer: Any) -> FlashpointWiring | None:
    """The trainer's flashpoint wiring, None if it is not wired."""
    return getattr(trainer, "_flashpoint", None)


def flashpoint_settings_of(trainer: Any) -> FlashpointSettings | None:
    """The settings of a wired trainer, None if it is not wired."""
    wiring = wiring_of(trainer)
    return wiring.settings if wiring is not None else None
