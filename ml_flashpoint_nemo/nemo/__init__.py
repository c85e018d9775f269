"""NeMo 2.0 integration: one-line wrapping, checkpoint IO routing, callback, AutoResume, NeMo-Run plugin,
and the abort step for NVRx in-process restarts.

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint
    wrap_trainer_with_flashpoint(trainer)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ml_flashpoint_nemo._lazy import lazy_exports

if TYPE_CHECKING:  # what the lazy exports below resolve to, for type checkers and IDEs
    from ml_flashpoint_nemo.nemo.callback import FlashpointCallback
    from ml_flashpoint_nemo.nemo.checkpoint_io import FlashpointCheckpointIO
    from ml_flashpoint_nemo.nemo.inprocess import FlashpointAbort
    from ml_flashpoint_nemo.nemo.plugin import FlashpointPlugin
    from ml_flashpoint_nemo.nemo.resume import FlashpointAutoResume
    from ml_flashpoint_nemo.nemo.settings import FlashpointSettings
    from ml_flashpoint_nemo.nemo.wrap import wrap_trainer_with_flashpoint

_EXPORTS = {
    "FlashpointAbort": "inprocess",
    "FlashpointAutoResume": "resume",
    "FlashpointCallback": "callback",
    "FlashpointCheckpointIO": "checkpoint_io",
    "FlashpointPlugin": "plugin",
    "FlashpointSettings": "settings",
    "wrap_trainer_with_flashpoint": "wrap",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
