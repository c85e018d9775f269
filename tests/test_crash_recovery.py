"""SIGKILL a real writer process at random points; the newest committed version must load bit-exact."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ml_flashpoint_nemo.core import CheckpointSaver, committed_steps, delete_superseded, load_version, verify_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from tests.support.save_loop import state_for_step
from tests.support.states import assert_state_equal

REPO = Path(__file__).resolve().parents[1]
KILL_RUNS = int(os.environ.get("FLASHPOINT_KILL_RUNS", "5"))  # 5 in CI (~4 s each); more: FLASHPOINT_KILL_RUNS=100


def start_writer(base_dir: Path, first_step: int, last_step: int | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "tests.support.save_loop", str(base_dir), str(first_step)]
    if last_step is not None:
        args.append(str(last_step))
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_first_commit(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("committed"):
            return
        if not line and proc.poll() is not None:
            raise AssertionError(f"writer exited with {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError("writer did not commit in time")


def newest_step(base_dir: Path) -> int:
    return committed_steps(CheckpointLayout(base_dir))[-1]


def test_sigkill_at_random_points_leaves_newest_committed_loadable(base_dir):
    rng = random.Random(int(os.environ.get("FLASHPOINT_KILL_SEED", "1234")))
    next_step = 1
    for _ in range(KILL_RUNS):
        writer = start_writer(base_dir, next_step)
        wait_for_first_commit(writer)
        time.sleep(rng.uniform(0.0, 0.4))
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
        step = newest_step(base_dir)
        assert_state_equal(state_for_step(step), load_version(base_dir, step))
        verify_version(base_dir, step)
        next_step = step + 1


def test_restart_adopts_pool_and_never_touches_newest_committed(base_dir):
    writer = start_writer(base_dir, 1, 2)  # steps 1 and 2, keep=1: step 2 committed, step 1's buffer free
    assert writer.wait(timeout=120) == 0, writer.stderr.read()
    newest = base_dir / "step-2" / "rank-00000-0.fpo"
    before = newest.read_bytes()
    newest_inode = os.stat(newest).st_ino
    pool_files = list((base_dir / "pool" / "rank-00000").glob("buf-*"))
    assert len(pool_files) == 1, "the retired version's buffer should wait in the pool"
    free_inode = os.stat(pool_files[0]).st_ino

    with CheckpointSaver(base_dir) as saver:  # the restarted process
        written = saver.write_object(3, state_for_step(3))
        new_object = base_dir / "step-3" / written.record.name
        assert os.stat(new_object).st_ino == free_inode, "the adopted free buffer should have been reused"
        assert newest.read_bytes() == before, "writing step 3 changed the newest committed version"
        assert_state_equal(state_for_step(2), load_version(base_dir, 2))
        saver.commit(3, [written.record])
        delete_superseded(base_dir, keep=1, rank=0, pool=saver.pool)
        saver.save(4, state_for_step(4))  # reuses step 2's file, now retired
        assert os.stat(base_dir / "step-4" / written.record.name).st_ino == newest_inode
    assert_state_equal(state_for_step(4), load_version(base_dir, 4))


def test_uncommitted_leftovers_are_cleaned_after_restart(base_dir):
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state_for_step(1))
        saver.write_object(2, state_for_step(2))  # "crashed" before the commit
    assert committed_steps(CheckpointLayout(base_dir)) == [1]
    with pytest.raises(Exception, match="no committed version of step 2"):
        load_version(base_dir, 2)
    with CheckpointSaver(base_dir) as saver:
        saver.save(2, state_for_step(2))  # the leftover object is replaced, not mixed in
        saver.save(3, state_for_step(3))
    assert committed_steps(CheckpointLayout(base_dir)) == [3]
    assert sorted(p.name for p in base_dir.iterdir()) == ["pool", "step-3"]
    assert_state_equal(state_for_step(3), load_version(base_dir, 3))
