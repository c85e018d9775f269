"""In a fresh process: wrap_trainer_with_flashpoint's outcomes on real NeMo trainers (no training).

Prints one line per check for tests/test_nemo_wrap.py to assert on.
"""

from __future__ import annotations

import os
import sys
import time


def trainer(strategy=None):
    from nemo import lightning as nl

    return nl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      strategy=strategy or nl.MegatronStrategy(ckpt_async_save=False))


def outcome(action) -> str:
    try:
        return f"ok {action()}"
    except Exception as exc:  # noqa: BLE001 - printed for the test
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    for name in [n for n in os.environ if n in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "FLASHPOINT_JOB_ID")]:
        del os.environ[name]
    os.environ.pop("FLASHPOINT_BASE_DIR", None)
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint
    from ml_flashpoint_nemo.nemo import FlashpointCallback, FlashpointCheckpointIO

    base = sys.argv[1]
    print("NO_JOB_ID", outcome(lambda: wrap_trainer_with_flashpoint(trainer())), flush=True)
    print("WRONG_STRATEGY", outcome(lambda: wrap_trainer_with_flashpoint(trainer(SingleDeviceStrategy("cpu")),
                                                                         base_dir=base)), flush=True)
    print("BAD_OPTION", outcome(lambda: wrap_trainer_with_flashpoint(trainer(), base_dir=base, every_n_steps=0)))
    print("UNKNOWN_OPTION", outcome(lambda: wrap_trainer_with_flashpoint(trainer(), base_dir=base, evry_n_steps=5)))

    wired = trainer()
    durable = wired.strategy.checkpoint_io
    started = time.perf_counter()
    first = wrap_trainer_with_flashpoint(wired, base_dir=base, every_n_steps=3)
    print(f"WRAP_MS {(time.perf_counter() - started) * 1e3:.2f}")
    second = wrap_trainer_with_flashpoint(wired, base_dir=base)
    io = wired.strategy.checkpoint_io
    print("TWICE same_callback", first is second,
          "one_callback", sum(isinstance(c, FlashpointCallback) for c in wired.callbacks) == 1,
          "io_wraps_durable", isinstance(io, FlashpointCheckpointIO) and io.checkpoint_io is durable)
    os.environ["SLURM_JOB_ID"] = "4242"
    from_env = trainer()
    wrap_trainer_with_flashpoint(from_env)
    print("JOB_ID_BASE", from_env._flashpoint.settings.base_dir)
    for t in (wired, from_env):
        t._flashpoint.io.close()


if __name__ == "__main__":
    main()
