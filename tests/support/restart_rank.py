"""One rank of tests/support/nemo_train.py under an elastic launcher (ft_launcher / torchrun), for tests/test_restarts.py.

Takes nemo_train's flags (without --kill-at) and runs nemo_train.main() unchanged, adding one crash:
in the FIRST incarnation only (TORCHELASTIC_RESTART_COUNT == "0") the rank RESTART_KILL_RANK
SIGKILLs itself after step RESTART_KILL_AT (nemo_train's own --kill-at kills every rank). Right
before the kill it writes RESTART_PIDS_FILE: its pid and every descendant process (pid, create
time, cmdline), so the test can check that none of them outlives it. The other rank is left to the
launcher, which tears it down and restarts both; incarnation 1 then resumes from the RAM checkpoint
under the same --base and trains to the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1] / "examples"


def helper_owners() -> dict[int, str]:
    """Who started which helper process: "flashpoint" (our Manager), "resource_tracker" (the stdlib's)."""
    import gc
    from multiprocessing import resource_tracker

    from ml_flashpoint_nemo.core.sync_manager import SyncManagerFuture

    owners = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): some NeMo placeholders raise on any attribute access (__class__ too)
        if type(obj) is SyncManagerFuture and obj.pid is not None:
            owners[obj.pid] = "flashpoint"
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)  # noqa: SLF001
    if tracker is not None:
        owners[tracker] = "resource_tracker"
    # Megatron's async durable save: filesystem_async._get_write_results_queue() does
    # mp.get_context("spawn").Manager().Queue(); the proxy keeps its SyncManager in ._manager
    fs_async = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(fs_async, "_results_queue", None)
    process = getattr(getattr(queue, "_manager", None), "_process", None)
    if process is not None and process.pid not in owners:
        owners[process.pid] = "megatron_manager"
    return owners


def descendants() -> list[dict[str, Any]]:
    """Every process below this one, with its owner (helper_owners; "other": not started by us)."""
    import psutil

    owners = helper_owners()
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            owner = owners.get(proc.pid) or owners.get(proc.ppid())
            if owner is None:  # a fork() of the rank (Megatron's async caller and its writers) runs its cmdline
                owner = "fork_of_rank" if proc.cmdline() == psutil.Process().cmdline() else "other"
            found.append({"pid": proc.pid, "ppid": proc.ppid(), "create_time": proc.create_time(),
                          "cmdline": proc.cmdline(), "owner": owner})
        except psutil.Error:
            pass
    return found


def main() -> None:
    sys.path.insert(0, str(EXAMPLES))
    sys.path.insert(0, str(HERE.parents[1]))
    import lightning.pytorch as pl
    import tiny_gpt

    from tests.support import nemo_train

    incarnation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    kill_rank = int(os.environ.get("RESTART_KILL_RANK", "1"))
    kill_at = int(os.environ.get("RESTART_KILL_AT", "5"))
    pids_file = os.environ.get("RESTART_PIDS_FILE")
    print(f"restart_rank: rank {os.environ.get('RANK')} pid {os.getpid()} incarnation {incarnation}", flush=True)

    class KillOneRank(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *unused: Any) -> None:
            if incarnation != "0" or trainer.global_rank != kill_rank or trainer.global_step != kill_at:
                return
            if pids_file:
                record = {"pid": os.getpid(), "rank": trainer.global_rank, "descendants": descendants()}
                tmp = pids_file + ".tmp"
                Path(tmp).write_text(json.dumps(record))
                os.replace(tmp, pids_file)
            print(f"restart_rank: rank {trainer.global_rank} SIGKILLs itself after step {kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    make_trainer = tiny_gpt.make_trainer

    def make_trainer_with_crash(*args: Any, callbacks: Any = None, **kwargs: Any) -> Any:
        return make_trainer(*args, callbacks=[*(callbacks or []), KillOneRank()], **kwargs)

    tiny_gpt.make_trainer = make_trainer_with_crash  # nemo_train imports tiny_gpt inside main(): same module object
    sys.argv = [nemo_train.__file__, *sys.argv[1:]]
    nemo_train.main()


if __name__ == "__main__":
    main()
