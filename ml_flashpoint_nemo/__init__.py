"""ml_flashpoint_nemo: memory-first crash-recovery checkpointing for NeMo 2.0 and Megatron-core.

Checkpoints go to host RAM (a tmpfs) in seconds and are recovered from there after a
restart. The core (``ml_flashpoint_nemo.core``) needs torch only; the NeMo, Megatron
and DCP adapters import their frameworks lazily.
"""

from typing import TYPE_CHECKING

from ml_flashpoint_nemo._lazy import lazy_exports
from ml_flashpoint_nemo.errors import (
    BaseDirError,
    ChecksumError,
    CorruptCheckpointError,
    DurableDrainError,
    FailureDomainError,
    FlashpointError,
    FormatVersionError,
    LoadMismatchError,
    LocalCheckpointError,
    ManagerStartError,
    MissingKeyError,
    OutOfSpaceError,
    PeerFetchError,
    PoolBusyError,
    ReplicationConfigError,
    ReplicationSecretError,
    TrainerSetupError,
    TransferError,
    TransferIntegrityError,
    UnsupportedValueError,
    VersionExistsError,
    VersionNotFoundError,
)

__version__ = "0.1.0"

if TYPE_CHECKING:  # what the lazy exports below resolve to, for type checkers and IDEs
    from ml_flashpoint_nemo.nemo.inprocess import FlashpointAbort
    from ml_flashpoint_nemo.nemo.wrap import wrap_trainer_with_flashpoint

# NeMo (and NVRx) are imported only by those who use those integrations.
_EXPORTS = {
    "FlashpointAbort": "nemo.inprocess",
    "wrap_trainer_with_flashpoint": "nemo.wrap",
}

__all__ = [
    "BaseDirError",
    "ChecksumError",
    "CorruptCheckpointError",
    "DurableDrainError",
    "FailureDomainError",
    "FlashpointAbort",
    "FlashpointError",
    "FormatVersionError",
    "PeerFetchError",
    "LoadMismatchError",
    "LocalCheckpointError",
    "ManagerStartError",
    "MissingKeyError",
    "OutOfSpaceError",
    "PoolBusyError",
    "ReplicationConfigError",
    "ReplicationSecretError",
    "TrainerSetupError",
    "TransferError",
    "TransferIntegrityError",
    "UnsupportedValueError",
    "VersionExistsError",
    "VersionNotFoundError",
    "__version__",
    "wrap_trainer_with_flashpoint",
]

__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
