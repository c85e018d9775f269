"""One rank of tests/support/nemo_train.py under NVRx's in-process restart (inprocess.Wrapper), for
tests/test_inprocess_restart.py.

The Wrapper calls nemo_train.main() again in this same process after each fault: restart
iteration i raises a RuntimeError on rank --fault-rank after step --fault-at[i] (none in the
last iteration). The abort is inprocess.Compose(AbortTorchDistributed(), FlashpointAbort()).
Every iteration builds a new trainer, wraps it with wrap_trainer_with_flashpoint under the same
--base and resumes from the newest RAM version. The CPU-only settings are explained in the
test's docstring.

Written under --out: result.json and state.pt of the last iteration (rank 0, by nemo_train),
iterations.json (rank 0: per iteration, where it resumed from and its losses) and
resources-rank<R>.json (every rank: what this process held at the start of each iteration and
after the Wrapper returned: threads, fds, child processes, tmpfs mappings, base dir files and
the flashpoint resources registered as alive).
"""

# No `from __future__ import annotations`: the Wrapper finds the parameter that receives its CallWrapper by
# issubclass() on the annotation, which fails on a string annotation.
import argparse
import datetime
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLES = REPO / "examples"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--fault-at", type=int, nargs="+", required=True, help="step of the fault, per iteration")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--base", required=True)
    parser.add_argument("--gloo-timeout", type=float, default=20.0, help="seconds, every process group")
    return parser.parse_args()


# --- what this process holds ------------------------------------------------------------------


def _fd_targets() -> list[str]:
    """Every open fd by what it points to; sockets, pipes and anonymous inodes by kind only."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the fd of the listing itself, closed by now
            continue
        kind = target.split(":", 1)[0]
        found.append(kind if kind in ("socket", "pipe") else target)
    return sorted(found)


def _thread_names() -> list[str]:
    """Names of the OS threads (/proc/self/task/*/comm): C++ threads too, not only Python ones."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:
            pass
    return sorted(names)


def _tmpfs_mappings() -> list[str]:
    paths = set()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                paths.add(fields[5].strip())
    return sorted(paths)


def _children() -> list[str]:
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(proc.cmdline())[:300])
        except psutil.Error:
            pass
    return sorted(found)


def _base_files(base: Path) -> list[str]:
    return sorted(str(path.relative_to(base)) for path in base.rglob("*") if not path.is_dir()) if base.exists() else []


FORMER_TRAINERS: list[weakref.ref[Any]] = []  # every trainer made so far, to wait until the aborted ones are freed
RELEASE_WAIT_S = 60.0


def _wait_until_former_trainers_are_freed() -> dict[str, Any]:
    """Poll (deadline RELEASE_WAIT_S) until no earlier trainer is alive.

    After an abort the previous trainer (with its 16 gloo groups: threads, sockets, pipes) is
    sometimes still referenced for a moment by something the garbage collector does not see (a
    frame still unwinding in another thread, a C++ callback), so a snapshot taken at once counts
    it. Waiting for it keeps the leak check exact: a trainer that is never freed is still found,
    as the snapshot then records it as alive.
    """
    deadline, started = time.monotonic() + RELEASE_WAIT_S, time.monotonic()
    while True:
        gc.collect()
        alive = sum(ref() is not None for ref in FORMER_TRAINERS)
        if alive == 0 or time.monotonic() > deadline:
            return {"former_trainers_alive": alive, "waited_for_their_release_s": round(time.monotonic() - started, 2)}
        time.sleep(0.1)


def snapshot(base: Path) -> dict[str, Any]:
    from ml_flashpoint_nemo.core.lifecycle import live_resources

    release = _wait_until_former_trainers_are_freed()
    return {
        **release,
        "python_threads": sorted(thread.name for thread in threading.enumerate()),
        "os_threads": _thread_names(),
        "fds": _fd_targets(),
        "children": _children(),
        "tmpfs_mappings": _tmpfs_mappings(),
        "base_files": _base_files(base),
        "live_flashpoint_resources": live_resources(),
    }


# --- the run ----------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(EXAMPLES))  # before site-packages' own `examples` package
    sys.path.insert(0, str(REPO))
    # Every process group's gloo timeout: NeMo reads this for the default group (also with gloo).
    os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = str(int(args.gloo_timeout))

    import lightning.pytorch as pl
    import tiny_gpt  # the CPU shims and every NeMo import, before the Wrapper starts watching progress
    import torch.distributed as dist
    from megatron.core import parallel_state
    from nemo.lightning.one_logger_callback import OneLoggerNeMoCallback
    from nemo.utils import AppState
    from nemo.utils import logging as nemo_logging
    from nv_one_logger.api.one_logger_provider import OneLoggerProvider
    from nvidia_resiliency_ext import inprocess

    from ml_flashpoint_nemo import FlashpointAbort
    from tests.support import nemo_train

    # NeMo's telemetry (OneLogger, on rank 0) keeps the spans of an aborted run open, and the next run's
    # on_train_start raises "Cannot start span training_loop while 1 span(s) with the same name is already active";
    # NeMo 2.7.3 offers no reset, and no telemetry exporter is configured here anyway.
    OneLoggerProvider.instance().force_disable_logging()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    out, base = Path(args.out), Path(args.base)
    out.mkdir(parents=True, exist_ok=True)

    initialize_model_parallel = parallel_state.initialize_model_parallel

    def with_short_timeout(*positional: Any, **options: Any) -> Any:
        options.setdefault("distributed_timeout_minutes", args.gloo_timeout / 60)  # Megatron's groups
        return initialize_model_parallel(*positional, **options)

    parallel_state.initialize_model_parallel = with_short_timeout

    # One store for the process groups of every iteration, each iteration under its own prefix: keys of an
    # aborted iteration (gloo's peer addresses) must not be read by the next one.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port + 1, world_size, is_master=rank == 0, multi_tenant=True,
                          wait_for_workers=True, use_libuv=True)
    snapshots: dict[str, Any] = {"before": snapshot(base)}
    iterations: list[dict[str, Any]] = []
    make_trainer = tiny_gpt.make_trainer

    class Fault(pl.Callback):
        def __init__(self, iteration: int) -> None:
            self.iteration = iteration
            self.step = args.fault_at[iteration] if iteration < len(args.fault_at) else None

        def on_train_batch_end(self, trainer: Any, *unused: Any) -> None:
            if trainer.global_step == self.step and trainer.global_rank == args.fault_rank:
                print(f"inprocess_rank: rank {rank} raises after step {self.step} in iteration {self.iteration}",
                      flush=True)
                raise RuntimeError(f"injected fault after step {self.step} (restart iteration {self.iteration})")

    class Record(pl.Callback):
        """Where this iteration resumed from and its losses, kept as plain data (no reference to the trainer)."""

        def __init__(self, entry: dict[str, Any]) -> None:
            self.entry = entry

        def on_train_start(self, trainer: Any, *unused: Any) -> None:
            decision = getattr(trainer, "_flashpoint_resume", None)
            self.entry["resumed_from"] = decision.source if decision else None
            self.entry["ram_step"] = decision.ram_step if decision else None
            self.entry["start_step"] = int(trainer.global_step)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *unused: Any) -> None:
            loss = outputs if not isinstance(outputs, dict) else outputs["loss"]
            self.entry["losses"].append([int(trainer.global_step), float(loss.detach().float().item())])

    # Lightning's handlers of the signals its _SignalConnector replaces, as they were before any trainer.
    signal_handlers_before = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}

    def release_framework_state() -> None:
        """What NeMo, Megatron and Lightning keep of a finished or aborted run (none of it flashpoint's).

        1. Megatron's model-parallel groups: NeMo creates new ones only if none exist, so after an abort it would
           train on the destroyed ones ("Group ... is not registered"); Megatron-Bridge's restart drops them too.
           Megatron 0.15.3's destroy_model_parallel() forgets two of them (2 gloo contexts, 6 threads).
        2. NeMo's OneLogger callback is a process-wide singleton in every trainer's callbacks, and Lightning binds
           each run's LightningModule.log/log_dict to every callback: the singleton keeps the last run's model, and
           with it that run's gloo process groups (17 here, 51 threads, ~75 fds), alive.
        3. NeMo's AppState singleton keeps the last run's data/tensor/pipeline-parallel groups (5 gloo contexts).
        4. NeMoLogger adds a new FileHandler for its log file at every run (to NeMo's and Megatron's loggers) and
           never closes the previous one.
        5. Lightning's SIGTERM handler (a _HandlersCompose of the trainer's _SignalConnector methods) is put back only
           by the trainer's teardown, which NVRx's RankShouldRestart can interrupt: it lands in the main thread as
           soon as a timed-out gloo op returns, which may be inside Lightning's exception handling. The handler then
           keeps the aborted trainer alive, and the next trainer chains it into its own handler (Lightning calls
           the SIGTERM handler it finds). Until then the snapshots found that trainer alive after the 60 s wait in a
           quarter of the runs.
        """
        for number, handler in signal_handlers_before.items():  # main thread: Finalize and the end of a run
            signal.signal(number, handler)
        parallel_state.destroy_model_parallel()
        parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None  # noqa: SLF001
        parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None  # noqa: SLF001
        telemetry_callback = OneLoggerNeMoCallback._instance
        for name in ("log", "log_dict"):
            telemetry_callback.__dict__.pop(name, None)
        app_state = AppState()
        app_state.data_parallel_group = app_state.tensor_model_parallel_group = None
        app_state.pipeline_model_parallel_group = None
        for name in ("file", "file_err"):
            handler = nemo_logging._handlers.pop(name, None)  # noqa: SLF001 - NeMo offers no way to remove it
            if handler is not None:
                for logger in (nemo_logging._logger, logging.getLogger("megatron.core")):  # noqa: SLF001
                    logger.removeHandler(handler)
                handler.close()

    class ReleaseFrameworkState(inprocess.finalize.Finalize):
        """After an abort, in the main thread (NVRx's ThreadedFinalize needs CUDA: "CUDA is not available")."""

        def __call__(self, state: Any) -> Any:
            release_framework_state()
            return state

    @inprocess.Wrapper(
        store_kwargs={"port": port + 2},
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), FlashpointAbort()),
        initialize=inprocess.initialize.RetryController(max_iterations=len(args.fault_at) + 1),
        finalize=ReleaseFrameworkState(),
        monitor_process_logfile=str((out / "monitor-{rank}.log").absolute()),
    )
    def train(call_wrapper: Optional[inprocess.CallWrapper] = None) -> int:
        iteration = call_wrapper.iteration
        snapshots[f"iteration-{iteration}"] = snapshot(base)
        entry: dict[str, Any] = {"iteration": iteration, "losses": []}
        iterations.append(entry)
        prefix_store = dist.PrefixStore(f"iteration-{iteration}", store)
        # The snapshot waits (up to RELEASE_WAIT_S) for this rank's aborted trainer to be freed, which can take
        # seconds on one rank and none on the other. Without this barrier the faster rank reaches the process group's
        # rendezvous first and gives up after the gloo timeout (20 s) while its peer is still in the snapshot.
        prefix_store.set(f"snapshot-taken-{rank}", "1")
        prefix_store.wait([f"snapshot-taken-{peer}" for peer in range(world_size)],
                          datetime.timedelta(seconds=RELEASE_WAIT_S + 60))

        def make_trainer_for_this_iteration(*positional: Any, callbacks: Any = None, **options: Any) -> Any:
            trainer = make_trainer(*positional, callbacks=[*(callbacks or []), Record(entry), Fault(iteration)],
                                   **options)
            trainer.strategy.store = prefix_store  # NeMo's MegatronStrategy initializes its process group with it
            FORMER_TRAINERS.append(weakref.ref(trainer))
            return trainer

        tiny_gpt.make_trainer = make_trainer_for_this_iteration  # nemo_train imports tiny_gpt: the same module
        sys.argv = [nemo_train.__file__, "--steps", str(args.steps), "--every", str(args.every), "--async-save",
                    "--save-worker-up", "--out", str(out), "--base", str(base)]
        try:
            nemo_train.main()
        except Exception:
            logging.getLogger("inprocess_rank").exception("restart iteration %d failed", iteration)  # NVRx: repr only
            raise
        dist.destroy_process_group()  # as after any run; the next call of the Wrapper needs none to exist
        release_framework_state()
        return iteration

    started = datetime.datetime.now()
    final_iteration = train()
    snapshots["end"] = snapshot(base)
    print(f"inprocess_rank: rank {rank} finished in restart iteration {final_iteration} after "
          f"{(datetime.datetime.now() - started).total_seconds():.1f} s", flush=True)
    (out / f"resources-rank{rank}.json").write_text(json.dumps(snapshots, indent=1))
    if rank == 0:
        (out / "iterations.json").write_text(json.dumps(iterations, indent=1))


if __name__ == "__main__":
    main()
