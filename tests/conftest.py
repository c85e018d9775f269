"""Shared fixtures: every test gets its own base directory on /dev/shm, removed afterwards; the NeMo
end-to-end tests share one reference run per session; the processes of a test or module marked
``unmeasured`` run without coverage (scripts/coverage.sh)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.fork_server import COVERAGE_VARIABLES
from tests.support.tmpfs import mounted_tmpfs

SHM = Path("/dev/shm")


def _unmeasured(request: pytest.FixtureRequest) -> Iterator[None]:
    """Without coverage's variables, the processes started meanwhile (and ranks forked by the fork servers) are
    not measured: a traced NeMo process takes about twice the CPU, and these tests run paths measured elsewhere."""
    if request.node.get_closest_marker("unmeasured") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for name in COVERAGE_VARIABLES:
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(autouse=True)
def _unmeasured_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from _unmeasured(request)


@pytest.fixture(scope="module", autouse=True)
def _unmeasured_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """Also for the module's own fixtures (set up before a test's function-scoped ones)."""
    yield from _unmeasured(request)


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
