"""The uninterrupted 2-rank NeMo run that the end-to-end tests compare with, bit for bit.

tests/support/nemo_train.py with --route none: no flashpoint, fixed seeds, REFERENCE_STEPS steps.
Its losses and final state do not depend on any test (nor on flashpoint's or async-save flags,
which it does not use), so the session computes it once (conftest's nemo_reference) instead of
once per test module: each run is two NeMo processes, forked from tests/support/fork_server.py's server.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.support.fork_server import COVERAGE_VARIABLES, nemo_popen
from tests.support.multiproc import REPO

sys.path.insert(0, str(REPO / "examples"))

from launch import launch_ranks  # noqa: E402

REFERENCE_STEPS = 8
TRAIN_SCRIPT = str(REPO / "tests" / "support" / "nemo_train.py")


def train_reference(out: Path, timeout: float = 400) -> Path:
    """Run the reference into out/reference (where quickstart.compare looks) and return out. It runs no code of
    ours, so it runs without coverage (see conftest's unmeasured)."""
    env = {name: value for name, value in os.environ.items() if name not in COVERAGE_VARIABLES}
    code = launch_ranks(TRAIN_SCRIPT, ["--steps", str(REFERENCE_STEPS), "--out", str(out / "reference"),
                                       "--base", str(out / "unused-base"), "--route", "none"],
                        timeout=timeout, env=env, log_dir=out / "reference", popen=nemo_popen)
    assert code == 0, (out / "reference" / "rank-0.log").read_text()[-4000:]
    return out


def link_reference(reference: Path, out: Path) -> None:
    """Make out/reference the session's reference run, as quickstart.compare(out) expects."""
    (out / "reference").symlink_to(reference / "reference")
