"""A real, small tmpfs for out-of-space tests: ENOSPC then comes from the kernel itself."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def mounted_tmpfs(mount_point: Path, size: str, options: str = "") -> Iterator[Path]:
    """Mount a tmpfs of `size` (e.g. "8m", more mount options in `options`, e.g. "huge=advise") at
    mount_point for the block; skips the test without root."""
    mount_point.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (f",{options}" if options else ""),
                                 "tmpfs", str(mount_point)], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here; out-of-space tests need a real small tmpfs")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here (needs root): {result.stderr.strip() or result.returncode}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)
