"""Throughput of the core save and load paths, as ratios to a plain memcpy measured in the same run.

DESIGN.md §8 states the performance budgets as ratios to memcpy, because absolute
GB/s depend on the machine. This script measures, in one run and on one tmpfs:

- memcpy      the reference: a single-threaded memcpy (libc memmove via ctypes,
              benchmarks/references.py) of every tensor into an already-written tmpfs
              mapping of the same size.
- copy_limit  the machine's limit: the same copy with as many threads as our save uses,
              plain memcpy (the same memmove, one contiguous share per thread) or the
              extension's non-temporal stores, whichever is faster in this run. Every
              row also reports ratio_vs_limit; the budgets are save >= 0.9x and load >= 0.8x.
- save_warm   CheckpointSaver.save into warm pool buffers, checksums on.
- save_nocrc  the same with checksums off (gives the checksum overhead).
- save_first  the first save of a new process that pre-faults its pool in the
              background at start (one child process per run).
- load        load_version into pre-allocated destination tensors, checksums verified, in the
              process that saved: the default read method (auto) copies from the pool buffer
              that still maps the object.
- load_file   the same load from the object file (FLASHPOINT_READ_METHOD=file: auto's choice,
              mapped for huge pages, pread for 4 KiB pages), as a load after a restart reads.
- load_map / load_pread  the file load with FLASHPOINT_READ_METHOD forced; load_file, load_map
              and load_pread are interleaved with load in one series of rounds.
- load_nocrc  load of a version saved without checksums (gives the load checksum overhead).
- dcp_save / dcp_load      torch.distributed.checkpoint FileSystemWriter/Reader, same tmpfs.
- torch_save / torch_load  torch.save / torch.load, same tmpfs.

The state is a few large tensors (~90% of the bytes) and up to 2000 small ones of
1-64 KiB in several dtypes, random values from a fixed seed. Every figure is the
median of --runs runs; gbps counts tensor bytes only (1 GB = 1e9 bytes).

Every row also gives cpu_seconds (the process's CPU time, all threads, median) and
cpu_ratio_vs_limit (copy_limit's CPU time over the row's, same bytes): on a machine
shared with other work the wall-clock ratios swing with the neighbours, the CPU-time
ones much less. copy_limit's row carries the load average at the start and the end
of the run and the huge= setting of the tmpfs the run writes to (--base-dir: mount a
tmpfs with huge=within_size to measure huge pages, docs/performance.md).

With --device cuda the state lives on the GPU, and the rows are the staging paths:

- d2h_pinned  the reference: every tensor copied (non_blocking) into a page-locked host tensor
              allocated once, then one synchronize.
- save_warm   CheckpointSaver.save of the GPU state into warm, page-locked pool buffers; the
              copies go in batches, each checksummed while the next ones are in flight.
- save_serial the same in one batch: every copy, then every checksum (what batching gains).
- h2d_pinned  the reference for loads: page-locked host tensors copied into the GPU destinations.
- load        load_version into pre-allocated GPU destinations, checksums verified; each batch
              read is uploaded while the next one is read.
- load_serial the same in one batch: every read, then every upload.

    python benchmarks/bench_core.py --size-gib 1          # table
    python benchmarks/bench_core.py --size-gib 1 --json   # one JSON object per line
    python benchmarks/bench_core.py --size-gib 4 --device cuda
"""

from __future__ import annotations

import argparse
import array
import functools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core import CheckpointSaver, load_version, loader
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.versions import read_commit

from references import memmove_shares, split_into_shares

SEED = 1234
GIB = 1 << 30
LARGE_TENSORS = 8
LARGE_DTYPES = (torch.float32, torch.bfloat16)
LARGE_COLUMNS = 1024
SMALL_TENSORS = 2000
SMALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
SMALL_MIN_BYTES, SMALL_MAX_BYTES = 1 << 10, 64 << 10
SMALL_SHARE = 0.10  # at most this share of the bytes goes to small tensors
MEMCPY_ALIGNMENT = 64
# With keep=1 the saver cycles two buffers (the committed one and the one being filled):
# two untimed saves fault both in, so the timed saves all write into warm pages.
WARMUP_SAVES = 2
QUICK_SIZE_GIB = 0.02
CHILD_FLAG = "--child-save-first"
READ_METHOD_VARIABLE = "FLASHPOINT_READ_METHOD"

# dcp.save/load warn that they run without a process group, which is the point here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

State = dict[str, torch.Tensor]


# ---------------------------------------------------------------- the state


@dataclass(frozen=True)
class TensorSpec:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def plan_state(total_bytes: int, seed: int = SEED) -> list[TensorSpec]:
    """Keys, dtypes and shapes of a state of about total_bytes; the large tensors are spread among the small."""
    rng = random.Random(seed)
    small: list[TensorSpec] = []
    small_bytes = 0
    for i in range(SMALL_TENSORS):
        dtype = rng.choice(SMALL_DTYPES)
        numel = rng.randint(SMALL_MIN_BYTES, SMALL_MAX_BYTES) // dtype.itemsize
        if small_bytes + numel * dtype.itemsize > total_bytes * SMALL_SHARE:
            break
        small.append(TensorSpec(f"small.{i:04d}", dtype, (numel,)))
        small_bytes += numel * dtype.itemsize
    large_each = (total_bytes - small_bytes) // LARGE_TENSORS
    specs: list[TensorSpec] = []
    stride = max(1, len(small) // LARGE_TENSORS)
    for j in range(LARGE_TENSORS):
        dtype = LARGE_DTYPES[j % len(LARGE_DTYPES)]
        rows = max(1, large_each // (LARGE_COLUMNS * dtype.itemsize))
        specs.append(TensorSpec(f"large.{j}", dtype, (rows, LARGE_COLUMNS)))
        specs.extend(small[j * stride : (j + 1) * stride if j < LARGE_TENSORS - 1 else len(small)])
    return specs


def build_state(specs: list[TensorSpec], seed: int = SEED) -> State:
    generator = torch.Generator().manual_seed(seed)
    return {spec.key: _random_tensor(spec, generator) for spec in specs}


def _random_tensor(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, dtype=spec.dtype, generator=generator)
    info = torch.iinfo(spec.dtype)
    return torch.randint(info.min, info.max, spec.shape, dtype=spec.dtype, generator=generator)


def state_nbytes(state_or_specs: State | list[TensorSpec]) -> int:
    values = state_or_specs.values() if isinstance(state_or_specs, dict) else state_or_specs
    return sum(v.nbytes for v in values)


def zero_(state: State) -> None:
    for tensor in state.values():
        tensor.zero_()


def check_equal(actual: State, expected: State, what: str) -> None:
    """A benchmark of a load that loads wrong bytes is worthless: compare once after timing."""
    wrong = [key for key, tensor in expected.items() if not torch.equal(actual[key], tensor)]
    if wrong:
        raise AssertionError(f"{what} loaded wrong data for {len(wrong)} keys, e.g. {wrong[:3]}")


# ---------------------------------------------------------------- timing


@dataclass
class Result:
    name: str
    seconds: float  # median
    samples: list[float]
    nbytes: int
    extra: dict[str, Any] = field(default_factory=dict)
    cpu_samples: list[float] = field(default_factory=list)  # process CPU seconds of each run

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def cpu_seconds(self) -> float | None:
        return statistics.median(self.cpu_samples) if self.cpu_samples else None

    def as_dict(self, memcpy_gbps: float, limit: Result | None = None) -> dict[str, Any]:
        cpu = self.cpu_seconds
        limit_cpu = limit.cpu_seconds if limit else None
        return {
            "name": self.name,
            "gbps": round(self.gbps, 3),
            "ratio_vs_memcpy": round(self.gbps / memcpy_gbps, 3),
            **({"ratio_vs_limit": round(self.gbps / limit.gbps, 3)} if limit else {}),
            **({"cpu_seconds": round(cpu, 4)} if cpu else {}),
            **({"cpu_ratio_vs_limit": round(limit_cpu / cpu, 3)} if cpu and limit_cpu else {}),
            "seconds": round(self.seconds, 4),
            "runs": len(self.samples),
            "min_seconds": round(min(self.samples), 4),
            "max_seconds": round(max(self.samples), 4),
            "nbytes": self.nbytes,
            **self.extra,
        }


Sample = tuple[float, float]  # (wall-clock seconds, process CPU seconds) of one run


def timed(action: Callable[[], Any], setup: Callable[[], Any] | None = None) -> Callable[[], Sample]:
    """A run that calls setup untimed, then returns the wall-clock and CPU seconds of action."""

    def run_once() -> Sample:
        if setup is not None:
            setup()
        cpu_start, start = time.process_time(), time.perf_counter()
        result = action()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        del result  # freeing what the action returned (e.g. loaded tensors) is not part of it
        return elapsed, cpu

    return run_once


def median_of_runs(name: str, run_once: Callable[[], Sample] | Callable[[], float], runs: int, nbytes: int, **extra: Any) -> Result:
    samples = [run_once() for _ in range(runs)]
    return _reported(_result(name, samples, nbytes, extra))


def medians_interleaved(runs: int, nbytes: int, **run_once: Callable[[], Sample]) -> list[Result]:
    """Each run_once `runs` times, in rounds that run every one once (first one first, then rotated),
    so that a slow spell of the machine lands on all of them alike; one Result each, in the order given."""
    names = list(run_once)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for round_ in range(runs):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(run_once[name]())
    return [_reported(_result(name, samples[name], nbytes, {})) for name in names]


def _result(name: str, samples: list[Sample] | list[float], nbytes: int, extra: dict[str, Any]) -> Result:
    """A run that measured wall-clock seconds only (a float, e.g. one timed in a child) has no CPU figure."""
    pairs = [sample if isinstance(sample, tuple) else (sample, None) for sample in samples]
    walls = [wall for wall, _ in pairs]
    cpus = [cpu for _, cpu in pairs if cpu is not None]
    return Result(name, statistics.median(walls), walls, nbytes, extra, cpus if len(cpus) == len(pairs) else [])


def _reported(result: Result) -> Result:
    cpu = f", cpu {result.cpu_seconds:.4f} s" if result.cpu_seconds else ""
    print(f"  {result.name}: {result.seconds:.4f} s, {result.gbps:.2f} GB/s{cpu}", file=sys.stderr, flush=True)
    return result


@dataclass
class Bench:
    """What every measurement needs: the state, where to write, how often, how many threads."""

    state: State
    workdir: Path
    runs: int
    threads: int

    @property
    def nbytes(self) -> int:
        return state_nbytes(self.state)

    def fresh_dir(self, name: str) -> Path:
        path = self.workdir / name
        shutil.rmtree(path, ignore_errors=True)
        return path


# ---------------------------------------------------------------- measurements


def bench_memcpy(bench: Bench) -> list[Result]:
    """memcpy into a mapping whose pages exist and were written once: one thread (the reference), then the limit.

    The limit is the same copy spread over the save's threads, with plain memcpy (libc memmove,
    benchmarks/references.py) and with the extension's non-temporal stores; the faster of the two
    is reported as copy_limit.
    """
    ops: list[int] = []
    offset = 0
    for tensor in bench.state.values():
        ops += (tensor.data_ptr(), offset, tensor.nbytes)
        offset += (tensor.nbytes + MEMCPY_ALIGNMENT - 1) // MEMCPY_ALIGNMENT * MEMCPY_ALIGNMENT
    flat = array.array("Q", ops)
    path = bench.workdir / "memcpy.buf"
    buffer = _core.ShmBuffer.create(str(path), offset)
    try:
        buffer.prefault()
        copies = [(src, buffer.address + dst, nbytes) for src, dst, nbytes in zip(ops[0::3], ops[1::3], ops[2::3])]
        single_copy = functools.partial(memmove_shares, split_into_shares(copies, 1))
        plain_copy = functools.partial(memmove_shares, split_into_shares(copies, bench.threads))
        non_temporal_copy = functools.partial(_core.copy_into_buffer, buffer, flat, checksum=False,
                                              threads=bench.threads)

        single_copy()  # written once: no first-touch cost in the timed runs
        single = median_of_runs(
            "memcpy", timed(single_copy), bench.runs, bench.nbytes,
            threads=1, single_threaded=True, tensors=len(bench.state),
            note="single-threaded plain memcpy (libc memmove via ctypes) into a warm tmpfs mapping (the reference)",
        )
        plain, non_temporal = medians_interleaved(bench.runs, bench.nbytes, plain=timed(plain_copy),
                                                  non_temporal=timed(non_temporal_copy))
        best = min((plain, non_temporal), key=lambda r: r.seconds)
        limit = Result("copy_limit", best.seconds, best.samples, bench.nbytes, cpu_samples=best.cpu_samples, extra={
            "threads": bench.threads, "stores": "non-temporal" if best is non_temporal else "plain memcpy",
            "plain_gbps": round(plain.gbps, 3), "non_temporal_gbps": round(non_temporal.gbps, 3),
            "note": "the copy spread over the save's threads, the faster kind of stores (the machine's limit)",
        })
        return [single, limit]
    finally:
        buffer.close()
        path.unlink(missing_ok=True)


def bench_save_and_load(bench: Bench, dest: State, *, checksum: bool) -> tuple[Result, list[Result]]:
    """Steady-state saves into warm pool buffers, then loads of the last one into `dest`.

    With checksums, the default load (from the pool buffer) is interleaved with loads from the
    file, by auto's choice and forced to each read method.
    """
    suffix = "" if checksum else "_nocrc"
    base = bench.fresh_dir(f"save{suffix}")
    steps = count()
    try:
        with CheckpointSaver(base, threads=bench.threads, checksum=checksum) as saver:

            def save() -> None:
                saver.save(next(steps), bench.state)

            for _ in range(WARMUP_SAVES):
                save()
            saved = median_of_runs(
                "save_warm" if checksum else "save_nocrc", timed(save), bench.runs, bench.nbytes,
                threads=bench.threads, checksum=checksum, warmup_saves=WARMUP_SAVES,
            )
            last_step = next(steps) - 1
            methods = {f"load{suffix}": None}
            if checksum:
                methods.update(load_file="file", load_map="map", load_pread="pread")
            loads = medians_interleaved(bench.runs, bench.nbytes, **{
                name: timed(functools.partial(_load_with, method, base, last_step, dest, bench.threads),
                            setup=lambda: zero_(dest))
                for name, method in methods.items()
            })
            picked = _read_method_picked(base, last_step)
            for loaded, method in zip(loads, methods.values()):
                how = {None: "auto (pool buffer)", "file": f"file (auto: {picked})"}.get(method, method)
                loaded.extra.update(threads=bench.threads, checksum=checksum, read_method=how,
                                    destination="pre-allocated, touched tensors")
            check_equal(dest, bench.state, f"load{suffix}")
        return saved, loads
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _load_with(method: str | None, base: Path, step: int, dest: State, threads: int) -> None:
    """load_version with FLASHPOINT_READ_METHOD set to method (None: as the environment has it)."""
    saved = os.environ.get(READ_METHOD_VARIABLE)
    if method is not None:
        os.environ[READ_METHOD_VARIABLE] = method
    try:
        load_version(base, step, into=dest, threads=threads)
    finally:
        if method is not None:
            if saved is None:
                os.environ.pop(READ_METHOD_VARIABLE, None)
            else:
                os.environ[READ_METHOD_VARIABLE] = saved


def _read_method_picked(base: Path, step: int) -> str:
    """What read method auto picks for the (one) object of version `step`."""
    (record,) = read_commit(CheckpointLayout(base), step).objects
    path = CheckpointLayout(base).object_path(step, record.name)
    fd = os.open(path, os.O_RDONLY)
    try:
        return _core.read_method_for(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def bench_dcp(bench: Bench, dest: State) -> tuple[Result, Result]:
    path = bench.workdir / "dcp"

    def save() -> None:
        dcp.save(bench.state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)

    def load() -> None:
        dcp.load(dest, storage_reader=dcp.FileSystemReader(path), no_dist=True)

    try:
        saved = median_of_runs(
            "dcp_save", timed(save, setup=lambda: bench.fresh_dir("dcp")), bench.runs, bench.nbytes,
            fresh_files=True, writer="FileSystemWriter defaults (thread_count=1, sync_files=True)",
            note="the previous checkpoint directory is removed before each save",
        )
        loaded = median_of_runs(
            "dcp_load", timed(load, setup=lambda: zero_(dest)), bench.runs, bench.nbytes,
            destination="pre-allocated, touched tensors",
        )
        check_equal(dest, bench.state, "dcp_load")
        return saved, loaded
    finally:
        shutil.rmtree(path, ignore_errors=True)


def bench_torch(bench: Bench) -> tuple[Result, Result]:
    path = bench.workdir / "state.pt"
    try:
        saved = median_of_runs(
            "torch_save", timed(lambda: torch.save(bench.state, path), setup=lambda: path.unlink(missing_ok=True)),
            bench.runs, bench.nbytes, fresh_files=True,
        )
        loaded = median_of_runs(
            "torch_load", timed(lambda: torch.load(path, weights_only=True, mmap=False)), bench.runs, bench.nbytes,
            destination="new tensors (torch.load allocates them)",
        )
        return saved, loaded
    finally:
        path.unlink(missing_ok=True)


def bench_save_first(bench_dir: Path, size_gib: float, runs: int, threads: int, nbytes: int) -> Result:
    """One fresh process per run; each pre-faults its pool at start and times its first save."""
    reports: list[dict[str, Any]] = []

    def run_once() -> Sample:
        base = bench_dir / "save_first"
        shutil.rmtree(base, ignore_errors=True)
        try:
            reports.append(_run_child(base, size_gib, threads))
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return reports[-1]["seconds"], reports[-1]["cpu_seconds"]

    result = median_of_runs("save_first", run_once, runs, nbytes, threads=threads, checksum=True)
    result.extra.update(
        warmup_seconds=round(statistics.median(r["warmup_seconds"] for r in reports), 4),
        warmup_wait_seconds=round(statistics.median(r["warmup_wait_seconds"] for r in reports), 4),
        warmup_nbytes=reports[-1]["warmup_nbytes"],
        object_nbytes=reports[-1]["object_nbytes"],
        note="first save of a new process; pool pre-faulted in the background (saver.warm_up) while the "
        "state was built, then waited for",
    )
    return result


def _run_child(base: Path, size_gib: float, threads: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), CHILD_FLAG,
               "--size-gib", str(size_gib), "--threads", str(threads), "--base-dir", str(base)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if completed.returncode != 0:
        raise RuntimeError(f"save_first child failed ({completed.returncode}):\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def child_save_first(base: Path, size_gib: float, threads: int) -> None:
    """In the child: warm up the pool first thing, build the state meanwhile, then time one save."""
    specs = plan_state(int(size_gib * GIB))
    nbytes = state_nbytes(specs)
    with CheckpointSaver(base, threads=threads) as saver:
        warmup_start = time.perf_counter()
        warmup = saver.warm_up(nbytes)
        warmup_done = threading.Event()
        finished_at: list[float] = []

        def on_warmup_done(_: object) -> None:  # result() may return before callbacks run: wait for this
            finished_at.append(time.perf_counter())
            warmup_done.set()

        warmup.add_done_callback(on_warmup_done)
        state = build_state(specs)
        wait_start = time.perf_counter()
        warmup.result()
        warmup_done.wait()
        waited = time.perf_counter() - wait_start
        cpu_start, start = time.process_time(), time.perf_counter()
        result = saver.save(0, state)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "warmup_seconds": finished_at[0] - warmup_start,
        "warmup_wait_seconds": waited,
        "warmup_nbytes": nbytes,
        "object_nbytes": result.objects[0].nbytes,
    }))


# ---------------------------------------------------------------- driver


def run_all(args: argparse.Namespace, workdir: Path) -> list[Result]:
    specs = plan_state(int(args.size_gib * GIB))
    nbytes = state_nbytes(specs)
    print(f"state: {len(specs)} tensors, {nbytes / 1e9:.3f} GB; {args.runs} runs each; "
          f"{args.threads} threads; in {workdir}", file=sys.stderr, flush=True)
    # First, while this process holds no state, so the children have the memory to themselves.
    load_start = os.getloadavg()
    results = [bench_save_first(workdir, args.size_gib, args.runs, args.threads, nbytes)]
    bench = Bench(build_state(specs), workdir, args.runs, args.threads)
    dest = {key: torch.zeros_like(tensor) for key, tensor in bench.state.items()}
    results[:0] = bench_memcpy(bench)
    save_warm, loads = bench_save_and_load(bench, dest, checksum=True)
    save_nocrc, (load_nocrc,) = bench_save_and_load(bench, dest, checksum=False)
    save_warm.extra["checksum_overhead"] = round(save_warm.seconds / save_nocrc.seconds - 1, 4)
    loads[0].extra["checksum_overhead"] = round(loads[0].seconds / load_nocrc.seconds - 1, 4)
    results += [save_warm, save_nocrc, *loads, load_nocrc]
    results += bench_dcp(bench, dest)
    del dest  # torch.load allocates its own tensors
    results += bench_torch(bench)
    limit = next(r for r in results if r.name == "copy_limit")
    limit.extra.update(loadavg_start=[round(x, 2) for x in load_start], loadavg_end=[round(x, 2) for x in os.getloadavg()],
                       tmpfs_huge=tmpfs_huge_setting(workdir), cpus=len(os.sched_getaffinity(0)))
    return results


def tmpfs_huge_setting(path: Path) -> str:
    """The huge= option of the tmpfs holding path ("never" when not given), or "not tmpfs"."""
    best: tuple[int, str, str] = (-1, "", "")
    resolved = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 4:
                continue
            mount_point, fstype, options = fields[1], fields[2], fields[3]
            inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) > best[0]:
                best = (len(mount_point), fstype, options)
    if best[1] != "tmpfs":
        return "not tmpfs"
    huge = [option.split("=", 1)[1] for option in best[2].split(",") if option.startswith("huge=")]
    return huge[0] if huge else "never"


ONE_BATCH = 1 << 62  # a batch size no state reaches: the save or load in one batch, no overlap


def run_cuda(args: argparse.Namespace, workdir: Path) -> list[Result]:
    """The GPU staging paths against plain page-locked copies of the same tensors, in one run."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device; this machine has none")
    specs = plan_state(int(args.size_gib * GIB))
    nbytes = state_nbytes(specs)
    print(f"state on {torch.cuda.get_device_name()}: {len(specs)} tensors, {nbytes / 1e9:.3f} GB; {args.runs} runs "
          f"each; {args.threads} threads; in {workdir}", file=sys.stderr, flush=True)
    state = {key: tensor.cuda() for key, tensor in build_state(specs).items()}
    host = {key: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for key, t in state.items()}
    dest = {key: torch.zeros_like(tensor) for key, tensor in state.items()}

    def d2h() -> None:
        for key, tensor in state.items():
            host[key].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()

    def h2d() -> None:
        for key, tensor in host.items():
            dest[key].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()

    d2h()
    reference = median_of_runs("d2h_pinned", timed(d2h), args.runs, nbytes, tensors=len(state),
                               note="non_blocking copies into page-locked host tensors, one synchronize")
    results = [reference]
    base = workdir / "cuda-save"
    steps = count()
    with CheckpointSaver(base, threads=args.threads) as saver:
        for _ in range(WARMUP_SAVES):
            saver.save(next(steps), state)
        batched = saver.staging_batch_nbytes

        def save(batch_nbytes: int) -> None:
            saver.staging_batch_nbytes = batch_nbytes
            saver.save(next(steps), state)

        warm, serial = medians_interleaved(args.runs, nbytes, save_warm=timed(lambda: save(batched)),
                                           save_serial=timed(lambda: save(ONE_BATCH)))
        warm.extra.update(threads=args.threads, source="cuda", batch_nbytes=batched)
        serial.extra.update(threads=args.threads, source="cuda", note="every copy, then every checksum")
        results += [warm, serial]
        saver.staging_batch_nbytes = batched
        last = next(steps) - 1
        h2d()
        results.append(median_of_runs("h2d_pinned", timed(h2d, setup=lambda: zero_(dest)), args.runs, nbytes,
                                      note="non_blocking copies from page-locked host tensors, one synchronize"))
        batched = loader.UPLOAD_BATCH_NBYTES

        def load(batch_nbytes: int) -> None:
            loader.UPLOAD_BATCH_NBYTES = batch_nbytes
            load_version(base, last, into=dest, threads=args.threads)

        try:
            loads = medians_interleaved(args.runs, nbytes, load=timed(lambda: load(batched), setup=lambda: zero_(dest)),
                                        load_serial=timed(lambda: load(ONE_BATCH), setup=lambda: zero_(dest)))
        finally:
            loader.UPLOAD_BATCH_NBYTES = batched
        loads[0].extra.update(threads=args.threads, destination="pre-allocated GPU tensors", batch_nbytes=batched)
        loads[1].extra.update(threads=args.threads, note="every read, then every upload")
        results += loads
        load(batched)
        check_equal(dest, state, "load into GPU tensors")
    shutil.rmtree(base, ignore_errors=True)
    return results


def print_results(results: list[Result], as_json: bool) -> None:
    names = {r.name: r for r in results}
    reference = names.get("memcpy") or names["d2h_pinned"]
    limit = names.get("copy_limit")
    rows = [r.as_dict(reference.gbps, limit) for r in results]
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{'name':<12} {'GB/s':>8} {'x memcpy':>9} {'x limit':>8} {'cpu x limit':>12} {'median s':>9} {'runs':>5}  notes"
          if limit else f"{'name':<12} {'GB/s':>8} {'x ' + reference.name:>12} {'median s':>9} {'runs':>5}  notes")
    for row, result in zip(rows, results):
        notes = ", ".join(f"{k}={v}" for k, v in result.extra.items() if k != "note")
        cpu_ratio = row.get("cpu_ratio_vs_limit")
        ratio = f"{row['ratio_vs_memcpy']:>9.2f} {row['ratio_vs_limit']:>8.2f} " + \
            (f"{cpu_ratio:>12.2f}" if cpu_ratio else f"{'-':>12}") if limit else f"{row['ratio_vs_memcpy']:>12.2f}"
        print(f"{row['name']:<12} {row['gbps']:>8.2f} {ratio} {row['seconds']:>9.4f} {row['runs']:>5}  {notes}")


def common_arguments(description: str, default_size_gib: float) -> argparse.ArgumentParser:
    """The options every benchmark script takes: size, runs, where to write, output form."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size-gib", type=float, default=default_size_gib,
                        help="total tensor bytes of the state (default %(default)s)")
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement; the median is reported")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="where to write; a fresh directory inside it is used and removed "
                        "(default: a fresh directory under /dev/shm)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_SIZE_GIB} GiB, 1 run (overrides --size-gib and --runs)")
    return parser


def finish_common_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.quick:
        args.size_gib, args.runs = QUICK_SIZE_GIB, 1
    if args.runs < 1 or args.size_gib <= 0:
        parser.error("--runs and --size-gib must be positive")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common_arguments(__doc__.split("\n\n")[0], 1.0)
    parser.add_argument("--threads", type=int, default=default_copy_threads(),
                        help="copy threads for our save and load (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the state lives: cpu (default) or cuda (GPU staging, see above)")
    parser.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = finish_common_arguments(parser, parser.parse_args(argv))
    if args.threads < 1:
        parser.error("--threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child_save_first:
        child_save_first(args.base_dir, args.size_gib, args.threads)
        return 0
    run = run_cuda if args.device == "cuda" else run_all
    print_results(in_fresh_workdir(args.base_dir, "flashpoint-bench-", lambda workdir: run(args, workdir)), args.json)
    return 0


def in_fresh_workdir(base_dir: Path | None, prefix: str, run: Callable[[Path], Any]) -> Any:
    """Run in a new directory under base_dir (default /dev/shm), removed afterwards, even on SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwinds like Ctrl-C
    parent = base_dir or Path("/dev/shm")
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        return run(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
