"""Recovery at the saved world size: each rank restores its own objects, and a node nothing more.

Used by replication.choice for every candidate version saved by as many ranks as the job now
has. Per candidate, every rank takes the same path through the same collectives, each of a
size that does not depend on the number of ranks (fixed-size all-reduces; messages are
gathered only when some rank has a problem):

1. The version files: a node whose commit record is missing or unreadable gets the record
   and the files it lists from the lowest (else the highest) rank that holds them.
2. The layout: a candidate saved by another world size ends here (ELASTIC): the caller then
   makes every object present on every node, which a resharding load may read.
3. Each rank's own objects: present on its node and intact (checked ahead in the background,
   else read in full), else dropped when proven corrupt and fetched from the nodes the
   placement pushed them to, verified against the commit record.

After the choice every object of the version is on the node of the rank that saved it, and
the session's transfer servers keep running: a load that reads another rank's object (a
replicated tensor is stored once) fetches it then through core.remote_objects, from that
rank's node. So a restart with no node lost moves no object during the choice, and one after
a node was wiped moves that node's ranks' objects (and only what its loads read besides).
The servers stop when the next save starts replication (every rank has loaded by then:
training steps synchronise the ranks), at an abort, or at exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass

from ml_flashpoint_nemo.core import lifecycle, remote_objects
from ml_flashpoint_nemo.core.format import CommitRecord, ObjectRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.loader import verify_object_file
from ml_flashpoint_nemo.core.topology import NodeTopology, problems_of_every_rank, reduced_ints
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.version_files import check_version_files
from ml_flashpoint_nemo.core.versions import read_commit
from ml_flashpoint_nemo.errors import CorruptCheckpointError
from ml_flashpoint_nemo.replication.placement import holder_nodes, peer_rank
from ml_flashpoint_nemo.replication.preverify import verified_ahead
from ml_flashpoint_nemo.replication.recovery import fetch_object_from, fetch_version_files
from ml_flashpoint_nemo.replication.service import PeerEndpoints, ReplicationConfig, peer_endpoints

logger = logging.getLogger(__name__)

CHOSEN, SKIPPED, ELASTIC = "chosen", "skipped", "elastic"
_NO_RANK = 1 << 62  # larger than any rank, for the MIN-as-MAX of the holders of a commit record


@dataclass(frozen=True)
class Verdict:
    outcome: str  # CHOSEN, SKIPPED or ELASTIC
    reasons: tuple[str, ...] = ()


class RecoverySession:
    """This rank's transfer server and its peers' addresses for one recovery, started on demand (collective)."""

    def __init__(self, base_dir: str | os.PathLike[str], topology: NodeTopology, config: ReplicationConfig) -> None:
        self.base_dir = os.fspath(base_dir)
        self.topology = topology
        self.config = config
        self.endpoints: PeerEndpoints | None = None
        self._lock = threading.Lock()

    def start(self) -> PeerEndpoints:
        """Collective the first time (every rank calls it at the same point): servers up, addresses known."""
        if self.endpoints is None:
            self.endpoints = peer_endpoints(self.base_dir, self.config, topology=self.topology)
            lifecycle.register(self, RecoverySession.close, "the recovery's transfer server")
        return self.endpoints

    def fetch_for_load(self, step: int, record: ObjectRecord) -> None:
        """core.remote_objects' fetcher: the object from its saving rank's node (else its replicas'), checked."""
        endpoints = self.endpoints
        if endpoints is None:
            raise CorruptCheckpointError(f"{record.name} of step {step} is not on this node and the recovery's "
                                         "transfer servers have stopped; load the version the restart chose")
        layout = CheckpointLayout(self.base_dir)
        failure = _fetch(layout, step, record, _sources(self.topology, record.rank, self.config.factor), endpoints,
                         self.config)
        if failure:
            raise CorruptCheckpointError(f"{record.name} of step {step}, which this load reads, could not be fetched "
                                         f"from the node of rank {record.rank}: {failure}")

    def keep_for_loads(self) -> None:
        """Serve and fetch the objects the coming loads read, until core.remote_objects.stop_fetching (or close)."""
        remote_objects.register_fetcher(self.base_dir, self.fetch_for_load, self.close)

    def close(self) -> None:
        """Stop the server; no collective, idempotent, safe from another thread."""
        with self._lock:
            endpoints, self.endpoints = self.endpoints, None
        remote_objects.unregister_fetcher(self.base_dir, self.fetch_for_load)
        if endpoints is not None:
            endpoints.close()
        lifecycle.unregister(self)


atexit.register(remote_objects.stop_all)


def _sources(topology: NodeTopology, saving_rank: int, factor: int) -> list[int]:
    """The ranks whose nodes hold saving_rank's objects (its own node first, then its replicas'), not this one."""
    nodes = holder_nodes(topology, saving_rank, factor)
    return [peer_rank(topology, saving_rank, node) for node in nodes if node != topology.node]


def _fetch(layout: CheckpointLayout, step: int, record: ObjectRecord, sources: list[int], endpoints: PeerEndpoints,
           config: ReplicationConfig) -> str | None:
    """Fetch one object from the first of sources that has it intact; None, or why not."""
    if not sources:
        return "no other node holds a copy"
    return fetch_object_from(layout, step, record, sources, endpoints, config) or None


def settle(layout: CheckpointLayout, step: int, topology: NodeTopology, session: RecoverySession) -> Verdict:
    """Collective: whether step can be resumed from at the saved layout, after restoring what this rank lacks."""
    rank = topology.rank
    commit = _readable_commit(layout, step)
    holder = rank if commit is not None else -1
    lacking, negated_lowest, highest = reduced_ints([int(commit is None), -(holder if holder >= 0 else _NO_RANK),
                                                     holder])
    if lacking:
        if highest < 0:
            return Verdict(SKIPPED, (f"no node can read the commit record of step {step}",))
        endpoints = session.start()
        problem = None
        if commit is None and topology.is_leader:
            problem = _fetch_files_from(layout, step, endpoints, session.config, [-negated_lowest, highest])
        failed = problems_of_every_rank(problem)
        if failed:
            return Verdict(SKIPPED, tuple(failed))
        commit = _readable_commit(layout, step)  # the leader put it in place; its node's ranks read it now
    elastic = commit is not None and commit.world_size != len(topology.node_of_rank)
    any_elastic, any_unreadable = reduced_ints([int(elastic), int(commit is None)])
    if any_unreadable:
        problem = None if commit is not None else f"rank {rank}: the commit record of step {step} cannot be read"
        return Verdict(SKIPPED, tuple(problems_of_every_rank(problem)))
    if any_elastic:
        return Verdict(ELASTIC)
    assert commit is not None  # every rank read it (the all-reduce above)
    missing, problem = _own_objects_to_fetch(layout, step, commit, topology)
    (any_missing,) = reduced_ints([int(bool(missing))])
    if any_missing and topology.node_count < 2:
        problem = problem or (f"rank {rank}: its object {missing[0].name} of step {step} is not on this node, and "
                              "the job has no other node that could hold a copy" if missing else None)
    elif any_missing:
        endpoints = session.start()
        for record in missing:
            if problem is None:
                failure = _fetch(layout, step, record, _sources(topology, rank, session.config.factor), endpoints,
                                 session.config)
                if failure:
                    problem = (f"rank {rank}: its object {record.name} of step {step} is on none of the nodes it was "
                               f"replicated to: every copy was lost ({failure})")
        if missing and problem is None:
            logger.info("Rank %d fetched %d of its objects of step %d from their replicas", rank, len(missing), step)
    if problem is None:
        try:
            check_version_files(layout, commit)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the all-reduce below
            problem = f"rank {rank}: {type(exc).__name__}: {exc}"
    failed = problems_of_every_rank(problem)
    return Verdict(SKIPPED, tuple(failed)) if failed else Verdict(CHOSEN)


def _readable_commit(layout: CheckpointLayout, step: int) -> CommitRecord | None:
    try:
        return read_commit(layout, step)
    except Exception:  # noqa: BLE001 - absent or unreadable: this node takes it from a peer
        return None


def _fetch_files_from(layout: CheckpointLayout, step: int, endpoints: PeerEndpoints, config: ReplicationConfig,
                      sources: list[int]) -> str | None:
    failures = []
    for source in dict.fromkeys(sources):
        try:
            fetch_version_files(layout, step, endpoints, source, config)
            return None
        except Exception as exc:  # noqa: BLE001 - the next holder, then report
            failures.append(f"from rank {source}: {type(exc).__name__}: {exc}")
    return f"rank {endpoints.rank} could not fetch the files of step {step}: " + "; ".join(failures)


def _own_objects_to_fetch(layout: CheckpointLayout, step: int, commit: CommitRecord,
                          topology: NodeTopology) -> tuple[list[ObjectRecord], str | None]:
    """This rank's objects of step that its node lacks or holds corrupt (dropped), and any other problem.

    A corrupt copy is dropped only when another node may hold a good one; an unreadable one
    (an I/O error may hit the only good copy) is left and reported.
    """
    rank, missing = topology.rank, []
    try:
        for record in commit.objects:
            if record.rank != rank:
                continue
            path = layout.object_path(step, record.name)
            if not path.is_file():
                missing.append(record)
                continue
            if verified_ahead(layout.base_dir, rank, path, record):
                continue
            try:
                verify_object_file(path, record, default_copy_threads())
            except CorruptCheckpointError as exc:
                if topology.node_count < 2:
                    raise
                logger.warning("RAM checkpoint step %d: rank %d drops the corrupt object %s to fetch a peer's "
                               "replica: %s", step, rank, record.name, exc)
                path.unlink(missing_ok=True)
                missing.append(record)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the all-reduce that follows
        return [], f"rank {rank}: {type(exc).__name__}: {exc}"
    return missing, None
