"""The background Manager warm-up: bounded waits, clean failures, no re-run of __main__, no orphans."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from ml_flashpoint_nemo.core.sync_manager import (
    TIMEOUT_ENV,
    SyncManagerFuture,
    shutdown_manager,
    start_manager_warmup,
    wait_for_manager,
)
from ml_flashpoint_nemo.errors import FlashpointError, ManagerStartError
from tests.support import manager_hooks
from tests.support.orphans import assert_helper_dies_with_parent, gone, repo_env, wait_gone

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 120


@pytest.fixture
def start() -> Iterator[Callable[..., SyncManagerFuture]]:
    """start_manager_warmup, with every future closed after the test."""
    futures: list[SyncManagerFuture] = []

    def _start(**kwargs: object) -> SyncManagerFuture:
        future = start_manager_warmup(**kwargs)  # type: ignore[arg-type]
        futures.append(future)
        return future

    yield _start
    for future in futures:
        future.close()


def test_future_resolves_to_a_working_manager_that_close_shuts_down(start: Callable[..., SyncManagerFuture]) -> None:
    began = time.perf_counter()
    future = start()
    returned_ms = (time.perf_counter() - began) * 1e3
    logger.info("start_manager_warmup returned after %.2f ms", returned_ms)  # measured, not asserted

    manager = wait_for_manager(future, what="this test")
    # Its deadline timer was gone before the future completed: a waiter that forks right away (a Megatron
    # worker) must not race a thread's end (CPython gh-112275 deadlocks such a child before 3.11.10).
    assert not [t.name for t in threading.enumerate() if t.name == "flashpoint-manager-deadline"]
    shared = manager.dict()
    shared["step"] = 7
    assert shared["step"] == 7
    assert future.pid is not None and not gone(future.pid)

    # The launching thread has finished its work; PR_SET_PDEATHSIG must not have killed the server.
    time.sleep(0.5)
    assert not gone(future.pid)
    items = manager.Queue()
    items.put("hello")
    assert items.get(timeout=5) == "hello"
    assert future.result() is manager

    pid = future.pid
    future.close()  # shuts the server down; idempotent
    assert wait_gone(pid)
    future.close()
    shutdown_manager(future)
    shutdown_manager(None)


def test_start_failure_is_raised_with_its_cause(start: Callable[..., SyncManagerFuture]) -> None:
    future = start(timeout=60.0, _server_hook=manager_hooks.fail)
    with pytest.raises(ManagerStartError, match="failed to start") as info:
        future.result(what="this test")
    assert "exited with code 1" in str(info.value)
    assert "__main__" not in str(info.value)  # the guard advice is for hangs; our child never re-imports main
    assert isinstance(info.value.__cause__, EOFError)
    assert isinstance(info.value, FlashpointError)
    with pytest.raises(ManagerStartError):  # every later wait fails the same way, at once
        wait_for_manager(future)
    assert isinstance(future.exception(), ManagerStartError)
    assert future.pid is not None and wait_gone(future.pid)
    future.close()  # harmless after a failed start, and twice
    shutdown_manager(future)


def test_wait_timeout_abandons_the_start_and_kills_the_child(start: Callable[..., SyncManagerFuture]) -> None:
    future = start(timeout=1.5, _server_hook=manager_hooks.hang)
    with pytest.raises(ManagerStartError) as info:
        future.result(what="this test")
    message = str(info.value)
    assert "was not running" in message or "did not start within" in message
    assert 'if __name__ == "__main__":' in message
    assert TIMEOUT_ENV in message
    assert future.pid is not None
    assert wait_gone(future.pid), "the half-started Manager process survived the timeout"
    assert future.done() and future.cancel() is False


def test_deadline_is_enforced_even_if_nobody_waits(start: Callable[..., SyncManagerFuture]) -> None:
    future = start(timeout=1.0, _server_hook=manager_hooks.hang)
    closed = threading.Event()
    future.add_done_callback(lambda done: (done.close(), closed.set()))  # a callback may close: no deadlock
    give_up = time.monotonic() + 20
    while not future.done() and time.monotonic() < give_up:
        time.sleep(0.05)
    assert future.done()
    assert isinstance(future.exception(timeout=0), ManagerStartError)
    assert "did not start within 1.0 s" in str(future.exception(timeout=0))
    assert closed.wait(5)
    assert future.pid is not None and wait_gone(future.pid)


def test_a_short_wait_times_out_the_start(start: Callable[..., SyncManagerFuture]) -> None:
    future = start(timeout=60.0, _server_hook=manager_hooks.hang)
    with pytest.raises(ManagerStartError, match="limit 0.2 s"):
        future.result(timeout=0.2, what="this test")
    assert future.pid is None or wait_gone(future.pid)


def test_close_during_the_start_abandons_it(start: Callable[..., SyncManagerFuture]) -> None:
    future = start(timeout=60.0, _server_hook=manager_hooks.hang)
    give_up = time.monotonic() + 20  # let the child be launched, so there is something to kill
    while future.pid is None and time.monotonic() < give_up:
        time.sleep(0.01)
    pid = future.pid
    future.close()
    with pytest.raises(ManagerStartError, match="closed before it had started"):
        future.result()
    assert pid is not None and wait_gone(pid)
    future.close()


def test_timeout_comes_from_the_environment(
    start: Callable[..., SyncManagerFuture], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert start().timeout == 7.5
    assert start(timeout=3.0).timeout == 3.0
    monkeypatch.delenv(TIMEOUT_ENV)
    assert start().timeout == 120.0
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ManagerStartError, match=TIMEOUT_ENV):
            start_manager_warmup()


def test_unguarded_main_script_is_not_rerun_by_the_manager_process() -> None:
    script = REPO / "tests" / "support" / "manager_unguarded_main.py"
    result = subprocess.run(
        [sys.executable, str(script), "60"],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MANAGER READY" in result.stdout and "answer=42" in result.stdout
    assert "DONE" in result.stdout
    top_levels = [line for line in result.stdout.splitlines() if line.startswith("TOP LEVEL")]
    assert len(top_levels) == 1, f"the main module was re-run: {top_levels}"


@pytest.mark.parametrize("mode", ["pdeathsig", "watchdog-only"])
def test_manager_dies_with_its_sigkilled_parent(mode: str) -> None:
    command = [sys.executable, "-m", "tests.support.manager_parent"]
    if mode == "watchdog-only":
        command.append("--no-pdeathsig")
    assert_helper_dies_with_parent(command, "MANAGER PID ", "Manager", timeout=SUBPROCESS_TIMEOUT_S)


@pytest.mark.parametrize(
    "script, unguarded",
    [
        ('"""Docs quoting `if __name__ == "__main__":` do not count."""\nimport sys\nx = 1\n', True),
        ('def main():\n    pass\n\nif __name__ == "__main__":\n    main()\n', False),
        ("if '__main__' == __name__:\n    pass\n", False),
        ('if __name__ != "__main__":\n    pass\n', True),
    ],
)
def test_unguarded_main_scripts_are_recognised(tmp_path: Path, script: str, unguarded: bool) -> None:
    path = tmp_path / "train.py"
    path.write_text(script + "\nfrom ml_flashpoint_nemo.core.sync_manager import unguarded_main_script\n"
                    "print('RESULT', unguarded_main_script())\n")
    result = subprocess.run([sys.executable, str(path)], cwd=REPO, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_S, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    assert f"RESULT {path if unguarded else None}" in result.stdout
