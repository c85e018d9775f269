"""The `.metadata` file of a DCP version: torch's Metadata, pickled, without the per-save StorageMeta.

A job saves the same structure every time, and everything here that walks every item is on the
commit's critical path (pickling DCP's Metadata costs ~9 us per item in Python, ~4.5 ms for 500
tensors). So the coordinator keeps, per base directory, what its last save wrote: the bytes, a
private decoded copy of the Metadata (without storage_data), the storage_data and the layout it
was built from (which rank's object holds which item). The next save reuses the storage_data
when the layout repeats (compared as tuples, in C) and the bytes when the rest of the Metadata
equals the copy too. Nothing of the cache is shared with DCP or the caller (DCP's plan cache may
keep and reuse its own Metadata), so equality means the bytes describe this save exactly.

StorageMeta (checkpoint_id, save_id) is the one part that changes every save; it is left out of the
file, and the reader rebuilds it from the path and the commit record. Equal sizes, offsets and
tensor properties are written once each (pickle's memo then refers back to them), which makes
the file 15-30% smaller and the reader's unpickling faster.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ml_flashpoint_nemo.dcp.storage_info import ItemLocation, RankWrite
from ml_flashpoint_nemo.errors import CorruptCheckpointError

_Layout = tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]  # per rank with an object: (name, (fqn, offset) per item)


@dataclasses.dataclass(frozen=True)
class _Written:
    layout: _Layout
    storage_data: dict[MetadataIndex, ItemLocation]  # private: callers get a copy
    rest: Metadata  # private decoded copy, storage_data and storage_meta None
    encoded: bytes


_LAST_WRITTEN: dict[str, _Written] = {}  # base dir -> what its coordinator wrote last
_LOCK = threading.Lock()
_FQN_AND_OFFSET = operator.attrgetter("fqn", "offset")  # what MetadataIndex compares, as a tuple (in C)


@dataclasses.dataclass(frozen=True)
class EarlyComparison:
    """`metadata`, less storage_data and storage_meta, equalled what `last` was encoded from."""

    metadata: Metadata
    last: _Written


def compare_early(base_dir: str | os.PathLike[str], metadata: Any) -> EarlyComparison | None:
    """Compare a save's Metadata with the last one written into base_dir before the state's copy.

    The coordinator's write_data calls it while DCP's Metadata is still in the CPU caches (after
    the copy has evicted it, the same comparison in finish() takes longer). encode_metadata trusts
    the answer only for this very object and last save: DCP hands finish() the Metadata its
    planner built, unchanged since.
    """
    with _LOCK:
        last = _LAST_WRITTEN.get(os.fspath(base_dir))
    try:
        equal = last is not None and isinstance(metadata, Metadata) and last.rest == _rest(metadata)
    except Exception:  # noqa: BLE001 - an odd Metadata subclass: encode_metadata compares (or fails) as before
        return None
    return EarlyComparison(metadata, last) if equal and last is not None else None


def _rest(metadata: Metadata) -> Metadata:
    return dataclasses.replace(metadata, storage_meta=None, storage_data=None)


def encode_metadata(base_dir: str | os.PathLike[str], metadata: Metadata, writes: Sequence[RankWrite],
                    early: EarlyComparison | None = None) -> bytes:
    """Set metadata.storage_data from every rank's RankWrite, and return the bytes of `.metadata`.

    Both are reused from the last save into base_dir while the structure repeats (see compare_early).
    """
    layout: _Layout = tuple((name, tuple(map(_FQN_AND_OFFSET, indices))) for name, _, _, indices in writes)
    key = os.fspath(base_dir)
    with _LOCK:
        last = _LAST_WRITTEN.get(key)
    if last is not None and last.layout == layout:
        metadata.storage_data = dict(last.storage_data)
        if (early is not None and early.metadata is metadata and early.last is last) or last.rest == _rest(metadata):
            return last.encoded
    else:
        metadata.storage_data = {index: (name, record_key) for name, _, keys, indices in writes
                                 for index, record_key in zip(indices, keys)}
    private: Metadata = pickle.loads(pickle.dumps(dataclasses.replace(metadata, storage_meta=None),
                                                  protocol=pickle.HIGHEST_PROTOCOL))
    _share_equal_values(private)
    encoded = pickle.dumps(private, protocol=pickle.HIGHEST_PROTOCOL)
    written = _Written(layout, private.storage_data, _rest(private), encoded)
    with _LOCK:
        _LAST_WRITTEN[key] = written
    return encoded


def _share_equal_values(metadata: Metadata) -> None:
    """Make equal sizes, offsets and tensor properties one object each (ints only: nothing changes value)."""
    shapes: dict[tuple[type, tuple[int, ...]], Any] = {}
    properties: dict[tuple[Any, ...], Any] = {}

    def shared_shape(value: Any) -> Any:
        if isinstance(value, tuple) and all(type(v) is int for v in value):
            return shapes.setdefault((type(value), tuple(value)), value)  # a torch.Size stays a torch.Size
        return value

    for stored in metadata.state_dict_metadata.values():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        p = stored.properties
        stored.properties = properties.setdefault(
            (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory), p)
        stored.size = shared_shape(stored.size)
        for chunk in stored.chunks:
            chunk.offsets = shared_shape(chunk.offsets)
            chunk.sizes = shared_shape(chunk.sizes)
    for index in list(metadata.storage_data):
        if index.offset is not None:
            object.__setattr__(index, "offset", shared_shape(index.offset))


def decode_metadata(encoded: bytes, step: int | None) -> Metadata:
    """DCP's Metadata from the verified bytes of `.metadata`; a file this code cannot read is refused clearly."""
    try:
        metadata = pickle.loads(encoded)
    except (AttributeError, ImportError, TypeError, pickle.UnpicklingError) as exc:
        raise CorruptCheckpointError(
            f"the DCP metadata of version {step} does not unpickle here ({type(exc).__name__}: {exc}): it was "
            "written by another ml_flashpoint_nemo or torch. Load an older version, or the durable checkpoint."
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"the DCP metadata of version {step} holds a {type(metadata).__name__}")
    # The writer always records both (empty for an empty state); anything else is not a save of ours.
    for field in ("state_dict_metadata", "storage_data"):
        if type(getattr(metadata, field)) is not dict:
            raise CorruptCheckpointError(
                f"the DCP metadata of version {step} has {field} of type {type(getattr(metadata, field)).__name__}, "
                "not a dict: it was not written by this ml_flashpoint_nemo. Load another version, or the durable "
                "checkpoint."
            )
    return metadata


ChunkKey = tuple[str, tuple[int, ...]]  # (fqn, chunk offsets), as DCP's MetadataIndex compares


def checked_chunk_sizes(metadata: Metadata, step: int | None) -> dict[ChunkKey, tuple[int, ...]]:
    """The size of every stored tensor chunk, after checking the chunks against their tensor.

    A load plan is computed from these offsets and sizes (resharding reads parts of chunks),
    so they are checked before any is used: integer offsets and sizes, one per dimension, each
    chunk inside the tensor, and the chunks' volumes adding up to the tensor's (what DCP's save
    planner guarantees for a tensor it wrote; a chunk missing would leave part of a
    destination unwritten).
    """
    sizes: dict[ChunkKey, tuple[int, ...]] = {}
    checked: dict[int, tuple[int, ...]] = {}  # id of a size/offset object already checked (alive: metadata holds it)

    def dims(value: object, fqn: str, what: str) -> tuple[int, ...]:
        known = checked.get(id(value))  # equal sizes are often one object (see _share_equal_values)
        if known is None:
            known = checked[id(value)] = _dims(value, fqn, what, step)
        return known

    for fqn, stored in metadata.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        shape = dims(stored.size, fqn, "size")
        chunks = stored.chunks
        if type(chunks) is list and len(chunks) == 1:  # the common case: one chunk holding the whole tensor
            offsets = dims(chunks[0].offsets, fqn, "chunk offsets")
            extent = dims(chunks[0].sizes, fqn, "chunk sizes")
            if extent == shape and len(offsets) == len(shape) and not any(offsets):
                sizes[(fqn, offsets)] = extent
                continue
        volume = 0
        for chunk in chunks:
            offsets = dims(chunk.offsets, fqn, "chunk offsets")
            extent = dims(chunk.sizes, fqn, "chunk sizes")
            if len(offsets) != len(shape) or len(extent) != len(shape) or any(
                    o + n > d for o, n, d in zip(offsets, extent, shape)):
                raise CorruptCheckpointError(
                    f"the DCP metadata of version {step} has a chunk of {fqn} at {list(offsets)} of size "
                    f"{list(extent)} outside the tensor's shape {list(shape)}. Load another version, or the durable "
                    "checkpoint."
                )
            chunk_volume = 1
            for n in extent:
                chunk_volume *= n
            volume += chunk_volume
            sizes[(fqn, offsets)] = extent
        tensor_volume = 1
        for d in shape:
            tensor_volume *= d
        if volume != tensor_volume:
            raise CorruptCheckpointError(
                f"the DCP metadata of version {step} lists chunks of {fqn} holding {volume} elements, but the tensor "
                f"{list(shape)} has {tensor_volume}: part of it was not saved. Load another version, or the durable "
                "checkpoint."
            )
    return sizes


def _dims(value: object, fqn: str, what: str, step: int | None) -> tuple[int, ...]:
    if isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    raise CorruptCheckpointError(
        f"the DCP metadata of version {step} gives {fqn} {what} {value!r}, not non-negative integers. Load another "
        "version, or the durable checkpoint."
    )
