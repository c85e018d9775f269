"""Checking that a helper process dies with its SIGKILLed parent (Manager, persistent save worker)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """True if the process no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except (FileNotFoundError, ProcessLookupError):  # reaped between open() and read()
        return True


def wait_gone(pid: int, within: float = 5.0) -> bool:
    give_up = time.monotonic() + within
    while time.monotonic() < give_up:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


def repo_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _read_lines(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)


def assert_helper_dies_with_parent(command: list[str], pid_prefix: str, what: str, *, timeout: float = 120) -> None:
    """Start `command`, read the helper's pid from its line "<pid_prefix><pid>", SIGKILL the parent and
    require the helper gone within 5 s (alive before). Whatever is left is killed."""
    parent = subprocess.Popen(command, cwd=REPO, env=repo_env(), stdout=subprocess.PIPE, text=True)
    helper_pid = None
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_lines, args=(parent.stdout, lines), daemon=True).start()
        give_up = time.monotonic() + timeout
        while helper_pid is None and time.monotonic() < give_up and parent.poll() is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line.startswith(pid_prefix):
                helper_pid = int(line.split()[-1])
        assert helper_pid is not None, f"the parent never reported its {what} (exit code {parent.poll()})"
        time.sleep(0.5)
        assert not gone(helper_pid), f"the {what} died while its parent was alive"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_gone(helper_pid, within=5.0), f"{what} {helper_pid} outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if helper_pid is not None and not gone(helper_pid):
            os.kill(helper_pid, signal.SIGKILL)
