"""ml_flashpoint_nemo: memory-first crash-recovery checkpointing for NeMo 2.0 and Megatron-core.

Checkpoints go to host RAM (a tmpfs) in seconds and are recovered from there after a
restart. The core (``ml_flashpoint_nemo.core``) needs torch only; the NeMo, Megatron
and DCP adapters import their frameworks lazily.
"""

from ml_flashpoint_nemo.errors import (
    BaseDirError,
    ChecksumError,
    CorruptCheckpointError,
    FlashpointError,
    FormatVersionError,
    LoadMismatchError,
    MissingKeyError,
    OutOfSpaceError,
    PoolBusyError,
    TrainerSetupError,
    UnsupportedValueError,
    VersionExistsError,
    VersionNotFoundError,
)

__version__ = "0.1.0"

__all__ = [
    "BaseDirError",
    "ChecksumError",
    "CorruptCheckpointError",
    "FlashpointError",
    "FormatVersionError",
    "LoadMismatchError",
    "MissingKeyError",
    "OutOfSpaceError",
    "PoolBusyError",
    "TrainerSetupError",
    "UnsupportedValueError",
    "VersionExistsError",
    "VersionNotFoundError",
    "__version__",
    "wrap_trainer_with_flashpoint",
]


def __getattr__(name: str):
    # NeMo is imported only by those who use the NeMo integration.
    if name == "wrap_trainer_with_flashpoint":
        from ml_flashpoint_nemo.nemo.wrap import wrap_trainer_with_flashpoint

        return wrap_trainer_with_flashpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
