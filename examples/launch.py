"""Start a script as N local rank processes with torchrun-style environment variables.

Light on purpose (no torch, no NeMo): the parent process only starts and reaps ranks.

Start-up (interpreter, imports, rendezvous) can be slow on a loaded machine and is not the
work being timed: with startup_timeout, each rank reports when its process group is up
(init_process_group_reporting_start) and the run's timeout counts from the moment every
rank has.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

from ml_flashpoint_nemo.testing.ports import free_port

STARTED_FILE_ENV = "LAUNCH_STARTED_FILE"  # where a rank reports that its process group is up
STARTUP_TIMEOUT_ENV = "LAUNCH_STARTUP_TIMEOUT_S"  # how long its rendezvous may wait for the other ranks


class StartupTimeoutError(TimeoutError):
    """Some rank did not get its process group up within the start-up bound (imports, rendezvous)."""


def launch_ranks(script: str, argv: Sequence[str], nproc: int = 2, timeout: float = 600.0,
                 env: dict[str, str] | None = None, log_dir: str | os.PathLike[str] | None = None,
                 stop_on_failure: bool = False, stack_signal: int | None = None,
                 startup_timeout: float | None = None, popen: Callable[..., Any] = subprocess.Popen) -> int:
    """Run `script argv` as nproc ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT set).

    Returns the worst exit code: negative if a rank was killed by a signal (-9 for SIGKILL);
    raises TimeoutError (after killing every rank) if they run past timeout. With log_dir,
    each rank's output goes to <log_dir>/rank-<r>.log instead of this terminal.
    Each rank runs in its own session, killed as a whole at the end, so helper processes of
    a SIGKILLed rank (e.g. the Manager Megatron's own async writer spawns) do not outlive it.
    With stop_on_failure, the first rank that fails ends the others at once, as an elastic
    launcher stops a worker group (their codes then do not count).
    With stack_signal, ranks still running when they are ended (a failure or the timeout)
    first get that signal, with their helper processes, and 2 s to print their stacks
    (a rank that called faulthandler.register(stack_signal, all_threads=True) does).
    With startup_timeout, timeout counts from when every rank reported its process group up
    (init_process_group_reporting_start); a start-up longer than startup_timeout raises
    StartupTimeoutError instead, so that a slow start is never taken for a hang.
    popen starts each rank (subprocess.Popen's arguments; tests pass a fork server's, see
    tests/support/fork_server.py).
    """
    port = free_port()
    procs = []
    started_dir = Path(tempfile.mkdtemp(prefix="launch-started-")) if startup_timeout is not None else None
    started_files = [started_dir / f"rank-{rank}" for rank in range(nproc)] if started_dir is not None else []
    for rank in range(nproc):
        rank_env = dict(os.environ if env is None else env, RANK=str(rank), LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
        if started_files:
            rank_env[STARTED_FILE_ENV] = str(started_files[rank])
            rank_env[STARTUP_TIMEOUT_ENV] = str(startup_timeout)
        output = None
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            output = open(os.path.join(log_dir, f"rank-{rank}.log"), "w")  # noqa: SIM115 - closed by the child's exit
        procs.append(popen([sys.executable, os.path.abspath(script), *argv], env=rank_env,
                                      stdout=output, stderr=subprocess.STDOUT if output else None,
                                      start_new_session=True))
        if output is not None:
            output.close()  # the child holds its own descriptor
    launched = time.monotonic()
    deadline = None if started_files else launched + timeout
    codes: list[int | None] = [None] * nproc
    try:
        while None in codes:
            codes = [proc.poll() for proc in procs]
            if stop_on_failure and any(code for code in codes):
                break
            now = time.monotonic()
            if deadline is None and all(f.exists() for f in started_files):
                deadline = now + timeout
            if None in codes and deadline is None and now > launched + startup_timeout:  # type: ignore[operator]
                late = [r for r, f in enumerate(started_files) if not f.exists()]
                raise StartupTimeoutError(f"{script}: ranks {late} did not start (process group up) within "
                                          f"{startup_timeout:.0f} s; its ranks were killed")
            if None in codes and deadline is not None and now > deadline:
                after = " after every rank started" if started_files else ""
                raise TimeoutError(f"{script} did not finish within {timeout:.0f} s{after}; its ranks were killed")
            time.sleep(0.05)
    finally:
        if started_dir is not None:
            for f in started_files:
                f.unlink(missing_ok=True)
            started_dir.rmdir()
        if stack_signal is not None and _signal_running(procs, stack_signal):
            time.sleep(2.0)
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    finished = [code for code in codes if code is not None]
    return min(finished) if min(finished) < 0 else max(finished)


def init_process_group_reporting_start(backend: str, timeout: timedelta) -> None:
    """In a rank: join the process group, then report to launch_ranks that start-up is over.

    The rendezvous waits up to the launcher's start-up bound for ranks still importing (a
    store of our own, with that timeout); the group's collectives keep `timeout`.
    """
    import torch.distributed as dist

    startup_s = float(os.environ.get(STARTUP_TIMEOUT_ENV, timeout.total_seconds()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0,
                          timedelta(seconds=max(startup_s, timeout.total_seconds())), wait_for_workers=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    dist.barrier()  # every rank is in the group
    store.set_timeout(timeout)
    started = os.environ.get(STARTED_FILE_ENV)
    if started:
        Path(started).touch()


def _signal_running(procs: Sequence[subprocess.Popen], signum: int) -> bool:
    """Send signum to the session of every rank still running; True if there was one."""
    sent = False
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signum)
                sent = True
            except ProcessLookupError:
                pass
    return sent
