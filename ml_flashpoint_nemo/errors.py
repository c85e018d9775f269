"""The exceptions ml_flashpoint_nemo raises.

Everything derives from :class:`FlashpointError`, so a training loop can catch one
type to skip a failed RAM checkpoint and carry on with its durable one. Each message
says what happened and what to do about it.
"""

from __future__ import annotations


class FlashpointError(Exception):
    """Base class of every error raised by ml_flashpoint_nemo."""


class BaseDirError(FlashpointError):
    """The checkpoint base directory cannot be used (missing, not writable, not a directory)."""


class OutOfSpaceError(FlashpointError):
    """The tmpfs holding the base directory is full; the save was abandoned, earlier versions are intact."""


class PoolBusyError(FlashpointError):
    """Another live process holds this rank's buffer pool."""


class UnsupportedValueError(FlashpointError, TypeError):
    """A value in the state cannot be stored (e.g. a sparse or quantized tensor, a non-string key)."""


class VersionNotFoundError(FlashpointError):
    """No committed version with the requested step exists."""


class VersionExistsError(FlashpointError, RuntimeError):
    """A committed version with this step already exists and overwriting was not requested.

    A RuntimeError too, what torch DCP's FileSystemWriter(overwrite=False) raises in the same case.
    """


class CorruptCheckpointError(FlashpointError):
    """A checkpoint file is truncated, malformed or fails its checksum."""


class ChecksumError(CorruptCheckpointError):
    """Bytes read back do not match the CRC32C recorded when they were written."""

    def __init__(self, message: str, *, path: str, key: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.key = key


class PeerFetchError(FlashpointError):
    """An object a load reads is on no reachable node that holds it (its peers or the network failed)."""


class FormatVersionError(FlashpointError):
    """A file was written in a format version this release cannot read (e.g. by a newer release).

    The file may be perfectly valid, so this is not a CorruptCheckpointError: code that drops
    or reports corrupt files must leave it alone. Code that only skips unusable versions
    catches both.
    """


class MissingKeyError(FlashpointError, KeyError):
    """A key asked for on load is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class LoadMismatchError(FlashpointError, ValueError):
    """A destination tensor's shape or dtype differs from the stored one."""


class ManagerStartError(FlashpointError):
    """The multiprocessing Manager needed by async saves failed to start or did not start in time."""


class TrainerSetupError(FlashpointError):
    """The trainer cannot be wired for flashpoint checkpoints as configured (strategy, checkpoint IO, options)."""


class ReplicationSecretError(FlashpointError):
    """The replication job secret is missing on some ranks, differs between ranks, or its file is unsafe."""


class ReplicationConfigError(FlashpointError, ValueError):
    """A ReplicationConfig setting is out of the range the transfer service accepts."""


class FailureDomainError(FlashpointError, ValueError):
    """A node's failure domain (FLASHPOINT_FAILURE_DOMAIN or ReplicationConfig.failure_domain) is malformed,
    could not be read, or the ranks of one node name different ones."""


class DurableDrainError(FlashpointError):
    """A durable checkpoint could not be drained from RAM; the previous durable checkpoint is intact."""


class LocalCheckpointError(FlashpointError):
    """A local checkpoint of NVRx's manager interface (ml_flashpoint_nemo.nvrx) could not be saved or loaded.

    What ml_flashpoint_nemo.nvrx raises is a subclass that is also NVRx's CheckpointingException, so
    code written for NVRx's own manager catches it as before.
    """


# The transfer service's errors are defined by the C++ core, which raises them; re-exported here
# so that users catch them from one place. TransferError derives from FlashpointError (the core
# looks it up here when it is imported, which is why this import comes last) and from OSError
# (callers that catch network failures as OSError keep working). TransferIntegrityError: a
# message on a replication connection failed its authentication tag (tampered with or corrupted
# on the way); nothing was stored.
from ml_flashpoint_nemo._core import TransferError, TransferIntegrityError  # noqa: E402, F401 - re-exported
