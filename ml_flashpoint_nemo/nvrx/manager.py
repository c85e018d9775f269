"""NVRx's local-checkpoint manager interface on the RAM store: one class for NeMo, Megatron-LM and Bridge.

NVRx's ``BaseCheckpointManager`` is what NeMo's hierarchical checkpoint IO, Megatron-LM's
``--non-persistent-ckpt-type local`` and Megatron-Bridge call to save and load "local"
checkpoints. This manager keeps that interface and stores each rank's ``TensorAwareStateDict``
as one object of a RAM version: its tensors as records, its hollow structure (what is left
after ``pop_tensors``) as one pickled record, every byte under a CRC32C. A version exists once
the coordinator's commit record lists every rank's object; the version a job resumes from is
chosen by replication.choice (newest version intact on every rank, older ones as fallback,
objects a node lost fetched from peer replicas). docs/nvrx.md lists every difference from
NVRx's own ``LocalCheckpointManager``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
    BaseCheckpointManager,
    CheckpointingException,
    CkptID,
)

from ml_flashpoint_nemo.core import lifecycle
from ml_flashpoint_nemo.core.layout import CheckpointLayout, rank_of_object
from ml_flashpoint_nemo.core.loader import load_version
from ml_flashpoint_nemo.core.node_copies import NodeCopies
from ml_flashpoint_nemo.core.saver import CheckpointSaver, StagedObject
from ml_flashpoint_nemo.core.seal import seal_object
from ml_flashpoint_nemo.core.topology import any_rank, discover_nodes, gathered_on_coordinator, problems_of_every_rank
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.versions import (
    committed_steps,
    read_commit,
    retire_superseded,
    retire_version,
    write_commit,
)
from ml_flashpoint_nemo.errors import LocalCheckpointError
from ml_flashpoint_nemo.replication.choice import choose_version
from ml_flashpoint_nemo.replication.service import ReplicationConfig, ReplicationService

logger = logging.getLogger(__name__)

# Record keys of a rank's object: its hollow state dict, then its tensors in pop_tensors order.
STRUCTURE_KEY = "nvrx/structure"
TENSOR_KEY_PATTERN = "nvrx/tensor/{index:08d}"
SESSION_KEY = "nvrx_session"  # in the commit record's metadata
CONTENT_METADATA_KEY = "nvrx_content_metadata"  # in the commit record's metadata: the content_metadata() of the save
_SESSION_ID = re.compile(r"[A-Za-z0-9_.-]*")


class LocalCheckpointingError(LocalCheckpointError, CheckpointingException):
    """A local save or load failed (on every rank alike); both our FlashpointError and NVRx's CheckpointingException."""


def tensor_key(index: int) -> str:
    return TENSOR_KEY_PATTERN.format(index=index)


def flatten(state_dict: TensorAwareStateDict) -> dict[str, Any]:
    """The records of one rank's object: the pickled hollow state dict and its tensors.

    The caller's state dict is left as it came: its tensors are popped only while the hollow
    rest is pickled and are put back right after (NVRx's pop/insert contract).
    """
    if state_dict.is_hollow:
        raise LocalCheckpointingError("the state dict to save is hollow (its tensors were popped); insert them first")
    tensors = list(state_dict.pop_tensors())
    try:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
    finally:
        state_dict.insert_tensors(tensors)
    flat: dict[str, Any] = {STRUCTURE_KEY: buffer.getbuffer()}
    for index, tensor in enumerate(tensors):
        flat[tensor_key(index)] = tensor
    return flat


def unflatten(records: dict[str, Any], where: str) -> TensorAwareStateDict:
    """The state dict of flatten's records, read back with every CRC32C checked (core.loader)."""
    structure = records.pop(STRUCTURE_KEY, None)
    if not isinstance(structure, (bytes, bytearray, memoryview)):
        raise LocalCheckpointingError(f"{where} holds no state dict structure: it was not saved by this manager")
    # Unpickled only after the loader matched its CRC32C and the object's against the commit record; the
    # same trust as Megatron's common.pt and NVRx's own torch.load of its files.
    state_dict = torch.load(io.BytesIO(bytes(structure)), weights_only=False)  # nosec B614
    if not isinstance(state_dict, TensorAwareStateDict) or not state_dict.is_hollow:
        raise LocalCheckpointingError(f"{where} holds a {type(state_dict).__name__}, not a hollow TensorAwareStateDict")
    expected = [tensor_key(i) for i in range(len(records))]
    if sorted(records) != expected:
        raise LocalCheckpointingError(
            f"{where} has records {sorted(records)[:3]}..., not tensors 0..{len(records) - 1}"
        )
    state_dict.insert_tensors([records[key] for key in expected])
    return state_dict


class FlashpointLocalCheckpointManager(BaseCheckpointManager):
    """NVRx's ``BaseCheckpointManager`` on RAM versions: a drop-in for ``LocalCheckpointManager``.

    root_local_ckpt_dir: a directory on a tmpfs of each node (e.g. /dev/shm/ckpt); versions of
    session ``session_id`` live in ``<root>/<session_id>``. keep: committed versions kept (more
    while the newest is not yet replicated). replication: our peer replication settings (it runs
    in the background after each commit; on one node it is off). NVRx's ``repl_strategy`` is
    refused: its clique replication runs inside the save, which is what this manager avoids.
    content_metadata: a function returning what shapes the saved state dict (NeMo's and Megatron's
    sharded-state-dict metadata: the optimizer's sharding type, ...), JSON-able; each version records
    it, and find_latest does not offer a version saved under other metadata. Every method is
    collective, as NVRx's are: all ranks call it.
    """

    latest_iteration: int  # set by NVRx's __init__: -1, or the iteration find_latest chose

    def __init__(
        self,
        root_local_ckpt_dir: str | os.PathLike[str],
        session_id: str = "",
        repl_strategy: Any = None,
        *,
        keep: int = 1,
        replication: ReplicationConfig | None = None,
        checksum: bool = True,
        threads: int | None = None,
        content_metadata: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        if repl_strategy is not None:
            raise LocalCheckpointingError(
                f"repl_strategy={type(repl_strategy).__name__} is NVRx's replication, which runs inside the save; "
                "this manager replicates in the background: pass replication=ReplicationConfig(...) instead"
            )
        if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id) or session_id in (".", ".."):
            raise LocalCheckpointingError(
                f"session_id {session_id!r} must be a plain directory name (letters, digits, '_', '.', '-')"
            )
        if keep < 1:
            raise LocalCheckpointingError(f"keep must be >= 1, got {keep}")
        super().__init__(session_id, None)
        self.root_local_ckpt_dir = root_local_ckpt_dir
        self.base_dir = Path(root_local_ckpt_dir, session_id).absolute()
        self.layout = CheckpointLayout(self.base_dir)
        self.keep = keep
        self.replication_config = replication or ReplicationConfig()
        self.checksum = checksum
        self.threads = threads or default_copy_threads()
        self.content_metadata = content_metadata
        self._saver: CheckpointSaver | None = None
        self._replication: ReplicationService | None = None
        self._nodes: NodeCopies | None = None  # the version files' copy per node, on several nodes only
        self._warmed = False
        self._close_lock = threading.Lock()

    @property
    def local_ckpt_dir(self) -> Path:
        """Where this session's versions live; Megatron-LM's and Bridge's local saves read it as their save_dir."""
        return self.base_dir

    # --- NVRx's abstract methods ------------------------------------------------------------------

    def _my_ckpt_ids(self) -> Iterable[CkptID]:
        """(iteration, rank, session) of each object of a committed version on this node (replicas too)."""
        ids = []
        for step in committed_steps(self.layout):
            for name in _listdir(self.layout.version_dir(step)):
                owner = rank_of_object(name)
                if owner is not None:
                    ids.append((step, owner, self.session_id))
        return ids

    def _load(self, ckpt_id: CkptID) -> TensorAwareStateDict:
        iteration, rank, session = self._checked_id(ckpt_id)
        where = f"local checkpoint iteration {iteration} of rank {rank} in {self.base_dir}"
        return unflatten(load_version(self.base_dir, iteration, rank=rank, threads=self.threads,
                                       check_private=False), where)

    def _save(self, state_dict: TensorAwareStateDict, ckpt_id: CkptID) -> None:
        """This rank's object of the version, written but not committed (save() commits)."""
        iteration, rank, _ = self._checked_id(ckpt_id)
        if rank != self.rank:
            raise LocalCheckpointingError(f"rank {self.rank} cannot write the object of rank {rank}")
        self._saver_for_rank().write_object(iteration, flatten(state_dict), overwrite=True)

    def _cleanup(self, iteration: int) -> None:
        """Retire this rank's objects of versions superseded by `iteration` (the newest `keep` stay)."""
        retire_superseded(
            self.base_dir,
            keep=self.keep,
            rank=self.rank,
            pool=self._saver.pool if self._saver else None,
            world_size=_world_size(),
        )

    def _cleanup_failed_save(self, iteration: int) -> None:
        """Remove this rank's object of `iteration` unless that version is committed (then it is valid)."""
        if not self.layout.is_committed(iteration):
            retire_version(self.layout, iteration, rank=self.rank, pool=self._saver.pool if self._saver else None)

    # --- the collective interface -----------------------------------------------------------------

    def find_latest(self) -> int:
        """Collective: the newest iteration every rank can load intact, -1 if none (cached until the next save).

        Stronger than NVRx's (a file of every rank exists): the version is committed, every rank's
        object passes its checksums (replicas fetched from peers for what a node lost), and a
        damaged newer version is skipped for an older one. A version saved by another number of
        ranks is skipped too (each rank loads its own state dict), so it hides no older one. With
        content_metadata, the version found must have been saved under the same metadata, else
        none is offered (-1, logged on every rank with both).
        """
        if self.latest_iteration != -1:
            return self.latest_iteration
        choice = choose_version(self.base_dir, self.replication_config, elastic=False)
        step = -1 if choice.step is None else choice.step
        if step >= 0 and self.content_metadata is not None:
            problem = self._content_metadata_problem(step)
            if any_rank(problem is not None):  # 8 B, every rank alike
                logger.warning(
                    "Local checkpoint iteration %d is not used: %s",
                    step,
                    problem or "its content metadata differs on another rank",
                )
                step = -1
        self.latest_iteration = step
        return step

    def load(self) -> tuple[TensorAwareStateDict, CkptID]:
        """Collective: this rank's state dict of the iteration find_latest chose, and its id."""
        if self.latest_iteration == -1:
            raise LocalCheckpointingError("call find_latest() before load(): no local checkpoint was chosen")
        ckpt_id = self._ckpt_id(self.latest_iteration)
        state_dict, problem = None, None
        try:
            state_dict = self._load_fn(ckpt_id)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the collective below
            problem = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        failed = problems_of_every_rank(problem)
        if failed:
            self.latest_iteration = -1  # find_latest() checks again (and skips what is damaged now)
            raise LocalCheckpointingError(
                f"loading local checkpoint iteration {ckpt_id[0]} failed: " + "; ".join(failed)
            )
        assert state_dict is not None
        return state_dict, ckpt_id

    def save(self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False) -> AsyncRequest | None:
        """Collective: save this rank's state dict as its object of version `iteration`.

        The caller waits only for the copy into a pool buffer; with is_async, the checksums and
        sealing are the returned request's function (run by NVRx's or Megatron's async queue) and
        the commit is its finalize function, on every rank. Without, all of it runs here.
        A failure on any rank fails the save on every rank (LocalCheckpointingError at finalize)
        and leaves the previous version as the newest.
        """
        self._ckpt_id(iteration)  # NVRx's check of the iteration (non-negative)
        if iteration <= self.latest_iteration:
            raise LocalCheckpointingError(
                f"iteration {iteration} is not newer than the local checkpoint found ({self.latest_iteration})"
            )
        self.latest_iteration = -1
        lifecycle.register(self, FlashpointLocalCheckpointManager.close)
        staged, problem = self._stage(state_dict, iteration, self._keep_for_this_save())
        finalize = _Finalize(self, iteration, staged, problem)
        if staged is None:
            request = AsyncRequest(None, (), [finalize])
        else:
            request = AsyncRequest(seal_object, (staged.seal_job, self.threads), [finalize])
        if is_async:
            return request
        if request.async_fn is not None:
            try:
                request.async_fn(*request.async_fn_args)
            except Exception as exc:  # noqa: BLE001 - the object stays unsealed; finalize reports it everywhere
                logger.debug("sealing local checkpoint %d failed on rank %d", iteration, self.rank, exc_info=True)
                finalize.problem = f"rank {self.rank}: sealing failed: {type(exc).__name__}: {exc}"
        finalize()
        return None

    def close(self) -> None:
        """Release this process's buffer pool and stop replication (RAM versions stay). No collective."""
        with self._close_lock:
            saver, self._saver = self._saver, None
            replication, self._replication = self._replication, None
        if replication is not None:
            replication.close()
        if saver is not None:
            saver.close()
        lifecycle.unregister(self)

    # --- helpers ----------------------------------------------------------------------------------

    def current_content_metadata(self) -> dict[str, Any] | None:
        """content_metadata() as the commit record stores it (through JSON), or None without the function."""
        if self.content_metadata is None:
            return None
        return json.loads(json.dumps(dict(self.content_metadata())))

    def _content_metadata_problem(self, step: int) -> str | None:
        """Why version `step` was saved under other content metadata than the job's now (None: the same)."""
        try:
            saved = read_commit(self.layout, step).metadata.get(CONTENT_METADATA_KEY)
            now = self.current_content_metadata()
        except Exception as exc:  # noqa: BLE001 - every rank must reach the all-reduce after this
            return f"rank {self.rank}: its content metadata cannot be compared: {type(exc).__name__}: {exc}"
        if saved == now:
            return None
        return (
            f"it was saved with content metadata {json.dumps(saved)[:300]}, the job now has "
            f"{json.dumps(now)[:300]} (e.g. another optimizer sharding): loading it would build a different "
            "state dict. Restore the settings it was saved with to resume from it; else the global "
            "checkpoint (or none) is loaded"
        )

    def _checked_id(self, ckpt_id: CkptID) -> CkptID:
        iteration, rank, session = ckpt_id
        if session != self.session_id:
            raise LocalCheckpointingError(f"checkpoint id {ckpt_id} is of session {session!r}, not {self.session_id!r}")
        return iteration, rank, session

    def _saver_for_rank(self) -> CheckpointSaver:
        if self._saver is None:
            self._saver = CheckpointSaver(self.base_dir, self.rank, threads=self.threads, checksum=self.checksum)
        return self._saver

    def _keep_for_this_save(self) -> int:
        """Collective: the versions to keep, one more while the newest is not replicated (service started once)."""
        if self._replication is None:
            problem = None
            try:
                self.layout.ensure_writable()
            except Exception as exc:  # noqa: BLE001 - one node's bad root must fail every rank, not hang the others
                problem = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            failed = problems_of_every_rank(problem)
            if failed:
                raise LocalCheckpointingError(
                    "the local checkpoint directory is not usable on every rank; nothing "
                    "was saved: " + "; ".join(failed)
                )
            topology = discover_nodes(self.base_dir, self.replication_config.failure_domain)
            if topology.node_count > 1:
                self._nodes = NodeCopies.discover(self.base_dir, None, self.replication_config.failure_domain)
            self._replication = ReplicationService.start(self.base_dir, topology, self.replication_config)
        return self._replication.keep_for_next_save(self.keep)

    def _stage(
        self, state_dict: TensorAwareStateDict, iteration: int, keep: int
    ) -> tuple[StagedObject | None, str | None]:
        """The blocking part: retire superseded versions, copy the state into a pool buffer; (staged, problem)."""
        try:
            saver = self._saver_for_rank()
            retire_superseded(self.base_dir, keep=keep, rank=self.rank, pool=saver.pool, world_size=_world_size())
            staged = saver.stage_object(iteration, flatten(state_dict), overwrite=True, defer_checksums=True)
            if not self._warmed:  # the next save needs a buffer of its own while this version stays
                self._warmed = True
                saver.warm_up(staged.seal_job.plan.object_nbytes, count=1)
            return staged, None
        except Exception as exc:  # noqa: BLE001 - reported on every rank by finalize
            logger.debug("staging local checkpoint %d failed on rank %d", iteration, self.rank, exc_info=True)
            return None, f"rank {self.rank}: staging failed: {type(exc).__name__}: {exc}"


class _Finalize:
    """A save's finalize function: place every rank's object, commit on the coordinator, start replication."""

    def __init__(
        self,
        manager: FlashpointLocalCheckpointManager,
        iteration: int,
        staged: StagedObject | None,
        problem: str | None,
    ) -> None:
        self.manager = manager
        self.iteration = iteration
        self.staged = staged
        self.problem = problem

    def __call__(self) -> None:
        manager, iteration = self.manager, self.iteration
        record, problem = None, self.problem
        staged, self.staged = self.staged, None
        if staged is not None:
            try:
                if problem is not None:
                    raise LocalCheckpointingError(problem)
                record = manager._saver_for_rank().place(staged).record
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                manager._saver_for_rank().abandon(staged)
                problem = problem or f"rank {manager.rank}: {type(exc).__name__}: {exc}"
        elif problem is None:
            problem = f"rank {manager.rank}: finalize of iteration {iteration} ran twice or without a staged object"
        errors, records = gathered_on_coordinator(record, problem,
                                                  manager._nodes.gather if manager._nodes is not None else None)
        commit_problem = None
        if not errors and dist.get_rank() == 0:
            try:
                if records is None:
                    raise LocalCheckpointingError("rank 0 could not receive every rank's object record (see its log)")
                metadata: dict[str, Any] = {SESSION_KEY: manager.session_id}
                content = manager.current_content_metadata()
                if content is not None:
                    metadata[CONTENT_METADATA_KEY] = content
                write_commit(manager.layout, iteration, records, world_size=_world_size(), metadata=metadata)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                commit_problem = f"rank 0 commit: {type(exc).__name__}: {exc}"
        if not errors:
            errors = problems_of_every_rank(commit_problem)
        if errors:
            try:
                manager._cleanup_failed_save(iteration)
            except Exception:  # noqa: BLE001 - the leftover is uncommitted: retired by a later save
                logger.debug("cleanup of failed local checkpoint %d", iteration, exc_info=True)
            raise LocalCheckpointingError(
                f"local checkpoint of iteration {iteration} failed; the previous version is intact: "
                + "; ".join(errors)
            )
        if manager._nodes is not None:
            manager._nodes.copy_version_to_every_node(manager.layout, iteration)
        if manager._replication is not None:
            manager._replication.replicate(iteration)  # in the background
        logger.debug("Local checkpoint of iteration %d committed", iteration)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


__all__ = ["FlashpointLocalCheckpointManager", "LocalCheckpointingError"]
