"""MemoryStorageWriter: a DCP StorageWriter (and AsyncStager) that saves into RAM versions.

Every rank writes the items of its plan as one object of version N; the coordinator's
finish() writes DCP's metadata and then the commit record, so a dcp.save that returns
has left a committed, loadable version. Older versions are retired at the start of the
next save, each rank recycling its own buffers, once the newer version is committed.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import uuid
from collections import Counter
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.core.gc_pause import without_gc
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.saver import CheckpointSaver
from ml_flashpoint_nemo.core.version_files import FILES_KEY, describe_bytes, describe_files
from ml_flashpoint_nemo.core.versions import retire_superseded, retire_version, write_commit, write_file_atomically
from ml_flashpoint_nemo.dcp.metadata_file import EarlyComparison, compare_early, encode_metadata
from ml_flashpoint_nemo.dcp.staging import StagingBuffers
from ml_flashpoint_nemo.dcp.storage_info import (
    DCP_METADATA_NAME,
    CheckpointIdCheck,
    RankWrite,
    record_key_of,
    step_of_checkpoint_id,
)
from ml_flashpoint_nemo.errors import BaseDirError, UnsupportedValueError, VersionExistsError

logger = logging.getLogger(__name__)


class MemoryStorageWriter(StorageWriter, AsyncStager):
    """Writes DCP checkpoints as flashpoint versions under base_dir (one object per rank).

    Use checkpoint_id=<base_dir>/step-<N>. `keep` committed versions are kept; the
    writer may be reused for every save of a job (its buffers are reused too). A save to
    a step already committed replaces it, unless overwrite=False (then it is refused).

    DCP's process executor runs write_data and finish in the same background process,
    so no result has to cross processes here and no Manager is needed; the Megatron
    strategy, whose worker and finalize run in different processes, uses one.
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        keep: int = 1,
        checksum: bool = True,
        threads: int | None = None,
        overwrite: bool = True,
    ) -> None:
        super().__init__()
        self.layout = CheckpointLayout(base_dir)
        self.overwrite = overwrite
        self.keep = keep
        self.checksum = checksum
        self.threads = threads
        self.step: int | None = None
        self.checkpoint_id: str | None = None
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = False
        self._saver: CheckpointSaver | None = None
        self._staging = StagingBuffers()
        self._early: EarlyComparison | None = None  # from write_data, for finish (see compare_early)

    # --- pickling (DCP's process executor sends the writer to another process) ---------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_saver"] = None  # buffers and the pool lock belong to the process that made them
        state["_staging"] = None
        state["_early"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._staging = StagingBuffers()

    # --- StorageWriter ---------------------------------------------------------------------

    validate_checkpoint_id = CheckpointIdCheck()  # agrees with reset(): see step_of_checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Point the writer at checkpoint_id for the next save; None keeps the last one (as FileSystemWriter)."""
        if checkpoint_id is not None:
            self.step = step_of_checkpoint_id(self.layout, checkpoint_id)
            self.checkpoint_id = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._early = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:  # before planning, on every rank (DCP gathers the error)
            raise BaseDirError(
                f"MemoryStorageWriter needs checkpoint_id={self.layout.base_dir}/step-<N> to know the step: pass it "
                "to dcp.save, or call writer.reset(checkpoint_id) before save_state_dict"
            )
        self.is_coordinator = is_coordinator
        # Objects and pools are per global rank, whatever process group DCP was given.
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Where FileSystemWriter checks, with its error type (a RuntimeError); DCP raises it on every rank.
        # (set_up_storage_writer, which DCP calls first, refused a writer without a step)
        if not self.overwrite and self.step is not None and self.layout.is_committed(self.step):
            raise VersionExistsError(
                f"step {self.step} is already committed in {self.layout.base_dir} and overwrite=False: save to "
                "another step, or create the MemoryStorageWriter with overwrite=True"
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def _saver_for_rank(self) -> CheckpointSaver:
        if self._saver is None or self._saver.rank != self.rank or self._saver.pool.closed:
            self._saver = _process_saver(self.layout, self.rank)
        self._saver.threads = self.threads or self._saver.threads
        self._saver.checksum = self.checksum
        return self._saver

    @without_gc
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "torch.futures.Future[list[WriteResult]]":
        if self.step is None:
            raise BaseDirError("write_data called before reset(checkpoint_id): pass checkpoint_id to dcp.save")
        saver = self._saver_for_rank()
        retire_superseded(self.layout.base_dir, keep=self.keep, rank=self.rank, pool=saver.pool,
                          world_size=dist.get_world_size() if dist.is_initialized() else None)
        flat, items = resolve_write_items(plan, planner)
        if self.is_coordinator:  # DCP's default planner keeps the Metadata it built; compared before the copy
            self._early = compare_early(self.layout.base_dir, getattr(planner, "metadata", None))
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        if not flat:
            # Nothing of the state is on this rank (an empty state): no object, none the commit record could list.
            if self.layout.is_committed(self.step):
                retire_version(self.layout, self.step, rank=self.rank, pool=saver.pool)  # as an overwrite does
            future.set_result([])
            return future
        written = saver.write_object(self.step, flat, overwrite=True)
        future.set_result(write_results(written.record, items))
        return future

    @without_gc
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.step is None:
            raise BaseDirError("finish called before reset(checkpoint_id)")
        # One RankWrite per rank that holds part of the state (see storage_info); an empty rank returns none.
        writes: list[RankWrite] = [result.storage_data for per_rank in results for result in per_rank]
        objects: list[ObjectRecord] = [write[1] for write in writes]
        metadata.storage_meta = self.storage_meta()  # for dcp.save's caller; the file leaves it out
        early, self._early = self._early, None
        encoded = encode_metadata(self.layout.base_dir, metadata, writes, early)  # also sets metadata.storage_data
        described = describe_bytes(encoded)
        version_dir = self.layout.version_dir(self.step)
        version_dir.mkdir(parents=True, exist_ok=True)
        write_file_atomically(version_dir, DCP_METADATA_NAME, encoded, f"DCP's metadata of step {self.step}")
        write_commit(
            self.layout,
            self.step,
            sorted(objects, key=lambda o: (o.rank, o.name)),
            world_size=len(results),
            metadata={
                "kind": "dcp",
                "save_id": self.save_id,
                FILES_KEY: {DCP_METADATA_NAME: described, **describe_files(version_dir, self.version_files())},
            },
        )
        logger.debug("Committed DCP version %d with %d objects", self.step, len(objects))

    def version_files(self) -> tuple[str, ...]:
        """Files besides DCP's metadata that a subclass keeps in the version (checksummed in the commit record)."""
        return ()

    # --- AsyncStager -----------------------------------------------------------------------

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    @without_gc
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """One copy of the state into reused host buffers; training may continue after this."""
        return self._staging.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Release staging buffers and this rank's buffer pool (the RAM versions stay)."""
        self._staging.clear()
        if self._saver is not None:
            _SAVERS.pop((str(self.layout.base_dir), self._saver.rank), None)
            self._saver.close()
            self._saver = None


# One saver per (base dir, rank) and process. DCP's process executor unpickles a fresh
# writer for every save into the same background process; they must share the pool
# (a second pool for the same rank is refused) and its warm buffers.
_SAVERS: dict[tuple[str, int], CheckpointSaver] = {}
_SAVERS_LOCK = threading.Lock()  # the trainer's thread and the pool warm-up thread may both ask


def release_process_savers(base_dirs: Iterable[str | os.PathLike[str]] | None = None) -> None:
    """Close the savers this process holds for base_dirs (None: all): their pools' mappings and locks.

    The versions stay on the tmpfs. Safe from several threads at once (an abort and a teardown):
    each saver is taken by one of them.
    """
    wanted = None if base_dirs is None else {str(CheckpointLayout(b).base_dir) for b in base_dirs}
    with _SAVERS_LOCK:
        keys = [key for key in _SAVERS if wanted is None or key[0] in wanted]
        savers = [_SAVERS.pop(key) for key in keys]
    for saver in savers:
        saver.close()


def _process_saver(layout: CheckpointLayout, rank: int) -> CheckpointSaver:
    key = (str(layout.base_dir), rank)
    with _SAVERS_LOCK:
        saver = _SAVERS.get(key)
        if saver is None or saver.pool.closed:
            saver = _SAVERS[key] = CheckpointSaver(layout.base_dir, rank)
        return saver


def warm_up_rank_pool(base_dir: str | os.PathLike[str], rank: int) -> None:
    """Take rank's pool in this process and pre-fault the buffers an earlier run left in it (background)."""
    _process_saver(CheckpointLayout(base_dir), rank).pool.start_warmup()


PlannedItems = tuple[tuple[str, ...], tuple[MetadataIndex, ...]]  # record key and DCP index of each item, in plan order


def write_results(record: ObjectRecord, items: PlannedItems) -> list[WriteResult]:
    """The one WriteResult of this rank's object `record`; its storage_data is a RankWrite (see storage_info)."""
    keys, indices = items
    return [WriteResult(indices[0], record.nbytes, (record.name, record, keys, indices))] if indices else []


def resolve_write_items(plan: SavePlan, planner: SavePlanner) -> tuple[dict[str, Any], PlannedItems]:
    """The plan's items as a flat state for the saver, and their record keys and indices.

    One pass over the items: resolve_data once each (the planner's API), record keys once each.
    """
    flat: dict[str, Any] = {}
    keys: list[str] = []
    indices: list[MetadataIndex] = []
    resolve = planner.resolve_data
    key_of = record_key_of
    byte_io = WriteItemType.BYTE_IO
    for item in plan.items:
        data: Any = resolve(item)  # a tensor item resolves to its tensor
        if item.type is byte_io:
            data = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(bytes(data))
        index = item.index
        key = key_of(index.fqn, index.offset)
        flat[key] = data
        keys.append(key)
        indices.append(index)
    if len(flat) != len(keys):  # checked once, not per item: two items mapped to one record key
        repeated = next(key for key, count in Counter(keys).items() if count > 1)
        raise UnsupportedValueError(
            f"two items of the plan map to the record key {repeated!r}; rename the state dict key that contains '@'"
        )
    return flat, (tuple(keys), tuple(indices))
