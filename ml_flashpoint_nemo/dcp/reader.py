"""MemoryStorageReader: a DCP StorageReader that loads committed RAM versions.

Records are read straight into the tensors DCP resolves for them (one copy, verified
by CRC32C on the way). When the load plan asks for part of a stored chunk
(resharding), the chunk is read once, verified, and the parts are copied out.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import uuid
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import CommitRecord, IndexEntry
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import open_object, read_object
from ml_flashpoint_nemo.core.values import dtype_name
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.dcp.storage_info import DCP_METADATA_NAME, FlashpointStorageInfo, step_of_checkpoint_id
from ml_flashpoint_nemo.errors import ChecksumError, CorruptCheckpointError, VersionNotFoundError

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
        self._storage_data: dict[Any, FlashpointStorageInfo] = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.basename(os.fspath(checkpoint_id)).startswith("step-")

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

    def _commit_record(self) -> CommitRecord:
        if self.step is None:
            self.reset()
        if self._commit is None:
            self._commit = read_commit(self.layout, self.step)
            if self._commit.metadata.get("kind") != "dcp":
                raise CorruptCheckpointError(
                    f"version {self.step} in {self.layout.base_dir} was not saved through DCP; "
                    "load it with ml_flashpoint_nemo.core.load_version"
                )
        return self._commit

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        commit = self._commit_record()
        expected = commit.metadata["dcp_metadata"]
        path = self.layout.version_dir(commit.step) / expected["name"]
        try:
            encoded = path.read_bytes()
        except FileNotFoundError:
            raise CorruptCheckpointError(f"DCP metadata {path} of a committed version is missing") from None
        if len(encoded) != expected["nbytes"] or _core.crc32c(encoded) != expected["crc32c"]:
            raise ChecksumError(f"DCP metadata {path} does not match its commit record", path=str(path))
        metadata: Metadata = pickle.loads(encoded)  # verified against the commit record first
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage_data = dict(metadata.storage_data or {})
        if not self._storage_data:
            raise CorruptCheckpointError(f"DCP metadata of version {self.step} has no storage data")
        self._commit_record()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "torch.futures.Future[None]":
        commit = self._commit_record()
        records = {o.name: o for o in commit.objects}
        by_object: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_object[self._storage_data[item.storage_index].object.name].append(item)
        for name, items in by_object.items():
            if name not in records:
                raise CorruptCheckpointError(f"object {name} is not listed in the commit record of step {self.step}")
            with open_object(str(self.layout.object_path(commit.step, name)), records[name]) as obj:
                self._read_items(obj, items, planner)
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def _read_items(self, obj: Any, items: list[ReadItem], planner: LoadPlanner) -> None:
        entries = {e.key: e for e in obj.entries}
        items_by_key: dict[str, list[ReadItem]] = defaultdict(list)
        for item in items:
            items_by_key[self._storage_data[item.storage_index].key].append(item)
        direct: dict[str, torch.Tensor] = {}  # whole stored chunk -> its destination, read in place
        direct_items: list[tuple[ReadItem, torch.Tensor]] = []
        partial_keys: list[str] = []
        byte_keys: list[str] = []
        for key, key_items in items_by_key.items():
            entry = entries.get(key)
            if entry is None:
                raise CorruptCheckpointError(f"record {key!r} is missing from {obj.path}")
            if key_items[0].type == LoadItemType.BYTE_IO:
                byte_keys.append(key)
                continue
            target = planner.resolve_tensor(key_items[0]).detach() if len(key_items) == 1 else None
            if target is not None and _covers_whole_chunk(key_items[0], entry) and _same_dtype(target, entry):
                direct[key] = target
                direct_items.append((key_items[0], target))
            else:
                partial_keys.append(key)
        loaded = read_object(obj, into=direct, keys=partial_keys + byte_keys, threads=self.threads)
        for item, target in direct_items:
            planner.commit_tensor(item, target)
        for key in partial_keys:
            stored = loaded[key]
            for item in items_by_key[key]:
                source = stored
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    source = source.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.shape != source.shape:
                    raise CorruptCheckpointError(
                        f"{item.dest_index.fqn}: the load plan asks for {list(source.shape)} elements of the stored "
                        f"chunk but the destination holds {list(target.shape)}"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)
        for key in byte_keys:
            for item in items_by_key[key]:
                planner.load_bytes(item, io.BytesIO(loaded[key]))


def _same_dtype(target: torch.Tensor, entry: IndexEntry) -> bool:
    return dtype_name(target.dtype) == entry.dtype


def _covers_whole_chunk(item: ReadItem, entry: IndexEntry) -> bool:
    return all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == tuple(entry.shape)
