"""Sealing a staged object (its index, then its header): the part of a save that can run in any process.

Kept free of torch and Megatron so that the persistent save worker (core/save_worker.py) boots
in a fraction of a second: a worker that imported them took ~3.5 s of CPU per rank at trainer
set-up, taken from the restore and the first steps on a busy host.
"""

from __future__ import annotations

import array
import os
from dataclasses import dataclass

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import FLAG_NO_DATA_CRC, FLAG_ZERO_PADDING, HEADER_NBYTES, ObjectHeader, ObjectPlan
from ml_flashpoint_nemo.errors import CorruptCheckpointError, FormatVersionError


@dataclass(frozen=True)
class SealJob:
    """Everything needed to finish a staged object from any process: picklable, addressed by path."""

    path: str
    rank: int
    plan: ObjectPlan
    crcs: list[int] | None  # None: compute the data CRCs from the file
    checksum: bool
    padding_zeroed: bool = False  # every gap of the layout was zeroed while staging


def seal_object(job: SealJob, threads: int = 1) -> None:
    """Write a staged object's index and then its header (computing data CRCs first if needed).

    Runs in the saving process or in a background worker process; it touches only the
    object's file. The header goes last, so a valid header means a complete object.
    """
    plan = job.plan
    fd = os.open(job.path, os.O_RDWR | os.O_CLOEXEC)
    try:
        crcs = job.crcs
        if crcs is None:
            ranges = array.array("Q")
            for entry in plan.entries:
                ranges.extend((entry.offset, entry.nbytes))
            crcs = _core.checksum_file_ranges(fd, ranges, threads)
        index = plan.index.fill(crcs if job.checksum else [0] * len(plan.entries))
        header = ObjectHeader(
            object_nbytes=plan.object_nbytes,
            index_offset=plan.index_offset,
            index_nbytes=len(index),
            index_crc32c=_core.crc32c(index),
            record_count=len(plan.entries),
            writer_rank=job.rank,
            flags=(0 if job.checksum else FLAG_NO_DATA_CRC) | (FLAG_ZERO_PADDING if job.padding_zeroed else 0),
        ).encode()
        os.pwrite(fd, index, plan.index_offset)
        os.pwrite(fd, header, 0)
    finally:
        os.close(fd)


def read_sealed_checksum(job: SealJob) -> int:
    """The object's checksum for the commit record, read back; fails if sealing did not complete."""
    plan = job.plan
    fd = os.open(job.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header_bytes = os.pread(fd, HEADER_NBYTES, 0)
        try:
            header = ObjectHeader.decode(header_bytes, job.path)
        except (CorruptCheckpointError, FormatVersionError) as exc:  # our own header: any other version is damage
            raise CorruptCheckpointError(
                f"the object staged in {job.path} was never sealed: its background write failed or was killed "
                "(see that worker's log). The save was abandoned; earlier versions are intact."
            ) from exc
        if header.object_nbytes != plan.object_nbytes or header.index_offset != plan.index_offset:
            raise CorruptCheckpointError(
                f"the object sealed in {job.path} does not match the layout it was staged with"
            )
        index = os.pread(fd, header.index_nbytes, header.index_offset)
        if _core.crc32c(index) != header.index_crc32c:
            raise CorruptCheckpointError(f"the index sealed in {job.path} fails its checksum")
        return _core.crc32c(index, _core.crc32c(header_bytes))
    finally:
        os.close(fd)
