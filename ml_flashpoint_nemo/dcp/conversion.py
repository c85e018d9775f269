"""Converting a committed RAM version into torch DCP write items: the one mapping both `flashpoint export` and
the durable drain use.

- DCP-kind versions (MemoryStorageWriter, the Megatron strategy): the same keys (fully qualified names),
  global shapes, dtypes and chunks as the original DCP metadata; bytes items are copied verbatim, never
  unpickled; the original planner data is kept.
- core-kind versions (CheckpointSaver, per-rank state dicts): one rank's state keeps its plain keys; with
  several ranks every key becomes "rank{R}/{key}". Tensors are stored whole.

Each plan says, per RAM object, which records to read (Read) and, per DCP item, what to write (WriteItem);
make_planner turns them into a planner that FileSystemWriter (or dcp.save) drives.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:  # torch is imported when a plan is made, not with the module (the CLI starts without it)
    import torch
    from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

    from ml_flashpoint_nemo.core.format import CommitRecord
    from ml_flashpoint_nemo.core.layout import CheckpointLayout

    # (reads per RAM object, DCP write items, planner data, the version's DCP metadata, whether bytes items are
    # already serialized); a core-kind version has no DCP metadata
    DcpVersionPlan = tuple[dict[str, list["Read"]], list[WriteItem], dict, Metadata, bool]
    CoreVersionPlan = tuple[dict[str, list["Read"]], list[WriteItem], dict, None, bool]


@dataclass
class Read:
    """One record to read: into `tensor` (a tensor record) or as bytes (tensor None)."""

    key: str  # record key in the object
    fqn: str  # DCP fully qualified name in the export
    offset: tuple[int, ...] | None  # chunk offsets (None for bytes)
    tensor: torch.Tensor | None = None
    nbytes: int = 0


def offset_key(offset: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if offset is None else tuple(int(x) for x in offset)


def plan_dcp_version(layout: CheckpointLayout, commit: CommitRecord) -> DcpVersionPlan:
    """Reads per object, write items, planner data and the original DCP metadata of a DCP-kind version."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from ml_flashpoint_nemo.core.version_files import read_checked_file
    from ml_flashpoint_nemo.dcp.metadata_file import checked_chunks, decode_metadata
    from ml_flashpoint_nemo.dcp.storage_info import DCP_METADATA_NAME, item_location
    from ml_flashpoint_nemo.errors import CorruptCheckpointError

    # verified against the commit record before it is unpickled (as MemoryStorageReader does)
    metadata = decode_metadata(read_checked_file(layout, commit, DCP_METADATA_NAME), commit.step)
    checked_chunks(metadata, commit.step)  # every chunk a tensor torch can hold, the chunks tiling it: before any empty()
    storage = {(index.fqn, offset_key(index.offset)): item_location(value, index, commit.step)
               for index, value in (metadata.storage_data or {}).items()}
    per_object: dict[str, list[Read]] = {}
    items = []
    for fqn, stored in metadata.state_dict_metadata.items():
        if isinstance(stored, BytesStorageMetadata):
            location = storage.get((fqn, None))
            if location is None:
                raise CorruptCheckpointError(f"{fqn} has no storage data in version {commit.step}")
            name, key = location
            per_object.setdefault(name, []).append(Read(key, fqn, None))
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            continue
        dtype = stored.properties.dtype
        whole = len(stored.chunks) == 1 and not any(stored.chunks[0].offsets) and \
            tuple(stored.chunks[0].sizes) == tuple(stored.size)
        for chunk in stored.chunks:
            offset = offset_key(chunk.offsets)
            tensor = torch.empty(tuple(chunk.sizes), dtype=dtype)
            read = Read("", fqn, offset, tensor, tensor.numel() * tensor.element_size())
            location = storage.get((fqn, offset))
            if location is not None:
                name, read.key = location
                per_object.setdefault(name, []).append(read)
            elif tensor.numel():
                raise CorruptCheckpointError(f"{fqn} (chunk at {list(offset or ())}) has no storage data in "
                                             f"version {commit.step}")
            else:
                per_object.setdefault("", []).append(read)  # nothing to read: an empty chunk
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offset or ())),
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                    properties=stored.properties,
                    size=torch.Size(stored.size),
                ),
            ))
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else \
        {fqn: (fqn,) for fqn in metadata.state_dict_metadata}
    return per_object, items, planner_data, metadata, True


def plan_core_version(layout: CheckpointLayout, commit: CommitRecord) -> CoreVersionPlan:
    """Reads per object and write items of a core-kind version (per-rank state dicts)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from ml_flashpoint_nemo.core.loader import open_object
    from ml_flashpoint_nemo.core.values import dtype_from_name

    ranks = sorted({o.rank for o in commit.objects})
    per_object: dict[str, list[Read]] = {}
    items = []
    seen: set[str] = set()
    for record in commit.objects:
        prefix = "" if len(ranks) == 1 else f"rank{record.rank}/"
        with open_object(str(layout.object_path(commit.step, record.name)), record) as obj:  # verified index
            for entry in obj.entries:
                fqn = prefix + entry.key
                if fqn in seen:
                    from ml_flashpoint_nemo.errors import CorruptCheckpointError

                    raise CorruptCheckpointError(f"key {entry.key!r} of rank {record.rank} is stored twice")
                seen.add(fqn)
                if entry.kind == "bytes":
                    per_object.setdefault(record.name, []).append(Read(entry.key, fqn, None, nbytes=entry.nbytes))
                    items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                    continue
                tensor = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
                offset = (0,) * len(entry.shape)
                per_object.setdefault(record.name, []).append(Read(entry.key, fqn, offset, tensor, entry.nbytes))
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offset)),
                    type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(entry.shape)),
                        properties=TensorProperties.create_from_tensor(tensor),
                        size=torch.Size(entry.shape),
                    ),
                ))
    return per_object, items, {fqn: (fqn,) for fqn in seen}, None, False


def fill_sizes(layout: CheckpointLayout, commit: CommitRecord, per_object: dict[str, list[Read]]) -> None:
    """Sizes of the bytes records to read, from their objects' indexes (checked against the commit record)."""
    from ml_flashpoint_nemo.core.loader import open_object

    records = {o.name: o for o in commit.objects}
    for name, reads in per_object.items():
        if name not in records or all(r.tensor is not None for r in reads):
            continue
        with open_object(str(layout.object_path(commit.step, name)), records[name]) as obj:
            sizes = {e.key: e.nbytes for e in obj.entries}
        for r in reads:
            if r.tensor is None:
                r.nbytes = sizes.get(r.key, 0)



def make_planner(items: list[WriteItem], resolve: Callable[[WriteItem], torch.Tensor | bytes], planner_data: dict,
                 original: Metadata | None, on_write: Callable[[int], None]) -> SavePlanner:
    """A DCP save planner for exactly `items`; resolve(write_item) gives each item's tensor or serialized bytes.

    The data may be read ahead (export) or on demand, one item at a time (the durable drain).
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    class ConversionPlanner(DefaultSavePlanner):
        """Plans exactly the given items (chunks as stored) and hands out their data from resolve."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None,
                           is_coordinator: bool = False) -> None:
            self.state_dict = {}
            self.mappings = planner_data
            self.is_coordinator = is_coordinator

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(list(items), planner_data=planner_data)
            return self.plan

        def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
            plans, metadata = super().create_global_plan(all_plans)
            if original is not None:  # attributes a framework added to DCP's metadata (e.g. Megatron's)
                known = {f.name for f in dataclasses.fields(Metadata)}
                for attr, value in vars(original).items():
                    if attr not in known:
                        setattr(metadata, attr, value)
            self.metadata = metadata
            return plans, metadata

        def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
            value = resolve(write_item)
            if isinstance(value, bytes):  # what resolve gives for a BYTE_IO item, and for no other
                on_write(len(value))
                return io.BytesIO(value)
            on_write(value.numel() * value.element_size())
            return value

    return ConversionPlanner()
