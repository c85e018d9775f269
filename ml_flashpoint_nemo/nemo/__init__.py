"""NeMo 2.0 integration: one-line wrapping, checkpoint IO routing, callback, AutoResume, NeMo-Run plugin,
and the abort step for NVRx in-process restarts.

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint
    wrap_trainer_with_flashpoint(trainer)
"""

from __future__ import annotations

from ml_flashpoint_nemo._lazy import lazy_exports

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
