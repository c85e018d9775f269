"""The version a job resumes from: the newest RAM version complete and intact on every rank.

It sits above core because completing a version may take a peer's replica (replication.recovery).

Ranks must never resume from different versions, and never from a version with a missing or
flipped byte. The candidates are the steps committed on some node, newest first, found by
fixed-size all-reduces. A candidate saved by as many ranks as the job has is settled by
replication.own_objects: a node lacking the version files takes them from a peer, each rank
checks its own objects (objects preverify.verify_ahead already checked in the background are
not read again) and fetches those its node lacks or holds corrupt from their replicas, and the
first candidate that checks out on every rank wins. Nothing is gathered whose size grows with
the job, and no node copies objects it does not need: the objects of other ranks that a load
reads are fetched by that load. A candidate saved by another world size (an elastic restart;
the load strategies reshard) is checked as before: every object on every node, each node's
share checked there. Skipped candidates are logged with the reason on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo.core import remote_objects
from ml_flashpoint_nemo.core.layout import CheckpointLayout, not_private_problem
from ml_flashpoint_nemo.core.loader import verify_object_file
from ml_flashpoint_nemo.core.topology import NodeTopology, discover_nodes, problems_of_every_rank, reduced_ints
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.version_files import check_version_files
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.errors import BaseDirError, CorruptCheckpointError
from ml_flashpoint_nemo.replication.own_objects import CHOSEN, ELASTIC, RecoverySession, settle
from ml_flashpoint_nemo.replication.preverify import verified_ahead
from ml_flashpoint_nemo.replication.recovery import fetch_missing_from_peers
from ml_flashpoint_nemo.replication.service import ReplicationConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryChoice:
    """The agreed version (None: no RAM version is usable) and why newer ones were skipped."""

    step: int | None
    skipped: dict[int, list[str]] = field(default_factory=dict)

    def path(self, base_dir: str | os.PathLike[str]) -> str | None:
        return None if self.step is None else str(CheckpointLayout(base_dir).version_dir(self.step))


def _local_problem(layout: CheckpointLayout, step: int, topology: NodeTopology, elastic: bool = True) -> str | None:
    """Why this rank cannot resume from step (None if it can).

    Every object must be on this node: a load may read any rank's object (replicated tensors
    are stored once, and a job restarted with another layout reads other ranks' shards).
    Without elastic, a version saved by another world size cannot be resumed from.
    """
    rank = topology.rank
    try:
        commit = read_commit(layout, step)
        if not elastic and commit.world_size != len(topology.node_of_rank):
            return f"rank {rank}: it was saved by {commit.world_size} ranks; " + _other_world_size(
                len(topology.node_of_rank)
            )
        absent = [o.name for o in commit.objects if not layout.object_path(step, o.name).is_file()]
        if absent:
            return f"rank {rank}: {len(absent)} objects are not on this node, e.g. {absent[0]}"
        check_version_files(layout, commit)
        ranks = _ranks_to_verify(commit.world_size, topology)
        for record in commit.objects:
            path = layout.object_path(step, record.name)
            if record.rank in ranks and not verified_ahead(layout.base_dir, rank, path, record):
                verify_object_file(path, record, default_copy_threads())
    except Exception as exc:  # noqa: BLE001 - any failure, not only the expected ones: every rank must reach the gather
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return None


def _ranks_to_verify(saved_world_size: int, topology: NodeTopology) -> list[int]:
    """The saving ranks whose objects this rank checks.

    At the saved world size, its own (as every rank reads mostly its own shard). At another
    world size (an elastic restart), the node's ranks share all saved ranks' objects, so that
    every object this node may read is checked once on it.
    """
    if saved_world_size == len(topology.node_of_rank):
        return [topology.rank]
    node_ranks = topology.ranks_of_node(topology.node)
    share = node_ranks.index(topology.rank)
    return [r for r in range(saved_world_size) if r % len(node_ranks) == share]


def _drop_corrupt_objects_on_every_rank(layout: CheckpointLayout, step: int, topology: NodeTopology) -> bool:
    """Collective: each rank deletes the objects it checks (_ranks_to_verify) that fail; True if any rank did.

    A peer node may hold a good replica, which the fetch that follows brings back; without
    one the version stays unusable, as it already was with the corrupt copy.
    """
    dropped, rank = [], topology.rank
    try:  # nothing here may raise on this rank alone: the others wait in the gather below
        commit = read_commit(layout, step)
        mine = _ranks_to_verify(commit.world_size, topology)
        records = [r for r in commit.objects if r.rank in mine]
    except Exception:  # noqa: BLE001 - reported by _local_problem; nothing to drop here
        records = []
    for record in records:
        path = layout.object_path(step, record.name)
        try:
            verify_object_file(path, record)
        except CorruptCheckpointError as exc:  # only proven damage: an I/O error may hit the only good copy
            logger.warning(
                "RAM checkpoint step %d: rank %d drops the corrupt object %s to fetch a peer's replica: %s",
                step,
                rank,
                record.name,
                exc,
            )
            try:
                path.unlink(missing_ok=True)
                dropped.append(record.name)
            except OSError as unlink_error:  # kept; every rank must still reach the collective below
                logger.warning("cannot drop %s: %s", path, unlink_error)
        except Exception:  # noqa: BLE001 - absent, unreadable or odd: reported by _local_problem, left as it is
            continue
    return bool(problems_of_every_rank(", ".join(dropped) or None))


def refuse_unless_private_everywhere(layout: CheckpointLayout) -> None:
    """Collective: raise BaseDirError on every rank if any rank's base directory is not private to the job's user.

    A directory another user owns or may write can hold a planted version; nothing is loaded from
    any node then, since the ranks must agree (one small all-reduce when every directory is fine).
    """
    problem = not_private_problem(layout.base_dir)
    failed = problems_of_every_rank(problem and f"rank {dist.get_rank()}: {problem}")
    if failed:
        raise BaseDirError("no RAM checkpoint is loaded on any rank: " + "; ".join(failed))


def choose_version(
    base_dir: str | os.PathLike[str], config: ReplicationConfig | None = None, *, elastic: bool = True
) -> RecoveryChoice:
    """Collective: the newest step every rank can resume from, checked on every rank.

    Candidates saved by as many ranks as the job has are settled by replication.own_objects
    (each rank restores its own objects; fixed-size collectives). Once the newest candidate
    left was saved by another world size, the choice goes on as an elastic restart needs it:
    every object on every node (_choose_with_every_object_on_every_node). With elastic=False
    (a caller that cannot reshard) such candidates are skipped instead, so an older version
    saved by as many ranks as the job has is still found, and nothing is fetched for them.
    """
    layout = CheckpointLayout(base_dir)
    remote_objects.stop_fetching(base_dir)  # a choice before this one served its loads, which every rank has done
    refuse_unless_private_everywhere(layout)
    config = config or ReplicationConfig()
    if dist.get_world_size() == 1:
        return _choose_with_every_object_on_every_node(base_dir, config, fetch=False, elastic=elastic)
    rank = dist.get_rank()
    try:  # a rank that cannot list its versions offers none; it must still reach the all-reduces
        local = set(committed_steps(layout))
    except Exception as exc:  # noqa: BLE001 - logged; this rank offers no version
        logger.warning("Rank %d cannot list its RAM checkpoint versions in %s: %s", rank, layout.base_dir, exc)
        local = set()
    topology = discover_nodes(base_dir, config.failure_domain)  # the holders of each rank's copies depend on it
    session = RecoverySession(base_dir, topology, config)
    skipped: dict[int, list[str]] = {}
    below: int | None = None
    serving = False
    try:
        while True:
            (step,) = reduced_ints([max((s for s in local if below is None or s < below), default=-1)])
            if step < 0:
                _log_skipped(skipped, None)
                return RecoveryChoice(None, skipped)
            verdict = settle(layout, step, topology, session)
            if verdict.outcome == ELASTIC and not elastic:  # agreed on every rank by settle's all-reduce
                skipped[step] = [_other_world_size(dist.get_world_size())]
                below = step
                continue
            if verdict.outcome == ELASTIC:
                session.close()
                return _choose_with_every_object_on_every_node(base_dir, config, fetch=True, skipped=skipped,
                                                               below=below)
            if verdict.outcome == CHOSEN:
                if topology.node_count > 1:  # a load may read another rank's object: its node serves it (settle
                    session.keep_for_loads()  # started the servers)
                    serving = True
                _log_skipped(skipped, step)
                return RecoveryChoice(step, skipped)
            skipped[step] = list(verdict.reasons)
            below = step
    finally:
        if not serving:
            session.close()


def _choose_with_every_object_on_every_node(
    base_dir: str | os.PathLike[str],
    config: ReplicationConfig,
    *,
    fetch: bool,
    skipped: dict[int, list[str]] | None = None,
    below: int | None = None,
    elastic: bool = True,
) -> RecoveryChoice:
    """Collective: the choice for an elastic restart (or a single rank), which may read any saved rank's object.

    Each node first fetches every object it lacks of the newest version that can be completed
    (replication.recovery); the candidates are then the steps committed on every node, below
    `below` (the newer ones were settled at the saved layout and skipped, for `skipped`' reasons).
    With elastic=False (a single rank only) a candidate saved by another world size is skipped.
    The fetches and the node discovery use the job's config (its host, timeouts, failure domain).
    """
    if fetch:
        fetch_missing_from_peers(base_dir, config, below=below)
    layout = CheckpointLayout(base_dir)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:  # a rank that cannot list its versions offers none; it must still reach the gather
        local = {s for s in committed_steps(layout) if below is None or s < below}
    except Exception as exc:  # noqa: BLE001 - logged; this rank offers no version
        logger.warning("Rank %d cannot list its RAM checkpoint versions in %s: %s", rank, layout.base_dir, exc)
        local = set()
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, sorted(local))
    candidates = sorted(set.intersection(*(set(s) for s in everyone)), reverse=True)
    newest_anywhere = max((s for steps in everyone for s in steps), default=None)
    skipped = dict(skipped or {})
    if newest_anywhere is not None and (not candidates or candidates[0] != newest_anywhere):
        missing_on = [r for r, steps in enumerate(everyone) if newest_anywhere not in steps]
        skipped[newest_anywhere] = [f"not committed on the node of ranks {missing_on}"]
    topology = discover_nodes(base_dir, config.failure_domain) if candidates else None
    for step in candidates:
        assert topology is not None  # discovered above whenever there are candidates
        found = problems_of_every_rank(_local_problem(layout, step, topology, elastic))
        if (
            found
            and world_size > 1
            and topology.node_count > 1
            and _drop_corrupt_objects_on_every_rank(layout, step, topology)
        ):  # a peer may hold a good replica
            fetch_missing_from_peers(base_dir, config, only_step=step)  # a peer's replica replaces what was dropped
            found = problems_of_every_rank(_local_problem(layout, step, topology, elastic))
        if not found:
            _log_skipped(skipped, step)
            return RecoveryChoice(step, skipped)
        skipped[step] = found
    _log_skipped(skipped, None)
    return RecoveryChoice(None, skipped)


def _other_world_size(world_size: int) -> str:
    return (
        f"the job has {world_size} ranks and its loader does not reshard (a version saved by another number of ranks)"
    )


def _log_skipped(skipped: dict[int, list[str]], chosen: int | None) -> None:
    """Rank 0 logs the choice: every rank holds the same reasons (gathered from every rank), so N copies say nothing more."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for step, reasons in sorted(skipped.items(), reverse=True):
        logger.warning("RAM checkpoint step %d is not used: %s", step, "; ".join(reasons))
    if chosen is None and skipped:
        logger.warning("No RAM checkpoint version is usable on every rank; fall back to the durable checkpoint")
    if chosen is not None:
        logger.info("Resuming from RAM checkpoint step %d", chosen)
