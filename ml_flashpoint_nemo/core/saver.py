"""Writing a rank's state as one object of a version, and committing single-rank versions."""

from __future__ import annotations

import array
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core import capture
from ml_flashpoint_nemo.core.format import (
    HEADER_NBYTES,
    LARGE_RECORD_ALIGNMENT,
    CommitRecord,
    IndexEntry,
    ObjectPlan,
    ObjectRecord,
    plan_object,
)
from ml_flashpoint_nemo.core.gc_pause import gc_paused
from ml_flashpoint_nemo.core.layout import CheckpointLayout, object_name
from ml_flashpoint_nemo.core.pool import BufferPool, raise_if_out_of_space
from ml_flashpoint_nemo.core.seal import SealJob, read_sealed_checksum, seal_object
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.values import PreparedValue, TensorColumns, prepare_state, tensor_columns
from ml_flashpoint_nemo.core.versions import retire_superseded, retire_version, write_commit
from ml_flashpoint_nemo.errors import VersionExistsError

logger = logging.getLogger(__name__)

# Source of the zeros written into an object's padding (every gap is shorter than this).
_ZEROS = torch.zeros(LARGE_RECORD_ALIGNMENT, dtype=torch.uint8)


# Device-to-host staging is checksummed batch by batch while later batches are copied.
STAGING_BATCH_NBYTES = 128 << 20


def _recorded_event(device: torch.device | None) -> Any:
    """A CUDA event on device's current stream: it completes once every copy enqueued there before it has."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def padding_copy_ops(plan: ObjectPlan) -> array.array:
    """(src, dst_offset, nbytes) copy ops that zero every gap of the plan's layout.

    A reused buffer holds the bytes of earlier saves in its gaps; zeroing them lets the
    whole object's CRC32C be derived from its index (format flag FLAG_ZERO_PADDING).
    """
    ops = array.array("Q")
    for offset, nbytes in plan.padding_ranges():
        if nbytes > _ZEROS.numel():
            raise ValueError(f"a {nbytes}-byte gap at offset {offset} is longer than any record alignment")
        ops.extend((_ZEROS.data_ptr(), offset, nbytes))
    return ops


@dataclass(frozen=True)
class WrittenObject:
    """An object written but not yet committed: its record for the commit and its data size."""

    record: ObjectRecord
    data_nbytes: int


@dataclass(frozen=True)
class SaveResult:
    step: int
    nbytes: int  # bytes of tensor and bytes data (not counting headers and index)
    seconds: float
    objects: tuple[ObjectRecord, ...]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class CheckpointSaver:
    """Saves flat state dicts of one rank into RAM checkpoints under base_dir.

    ``save`` is the whole single-process path (write, commit, retire old versions).
    Multi-rank adapters call ``write_object`` on every rank and commit once all
    ranks' objects exist.
    """

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        rank: int = 0,
        *,
        threads: int | None = None,
        checksum: bool = True,
        pool: BufferPool | None = None,
        max_free_buffers: int = 2,
    ) -> None:
        self.layout = CheckpointLayout(base_dir)
        self.layout.ensure_writable()
        self.rank = rank
        self.threads = threads or default_copy_threads()
        self.checksum = checksum
        self.staging_batch_nbytes = STAGING_BATCH_NBYTES
        self.pool = pool or BufferPool(self.layout, rank, max_free=max_free_buffers)
        self._plan: ObjectPlan | None = None
        self._plan_signature: list[tuple] | None = None
        # For states of plain CPU tensors: the plan's layout key, record offsets and sizes.
        self._plan_columns: tuple[tuple, array.array, array.array] | None = None
        self._padding_ops = array.array("Q")
        self._capture_thread: ThreadPoolExecutor | None = None  # background copies (stage_object in_background)

    def warm_up(self, nbytes: int, count: int = 2) -> "Future[None]":
        """Pre-create and pre-fault `count` buffers for saves of about nbytes, in the background.

        Keeping k versions needs k + 1 buffers: the next save fills one while k are committed.
        """
        return self.pool.start_warmup(nbytes, count)

    def write_object(self, step: int, state: Mapping[str, Any], *, overwrite: bool = False) -> WrittenObject:
        """Write this rank's state as an (uncommitted) object of version `step`: stage, seal, place."""
        staged = self.stage_object(step, state, overwrite=overwrite)
        try:
            seal_object(staged.seal_job, self.threads)
        except BaseException:
            self.abandon(staged)
            raise
        return self.place(staged)

    def stage_object(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        overwrite: bool = False,
        defer_checksums: bool = False,
        in_background: bool = False,
    ) -> "StagedObject":
        """Copy the state into a pool buffer: the only part of a save the caller must wait for.

        With defer_checksums the copy is a plain memcpy and the CRCs are computed by
        seal_object, which may then run in the background or in another process. With
        in_background (needs defer_checksums) the copies of host tensors run in a background
        thread after this returns (StagedObject.copying; bytes and device tensors are copied
        before): nothing may write to them until core.capture.wait_for_captures() returns.
        """
        if in_background and not defer_checksums:
            raise ValueError("a background copy computes no checksums: pass defer_checksums=True with it")
        copying: "Future[object] | None" = None
        with gc_paused():  # thousands of small objects: no collection in the middle of the copy
            columns = tensor_columns(state)
            values = prepare_state(state) if columns is None else []
            if self.layout.is_committed(step):
                if not overwrite:
                    raise VersionExistsError(
                        f"step {step} is already committed in {self.layout.base_dir}; pass overwrite=True to replace "
                        "it (the old version is removed before the new one is written)"
                    )
                # Only this rank's objects: other ranks of a multi-rank save retire their own.
                retire_version(self.layout, step, rank=self.rank, pool=self.pool)
            plan = self._plan_for(values) if columns is None else self._plan_for_columns(columns)
            buffer = self.pool.acquire(plan.object_nbytes)
            checksum = self.checksum and not defer_checksums
            try:
                with memoryview(buffer) as view:
                    view[:HEADER_NBYTES] = bytes(HEADER_NBYTES)  # no valid header until sealed
                if in_background:
                    crcs = []
                    ops = (self._column_ops(columns) if columns is not None
                           else self._direct_ops_after_others(buffer, values, plan.entries))
                    copying = self._copy_in_background(buffer, ops, keep_alive=(state, values))
                elif columns is None:
                    crcs = self._copy_values(buffer, values, plan.entries, checksum, self._padding_ops)
                else:
                    crcs = self._copy_columns(buffer, columns, checksum)
            except BaseException as exc:
                self.pool.release(buffer)
                if isinstance(exc, OSError):
                    raise_if_out_of_space(exc, f"step {step}")
                raise
        job = SealJob(
            path=buffer.path,
            rank=self.rank,
            plan=plan,
            crcs=None if (self.checksum and defer_checksums) else crcs,
            checksum=self.checksum,
            padding_zeroed=True,
        )
        data_nbytes = sum(v.nbytes for v in values) if columns is None else sum(columns.nbytes)
        return StagedObject(step, buffer, job, data_nbytes, copying)

    def _copy_in_background(self, buffer: _core.ShmBuffer, ops: array.array, keep_alive: object) -> "Future[object]":
        """Run the copy ops on this saver's capture thread (one: copies end in the order saves start)."""
        if self._capture_thread is None:
            self._capture_thread = ThreadPoolExecutor(1, thread_name_prefix="flashpoint-capture")
        future: Future[object] = self._capture_thread.submit(background_copy, buffer, ops, self.threads, keep_alive)
        capture.track(future)
        return future

    def _column_ops(self, columns: TensorColumns) -> array.array:
        """(source, offset, nbytes) rows of every tensor of the columns and of the padding."""
        assert self._plan_columns is not None
        _, offsets, sizes = self._plan_columns
        ops = array.array("Q", bytes(24 * len(offsets)))  # filled column-wise
        ops[0::3] = columns.addresses
        ops[1::3] = offsets
        ops[2::3] = sizes
        ops.extend(self._padding_ops)
        return ops

    def _direct_ops_after_others(
        self, buffer: _core.ShmBuffer, values: list[PreparedValue], entries: list[IndexEntry]
    ) -> array.array:
        """Copy what the C++ engine cannot read (bytes, strided and device values) now; the ops of the rest."""
        direct_ops, _, indirect_positions = _split_direct(values, entries)
        if indirect_positions:
            self._copy_with_torch(buffer, [(values[p], entries[p]) for p in indirect_positions], checksum=False)
        direct_ops.extend(self._padding_ops)
        return direct_ops

    def place(self, staged: "StagedObject") -> WrittenObject:
        """Check the sealed object and rename it into its version directory (still uncommitted)."""
        try:
            record_crc = read_sealed_checksum(staged.seal_job)
            name = object_name(self.rank)
            version_dir = self.layout.version_dir(staged.step)
            version_dir.mkdir(parents=True, exist_ok=True)
            self.pool.place(staged.buffer, version_dir / name)
        except BaseException as exc:
            self.pool.release(staged.buffer)
            if isinstance(exc, OSError):
                raise_if_out_of_space(exc, f"step {staged.step}")
            raise
        return WrittenObject(ObjectRecord(name, self.rank, staged.seal_job.plan.object_nbytes, record_crc),
                             staged.data_nbytes)

    def abandon(self, staged: "StagedObject") -> None:
        """Give a staged buffer back to the pool after a failed save (once no copy writes into it)."""
        if staged.copying is not None:
            wait([staged.copying])
        self.pool.release(staged.buffer)

    def _plan_for(self, values: list[PreparedValue]) -> ObjectPlan:
        """The layout of the previous save when keys, dtypes and shapes are unchanged (checked every save)."""
        return self._plan_for_signature([(v.key, v.kind, v.dtype, v.shape, v.nbytes) for v in values])

    def _plan_for_signature(self, signature: list[tuple]) -> ObjectPlan:
        if self._plan is None or self._plan_signature != signature:
            self._plan, self._plan_signature = plan_object(signature), signature
            self._padding_ops = padding_copy_ops(self._plan)
            self._plan_columns = None
        return self._plan

    def _plan_for_columns(self, columns: TensorColumns) -> ObjectPlan:
        """_plan_for for a state of plain CPU tensors, compared column by column (no per-value objects)."""
        layout_key = columns.layout_key()
        if self._plan is None or self._plan_columns is None or self._plan_columns[0] != layout_key:
            plan = self._plan_for_signature(columns.signature())
            offsets = array.array("Q", [entry.offset for entry in plan.entries])
            self._plan_columns = (layout_key, offsets, array.array("Q", columns.nbytes))
        assert self._plan is not None
        return self._plan

    def _copy_columns(self, buffer: _core.ShmBuffer, columns: TensorColumns, checksum: bool) -> list[int]:
        """Copy every tensor of the columns to its record's offset and zero the gaps, in one parallel pass."""
        ops = self._column_ops(columns)  # the padding's CRCs at the end are not needed
        return _core.copy_into_buffer(buffer, ops, checksum, self.threads)[: len(columns.keys)]

    def _copy_values(
        self,
        buffer: _core.ShmBuffer,
        values: list[PreparedValue],
        entries: list[IndexEntry],
        checksum: bool,
        padding_ops: array.array,
    ) -> list[int]:
        """Copy every value to its record's offset and zero the gaps; returns the records' CRC32Cs."""
        crcs = [0] * len(values)
        direct_ops, direct_positions, indirect_positions = _split_direct(values, entries)
        direct_ops.extend(padding_ops)  # in the same parallel pass; their CRCs are not needed
        copied = _core.copy_into_buffer(buffer, direct_ops, checksum, self.threads)
        for position, crc in zip(direct_positions, copied[: len(direct_positions)]):
            crcs[position] = crc
        if indirect_positions:
            items = [(values[p], entries[p]) for p in indirect_positions]
            for position, crc in zip(indirect_positions, self._copy_with_torch(buffer, items, checksum)):
                crcs[position] = crc
        return crcs

    def _copy_with_torch(
        self, buffer: _core.ShmBuffer, items: list[tuple[PreparedValue, IndexEntry]], checksum: bool
    ) -> list[int]:
        """Values the C++ engine cannot read directly: bytes, strided and device tensors.

        Device tensors are copied by torch straight into the mapped (page-locked) buffer, one
        asynchronous DMA copy each, in batches of about staging_batch_nbytes: the CPU checksums
        a batch as soon as its copies have landed while later ones are still in flight, so the
        CRC adds little to the device-to-host time. Returns the CRC32Cs.
        """
        landed: list[int] = []  # positions copied synchronously (bytes, CPU tensors)
        in_flight: list[tuple[Any, list[int]]] = []  # (CUDA event, positions) per batch, in copy order
        batch: list[int] = []
        batch_device: torch.device | None = None
        devices: set[torch.device] = set()
        pending = 0
        target: torch.Tensor | None = None
        with memoryview(buffer) as view, torch.no_grad():
            try:
                for position, (value, entry) in enumerate(items):
                    if value.nbytes == 0:
                        continue
                    if value.data is not None:
                        view[entry.offset : entry.offset + value.nbytes] = value.data
                        landed.append(position)
                        continue
                    tensor = value.tensor
                    assert tensor is not None  # a prepared value holds either bytes (data) or a tensor
                    if tensor.is_cuda and batch and (pending >= self.staging_batch_nbytes
                                                     or tensor.device != batch_device):
                        in_flight.append((_recorded_event(batch_device), batch))
                        batch, pending = [], 0
                    if tensor.is_cuda:
                        devices.add(tensor.device)
                    target = torch.frombuffer(view, dtype=torch.uint8, count=value.nbytes, offset=entry.offset)
                    target.view(tensor.dtype).view(value.shape).copy_(tensor, non_blocking=tensor.is_cuda)
                    target = None
                    if tensor.is_cuda:
                        batch.append(position)
                        batch_device = tensor.device
                        pending += value.nbytes
                    else:
                        landed.append(position)
                if batch:
                    in_flight.append((_recorded_event(batch_device), batch))
            except BaseException:
                target = None  # the view must have no exports left when it closes
                for device in devices:  # no DMA may still write into a buffer the pool gets back
                    torch.cuda.current_stream(device).synchronize()
                raise
            crcs = [0] * len(items)
            for event, positions in [*in_flight, (None, landed)]:
                if event is not None:
                    event.synchronize()  # this batch has landed: checksums and sealing may read it
                if checksum and positions:
                    ranges = array.array("Q")
                    for position in positions:
                        ranges.extend((items[position][1].offset, items[position][1].nbytes))
                    for position, crc in zip(positions, _core.checksum_buffer_ranges(buffer, ranges, self.threads)):
                        crcs[position] = crc
        return crcs

    def commit(
        self, step: int, objects: list[ObjectRecord], *, world_size: int = 1, metadata: dict[str, Any] | None = None
    ) -> CommitRecord:
        """Make version `step` exist; call once every object it lists is written."""
        return write_commit(self.layout, step, objects, world_size=world_size, metadata=metadata)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        keep: int | None = 1,
        overwrite: bool = False,
    ) -> SaveResult:
        """Save state as committed version `step` of this single rank; keep the newest `keep` versions."""
        start = time.perf_counter()
        written = self.write_object(step, state, overwrite=overwrite)
        self.commit(step, [written.record], world_size=1, metadata=metadata)
        elapsed = time.perf_counter() - start
        if keep is not None:
            retire_superseded(self.layout.base_dir, keep=keep, rank=self.rank, pool=self.pool)
        logger.debug("Saved step %d: %d bytes in %.3f s", step, written.data_nbytes, elapsed)
        return SaveResult(step, written.data_nbytes, elapsed, (written.record,))

    def close(self) -> None:
        if self._capture_thread is not None:  # its copies write into the pool's mappings
            self._capture_thread.shutdown(wait=True)
            self._capture_thread = None
        self.pool.close()

    def __enter__(self) -> "CheckpointSaver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class StagedObject:
    """An object whose data sits in a pool buffer; sealing writes its index and header."""

    step: int
    buffer: _core.ShmBuffer
    seal_job: SealJob
    data_nbytes: int
    copying: "Future[object] | None" = None  # the background copy, while stage_object(in_background=True) runs it


def _split_direct(values: list[PreparedValue], entries: list[IndexEntry]) -> tuple[array.array, list[int], list[int]]:
    """(source, offset, nbytes) ops of the values the C++ engine copies, their positions, the other positions."""
    direct_ops = array.array("Q")
    direct_positions: list[int] = []
    indirect_positions: list[int] = []
    for position, (value, entry) in enumerate(zip(values, entries)):
        tensor = value.tensor
        if tensor is not None and value.is_direct:
            direct_ops.extend((tensor.data_ptr() if value.nbytes else 0, entry.offset, value.nbytes))
            direct_positions.append(position)
        else:
            indirect_positions.append(position)
    return direct_ops, direct_positions, indirect_positions


def background_copy(buffer: _core.ShmBuffer, ops: array.array, threads: int, keep_alive: object) -> None:
    """A background copy's body; keep_alive holds the source tensors (ops hold only their addresses)."""
    _core.copy_into_buffer(buffer, ops, False, threads)
