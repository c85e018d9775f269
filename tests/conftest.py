"""Shared fixtures: every test gets its own base directory on /dev/shm, removed afterwards."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

SHM = Path("/dev/shm")


@pytest.fixture
def base_dir() -> Iterator[Path]:
    path = SHM / f"flashpoint-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB tmpfs, so that ENOSPC is the kernel's own answer. Needs root (CI runs as root)."""
    mount_point = tmp_path / "small-tmpfs"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({result.stderr.strip()}); needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
