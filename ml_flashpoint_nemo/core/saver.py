"""Writing a rank's state as one object of a version, and committing single-rank versions."""

from __future__ import annotations

import array
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import (
    FLAG_NO_DATA_CRC,
    CommitRecord,
    IndexEntry,
    ObjectHeader,
    ObjectPlan,
    ObjectRecord,
    plan_object,
)
from ml_flashpoint_nemo.core.layout import CheckpointLayout, object_name
from ml_flashpoint_nemo.core.pool import BufferPool, raise_if_out_of_space
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.values import PreparedValue, prepare_state
from ml_flashpoint_nemo.core.versions import delete_superseded, retire_version, write_commit
from ml_flashpoint_nemo.errors import VersionExistsError

logger = logging.getLogger(__name__)


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
        self.pool = pool or BufferPool(self.layout, rank, max_free=max_free_buffers)
        self._plan: ObjectPlan | None = None
        self._plan_signature: list[tuple] | None = None

    def warm_up(self, nbytes: int, count: int = 2) -> "Future[None]":
        """Pre-create and pre-fault `count` buffers for saves of about nbytes, in the background.

        Keeping k versions needs k + 1 buffers: the next save fills one while k are committed.
        """
        return self.pool.start_warmup(nbytes, count)

    def write_object(self, step: int, state: Mapping[str, Any], *, overwrite: bool = False) -> WrittenObject:
        """Write this rank's state as an (uncommitted) object of version `step`."""
        values = prepare_state(state)
        if self.layout.is_committed(step):
            if not overwrite:
                raise VersionExistsError(
                    f"step {step} is already committed in {self.layout.base_dir}; pass overwrite=True to replace it "
                    "(the old version is removed before the new one is written)"
                )
            # Only this rank's objects: other ranks of a multi-rank save retire their own.
            retire_version(self.layout, step, rank=self.rank, pool=self.pool)
        plan = self._plan_for(values)
        buffer = self.pool.acquire(plan.object_nbytes)
        try:
            index = plan.index.fill(self._copy_values(buffer, values, plan.entries))
            header = ObjectHeader(
                object_nbytes=plan.object_nbytes,
                index_offset=plan.index_offset,
                index_nbytes=len(index),
                index_crc32c=_core.crc32c(index),
                record_count=len(plan.entries),
                writer_rank=self.rank,
                flags=0 if self.checksum else FLAG_NO_DATA_CRC,
            ).encode()
            with memoryview(buffer) as view:
                view[plan.index_offset : plan.object_nbytes] = index
                view[: len(header)] = header
            name = object_name(self.rank)
            version_dir = self.layout.version_dir(step)
            version_dir.mkdir(parents=True, exist_ok=True)
            self.pool.place(buffer, version_dir / name)
        except BaseException as exc:
            self.pool.release(buffer)
            if isinstance(exc, OSError):
                raise_if_out_of_space(exc, f"step {step}")
            raise
        record = ObjectRecord(name, self.rank, plan.object_nbytes, _core.crc32c(index, _core.crc32c(header)))
        return WrittenObject(record, sum(v.nbytes for v in values))

    def _plan_for(self, values: list[PreparedValue]) -> ObjectPlan:
        """The layout of the previous save when keys, dtypes and shapes are unchanged (checked every save)."""
        signature = [(v.key, v.kind, v.dtype, v.shape, v.nbytes) for v in values]
        if self._plan is None or self._plan_signature != signature:
            self._plan, self._plan_signature = plan_object(signature), signature
        return self._plan

    def _copy_values(self, buffer: _core.ShmBuffer, values: list[PreparedValue], entries: list[IndexEntry]) -> list[int]:
        """Copy every value to its record's offset; returns the records' CRC32Cs (zeros with checksum off)."""
        crcs = [0] * len(values)
        direct_ops = array.array("Q")
        direct_positions = []
        indirect_positions = []
        for position, (value, entry) in enumerate(zip(values, entries)):
            if value.is_direct:
                direct_ops.extend((value.tensor.data_ptr() if value.nbytes else 0, entry.offset, value.nbytes))
                direct_positions.append(position)
            else:
                indirect_positions.append(position)
        for position, crc in zip(direct_positions, _core.copy_into_buffer(buffer, direct_ops, self.checksum, self.threads)):
            crcs[position] = crc
        if indirect_positions:
            items = [(values[p], entries[p]) for p in indirect_positions]
            for position, crc in zip(indirect_positions, self._copy_with_torch(buffer, items)):
                crcs[position] = crc
        return crcs

    def _copy_with_torch(self, buffer: _core.ShmBuffer, items: list[tuple[PreparedValue, IndexEntry]]) -> list[int]:
        """Values the C++ engine cannot read directly: bytes, strided and device tensors.

        Device tensors are copied by torch straight into the mapped buffer (one D2H copy),
        then checksummed in place. Returns their CRC32Cs.
        """
        with memoryview(buffer) as view, torch.no_grad():
            for value, entry in items:
                if value.nbytes == 0:
                    continue
                if value.data is not None:
                    view[entry.offset : entry.offset + value.nbytes] = value.data
                    continue
                target = torch.frombuffer(view, dtype=torch.uint8, count=value.nbytes, offset=entry.offset)
                # copy_ from a device tensor into pageable host memory returns once the bytes are here.
                target.view(value.tensor.dtype).view(value.shape).copy_(value.tensor)
                del target
        if not self.checksum:
            return [0] * len(items)
        ranges = array.array("Q")
        for _, entry in items:
            ranges.extend((entry.offset, entry.nbytes))
        return _core.checksum_buffer_ranges(buffer, ranges, self.threads)

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
            delete_superseded(self.layout.base_dir, keep=keep, rank=self.rank, pool=self.pool)
        logger.debug("Saved step %d: %d bytes in %.3f s", step, written.data_nbytes, elapsed)
        return SaveResult(step, written.data_nbytes, elapsed, (written.record,))

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "CheckpointSaver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
