"""Start a script as N local rank processes with torchrun-style environment variables.

Light on purpose (no torch, no NeMo): the parent process only starts and reaps ranks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(script: str, argv: Sequence[str], nproc: int = 2, timeout: float = 600.0,
                 env: dict[str, str] | None = None, log_dir: str | os.PathLike[str] | None = None,
                 stop_on_failure: bool = False, stack_signal: int | None = None) -> int:
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
    """
    port = free_port()
    procs = []
    for rank in range(nproc):
        rank_env = dict(os.environ if env is None else env, RANK=str(rank), LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port))
        output = None
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            output = open(os.path.join(log_dir, f"rank-{rank}.log"), "w")  # noqa: SIM115 - closed by the child's exit
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(script), *argv], env=rank_env,
                                      stdout=output, stderr=subprocess.STDOUT if output else None,
                                      start_new_session=True))
        if output is not None:
            output.close()  # the child holds its own descriptor
    deadline = time.time() + timeout
    codes: list[int | None] = [None] * nproc
    try:
        while None in codes:
            codes = [proc.poll() for proc in procs]
            if stop_on_failure and any(code for code in codes):
                break
            if None in codes and time.time() > deadline:
                raise TimeoutError(f"{script} did not finish within {timeout:.0f} s; its ranks were killed")
            time.sleep(0.05)
    finally:
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
