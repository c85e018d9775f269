"""Every process exits: a trainer that fails while a helper of ours never booted exits promptly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.orphans import REPO, gone, repo_env

EXIT_DEADLINE_S = 30.0  # after the helper's pid is known; import and the worker's 3 s bound come first


@pytest.mark.parametrize("helper", ["worker", "manager"])
def test_a_failing_trainer_exits_although_its_helper_never_booted(helper: str) -> None:
    parent = subprocess.Popen([sys.executable, "-m", "tests.support.exit_parent", helper], cwd=REPO, env=repo_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("HELPER PID "), (line, parent.poll())
        helper_pid = int(line.split()[-1])
        give_up = time.monotonic() + EXIT_DEADLINE_S
        while parent.poll() is None and time.monotonic() < give_up:
            time.sleep(0.05)
        assert parent.poll() is not None, f"the failing trainer was still running {EXIT_DEADLINE_S} s after it raised"
        assert parent.returncode == 1
        stderr = parent.stderr.read()  # type: ignore[union-attr]
        assert ("was not up within 3 s" if helper == "worker" else "failed while its Manager") in stderr, stderr
        assert gone(helper_pid), f"the {helper} {helper_pid} outlived the trainer"
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        parent.wait(timeout=10)
