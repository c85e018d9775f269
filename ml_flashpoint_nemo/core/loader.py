"""Reading versions back: straight from the object into the destination, verified on the way.

Data goes from the object straight into the destination tensor's own memory,
each 64 bytes folded into the CRC32C on the way. Where this process saved the
object and still holds its pool buffer (core/pool.py), it is copied from that
mapping, whose pages are populated already; otherwise from the object file:
copied from a mapping of the file where its pages are huge, pread through a
cache-sized buffer where they are not (csrc/file_reads.hpp;
FLASHPOINT_READ_METHOD overrides the choice, and any value but auto reads the file).
A file truncated during the read raises CorruptCheckpointError, never a SIGBUS.
Nothing is returned unless every checksum matched: a mismatch raises
ChecksumError naming the object and the key.
"""

from __future__ import annotations

import array
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import (
    CORRUPT_ADVICE,
    HEADER_NBYTES,
    IndexEntry,
    ObjectHeader,
    ObjectRecord,
    decode_index,
    read_index_named_by,
    validate_index,
)
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.pool import find_placed_buffer
from ml_flashpoint_nemo.core.tuning import default_copy_threads, read_method, reads_pool_mappings
from ml_flashpoint_nemo.core.values import BytesLike, dtype_from_name, dtype_name
from ml_flashpoint_nemo.core.version_files import check_version_files
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.errors import (
    ChecksumError,
    CorruptCheckpointError,
    FormatVersionError,
    LoadMismatchError,
    MissingKeyError,
    VersionNotFoundError,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class OpenObject:
    """A validated object file: its header and index, and an open descriptor for reads."""

    path: str
    fd: int
    header: ObjectHeader
    entries: list[IndexEntry]
    by_key: dict[str, IndexEntry]  # the same entries by record key (keys are unique: validate_index)


@contextmanager
def open_object(path: str, record: ObjectRecord) -> Iterator[OpenObject]:
    """Open an object and check it against its commit record: size, header, index checksum, bounds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"object {path} named by the commit record is missing. {CORRUPT_ADVICE}") from None
    try:
        file_size = os.fstat(fd).st_size
        if file_size < record.nbytes:
            raise CorruptCheckpointError(
                f"object {path} is truncated: {file_size} bytes, the commit record says {record.nbytes}. "
                + CORRUPT_ADVICE
            )
        header_bytes = os.pread(fd, HEADER_NBYTES, 0)
        header = ObjectHeader.decode(header_bytes, path)
        index_bytes = read_index_named_by(fd, header_bytes, header, record, path)
        entries = decode_index(index_bytes, path)
        by_key = validate_index(header, entries, path)
        yield OpenObject(path, fd, header, entries, by_key)
    finally:
        os.close(fd)


def _check_crc(obj: OpenObject, entry: IndexEntry, actual: int) -> None:
    if obj.header.has_data_crc and actual != entry.crc32c:
        raise ChecksumError(
            f"key {entry.key!r} in {obj.path}: CRC32C {actual:08x} does not match the recorded {entry.crc32c:08x}; "
            f"the RAM copy is corrupt and the destination holds undefined data. {CORRUPT_ADVICE}",
            path=obj.path,
            key=entry.key,
        )


def _expected_shape_and_dtype(entry: IndexEntry) -> tuple[tuple[int, ...], torch.dtype]:
    return entry.shape, dtype_from_name(entry.dtype)


def _check_destination(entry: IndexEntry, destination: Any, path: str) -> None:
    """A tensor record needs a tensor of its shape and dtype; a bytes record a bytes-like placeholder."""
    is_bytes_like = isinstance(destination, (bytes, bytearray, memoryview))
    if entry.kind == "bytes":
        if not is_bytes_like:
            raise LoadMismatchError(f"key {entry.key!r} in {path} holds bytes; it cannot be loaded into a tensor")
        return
    if not isinstance(destination, torch.Tensor):
        raise LoadMismatchError(f"destination of {entry.key!r} must be a torch.Tensor, got {type(destination).__name__}")
    shape, dtype = _expected_shape_and_dtype(entry)
    if destination.shape != shape or destination.dtype != dtype:
        raise LoadMismatchError(
            f"key {entry.key!r}: stored {dtype_name(dtype)}{list(shape)} but the destination is "
            f"{dtype_name(destination.dtype)}{list(destination.shape)}. The model or its parallel layout "
            "differs from the one that saved this checkpoint."
        )


def read_object(
    obj: OpenObject,
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    keys: Sequence[str] | None = None,
    threads: int | None = None,
) -> dict[str, torch.Tensor | bytes]:
    """Read records of an open object: into the given tensors where given, into new ones otherwise.

    Bytes records always come back as new bytes (a bytes placeholder in `into` is allowed).
    """
    threads = threads or default_copy_threads()
    by_key = obj.by_key
    wanted = list(keys) if keys is not None else list(by_key)
    if into:
        already = set(wanted)
        wanted += [k for k in into if k not in already]
    missing = [k for k in wanted if k not in by_key]
    if missing:
        raise MissingKeyError(
            f"keys {missing[:5]}{'...' if len(missing) > 5 else ''} are not in {obj.path} "
            f"(it holds {len(by_key)} keys). The checkpoint was saved from a different model or rank."
        )
    into = into or {}
    for key in wanted:  # every destination is checked before any byte is read
        if key in into:
            _check_destination(by_key[key], into[key], obj.path)

    result: dict[str, torch.Tensor | bytes] = {}
    ops = array.array("Q")
    op_entries: list[IndexEntry] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (read target, final destination)
    for key in wanted:
        entry = by_key[key]
        if entry.kind == "bytes":
            result[key] = _read_bytes(obj, entry)
            continue
        destination = into.get(key)
        if destination is None or not destination.is_cpu or not destination.is_contiguous():
            shape, dtype = _expected_shape_and_dtype(entry)
            pin = destination is not None and destination.is_cuda
            target = torch.empty(shape, dtype=dtype, pin_memory=pin)
            if destination is not None:
                staged.append((target, destination))
        else:
            target = destination
        result[key] = destination if destination is not None else target
        if entry.nbytes:
            ops.extend((entry.offset, target.data_ptr(), entry.nbytes, target.numel() * target.element_size()))
            op_entries.append(entry)
    buffer = _pool_buffer_of(obj) if op_entries else None
    if staged:  # GPU (or non-contiguous) destinations
        _read_and_upload(obj, ops, op_entries, staged, threads, buffer)
        return result
    crcs = _read_with_errors(obj, ops, threads, buffer)
    for entry, crc in zip(op_entries, crcs):
        _check_crc(obj, entry, crc)
    for target, destination in staged:
        destination.copy_(target)
    return result


# Reads into staging tensors go to their destinations batch by batch: on a GPU each batch's upload
# overlaps the next read.
UPLOAD_BATCH_NBYTES = 128 << 20


def _read_and_upload(
    obj: OpenObject,
    ops: array.array,
    op_entries: list[IndexEntry],
    staged: list[tuple[torch.Tensor, torch.Tensor]],
    threads: int,
    buffer: _core.ShmBuffer | None = None,
) -> None:
    """Read (and verify) the records in batches; after each, start the uploads of its staged tensors.

    The host-to-device copies are asynchronous from page-locked staging tensors, so the DMA of
    one batch runs while the next is read from the file. Every upload has landed on return.
    """
    # Staging tensors with bytes have distinct addresses, which the read ops name; empty ones are not read.
    uploads = {target.data_ptr(): (target, destination) for target, destination in staged if target.numel()}
    empty = [(target, destination) for target, destination in staged if not target.numel()]
    devices = {destination.device for _, destination in staged if destination.is_cuda}
    try:
        start = 0
        while start < len(op_entries):
            end, nbytes = start, 0
            while end < len(op_entries) and (end == start or nbytes < UPLOAD_BATCH_NBYTES):
                nbytes += op_entries[end].nbytes
                end += 1
            crcs = _read_with_errors(obj, ops[4 * start : 4 * end], threads, buffer)
            for entry, crc in zip(op_entries[start:end], crcs):
                _check_crc(obj, entry, crc)
            for op in range(start, end):
                pair = uploads.get(ops[4 * op + 1])  # None: read in place into a CPU destination
                if pair is not None:
                    pair[1].copy_(pair[0], non_blocking=pair[1].is_cuda)
            start = end
        for target, destination in empty:
            destination.copy_(target)
    finally:
        for device in devices:  # also on an error: no upload may still read a staging tensor
            torch.cuda.current_stream(device).synchronize()


def _pool_buffer_of(obj: OpenObject) -> _core.ShmBuffer | None:
    """This process's pool buffer that maps the very file obj has open, or None: then the file is read.

    The same (st_dev, st_ino) is the same file, so the shared mapping holds exactly the bytes a
    read of obj.fd would. A buffer closed meanwhile is harmless: read_buffer_into refuses it
    (even if its old descriptor number was reused) and the read falls back to the file.
    """
    if not reads_pool_mappings():
        return None
    buffer = find_placed_buffer(obj.path)
    if buffer is None:
        return None
    try:
        opened = os.fstat(obj.fd)
        mapped = os.fstat(buffer.fd)  # -1 once closed: EBADF
    except OSError:
        return None
    if (opened.st_dev, opened.st_ino) != (mapped.st_dev, mapped.st_ino) or buffer.size < obj.header.object_nbytes:
        return None
    return buffer


def _read_with_errors(
    obj: OpenObject, ops: array.array, threads: int, buffer: _core.ShmBuffer | None = None
) -> list[int]:
    """Read the ops from buffer (see _pool_buffer_of) if given and still open, else from the file."""
    checksum = obj.header.has_data_crc
    try:
        if buffer is not None:
            try:
                crcs = _core.read_buffer_into(buffer, ops, checksum, threads)
            except (RuntimeError, IndexError, OSError) as exc:
                # Closed meanwhile, a row outside the buffer, a failed fstat: the file read decides, with its own errors.
                logger.debug("Reading %s from the file, not its pool buffer: %s", obj.path, exc)
            else:
                logger.debug("Read %d records of %s from this process's pool buffer", len(crcs), obj.path)
                return crcs
        return _core.read_file_into(obj.fd, ops, checksum, threads, read_method())
    except EOFError as exc:
        raise CorruptCheckpointError(f"object {obj.path} is truncated ({exc}). {CORRUPT_ADVICE}") from exc


def _read_bytes(obj: OpenObject, entry: IndexEntry) -> bytes:
    data = os.pread(obj.fd, entry.nbytes, entry.offset)
    if len(data) != entry.nbytes:
        raise CorruptCheckpointError(f"object {obj.path} is truncated inside {entry.key!r}. {CORRUPT_ADVICE}")
    _check_crc(obj, entry, _core.crc32c(data))
    return data


def load_version(
    base_dir: str | os.PathLike[str],
    step: int | None = None,
    *,
    rank: int = 0,
    into: Mapping[str, torch.Tensor] | None = None,
    keys: Sequence[str] | None = None,
    threads: int | None = None,
    check_private: bool = True,
) -> dict[str, torch.Tensor | BytesLike]:
    """Load rank's state of committed version `step` (the newest if None).

    Tensors named in `into` are filled in place (same shape and dtype required) and
    returned; other keys come back as new CPU tensors, bytes records as bytes. A base
    directory that another user could write or replace raises BaseDirError first
    (layout.not_private_problem); check_private=False is for callers whose ranks agreed
    on that check already (replication.choice.choose_version), so that no rank raises alone.
    """
    layout = CheckpointLayout(base_dir)
    if check_private:
        layout.ensure_private()
    if step is None:
        steps = committed_steps(layout)
        if not steps:
            raise VersionNotFoundError(f"no committed version in {layout.base_dir}")
        step = steps[-1]
    commit = read_commit(layout, step)
    objects = commit.objects_of_rank(rank)
    if not objects:
        raise VersionNotFoundError(
            f"version {step} in {layout.base_dir} has no object of rank {rank} "
            f"(it was saved by {commit.world_size} ranks). Check the rank and world size."
        )
    result: dict[str, Any] = {}
    remaining_into = dict(into or {})
    for record in objects:
        with open_object(str(layout.object_path(step, record.name)), record) as obj:
            present = obj.by_key
            part_into = {k: v for k, v in remaining_into.items() if k in present}
            part_keys = [k for k in (keys if keys is not None else present) if k in present]
            result.update(read_object(obj, into=part_into, keys=part_keys, threads=threads))
            for k in part_into:
                remaining_into.pop(k)
    absent = list(remaining_into) + [k for k in (keys or ()) if k not in result]
    if absent:
        raise MissingKeyError(f"keys {absent[:5]} are not in version {step} of rank {rank} in {layout.base_dir}")
    return result


def load_newest_valid(
    base_dir: str | os.PathLike[str],
    *,
    rank: int = 0,
    into: Mapping[str, torch.Tensor] | None = None,
    threads: int | None = None,
) -> tuple[int, dict[str, torch.Tensor | BytesLike]]:
    """Load the newest version that reads back intact, trying older ones when a newer one fails.

    Each skipped version is logged with the reason. Raises VersionNotFoundError when none loads.
    A destination that does not fit (LoadMismatchError, MissingKeyError) is the caller's to fix
    and is raised; any other failure of a version, even one no check foresaw, skips it. A base
    directory that another user could write or replace raises BaseDirError (nothing is loaded).
    """
    layout = CheckpointLayout(base_dir)
    layout.ensure_private()
    failures = []
    for step in reversed(committed_steps(layout)):
        try:
            return step, load_version(base_dir, step, rank=rank, into=into, threads=threads, check_private=False)
        except (CorruptCheckpointError, FormatVersionError, VersionNotFoundError) as exc:
            skipped: Exception = exc
        except (LoadMismatchError, MissingKeyError):
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the version's bytes set off, an older one may load
            skipped = _unforeseen_failure(layout, step, exc)
        logger.warning("Skipping RAM checkpoint step %d: %s", step, skipped)
        failures.append(f"step {step}: {skipped}")
    raise VersionNotFoundError(
        f"no loadable version of rank {rank} in {layout.base_dir}"
        + (": " + "; ".join(failures) if failures else " (none committed)")
    )


def _unforeseen_failure(layout: CheckpointLayout, step: int, exc: Exception) -> CorruptCheckpointError:
    """A failure no check of the version foresaw, as the CorruptCheckpointError it stands for."""
    logger.debug("Loading step %d of %s failed", step, layout.base_dir, exc_info=exc)
    error = CorruptCheckpointError(
        f"version {step} in {layout.base_dir} failed to load ({type(exc).__name__}: {exc}). {CORRUPT_ADVICE}"
    )
    error.__cause__ = exc
    return error


@dataclass(frozen=True)
class VerifyReport:
    step: int
    objects: int
    records: int
    nbytes: int
    files: int = 0  # version-level files (adapter metadata, common state)


def verify_version(
    base_dir: str | os.PathLike[str], step: int, *, ranks: Sequence[int] | None = None, threads: int | None = None
) -> VerifyReport:
    """Check every byte of a version's local objects and files against their checksums; raises on the first problem."""
    layout = CheckpointLayout(base_dir)
    commit = read_commit(layout, step)
    files = check_version_files(layout, commit)
    threads = threads or default_copy_threads()
    objects = records = nbytes = 0
    for record in commit.objects:
        if ranks is not None and record.rank not in ranks:
            continue
        count, size = verify_object_file(layout.object_path(step, record.name), record, threads)
        objects += 1
        records += count
        nbytes += size
    return VerifyReport(step, objects, records, nbytes, files)


def verify_object_file(path: str | os.PathLike[str], record: ObjectRecord, threads: int = 1) -> tuple[int, int]:
    """Check one object (header, index, every record's data) against its commit record; (records, bytes)."""
    with open_object(os.fspath(path), record) as obj:
        ranges = array.array("Q")
        for entry in obj.entries:
            ranges.extend((entry.offset, entry.nbytes))
        try:
            crcs = _core.checksum_file_ranges(obj.fd, ranges, threads, read_method())
        except EOFError as exc:
            raise CorruptCheckpointError(f"object {obj.path} is truncated ({exc})") from exc
        for entry, crc in zip(obj.entries, crcs):
            _check_crc(obj, entry, crc)
        return len(obj.entries), sum(e.nbytes for e in obj.entries)

