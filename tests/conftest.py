"""Shared fixtures: every test gets its own base directory on /dev/shm, removed afterwards; the NeMo
end-to-end tests share one reference run per session."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.tmpfs import mounted_tmpfs

SHM = Path("/dev/shm")


@pytest.fixture
def base_dir() -> Iterator[Path]:
    path = SHM / f"flashpoint-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir(base_dir: Path) -> Path:
    """Like base_dir, but already created."""
    base_dir.mkdir()
    return base_dir


@pytest.fixture
def dirs(shm_dir: Path) -> tuple[Path, Path]:
    """(server base, client base) for the transfer tests; a test file may define its own."""
    server, client = shm_dir / "server", shm_dir / "client"
    server.mkdir()
    client.mkdir()
    return server, client


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB tmpfs. Needs root (CI runs as root); skipped otherwise."""
    with mounted_tmpfs(tmp_path / "small-tmpfs", "16m") as mount_point:
        yield mount_point


@pytest.fixture(scope="session")
def nemo_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted NeMo run every end-to-end scenario is compared with (tests/support/nemo_reference.py),
    computed once per session; a test links it into its output with link_reference."""
    from tests.support.nemo_reference import train_reference  # imports examples/launch.py: only when needed

    return train_reference(tmp_path_factory.mktemp("nemo-reference"))
