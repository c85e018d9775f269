"""The version a job resumes from: the newest RAM version complete and intact on every rank.

It sits above core because completing a version may take a peer's replica (replication.recovery).

Ranks must never resume from different versions, and never from a version with a
missing or flipped byte. Each rank lists the versions committed on its node; the
candidates are the steps committed on every node, newest first; for each candidate
every rank checks that every object is on its node, its own objects (at another world
size: its share of the node's objects; objects preverify.verify_ahead already checked in the
background are not read again) and the version's files, and the first candidate
that checks out on every rank wins. A version saved by another world size or layout is a
candidate like any other: the load strategies reshard. Skipped candidates are logged with the reason on
every rank. Two small all-gathers per candidate, no data moved. When a candidate fails
because a rank's own object is corrupt, that object is dropped and fetched again from a
peer's replica (when one exists) before the candidate is checked once more.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import verify_object_file
from ml_flashpoint_nemo.core.topology import NodeTopology, discover_nodes, problems_of_every_rank
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.version_files import check_version_files
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.errors import CorruptCheckpointError
from ml_flashpoint_nemo.replication.preverify import verified_ahead
from ml_flashpoint_nemo.replication.recovery import fetch_missing_from_peers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryChoice:
    """The agreed version (None: no RAM version is usable) and why newer ones were skipped."""

    step: int | None
    skipped: dict[int, list[str]] = field(default_factory=dict)

    def path(self, base_dir: str | os.PathLike[str]) -> str | None:
        return None if self.step is None else str(CheckpointLayout(base_dir).version_dir(self.step))


def _local_problem(layout: CheckpointLayout, step: int, topology: NodeTopology) -> str | None:
    """Why this rank cannot resume from step (None if it can).

    Every object must be on this node: a load may read any rank's object (replicated tensors
    are stored once, and a job restarted with another layout reads other ranks' shards).
    """
    rank = topology.rank
    try:
        commit = read_commit(layout, step)
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
            logger.warning("RAM checkpoint step %d: rank %d drops the corrupt object %s to fetch a peer's replica: %s",
                           step, rank, record.name, exc)
            try:
                path.unlink(missing_ok=True)
                dropped.append(record.name)
            except OSError as unlink_error:  # kept; every rank must still reach the collective below
                logger.warning("cannot drop %s: %s", path, unlink_error)
        except Exception:  # noqa: BLE001 - absent, unreadable or odd: reported by _local_problem, left as it is
            continue
    return bool(problems_of_every_rank(", ".join(dropped) or None))


def choose_version(base_dir: str | os.PathLike[str]) -> RecoveryChoice:
    """Collective: the newest step every rank can resume from, checked on every rank."""
    if dist.get_world_size() > 1:  # first fetch what this node lacks (objects, version files) from peers
        fetch_missing_from_peers(base_dir)
    layout = CheckpointLayout(base_dir)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:  # a rank that cannot list its versions offers none; it must still reach the gather
        local = set(committed_steps(layout))
    except Exception as exc:  # noqa: BLE001 - logged; this rank offers no version
        logger.warning("Rank %d cannot list its RAM checkpoint versions in %s: %s", rank, layout.base_dir, exc)
        local = set()
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, sorted(local))
    candidates = sorted(set.intersection(*(set(s) for s in everyone)), reverse=True)
    newest_anywhere = max((s for steps in everyone for s in steps), default=None)
    skipped: dict[int, list[str]] = {}
    if newest_anywhere is not None and (not candidates or candidates[0] != newest_anywhere):
        missing_on = [r for r, steps in enumerate(everyone) if newest_anywhere not in steps]
        skipped[newest_anywhere] = [f"not committed on the node of ranks {missing_on}"]
    topology = discover_nodes(base_dir) if candidates else None
    for step in candidates:
        assert topology is not None  # discovered above whenever there are candidates
        found = problems_of_every_rank(_local_problem(layout, step, topology))
        if found and world_size > 1 and topology.node_count > 1 \
                and _drop_corrupt_objects_on_every_rank(layout, step, topology):  # a peer may hold a good replica
            fetch_missing_from_peers(base_dir, only_step=step)  # a peer's replica replaces what was dropped
            found = problems_of_every_rank(_local_problem(layout, step, topology))
        if not found:
            _log_skipped(skipped, step)
            return RecoveryChoice(step, skipped)
        skipped[step] = found
    _log_skipped(skipped, None)
    return RecoveryChoice(None, skipped)


def _log_skipped(skipped: dict[int, list[str]], chosen: int | None) -> None:
    for step, reasons in sorted(skipped.items(), reverse=True):
        logger.warning("RAM checkpoint step %d is not used: %s", step, "; ".join(reasons))
    if chosen is not None:
        logger.info("Resuming from RAM checkpoint step %d", chosen)
