"""Signal handlers that a trainer cut short left installed are put back when the next trainer is wired.

The scenario runs in a fresh process (tests/support/stale_handler_checks.py): signal handlers are
process-wide. It is what an NVRx in-process restart can leave behind (docs/design.md, "In-process
restarts"). The teardown that would put the handlers back never runs, and flashpoint's resources
are closed as FlashpointAbort closes them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.multiproc import REPO


@pytest.fixture(scope="module")
def checks() -> dict[str, str]:
    base = Path("/dev/shm") / f"flashpoint-test-stale-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHPOINT_BASE_DIR", "FLASHPOINT_JOB_ID", "RANK")}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.support.stale_handler_checks", str(base)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.split(" ", 1)[0] in _LABELS]
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in lines} | {"log": done.stdout}


_LABELS = {"LIGHTNING", "LIGHTNING_LATE_STOP", "WITH_PREEMPTION", "WITH_PREEMPTION_LATE_STOP", "RUNNING",
           "OTHER_THREAD", "MAIN_THREAD", "REALTIME", "NOTHING_TO_PUT_BACK", "NEMO_PREEMPTION",
           "NEMO_PREEMPTION_OTHER_RANK", "RUNNING_NEMO", "RUNNING_NEMO_ENDED", "OWNER_CHECK_FAILS",
           "PUT_BACK_OTHER_THREAD"}


def test_lightnings_handler_of_an_aborted_trainer_is_put_back_and_the_trainer_freed(checks):
    # Without the fix the handler keeps the aborted trainer alive (kept_alive_before): that is the leak.
    assert checks["LIGHTNING"] == "installed _HandlersCompose kept_alive_before True sigterm_after original freed True"
    assert "Put back 1 signal handler(s) that trainers cut short had left installed (Lightning's handler of signal " \
           "SIGTERM)" in checks["log"]


def test_flashpoints_preemption_handler_and_lightnings_beneath_it_are_both_put_back(checks):
    assert checks["WITH_PREEMPTION"] == ("installed OwnedHandler kept_alive_before True sigterm_after original "
                                         "freed True")
    assert "(flashpoint's preemption handler of signal SIGTERM, Lightning's handler of signal SIGTERM)" in checks["log"]


def test_the_aborted_callback_stopping_late_puts_back_nothing(checks):
    """Its preemption handler was put back already: a late _stop_drain must not reinstall what it replaced."""
    assert checks["LIGHTNING_LATE_STOP"] == checks["WITH_PREEMPTION_LATE_STOP"] == "sigterm original"


@pytest.mark.parametrize("label, handler", [("NEMO_PREEMPTION", "master_handler"),
                                            ("NEMO_PREEMPTION_OTHER_RANK", "ignoring_handler")])
def test_nemos_preemption_context_of_an_aborted_trainer_is_exited_as_its_train_end_would(checks, label, handler):
    """NeMo's PreemptionCallback keeps, in its suspended handler context, the Lightning handler it replaced, and
    puts it back when collected: after the next wiring and fit, a collection must bring nothing back."""
    assert checks[label] == (f"installed {handler} freed True after_collection _HandlersCompose "
                             "chains_original True")
    assert checks["log"].count("(NeMo's PreemptionCallback handler of signal SIGTERM, Lightning's handler of "
                               "signal SIGTERM)") == 2


def test_nemos_preemption_handler_of_a_trainer_still_training_is_kept(checks):
    assert checks["RUNNING_NEMO"] == "kept master_handler"
    assert checks["RUNNING_NEMO_ENDED"] == "sigterm original"


def test_the_handlers_of_a_trainer_still_training_are_kept(checks):
    assert checks["RUNNING"] == "kept True"


def test_only_the_main_thread_puts_handlers_back(checks):
    assert checks["OTHER_THREAD"] == "released 0 sigterm _HandlersCompose"
    assert checks["MAIN_THREAD"] == "released 1 sigterm original"


def test_a_real_time_signal_is_named_by_its_number_and_a_handler_with_nothing_to_put_back_stays(checks):
    assert checks["REALTIME"] == "released 1 handler SIG_DFL"  # what it replaced
    assert f"a finished owner's handler of signal {int(signal.SIGRTMIN) + 1}" in checks["log"]
    assert checks["NOTHING_TO_PUT_BACK"] == "released 0 handler OwnedHandler"  # found, left, and not counted


def test_a_failing_check_is_logged_and_never_stops_the_wiring(checks):
    assert checks["OWNER_CHECK_FAILS"] == "released 0 handler OwnedHandler"
    assert "Could not check for signal handlers left by earlier trainers" in checks["log"]
    assert "ZeroDivisionError" in checks["log"]


def test_a_handler_is_put_back_only_from_the_main_thread(checks):
    assert checks["PUT_BACK_OTHER_THREAD"] == "False handler OwnedHandler"
