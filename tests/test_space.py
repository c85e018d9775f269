"""The free-space check every rank runs before a RAM save (core/space.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ml_flashpoint_nemo.core import CheckpointSaver, space
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.version_files import FILES_KEY, describe_bytes
from ml_flashpoint_nemo.core.versions import read_commit, write_commit
from tests.support.multiproc import run_world

MiB = 1 << 20


def version_with_a_listed_file(base: Path, nbytes: int) -> CheckpointLayout:
    """Version 1 with one object and a version-level file of nbytes listed in its commit record."""
    layout = CheckpointLayout(base)
    with CheckpointSaver(base) as saver:
        saver.save(1, {"w": torch.ones(4)})
    record = read_commit(layout, 1)
    extra = os.urandom(nbytes)
    (layout.version_dir(1) / "common.pt").write_bytes(extra)
    write_commit(layout, 1, record.objects, world_size=1, metadata={FILES_KEY: {"common.pt": describe_bytes(extra)}})
    return layout


def test_needed_room_counts_the_listed_files_not_replicas_arriving(shm_dir, monkeypatch):
    monkeypatch.setattr(space, "MIN_FREE_BYTES", 0)  # so that the small files decide the number
    layout = version_with_a_listed_file(shm_dir, 3 * MiB)
    expected = 2 * (3 * MiB + layout.commit_path(1).stat().st_size)
    assert space.bytes_needed(layout) == expected
    # a peer's replica being received into the version directory is not a version-level file
    (layout.version_dir(1) / ".xfer-0123abcd.tmp").write_bytes(b"\0" * (8 * MiB))
    assert space.bytes_needed(layout) == expected


def test_first_save_needs_the_minimum_even_before_the_base_exists(base_dir):
    assert not base_dir.exists()
    assert space.bytes_needed(CheckpointLayout(base_dir)) == space.MIN_FREE_BYTES
    assert space.room_problem(base_dir) is None
    assert not base_dir.exists()  # checking creates nothing


def test_a_damaged_commit_record_does_not_stop_later_saves(shm_dir, monkeypatch):
    monkeypatch.setattr(space, "MIN_FREE_BYTES", 0)
    layout = version_with_a_listed_file(shm_dir, 3 * MiB)
    layout.commit_path(1).write_bytes(b"garbage")
    assert space.bytes_needed(layout) == 0  # the minimum: the version-level files are unknown
    assert space.room_problem(shm_dir) is None
    assert layout.commit_path(1).read_bytes() == b"garbage"  # the check changes nothing
    assert (layout.version_dir(1) / "common.pt").stat().st_size == 3 * MiB


def fill(tmpfs: Path, leave: int) -> None:
    vfs = os.statvfs(tmpfs)
    (tmpfs / "filler").write_bytes(b"\1" * (vfs.f_bavail * vfs.f_frsize - leave))


def test_a_full_tmpfs_is_a_problem(small_tmpfs):
    base = small_tmpfs / "base"
    version_with_a_listed_file(base, 1024)
    fill(small_tmpfs, 64 * 1024)
    problem = space.room_problem(base)
    assert problem is not None and "bytes free, the save needs at least" in problem, problem


def test_a_full_tmpfs_on_one_node_skips_the_save_on_every_rank(shm_dir, small_tmpfs):
    fill(small_tmpfs, 64 * 1024)
    bases = [str(shm_dir / "node-0"), str(small_tmpfs / "node-1")]
    outputs = run_world("space_scenarios", "full_node_skips_the_save_everywhere", 2, {"bases": bases}, timeout=120)
    for output in outputs:
        assert "SKIPPED: OutOfSpaceError: flashpoint save skipped on every rank: " in output, output
        assert f"{bases[1]} has " in output and bases[0] not in output, output
