"""MemoryStorageReader: a DCP StorageReader that loads committed RAM versions.

Records are read straight into the tensors DCP resolves for them (one copy, verified
by CRC32C on the way). When the load plan asks for part of a stored chunk
(resharding), the chunk is read once, verified, and the parts are copied out.

The lookup table built from `.metadata` (where each item is, its chunk checked) is kept per
process for the last few `.metadata` contents, keyed by their bytes: a later load of the same
bytes (the same version again, or one whose metadata repeats; an in-job restart) skips the
checks, and from the third load on decodes only the part of the Metadata a caller could change.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import logging
import os
import pickle
import threading
import uuid
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ml_flashpoint_nemo.core.format import FILES_KEY, CommitRecord, IndexEntry
from ml_flashpoint_nemo.core.gc_pause import without_gc
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import OpenObject, open_object, read_object
from ml_flashpoint_nemo.core.remote_objects import ensure_local
from ml_flashpoint_nemo.core.values import dtype_name
from ml_flashpoint_nemo.core.version_files import read_checked_file
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.dcp.metadata_file import checked_chunks, decode_metadata, unpickle_metadata
from ml_flashpoint_nemo.dcp.storage_info import (
    DCP_METADATA_NAME,
    CheckpointIdCheck,
    item_location,
    step_of_checkpoint_id,
)
from ml_flashpoint_nemo.errors import CorruptCheckpointError, VersionNotFoundError

logger = logging.getLogger(__name__)

# object name, record key, and the checked chunk's size and dtype name as its record must hold them (None: bytes)
_Location = tuple[str, str, tuple[int, ...] | None, str | None]
_Locations = dict[tuple[str, Any], _Location]  # keyed by (fqn, offset), what DCP's MetadataIndex compares



@dataclasses.dataclass(frozen=True)
class _Decoded:
    """What one `.metadata` content decoded to, kept for later loads of the same bytes.

    rest is the Metadata without storage_data, pickled again: unpickling it gives a caller a Metadata
    of its own, and storage_data (frozen MetadataIndex keys, tuples of str) needs only a shallow copy.
    It is filled on the second load of the same bytes, so a process that loads once pays nothing for it.
    """

    encoded: bytes
    locations: _Locations
    rest: bytes | None = None
    storage_data: dict[MetadataIndex, Any] | None = None

    def metadata(self) -> Metadata:
        assert self.rest is not None and self.storage_data is not None
        metadata: Metadata = unpickle_metadata(self.rest, None)
        metadata.storage_data = dict(self.storage_data)
        return metadata


# The decoded `.metadata` contents last read in this process: (size, CRC32C) of the bytes, as their commit
# record gives them -> what they decoded to. A hit needs the same bytes, compared in full (a CRC is easily
# forged). Entries are never changed (an entry is replaced); a load gets its own Metadata, and shares the
# lookup table (read only) and storage_data's frozen keys and str values.
_TABLES: OrderedDict[tuple[Any, Any], _Decoded] = OrderedDict()
_TABLES_KEPT = 4
_TABLES_LOCK = threading.Lock()


class MemoryStorageReader(StorageReader):
    """Reads DCP checkpoints saved by MemoryStorageWriter; checkpoint_id=<base_dir>/step-<N>.

    Without a checkpoint_id the newest committed version is read.
    """

    def __init__(self, base_dir: str | os.PathLike[str], *, threads: int | None = None) -> None:
        super().__init__()
        self.layout = CheckpointLayout(base_dir)
        self.threads = threads
        self.step: int | None = None
        self.load_id = uuid.uuid4().hex
        self._commit: CommitRecord | None = None
        # (fqn, offset), what DCP's MetadataIndex compares -> (object name, record key, checked chunk size and dtype)
        self._locations: _Locations = {}
        self._decoded: tuple[Metadata, _Locations] | None = None  # what read_metadata returned last, and its table

    validate_checkpoint_id = CheckpointIdCheck()  # agrees with reset(): see step_of_checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.load_id = uuid.uuid4().hex
        self._commit = None
        self._decoded = None
        if checkpoint_id is not None:
            self.step = step_of_checkpoint_id(self.layout, checkpoint_id)
        elif self.step is None:
            steps = committed_steps(self.layout)
            if not steps:
                raise VersionNotFoundError(f"no committed version in {self.layout.base_dir}")
            self.step = steps[-1]

    def _current_step(self) -> int:
        """The step to read: the checkpoint_id's, else the newest committed one (reset() picks it or raises)."""
        if self.step is None:
            self.reset()
        assert self.step is not None
        return self.step

    def _commit_record(self) -> CommitRecord:
        step = self._current_step()
        if self._commit is None:
            self._commit = read_commit(self.layout, step)
            if self._commit.metadata.get("kind") != "dcp":
                raise CorruptCheckpointError(
                    f"version {self.step} in {self.layout.base_dir} was not saved through DCP; "
                    "load it with ml_flashpoint_nemo.core.load_version"
                )
        return self._commit

    @without_gc  # unpickling ~1,500 objects per 500 tensors would often set off a full collection here
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        commit = self._commit_record()
        encoded = read_checked_file(self.layout, commit, DCP_METADATA_NAME)
        step = self._current_step()  # the commit record's
        described = commit.metadata[FILES_KEY][DCP_METADATA_NAME]  # read_checked_file checked the bytes against it
        key = (described["nbytes"], described["crc32c"])
        with _TABLES_LOCK:
            cached = _TABLES.get(key)
            if cached is not None:
                _TABLES.move_to_end(key)
        if cached is not None and cached.encoded == encoded:
            if cached.rest is not None:
                metadata = cached.metadata()
            else:  # the second load of these bytes: keep the parts (pickled before anyone else holds metadata)
                metadata = decode_metadata(encoded, step)
                rest = _pickled_without_storage_data(metadata)
                if rest is not None:
                    self._keep(key, dataclasses.replace(cached, storage_data=dict(metadata.storage_data), rest=rest))
            locations = cached.locations
        else:  # verified against the commit record first; the table is built before anyone else holds metadata
            metadata = decode_metadata(encoded, step)
            locations = self._checked_locations(metadata)
            self._keep(key, _Decoded(encoded, locations))
        self._decoded = (metadata, locations)
        # not in the file (it changes every save): rebuilt from the path and the commit record
        metadata.storage_meta = StorageMeta(checkpoint_id=os.fspath(self.layout.version_dir(step)),
                                            save_id=commit.metadata.get("save_id", ""), load_id=self.load_id)
        return metadata

    @staticmethod
    def _keep(key: tuple[Any, Any], decoded: _Decoded) -> None:
        with _TABLES_LOCK:
            _TABLES[key] = decoded
            _TABLES.move_to_end(key)
            while len(_TABLES) > _TABLES_KEPT:
                _TABLES.popitem(last=False)

    @without_gc
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        decoded = self._decoded
        if decoded is not None and decoded[0] is metadata:  # what read_metadata returned: its table is built
            self._locations = decoded[1]
        else:
            self._locations = self._checked_locations(metadata)
        self._commit_record()

    def _checked_locations(self, metadata: Metadata) -> _Locations:
        """Where each item of metadata is stored, after checking its storage data and chunks."""
        storage_data = metadata.storage_data  # a dict: decode_metadata checked it
        if not storage_data and metadata.state_dict_metadata:
            # An empty state saves an empty .metadata and loads (as with FileSystemWriter); items without storage do not.
            raise CorruptCheckpointError(
                f"the DCP metadata of version {self.step} lists {len(metadata.state_dict_metadata)} items but no "
                "storage data for any of them; load another version, or the durable checkpoint"
            )
        # Keyed by (fqn, offset), what MetadataIndex compares: tuple hashing and equality run in C,
        # MetadataIndex's dataclass __hash__/__eq__ in Python (two calls per item otherwise).
        step = self.step
        chunks = checked_chunks(metadata, step)
        locations: _Locations = {}
        no_tensor = (None, None)
        for index, value in storage_data.items():
            at = (index.fqn, index.offset)
            name, key = item_location(value, index, step)
            locations[at] = (name, key, *chunks.get(at, no_tensor))
        return locations

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @without_gc
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "torch.futures.Future[None]":
        """One pass over the items checks each and sorts it into its object's reads; then each object is read.

        The direct path needs one item per stored chunk asking for all of it, into a destination
        of its dtype (read_object then checks the shape and reads in place, verifying the CRC).
        Everything else (resharding, dtype conversion, a chunk asked for twice) reads the chunk
        once, verified, and copies the parts out. Nothing is read before every item is checked.
        """
        commit = self._commit_record()
        location_of = self._locations.get  # ~500 items: every lookup and check here runs per item
        byte_io = LoadItemType.BYTE_IO
        resolve = planner.resolve_tensor
        with contextlib.ExitStack() as opened:
            objects: dict[str, _ObjectReads] = {}
            for item in plan.items:
                index = item.storage_index
                location = location_of((index.fqn, index.offset))
                if location is None:
                    raise CorruptCheckpointError(
                        f"{index.fqn} (offset {list(index.offset or [])}) has no storage data in version {self.step}"
                    )
                name, key, chunk, dtype = location
                reads = objects.get(name)
                if reads is None:
                    reads = objects[name] = self._open(opened, commit, name)
                entry = reads.entries.get(key)
                if entry is None:
                    raise CorruptCheckpointError(f"record {key!r} is missing from {reads.obj.path}")
                if item.type is byte_io:
                    reads.as_bytes.setdefault(key, []).append(item)
                    continue
                # The common request, a whole stored chunk, is inside it by definition; any other is checked.
                whole = item.lengths == chunk and not any(item.storage_offsets)
                if not whole:
                    self._check_request(item, chunk)
                if chunk != entry.shape or dtype != entry.dtype:  # the record holds the chunk the metadata gives
                    self._check_record(item, entry, chunk, dtype, reads.obj.path)
                copied = reads.copied
                pieces = copied.get(key)
                if pieces is not None:
                    pieces.append((item, None))
                    continue
                earlier = reads.direct.pop(key, None)
                if earlier is not None:  # the chunk is asked for twice: both go through a copy
                    copied[key] = [earlier, (item, None)]
                    continue
                if whole:
                    target = resolve(item)
                    if target.requires_grad:  # written in place: no autograd history (as _destination)
                        target = target.detach()
                    if dtype_name(target.dtype) == entry.dtype:
                        reads.direct[key] = (item, target)
                    else:
                        copied[key] = [(item, target)]
                else:
                    copied[key] = [(item, None)]
            for reads in objects.values():
                self._read_items(reads, planner)
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def _open(self, opened: contextlib.ExitStack, commit: CommitRecord, name: str) -> "_ObjectReads":
        record = next((o for o in commit.objects if o.name == name), None)
        if record is None:
            raise CorruptCheckpointError(f"object {name} is not listed in the commit record of step {self.step}")
        path = self.layout.object_path(commit.step, name)
        ensure_local(self.layout.base_dir, commit.step, record)  # another rank's object: checked, or fetched
        return _ObjectReads(opened.enter_context(open_object(str(path), record)))

    def _read_items(self, reads: "_ObjectReads", planner: LoadPlanner) -> None:
        """Read one object's items, sorted by read_data: whole chunks in place, parts through a copy."""
        obj, direct, copied, as_bytes = reads.obj, reads.direct, reads.copied, reads.as_bytes
        loaded = read_object(obj, into={key: target for key, (_, target) in direct.items()},
                             keys=[*copied, *as_bytes], threads=self.threads)
        for item, target in direct.values():
            planner.commit_tensor(item, target)
        for key, pieces in copied.items():
            stored = loaded[key]
            if not isinstance(stored, torch.Tensor):
                raise CorruptCheckpointError(f"record {key!r} in {obj.path} holds bytes where the DCP metadata has a tensor")
            for item, resolved in pieces:
                source = stored
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    source = source.narrow(dim, offset, length)
                target = resolved if resolved is not None else _destination(planner, item)
                if target.shape != source.shape:
                    raise CorruptCheckpointError(
                        f"{item.dest_index.fqn}: the load plan asks for {list(source.shape)} elements of the stored "
                        f"chunk but the destination holds {list(target.shape)}"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)
        for key, items in as_bytes.items():
            data = loaded[key]
            if not isinstance(data, bytes):
                raise CorruptCheckpointError(f"record {key!r} in {obj.path} holds a tensor where the DCP metadata has bytes")
            for item in items:
                planner.load_bytes(item, io.BytesIO(data))

    def _check_request(self, item: ReadItem, chunk: tuple[int, ...] | None) -> None:
        """The plan asks for a part inside the stored chunk the metadata describes (checked before any read)."""
        index = item.storage_index
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if chunk is None or len(offsets) != len(chunk) or len(lengths) != len(chunk) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, chunk)):
            raise CorruptCheckpointError(
                f"{item.dest_index.fqn}: the load plan asks for {list(lengths)} elements at {list(offsets)} of the "
                f"stored chunk {index.fqn} at {list(index.offset or [])}, which holds "
                f"{list(chunk) if chunk is not None else 'no tensor'} in version {self.step}: the request cannot be "
                "satisfied from this version"
            )

    def _check_record(self, item: ReadItem, entry: IndexEntry, chunk: tuple[int, ...] | None, dtype: str | None,
                      path: str) -> None:
        """The stored record has the shape and dtype the metadata gives its chunk (else its bytes would be converted)."""
        if chunk != tuple(entry.shape) or dtype != entry.dtype:
            index = item.storage_index
            raise CorruptCheckpointError(
                f"{index.fqn} (offset {list(index.offset or [])}, record {entry.key!r}): the record in {path} holds "
                f"{list(entry.shape)} elements but the DCP metadata of version {self.step} says {list(chunk or [])} "
                f"({entry.dtype} stored, {dtype} in the metadata). Load another version, or the durable checkpoint."
            )


class _ObjectReads:
    """What read_data reads from one open object, by record key."""

    __slots__ = ("obj", "entries", "direct", "copied", "as_bytes")

    def __init__(self, obj: OpenObject) -> None:
        self.obj = obj
        self.entries = obj.by_key
        self.direct: dict[str, tuple[ReadItem, torch.Tensor]] = {}  # record key -> (its one item, its destination)
        self.copied: dict[str, list[tuple[ReadItem, torch.Tensor | None]]] = {}  # items, destinations resolved or not
        self.as_bytes: dict[str, list[ReadItem]] = {}


def _pickled_without_storage_data(metadata: Metadata) -> bytes | None:
    """metadata less storage_data, pickled (a shallow copy keeps any attribute a Metadata gained beyond its
    fields); None when it does not pickle here, and the load goes on uncached."""
    rest = copy.copy(metadata)
    rest.storage_data = None
    try:
        return pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - only the cache is lost: this load decoded the file itself
        logger.debug("the decoded DCP metadata does not pickle again; repeated loads decode the file", exc_info=True)
        return None


def _destination(planner: LoadPlanner, item: ReadItem) -> torch.Tensor:
    """The tensor the planner resolves for item, without autograd history (it is written in place)."""
    target = planner.resolve_tensor(item)
    return target.detach() if target.requires_grad else target


