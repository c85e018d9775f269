"""use_flashpoint_local_checkpoints on real NeMo trainers (no training): one JSON line per check.

Run forked from a NeMo-imported server by tests/test_nvrx_nemo.py; argv[1] is a base directory.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable


def trainer(callbacks: list[Any] | None = None, async_save: bool = False) -> Any:
    from nemo import lightning as nl

    return nl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks or [],
        strategy=nl.MegatronStrategy(ckpt_async_save=async_save),
    )


def wiring(t: Any) -> dict[str, Any]:
    """What the call may change: the strategy's checkpoint IO and the local checkpoint callbacks."""
    from nvidia_resiliency_ext.ptl_resiliency.local_checkpoint_callback import LocalCheckpointCallback

    io = t.strategy.checkpoint_io
    inner = getattr(io, "checkpoint_io", None)
    return {
        "io": type(io).__name__,
        "inner": type(inner).__name__ if inner is not None else None,
        "local_callbacks": [cb._every_n_train_steps for cb in t.callbacks if isinstance(cb, LocalCheckpointCallback)],
    }


def outcome(t: Any, call: Callable[[], Any]) -> dict[str, Any]:
    before = wiring(t)
    try:
        call()
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "before": before, "after": wiring(t)}


def main() -> None:
    from nvidia_resiliency_ext.ptl_resiliency.local_checkpoint_callback import LocalCheckpointCallback

    from ml_flashpoint_nemo.nvrx import use_flashpoint_local_checkpoints as use

    base = sys.argv[1]
    checks: dict[str, Any] = {}
    t = trainer()
    checks["no_interval"] = outcome(t, lambda: use(t, base))
    t = trainer()
    checks["bad_session"] = outcome(t, lambda: use(t, base, every_n_train_steps=2, session_id="../other"))
    t = trainer()
    checks["resume_without_session"] = outcome(t, lambda: use(t, base, every_n_train_steps=2,
                                                             resume_without_global=True))
    t = trainer()
    checks["sync"] = outcome(t, lambda: use(t, base, every_n_train_steps=2))
    checks["twice"] = outcome(t, lambda: use(t, base, every_n_train_steps=2))
    t = trainer(async_save=True)
    checks["async"] = outcome(t, lambda: use(t, base, every_n_train_steps=2))
    checks["async_flag"] = t.strategy.checkpoint_io.checkpoint_io.async_save
    t = trainer(callbacks=[LocalCheckpointCallback(every_n_train_steps=3)])
    checks["own_callback"] = outcome(t, lambda: use(t, base))
    print(json.dumps(checks))


if __name__ == "__main__":
    main()
