"""Faults that must travel inside an async-save request, for benchmarks/fault_campaign_rank.py.

A persistent save worker is a spawned process: it does not see functions the rank patched to
inject a fault, as a forked worker does. The request's async function is wrapped instead, in
this importable module, so the worker can unpickle the wrapper.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable


class KillRankAroundWrite:
    """Runs the request's background write, SIGKILLing the rank (and so its tied worker) before or after it."""

    def __init__(self, write: Callable[..., Any], when: str, step: int, rank_pid: int) -> None:
        self.write, self.when, self.step, self.rank_pid = write, when, step, rank_pid

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.when == "before":
            self._kill_rank()
        result = self.write(*args, **kwargs)
        if self.when == "after":
            self._kill_rank()
        return result

    def _kill_rank(self) -> None:
        print(f"FAULT: SIGKILL {self.when} the persistent worker's write of step {self.step}", flush=True)
        os.kill(self.rank_pid, signal.SIGKILL)
        time.sleep(60)  # the rank's death ends this worker too; it must not report as if nothing happened
