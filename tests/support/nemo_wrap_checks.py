"""In a fresh process: wrap_trainer_with_flashpoint's outcomes on real NeMo trainers (no training).

Prints one line per check for tests/test_nemo_wrap.py to assert on.
"""

from __future__ import annotations

import os
import sys
import time

from ml_flashpoint_nemo.nemo.checkpoint_io import FlashpointCheckpointIO


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
    from ml_flashpoint_nemo.nemo import FlashpointCallback

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
    print("ROUTING", routing(wired, base))
    print("SHOULD_SAVE", should_save_steps(base))
    os.environ["SLURM_JOB_ID"] = "4242"
    from_env = trainer()
    wrap_trainer_with_flashpoint(from_env)
    print("JOB_ID_BASE", from_env._flashpoint.settings.base_dir)
    print("OVERLAP_REFUSED", overlap_refusals(base))
    plugin_trainer = recipe_with_plugin(base)
    print("FORK_WARNINGS", fork_warnings(base))
    for t in (wired, from_env, plugin_trainer):
        t._flashpoint.io.close()


def fork_warnings(base: str) -> str:
    """How many fork-deadlock warnings wrapping logs with a fork per save, and with the persistent worker."""
    import logging

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint
    from ml_flashpoint_nemo.nemo import checkpoint_io

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    counts = []
    for persistent in (False, True):
        collect = Collect()
        checkpoint_io.logger.addHandler(collect)
        checkpoint_io._warn_fork_can_deadlock.cache_clear()  # it warns once per process
        wrapped = trainer()
        wrap_trainer_with_flashpoint(wrapped, base_dir=f"{base}-fork-{persistent}", persistent_worker=persistent)
        wrapped._flashpoint.io.close()
        checkpoint_io.logger.removeHandler(collect)
        counts.append(sum("gh-112275" in m and "persistent_worker=True" in m for m in collect.messages))
    forks_can_deadlock = sys.version_info < checkpoint_io.FORK_SAFE_PYTHON
    return f"fork {counts[0]} persistent {counts[1]} fork_can_deadlock {forks_can_deadlock}"


def overlap_refusals(base: str) -> str:
    """overlap_capture with NeMo's EMA callback, then with an MoE expert bias: each fit's set-up refuses it."""
    from types import SimpleNamespace

    from nemo.collections.common.callbacks import EMA

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint

    results = []
    for extra, config in ((EMA(decay=0.9), None), (None, SimpleNamespace(moe_router_enable_expert_bias=True))):
        t = trainer()
        if extra is not None:
            t.callbacks.append(extra)
        callback = wrap_trainer_with_flashpoint(t, base_dir=base, overlap_capture=True)
        results.append(outcome(lambda: callback.setup(t, SimpleNamespace(config=config), "fit")))
        callback.io.close()
    return " | ".join(results)


def routing(wired, base: str) -> str:
    """Which IO a path goes to: removal of a RAM version vs a durable one, and the refused mixes."""
    import tempfile

    import torch

    from ml_flashpoint_nemo.core import CheckpointSaver, committed_steps
    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.nemo.checkpoint_io import FLASHPOINT_SAVE

    io = wired.strategy.checkpoint_io
    with CheckpointSaver(base, rank=0) as saver:
        saver.save(5, {"w": torch.ones(4)})
    io.remove_checkpoint(os.path.join(base, "step-5"))
    durable = tempfile.mkdtemp(prefix="durable-")
    io.remove_checkpoint(durable)
    marked_outside = outcome(lambda: io.save_checkpoint({}, os.path.join(durable, "step-3"), {FLASHPOINT_SAVE: True}))
    unmarked_inside = outcome(lambda: io.save_checkpoint({}, os.path.join(base, "step-3")))
    return (f"ram_removed {committed_steps(CheckpointLayout(base)) == []} durable_removed {not os.path.exists(durable)} "
            f"marked_outside {marked_outside.split(':')[0]} unmarked_inside {unmarked_inside.split(':')[0]}")


def should_save_steps(base: str) -> str:
    """Steps 1-12 at which the callback saves: every 2, skipping the durable ModelCheckpoint's every 3."""
    from nemo.lightning.pytorch.callbacks import ModelCheckpoint

    from ml_flashpoint_nemo import wrap_trainer_with_flashpoint

    found = []
    for options in ({}, {"skip_durable_steps": False}, {"enabled": False}):
        t = trainer()
        t.callbacks.append(ModelCheckpoint(every_n_train_steps=3))
        callback = wrap_trainer_with_flashpoint(t, base_dir=base, every_n_steps=2, **options)
        found.append(",".join(str(step) for step in range(1, 13) if callback.should_save(t, step)) or "-")
        t._flashpoint.io.close()
    return " ".join(found)


def recipe_with_plugin(base: str):
    """A real NeMo 2.0 recipe + FlashpointPlugin, its trainer built from the config (on CPU) and set up."""
    import fiddle as fdl
    import nemo_run as run
    from nemo.collections import llm

    from ml_flashpoint_nemo.nemo import FlashpointAutoResume, FlashpointCallback, FlashpointPlugin

    recipe = llm.llama3_8b.pretrain_recipe(name="flashpoint", dir=base, num_nodes=1, num_gpus_per_node=1)
    durable_resume = recipe.resume
    plugin = FlashpointPlugin(every_n_steps=7, base_dir=base)
    plugin.assign("exp-123")
    executor = run.LocalExecutor()
    plugin.setup(recipe, executor)
    secret = executor.env_vars.get("FLASHPOINT_REPLICATION_SECRET")
    plugin.setup(recipe, executor)  # twice: still one callback, resume wrapped once, the same secret
    assert secret is not None and len(bytes.fromhex(secret)) == 32, secret
    assert executor.env_vars["FLASHPOINT_REPLICATION_SECRET"] == secret
    with_file = run.LocalExecutor(env_vars={"FLASHPOINT_REPLICATION_SECRET_FILE": "/run/secret"})
    plugin.setup(recipe, with_file)  # a secret file named by the user wins: no variable added
    assert "FLASHPOINT_REPLICATION_SECRET" not in with_file.env_vars, with_file.env_vars
    configs = [c for c in recipe.trainer.callbacks if getattr(c, "__fn_or_cls__", None) is FlashpointCallback]
    resume = fdl.build(recipe.resume)
    print("PLUGIN_CONFIG callbacks", len(configs), "resume", type(resume).__name__,
          "durable", resume.durable == fdl.build(durable_resume), "job_id", executor.env_vars.get("FLASHPOINT_JOB_ID"))
    recipe.trainer.accelerator, recipe.trainer.devices = "cpu", 1  # the recipe targets GPUs
    trainer = fdl.build(recipe.trainer)
    callback = next(c for c in trainer.callbacks if isinstance(c, FlashpointCallback))
    callback.setup(trainer, None, "fit")  # what Lightning does at fit
    print("PLUGIN_TRAINER wired", isinstance(trainer.strategy.checkpoint_io, FlashpointCheckpointIO),
          "every", trainer._flashpoint.settings.every_n_steps, "auto_resume", isinstance(resume, FlashpointAutoResume))
    return trainer


if __name__ == "__main__":
    main()
