"""The base directory of a job's RAM checkpoints, found the same way by every restart of the job.

A restarted job must find the versions its previous incarnation left on the tmpfs, so
the default base directory is keyed by an id that stays the same across restarts of
one job and differs between jobs: the scheduler's job id, or the elastic launcher's
run id. Without such an id there is no safe default, and the user is told what to set.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from ml_flashpoint_nemo.errors import BaseDirError

BASE_DIR_ENV = "FLASHPOINT_BASE_DIR"
JOB_ID_ENV = "FLASHPOINT_JOB_ID"
DEFAULT_ROOT = Path("/dev/shm/ml_flashpoint")

# Checked in order; the first one set names the job. torchrun/ft_launcher's run id is
# stable across in-job restarts; its default "none" names nothing.
_JOB_ID_VARIABLES = (
    JOB_ID_ENV,
    "SLURM_ARRAY_JOB_ID",  # with SLURM_ARRAY_TASK_ID: one directory per array task
    "SLURM_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",
    "FLUX_JOB_ID",
    "TORCHX_APP_ID",
    "TORCHELASTIC_RUN_ID",
)
_UNUSABLE_IDS = {"", "none", "default"}
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def job_id_from_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """The job id the launcher or scheduler put in the environment, made safe for a path; None if none."""
    env = os.environ if environ is None else environ
    for name in _JOB_ID_VARIABLES:
        value = env.get(name, "").strip()
        if value.lower() in _UNUSABLE_IDS:
            continue
        if name == "SLURM_ARRAY_JOB_ID" and env.get("SLURM_ARRAY_TASK_ID"):
            value = f"{value}_{env['SLURM_ARRAY_TASK_ID']}"
        safe = _SAFE.sub("_", value).strip("._")
        if safe:
            return safe
    return None


def default_base_dir(environ: Mapping[str, str] | None = None) -> Path:
    """FLASHPOINT_BASE_DIR, else /dev/shm/ml_flashpoint/<job id>; raises BaseDirError without either."""
    env = os.environ if environ is None else environ
    explicit = env.get(BASE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit)
    job_id = job_id_from_environment(env)
    if job_id is None:
        raise BaseDirError(
            "cannot choose a RAM checkpoint directory: no job id in the environment "
            f"(looked for {', '.join(_JOB_ID_VARIABLES)}). A restart must find the same directory, so set "
            f"{BASE_DIR_ENV}=/dev/shm/<something unique to this job> or {JOB_ID_ENV}=<job id>, "
            "or pass base_dir= explicitly."
        )
    return DEFAULT_ROOT / job_id
