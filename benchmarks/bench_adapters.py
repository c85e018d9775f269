"""What the adapters add on top of the core, measured in one run against references from the same run.

DESIGN.md §3 and §8 give the budgets this script checks; every line has `target` and
`meets_target` where a budget exists:

- staging_copy       the reference for async saves: one torch copy_ of every tensor into
                     already-allocated, already-touched host tensors, with torch's default
                     threads (`seconds`) and with one thread (`seconds_1thread`).
- async_blocking     Megatron dist_checkpointing.save(..., FlashpointSaveStrategy(),
                     async_sharded_save=True) plus AsyncCallsQueue.schedule_async_request:
                     the time the training step waits, as the NeMo IO saves by default (its
                     PersistentWorkerQueue: the worker, started at set-up, is up before the
                     timed saves; the sharding-integrity check on the first save only;
                     --fork-per-save, --validate-every-save change either). The
                     finalize (maybe_finalize_async_calls(blocking=True)) is not part of it.
                     Budget: blocking <= 1.1x the faster of the two staging copies
                     (torch's threads can stall in OpenMP on a busy machine). Measured with
                     Python's GC on (the budget) and off (gc_off_*, as trainers often run).
                     worker_start_seconds: how long starting the persistent worker blocked
                     the caller (its boot runs in the worker).
- dcp_save_vs_core   dcp.save({"model": state}) with a reused MemoryStorageWriter vs
                     CheckpointSaver.save(state) (a training script hands DCP a few top-level
                     keys; DCP logs each one's state_dict() call).
- dcp_load_vs_core   dcp.load with MemoryStorageReader vs load_version, both into
                     pre-allocated tensors. Budget for both: DCP adds <= 10%. The runs of
                     each row's variants are interleaved, round by round.
                     Both rows split the DCP call: flashpoint_seconds is the time inside our
                     StorageWriter / StorageReader methods in those same runs, less the planner
                     callbacks any storage layer makes per item (resolve_data; resolve_tensor,
                     commit_tensor, load_bytes) and less the timing wrappers' own cost per
                     callback (callback_residual_us, measured in the same process). It includes
                     the core's work:
                     flashpoint_overhead = flashpoint / core - 1 is what the adapter adds, also
                     checked against 10%. adapter_seconds is flashpoint_seconds less the core's
                     own work inside it (writing the object, retiring, the commit record; opening
                     the object with its index, reading it, the commit record):
                     the adapter alone, free of where two objects' tmpfs pages landed (the same
                     bytes written at different times read 10-35% apart); adapter_overhead is it
                     over the core, also checked against 10%. torch_part_seconds is the rest, DCP's
                     own work.
                     torch_seconds cross-checks that part: the same call with a no-op
                     StorageWriter / StorageReader (the default planners still plan every item,
                     exchange plans through the process group and resolve every item; no byte is
                     copied), which no storage layer can avoid.
                     dcp_save_vs_core also gives plan_cached_seconds: dcp.save with
                     DefaultSavePlanner(enable_plan_caching=True), a caller's option.
- manager_warmup_return  how long start_manager_warmup() takes to return in this process
                     (budget < 5 ms); also how long until the Manager is ready.
- manager_ready_nemo / manager_ready_bare  the same in a child interpreter whose main
                     script imported nemo.lightning first / did not import NeMo.

Megatron and DCP run in a single-process gloo group (world size 1). On a CPU-only torch,
Megatron's dist_checkpointing needs the two CUDA shims of ml_flashpoint_nemo/testing/cpu_shims.py (install_for_checkpointing);
they are installed before megatron is imported and the output says so. The state is a
few large tensors (~90% of the bytes) and ~500 small ones, random values from a fixed
seed; every figure is the median of --runs runs; gbps counts tensor bytes (1 GB = 1e9 B).

    python benchmarks/bench_adapters.py                 # table
    python benchmarks/bench_adapters.py --json          # one JSON object per line
"""

from __future__ import annotations

import sys
import time

CHILD_FLAG = "--child-manager"
CHILD_NEMO_FLAG = "--child-import-nemo"

# A child started with CHILD_NEMO_FLAG stands for a training script that imports NeMo at its
# top level, before anything else. Were the Manager's spawned process to re-import the main
# module (spawn does by default), it would pay for this import as well.
NEMO_IMPORT_SECONDS: float | None = None
if CHILD_FLAG in sys.argv[1:] and CHILD_NEMO_FLAG in sys.argv[1:]:
    _import_start = time.perf_counter()
    import nemo.lightning  # noqa: F401

    NEMO_IMPORT_SECONDS = time.perf_counter() - _import_start

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
from itertools import count  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]  # bench_core, tests.support

import torch  # noqa: E402

from ml_flashpoint_nemo.testing import cpu_shims  # noqa: E402

# Must run before megatron is imported: dist_checkpointing calls torch.cuda.current_device()
# and torch.cuda.synchronize(), which a CPU-only torch refuses. A no-op when CUDA is present.
MEGATRON_CPU_SHIM = not torch.cuda.is_available()
cpu_shims.install_for_checkpointing()

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from bench_core import (  # noqa: E402
    GIB,
    LARGE_COLUMNS,
    LARGE_DTYPES,
    SEED,
    SMALL_DTYPES,
    WARMUP_SAVES,
    Bench,
    Result,
    TensorSpec,
    build_state,
    check_equal,
    common_arguments,
    finish_common_arguments,
    in_fresh_workdir,
    median_of_runs,
    medians_interleaved,
    state_nbytes,
    timed,
    zero_,
)
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.metadata import Metadata  # noqa: E402
from torch.distributed.checkpoint.planner import (  # noqa: E402
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult  # noqa: E402

from ml_flashpoint_nemo.core import CheckpointSaver, load_version  # noqa: E402
from ml_flashpoint_nemo.core.gc_pause import gc_paused  # noqa: E402
from ml_flashpoint_nemo.core.sync_manager import shutdown_manager, start_manager_warmup, wait_for_manager  # noqa: E402
from ml_flashpoint_nemo.core.tuning import default_copy_threads  # noqa: E402
from ml_flashpoint_nemo.dcp import MemoryStorageReader, MemoryStorageWriter  # noqa: E402
from ml_flashpoint_nemo.dcp import reader as dcp_reader_module  # noqa: E402
from ml_flashpoint_nemo.dcp import writer as dcp_writer_module  # noqa: E402
from ml_flashpoint_nemo.megatron import FlashpointLoadStrategy, FlashpointSaveStrategy  # noqa: E402
from ml_flashpoint_nemo.megatron.async_workers import PersistentWorkerQueue  # noqa: E402

LARGE_TENSORS = 4
SMALL_TENSORS = 500
SMALL_SHARE = 0.10  # of the bytes, spread over the small tensors (each 0.5x-1.5x the mean)
MIN_SMALL_BYTES = 64

BLOCKING_BUDGET = 1.1  # async blocking time / staging copy time
DCP_OVERHEAD_BUDGET = 0.10  # DCP seconds / core seconds - 1
# What DCP calls on our StorageWriter / StorageReader during dcp.save / dcp.load: the adapter's own part.
WRITER_METHODS = ("reset", "set_up_storage_writer", "storage_meta", "prepare_local_plan", "prepare_global_plan",
                  "write_data", "finish")
READER_METHODS = ("reset", "read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan",
                  "read_data")
LOAD_CALLBACKS = ("resolve_tensor", "commit_tensor", "load_bytes")  # the planner's work, whoever calls it
MANAGER_RETURN_BUDGET_S = 0.005
CHILD_TIMEOUT_S = 240
WORKER_BOOT_TIMEOUT_S = 240

State = dict[str, torch.Tensor]
Row = dict[str, Any]
ROW_ORDER = ("staging_copy", "async_blocking", "dcp_save_vs_core", "dcp_load_vs_core",
             "manager_warmup_return", "manager_ready_nemo", "manager_ready_bare")


# ---------------------------------------------------------------- the state


def plan_state(total_bytes: int, seed: int = SEED) -> list[TensorSpec]:
    """A few large 2-D tensors (~90% of total_bytes), then ~500 small 1-D ones of several dtypes."""
    rng = random.Random(seed)
    small_mean = max(MIN_SMALL_BYTES, int(total_bytes * SMALL_SHARE / SMALL_TENSORS))
    small = []
    for i in range(SMALL_TENSORS):
        dtype = rng.choice(SMALL_DTYPES)
        numel = max(1, int(small_mean * rng.uniform(0.5, 1.5)) // dtype.itemsize)
        small.append(TensorSpec(f"small.{i:03d}", dtype, (numel,)))
    large_each = max(0, total_bytes - state_nbytes(small)) // LARGE_TENSORS
    large = []
    for j in range(LARGE_TENSORS):
        dtype = LARGE_DTYPES[j % len(LARGE_DTYPES)]
        rows = max(1, large_each // (LARGE_COLUMNS * dtype.itemsize))
        large.append(TensorSpec(f"large.{j}", dtype, (rows, LARGE_COLUMNS)))
    return large + small


def sharded_state_dict(state: State) -> dict[str, ShardedTensor]:
    """World size 1: every tensor is a whole, unsharded ShardedTensor (no sharding axes, main replica)."""
    return {key: ShardedTensor.from_rank_offsets(key, tensor) for key, tensor in state.items()}


# ---------------------------------------------------------------- helpers


def row(name: str, result: Result | None = None, **fields: Any) -> Row:
    """One output line: the result's median and spread, then the given fields."""
    out: Row = {"name": name}
    if result is not None:
        out.update(
            seconds=round(result.seconds, 6), runs=len(result.samples),
            min_seconds=round(min(result.samples), 6), max_seconds=round(max(result.samples), 6),
        )
        if result.nbytes:
            out.update(gbps=round(result.gbps, 3), nbytes=result.nbytes)
        out.update(result.extra)
    out.update(fields)
    return out


def budget(value: float, target: float) -> Row:
    return {"target": target, "meets_target": bool(value <= target)}


def median(samples: list[float]) -> float:
    return round(statistics.median(samples), 6)


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def patched(owner: type, method: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """owner.method is replacement while active."""
    original = getattr(owner, method)
    setattr(owner, method, replacement)
    try:
        yield
    finally:
        setattr(owner, method, original)


@contextlib.contextmanager
def recording_seconds(owner: type, method: str, samples: list[float]) -> Iterator[None]:
    """While active, every call of owner.method appends its wall-clock seconds to samples."""
    original = getattr(owner, method)

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            samples.append(time.perf_counter() - start)

    with patched(owner, method, recorded):
        yield


class TimeInside:
    """Per run of an action, the seconds spent inside some methods of a class (outermost calls only),
    less the time those methods spend in callbacks into someone else's code.

    Used for the adapters' own part of a dcp.save / dcp.load: every StorageWriter / StorageReader
    method DCP calls, timed in the same runs as the whole call (no two noisy medians subtracted),
    less the planner callbacks every storage layer makes per item (DCP's planner's work). The
    wrappers around those callbacks cost time of their own (~0.3-1 us per call, hundreds of calls
    per save): that cost is the instrument's, not the adapter's, so it is measured in this process
    (callback_residual) and taken off per callback made. `contexts` are methods that return a
    context manager (the core's open_object): the time of entering and leaving it is counted.
    """

    def __init__(self, owner: Any, methods: tuple[str, ...], callbacks: tuple[tuple[type, str], ...] = (),
                 contexts: tuple[str, ...] = ()) -> None:
        self.owner, self.methods, self.callbacks, self.contexts = owner, methods, callbacks, contexts
        self.samples: list[float] = []
        self.callback_residual = 0.0  # seconds a callback's wrapper adds outside what it subtracts
        self._total = 0.0
        self._callbacks_made = 0
        self._depth = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        if self.callbacks:
            self.callback_residual = self._calibrate_callback_wrapper()
        with contextlib.ExitStack() as stack:
            for method in self.methods:
                stack.enter_context(patched(self.owner, method, self._timed(getattr(self.owner, method), +1)))
            for method in self.contexts:
                stack.enter_context(patched(self.owner, method, self._timed_context(getattr(self.owner, method))))
            for owner, method in self.callbacks:
                stack.enter_context(patched(owner, method, self._timed(getattr(owner, method), -1)))
            yield

    def _timed(self, original: Callable[..., Any], sign: int) -> Callable[..., Any]:
        @functools.wraps(original)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            outermost = self._depth == 0
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if sign > 0 and outermost:
                    self._total += time.perf_counter() - start
                elif sign < 0 and not outermost:  # a callback made from inside our methods
                    self._total -= time.perf_counter() - start
                    self._callbacks_made += 1

        return timed_call

    def _timed_context(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        @functools.wraps(original)
        def timed_context(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with contextlib.ExitStack() as stack:
                start = time.perf_counter()
                entered = stack.enter_context(original(*args, **kwargs))
                self._total += time.perf_counter() - start
                try:
                    yield entered
                finally:
                    start = time.perf_counter()
                    stack.close()
                    self._total += time.perf_counter() - start

        return timed_context

    def _calibrate_callback_wrapper(self, calls: int = 20_000, rounds: int = 5) -> float:
        """Seconds per call that a callback's wrapper adds over calling the callback directly, less what
        it subtracts: what the adapter's figure would wrongly carry per callback (best of a few rounds)."""

        def noop() -> None:
            return None

        wrapped = self._timed(noop, -1)
        saved = self._total, self._depth, self._callbacks_made
        best = float("inf")
        try:
            for _ in range(rounds):
                self._total, self._depth = 0.0, 1  # as when called from inside one of our methods
                start = time.perf_counter()
                for _ in range(calls):
                    wrapped()
                with_wrapper = time.perf_counter() - start + self._total  # _total holds minus what was subtracted
                start = time.perf_counter()
                for _ in range(calls):
                    noop()
                direct = time.perf_counter() - start
                best = min(best, (with_wrapper - direct) / calls)
        finally:
            self._total, self._depth, self._callbacks_made = saved
        return max(best, 0.0)

    def around(self, action: Callable[[], Any]) -> Callable[[], None]:
        """action, adding the time it spent inside the methods to samples."""

        def run() -> None:
            self._total, self._callbacks_made = 0.0, 0
            action()
            self.samples.append(self._total - self._callbacks_made * self.callback_residual)

        return run


@contextlib.contextmanager
def single_process_group(workdir: Path) -> Iterator[None]:
    """A gloo group of world size 1 over a FileStore in workdir (no TCP port to pick)."""
    store = dist.FileStore(str(workdir / "gloo.store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- measurements


def bench_staging_copy(bench: Bench, dest: State) -> tuple[Result, Result]:
    """One torch copy_ per tensor into dest, whose pages exist and were written once."""

    def copy() -> None:
        for key, tensor in bench.state.items():
            dest[key].copy_(tensor)

    copy()
    default = median_of_runs("staging_copy", timed(copy), bench.runs, bench.nbytes,
                             threads=torch.get_num_threads(), tensors=len(bench.state))
    with torch_threads(1):
        single = median_of_runs("staging_copy_1thread", timed(copy), bench.runs, bench.nbytes, threads=1)
    return default, single


def staging_row(default: Result, single: Result) -> Row:
    return row(
        "staging_copy", default,
        seconds_1thread=round(single.seconds, 6), gbps_1thread=round(single.gbps, 3),
        min_seconds_1thread=round(min(single.samples), 6),
        note="torch copy_ of every tensor into pre-allocated, touched host tensors; seconds with torch's "
        "default threads, seconds_1thread with one",
    )


Parts = dict[str, list[float]]


def new_parts() -> Parts:
    return {"save": [], "schedule": [], "stage": [], "finalize": []}


def bench_async_blocking(
    bench: Bench, dest: State, *, persistent: bool = True, validate_once: bool = False
) -> tuple[tuple[Result, Parts], tuple[Result, Parts], float | None]:
    """Megatron async save + AsyncCallsQueue scheduling, timed (the finalize is not); with Python's GC on, then off.

    Also returns the seconds PersistentWorkerQueue.start_worker() took to return (None: fork per save).

    Each pass also returns the seconds of the parts of its saves. GC off is how trainers often
    run (NeMo's GarbageCollectionCallback, Megatron's --manual-gc); with it on, a save may
    trigger a full collection of every object the process holds.
    """
    base = bench.fresh_dir("megatron")
    steps = count()
    manager = start_manager_warmup()  # as trainer set-up does, off the critical path
    strategy = FlashpointSaveStrategy(manager_future=manager)
    queue = PersistentWorkerQueue() if persistent else AsyncCallsQueue()
    worker_start = None
    if persistent:  # as the IO does at trainer set-up; the timed saves measure the worker once it is up
        began = time.perf_counter()
        queue.start_worker()
        worker_start = time.perf_counter() - began
        if not queue.worker_ready(timeout=WORKER_BOOT_TIMEOUT_S):
            raise RuntimeError(f"the persistent save worker was not up within {WORKER_BOOT_TIMEOUT_S} s")
    saves = count()

    def blocking_save(parts: Parts) -> float:
        sharded = sharded_state_dict(bench.state)
        checkpoint_dir = base / f"step-{next(steps)}"
        checkpoint_dir.mkdir(parents=True)
        start = time.perf_counter()
        with recording_seconds(CheckpointSaver, "stage_object", parts["stage"]):
            # validate_once: Megatron's sharding-integrity check (a gather) on the first save only
            request = dist_checkpointing.save(sharded, str(checkpoint_dir), sharded_strategy=strategy,
                                              async_sharded_save=True,
                                              validate_access_integrity=not validate_once or next(saves) == 0)
        saved = time.perf_counter()
        queue.schedule_async_request(request)
        scheduled = time.perf_counter()
        queue.maybe_finalize_async_calls(blocking=True)
        parts["save"].append(saved - start)
        parts["schedule"].append(scheduled - saved)
        parts["finalize"].append(time.perf_counter() - scheduled)
        return scheduled - start

    def timed_pass(name: str) -> tuple[Result, Parts]:
        parts = new_parts()
        return median_of_runs(name, functools.partial(blocking_save, parts), bench.runs, bench.nbytes), parts

    try:
        for _ in range(WARMUP_SAVES):  # the first waits for the Manager; both warm pool buffers and caches
            blocking_save(new_parts())
        gc_on = timed_pass("async_blocking")
        with gc_paused():
            gc_off = timed_pass("async_blocking_gc_off")
        zero_(dest)
        loaded = dist_checkpointing.load(sharded_state_dict(dest), str(base / f"step-{next(steps) - 1}"),
                                         sharded_strategy=FlashpointLoadStrategy())
        check_equal(loaded, bench.state, "async_blocking (load of the last async save)")
    except BaseException:
        queue.close(abort=True)
        raise
    else:
        queue.close()
    finally:
        shutdown_manager(manager)
        shutil.rmtree(base, ignore_errors=True)
    return gc_on, gc_off, worker_start


def blocking_row(gc_on: tuple[Result, Parts], gc_off: tuple[Result, Parts], staging: Result,
                 staging_1thread: Result, *, persistent: bool, validate_once: bool,
                 worker_start: float | None) -> Row:
    """The budget is checked with GC on, against the faster of the two staging copies (the stricter reference).

    With torch's default threads on a busy 2-core machine, copy_ can stall in OpenMP and take
    many times longer than with one thread; the faster copy keeps such a stall from passing.
    """
    (result, parts), (result_gc_off, parts_gc_off) = gc_on, gc_off
    reference, label = min((staging, "default_threads"), (staging_1thread, "1thread"), key=lambda r: r[0].seconds)
    ratio = result.seconds / reference.seconds
    return row(
        "async_blocking", result,
        **blocking_parts(result, parts),
        staging_copy_seconds=round(staging.seconds, 6), staging_copy_1thread_seconds=round(staging_1thread.seconds, 6),
        staging_reference=label, ratio_blocking_over_staging=round(ratio, 3),
        ratio_blocking_over_staging_default_threads=round(result.seconds / staging.seconds, 3),
        ratio_blocking_over_staging_1thread=round(result.seconds / staging_1thread.seconds, 3),
        **budget(ratio, BLOCKING_BUDGET),
        gc_off_seconds=round(result_gc_off.seconds, 6), gc_off_max_seconds=round(max(result_gc_off.samples), 6),
        gc_off_ratio_blocking_over_staging=round(result_gc_off.seconds / reference.seconds, 3),
        **{f"gc_off_{k}": v for k, v in blocking_parts(result_gc_off, parts_gc_off).items()},
        copy_threads=default_copy_threads(), warmup_saves=WARMUP_SAVES, megatron_cpu_shim=MEGATRON_CPU_SHIM,
        persistent_worker=persistent,
        worker_start_seconds=None if worker_start is None else round(worker_start, 6),
        validate_access_integrity="first save only" if validate_once else "every save",
        note="seconds = dist_checkpointing.save(async_sharded_save=True) + "
        f"{'PersistentWorkerQueue (worker up)' if persistent else 'AsyncCallsQueue (fork per save)'}"
        ".schedule_async_request; stage_copy_seconds = CheckpointSaver.stage_object inside "
        "it; finalize (maybe_finalize_async_calls(blocking=True)) untimed; ratio against the faster staging copy; "
        "gc_off_* = the same with Python's GC disabled. "
        + ("CPU-only torch: ml_flashpoint_nemo.testing.cpu_shims.install_for_checkpointing() shims torch.cuda.synchronize/current_device"
           if MEGATRON_CPU_SHIM else "CUDA present: no shim"),
    )


def blocking_parts(result: Result, parts: Parts) -> Row:
    return {
        "save_seconds": median(parts["save"]), "schedule_seconds": median(parts["schedule"]),
        "stage_copy_seconds": median(parts["stage"]),
        "non_copy_seconds": median([total - stage for total, stage in zip(result.samples, parts["stage"])]),
        "finalize_seconds": median(parts["finalize"]),
    }


class NoopStorageWriter(StorageWriter):
    """DCP's part of dcp.save alone: resolves every item as a real writer must, stores nothing."""

    def __init__(self) -> None:
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "torch.futures.Future[list[WriteResult]]":
        results = []
        for item in plan.items:
            planner.resolve_data(item)
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class NoopStorageReader(StorageReader):
    """DCP's part of dcp.load alone: the metadata of a no-op save; resolves and commits every item, reads nothing."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "torch.futures.Future[None]":
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue  # the benchmark's state has no bytes items
            planner.commit_tensor(item, planner.resolve_tensor(item))
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def bench_dcp_vs_core(bench: Bench, dest: State) -> list[Row]:
    """The state goes to DCP as a user's call hands it over, {"model": state}: DCP logs every top-level
    key's state_dict() call (two log records each), so 500 tensors as 500 top-level keys would charge DCP
    ~20 ms that no training script pays. The core path takes the same tensors flat."""
    dcp_base, core_base = bench.fresh_dir("dcp"), bench.fresh_dir("core")
    dcp_steps, core_steps = count(), count()
    nested, nested_dest = {"model": bench.state}, {"model": dest}
    writer = MemoryStorageWriter(dcp_base)  # reused for every save, as a job would
    noop_writer = NoopStorageWriter()
    own_save = TimeInside(MemoryStorageWriter, WRITER_METHODS, ((DefaultSavePlanner, "resolve_data"),))
    own_load = TimeInside(MemoryStorageReader, READER_METHODS, tuple((DefaultLoadPlanner, m) for m in LOAD_CALLBACKS))
    # The core's own work inside those runs, what CheckpointSaver.save / load_version also do (write this object,
    # retire, write the commit record / read the commit record, open this object and check its index, read its
    # bytes): ours less it is the adapter alone
    core_in_save_object = TimeInside(CheckpointSaver, ("write_object",))
    core_in_save_versions = TimeInside(dcp_writer_module, ("retire_superseded", "write_commit"))
    core_in_load = TimeInside(dcp_reader_module, ("read_object", "read_commit"), contexts=("open_object",))
    try:
        with CheckpointSaver(core_base) as saver:

            def dcp_save() -> None:
                dcp.save(nested, checkpoint_id=f"{dcp_base}/step-{next(dcp_steps)}", storage_writer=writer)

            def core_save() -> None:
                saver.save(next(core_steps), bench.state)

            def torch_save() -> None:
                dcp.save(nested, checkpoint_id=f"{dcp_base}/noop", storage_writer=noop_writer)

            def plan_cached_save() -> None:
                dcp.save(nested, checkpoint_id=f"{dcp_base}/step-{next(dcp_steps)}", storage_writer=writer,
                         planner=DefaultSavePlanner(enable_plan_caching=True))

            for _ in range(WARMUP_SAVES):
                dcp_save()
                core_save()
                torch_save()
            plan_cached_save()  # fills torch's plan cache (class-level, keyed by the planner's class)
            with own_save.recording(), core_in_save_object.recording(), core_in_save_versions.recording():
                *saves, plan_cached = medians_interleaved(
                    bench.runs, bench.nbytes,
                    dcp_save=timed(own_save.around(core_in_save_object.around(core_in_save_versions.around(dcp_save)))),
                    core_save=timed(core_save),
                    torch_save=timed(torch_save), dcp_save_plan_cached=timed(plan_cached_save))
            dcp_last, core_last = next(dcp_steps) - 1, next(core_steps) - 1

            def dcp_load() -> None:
                dcp.load(nested_dest, checkpoint_id=f"{dcp_base}/step-{dcp_last}",
                         storage_reader=MemoryStorageReader(dcp_base))

            def torch_load() -> None:
                dcp.load(nested_dest, checkpoint_id=f"{dcp_base}/noop",
                         storage_reader=NoopStorageReader(noop_writer.metadata))

            core_load = functools.partial(load_version, core_base, core_last, into=dest)
            dcp_load()
            check_equal(dest, bench.state, "dcp_load")
            zero_(dest)
            core_load()
            check_equal(dest, bench.state, "core load_version")
            with own_load.recording(), core_in_load.recording():
                loads = medians_interleaved(
                    bench.runs, bench.nbytes,
                    dcp_load=timed(own_load.around(core_in_load.around(dcp_load)), setup=lambda: zero_(dest)),
                    core_load=timed(core_load, setup=lambda: zero_(dest)), torch_load=timed(torch_load))
    finally:
        writer.close()
        shutil.rmtree(dcp_base, ignore_errors=True)
        shutil.rmtree(core_base, ignore_errors=True)
    return [
        comparison_row("dcp_save_vs_core", *saves, own_save.samples,
                       [a + b for a, b in zip(core_in_save_object.samples, core_in_save_versions.samples)],
                       warmup_saves=WARMUP_SAVES,
                       callback_residual_us=round(own_save.callback_residual * 1e6, 3),
                       plan_cached_seconds=round(plan_cached.seconds, 6),
                       plan_cached_overhead=round(plan_cached.seconds / saves[1].seconds - 1, 4),
                       note="dcp.save({'model': state}, MemoryStorageWriter reused) vs CheckpointSaver.save(state); "
                       "checksums on, keep=1; torch_seconds = dcp.save with a no-op StorageWriter; plan_cached_* = "
                       "dcp.save with DefaultSavePlanner(enable_plan_caching=True); runs interleaved"),
        comparison_row("dcp_load_vs_core", *loads, own_load.samples, core_in_load.samples,
                       callback_residual_us=round(own_load.callback_residual * 1e6, 3),
                       note="dcp.load(MemoryStorageReader) vs load_version, into pre-allocated touched tensors; "
                       "torch_seconds = dcp.load with a no-op StorageReader; runs interleaved"),
    ]


def comparison_row(name: str, dcp_result: Result, core_result: Result, torch_result: Result, own: list[float],
                   core_inside: list[float], **fields: Any) -> Row:
    """overhead: all a DCP call adds over the core (the budget); flashpoint_*: the time inside our
    StorageWriter/Reader methods in the same DCP runs, over the core; adapter_*: the same less the
    core's own work inside those methods (writing / reading the DCP version's object, retiring, the
    commit record: what the core's save / load_version do too), i.e. the adapter alone: two objects of the same bytes, written at different
    times, can read 10-35% apart (where their tmpfs pages landed), which flashpoint_* charges to the
    adapter; torch_part_*: the rest of each of those runs (DCP's own work); torch_*: DCP with a no-op
    storage layer, a cross-check of that part."""
    overhead = dcp_result.seconds / core_result.seconds - 1
    own_seconds = statistics.median(own)
    flashpoint_overhead = own_seconds / core_result.seconds - 1
    adapter_seconds = statistics.median(ours - core for ours, core in zip(own, core_inside))
    torch_part = statistics.median(whole - ours for whole, ours in zip(dcp_result.samples, own))
    return row(
        name,
        dcp_seconds=round(dcp_result.seconds, 6), core_seconds=round(core_result.seconds, 6),
        dcp_gbps=round(dcp_result.gbps, 3), core_gbps=round(core_result.gbps, 3),
        dcp_min_seconds=round(min(dcp_result.samples), 6), core_min_seconds=round(min(core_result.samples), 6),
        overhead=round(overhead, 4), **budget(overhead, DCP_OVERHEAD_BUDGET),
        flashpoint_seconds=round(own_seconds, 6), flashpoint_overhead=round(flashpoint_overhead, 4),
        flashpoint_meets_target=bool(flashpoint_overhead <= DCP_OVERHEAD_BUDGET),
        adapter_seconds=round(adapter_seconds, 6), core_inside_seconds=round(statistics.median(core_inside), 6),
        adapter_overhead=round(adapter_seconds / core_result.seconds, 4),
        adapter_meets_target=bool(adapter_seconds / core_result.seconds <= DCP_OVERHEAD_BUDGET),
        torch_part_seconds=round(torch_part, 6), torch_part_over_core=round(torch_part / core_result.seconds, 4),
        torch_seconds=round(torch_result.seconds, 6), torch_min_seconds=round(min(torch_result.samples), 6),
        torch_over_core=round(torch_result.seconds / core_result.seconds, 4),
        runs=len(dcp_result.samples), nbytes=dcp_result.nbytes, **fields,
    )


def bench_manager_return(runs: int) -> Row:
    """start_manager_warmup() in this process: time to return; then wait until ready and close."""
    ready: list[float] = []

    def run_once() -> float:
        start = time.perf_counter()
        future = start_manager_warmup()
        returned = time.perf_counter() - start
        try:
            wait_for_manager(future, what="bench_adapters")
            ready.append(time.perf_counter() - start)
        finally:
            future.close()
        return returned

    result = median_of_runs("manager_warmup_return", run_once, runs, 0)
    return row("manager_warmup_return", result, ready_seconds=median(ready),
               **budget(result.seconds, MANAGER_RETURN_BUDGET_S),
               process="this benchmark (torch and megatron.core imported, no NeMo)")


def bench_manager_child(import_nemo: bool, runs: int) -> Row:
    """A fresh interpreter runs this script as its main module and times `runs` warm-ups there."""
    name = "manager_ready_nemo" if import_nemo else "manager_ready_bare"
    report = _run_child(import_nemo, runs)
    # The child measured the samples; the shared helper takes their median.
    result = median_of_runs(name, iter(report["return_seconds"]).__next__, runs, 0)
    return row(
        name, result,
        return_seconds=round(result.seconds, 6), return_first_seconds=round(report["return_seconds"][0], 6),
        ready_seconds=median(report["ready_seconds"]), ready_first_seconds=round(report["ready_seconds"][0], 6),
        nemo_import_seconds=report["nemo_import_seconds"],
        **budget(result.seconds, MANAGER_RETURN_BUDGET_S),
        main_module_imports="nemo.lightning first, then torch and megatron.core" if import_nemo
        else "torch and megatron.core, no NeMo",
        note="child interpreter running this script as __main__; return = start_manager_warmup() returned, "
        "ready = wait_for_manager() returned (both from the call); medians of the child's runs, *_first = its "
        "first Manager",
    )


def _run_child(import_nemo: bool, runs: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, "--runs", str(runs)]
    completed = subprocess.run(command + ([CHILD_NEMO_FLAG] if import_nemo else []),
                               capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if completed.returncode != 0:
        raise RuntimeError(f"manager child failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def child_manager(runs: int) -> None:
    """In the child: time start_manager_warmup() and the wait for its Manager, `runs` times; print one JSON line."""
    returned: list[float] = []
    ready: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        future = start_manager_warmup()
        returned.append(time.perf_counter() - start)
        try:
            wait_for_manager(future, what="bench_adapters child")
            ready.append(time.perf_counter() - start)
        finally:
            future.close()
    print(json.dumps({"return_seconds": returned, "ready_seconds": ready, "nemo_import_seconds": NEMO_IMPORT_SECONDS}))


# ---------------------------------------------------------------- driver


def run_all(args: argparse.Namespace, workdir: Path) -> list[Row]:
    specs = plan_state(int(args.size_gib * GIB))
    print(f"state: {len(specs)} tensors, {state_nbytes(specs) / 1e9:.3f} GB; {args.runs} runs each; "
          f"torch threads {torch.get_num_threads()}, copy threads {default_copy_threads()}; in {workdir}; "
          f"megatron CPU shim {'installed' if MEGATRON_CPU_SHIM else 'not needed'}", file=sys.stderr, flush=True)
    # First, while this process holds no state: the children have the machine to themselves.
    rows = [bench_manager_return(args.runs), bench_manager_child(True, args.runs),
            bench_manager_child(False, args.runs)]
    bench = Bench(build_state(specs), workdir, args.runs, default_copy_threads())
    dest = {key: torch.zeros_like(tensor) for key, tensor in bench.state.items()}
    with single_process_group(workdir):
        staging, staging_1thread = bench_staging_copy(bench, dest)
        rows.append(staging_row(staging, staging_1thread))
        validate_once = not args.validate_every_save
        persistent = not args.fork_per_save
        gc_on, gc_off, worker_start = bench_async_blocking(bench, dest, persistent=persistent,
                                                           validate_once=validate_once)
        rows.append(blocking_row(gc_on, gc_off, staging, staging_1thread, persistent=persistent,
                                 validate_once=validate_once, worker_start=worker_start))
        rows += bench_dcp_vs_core(bench, dest)
    return sorted(rows, key=lambda r: ROW_ORDER.index(r["name"]))


def print_rows(rows: list[Row], as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r))
        return
    for r in rows:
        verdict = "" if "meets_target" not in r else f"  [{'ok' if r['meets_target'] else 'MISSED'} <= {r['target']}]"
        fields = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("name", "note", "target", "meets_target"))
        print(f"{r['name']:<22} {fields}{verdict}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common_arguments(__doc__.split("\n\n")[0], 0.5)
    parser.add_argument("--fork-per-save", action="store_true",
                        help="async saves fork a worker each (the IO's persistent_worker=False) instead of "
                             "going to the persistent worker")
    parser.add_argument("--validate-every-save", action="store_true",
                        help="Megatron's sharding-integrity check every save (its default outside the NeMo IO, "
                             "which checks the first save only)")
    parser.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(CHILD_NEMO_FLAG, action="store_true", help=argparse.SUPPRESS)
    return finish_common_arguments(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_manager:
        child_manager(args.runs)
        return 0
    print_rows(in_fresh_workdir(args.base_dir, "flashpoint-bench-adapters-", lambda workdir: run_all(args, workdir)),
               args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
