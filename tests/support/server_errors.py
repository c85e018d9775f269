"""Waiting for what a real _core.TransferServer reports through errors()."""

from __future__ import annotations

import time
from typing import Any


def wait_for_error(srv: Any, needle: str, timeout: float = 10.0) -> list[str]:
    """The server's errors, collected until one contains needle (its worker may still be finishing); fails
    the test with what it did collect if none does within timeout seconds."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen += srv.errors()
        if any(needle in e for e in seen):
            return seen
        time.sleep(0.02)
    raise AssertionError(f"no server error containing {needle!r}; got {seen}")
