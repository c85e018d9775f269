"""FlashpointPlugin: flashpoint RAM checkpoints for a NeMo 2.0 recipe run with NeMo-Run, no code change.

    run.run(recipe, executor=executor, plugins=[FlashpointPlugin(every_n_steps=100)])

It adds run.Config(FlashpointCallback, ...) to the recipe's trainer callbacks (the
callback wires the trainer in its setup hook) and, unless told not to, replaces the
recipe's resume with a FlashpointAutoResume that wraps it (the durable fallback). The
executor's environment gets the job id, so every restart of the run finds its RAM
versions: NeMo-Run's experiment id, unless the scheduler provides one. It also gets a fresh
replication secret per experiment (FLASHPOINT_REPLICATION_SECRET), so the secret reaches
the ranks with the job's environment instead of crossing the training network; unless the
executor already names a secret or a secret file (see docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nemo_run as run

from ml_flashpoint_nemo.nemo.callback import FlashpointCallback
from ml_flashpoint_nemo.nemo.job import JOB_ID_ENV
from ml_flashpoint_nemo.nemo.resume import FlashpointAutoResume
from ml_flashpoint_nemo.nemo.settings import FlashpointOptions
from ml_flashpoint_nemo.replication.secret import SECRET_ENV, SECRET_FILE_ENV, new_secret_hex


@dataclass(kw_only=True)
class FlashpointPlugin(FlashpointOptions, run.Plugin):
    """Options as for wrap_trainer_with_flashpoint; base_dir None means FLASHPOINT_BASE_DIR or the job id."""

    base_dir: str | None = None
    wrap_resume: bool = True  # replace the recipe's resume by a FlashpointAutoResume wrapping it

    def __post_init__(self) -> None:
        self.check()  # a bad option fails when the recipe is configured, not on the cluster

    def setup(self, task: Any, executor: Any) -> None:
        trainer = getattr(task, "trainer", None)
        if trainer is None:
            raise ValueError(f"FlashpointPlugin needs a task with a trainer (a NeMo recipe), got {type(task).__name__}")
        callback = run.Config(FlashpointCallback, base_dir=self.base_dir, **self.option_values())
        callbacks = list(getattr(trainer, "callbacks", None) or [])
        if not any(getattr(c, "__fn_or_cls__", None) is FlashpointCallback for c in callbacks):
            callbacks.append(callback)
        trainer.callbacks = callbacks
        resume = getattr(task, "resume", None)
        if self.wrap_resume and getattr(resume, "__fn_or_cls__", None) is not FlashpointAutoResume:
            task.resume = run.Config(FlashpointAutoResume, durable=resume)
        env = getattr(executor, "env_vars", None) if executor is not None else None
        if env is not None:
            if self.experiment_id:
                env.setdefault(JOB_ID_ENV, self.experiment_id)
            if not env.get(SECRET_ENV) and not env.get(SECRET_FILE_ENV):
                env[SECRET_ENV] = new_secret_hex()  # one per experiment; setup again keeps it (set above)
