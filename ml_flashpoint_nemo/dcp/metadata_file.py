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
import io
import operator
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ml_flashpoint_nemo.core.format import MAX_TENSOR_EXTENT
from ml_flashpoint_nemo.core.values import dtype_name
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


# What a `.metadata` may name: the classes DCP's Metadata is made of (Megatron's subclass included) and the
# callables torch's own reduce functions name for its values (torch.Size, a layout by name); torch's dtypes,
# layouts and memory formats are admitted by value below. Containers (dict, list, tuple, set) are opcodes
# of their own. A name outside these is refused before its module is imported: a `.metadata` may come
# from a peer, and unpickling a name runs it.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ADMITTED_NAMES = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),  # Metadata with mcore_data
})
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)  # pickled by name: torch.float32
# torch pickles a layout as torch.serialization._get_layout("torch.strided"); this lookup answers the same
# and, unlike that function, has no attributes a pickle could set.
_LAYOUT_BY_NAME = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}.__getitem__


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: every class or callable it names must be admitted.

    An admitted class (or Enum member) is shared by the whole process, and a pickle can set
    attributes on anything it names (the BUILD opcode), so each is remembered as it was when
    named; refused_changes puts back and reports what the pickle changed.
    """

    def __init__(self, encoded: bytes) -> None:
        super().__init__(io.BytesIO(encoded))
        self.named: dict[int, tuple[Any, dict[str, Any]]] = {}  # id -> (a shared object named, its attributes)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED_NAMES:
            found = super().find_class(module, name)
            for shared in (found, *(vars(found).get("_member_map_") or {}).values()):  # an Enum's members too
                if hasattr(shared, "__dict__") and id(shared) not in self.named:
                    self.named[id(shared)] = (shared, dict(vars(shared)))
            return found
        if module == "torch.serialization" and name == "_get_layout":
            return _LAYOUT_BY_NAME
        if module == "torch":
            constant = getattr(torch, name, None)
            if isinstance(constant, _TORCH_CONSTANTS):
                return constant
        raise _RefusedName(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedName("a persistent id")

    def refused_changes(self) -> str | None:
        """Put back every attribute the pickle set on a shared object; name the first such object, or None."""
        changed = None
        for shared, before in self.named.values():
            now = dict(vars(shared))
            if now.get("__slotnames__", _MISSING) == [] and "__slots__" not in now:
                # What copyreg caches on a class of no slots when another thread pickles one meanwhile
                now.pop("__slotnames__")
                before = {k: v for k, v in before.items() if k != "__slotnames__"}
            if len(now) == len(before) and all(now.get(k, _MISSING) is v for k, v in before.items()):
                continue
            keys = sorted(k for k in now.keys() | before.keys() if now.get(k, _MISSING) is not before.get(k, _MISSING))
            changed = changed or f"attribute{'s' if len(keys) > 1 else ''} {', '.join(keys)} of {shared!r}"
            for key in now.keys() - before.keys():
                _put_back(shared, key, _MISSING)
            for key, value in before.items():
                if now.get(key, _MISSING) is not value:
                    _put_back(shared, key, value)
        return changed


def _put_back(shared: Any, key: str, value: Any) -> None:
    """Give a class (through setattr: its __dict__ is read-only) or an instance its attribute as it was."""
    attributes = vars(shared)
    if isinstance(shared, type) and value is _MISSING:
        delattr(shared, key)
    elif isinstance(shared, type):
        setattr(shared, key, value)
    elif value is _MISSING:
        del attributes[key]
    else:
        attributes[key] = value


_MISSING = object()


class _RefusedName(pickle.UnpicklingError):
    """A name DCP metadata is not made of."""


def unpickle_metadata(encoded: bytes, step: int | None) -> Any:
    """The object `.metadata`'s bytes hold, unpickled with only the names DCP metadata is made of."""
    unpickler = _MetadataUnpickler(encoded)
    try:
        loaded = unpickler.load()
    except _RefusedName as exc:
        raise CorruptCheckpointError(
            f"the DCP metadata of version {step} does not unpickle here: it names {exc}, which DCP metadata is not "
            "made of, and was refused unrun. Load an older version, or the durable checkpoint."
        ) from None
    except Exception as exc:  # noqa: BLE001 - bytes that no DCP save wrote can fail in any admitted constructor
        raise CorruptCheckpointError(
            f"the DCP metadata of version {step} does not unpickle here ({type(exc).__name__}: {exc}): it was "
            "written by another ml_flashpoint_nemo or torch. Load an older version, or the durable checkpoint."
        ) from exc
    finally:
        changed = unpickler.refused_changes()
    if changed is not None:
        raise CorruptCheckpointError(
            f"the DCP metadata of version {step} sets {changed}, which no DCP save does (put back). Load an older "
            "version, or the durable checkpoint."
        )
    return loaded


def decode_metadata(encoded: bytes, step: int | None) -> Metadata:
    """DCP's Metadata from the verified bytes of `.metadata`; a file this code cannot read is refused clearly."""
    metadata = unpickle_metadata(encoded, step)
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"the DCP metadata of version {step} holds a {type(metadata).__name__}")
    # The writer always records both (empty for an empty state); anything else is not a save of ours.
    for field in ("state_dict_metadata", "storage_data"):
        if type(getattr(metadata, field, None)) is not dict:
            raise CorruptCheckpointError(
                f"the DCP metadata of version {step} has {field} of type "
                f"{type(getattr(metadata, field, None)).__name__}, not a dict: it was not written by this "
                "ml_flashpoint_nemo. Load another version, or the durable checkpoint."
            )
    return metadata


ChunkKey = tuple[str, tuple[int, ...]]  # (fqn, chunk offsets), as DCP's MetadataIndex compares
StoredChunk = tuple[tuple[int, ...], str]  # a chunk's sizes and its tensor's dtype name, as a record holds them
_Box = tuple[tuple[int, ...], tuple[int, ...]]  # a chunk's offsets and sizes


def checked_chunks(metadata: Metadata, step: int | None) -> dict[ChunkKey, StoredChunk]:
    """The sizes and dtype of every stored tensor chunk, after checking the chunks against their tensor.

    A load plan is computed from these offsets and sizes (resharding reads parts of chunks),
    so they are checked before any is used: integer offsets and sizes, one per dimension, each
    chunk inside the tensor, no two chunks sharing an element, and the chunks' volumes adding
    up to the tensor's. Together these say the chunks tile the tensor exactly, as DCP's save
    planner writes them: a missing chunk would leave part of a destination unwritten, an
    overlapping one part of it read twice and another part never.
    """
    chunks_of: dict[ChunkKey, StoredChunk] = {}
    checked: dict[int, tuple[int, ...]] = {}  # id of a size/offset object already checked (alive: metadata holds it)
    dtypes: dict[int, str] = {}  # id of a TensorProperties already checked -> its dtype name (shared, as sizes are)

    def dims(value: object, fqn: str, what: str) -> tuple[int, ...]:
        known = checked.get(id(value))  # equal sizes are often one object (see _share_equal_values)
        if known is None:
            known = checked[id(value)] = _dims(value, fqn, what, step)
        return known

    try:
        for fqn, stored in metadata.state_dict_metadata.items():
            if type(stored) is not TensorStorageMetadata or type(fqn) is not str:
                if type(stored) is not BytesStorageMetadata or type(fqn) is not str:
                    raise _not_dcp_metadata(step, f"item {fqn!r} is a {type(stored).__name__}")
                continue
            properties = stored.properties
            dtype = dtypes.get(id(properties))
            if dtype is None:
                dtype = dtypes[id(properties)] = _dtype_of(properties, fqn, step)
            shape = dims(stored.size, fqn, "size")
            chunks = stored.chunks
            if type(chunks) is not list:
                raise _not_dcp_metadata(step, f"the chunks of {fqn!r} are not a list")
            if len(chunks) == 1 and type(chunks[0]) is ChunkStorageMetadata:  # the common case: the whole tensor
                offsets = dims(chunks[0].offsets, fqn, "chunk offsets")
                extent = dims(chunks[0].sizes, fqn, "chunk sizes")
                if extent == shape and len(offsets) == len(shape) and not any(offsets):
                    chunks_of[(fqn, offsets)] = (extent, dtype)
                    continue
            boxes = [_box(chunk, fqn, dims, step) for chunk in chunks]
            _check_tiling(boxes, shape, fqn, step)
            for offsets, extent in boxes:
                known = chunks_of.setdefault((fqn, offsets), (extent, dtype))
                if known[0] != extent:
                    raise CorruptCheckpointError(
                        f"the DCP metadata of version {step} lists two chunks of {fqn} at {list(offsets)}, of sizes "
                        f"{list(known[0])} and {list(extent)}. Load another version, or the durable checkpoint."
                    )
    except AttributeError as exc:  # an object a pickle made without its fields (no BUILD)
        raise _not_dcp_metadata(step, f"a part of it lacks a field ({exc})") from None
    return chunks_of


def _box(chunk: Any, fqn: str, dims: Any, step: int | None) -> _Box:
    """A chunk's (offsets, sizes), each checked."""
    if type(chunk) is not ChunkStorageMetadata:
        raise _not_dcp_metadata(step, f"a {type(chunk).__name__} is among the chunks of {fqn!r}")
    return dims(chunk.offsets, fqn, "chunk offsets"), dims(chunk.sizes, fqn, "chunk sizes")


def _dtype_of(properties: Any, fqn: str, step: int | None) -> str:
    dtype = getattr(properties, "dtype", None) if type(properties) is TensorProperties else None
    if not isinstance(dtype, torch.dtype):
        raise _not_dcp_metadata(step, f"the tensor properties of {fqn!r} name no torch dtype")
    return dtype_name(dtype)


def _not_dcp_metadata(step: int | None, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"the DCP metadata of version {step} is not what a DCP save writes: {what}. Load another version, or the "
        "durable checkpoint."
    )


def _check_tiling(boxes: list[_Box], shape: tuple[int, ...], fqn: str, step: int | None) -> None:
    """Refuse chunks that do not tile the tensor exactly: one outside it, two sharing an element, or a gap."""
    volume = 0
    for offsets, extent in boxes:
        if len(offsets) != len(shape) or len(extent) != len(shape) or any(
                o + n > d for o, n, d in zip(offsets, extent, shape)):
            raise CorruptCheckpointError(
                f"the DCP metadata of version {step} has a chunk of {fqn} at {list(offsets)} of size "
                f"{list(extent)} outside the tensor's shape {list(shape)}. Load another version, or the durable "
                "checkpoint."
            )
        volume += _volume(extent)
    tensor_volume = _volume(shape)
    if volume != tensor_volume:
        raise CorruptCheckpointError(
            f"the DCP metadata of version {step} lists chunks of {fqn} holding {volume} elements, but the tensor "
            f"{list(shape)} has {tensor_volume}: {'part of it was not saved' if volume < tensor_volume else 'some overlap'}"
            ". Load another version, or the durable checkpoint."
        )
    overlap = _overlapping_pair([box for box in boxes if all(box[1])])  # a chunk of no elements overlaps nothing
    if overlap is not None:
        (first_at, first_size), (second_at, second_size) = overlap
        raise CorruptCheckpointError(
            f"the DCP metadata of version {step} lists chunks of {fqn} that overlap: {list(first_size)} at "
            f"{list(first_at)} and {list(second_size)} at {list(second_at)}, so another part of the tensor was not "
            "saved. Load another version, or the durable checkpoint."
        )


def _volume(extent: tuple[int, ...]) -> int:
    volume = 1
    for n in extent:
        volume *= n
    return volume


def _overlapping_pair(boxes: list[_Box]) -> tuple[_Box, _Box] | None:
    """Two of the boxes (none empty) that share an element, or None.

    A sweep along the dimension with the most distinct offsets: boxes sorted by their start there,
    each compared only with the earlier ones still open at that start. Chunks cut along one
    dimension (the usual sharding) keep one box open, so the sweep is a sort and a linear pass;
    a grid of chunks keeps one row open.
    """
    if len(boxes) < 2 or not boxes[0][0]:
        return None if len(boxes) < 2 else (boxes[0], boxes[1])  # two chunks of a 0-d tensor: the same element
    ndim = len(boxes[0][0])
    sweep = max(range(ndim), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    others = [d for d in range(ndim) if d != sweep]
    open_boxes: list[_Box] = []
    for box in sorted(boxes, key=lambda b: b[0][sweep]):
        offsets, extent = box
        start = offsets[sweep]
        open_boxes = [b for b in open_boxes if b[0][sweep] + b[1][sweep] > start]
        for other in open_boxes:
            if all(other[0][d] < offsets[d] + extent[d] and offsets[d] < other[0][d] + other[1][d] for d in others):
                return other, box
        open_boxes.append(box)
    return None


def _dims(value: object, fqn: str, what: str, step: int | None) -> tuple[int, ...]:
    """value as the dimensions of a tensor: non-negative integers whose extent (zeros as one) torch can hold."""
    if isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value):
        extent = 1
        for v in value:
            extent *= v or 1
        if extent <= MAX_TENSOR_EXTENT:
            return tuple(value)
    shown = tuple.__repr__(value) if isinstance(value, tuple) else repr(value)  # torch.Size's repr fails past int64
    raise CorruptCheckpointError(
        f"the DCP metadata of version {step} gives {fqn} {what} {shown[:200]}, not non-negative integers of a shape "
        "torch can hold. Load another version, or the durable checkpoint."
    )
