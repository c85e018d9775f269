"""MemoryStorageReader: a DCP StorageReader that loads committed RAM versions.

Records are read straight into the tensors DCP resolves for them (one copy, verified
by CRC32C on the way). When the load plan asks for part of a stored chunk
(resharding), the chunk is read once, verified, and the parts are copied out.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ml_flashpoint_nemo.core.format import CommitRecord, IndexEntry
from ml_flashpoint_nemo.core.gc_pause import without_gc
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import OpenObject, open_object, read_object
from ml_flashpoint_nemo.core.values import dtype_name
from ml_flashpoint_nemo.core.version_files import read_checked_file
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.dcp.metadata_file import checked_chunk_sizes, decode_metadata
from ml_flashpoint_nemo.dcp.storage_info import (
    DCP_METADATA_NAME,
    CheckpointIdCheck,
    ItemLocation,
    item_location,
    step_of_checkpoint_id,
)
from ml_flashpoint_nemo.errors import CorruptCheckpointError, VersionNotFoundError

logger = logging.getLogger(__name__)


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
        self._storage_data: dict[tuple[str, Any], ItemLocation] = {}  # (fqn, offset) -> where it is
        self._chunk_sizes: dict[tuple[str, Any], tuple[int, ...]] = {}  # (fqn, offset) -> checked chunk size

    validate_checkpoint_id = CheckpointIdCheck()  # agrees with reset(): see step_of_checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.load_id = uuid.uuid4().hex
        self._commit = None
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
        encoded = read_checked_file(self.layout, self._commit_record(), DCP_METADATA_NAME)
        step = self._current_step()  # the commit record's
        metadata = decode_metadata(encoded, step)  # verified against the commit record first
        # not in the file (it changes every save): rebuilt from the path and the commit record
        metadata.storage_meta = StorageMeta(checkpoint_id=os.fspath(self.layout.version_dir(step)),
                                            save_id=self._commit_record().metadata.get("save_id", ""),
                                            load_id=self.load_id)
        return metadata

    @without_gc
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
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
        self._storage_data = {(index.fqn, index.offset): item_location(value, index, step)
                              for index, value in storage_data.items()}
        self._chunk_sizes = checked_chunk_sizes(metadata, step)
        self._commit_record()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @without_gc
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "torch.futures.Future[None]":
        commit = self._commit_record()
        records = {o.name: o for o in commit.objects}
        storage_data = self._storage_data
        by_object: dict[str, list[tuple[ReadItem, str]]] = {}
        for item in plan.items:
            index = item.storage_index
            location = storage_data.get((index.fqn, index.offset))
            if location is None:
                raise CorruptCheckpointError(
                    f"{index.fqn} (offset {list(index.offset or [])}) has no storage data in version {self.step}"
                )
            if item.type != LoadItemType.BYTE_IO:
                self._check_request(item)
            name, key = location
            keyed = by_object.get(name)
            if keyed is None:
                by_object[name] = [(item, key)]
            else:
                keyed.append((item, key))
        for name, keyed in by_object.items():
            if name not in records:
                raise CorruptCheckpointError(f"object {name} is not listed in the commit record of step {self.step}")
            with open_object(str(self.layout.object_path(commit.step, name)), records[name]) as obj:
                self._read_items(obj, keyed, planner)
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def _read_items(self, obj: OpenObject, keyed: list[tuple[ReadItem, str]], planner: LoadPlanner) -> None:
        """Read the items of one object: whole chunks straight into their destinations, parts through a copy.

        The direct path needs one item per stored chunk asking for all of it, into a destination
        of its dtype (read_object then checks the shape and reads in place, verifying the CRC).
        Everything else (resharding, dtype conversion) reads the chunk once, verified, and copies
        the parts out.
        """
        entries = {e.key: e for e in obj.entries}
        items_by_key: dict[str, list[ReadItem]] = {}
        for item, key in keyed:
            group = items_by_key.get(key)
            if group is None:
                items_by_key[key] = [item]
            else:
                group.append(item)
        direct: dict[str, torch.Tensor] = {}  # whole stored chunk -> its destination, read in place
        direct_items: list[tuple[ReadItem, torch.Tensor]] = []
        resolved: dict[int, torch.Tensor] = {}  # id(item) -> destination, for items resolved but read through a copy
        partial_keys: list[str] = []
        byte_keys: list[str] = []
        for key, key_items in items_by_key.items():
            entry = entries.get(key)
            if entry is None:
                raise CorruptCheckpointError(f"record {key!r} is missing from {obj.path}")
            first = key_items[0]
            if first.type == LoadItemType.BYTE_IO:
                byte_keys.append(key)
                continue
            self._check_record(first, entry, obj.path)  # one chunk per key: its items share the storage index
            if len(key_items) == 1 and _covers_whole_chunk(first, entry):
                target = _destination(planner, first)
                if _dtype_name(target.dtype) == entry.dtype:
                    direct[key] = target
                    direct_items.append((first, target))
                    continue
                resolved[id(first)] = target
            partial_keys.append(key)
        loaded = read_object(obj, into=direct, keys=partial_keys + byte_keys, threads=self.threads)
        for item, target in direct_items:
            planner.commit_tensor(item, target)
        for key in partial_keys:
            stored = loaded[key]
            if not isinstance(stored, torch.Tensor):
                raise CorruptCheckpointError(f"record {key!r} in {obj.path} holds bytes where the DCP metadata has a tensor")
            for item in items_by_key[key]:
                source = stored
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    source = source.narrow(dim, offset, length)
                pending = resolved.pop(id(item), None)
                target = pending if pending is not None else _destination(planner, item)
                if target.shape != source.shape:
                    raise CorruptCheckpointError(
                        f"{item.dest_index.fqn}: the load plan asks for {list(source.shape)} elements of the stored "
                        f"chunk but the destination holds {list(target.shape)}"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)
        for key in byte_keys:
            data = loaded[key]
            if not isinstance(data, bytes):
                raise CorruptCheckpointError(f"record {key!r} in {obj.path} holds a tensor where the DCP metadata has bytes")
            for item in items_by_key[key]:
                planner.load_bytes(item, io.BytesIO(data))


    def _check_request(self, item: ReadItem) -> None:
        """The plan asks for a part inside the stored chunk the metadata describes (checked before any read)."""
        index = item.storage_index
        chunk = self._chunk_sizes.get((index.fqn, index.offset))
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if chunk is None or len(offsets) != len(chunk) or len(lengths) != len(chunk) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, chunk)):
            raise CorruptCheckpointError(
                f"{item.dest_index.fqn}: the load plan asks for {list(lengths)} elements at {list(offsets)} of the "
                f"stored chunk {index.fqn} at {list(index.offset or [])}, which holds "
                f"{list(chunk) if chunk is not None else 'no tensor'} in version {self.step}: the request cannot be "
                "satisfied from this version"
            )

    def _check_record(self, item: ReadItem, entry: IndexEntry, path: str) -> None:
        """The stored record has the shape the metadata gives its chunk."""
        index = item.storage_index
        chunk = self._chunk_sizes.get((index.fqn, index.offset))
        if chunk != tuple(entry.shape):
            raise CorruptCheckpointError(
                f"{index.fqn} (offset {list(index.offset or [])}): the record in {path} holds {list(entry.shape)} "
                f"elements but the DCP metadata of version {self.step} says {list(chunk or [])}. Load another "
                "version, or the durable checkpoint."
            )

def _destination(planner: LoadPlanner, item: ReadItem) -> torch.Tensor:
    """The tensor the planner resolves for item, without autograd history (it is written in place)."""
    target = planner.resolve_tensor(item)
    return target.detach() if target.requires_grad else target


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    return dtype_name(dtype)


def _covers_whole_chunk(item: ReadItem, entry: IndexEntry) -> bool:
    return not any(item.storage_offsets) and tuple(item.lengths) == tuple(entry.shape)
