"""Run a scenario on N real processes joined by torch.distributed (gloo on CPU).

Each rank is its own Python process (python -m tests.support.<module> <scenario> ...),
so a test sees real process boundaries, real collectives and real exit codes, and a
hung rank is killed at the timeout instead of hanging the suite. Ranks started without a
command prefix are forked from a process that has torch (and Megatron-core, for the modules
that use it) imported already: tests/support/fork_server.py.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ml_flashpoint_nemo.testing.ports import free_port
from tests.support.fork_server import MEGATRON_PRELOAD, TORCH_PRELOAD, popen_preloaded

# The scenario modules whose ranks import Megatron-core; the others get a server with torch only.
_MEGATRON_MODULES = {"elastic_scenarios", "lifecycle_scenarios", "megatron_scenarios", "replication_scenarios"}

__all__ = ["REPO", "expect_failure", "free_port", "node_base", "run_ranks", "run_world", "scenario_main"]

REPO = Path(__file__).resolve().parents[2]


def run_world(module: str, scenario: str, world_size: int, params: dict[str, Any], *, timeout: float = 180) -> list[str]:
    """Start world_size ranks of module's scenario; return each rank's stdout. Fails on any non-zero exit."""
    envs = [{"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)} for rank in range(world_size)]
    return run_ranks(module, scenario, params, prefixes=[[] for _ in range(world_size)], envs=envs,
                     master_addr="127.0.0.1", master_port=free_port(), timeout=timeout)


def run_ranks(module: str, scenario: str, params: dict[str, Any], *, prefixes: list[list[str]],
              envs: list[dict[str, str]], master_addr: str, master_port: int, timeout: float = 180) -> list[str]:
    """Like run_world, but rank r runs under the command prefix prefixes[r] (e.g. ip netns exec NS) with envs[r]."""
    world_size = len(prefixes)
    preload = MEGATRON_PRELOAD if module in _MEGATRON_MODULES else TORCH_PRELOAD
    procs: list[Any] = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), OMP_NUM_THREADS="1",
                   FLASHPOINT_COPY_THREADS="1")
        env.update(envs[rank])
        popen = subprocess.Popen if prefixes[rank] else functools.partial(popen_preloaded, preload)
        procs.append(popen(
            prefixes[rank] + [sys.executable, "-m", f"tests.support.{module}", scenario, json.dumps(params)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # its own process group: a timeout kills what it forked too
        ))
    deadline = time.monotonic() + timeout
    outputs, failures = [], []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                _kill_group(other)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # something outside the group still holds its pipes
                out, err = "", "(no output: its pipes stayed open after the kill)"
            failures.append(f"rank {rank} timed out after {timeout}s\n{err[-3000:]}")
            continue
        outputs.append(out)
        if proc.returncode != 0:
            failures.append(f"rank {rank} exited with {proc.returncode}\n{err[-3000:]}\n{out[-2000:]}")
    assert not failures, "\n".join(failures)
    return outputs


def _kill_group(proc: Any) -> None:
    """SIGKILL a rank and every process it forked (e.g. a forked async-save worker that hung and keeps the
    rank's stdout open, so that reading it would never end)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def node_base(p: dict[str, Any]) -> str:
    """Base directory of this rank's simulated "node": p["ranks_per_node"] consecutive ranks share p["bases"][i]."""
    import torch.distributed as dist

    return p["bases"][dist.get_rank() // p["ranks_per_node"]]


def expect_failure(action: Callable[[], Any], label: str) -> None:
    """Run action, which must fail; print "<label>: <type>: <message>" for the test to check."""
    try:
        action()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        print(f"{label}: {type(exc).__name__}: {exc}")
        return
    raise AssertionError(f"expected a failure ({label}) but the action succeeded")


def scenario_main(scenarios: dict[str, Callable[[dict[str, Any]], None]]) -> None:
    """Entry point of a scenario module: set up the process group, run the scenario, tear down."""
    import torch.distributed as dist

    name, params = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    try:
        scenarios[name](params)
    finally:
        dist.destroy_process_group()
    _exit_before_gloo_threads_race_finalization()


def _exit_before_gloo_threads_race_finalization() -> None:
    """Run what a normal exit runs (thread joins, atexit hooks), then leave without finalizing.

    A gloo worker thread drops the tensors of the last collective only after the caller's wait
    has returned, and dropping them takes the GIL; when the interpreter is finalizing by then,
    that thread is unwound through a noexcept destructor and the process aborts ("terminate
    called without an active exception", a torch race, not ours). os._exit after the same exit
    steps leaves those threads alone. A scenario that raised exits the normal way (exit status 1).
    """
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as exit does
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
