"""The durable drain: committed RAM versions copied, in a background thread, into standard NeMo checkpoints.

Every rank copies its own share of a version (the objects it wrote) from tmpfs into the DCP data files of
`<durable_dir>/.drain-<token>-<N>/weights/`, reading each record through the flashpoint loader (so
every byte is checked against its CRC32C) and writing it with torch's FileSystemWriter, throttled to
`bytes_per_s`. It then writes a done file naming what it wrote (`.share-done-<R>`, JSON). Rank 0's drain
waits for every rank's done file (bounded), writes the DCP `.metadata`, `common.pt`, the NeMo `context/`
and Megatron's `metadata.json` last, renames the directory to its NeMo name and removes NeMo's
`<name>-unfinished` marker, which it set before writing. No collective runs outside the main thread:
ranks agree on the directory through a token broadcast once at train start.

While a rank drains a version, a hold file in the RAM version (`.drain-hold-<R>`) keeps the save's
retention from retiring it. At most two versions are held: the one being drained and the newest waiting.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ml_flashpoint_nemo.core import lifecycle
from ml_flashpoint_nemo.core.layout import MEGATRON_COMMON_NAME, CheckpointLayout
from ml_flashpoint_nemo.core.loader import OpenObject, open_object, read_object
from ml_flashpoint_nemo.core.version_files import read_checked_file
from ml_flashpoint_nemo.core.versions import fsync_directory, read_commit, write_file_atomically
from ml_flashpoint_nemo.dcp.conversion import Read, fill_sizes, make_planner, offset_key, plan_dcp_version
from ml_flashpoint_nemo.errors import DurableDrainError, FlashpointError

if TYPE_CHECKING:  # torch is imported by the drain thread, not with the module
    import torch
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import WriteItem
    from torch.distributed.checkpoint.storage import WriteResult

    ReadsByItem = dict[tuple[str, tuple[int, ...] | None], tuple[str, Read]]  # (fqn, offset) -> (object, read)

logger = logging.getLogger(__name__)

TEMP_PREFIX = ".drain-"  # <durable_dir>/.drain-<token>-<N>: a drain in progress, never a checkpoint
DONE_PREFIX = ".share-done-"  # in the temporary directory: one rank's share is written
DRAINED_MARK = ".flashpoint-drained"  # in a published checkpoint: its RAM step (retention counts only these)
UNFINISHED_SUFFIX = "-unfinished"  # NeMo's ModelCheckpoint.UNFINISHED_CHECKPOINT_SUFFIX
COMMON_STATE = MEGATRON_COMMON_NAME
BUCKET_BYTES = 64 << 20  # one data file per ~64 MiB: FileSystemWriter keeps a file's tensors until it is closed
_POLL_S = 0.05


DRAIN_NICE = 19  # the drain thread's CPU priority: it takes only cores training leaves idle


def _yield_cpu_to_training() -> None:
    """Lower the calling thread's CPU priority to DRAIN_NICE (Linux schedules threads, and nice is per thread).

    On a GPU node the drain runs on cores training leaves idle anyway; where training keeps every core
    busy (CPU training, a crowded host) this keeps the drain from taking its share from the steps.
    At SIGTERM training has stopped, so the persist-on-preemption drain still gets the CPU it needs.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DRAIN_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or a sandbox that forbids it: drain at normal priority
        logger.debug("Durable drain keeps its CPU priority: %s", exc)


@dataclass(frozen=True)
class DrainRequest:
    """Drain RAM version `step` into `<durable_dir>/<name>`."""

    step: int
    name: str


class Throttle:
    """Keeps the average rate at or below bytes_per_s (None: unthrottled); unthrottle() lifts it at once."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._lifted = threading.Event()
        self._start = time.monotonic()
        self._spent = 0

    def restart(self) -> None:
        self._start, self._spent = time.monotonic(), 0

    def unthrottle(self) -> None:
        self._lifted.set()

    def spend(self, nbytes: int) -> None:
        self._spent += nbytes
        if not self.bytes_per_s:
            return
        ahead = self._spent / self.bytes_per_s - (time.monotonic() - self._start)
        if ahead > 0:
            self._lifted.wait(ahead)


class DurableDrain:
    """One rank's drain thread; submit() from the main thread, everything else runs in the background."""

    def __init__(
        self,
        *,
        base_dir: Path,
        durable_dir: Path,
        rank: int,
        world_size: int,
        token: str,
        keep: int,
        bytes_per_s: float | None,
        timeout_s: float,
        context_dir: Path | None = None,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        """`prepare` (rank 0: clean up stale drains, stage NeMo's context into context_dir) runs first in the
        drain thread, so that training does not wait for it; its failure is logged and drains go on."""
        self.layout = CheckpointLayout(base_dir)
        self.durable_dir = Path(durable_dir).absolute()
        self.rank, self.world_size, self.token = rank, world_size, token
        self.keep, self.timeout_s = keep, timeout_s
        self.context_dir = context_dir
        self._prepare = prepare
        self.throttle = Throttle(bytes_per_s)
        self.published: list[tuple[int, Path]] = []  # rank 0: (step, path) of every drain made visible
        self.failures: list[tuple[int, str]] = []  # (step, error) of every failed drain on this rank
        self._finished: set[int] = set()  # steps whose drain ended on this rank (published, share done or failed)
        self._pending: DrainRequest | None = None
        self._current: DrainRequest | None = None
        self._closing = False
        self._cond = threading.Condition()
        self._release_stale_holds()
        self._thread = threading.Thread(target=self._run, name=f"flashpoint-drain-{rank}", daemon=True)
        self._thread.start()
        lifecycle.register(self, DurableDrain.close)  # an abort (FlashpointAbort) stops it after the current drain

    # --- main thread -------------------------------------------------------------------------

    def submit(self, request: DrainRequest) -> None:
        """Hold the RAM version and queue its drain; a queued one not started yet is replaced (its hold released).

        A closed drain (an aborted run's, when a stale handler submits to it) takes nothing: no thread would
        release the hold, and whoever waits for the step is not kept waiting."""
        try:
            self.layout.hold_path(request.step, self.rank).touch()
        except OSError as exc:
            self._fail(request, f"cannot hold RAM version {request.step}: {exc}")
            return
        with self._cond:  # decided under the lock close() takes: a request is queued only while a thread will take it
            closing = self._closing
            replaced = None if closing else self._pending
            if not closing:
                self._pending = request
                self._cond.notify_all()
        if closing:
            logger.warning("Durable drain of step %d not started: this drain was closed (its run ended or was "
                           "aborted)", request.step)
            self._release(request.step)
            self._mark_finished(request.step)
            return
        if replaced is not None and replaced.step != request.step:
            logger.warning("Durable drain of step %d skipped for step %d: the drain before it is still running "
                           "(raise durable_bytes_per_s or durable_every_n_steps)", replaced.step, request.step)
            self._release(replaced.step)
            self._mark_finished(replaced.step)

    def wait(self, step: int, timeout_s: float) -> bool:
        """Wait until this rank's drain of `step` ended (rank 0: published or failed); True if it did in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while step not in self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def busy_with(self) -> list[int]:
        with self._cond:
            return [r.step for r in (self._current, self._pending) if r is not None]

    def close(self, timeout_s: float = 0.0) -> None:
        """Stop after the current drain (waiting at most timeout_s); a queued one is dropped."""
        with self._cond:
            self._closing = True
            pending, self._pending = self._pending, None
            self._cond.notify_all()
        if pending is not None:
            self._release(pending.step)
        lifecycle.unregister(self)
        self._thread.join(timeout_s)

    # --- drain thread ------------------------------------------------------------------------

    def _run(self) -> None:
        _yield_cpu_to_training()
        prepare, self._prepare = self._prepare, None  # it may hold the trainer (NeMo's context): not past its run
        if prepare is not None:
            try:
                prepare()
            except Exception as exc:  # noqa: BLE001 - as NeMo's ModelCheckpoint: checkpoints without context
                logger.warning("Could not prepare %s for drained checkpoints (they are published without the "
                               "NeMo context): %s: %s", self.durable_dir, type(exc).__name__, exc)
            del prepare
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                request, self._pending = self._pending, None
                self._current = request
            if request is None:  # not reached: the wait above returns with a request or on closing
                continue
            try:
                self._drain(request)
            except Exception as exc:  # noqa: BLE001 - a failed drain is logged; training goes on, the next one retries
                self._fail(request, f"{type(exc).__name__}: {exc}")
            finally:
                self._release(request.step)
                with self._cond:
                    self._current = None
                self._mark_finished(request.step)

    def _drain(self, request: DrainRequest) -> None:
        temporary = self.temporary_dir(request.step)
        started = time.monotonic()
        if self.rank == 0:
            self.durable_dir.mkdir(parents=True, exist_ok=True)
            self._marker(request.name).touch()  # NeMo's own sign of a checkpoint being written
        version_files = self._write_share(request, temporary)
        self._release(request.step)  # every byte of this rank's share is read
        if self.rank == 0:
            assert version_files is not None
            self._publish(request, temporary, *version_files)
            logger.info("Durable checkpoint of step %d drained from RAM to %s in %.1f s", request.step,
                        self.durable_dir / request.name, time.monotonic() - started)

    def _write_share(self, request: DrainRequest, temporary: Path) -> tuple[bytes, Metadata] | None:
        """Write this rank's records into temporary/weights and its done file.

        Rank 0 also returns what it needs to publish, read while the version is held: common.pt and the
        version's DCP metadata.
        """
        weights = temporary / "weights"
        done = temporary / f"{DONE_PREFIX}{self.rank}"
        try:
            weights.mkdir(parents=True, exist_ok=True)
            results, version_files = self._copy_records(request.step, weights)
            fsync_directory(weights)
            write_file_atomically(temporary, done.name, json.dumps({"step": request.step, "results": results}).encode(),
                                  f"the drain done file of rank {self.rank}")
        except Exception as exc:
            error = json.dumps({"step": request.step, "error": f"{type(exc).__name__}: {exc}"}).encode()
            _try(lambda: write_file_atomically(temporary, done.name, error, "a drain error file"))
            raise
        return version_files

    def _copy_records(self, step: int, weights: Path) -> tuple[list[list[Any]], tuple[bytes, Metadata] | None]:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
        from torch.distributed.checkpoint.planner import SavePlan

        commit = read_commit(self.layout, step)
        if commit.metadata.get("kind") != "dcp":
            raise DurableDrainError(f"RAM version {step} was not saved through the Megatron strategy; only such "
                                    "versions drain into NeMo checkpoints")
        per_object, items, planner_data, metadata, _ = plan_dcp_version(self.layout, commit)
        records = {o.name: o for o in commit.objects}
        mine = {name: reads for name, reads in per_object.items()
                if (name == "" and self.rank == 0) or (name in records and records[name].rank == self.rank)}
        fill_sizes(self.layout, commit, mine)
        reads: ReadsByItem = {(r.fqn, r.offset): (name, r) for name, rs in mine.items() for r in rs}
        my_items = [i for i in items if (i.index.fqn, offset_key(i.index.offset)) in reads]
        version_files = (read_checked_file(self.layout, commit, COMMON_STATE), metadata) if self.rank == 0 else None
        self.throttle.restart()
        results: list[list[Any]] = []  # JSON rows of the done file, see _decode_done
        with ExitStack() as stack:
            opened: dict[str, OpenObject] = {}

            def resolve(item: WriteItem) -> torch.Tensor | bytes:
                name, read = reads[(item.index.fqn, offset_key(item.index.offset))]
                if name == "":
                    assert read.tensor is not None  # plan_dcp_version: only tensor chunks have no object
                    return read.tensor  # an empty chunk: nothing stored
                if name not in opened:
                    opened[name] = stack.enter_context(open_object(str(self.layout.object_path(step, name)),
                                                                   records[name]))
                value: torch.Tensor | bytes
                if read.tensor is None:
                    value = bytes(read_object(opened[name], keys=[read.key], threads=1)[read.key])
                else:
                    import torch

                    into = torch.empty_like(read.tensor)  # a fresh buffer per item: nothing stays resident
                    value = read_object(opened[name], into={read.key: into}, keys=[], threads=1)[read.key]
                self.throttle.spend(read.nbytes)
                return value

            planner = make_planner(my_items, resolve, planner_data, metadata, lambda n: None)
            for number, bucket in enumerate(_buckets(my_items, reads)):
                writer = FileSystemWriter(str(weights), single_file_per_rank=True, sync_files=True, thread_count=1)
                writer.set_up_storage_writer(self.rank == 0)
                plan = SavePlan(bucket, storage_data=_StoragePrefix(f"__{self.rank}_{number}_"))
                for result in writer.write_data(plan, planner).value():
                    info = result.storage_data
                    results.append([result.index.fqn, _offsets(result.index.offset), result.index.index,
                                    result.size_in_bytes, info.relative_path, info.offset, info.length])
        return results, version_files

    def _publish(self, request: DrainRequest, temporary: Path, common: bytes, metadata: Metadata) -> None:
        """Rank 0: once every rank's share is there, write the version-level files and make it visible."""
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
        from torch.distributed.checkpoint import FileSystemWriter

        weights = temporary / "weights"
        shares = self._wait_for_shares(request.step, temporary)
        self._check_shares(request.step, metadata, shares, weights)
        writer = FileSystemWriter(str(weights), sync_files=True)
        writer.set_up_storage_writer(True)
        writer.finish(metadata, [shares])
        write_file_atomically(weights, COMMON_STATE, common, f"{COMMON_STATE} of a drained checkpoint")
        if self.context_dir is not None and self.context_dir.is_dir():
            shutil.copytree(self.context_dir, temporary / "context", dirs_exist_ok=True)
        for rank in range(self.world_size):
            (temporary / f"{DONE_PREFIX}{rank}").unlink(missing_ok=True)
        write_file_atomically(temporary, DRAINED_MARK, json.dumps({"step": request.step}).encode(), "a drain mark")
        save_config(CheckpointingConfig("torch_dist", 1), str(weights))  # Megatron's own: last in weights/
        fsync_directory(weights)
        fsync_directory(temporary)
        final = self.durable_dir / request.name
        aside = None
        if final.exists():
            aside = self.durable_dir / f"{TEMP_PREFIX}{self.token}-replaced-{request.step}"
            os.rename(final, aside)
        os.rename(temporary, final)
        fsync_directory(self.durable_dir)
        self._marker(request.name).unlink(missing_ok=True)  # NeMo's completion: the unfinished marker goes last
        fsync_directory(self.durable_dir)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self.published.append((request.step, final))
        self._retire_old(request.step)

    def _wait_for_shares(self, step: int, temporary: Path) -> list[WriteResult]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult

        deadline = time.monotonic() + self.timeout_s
        waiting = set(range(self.world_size))
        results = []
        errors = []
        while waiting:
            for rank in sorted(waiting):
                path = temporary / f"{DONE_PREFIX}{rank}"
                if not path.is_file():
                    continue
                waiting.discard(rank)
                done = _decode_done(path.read_bytes(), rank, step)
                if "error" in done:
                    errors.append(f"rank {rank}: {done['error']}")
                    continue
                for fqn, offsets, index, size, relative, offset, length in done["results"]:
                    location = _StorageInfo(relative, offset, length)
                    results.append(WriteResult(MetadataIndex(fqn, offsets, index), size, location))
            if waiting and time.monotonic() > deadline:
                raise DurableDrainError(f"ranks {sorted(waiting)} did not finish their share of step {step} within "
                                        f"{self.timeout_s:g} s (durable_timeout_s); the previous durable checkpoint "
                                        "is kept")
            if waiting:
                time.sleep(_POLL_S)
        if errors:
            raise DurableDrainError(f"the drain of step {step} failed on " + "; ".join(errors))
        return results

    def _check_shares(self, step: int, metadata: Metadata, shares: list[WriteResult], weights: Path) -> None:
        """What the ranks say they wrote must cover the version's DCP metadata and lie inside their files."""
        expected = {(i.fqn, offset_key(i.offset)) for i in (metadata.storage_data or {})}
        sizes: dict[str, int] = {}
        seen = set()
        for result in shares:
            info = result.storage_data
            name = info.relative_path
            if name not in sizes:
                if "/" in name or not name.startswith("__") or not (weights / name).is_file():
                    raise DurableDrainError(f"a rank names data file {name!r}, which is not in {weights}")
                sizes[name] = (weights / name).stat().st_size
            if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
                raise DurableDrainError(f"{result.index.fqn} lies outside {name} ({sizes[name]} bytes)")
            seen.add((result.index.fqn, offset_key(result.index.offset)))
        if not expected <= seen:
            missing = sorted(str(k) for k in expected - seen)[:5]
            raise DurableDrainError(f"the ranks' shares of step {step} do not cover its checkpoint: missing {missing}")

    def _retire_old(self, newest: int) -> None:
        """Rank 0: keep the newest `keep` drained checkpoints; remove leftovers of this run's earlier drains."""
        drained = []
        for entry in _scan(self.durable_dir):
            if entry.name.startswith(f"{TEMP_PREFIX}{self.token}-"):
                suffix = entry.name.rsplit("-", 1)[-1]  # a step (a drain, or a checkpoint set aside) or "context"
                if suffix.isdigit() and int(suffix) < newest:
                    shutil.rmtree(entry, ignore_errors=True)
                continue
            mark = entry / DRAINED_MARK
            if entry.is_dir() and mark.is_file():
                try:
                    drained.append((int(json.loads(mark.read_text())["step"]), entry))
                except (ValueError, KeyError, TypeError, OSError):
                    continue
        for step, path in sorted(drained)[:-self.keep]:
            logger.debug("Removing drained checkpoint %s (step %d): durable_keep=%d", path, step, self.keep)
            shutil.rmtree(path, ignore_errors=True)

    # --- helpers ------------------------------------------------------------------------------

    def temporary_dir(self, step: int) -> Path:
        return self.durable_dir / f"{TEMP_PREFIX}{self.token}-{step}"

    def _marker(self, name: str) -> Path:
        return self.durable_dir / f"{name}{UNFINISHED_SUFFIX}"

    def _fail(self, request: DrainRequest, error: str) -> None:
        try:  # torch reports a full disk as an obscure RuntimeError: say how much room there is
            error += f" ({shutil.disk_usage(self.durable_dir).free / 1e6:.1f} MB free on the durable filesystem)"
        except OSError:
            pass
        self.failures.append((request.step, error))
        logger.error("Durable drain of step %d to %s failed on rank %d, training continues and the next drain "
                     "retries: %s", request.step, self.durable_dir, self.rank, error)
        if self.rank == 0:
            shutil.rmtree(self.temporary_dir(request.step), ignore_errors=True)
            if not (self.durable_dir / request.name).exists():
                _try(lambda: self._marker(request.name).unlink(missing_ok=True))

    def _release(self, step: int) -> None:
        _try(lambda: self.layout.hold_path(step, self.rank).unlink(missing_ok=True))

    def _mark_finished(self, step: int) -> None:
        with self._cond:
            self._finished.add(step)
            self._cond.notify_all()

    def _release_stale_holds(self) -> None:
        """Holds of this rank left by a process that died mid-drain."""
        for step in self.layout.version_steps():
            self._release(step)


def remove_stale_drains(durable_dir: Path, token: str) -> None:
    """Rank 0 at train start: remove what drains of earlier runs left (temporary directories, their markers)."""
    for entry in _scan(Path(durable_dir)):
        if entry.name.startswith(TEMP_PREFIX) and not entry.name.startswith(f"{TEMP_PREFIX}{token}-"):
            shutil.rmtree(entry, ignore_errors=True)


def _buckets(items: list[WriteItem], reads: ReadsByItem) -> list[list[WriteItem]]:
    """Items in groups of about BUCKET_BYTES, in object order (reads stay sequential)."""
    ordered = sorted(items, key=lambda i: reads[(i.index.fqn, offset_key(i.index.offset))][0])
    buckets: list[list[WriteItem]] = [[]]
    size = 0
    for item in ordered:
        nbytes = reads[(item.index.fqn, offset_key(item.index.offset))][1].nbytes
        if buckets[-1] and size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += nbytes
    return [b for b in buckets if b]


def _offsets(offset: Iterable[int] | None) -> list[int] | None:
    return None if offset is None else [int(x) for x in offset]


def _decode_done(raw: bytes, rank: int, step: int) -> dict[str, Any]:
    """A rank's done file, validated field by field (it is read from a shared filesystem)."""
    problem = f"the drain done file of rank {rank} for step {step} is malformed"
    try:
        done = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise DurableDrainError(problem) from None
    if not isinstance(done, dict) or done.get("step") != step:
        raise DurableDrainError(problem)
    if "error" in done:
        return {"error": str(done["error"])[:2000]}
    results = done.get("results")
    if not isinstance(results, list):
        raise DurableDrainError(problem)
    for row in results:
        ok = isinstance(row, list) and len(row) == 7 and isinstance(row[0], str) and (
            row[1] is None or (isinstance(row[1], list) and all(_is_count(x) for x in row[1]))) and (
            row[2] is None or _is_count(row[2])) and all(_is_count(x) for x in row[3:4] + row[5:7]) and \
            isinstance(row[4], str)
        if not ok:
            raise DurableDrainError(problem)
    return {"results": results}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _scan(directory: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(directory)]
    except FileNotFoundError:
        return []


def _try(action: Callable[[], Any]) -> None:
    try:
        action()
    except (OSError, FlashpointError):
        logger.debug("cleanup step failed", exc_info=True)
