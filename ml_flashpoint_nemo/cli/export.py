"""`flashpoint export BASE STEP DEST`: write a RAM version as a standard torch DCP checkpoint directory.

The result loads with ``dcp.load(state_dict, storage_reader=FileSystemReader(DEST))`` (no process
group needed), bit-exact. Every byte is read through the flashpoint loader, so it is verified
against its CRC32C before anything is written; a failure leaves no DEST behind.

Mapping:
- DCP-kind versions (saved through MemoryStorageWriter or the Megatron strategy): the same keys
  (fully qualified names), global shapes, dtypes and chunks (sharding offsets) as the original
  DCP metadata; bytes items (pickled Python objects) are copied verbatim, never unpickled. The
  original planner data (how nested state dicts were flattened) is kept. Other version files
  the commit record lists besides `.metadata` (Megatron's common.pt) are copied verbatim, except
  metadata.json, which names the flashpoint Megatron backend and would misdirect a Megatron load.
- core-kind versions (CheckpointSaver, per-rank state dicts): a version holding one rank's state
  keeps its plain keys; with several ranks every key becomes "rank{R}/{key}". Tensors are stored
  whole; bytes records come back as Python `bytes` values.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import shutil
import signal
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ml_flashpoint_nemo.cli.common import (
    EXIT_OK,
    CliError,
    human_bytes,
    open_base,
    parse_step,
)
from ml_flashpoint_nemo.core.layout import DCP_METADATA_NAME, MEGATRON_CONFIG_NAME
from ml_flashpoint_nemo.core.versions import fsync_directory

_READ_BATCH_BYTES = 64 << 20  # progress granularity: records are read in batches of about this size
_SKIPPED_VERSION_FILES = {DCP_METADATA_NAME, MEGATRON_CONFIG_NAME}


class Progress:
    """A one-line text progress bar on stderr (no dependency); silent when disabled."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._drawn = -1

    def advance(self, nbytes: int, *, force: bool = False) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        self._drawn = self.done
        fraction = min(self.done / self.total, 1.0)
        width = 30
        bar = "#" * int(fraction * width)
        rate = self.done / max(now - self.start, 1e-9)
        sys.stderr.write(f"\r{self.label} [{bar:<{width}}] {fraction * 100:5.1f}% "
                         f"{human_bytes(self.done)}/{human_bytes(self.total)} {human_bytes(int(rate))}/s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self._drawn != self.done:
                self.advance(0, force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


@dataclass
class _Read:
    """One record to read: into `tensor` (a tensor record) or as bytes (tensor None)."""

    key: str  # record key in the object
    fqn: str  # DCP fully qualified name in the export
    offset: tuple[int, ...] | None  # chunk offsets (None for bytes)
    tensor: Any = None
    nbytes: int = 0


def _offset_key(offset: Any) -> tuple[int, ...] | None:
    return None if offset is None else tuple(int(x) for x in offset)


def _plan_dcp_version(layout: Any, commit: Any) -> tuple[dict[str, list[_Read]], list[Any], dict, Any, bool]:
    """Reads per object, write items, planner data and the original DCP metadata of a DCP-kind version."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from ml_flashpoint_nemo.core.version_files import read_checked_file
    from ml_flashpoint_nemo.dcp.metadata_file import decode_metadata
    from ml_flashpoint_nemo.dcp.storage_info import item_location
    from ml_flashpoint_nemo.errors import CorruptCheckpointError

    # verified against the commit record before it is unpickled (as MemoryStorageReader does)
    metadata = decode_metadata(read_checked_file(layout, commit, DCP_METADATA_NAME), commit.step)
    storage = {(index.fqn, _offset_key(index.offset)): item_location(value, index, commit.step)
               for index, value in (metadata.storage_data or {}).items()}
    per_object: dict[str, list[_Read]] = {}
    items = []
    for fqn, stored in metadata.state_dict_metadata.items():
        if isinstance(stored, BytesStorageMetadata):
            location = storage.get((fqn, None))
            if location is None:
                raise CorruptCheckpointError(f"{fqn} has no storage data in version {commit.step}")
            name, key = location
            per_object.setdefault(name, []).append(_Read(key, fqn, None))
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
            continue
        dtype = stored.properties.dtype
        whole = len(stored.chunks) == 1 and not any(stored.chunks[0].offsets) and \
            tuple(stored.chunks[0].sizes) == tuple(stored.size)
        for chunk in stored.chunks:
            offset = _offset_key(chunk.offsets)
            tensor = torch.empty(tuple(chunk.sizes), dtype=dtype)
            read = _Read("", fqn, offset, tensor, tensor.numel() * tensor.element_size())
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


def _plan_core_version(layout: Any, commit: Any) -> tuple[dict[str, list[_Read]], list[Any], dict, Any, bool]:
    """Reads per object and write items of a core-kind version (per-rank state dicts)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from ml_flashpoint_nemo.core.loader import open_object
    from ml_flashpoint_nemo.core.values import dtype_from_name

    ranks = sorted({o.rank for o in commit.objects})
    per_object: dict[str, list[_Read]] = {}
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
                    per_object.setdefault(record.name, []).append(_Read(entry.key, fqn, None, nbytes=entry.nbytes))
                    items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                    continue
                tensor = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
                offset = (0,) * len(entry.shape)
                per_object.setdefault(record.name, []).append(_Read(entry.key, fqn, offset, tensor, entry.nbytes))
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


def _fill_sizes(layout: Any, commit: Any, per_object: dict[str, list[_Read]]) -> None:
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


def _read_all(layout: Any, commit: Any, per_object: dict[str, list[_Read]], raw_bytes: bool,
              progress: Progress, threads: int | None) -> dict[tuple[str, Any], Any]:
    """Every record, read and verified: {(fqn, offset): tensor | serialized bytes}."""
    import torch

    from ml_flashpoint_nemo.core.loader import open_object, read_object
    from ml_flashpoint_nemo.errors import CorruptCheckpointError

    records = {o.name: o for o in commit.objects}
    data: dict[tuple[str, Any], Any] = {}
    for name, reads in per_object.items():
        if name == "":
            data.update({(r.fqn, r.offset): r.tensor for r in reads})
            continue
        if name not in records:
            raise CorruptCheckpointError(f"object {name} is not listed in the commit record of step {commit.step}")
        with open_object(str(layout.object_path(commit.step, name)), records[name]) as obj:
            batch: list[_Read] = []
            batch_bytes = 0
            for i, read in enumerate(reads):
                batch.append(read)
                batch_bytes += read.nbytes
                if batch_bytes < _READ_BATCH_BYTES and i + 1 < len(reads):
                    continue
                into = {r.key: r.tensor for r in batch if r.tensor is not None}
                keys = [r.key for r in batch if r.tensor is None]
                loaded = read_object(obj, into=into, keys=keys, threads=threads)
                for r in batch:
                    if r.tensor is not None:
                        data[(r.fqn, r.offset)] = r.tensor
                    elif raw_bytes:  # a DCP bytes item: already torch.save'd by DCP, copied verbatim
                        data[(r.fqn, r.offset)] = bytes(loaded[r.key])
                    else:  # a core bytes record: stored as a Python bytes value
                        stream = io.BytesIO()
                        torch.save(bytes(loaded[r.key]), stream)
                        data[(r.fqn, r.offset)] = stream.getvalue()
                progress.advance(batch_bytes)
                batch, batch_bytes = [], 0
    return data


def _make_planner(items: list[Any], data: dict[tuple[str, Any], Any], planner_data: dict,
                  original: Any, on_write: Callable[[int], None]) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    class ExportPlanner(DefaultSavePlanner):
        """Plans exactly the given items (chunks as stored) and hands out already-read data."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
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

        def resolve_data(self, write_item: Any) -> Any:
            value = data[(write_item.index.fqn, _offset_key(write_item.index.offset))]
            if write_item.type == WriteItemType.BYTE_IO:
                on_write(len(value))
                return io.BytesIO(value)
            on_write(value.numel() * value.element_size())
            return value

    return ExportPlanner()


def export_version(base: str, step: int, dest_dir: Path, *, threads: int | None, progress_enabled: bool) -> dict:
    """Write version `step` of base into dest_dir (an empty directory); returns a summary."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.core.version_files import read_checked_file
    from ml_flashpoint_nemo.core.versions import read_commit

    layout = CheckpointLayout(base)
    commit = read_commit(layout, step)
    is_dcp = commit.metadata.get("kind") == "dcp"
    plan = _plan_dcp_version if is_dcp else _plan_core_version
    per_object, items, planner_data, original, raw_bytes = plan(layout, commit)
    _fill_sizes(layout, commit, per_object)
    total = sum(r.nbytes for reads in per_object.values() for r in reads)
    progress = Progress(2 * total, f"export step {step}", progress_enabled)
    try:
        data = _read_all(layout, commit, per_object, raw_bytes, progress, threads)
        planner = _make_planner(items, data, planner_data, original,
                                lambda n: progress.advance(n if n else 0))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            warnings.filterwarnings("ignore", message=".*no_dist.*")
            dcp.save({}, storage_writer=FileSystemWriter(str(dest_dir)), planner=planner, no_dist=True)
    finally:
        progress.close()
    copied = []
    if is_dcp:
        for name in sorted(commit.metadata.get("files") or {}):
            if name in _SKIPPED_VERSION_FILES:
                continue
            (dest_dir / name).write_bytes(read_checked_file(layout, commit, name))
            copied.append(name)
    tensors = sum(1 for i in items if i.tensor_data is not None)
    return {"step": step, "kind": "dcp" if is_dcp else "core", "items": len(items),
            "tensor_chunks": tensors, "bytes_items": len(items) - tensors,
            "keys": len({i.index.fqn for i in items}), "nbytes": total, "copied_files": copied}


def _prepare_dest(dest: Path, layout: Any, force: bool) -> bool:
    """Check DEST can be written; returns whether something is there to replace."""
    if not dest.parent.is_dir():
        raise CliError(f"the parent of DEST, {dest.parent}, is not an existing directory")
    base = os.path.realpath(layout.base_dir)
    real = os.path.realpath(dest)
    if real == base or real.startswith(base.rstrip("/") + "/"):
        raise CliError(f"DEST {dest} lies inside the base directory {layout.base_dir}; export elsewhere")
    if not (dest.exists() or dest.is_symlink()):
        return False
    if dest.is_dir() and not dest.is_symlink() and not any(os.scandir(dest)):
        return True  # an empty directory: replaced by the rename
    if not force:
        raise CliError(f"DEST {dest} exists and is not empty; pass --force to replace it")
    return True


def run(args: argparse.Namespace) -> int:
    from ml_flashpoint_nemo.core.versions import committed_steps

    layout = open_base(args.base)
    step = parse_step(args.step)
    committed = committed_steps(layout)
    if step not in committed:
        state = "is not committed" if step in layout.version_steps() else "does not exist"
        raise CliError(f"version {step} in {layout.base_dir} {state}; committed steps: {committed}")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")
    dest = Path(args.dest).absolute()
    replace = _prepare_dest(dest, layout, args.force)
    temporary = dest.parent / f"{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    progress = args.progress or sys.stderr.isatty()
    try:  # SIGTERM unwinds, so the finally below removes the temporary directory
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (main() called from a thread): keep the handler as it is
        previous = None
    temporary.mkdir()
    try:
        summary = export_version(str(layout.base_dir), step, temporary, threads=args.threads,
                                 progress_enabled=progress)
        fsync_directory(temporary)
        if replace:
            _replace(temporary, dest)
        else:
            os.rename(temporary, dest)
        fsync_directory(dest.parent)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(temporary, ignore_errors=True)
    print(f"exported step {step} ({summary['kind']}: {summary['keys']} keys, {summary['tensor_chunks']} tensor "
          f"chunks, {summary['bytes_items']} bytes items, {human_bytes(summary['nbytes'])}) to {dest}"
          + (f"; copied {', '.join(summary['copied_files'])}" if summary["copied_files"] else ""))
    return EXIT_OK


def _replace(temporary: Path, dest: Path) -> None:
    """Put temporary in dest's place: an empty directory is replaced by the rename, anything else moved aside."""
    if dest.is_dir() and not dest.is_symlink() and not any(os.scandir(dest)):
        os.rename(temporary, dest)
        return
    aside = dest.parent / f"{dest.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dest, aside)
    try:
        os.rename(temporary, dest)
    except BaseException:
        os.rename(aside, dest)
        raise
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)

