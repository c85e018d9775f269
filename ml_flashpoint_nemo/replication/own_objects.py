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
import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core import lifecycle, remote_objects
from ml_flashpoint_nemo.core.format import CommitRecord, ObjectRecord
from ml_flashpoint_nemo.core.layout import FETCH_LOCK_NAME, CheckpointLayout
from ml_flashpoint_nemo.core.loader import verify_object_file
from ml_flashpoint_nemo.core.topology import NodeTopology, problems_of_every_rank, reduced_ints
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.version_files import check_version_files
from ml_flashpoint_nemo.errors import CorruptCheckpointError, PeerFetchError
from ml_flashpoint_nemo.replication.placement import holder_nodes, peer_rank
from ml_flashpoint_nemo.replication.preverify import verified_ahead
from ml_flashpoint_nemo.replication.recovery import fetch_object_from, fetch_version_files
from ml_flashpoint_nemo.replication.service import PeerEndpoints, ReplicationConfig, peer_endpoints

logger = logging.getLogger(__name__)

CHOSEN, SKIPPED, ELASTIC = "chosen", "skipped", "elastic"
_NO_RANK = 1 << 62  # larger than any rank (and any CRC), for a MIN computed as a MAX of negated values


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
        self._checked: set[tuple[int, str]] = set()  # (step, object) checked or fetched on this node for a load

    def start(self) -> PeerEndpoints:
        """Collective the first time (every rank calls it at the same point): servers up, addresses known."""
        if self.endpoints is None:
            self.endpoints = peer_endpoints(self.base_dir, self.config, topology=self.topology)
            lifecycle.register(self, RecoverySession.close, "the recovery's transfer server")
        return self.endpoints

    def fetch_for_load(self, step: int, record: ObjectRecord) -> None:
        """core.remote_objects' fetcher: another rank's object, checked once on this node, else fetched.

        Under a lock per node (the ranks of a node share its files): the first rank checks a
        present copy (a replica or an earlier fetch) in full or fetches it, and notes the file
        it vouches for (device, inode, size, mtime) in the lock file; the node's other ranks find
        that note and neither read nor fetch it again.
        """
        if record.rank == self.topology.rank or (step, record.name) in self._checked:
            return  # this rank's own objects were checked by the choice
        layout = CheckpointLayout(self.base_dir)
        path = layout.object_path(step, record.name)
        with _node_lock(layout) as notes:
            if path.is_file():
                if _identity(step, path) in _read_notes(notes):
                    self._checked.add((step, record.name))
                    return
                try:
                    verify_object_file(path, record, default_copy_threads())
                    _note(notes, _identity(step, path))
                    self._checked.add((step, record.name))
                    return
                except CorruptCheckpointError as exc:
                    logger.warning("%s of step %d on this node is damaged (%s); fetching it again", record.name,
                                   step, exc)
                    path.unlink(missing_ok=True)
            endpoints = self.endpoints
            if endpoints is None:
                raise PeerFetchError(f"{record.name} of step {step} is not on this node and the recovery's "
                                     "transfer servers have stopped; load the version the restart chose")
            failure = _fetch(layout, step, record, self._sources(record.rank, endpoints), endpoints, self.config)
            if failure:
                raise PeerFetchError(f"{record.name} of step {step}, which this load reads, could not be "
                                     f"fetched from a node that holds it: {failure}")
            _note(notes, _identity(step, path))  # verified against its commit record by the fetch
            self._checked.add((step, record.name))

    def _sources(self, saving_rank: int, endpoints: PeerEndpoints) -> list[int]:
        """Ranks whose nodes hold saving_rank's objects: per holder node, the paired rank first, then the others.

        The holders are taken in an order that depends on this node, so that the nodes reading
        one object do not all ask the same server first.
        """
        topology = self.topology
        nodes = [n for n in holder_nodes(topology, saving_rank, self.config.factor) if n != topology.node]
        if nodes:
            turn = topology.node % len(nodes)
            nodes = nodes[turn:] + nodes[:turn]
        ranks = []
        for node in nodes:
            paired = peer_rank(topology, saving_rank, node)
            ranks += [paired] + [r for r in topology.ranks_of_node(node) if r != paired]
        return [r for r in ranks if endpoints.addresses[r] is not None]

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


def _own_sources(topology: NodeTopology, factor: int) -> list[int]:
    """The ranks paired with this one on the nodes the placement pushed its objects to."""
    nodes = holder_nodes(topology, topology.rank, factor)
    return [peer_rank(topology, topology.rank, node) for node in nodes if node != topology.node]


@contextlib.contextmanager
def _node_lock(layout: CheckpointLayout) -> Iterator[int]:
    """Exclusive among the processes sharing this node's base directory (flock on a file there); yields its fd.

    The file also holds the notes of the objects a rank of the node checked for a load (_note).
    """
    fd = os.open(os.path.join(layout.base_dir, FETCH_LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


_NOTES_LIMIT = 1 << 20  # the notes are ~100 B per object read from elsewhere; past this they start over


def _identity(step: int, path: os.PathLike[str] | str) -> str:
    """The file a check vouched for: step, name, device, inode, size and modification time."""
    info = os.stat(path)
    return f"{step} {os.path.basename(path)} {info.st_dev} {info.st_ino} {info.st_size} {info.st_mtime_ns}"


def _read_notes(fd: int) -> set[str]:
    size = os.fstat(fd).st_size
    if size > _NOTES_LIMIT:  # written only by this node's ranks; bounded all the same
        os.ftruncate(fd, 0)
        return set()
    return set(os.pread(fd, size, 0).decode("utf-8", "replace").splitlines())


def _note(fd: int, identity: str) -> None:
    os.pwrite(fd, (identity + "\n").encode(), os.fstat(fd).st_size)


def _fetch(layout: CheckpointLayout, step: int, record: ObjectRecord, sources: list[int], endpoints: PeerEndpoints,
           config: ReplicationConfig) -> str | None:
    """Fetch one object from the first of sources that has it intact; None, or why not."""
    if not sources:
        return "no other node holds a copy"
    return fetch_object_from(layout, step, record, sources, endpoints, config) or None


def settle(layout: CheckpointLayout, step: int, topology: NodeTopology, session: RecoverySession) -> Verdict:
    """Collective: whether step can be resumed from at the saved layout, after restoring what this rank lacks."""
    rank = topology.rank
    commit, digest = _readable_commit(layout, step)
    holder = rank if commit is not None else -1
    lacking, negated_lowest, highest, top_digest, negated_low_digest = reduced_ints(
        [int(commit is None), -(holder if holder >= 0 else _NO_RANK), holder, digest, -(digest if digest >= 0 else
                                                                                       _NO_RANK)])
    if highest < 0:
        return Verdict(SKIPPED, (f"no node can read the commit record of step {step}",))
    if top_digest != -negated_low_digest:  # e.g. a node that rejoined with an older job's step of that number
        return Verdict(SKIPPED, (f"the nodes hold different commit records for step {step}",))
    if lacking:
        endpoints = session.start()
        problem = None
        if commit is None and topology.is_leader:
            problem = _fetch_files_from(layout, step, endpoints, session.config, [-negated_lowest, highest])
        failed = problems_of_every_rank(problem)
        if failed:
            return Verdict(SKIPPED, tuple(failed))
        commit, _ = _readable_commit(layout, step)  # the leader put it in place; its node's ranks read it now
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
    if topology.node_count > 1:  # the loads may read other ranks' objects: every node must serve its own
        endpoints = session.start()
        if not any(endpoints.addresses[r] is not None for r in topology.ranks_of_node(topology.node)):
            problem = problem or (f"rank {rank}: no rank of its node could start a transfer server, so the other "
                                  "nodes could not read this node's objects")
        if missing and problem is None:
            problem = _fetch_own(layout, step, missing, topology, endpoints, session.config)
    elif any_missing and missing:
        problem = problem or (f"rank {rank}: its object {missing[0].name} of step {step} is not on this node, and "
                              "the job has no other node that could hold a copy")
    if problem is None:
        try:
            check_version_files(layout, commit)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the all-reduce below
            problem = f"rank {rank}: {type(exc).__name__}: {exc}"
    failed = problems_of_every_rank(problem)
    return Verdict(SKIPPED, tuple(failed)) if failed else Verdict(CHOSEN)


def _fetch_own(layout: CheckpointLayout, step: int, missing: list[ObjectRecord], topology: NodeTopology,
               endpoints: PeerEndpoints, config: ReplicationConfig) -> str | None:
    """Fetch this rank's missing objects: from the nodes the placement pushed them to, else from any node.

    Another node than the placement's holds them when the ranks sit on other hosts than when they
    were saved (a launcher that ordered the nodes differently): each node is then asked once,
    by this rank alone, with no collective.
    """
    placed = _own_sources(topology, config.factor)
    others = [peer_rank(topology, topology.rank, n) for n in range(topology.node_count) if n != topology.node]
    sources = [r for r in dict.fromkeys(placed + others) if endpoints.addresses[r] is not None]
    for record in missing:
        failure = _fetch(layout, step, record, sources, endpoints, config)
        if failure:
            return (f"rank {topology.rank}: its object {record.name} of step {step} is on no node that answered: "
                    f"every copy was lost ({failure})")
    logger.info("Rank %d fetched %d of its objects of step %d from their replicas", topology.rank, len(missing), step)
    return None


def _readable_commit(layout: CheckpointLayout, step: int) -> tuple[CommitRecord | None, int]:
    """This node's commit record of step and the CRC32C of its bytes; (None, -1) when absent or unreadable."""
    try:
        raw = layout.commit_path(step).read_bytes()
        record = CommitRecord.decode(raw, str(layout.commit_path(step)))
        return (record, _core.crc32c(raw)) if record.step == step else (None, -1)
    except Exception:  # noqa: BLE001 - absent or unreadable: this node takes it from a peer
        return None, -1


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
