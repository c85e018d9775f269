"""NVRx's local-checkpoint manager interface on RAM versions (docs/nvrx.md).

``FlashpointLocalCheckpointManager("/dev/shm/ckpt")`` goes where NVRx's ``LocalCheckpointManager`` went.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ml_flashpoint_nemo._lazy import lazy_exports

if TYPE_CHECKING:  # what the lazy exports below resolve to, for type checkers and IDEs
    from ml_flashpoint_nemo.nvrx.conversion import InvalidShardingError, TensorAwareConversion
    from ml_flashpoint_nemo.nvrx.manager import FlashpointLocalCheckpointManager, LocalCheckpointingError
    from ml_flashpoint_nemo.nvrx.trainer import FlashpointHierarchicalCheckpointIO, use_flashpoint_local_checkpoints

_EXPORTS = {
    "InvalidShardingError": "conversion",
    "TensorAwareConversion": "conversion",
    "FlashpointLocalCheckpointManager": "manager",
    "LocalCheckpointingError": "manager",
    "FlashpointHierarchicalCheckpointIO": "trainer",
    "use_flashpoint_local_checkpoints": "trainer",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
