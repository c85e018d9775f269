"""Recovery step before replication.choice.choose_version: fetch what this node lacks from peer nodes.

Collective; every rank takes the same path through the same collectives:

1. discover_nodes (one all_gather), then one all_gather of every rank's inventory:
   {step: (commit record readable, object names present)}. Every decision below is computed
   from this snapshot, identically on every rank.
2. Candidates: steps committed on at least one node, newest first. A candidate that every
   node already holds completely ends the step (nothing to fetch; choose_version checks it).
3. The first time something must be fetched, every rank starts a short-lived TransferServer
   on its node's base directory (fresh secret by broadcast, addresses by all_gather).
4. Phase A: the leader of each node without the commit record fetches the version-level
   files from a node that has it, checks them against the record, then puts the record in
   place (atomically, last). One all_gather of errors.
5. Phase B: the objects the node lacks are split over its ranks; each rank fetches its share
   in parallel from nodes that hold them (another holder if one fails) and verifies each
   against the commit record (header+index CRC, then every record's data CRC) before keeping
   it. One all_gather of problems. Success ends the step; a problem (e.g. every copy of an
   object lost) moves to the next older candidate.
6. Servers stop after the last all_gather, so no rank stops serving while another fetches.
"""

from __future__ import annotations

import array
import concurrent.futures
import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.format import CommitRecord, ObjectRecord, whole_object_crc32c
from ml_flashpoint_nemo.core.layout import (
    COMMIT_NAME,
    REPLICA_SPARES,
    CheckpointLayout,
    rank_of_object,
    temporary_name,
    version_file_name_problem,
    version_relpath,
)
from ml_flashpoint_nemo.core.loader import open_object
from ml_flashpoint_nemo.core.topology import NodeTopology, discover_nodes, problems_of_every_rank
from ml_flashpoint_nemo.core.version_files import FILES_KEY, check_version_files
from ml_flashpoint_nemo.core.versions import fsync_directory, read_commit
from ml_flashpoint_nemo.errors import ChecksumError, CorruptCheckpointError, FormatVersionError
from ml_flashpoint_nemo.replication.placement import peer_rank
from ml_flashpoint_nemo.replication.service import PeerEndpoints, ReplicationConfig, peer_endpoints

logger = logging.getLogger(__name__)

FETCH_THREADS = 4


def _inventory(layout: CheckpointLayout) -> dict[int, tuple[bool, list[str]]]:
    found = {}
    for step in layout.version_steps():
        try:
            names = os.listdir(layout.version_dir(step))
        except FileNotFoundError:
            continue
        try:
            read_commit(layout, step)
            committed = True
        except Exception:  # noqa: BLE001 - unreadable or absent: this node needs the record from a peer
            committed = False
        found[step] = (committed, sorted(n for n in names if rank_of_object(n) is not None))
    return found


def _inventory_or_nothing(layout: CheckpointLayout) -> dict[int, tuple[bool, list[str]]]:
    """This node's inventory; a node that cannot list its versions offers none (it must reach the gather)."""
    try:
        return _inventory(layout)
    except Exception as exc:  # noqa: BLE001 - logged; peers then see a node holding nothing
        logger.warning("Rank %d cannot list its RAM checkpoint versions in %s (%s: %s); it offers none to its peers",
                       dist.get_rank(), layout.base_dir, type(exc).__name__, exc)
        return {}


def fetch_missing_from_peers(
    base_dir: str | os.PathLike[str], config: ReplicationConfig | None = None, *, only_step: int | None = None,
    below: int | None = None,
) -> int | None:
    """Collective: make the newest step possible complete on every node; returns it (None: none can be).

    only_step: consider that step alone (recovery refetching the objects it dropped from a version
    that is not the newest). below: consider only older steps (the newer ones were settled otherwise).
    """
    config = config or ReplicationConfig()
    layout = CheckpointLayout(base_dir)
    try:
        layout.base_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # a wiped node: same identity as before the wipe
    except OSError:
        pass
    topology = discover_nodes(base_dir, config.failure_domain)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _inventory_or_nothing(layout))
    if topology.node_count < 2:
        return None
    nodes = [everyone[leader] for leader in topology.leaders]
    steps = sorted({s for inv in nodes for s, (ok, _) in inv.items()
                    if ok and only_step in (None, s) and (below is None or s < below)}, reverse=True)
    endpoints: PeerEndpoints | None = None
    try:
        for step in steps:
            present = [set(inv.get(step, (False, []))[1]) for inv in nodes]
            has_commit = [inv.get(step, (False, []))[0] for inv in nodes]
            union = set().union(*present)
            if all(has_commit) and all(p == union for p in present):
                return step  # nothing to fetch for the newest candidate
            if endpoints is None:
                endpoints = peer_endpoints(base_dir, config, topology=topology)
            failed = problems_of_every_rank(_phase_a(layout, topology, step, has_commit, endpoints, config))
            if not failed:
                failed = problems_of_every_rank(_phase_b(layout, topology, step, present, endpoints, config))
            if failed:
                _skip(step, failed)
                continue
            if topology.rank == 0:
                logger.info("RAM checkpoint step %d is complete on every node after fetching from peers", step)
            return step
        if topology.rank == 0:
            logger.warning("No RAM checkpoint version can be completed from the surviving nodes (candidates: %s); "
                           "no RAM version will be loaded: fall back to the durable checkpoint.", steps or "none")
        return None
    finally:
        if endpoints is not None:
            endpoints.close()


def _skip(step: int, reasons: list[str]) -> None:
    if dist.get_rank() == 0:
        logger.warning("RAM checkpoint step %d cannot be restored from peers: %s", step, "; ".join(reasons))


def _phase_a(layout: CheckpointLayout, topology: NodeTopology, step: int, has_commit: list[bool],
             endpoints: PeerEndpoints, config: ReplicationConfig) -> str | None:
    """Leader of a node without the commit record: fetch the version-level files, then the record."""
    node = topology.node
    if not topology.is_leader or has_commit[node]:
        return None
    sources = [n for n in range(topology.node_count) if has_commit[n]]
    failures = []
    for offset in range(len(sources)):
        source_node = sources[(node + offset) % len(sources)]
        source = topology.ranks_of_node(source_node)[0]
        try:
            fetch_version_files(layout, step, endpoints, source, config)
            return None
        except Exception as exc:  # noqa: BLE001 - try the next node, then report
            failures.append(f"from rank {source}: {type(exc).__name__}: {exc}")
    return f"rank {topology.rank} (node {node}) could not fetch the files of step {step}: " + "; ".join(failures)


def fetch_version_files(layout: CheckpointLayout, step: int, endpoints: PeerEndpoints, source: int,
                        config: ReplicationConfig) -> None:
    """The commit record of step and every file it lists, from rank source's node; the record last, after checks."""
    address = endpoints.addresses[source]
    if address is None:
        raise ConnectionError(f"rank {source} has no transfer server")
    directory = layout.version_dir(step)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(COMMIT_NAME)
    base = os.fspath(layout.base_dir)
    kwargs = dict(config.transfer_kwargs(), rank=endpoints.rank, peer_rank=source,
                  space_margin_bytes=config.space_margin_bytes)  # the room the node's own saves need
    try:
        _core.transfer_fetch(address[0], address[1], endpoints.secret, version_relpath(step, COMMIT_NAME), base,
                             version_relpath(step, temporary), **kwargs)
        record = CommitRecord.decode((directory / temporary).read_bytes(), f"the commit record of step {step} fetched")
        if record.step != step:
            raise CorruptCheckpointError(f"the commit record fetched for step {step} names step {record.step}")
        for name in record.metadata.get(FILES_KEY) or {}:
            problem = version_file_name_problem(name)
            if problem is not None:
                raise CorruptCheckpointError(f"refusing version file name {name!r} of step {step}: {problem}")
            _core.transfer_fetch(address[0], address[1], endpoints.secret, version_relpath(step, name), base, **kwargs)
        check_version_files(layout, record)  # each file against the record, before the record is in place
        os.rename(directory / temporary, layout.commit_path(step))
        fsync_directory(directory)
    finally:
        (directory / temporary).unlink(missing_ok=True)


def _phase_b(layout: CheckpointLayout, topology: NodeTopology, step: int, present: list[set[str]],
             endpoints: PeerEndpoints, config: ReplicationConfig) -> str | None:
    """This rank's share of the objects its node lacks: fetched from holders and verified."""
    try:
        commit = read_commit(layout, step)
        node = topology.node
        missing = [o for o in commit.objects if o.name not in present[node]]
        node_ranks = topology.ranks_of_node(node)
        mine = [o for i, o in enumerate(missing) if node_ranks[i % len(node_ranks)] == topology.rank]
        jobs = []
        for i, record in enumerate(mine):
            holders = [n for n in range(topology.node_count) if n != node and record.name in present[n]]
            if not holders:
                return (f"object {record.name} of step {step} is on no surviving node (every copy was lost); "
                        f"rank {topology.rank} cannot restore it")
            holders = holders[i % len(holders):] + holders[:i % len(holders)]
            jobs.append((record, [peer_rank(topology, topology.rank, n) for n in holders]))
        if not jobs:
            return None
        with concurrent.futures.ThreadPoolExecutor(min(FETCH_THREADS, len(jobs))) as pool:
            outcomes = list(pool.map(lambda job: fetch_object_from(layout, step, job[0], job[1], endpoints, config),
                                     jobs))
        failed = [o for o in outcomes if o]
        if failed:
            return f"rank {topology.rank}: " + "; ".join(failed)
        logger.info("Rank %d fetched %d objects of step %d from peers", topology.rank, len(jobs), step)
        return None
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        return f"rank {topology.rank}: {type(exc).__name__}: {exc}"


def fetch_object_from(layout: CheckpointLayout, step: int, record: ObjectRecord, sources: list[int],
                      endpoints: PeerEndpoints, config: ReplicationConfig) -> str | None:
    """Fetch one object from the first of sources' nodes that has it intact; None, or why every source failed."""
    relative = version_relpath(step, record.name)
    path = layout.object_path(step, record.name)
    failures = []
    for source in sources:
        address = endpoints.addresses[source]
        if address is None:
            failures.append(f"rank {source} has no transfer server")
            continue
        try:
            fetched = _core.transfer_fetch(address[0], address[1], endpoints.secret, relative,
                                           os.fspath(layout.base_dir), spare_dir=REPLICA_SPARES, rank=endpoints.rank,
                                           peer_rank=source, space_margin_bytes=config.space_margin_bytes,
                                           **config.transfer_kwargs())
            verify_fetched_object(path, record, fetched["crc32c"])
            return None
        except Exception as exc:  # noqa: BLE001 - next holder, then report
            Path(path).unlink(missing_ok=True)
            failures.append(f"{record.name} from rank {source}: {type(exc).__name__}: {exc}")
    return "; ".join(failures)


def verify_fetched_object(path: str | os.PathLike[str], record: ObjectRecord, received_crc32c: int) -> None:
    """Check a fetched object against its commit record, re-reading its data only when that cannot be avoided.

    The receiver computed the CRC32C of every byte it wrote. When the object's header and index
    match the record and its CRC follows from the index (zeroed padding), equal CRCs vouch for
    the data as verify_object's full read would, at the cost of reading the header, the index
    and any bytes past the object (a holder's own object is a pool buffer, perhaps longer).
    Anything else (another size, another CRC, an object without that flag) is read in full by
    verify_object, which names the damaged key. Against damage the one CRC is as strong as the
    per-record ones; against bytes crafted by a job member (who can also forge a record's own CRC:
    docs/security.md) neither is a defence, and the loader still checks every record it reads.
    """
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        expected = whole_object_crc32c(fd, os.fspath(path), record)
        tail = os.fstat(fd).st_size - record.nbytes  # a holder's own object is a pool buffer, perhaps longer
        if expected is not None and 0 < tail <= record.nbytes:
            tail_crc = _core.checksum_file_ranges(fd, array.array("Q", (record.nbytes, tail)), 1)[0]
            expected = _core.crc32c_combine(expected, tail_crc, tail)
        if expected is not None and expected == received_crc32c and 0 <= tail <= record.nbytes:
            return
    except (CorruptCheckpointError, FormatVersionError, OSError, EOFError):
        pass  # verify_object says what is wrong
    finally:
        os.close(fd)
    verify_object(path, record)


def verify_object(path: str | os.PathLike[str], record: ObjectRecord) -> None:
    """Check an object against its commit record: header, index CRC, and every record's data CRC."""
    with open_object(os.fspath(path), record) as obj:
        ranges = array.array("Q")
        for entry in obj.entries:
            ranges.extend((entry.offset, entry.nbytes))
        try:
            crcs = _core.checksum_file_ranges(obj.fd, ranges, 1)
        except EOFError as exc:
            raise CorruptCheckpointError(f"object {obj.path} is truncated ({exc})") from exc
        if obj.header.has_data_crc:
            for entry, crc in zip(obj.entries, crcs):
                if crc != entry.crc32c:
                    raise ChecksumError(f"key {entry.key!r} of {obj.path} fetched from a peer fails its CRC32C",
                                        path=obj.path, key=entry.key)
