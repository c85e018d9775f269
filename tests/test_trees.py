"""Deletion of trees a peer or a crash shaped: iterative, never follows symlinks, tolerates anything.

A peer once pushed a 4 KiB path (2,045 nested directories) and `step-1/sub/x`; `shutil.rmtree`,
`os.walk` and `flashpoint clean` then died with RecursionError or IsADirectoryError. These tests
build such trees for real (through directory descriptors, since the full path exceeds PATH_MAX).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from ml_flashpoint_nemo.core import CheckpointSaver
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.trees import remove_tree, tree_bytes
from ml_flashpoint_nemo.core.versions import retire_version
from tests.support.multiproc import REPO

DEPTH = 2000


def deep_tree(top: Path, depth: int = DEPTH, name: str = "dd") -> None:
    """top/dd/dd/... depth levels, a 3-byte file every 100 levels (the full path is ~6 KB)."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            if level % 100 == 0:
                f = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
                os.write(f, b"abc")
                os.close(f)
    finally:
        os.close(fd)


@pytest.fixture
def base(shm_dir: Path) -> Iterator[Path]:
    yield shm_dir / "base"


def test_remove_tree_removes_a_2000_deep_tree_and_leaves_symlink_targets_alone(shm_dir):
    outside = shm_dir / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"keep")
    top = shm_dir / "victim"
    deep_tree(top)
    os.symlink(outside, top / "link-to-outside")
    os.symlink(outside / "keep.txt", top / "dd" / "file-link")
    (top / "fifo-dir").mkdir()
    os.mkfifo(top / "fifo-dir" / "fifo")
    # A size estimate (for `clean`'s report): parts past PATH_MAX count 0, nothing raises.
    assert 0 < tree_bytes(top) <= 3 * (DEPTH // 100)
    assert remove_tree(top) is True
    assert not top.exists()
    assert (outside / "keep.txt").read_bytes() == b"keep"
    assert remove_tree(top) is True  # already gone: nothing to do, no error


def test_remove_tree_of_a_file_a_symlink_and_an_unremovable_part(shm_dir):
    f = shm_dir / "plain"
    f.write_bytes(b"x")
    assert remove_tree(f) and not f.exists()
    target = shm_dir / "target"
    target.mkdir()
    link = shm_dir / "link"
    os.symlink(target, link)
    assert remove_tree(link) and not os.path.lexists(link) and target.is_dir()
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    top = shm_dir / "partly"
    (top / "locked" / "inner").mkdir(parents=True)
    (top / "locked" / "inner" / "x").write_bytes(b"x")
    (top / "free").write_bytes(b"y")
    os.chmod(top / "locked" / "inner", 0o500)  # x cannot be unlinked
    try:
        assert remove_tree(top) is False  # ends, reports, and removed what it could
        assert not (top / "free").exists()
    finally:
        for d, _, _ in os.walk(top):
            os.chmod(d, 0o700)


def test_remove_tree_on_a_read_only_file_system_reports_failure_and_removes_nothing(tmp_path):
    """Nothing can be removed (EROFS, which root cannot override): every step fails softly, the answer is False."""
    from tests.support.tmpfs import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "ro", "4m") as mount_point:
        top = mount_point / "top"
        (top / "a" / "b").mkdir(parents=True)
        (top / "a" / "b" / "x").write_bytes(b"xyz")
        (top / "f").write_bytes(b"f")
        plain = mount_point / "plain"
        plain.write_bytes(b"p")
        before = sorted(str(p.relative_to(mount_point)) for p in mount_point.rglob("*"))
        subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
        try:
            assert remove_tree(top) is False
            assert remove_tree(plain) is False
            assert remove_tree(top / "f" / "under-a-file") is False  # ENOTDIR: neither gone nor removable
            assert remove_tree(mount_point / "missing") is True
            assert sorted(str(p.relative_to(mount_point)) for p in mount_point.rglob("*")) == before
            assert tree_bytes(top) == 4
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(mount_point)], check=True)


def test_a_name_longer_than_the_system_allows_is_reported_not_raised(shm_dir):
    assert remove_tree(shm_dir / ("n" * 300)) is False  # ENAMETOOLONG from lstat
    assert tree_bytes(shm_dir / ("n" * 300)) == 0


def _committed_base(base: Path, steps: tuple[int, ...]) -> None:
    with CheckpointSaver(base) as saver:
        for step in steps:
            saver.save(step, {"w": torch.arange(16, dtype=torch.float32) + step}, keep=None)


def test_retire_version_removes_peer_made_directories(base):
    _committed_base(base, (1, 2))
    (base / "step-1" / "sub").mkdir()
    (base / "step-1" / "sub" / "x").write_bytes(b"pushed")
    deep_tree(base / "step-1" / "deep")
    (base / "step-1" / "rank-00000-9.fpo").mkdir()  # a directory under an object name
    retire_version(CheckpointLayout(base), 1, rank=None)
    assert not (base / "step-1").exists() and (base / "step-2" / "COMMIT").exists()


def test_flashpoint_clean_removes_a_2000_deep_tree_in_a_superseded_version(base):
    _committed_base(base, (1, 2))
    deep_tree(base / "step-1" / "deep")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "ml_flashpoint_nemo.cli", "clean", str(base), "--json"],
                            capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (base / "step-1").exists()
    assert (base / "step-2" / "COMMIT").exists()
