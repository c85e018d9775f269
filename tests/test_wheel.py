"""The package builds into a wheel that carries the compiled core and works outside the source tree."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unmeasured  # pip and the wheel's own interpreter: nothing of the source tree to measure

REPO_ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh virtual environment that has only the wheel (no torch, no source tree).
SMOKE_SCRIPT = r"""
import os, sys, uuid
import ml_flashpoint_nemo._core as core
venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(core.__file__).startswith(venv + os.sep), core.__file__
assert "torch" not in sys.modules, "importing the core must not import torch"
assert core.crc32c(b"123456789") == 0xE3069283
assert core.crc32c_software(b"123456789") == 0xE3069283
path = "/dev/shm/flashpoint-wheel-test-" + uuid.uuid4().hex[:12]
buffer = core.ShmBuffer.create(path, 1)
try:
    assert buffer.size == core.page_size()
    with memoryview(buffer) as view:
        view[:5] = b"wheel"
    buffer.close()
    with open(path, "rb") as handle:
        assert handle.read(5) == b"wheel"
finally:
    buffer.close()
    os.unlink(path)
print("wheel smoke test ok", core.crc32c_backend())
"""


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (
        f"{' '.join(command)} exited {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    )
    return result


def test_wheel_builds_installs_and_imports_outside_the_source_tree(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(os.cpu_count() or 1)
    # A private build directory: the repository's build/ (used by the editable install) stays untouched. The build
    # requirements are the pinned ones set-up installed (pyproject's dev extra), so no isolated environment is made.
    run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
            "-w", str(wheelhouse),
            f"--config-settings=build-dir={tmp_path / 'build'}",
            # Without link-time optimization (about half of the build's CPU here): the test is about packaging.
            "--config-settings=cmake.define.CMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF",
            str(REPO_ROOT),
        ],
        env=env,
        timeout=900,
    )  # fmt: skip
    wheels = list(wheelhouse.glob("ml_flashpoint_nemo-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(metadata_name).decode()
    assert fnmatch.filter(names, "ml_flashpoint_nemo/_core*.so"), names
    assert "ml_flashpoint_nemo/__init__.py" in names
    assert "ml_flashpoint_nemo/core/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "csrc/", "build/"))], names
    assert "Requires-Dist: torch" in metadata

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env, timeout=300)
    python = venv / "bin" / "python"
    run(  # this interpreter's pip installs into the new environment: no pip of its own is needed there
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", str(wheel)],
        env=env,
        timeout=300,
    )

    outside = tmp_path / "elsewhere"  # not the repository, so the source tree cannot be imported
    outside.mkdir()
    result = run([str(python), "-c", SMOKE_SCRIPT, str(venv)], cwd=outside, env=env, timeout=120)
    assert "wheel smoke test ok" in result.stdout
