"""Megatron dist_checkpointing strategies that save to and load from RAM versions.

    dist_checkpointing.save(sharded_sd, f"{base}/step-{n}", sharded_strategy=FlashpointSaveStrategy())
    request = dist_checkpointing.save(..., sharded_strategy=strategy, async_sharded_save=True)
    async_queue.schedule_async_request(request)          # AsyncCallsQueue, persistent or not
    dist_checkpointing.load(sharded_sd, f"{base}/step-{n}", sharded_strategy=FlashpointLoadStrategy())

Save: planning (Megatron's planner, cached by Megatron when unchanged) and one
staging copy into this rank's pool buffer happen in the caller; the AsyncRequest's
function computes the checksums and seals the object in whatever process Megatron
runs it; finalization (in the trainer) places the object, gathers every rank's object
record and commits the version on the coordinator. The coordinator writes Megatron's
metadata.json and DCP's metadata before the commit record, so a committed version is
complete for dist_checkpointing.load.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.resharding import (
    TensorReformulationMetadata,
    apply_nd_flattened_tensors_reformulation,
    is_nd_flattened_tensor,
    restore_nd_flattened_tensors_formulation,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint as torch_dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ml_flashpoint_nemo.core import capture, lifecycle
from ml_flashpoint_nemo.core.gc_pause import without_gc
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.node_copies import NodeCopies
from ml_flashpoint_nemo.core.save_worker import seal_and_report
from ml_flashpoint_nemo.core.saver import CheckpointSaver, StagedObject
from ml_flashpoint_nemo.core.space import NO_PROBLEM, check_room_on_every_rank, raise_start_problems, start_problem
from ml_flashpoint_nemo.core.sync_manager import (
    SyncManagerFuture,
    shutdown_manager,
    start_manager_warmup,
    unguarded_main_script,
    wait_for_manager,
)
from ml_flashpoint_nemo.core.topology import (
    NodeGather,
    NodeTopology,
    gathered_on_coordinator,
    gathered_short_or_full,
    node_identity,
    problems_of_every_rank,
    raise_if_any_rank_failed,
    reduced_ints,
)
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.version_files import check_version_files
from ml_flashpoint_nemo.core.versions import read_commit, retire_superseded
from ml_flashpoint_nemo.dcp.reader import MemoryStorageReader
from ml_flashpoint_nemo.dcp.writer import (
    MemoryStorageWriter,
    PlannedItems,
    release_process_savers,
    resolve_write_items,
    write_results,
)
from ml_flashpoint_nemo.errors import (
    BaseDirError,
    CorruptCheckpointError,
    FlashpointError,
    ManagerStartError,
    OutOfSpaceError,
)
from ml_flashpoint_nemo.megatron.coordinator_items import CoordinatorItems, compact_report
from ml_flashpoint_nemo.megatron.worker_reports import WorkerReports
from ml_flashpoint_nemo.megatron.write_recipe import WriteRecipe

if TYPE_CHECKING:  # the service is imported at the first save (it loads the transfer machinery)
    from ml_flashpoint_nemo.replication.service import ReplicationConfig, ReplicationService

logger = logging.getLogger(__name__)

BACKEND = "ml_flashpoint"
VERSION = 1
_SAVE_CANNOT_START = 2  # above "the structure changed" (1) in the first all-reduce of every save
# A plan whose values keep failing their recipe (a value made contiguous by Megatron's conversion every
# save, say) stops learning new ones: each would cost a replay on the learning save and be dropped again.
_RECIPES_BEFORE_GIVING_UP = 2


def _split_checkpoint_dir(checkpoint_dir: str | os.PathLike[str]) -> tuple[CheckpointLayout, str]:
    path = Path(checkpoint_dir).absolute()
    return CheckpointLayout(path.parent), os.fspath(path)


# The savers (one per pool) whose pool got a warm buffer for the save after their first one.
_WARMED_SAVERS: "weakref.WeakSet[CheckpointSaver]" = weakref.WeakSet()


class _StagingWriter(MemoryStorageWriter):
    """The writer Megatron's async planner drives: stages in prepare_write_data, commits in finish."""

    step: int  # always known: reset() in __init__ takes it from checkpoint_dir (or raises)

    def __init__(self, checkpoint_dir: str | os.PathLike[str], *, keep: int, checksum: bool, threads: int | None,
                 overlap_capture: bool = False):
        layout, checkpoint_id = _split_checkpoint_dir(checkpoint_dir)
        super().__init__(layout.base_dir, keep=keep, checksum=checksum, threads=threads)
        self.reset(checkpoint_id)
        self.overlap_capture = overlap_capture
        self.staged: StagedObject | None = None
        self.stage_error: str | None = None
        self.items: PlannedItems = ((), ())  # record key and DCP index of each item of this rank's plan
        self.keep_resolved = False  # set for a save a WriteRecipe is to be learnt from
        self.resolved: dict[str, Any] | None = None  # what the planner resolved, when keep_resolved

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Blocking phase: copy this rank's items into a pool buffer (checksums come later).

        A failure here (a full tmpfs, say) is kept for finalize, which reports it on every
        rank: raising now would leave the other ranks waiting in finalize's collectives.
        """
        self.stage_items(lambda: resolve_write_items(plan, planner))

    def stage_items(self, resolve: Callable[[], tuple[dict[str, Any], PlannedItems]]) -> None:
        """Stage the items resolve() gives (the planner's, or a WriteRecipe's replay); never raises."""
        try:
            self._stage(resolve)
        except Exception as exc:  # noqa: BLE001 - reported to every rank at finalize
            self.abandon()
            self.stage_error = f"staging failed: {type(exc).__name__}: {exc}"
            logger.debug("flashpoint staging of step %s failed on rank %d", self.step, self.rank, exc_info=True)

    def _stage(self, resolve: Callable[[], tuple[dict[str, Any], PlannedItems]]) -> None:
        self.rank = dist.get_rank()
        saver = self._saver_for_rank()
        retire_superseded(self.layout.base_dir, keep=self.keep, rank=self.rank, pool=saver.pool,
                          world_size=dist.get_world_size())
        flat, self.items = resolve()
        if self.keep_resolved:
            self.resolved = flat
        first = saver not in _WARMED_SAVERS
        self.staged = saver.stage_object(self.step, flat, overwrite=True, defer_checksums=True,
                                         in_background=self.overlap_capture)
        if first:
            # The next save still finds this version committed (it is retired only then), so it needs a
            # buffer of its own: fault one in now, in the background, rather than while training waits.
            _WARMED_SAVERS.add(saver)
            saver.warm_up(self.staged.seal_job.plan.object_nbytes, count=1)

    def place_and_report(self) -> list[WriteResult]:
        """Finalize phase on every rank: check the sealed object, move it into the version."""
        assert self.staged is not None, "checked by _finalize_save"
        staged, self.staged = self.staged, None
        written = self._saver_for_rank().place(staged)
        return write_results(written.record, self.items)

    def abandon(self) -> None:
        if self.staged is not None:
            self._saver_for_rank().abandon(self.staged)
            self.staged = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        version_dir = self.layout.version_dir(self.step)
        version_dir.mkdir(parents=True, exist_ok=True)
        # Before the commit, not after. Megatron rewrites the same bytes once the save is final (in place:
        # a kill during that rewrite is repaired from its known bytes, see version_files.MEGATRON_CONFIG_BYTES).
        save_config(CheckpointingConfig(BACKEND, VERSION), str(version_dir))
        super().finish(metadata, results)

    def version_files(self) -> tuple[str, ...]:
        """Megatron's metadata.json and its common state (common.pt, written by rank 0 before the save)."""
        return (CONFIG_FNAME, COMMON_STATE_FNAME)


class FlashpointSaveStrategy(AsyncSaveShardedStrategy):
    """Saves Megatron sharded state dicts as RAM versions; checkpoint_dir is <base>/step-<N>.

    The background write reports its outcome through a queue of a spawn Manager, so a
    worker's error reaches the trainer's finalize on every rank. Pass the future of a
    Manager warmed up at trainer set-up (start_manager_warmup); without one, the strategy
    starts its own when it is created. The first save waits for it, bounded, and every
    rank raises ManagerStartError if any rank's Manager failed.
    """

    def __init__(
        self,
        *,
        keep: int = 1,
        checksum: bool = True,
        threads: int | None = None,
        manager_future: SyncManagerFuture | None = None,
        replication: ReplicationConfig | None = None,
        overlap_capture: bool = False,
    ) -> None:
        super().__init__(BACKEND, VERSION)
        # Async saves return before their host tensors are copied; every torch optimizer step waits for the copies.
        self.overlap_capture = overlap_capture
        self.replication_config = replication  # None: the defaults (factor 2)
        self._replication: ReplicationService | None = None
        self.keep = keep
        self.checksum = checksum
        self.threads = threads or default_copy_threads()
        self.manager_future = manager_future
        self._reports: WorkerReports | None = None
        self._manager: Any = None  # the Manager behind the reports' queue (and each overlapped copy's outcome)
        _warn_if_main_unguarded()
        self._signature: int | None = None
        self._cached_plans: tuple[SavePlan, SavePlan, bool] | None = None  # (central, local, validated)
        self._cached_metadata: Metadata | None = None
        self._recipe: WriteRecipe | None = None  # how saves under the cached plan take their items
        self._recipes_dropped = 0  # recipes of the cached plan a save's values no longer fitted
        self.recipe_saves = 0  # saves whose items came from the recipe (the rest went through DCP's planner)
        self._coordinator_items = CoordinatorItems()  # the plan number; on rank 0, every rank's items of a plan
        self._nodes: NodeCopies | None = None
        self._start_pending = False  # save_if_room let save() run; this save's first all-reduce has not run yet
        self._refusal: OutOfSpaceError | BaseDirError | None = None  # the room problem _start_agreed raised
        self._replication_reduced: tuple[list[int], int | None] | None = None  # votes reduced by _start_agreed
        self._close_lock = threading.Lock()
        self._base_dirs: set[Path] = set()  # whose buffer pools this strategy's saves opened in this process

    def save_if_room(self, save: Callable[[], Any], base_dir: str | os.PathLike[str],
                     version_dir: str | os.PathLike[str], *,
                     steady: bool) -> tuple[Any, OutOfSpaceError | BaseDirError | None]:
        """Collective: (save(), None) if every rank's node has room for the version and made version_dir, else
        (None, the OutOfSpaceError or BaseDirError every rank got) without writing anything.

        save() is Megatron's dist_checkpointing.save with this strategy. steady: Megatron's save runs
        no collective before this strategy's async_save (no integrity validation; with a fully
        parallel wrapper, its distribution cached). Then, after this strategy's first save, the
        check rides the save's first all-reduce (with the structure check and replication's): a
        rank with a problem joins that all-reduce from here instead of calling save() (which writes
        common.pt on rank 0), and so does a rank whose save() raises before reaching it. Otherwise
        the check costs an all-reduce of its own first.
        """
        if not (steady and self._reports is not None):
            try:
                check_room_on_every_rank(base_dir, version_dir=version_dir)
            except (OutOfSpaceError, BaseDirError) as exc:
                return None, exc
            return save(), None
        kind, problem = start_problem(base_dir, version_dir)
        self._refusal = None
        try:
            if problem is not None:
                self._start_agreed(_SAVE_CANNOT_START, problem, kind, version_dir)
            self._start_pending = True
            try:
                return save(), None
            except Exception as exc:
                if not self._start_pending:
                    raise  # after the agreement: raised on every rank by whatever raised it
                self._start_agreed(_SAVE_CANNOT_START, f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}",
                                   NO_PROBLEM, version_dir)
                raise AssertionError("_start_agreed raises when a rank cannot start") from exc
        except (OutOfSpaceError, BaseDirError) as exc:
            if exc is not self._refusal:
                raise
            return None, exc
        finally:
            self._start_pending, self._refusal = False, None

    def _structure_unchanged_on_every_rank(self, sharded_state_dict: ShardedStateDict, writer: "_StagingWriter | str",
                                           checkpoint_dir: str | Path) -> bool:
        """True when no rank's keys, shapes, dtypes, sharding or base directory changed since the last save.

        Checked every save (a hash per rank in the save's first all-reduce, see _start_agreed); only
        then is the last save's plan reused, which skips the planning collectives. writer is this
        rank's writer, or why it could not be made: the same all-reduce carries that, so that every rank raises.
        """
        problem: str | None = None
        if isinstance(writer, str):
            problem = writer
        else:
            try:
                signature = hash((node_identity(writer.layout.base_dir), dist.get_rank(), dist.get_world_size(),
                                  tuple(_describe(v) for v in nested_values(sharded_state_dict))))
            except Exception as exc:  # noqa: BLE001 - shared with every rank below
                problem = f"rank {dist.get_rank()}: describing the state failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            return self._start_agreed(_SAVE_CANNOT_START, problem, NO_PROBLEM, checkpoint_dir)
        changed = self._cached_plans is None or signature != self._signature
        self._signature = signature
        return self._start_agreed(int(changed), None, NO_PROBLEM, checkpoint_dir)

    def _start_agreed(self, flag: int, problem: str | None, room_kind: int, checkpoint_dir: str | os.PathLike[str]) -> bool:
        """Collective, a save's first: one fixed-size all-reduce of every rank's structure flag (0 unchanged, 1
        changed, _SAVE_CANNOT_START), room problem kind (core.space) and, once replication runs, its votes.

        True: every rank's structure is unchanged. Raises on every rank alike when any rank has a
        problem: OutOfSpaceError or BaseDirError for a room problem (save_if_room's), else FlashpointError.
        """
        self._start_pending = False
        replication = self._replication if self._replication is not None and self._replication.enabled else None
        votes, newest = replication.replication_votes() if replication is not None else ([], None)
        reduced = reduced_ints([flag, room_kind, *votes])
        self._replication_reduced = (reduced[2:], newest) if replication is not None else None
        if reduced[0] < _SAVE_CANNOT_START and reduced[1] == NO_PROBLEM:
            return reduced[0] == 0
        self._cached_plans = None  # whatever this save leaves, the next one plans afresh
        if reduced[1] != NO_PROBLEM:  # the room problems alone, as the room check of its own says them
            try:
                raise_start_problems(reduced[1], problems_of_every_rank(problem if room_kind != NO_PROBLEM else None))
            except (OutOfSpaceError, BaseDirError) as exc:
                self._refusal = exc
                raise
        failed = problems_of_every_rank(problem)
        raise FlashpointError(f"the flashpoint save to {os.fspath(checkpoint_dir)} cannot start; nothing was "
                              "written and the previous version is intact: " + "; ".join(failed))

    def _reports_agreed_by_all_ranks(self) -> WorkerReports:
        """Background-write outcomes (a Manager queue); at the first save, all ranks agree the Manager runs."""
        if self._reports is not None:
            return self._reports
        error, queue = None, None
        try:  # starting it can fail on this rank alone too (its FLASHPOINT_MANAGER_TIMEOUT_S, no thread left)
            if self.manager_future is None:
                self.manager_future = start_manager_warmup()
            self._manager = wait_for_manager(self.manager_future, what="the first flashpoint save")
            queue = self._manager.Queue()
        except Exception as exc:  # noqa: BLE001 - shared with every rank below
            error = f"rank {dist.get_rank()}: {exc}"
        failed = problems_of_every_rank(error)
        if failed:
            raise ManagerStartError("the flashpoint save cannot start: " + "; ".join(failed))
        self._reports = WorkerReports(queue)
        return self._reports

    @without_gc
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> AsyncRequest:
        lifecycle.register(self, FlashpointSaveStrategy.close)  # it now holds the Manager and replication
        reports = self._reports_agreed_by_all_ranks()
        # Only main replicas are written (as Megatron's torch_dist does): replicated tensors once per job.
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        writer = self._writer_or_problem(checkpoint_dir)
        reuse_plan = self._structure_unchanged_on_every_rank(sharded_state_dict, writer, checkpoint_dir)
        assert isinstance(writer, _StagingWriter), "a problem was raised on every rank above"
        if not reuse_plan:
            self._cached_plans = None  # planning that fails below must leave no older plan to be reused
            self._coordinator_items.new_plan()
        plan, items = self._coordinator_items.plan, self._coordinator_items
        self._base_dirs.add(writer.layout.base_dir)
        if not reuse_plan or self._nodes is None:
            domain = self.replication_config.failure_domain if self.replication_config else None
            self._nodes = NodeCopies.discover(writer.layout.base_dir, self._nodes, domain)
        nodes = self._nodes
        replication = self._replication_service(writer.layout.base_dir, nodes.topology)
        # The previous version survives while the newest is not replicated on every rank.
        reduced, self._replication_reduced = self._replication_reduced, None
        writer.keep = (replication.keep_after_votes(self.keep, *reduced) if reduced is not None and replication.enabled
                       else replication.keep_for_next_save(self.keep))
        if not reuse_plan:
            self._recipe, self._recipes_dropped = None, 0
        if not (reuse_plan and self._staged_by_recipe(sharded_state_dict, writer)):
            if reuse_plan:
                try:  # no collective under a reused plan: a failure here must not leave this rank alone
                    self._plan_and_stage(sharded_state_dict, writer, reuse_plan)
                except Exception as exc:  # noqa: BLE001 - fails the save at finalize, on every rank
                    writer.abandon()
                    writer.stage_error = f"staging failed: {type(exc).__name__}: {exc}"
            else:  # DCP's planning collectives raise a failure on every rank themselves
                self._plan_and_stage(sharded_state_dict, writer, reuse_plan)
        global_metadata = self._cached_metadata  # the coordinator's, from the planning save

        def finalize() -> None:
            _finalize_save(writer, global_metadata, reports, items, reused_plan=reuse_plan, plan=plan,
                           through=nodes.gather)
            nodes.copy_version_to_every_node(writer.layout, writer.step)
            replication.replicate(writer.step)  # in the background, never blocks training

        channel = self._copy_outcome_channel_or_wait(writer)
        if writer.staged is None:  # staging failed: nothing to write, finalize reports it on every rank
            return AsyncRequest(None, (), [finalize])
        token = writer.save_id  # unique to this save; the object's path is not (pool buffers are reused)
        args: tuple[Any, ...] = (writer.staged.seal_job, self.threads, reports.queue, token, os.getpid())
        if channel is not None:
            args += (channel,)
        return AsyncRequest(seal_and_report, args, [finalize])

    def _staged_by_recipe(self, sharded_state_dict: ShardedStateDict, writer: _StagingWriter) -> bool:
        """Stage this save by replaying the recipe learnt on the reused plan; False: it must go the long way.

        Runs between the same collectives on every rank, with no collective of its own: a rank whose
        values no longer fit the recipe goes the long way alone, which under a reused plan has none either.
        """
        recipe = self._recipe
        if recipe is None:
            return False
        try:
            flat = recipe.replay(sharded_state_dict)
        except Exception as exc:  # noqa: BLE001 - an object torch cannot save: fails at finalize on every rank
            writer.stage_error = f"staging failed: {type(exc).__name__}: {exc}"
            return True
        if flat is None:
            self._recipe = None
            self._recipes_dropped += 1
            return False
        writer.set_up_storage_writer(dist.get_rank() == 0)
        writer.stage_items(lambda: (flat, recipe.items))
        self.recipe_saves += 1
        return True

    def _plan_and_stage(self, sharded_state_dict: ShardedStateDict, writer: _StagingWriter, reuse_plan: bool) -> None:
        """The long way: Megatron's conversion and DCP's planning (reused when unchanged), then staging.

        Learns the recipe that later saves of this structure replay instead.
        """
        writer.keep_resolved = self._recipes_dropped < _RECIPES_BEFORE_GIVING_UP
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        (_, global_metadata, _), central_plan, local_plan, _, _ = save_state_dict_async_plan(
            pyt_state_dict,
            writer,
            None,
            0,
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
            cached_ckpt_structure=self._cached_plans if reuse_plan else None,
        )
        # Our signature check validates the cache, so the plans are reusable from the next save on.
        self._cached_plans = (central_plan, local_plan, True)
        if global_metadata is not None:
            self._cached_metadata = global_metadata
        resolved, writer.resolved, writer.keep_resolved = writer.resolved, None, False
        if resolved is not None and writer.stage_error is None and self._recipes_dropped < _RECIPES_BEFORE_GIVING_UP:
            try:
                self._recipe = WriteRecipe.learn(sharded_state_dict, resolved, writer.items)
            except Exception:  # noqa: BLE001 - no recipe: the next save goes the long way again
                logger.debug("no write recipe learnt from the save of step %s", writer.step, exc_info=True)
                self._recipe = None

    def _copy_outcome_channel_or_wait(self, writer: _StagingWriter) -> Any:
        """The channel the seal waits on for this save's background copy, or None when it need not wait.

        Never raises (the other ranks are past their last collective of this save): without a channel
        (the Manager failed on this rank) the copy is waited for here, and a failed copy fails the
        save as a failed staging does, on every rank at finalize.
        """
        copying = writer.staged.copying if writer.staged is not None else None
        if copying is None:
            return None
        capture.install_optimizer_step_guard()
        try:
            return self._copy_outcome_channel(copying)
        except Exception as exc:  # noqa: BLE001 - handled below, the same way on this rank as a staging failure
            logger.warning("flashpoint: no channel to the save worker (%s: %s); this save waits for its copy",
                           type(exc).__name__, exc)
        wait([copying])
        if copying.exception() is not None:
            writer.stage_error = f"the background copy failed: {copying.exception()!r}"
            writer.abandon()
        return None

    def _copy_outcome_channel(self, copying: "Future[object]") -> Any:
        """A Manager queue that gets the background copy's outcome (None, or why it failed) once it ends."""
        channel = self._manager.Queue()

        def tell(future: "Future[object]") -> None:
            error = future.exception()
            try:
                channel.put(None if error is None else f"the background copy failed: {type(error).__name__}: {error}")
            except Exception:  # noqa: BLE001 - the seal then waits in vain: the IO's worker_timeout_s fails the save
                logger.warning("flashpoint: cannot pass the background copy's outcome to the save worker",
                               exc_info=True)

        copying.add_done_callback(tell)
        return channel

    def _writer_or_problem(self, checkpoint_dir: str | Path) -> "_StagingWriter | str":
        """This save's writer, or why this rank cannot make one (raised on every rank by the next all-reduce)."""
        try:
            return _StagingWriter(checkpoint_dir, keep=self.keep, checksum=self.checksum, threads=self.threads,
                                  overlap_capture=self.overlap_capture)
        except Exception as exc:  # noqa: BLE001 - shared with every rank by _structure_unchanged_on_every_rank
            logger.debug("flashpoint writer for %s failed on rank %d", checkpoint_dir, dist.get_rank(), exc_info=True)
            return f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"

    def _replication_service(self, base_dir: Path, topology: NodeTopology) -> ReplicationService:
        """The replication service, started (collectively, on several nodes) at the first save."""
        if self._replication is None:
            from ml_flashpoint_nemo.replication.service import ReplicationConfig, ReplicationService

            self._replication = ReplicationService.start(base_dir, topology,
                                                         self.replication_config or ReplicationConfig())
        return self._replication

    @property
    def replication(self) -> ReplicationService | None:
        """The replication service (started at the first save), or None before it."""
        return self._replication

    def can_handle_sharded_objects(self) -> bool:
        return True

    def close(self) -> None:
        """Release this process's buffer pools of the bases saved to (RAM versions stay) and the Manager.

        No collective; safe from another thread (an abort), and any number of times. Only the
        pools of its own bases, once: a late close must not take the pools of a newer run.
        """
        with self._close_lock:  # each resource is taken by exactly one closer
            replication, self._replication = self._replication, None
            manager_future, self.manager_future = self.manager_future, None
            base_dirs, self._base_dirs = self._base_dirs, set()
            self._reports = None
        release_process_savers(base_dirs)
        if replication is not None:  # stop the push thread and the transfer server
            replication.close()
        shutdown_manager(manager_future)
        lifecycle.unregister(self)


@functools.lru_cache(maxsize=1)
def _warn_if_main_unguarded() -> None:
    script = unguarded_main_script()
    if script:
        logger.warning(
            "%s has no `if __name__ == \"__main__\":` block. Megatron's persistent async-save worker (and any "
            "other spawned process) re-runs its top level and hangs; put the training code under that guard.",
            script,
        )


def _describe(value: Any) -> tuple:
    """What the save plan depends on for one sharded value (not its data)."""
    if isinstance(value, ShardedTensor):
        return (value.key, value.dtype, tuple(value.local_shape), tuple(value.global_shape),
                tuple(value.global_offset), tuple(value.axis_fragmentations), str(value.replica_id),
                str(value.flattened_range))
    return (type(value).__name__, getattr(value, "key", None), str(getattr(value, "global_shape", None)),
            str(getattr(value, "global_offset", None)), str(getattr(value, "replica_id", None)))


def _finalize_save(writer: _StagingWriter, global_metadata: Metadata | None, reports: WorkerReports,
                   items: CoordinatorItems, *, reused_plan: bool, plan: int, through: NodeGather | None = None) -> None:
    """Every rank: place its object; coordinator: commit. Any rank's failure is raised on every rank.

    The write records go to the coordinator alone: every other rank receives small all-reduces,
    whatever the number of ranks and tensors. Under a reused plan each rank sends its object's
    record alone (rank 0 receives O(N), not O(N*T)) unless rank 0 lacks the plan's items, which it
    says in the gather's own all-reduce. Saves finalize in order, so one scheduled before the save
    that made the plan finalized still reports compactly; one queued behind a failed save reports
    in full, and rank 0 keeps the items for the next. through: the nodes' two-level gather (None: flat).
    """
    error: str | None = None
    results: list[WriteResult] = []
    try:
        if writer.staged is None:
            raise FlashpointError(writer.stage_error or "finalize ran without a staged object; was async_save interrupted?")
        reports.raise_if_failed(writer.save_id)
        results = writer.place_and_report()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        writer.abandon()
        error = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
    if reused_plan:
        errors, gathered, full = gathered_short_or_full(compact_report(results), results, error,
                                                        coordinator_needs_full=not items.holds(plan), through=through)
    else:
        (errors, gathered), full = gathered_on_coordinator(results, error, through), True
    commit_error: str | None = None
    if not errors and dist.get_rank() == 0:  # the coordinator, with every rank's records (None: it could not)
        try:
            if gathered is None:
                raise FlashpointError("rank 0 could not receive every rank's write records (see its log)")
            assert global_metadata is not None
            writer.finish(global_metadata, items.full_results(gathered, compact=not full, plan=plan))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            commit_error = f"rank 0 commit: {type(exc).__name__}: {exc}"
    if not errors:
        errors = problems_of_every_rank(commit_error)
    if errors:
        raise FlashpointError(
            f"flashpoint save of step {writer.step} failed; the previous version is intact: " + "; ".join(errors)
        )


class FlashpointLoadStrategy(TorchDistLoadShardedStrategy):
    """Loads RAM versions saved by FlashpointSaveStrategy through Megatron's usual load flow."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        capture.wait_for_captures("a load")  # it may overwrite tensors an overlapped save still copies
        reader, metadata, reformulation = self._checked_on_every_rank(sharded_state_dict, checkpoint_dir)
        sharded_state_dict, restore_data = apply_nd_flattened_tensors_reformulation(sharded_state_dict, reformulation)
        shape_checked = [t for t in nested_values(sharded_state_dict)
                         if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        shape_flexible = {t.key: t for t in nested_values(sharded_state_dict)
                          if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        original = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        torch_dcp.load_state_dict(
            pyt_state_dict,
            reader,
            planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=shape_checked,
                                     allow_shape_mismatch_sharded_tensors=shape_flexible),
        )
        self.cached_global_metadata = metadata
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, original)
        return restore_nd_flattened_tensors_formulation(state, restore_data)

    def _checked_on_every_rank(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path
    ) -> tuple[MemoryStorageReader, Metadata, dict[str, TensorReformulationMetadata]]:
        """Collective: this rank's reader, the version's metadata and reformulation, checked before DCP's collectives.

        Each node reads its own copy of the version files, so a damaged copy fails on its ranks
        alone: every rank raises that error, none waits for the others in DCP's planning.
        """
        error: Exception | None = None
        try:
            reader = self._reader(checkpoint_dir)
            assert reader.step is not None  # _reader's reset(checkpoint_id) set it
            # Megatron loaded common.pt before calling this strategy: fail the load if it was not the saved one.
            check_version_files(reader.layout, read_commit(reader.layout, reader.step))
            metadata = reader.read_metadata()
            reformulation = _reformulation_metadata(sharded_state_dict, metadata)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
        raise_if_any_rank_failed(error, f"the RAM checkpoint {os.fspath(checkpoint_dir)} cannot be loaded")
        return reader, metadata, reformulation

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Metadata | None = None):
        return super().load_tensors_metadata(checkpoint_dir, metadata or self._reader(checkpoint_dir).read_metadata())

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every ShardedTensor and ShardedObject of the version, without data (as torch_dist lists them)."""
        metadata = self._reader(checkpoint_dir).read_metadata()
        listed: dict[str, Any] = {}
        for key, stored in metadata.state_dict_metadata.items():
            if isinstance(stored, BytesStorageMetadata):
                sharded_object = ShardedObject.empty_from_unique_key(key)
                listed[sharded_object.unique_key] = sharded_object
        listed.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return listed

    @staticmethod
    def _reader(checkpoint_dir: str | Path) -> MemoryStorageReader:
        layout, checkpoint_id = _split_checkpoint_dir(checkpoint_dir)
        reader = MemoryStorageReader(layout.base_dir)
        reader.reset(checkpoint_id)
        return reader


def _reformulation_metadata(
    sharded_state_dict: ShardedStateDict, metadata: Metadata
) -> dict[str, TensorReformulationMetadata]:
    """Original global shapes of N-D flattened tensors (distributed optimizer state), from the metadata."""
    found = {}
    mcore_data = getattr(metadata, "mcore_data", {}) or {}
    for tensor in nested_values(sharded_state_dict):
        if not is_nd_flattened_tensor(tensor):
            continue
        try:
            original_shape = mcore_data[tensor.key]["nd_reformulated_orig_global_shape"]
        except KeyError as exc:
            raise CorruptCheckpointError(f"no global shape recorded for flattened tensor {tensor.key}") from exc
        stored = metadata.state_dict_metadata[tensor.key]
        if not isinstance(stored, TensorStorageMetadata):
            raise CorruptCheckpointError(f"flattened tensor {tensor.key} is stored as bytes, not as a tensor")
        found[tensor.key] = TensorReformulationMetadata(original_shape, stored.size)
    return found


register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, FlashpointLoadStrategy())
register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, FlashpointSaveStrategy())
