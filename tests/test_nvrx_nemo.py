"""NeMo's LocalCheckpointCallback + hierarchical IO with our NVRx manager (use_flashpoint_local_checkpoints).

2 real NeMo GPT ranks (gloo, forked from a NeMo-imported server: tests/support/fork_server.py) save local
checkpoints through NeMo's own LocalCheckpointCallback and MCoreHierarchicalCheckpointIO, are SIGKILLed,
and a restart resumes from the RAM version bit for bit (losses, parameters, optimizer state), with and
without a global checkpoint beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ml_flashpoint_nemo.core import committed_steps
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.versions import read_commit
from ml_flashpoint_nemo.nvrx.manager import CONTENT_METADATA_KEY
from tests.support.fork_server import NEMO_PRELOAD, nemo_popen, popen_preloaded
from tests.support.multiproc import REPO

sys.path.insert(0, str(REPO / "examples"))

from launch import launch_ranks  # noqa: E402
from quickstart import compare  # noqa: E402

from tests.support.nemo_reference import link_reference  # noqa: E402
from tests.test_nemo_e2e import train  # noqa: E402

SESSION = "tiny-gpt"  # tests/support/nemo_train.py's session id for --route nvrx
SESSION_OF_GLOBAL_STEP_CHECK = "job"  # tests/support/nvrx_global_step_rank.py's


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_local_checkpoint_without_global_resumes_from_ram_bit_exact(nemo_reference, tmp_path, shm_dir, async_save):
    """No global checkpoint at all: Lightning alone would restore nothing; the restart loads the newest RAM version.

    With async saves, a save is committed only once NeMo's queue found its write done on every rank, at a later
    step's end: on a loaded machine neither step 2's nor step 4's may be by the SIGKILL after step 5; the restart
    must then start from scratch (and still match the uninterrupted run).
    """
    link_reference(nemo_reference, tmp_path)
    flags = ("--route", "nvrx", "--every", "2", *(["--async-save"] if async_save else []))
    train(tmp_path, "crash", shm_dir, *flags, "--kill-at", "5", expect=-9)
    committed = committed_steps(CheckpointLayout(shm_dir / SESSION))
    assert committed in ([2, 4], [2], []) if async_save else committed == [2, 4], committed  # retired at the next save
    resumed = train(tmp_path, "resume", shm_dir, *flags)
    if not committed:
        assert resumed["resumed_from"] == "none" and resumed["losses"][0][0] == 1, resumed
        assert compare(tmp_path, resumed_from="none") == []
        return
    newest = committed[-1]
    assert resumed["resumed_from"] == "ram" and resumed["resumed_path"].endswith(f"step-{newest}"), resumed
    restoring = f"Restoring states from the checkpoint path at {shm_dir / SESSION / f'step-{newest}'}"
    assert restoring in resumed["log"], resumed["log"][-3000:]
    assert [step for step, _ in resumed["losses"]][0] == newest + 1, resumed["losses"]
    assert compare(tmp_path) == []


def test_without_resume_without_global_a_fit_with_no_global_checkpoint_starts_fresh(nemo_reference, tmp_path, shm_dir):
    """The default: RAM versions of the session are left alone when NeMo has no checkpoint to resume (a new run)."""
    link_reference(nemo_reference, tmp_path)
    flags = ("--route", "nvrx", "--every", "2")
    train(tmp_path, "crash", shm_dir, *flags, "--kill-at", "5", expect=-9)
    assert committed_steps(CheckpointLayout(shm_dir / SESSION)) == [2, 4]
    resumed = train(tmp_path, "resume", shm_dir, *flags, "--nvrx-resume-without-global", "0")
    assert resumed["resumed_from"] == "none", resumed
    assert [step for step, _ in resumed["losses"]][0] == 1, resumed["losses"]


@pytest.mark.parametrize(
    "case, local_every, global_every, kill_at, expected",
    [
        ("local newer", 2, 3, 5, ("ram", "step-4")),  # local step 4, global step 3
        ("global newer", 4, 3, 7, ("durable", "step=5")),  # local step 4, global step 6 (NeMo names it step=5)
    ],
)
def test_resume_loads_the_newer_of_local_and_global(
    nemo_reference, tmp_path, shm_dir, case, local_every, global_every, kill_at, expected
):
    """With NeMo's AutoResume finding a global checkpoint, NeMo's hierarchical IO compares the two iterations."""
    link_reference(nemo_reference, tmp_path)
    flags = ("--route", "nvrx", "--every", str(local_every), "--durable-every", str(global_every))
    flags += ("--durable-dir", str(tmp_path / "durable"))
    train(tmp_path, "crash", shm_dir, *flags, "--kill-at", str(kill_at), expect=-9)
    resumed = train(tmp_path, "resume", shm_dir, *flags)
    source, part = expected
    assert resumed["resumed_from"] == source and part in resumed["resumed_path"], resumed
    assert compare(tmp_path, resumed_from=source) == []


@pytest.fixture(scope="module")
def wiring_checks(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("nvrx-wiring") / "base"
    process = popen_preloaded(
        NEMO_PRELOAD,
        [sys.executable, str(REPO / "tests" / "support" / "nvrx_nemo_checks.py"), str(base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_call_wraps_the_strategys_io_as_nemos_own_wiring_does(wiring_checks):
    sync, asynchronous = wiring_checks["sync"], wiring_checks["async"]
    assert sync["error"] is None and sync["after"]["io"] == "FlashpointHierarchicalCheckpointIO", sync
    assert sync["after"]["inner"] == "MegatronCheckpointIO" and sync["after"]["local_callbacks"] == [2], sync
    # with async saves the strategy's IO stays NeMo's async wrapper, around ours, and our IO saves asynchronously
    assert asynchronous["error"] is None, asynchronous
    assert asynchronous["after"]["io"] == "AsyncFinalizableCheckpointIO", asynchronous
    assert asynchronous["after"]["inner"] == "FlashpointHierarchicalCheckpointIO", asynchronous
    assert wiring_checks["async_flag"] is True
    own = wiring_checks["own_callback"]  # the trainer's own LocalCheckpointCallback is used, none is added
    assert own["error"] is None and own["after"]["local_callbacks"] == [3], own


@pytest.mark.parametrize(
    "check, message",
    [
        ("no_interval", "pass every_n_train_steps >= 1"),
        ("bad_session", "must be a plain directory name"),
        ("twice", "already uses flashpoint local checkpoints: call this once"),
        ("resume_without_session", "needs a session_id that names this run"),
    ],
)
def test_bad_calls_raise_a_clear_error_and_leave_the_trainer_as_it_was(wiring_checks, check, message):
    result = wiring_checks[check]
    assert result["error"] and result["error"].startswith("LocalCheckpointingError") and message in result["error"]
    assert result["after"] == result["before"], result


@pytest.mark.parametrize(
    "odd_view, message",
    [
        ("damaged", "its global step cannot be read on every rank (rank 1: RuntimeError: "),
        ("other-step", "the ranks read different global steps from it (3 to 5)"),
    ],
)
def test_a_global_checkpoint_one_rank_sees_otherwise_fails_the_restart_on_every_rank_without_a_hang(
    tmp_path, shm_dir, odd_view, message
):
    """NeMo's hierarchical IO reads the global step between find_latest and the collective load it picks by it:
    rank 1 failing to read it, or reading another step (5 > local 4: it would load the global checkpoint while
    rank 0 loads the local one), must raise the same clear error on both ranks, not leave one waiting in a load."""
    code = launch_ranks(
        str(REPO / "tests" / "support" / "nvrx_global_step_rank.py"),
        ["--base", str(shm_dir), "--out", str(tmp_path), "--odd-rank", "1", "--odd-view", odd_view],
        nproc=2,
        timeout=90,  # deadline: the ranks' process group gives up after 60 s
        log_dir=tmp_path / "logs",
        popen=nemo_popen,
    )
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("rank-*.log")))
    assert code == 0, logs
    errors = [json.loads((tmp_path / f"load-rank-{rank}.json").read_text())["error"] for rank in range(2)]
    for error in errors:
        assert error and error.startswith(
            "LocalCheckpointingError: the restart cannot choose between local "
            "checkpoint iteration 4 and the global checkpoint"
        ), errors
        assert message in error, errors
    layout = CheckpointLayout(shm_dir / SESSION_OF_GLOBAL_STEP_CHECK)
    assert committed_steps(layout) == [4]  # the local one intact
    # the wiring records NeMo's sharded-state-dict metadata (the optimizer's sharding) with each local version
    assert read_commit(layout, 4).metadata[CONTENT_METADATA_KEY]["chained_optim_avoid_prefix"] is True
