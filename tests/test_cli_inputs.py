"""What `flashpoint` says about bad command-line input, in-process (test_cli.py runs the real console script).

Each case asserts the exit code and a message that tells the user what to pass, and that the
base directory is left as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ml_flashpoint_nemo.cli import main
from ml_flashpoint_nemo.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    PoolLocks,
    compact_ranks,
    format_time,
    human_bytes,
    iso_time,
    scan_pool,
    scan_replica_spares,
)
from ml_flashpoint_nemo.core import CheckpointSaver, committed_steps
from ml_flashpoint_nemo.core.layout import CheckpointLayout


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.is_dir() else []


@pytest.mark.parametrize("command", ["ls", "verify", "clean"])
def test_a_base_that_is_a_file_is_a_usage_error(tmp_path, capsys, command):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    assert main([command, str(not_a_dir)]) == EXIT_USAGE
    assert f"{not_a_dir} is not a directory; BASE is a flashpoint base directory" in capsys.readouterr().err
    assert not_a_dir.read_bytes() == b"x"


@pytest.mark.parametrize("command", ["ls", "clean"])
def test_a_foreign_directory_is_refused_and_left_alone(tmp_path, capsys, command):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "sub").mkdir()
    before = listing(tmp_path)
    assert main([command, str(tmp_path)]) == EXIT_USAGE
    assert "is not a flashpoint base directory: it holds neither pool/ nor step-<N>/" in capsys.readouterr().err
    assert listing(tmp_path) == before


@pytest.mark.parametrize("step", ["seven", "-1", "step-x", "1.5"])
def test_a_step_that_is_not_a_non_negative_integer_is_a_usage_error(shm_dir, capsys, step):
    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver:
        saver.save(1, {"w": torch.ones(3)})
    assert main(["verify", str(base), step]) == EXIT_USAGE
    assert f"STEP must be a non-negative integer (or step-<N>), got {step!r}" in capsys.readouterr().err
    assert committed_steps(CheckpointLayout(base)) == [1]


def test_an_empty_directory_is_an_empty_base(tmp_path, capsys):
    assert main(["ls", str(tmp_path)]) == EXIT_OK
    assert "Traceback" not in capsys.readouterr().err
    assert listing(tmp_path) == []


def test_pool_scan_counts_buffers_and_ignores_what_is_not_one(shm_dir):
    """A saver's spare buffer is counted with the memory it holds; stray names in the pool are not."""
    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver:
        saver.save(1, {"w": torch.ones(1024)})
        saver.save(2, {"w": torch.ones(1024)})  # retires step 1: its object becomes a free buffer
    layout = CheckpointLayout(base)
    rank_dir = layout.pool_root / "rank-00000"
    (rank_dir / "notes.txt").write_text("not a buffer")
    (layout.pool_root / "not-a-rank").mkdir()
    (pool,) = scan_pool(layout)
    assert pool.rank == 0 and pool.buffers >= 1 and pool.nbytes >= 4096
    assert pool.to_json()["locked"] is False  # the saver is closed: nobody holds the lock
    spares = scan_replica_spares(layout)
    assert spares.files == 0 and spares.nbytes == 0  # no replication ran: no spare directory


def test_pool_locks_report_a_live_holder_and_release_what_they_took(shm_dir):
    base = shm_dir / "base"
    with CheckpointSaver(base, rank=0) as saver, CheckpointSaver(base, rank=1) as other:
        saver.save(1, {"w": torch.ones(4)})
        other.close()  # rank 1's lock is free, rank 0's is held by this process's saver
        with PoolLocks(CheckpointLayout(base)) as locks:
            assert [rank for rank, _ in locks.busy] == [0]
            assert [holder for _, holder in locks.busy] in ([os.getpid()], [None])
            assert len(locks.fds) == 1
        assert locks.fds == []
        saver.save(2, {"w": torch.ones(4)})  # still its pool: nothing was taken from it
    assert committed_steps(CheckpointLayout(base)) == [2]


@pytest.mark.parametrize("ranks, text", [([], "-"), ([3], "3"), ([0, 1, 2, 5], "0-2,5"), ([7, 1, 2, 2, 8], "1-2,7-8")])
def test_rank_lists_are_compact(ranks, text):
    assert compact_ranks(ranks) == text


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 << 30, "3.0 GiB"),
                                     (5 << 50, "5120.0 TiB")])
def test_byte_counts_are_human(n, text):
    assert human_bytes(n) == text


def test_missing_times_print_as_a_dash_or_null():
    assert format_time(None) == "-" and iso_time(None) is None
    assert format_time(0.0).count(":") == 2 and iso_time(0.0).startswith(("1970", "1969"))
