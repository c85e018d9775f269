"""The README's main job runs and passes its own bit-exact check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unmeasured  # its processes repeat paths measured by other tests (conftest)
REPO = Path(__file__).resolve().parents[1]


def test_core_demo_recovers_bit_exact():
    result = subprocess.run(
        [sys.executable, "examples/core_demo.py", "--steps", "12", "--save-every", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trainer died with signal 9" in result.stdout
    assert "PASS: parameters and optimizer state after recovery are bit-identical" in result.stdout
    assert not list(Path("/dev/shm").glob("flashpoint-demo-*")), "the demo left RAM checkpoints behind"


def test_gpu_pretrain_example_configures_a_real_recipe_with_flashpoint(tmp_path):
    """It needs GPUs to train; --dryrun configures the recipe, executor and plugin and prints the task."""
    env = dict(os.environ, NEMORUN_HOME=str(tmp_path / "nemo_run"))
    result = subprocess.run(
        [sys.executable, "examples/pretrain_gpt_flashpoint.py", "--gpus", "2", "--dryrun", "--dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "'FLASHPOINT_JOB_ID'" in result.stdout  # the plugin gave the executor the experiment id
