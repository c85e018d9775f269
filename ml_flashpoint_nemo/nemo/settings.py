"""What a user can set for flashpoint checkpoints of a NeMo trainer, checked once, up front, and what a wired
trainer carries (its settings, callback and checkpoint IO)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ml_flashpoint_nemo.errors import TrainerSetupError
from ml_flashpoint_nemo.nemo.job import default_base_dir

if TYPE_CHECKING:
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
    parallel_save: bool = True  # spread replicated tensors over the data-parallel ranks
    enabled: bool = True
    resume: bool = True

    def option_values(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in FlashpointOptions.__dataclass_fields__}

    def check(self) -> None:
        for name in ("every_n_steps", "keep", "replication_factor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainerSetupError(f"flashpoint option {name} must be an integer >= 1, got {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise TrainerSetupError(f"flashpoint option threads must be None or an integer >= 1, got {self.threads!r}")
        timeout = self.worker_timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise TrainerSetupError(f"flashpoint option worker_timeout_s must be a number of seconds > 0, got {timeout!r}")


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
    parallel_save: bool
    enabled: bool
    resume: bool


@dataclass(kw_only=True)
class FlashpointSettings(FlashpointOptions):
    """The options plus the resolved base directory of a wired trainer."""

    base_dir: Path

    @classmethod
    def create(cls, base_dir: str | os.PathLike[str] | None = None, **options: object) -> "FlashpointSettings":
        """Settings with the base directory resolved (FLASHPOINT_BASE_DIR or the job id) and options checked."""
        settings = cls(base_dir=Path(base_dir) if base_dir else default_base_dir(), **checked_options(options))
        return settings


def checked_options(options: dict[str, object]) -> dict[str, object]:
    """The options if every name is known and every value is valid; TrainerSetupError otherwise."""
    known = set(FlashpointOptions.__dataclass_fields__)
    unknown = set(options) - known
    if unknown:
        raise TrainerSetupError(f"unknown flashpoint option(s) {sorted(unknown)}; known: {sorted(known)}")
    FlashpointOptions(**options).check()  # type: ignore[arg-type]
    return options


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
