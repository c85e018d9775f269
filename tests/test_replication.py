"""Replication of RAM versions to peer nodes and recovery from them: real processes, gloo, sockets.

A "node" is a base directory of its own plus its ranks (ranks_per_node consecutive ranks).
Losing a node is simulated by removing its base directory before a restart (a new world).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from ml_flashpoint_nemo.cli.common import scan_replica_spares
from ml_flashpoint_nemo.cli.ls import scan_versions
from ml_flashpoint_nemo.core.layout import DCP_METADATA_NAME, CheckpointLayout, object_name
from ml_flashpoint_nemo.core.loader import open_object
from ml_flashpoint_nemo.core.topology import NodeTopology
from ml_flashpoint_nemo.core.versions import committed_steps, list_versions, read_commit, retire_version
from ml_flashpoint_nemo.replication.placement import holder_nodes, push_sources, push_targets, target_nodes
from ml_flashpoint_nemo.replication.service import prune_foreign_objects
from tests.support.multiproc import free_port, run_world

# --- placement (pure) ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(2, 7))
def test_placement_every_node_count_and_factor(n):
    for k in range(1, n + 1):
        copies_of = {node: 0 for node in range(n)}
        for node in range(n):
            targets = target_nodes(node, n, k)
            assert len(targets) == k - 1 and len(set(targets)) == k - 1 and node not in targets
            assert targets == [(node + d) % n for d in range(1, k)]
            for t in targets:
                copies_of[t] += 1
        assert all(c == k - 1 for c in copies_of.values())  # balanced: every node receives k-1 nodes' objects
    assert target_nodes(1, n, n + 5) == target_nodes(1, n, n)  # capped at n


def test_placement_pairs_ranks_by_local_index_and_rejects_bad_input():
    topology = NodeTopology((0, 0, 1, 1, 2, 2), rank=0)  # 3 nodes x 2 ranks
    assert push_targets(topology, 0, 2) == [2] and push_targets(topology, 1, 2) == [3]
    assert push_targets(topology, 5, 3) == [1, 3]
    assert holder_nodes(topology, 3, 2) == [1, 2]
    uneven = NodeTopology((0, 0, 1), rank=0)  # node 1 has one rank: both of node 0's pair with it
    assert push_targets(uneven, 0, 2) == [2] and push_targets(uneven, 1, 2) == [2]
    assert push_targets(NodeTopology((0, 0), rank=0), 0, 2) == []  # one node: no replication
    with pytest.raises(ValueError):
        target_nodes(0, 3, 0)


@pytest.mark.parametrize("nodes", [(0, 0, 1, 1, 2, 2), (0, 0, 1), (0, 1, 1, 1, 2), (0, 1, 2, 3), (0, 0)])
def test_push_sources_are_exactly_the_ranks_that_push_to_a_rank(nodes):
    """What a server admits (its policy's pushers) is the inverse of where every rank pushes."""
    topology = NodeTopology(nodes, rank=0)
    for factor in range(1, 6):
        for rank in range(len(nodes)):
            expected = [s for s in range(len(nodes)) if rank in push_targets(topology, s, factor)]
            assert push_sources(topology, rank, factor) == expected, (nodes, factor, rank)


def test_foreign_objects_of_retired_versions_are_pruned(shm_dir):
    """retire_version leaves replicas (other nodes' objects) behind; prune removes them and the directory."""
    layout = CheckpointLayout(shm_dir)
    topology = NodeTopology((0, 1), rank=1)  # this is node 1, rank 1
    for step in (1, 2):
        d = layout.version_dir(step)
        d.mkdir(parents=True)
        for rank in (0, 1):
            (d / object_name(rank)).write_bytes(b"x")
        (d / "COMMIT").write_bytes(b"{}")
    retire_version(layout, 1, rank=1)
    assert os.listdir(layout.version_dir(1)) == [object_name(0)]  # the replica stays: nobody here wrote it
    assert prune_foreign_objects(layout, topology) == [1]
    assert not layout.version_dir(1).exists()
    assert sorted(os.listdir(layout.version_dir(2))) == ["COMMIT", object_name(0), object_name(1)]  # committed


def _versions_with_replicas(layout: CheckpointLayout, sizes: dict[int, int]) -> None:
    """Versions step -> replica size: rank 0's object is a replica on node 1 (rank 1), committed, then
    every version but the newest retired by rank 1 (which leaves the replicas to prune)."""
    for step, size in sizes.items():
        d = layout.version_dir(step)
        d.mkdir(parents=True)
        (d / object_name(0)).write_bytes(os.urandom(size))
        (d / object_name(1)).write_bytes(b"own")
        (d / "COMMIT").write_bytes(b"{}")
    for step in sorted(sizes)[:-1]:
        retire_version(layout, step, rank=1)


def test_pruned_replicas_become_spares_up_to_one_versions_worth(shm_dir):
    layout = CheckpointLayout(shm_dir)
    topology = NodeTopology((0, 1), rank=1)
    _versions_with_replicas(layout, {1: 5000, 2: 7000, 3: 6000})
    kept_inodes = {os.stat(layout.object_path(s, object_name(0))).st_ino for s in (1, 2)}
    assert prune_foreign_objects(layout, topology) == [1, 2]
    spares = list(layout.replica_spares_dir.iterdir())
    # Default budget: the largest version's replicas (7000 bytes): one of the two retired files fits.
    assert len(spares) == 1 and spares[0].stat().st_ino in kept_inodes and spares[0].stat().st_size <= 7000
    assert layout.version_steps() == [3] and committed_steps(layout) == [3]  # spares are never versions
    assert [v.step for v in scan_versions(layout)] == [3] and [v.step for v in list_versions(shm_dir)] == [3]
    assert scan_replica_spares(layout).files == 1


def test_pruning_with_no_spare_budget_deletes_and_trims_spares(shm_dir):
    layout = CheckpointLayout(shm_dir)
    topology = NodeTopology((0, 1), rank=1)
    _versions_with_replicas(layout, {1: 5000, 2: 6000})
    layout.replica_spares_dir.mkdir(parents=True)
    (layout.replica_spares_dir / "old-spare").write_bytes(os.urandom(100))
    assert prune_foreign_objects(layout, topology, spare_bytes=0) == [1]
    assert list(layout.replica_spares_dir.iterdir()) == []  # over the (zero) budget: removed too
    assert not layout.version_dir(1).exists()


def test_a_load_that_needs_an_object_no_reachable_node_holds_fails_with_peer_fetch_error(shm_dir):
    """Rank 0 of 2 nodes reads rank 1's object, absent here: with the recovery's servers stopped, or with no
    node left that could send it, the load fails with PeerFetchError (not as corruption), nothing written."""
    from ml_flashpoint_nemo.core.format import ObjectRecord
    from ml_flashpoint_nemo.errors import CorruptCheckpointError, PeerFetchError
    from ml_flashpoint_nemo.replication.own_objects import RecoverySession
    from ml_flashpoint_nemo.replication.service import PeerEndpoints, ReplicationConfig

    base = shm_dir / "node-0"
    (base / "step-3").mkdir(parents=True)
    session = RecoverySession(base, NodeTopology((0, 1), rank=0), ReplicationConfig())
    record = ObjectRecord(object_name(1), rank=1, nbytes=4096, crc32c=0)
    with pytest.raises(PeerFetchError, match="transfer servers have stopped") as stopped:
        session.fetch_for_load(3, record)
    assert not isinstance(stopped.value, CorruptCheckpointError)
    session.endpoints = PeerEndpoints(None, b"s" * 32, [None, None], rank=0)  # rank 1's server never started
    with pytest.raises(PeerFetchError, match="no other node holds a copy"):
        session.fetch_for_load(3, record)
    assert sorted(p.name for p in (base / "step-3").iterdir()) == []
    session.fetch_for_load(3, ObjectRecord(object_name(0), rank=0, nbytes=4096, crc32c=0))  # its own: checked before


# --- multi-process ------------------------------------------------------------------------------


def bases_for(root: Path, nodes: int) -> list[str]:
    return [str(root / f"node-{n}") for n in range(nodes)]


def run(scenario: str, world: int, **params) -> list[str]:
    return run_world("replication_scenarios", scenario, world, params, timeout=240)


def statuses(outputs: list[str], step: int) -> list[str]:
    return [re.search(rf"^STATUS {step} (\S+) failed=(\[.*?\])", out, re.M).group(0) for out in outputs]


@pytest.mark.parametrize("nodes, ranks_per_node, wiped", [(2, 2, 0), (3, 1, 1)])
def test_wiped_node_recovers_newest_version_from_peers(shm_dir, nodes, ranks_per_node, wiped):
    world = nodes * ranks_per_node
    bases = bases_for(shm_dir, nodes)
    outputs = run("replicate", world, bases=bases, ranks_per_node=ranks_per_node, steps=[1, 2, 3])
    assert all(s.endswith("replicated failed=[]") for s in statuses(outputs, 3)), outputs
    # The servers replication started admit only what the placement sends: not a push over their own object.
    foreign = [line for out in outputs for line in out.splitlines() if line.startswith("FOREIGN PUSH")]
    assert len(foreign) == world and all("TransferForbiddenError" in f and "lives on this node" in f
                                         for f in foreign), foreign
    for node, base in enumerate(bases):  # node i holds its own objects and node i-1's replicas
        names = set(os.listdir(Path(base) / "step-3"))
        for source in (node, (node - 1) % nodes):
            for r in range(source * ranks_per_node, (source + 1) * ranks_per_node):
                assert object_name(r) in names, (node, r, names)
    snapshot = shm_dir / "snapshot"
    if nodes == 3:
        shutil.copytree(shm_dir, snapshot, ignore=shutil.ignore_patterns("snapshot"))
    shutil.rmtree(bases[wiped])
    outputs = run("restart_load", world, bases=bases, ranks_per_node=ranks_per_node)
    assert all("CHOSEN 3" in out and "LOADED 3 OK" in out for out in outputs), outputs
    layout = CheckpointLayout(bases[wiped])
    assert 3 in committed_steps(layout)
    if nodes != 3:
        return
    # Both copies of node 0's objects lived on nodes 0 and 1 (k=2): lose both and nothing is loadable.
    for base in bases:
        shutil.rmtree(base)
        shutil.copytree(snapshot / Path(base).name, base)
    shutil.rmtree(bases[0])
    shutil.rmtree(bases[1])
    outputs = run("restart_load", world, bases=bases, ranks_per_node=ranks_per_node)
    assert all("CHOSEN None" in out for out in outputs), outputs
    assert "every copy was lost" in outputs[0] and "fall back to the durable checkpoint" in outputs[0], outputs[0]


def fetch_lines(outputs: list[str]) -> dict[int, str]:
    found = [re.search(r"^NODE (\d+) (CHOSEN .*)$", line) for out in outputs for line in out.splitlines()]
    return {int(m.group(1)): m.group(2) for m in found if m}


def test_restart_fetches_only_what_each_node_reads(shm_dir):
    """8 ranks on 4 nodes, k=2. A restart with no node lost fetches nothing to choose; the load brings each
    node only the object its ranks read and the node lacks (rank 0's, which holds the replicated bias: nodes
    0 and 1 hold it, as its own node and its replica). After node 1 is wiped, the choice brings back node 1's
    version files and its own ranks' objects, nothing else anywhere; its load then reads rank 0's object too.
    Both loads are bit-exact (checked on every rank)."""
    world, per_node = 8, 2
    bases = bases_for(shm_dir, 4)
    outputs = run("replicate", world, bases=bases, ranks_per_node=per_node, steps=[1, 2, 3])
    assert all(s.endswith("replicated failed=[]") for s in statuses(outputs, 3)), outputs
    rank_0 = "step-3/" + object_name(0)
    outputs = run("restart_counting_fetches", world, bases=bases, ranks_per_node=per_node)
    # Rank 0's object, which every load reads: checked in full once on each node holding it (node 0 for rank 1,
    # node 1 for one of ranks 2 and 3: the other finds the note of that check), fetched (and so checked) elsewhere.
    checks = [int(re.search(r"^RANK \d+ LOAD CHECKS (\d+)$", out, re.M).group(1)) for out in outputs]
    assert [checks[2 * n] + checks[2 * n + 1] for n in range(4)] == [1, 1, 0, 0], checks
    lines = fetch_lines(outputs)
    assert lines == {0: "CHOSEN 3 CHOICE FETCHED [] LOAD FETCHED []",
                     1: "CHOSEN 3 CHOICE FETCHED [] LOAD FETCHED []",
                     2: f"CHOSEN 3 CHOICE FETCHED [] LOAD FETCHED ['{rank_0}']",
                     3: f"CHOSEN 3 CHOICE FETCHED [] LOAD FETCHED ['{rank_0}']"}, lines
    shutil.rmtree(bases[1])
    lines = fetch_lines(run("restart_counting_fetches", world, bases=bases, ranks_per_node=per_node))
    node_1 = sorted(f"step-3/{name}" for name in (".metadata", "COMMIT", "common.pt", "metadata.json",
                                                   object_name(2), object_name(3)))
    assert lines == {0: "CHOSEN 3 CHOICE FETCHED [] LOAD FETCHED []",
                     1: f"CHOSEN 3 CHOICE FETCHED {node_1} LOAD FETCHED ['{rank_0}']",
                     2: "CHOSEN 3 CHOICE FETCHED [] LOAD FETCHED []",
                     3: "CHOSEN 3 CHOICE FETCHED [] LOAD FETCHED []"}, lines


def test_restart_on_reordered_hosts_finds_each_ranks_objects_and_checks_the_replicas_its_load_reads(shm_dir):
    """8 ranks on 4 nodes, k=2, saved, then restarted with the nodes in another order (a launcher that ranks the
    hosts differently): ranks 0-1 now run where ranks 4-5 saved, and so on. The placement no longer says where
    a rank's objects are; each rank that lacks its own asks the other nodes and the choice still takes step 3.
    Then node 1's replica of rank 0's object (read by every load: the replicated bias) is damaged: the load on
    that node checks it before use, drops it and fetches a good copy. Both loads are bit-exact."""
    world, per_node = 8, 2
    bases = bases_for(shm_dir, 4)
    outputs = run("replicate", world, bases=bases, ranks_per_node=per_node, steps=[1, 2, 3])
    assert all(s.endswith("replicated failed=[]") for s in statuses(outputs, 3)), outputs
    reordered = [bases[2], bases[3], bases[0], bases[1]]
    outputs = run("restart_counting_fetches", world, bases=reordered, ranks_per_node=per_node)
    lines = fetch_lines(outputs)
    assert all(line.startswith("CHOSEN 3 ") for line in lines.values()), lines
    assert "fetched 1 of its objects of step 3" in "".join(outputs), outputs  # found off the placement
    replica = Path(bases[1]) / "step-3" / object_name(0)
    flip_bit(replica, weight_offset(bases[0], 3, rank=0))  # a record of the object that node 1's loads read
    damaged = replica.read_bytes()
    outputs = run("restart_counting_fetches", world, bases=bases, ranks_per_node=per_node)
    assert all(line.startswith("CHOSEN 3 ") for line in fetch_lines(outputs).values()), outputs
    # node 1's load checked its copy, found the flip (in a record its ranks do not even read) and fetched it again
    assert replica.read_bytes() != damaged and replica.read_bytes() == (Path(bases[0]) / "step-3" /
                                                                        object_name(0)).read_bytes()


def test_nodes_holding_different_commit_records_for_a_step_skip_it(shm_dir):
    """2 nodes x 1 rank, steps 2 and 3 kept. Node 1's commit record of step 3 is replaced by another valid one
    (a node that rejoined with another job's step 3, say): each rank's own objects still check against its
    own node's record, but the nodes disagree on what step 3 is, so every rank takes step 2, bit-exact."""
    from ml_flashpoint_nemo.core.versions import write_commit

    bases = bases_for(shm_dir, 2)
    outputs = run("replicate", 2, bases=bases, ranks_per_node=1, steps=[1, 2, 3], keep=2)
    assert all("2, 3]" in out for out in outputs), outputs  # committed and kept
    layout = CheckpointLayout(bases[1])
    commit = read_commit(layout, 3)
    write_commit(layout, 3, commit.objects, world_size=commit.world_size,
                 metadata={**commit.metadata, "note": "another job's step 3"})
    outputs = run("restart_load", 2, bases=bases, ranks_per_node=1)
    assert all("CHOSEN 2" in out and "LOADED 2 OK" in out for out in outputs), outputs
    assert "the nodes hold different commit records for step 3" in outputs[0], outputs[0]


def weight_offset(base: str, step: int, rank: int = 1) -> int:
    """Where rank's layer.weight data starts in its object of step."""
    record = next(o for o in read_commit(CheckpointLayout(base), step).objects if o.name == object_name(rank))
    with open_object(str(Path(base) / f"step-{step}" / object_name(rank)), record) as obj:
        return next(e.offset for e in obj.entries if e.key.startswith("layer.weight"))


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_corrupt_own_object_is_replaced_by_the_peers_replica(shm_dir):
    """2 nodes x 1 rank, step 2 replicated. A bit flips in node 1's own object: recovery drops that copy,
    fetches node 0's replica, verifies it and resumes from step 2 bit-exactly (not from step 1). With
    the replica flipped as well, no good copy exists and step 1 is used."""
    bases = bases_for(shm_dir, 2)
    outputs = run("replicate", 2, bases=bases, ranks_per_node=1, steps=[1, 2])
    assert all(s.endswith("replicated failed=[]") for s in statuses(outputs, 2)), outputs
    own, replica = (Path(b) / "step-2" / object_name(1) for b in (bases[1], bases[0]))
    snapshot = replica.read_bytes()

    offset = weight_offset(bases[1], 2)

    def flip(path: Path) -> None:
        flip_bit(path, offset)

    flip(own)
    outputs = run("restart_load", 2, bases=bases, ranks_per_node=1)
    assert all("CHOSEN 2" in out and "LOADED 2 OK" in out for out in outputs), outputs
    assert "drops the corrupt object rank-00001-0.fpo" in outputs[1], outputs[1]
    assert own.read_bytes() == snapshot  # the good replica took its place
    flip(own)
    flip(replica)
    outputs = run("restart_load", 2, bases=bases, ranks_per_node=1)
    assert all("CHOSEN 1" in out and "LOADED 1 OK" in out for out in outputs), outputs
    assert "fails its CRC32C" in outputs[0] + outputs[1], outputs


def test_own_object_of_an_older_version_is_replaced_when_the_newest_is_rejected(shm_dir):
    """2 nodes x 1 rank, steps 1 and 2 kept and replicated. Node 1's copy of step 2's common state is
    damaged (step 2 is rejected although all its objects are there) and node 1's own object of step 1
    is corrupt: recovery must fetch the replica for step 1, not stop at the complete step 2."""
    bases = bases_for(shm_dir, 2)
    outputs = run("replicate", 2, bases=bases, ranks_per_node=1, steps=[1, 2], keep=2)
    assert all("COMMITTED [1, 2]" in out for out in outputs), outputs
    common = Path(bases[1]) / "step-2" / "common.pt"
    common.write_bytes(common.read_bytes()[:-1] + b"?")
    own, replica = (Path(b) / "step-1" / object_name(1) for b in (bases[1], bases[0]))
    flip_bit(own, weight_offset(bases[1], 1))
    outputs = run("restart_load", 2, bases=bases, ranks_per_node=1)
    assert all("CHOSEN 1" in out and "LOADED 1 OK" in out for out in outputs), outputs
    assert own.read_bytes() == replica.read_bytes()


def test_closing_does_not_wait_out_a_push_stuck_in_its_timeouts(shm_dir):
    """A push that hangs (a peer that accepts but never answers) ends within its I/O timeouts (5 s per try,
    2 tries here); closing the service, as an abort does, returns within its own 1 s bound."""
    outputs = run("close_during_a_stuck_push", 2, bases=bases_for(shm_dir, 2), ranks_per_node=1)
    closed_s = float(re.search(r"^CLOSED in ([\d.]+)s", outputs[0], re.M).group(1))
    assert closed_s < 3, outputs[0]
    assert "the replication thread is still in a push" in outputs[0], outputs[0]


def test_unreachable_peer_leaves_version_under_replicated_then_older_version_is_recovered(shm_dir):
    """4 nodes x 1 rank. Rank 1's server stops before step 3: rank 0 cannot copy steps 3 and 4 anywhere.

    The saves still commit, rank 0's status names the unreachable peer, step 2 (the newest version
    replicated everywhere) is kept. Node 0 is then lost: its objects of steps 3 and 4 are gone, so the
    restart falls back to step 2, restored bit-exactly from node 1.
    """
    bases = bases_for(shm_dir, 4)
    outputs = run("replicate", 4, bases=bases, ranks_per_node=1, steps=[1, 2, 3, 4], stop_server_rank=1,
                  stop_before_step=3)
    assert all(s.endswith("replicated failed=[]") for s in statuses(outputs, 2)), outputs
    for step in (3, 4):
        got = statuses(outputs, step)
        assert got[0] == f"STATUS {step} under-replicated failed=[1]", outputs[0]
        assert all(s.endswith("replicated failed=[]") and "under" not in s for s in got[1:]), got
    assert "ConnectionRefused" in outputs[0] or "TransferError" in outputs[0], outputs[0]
    assert "is under-replicated" in outputs[0]
    assert all(float(t) < 30 for t in re.findall(r"^SAVED [34] in ([\d.]+)s", outputs[0], re.M))
    assert all("COMMITTED [2, 3, 4]" in out for out in outputs), outputs  # step 2 kept while 3, 4 unreplicated
    assert "PROGRESS newest=2 failed=True" in outputs[0], outputs[0]  # what the trainer's metrics report
    assert all("PROGRESS newest=4 failed=False" in out for out in outputs[1:]), outputs
    shutil.rmtree(bases[0])
    outputs = run("restart_load", 4, bases=bases, ranks_per_node=1)
    assert all("CHOSEN 2" in out and "LOADED 2 OK" in out for out in outputs), outputs
    assert "step 4 is not used" in outputs[0] and "every copy was lost" in outputs[0], outputs[0]
    # every rank holds the same reasons; rank 0 alone logs them (not N copies of an O(N) line)
    assert not any("is not used" in out or "Resuming from" in out for out in outputs[1:]), outputs[1]


# --- network namespaces: every node its own address -------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_namespaces():
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    names, links = [f"fprep-{tag}-a", f"fprep-{tag}-b"], [f"fpr{tag}a", f"fpr{tag}b"]
    addresses = ["10.231.77.1", "10.231.77.2"]
    created: list[str] = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, address in zip(names, links, addresses):
            _ip("link", "set", link, "netns", ns)
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", link)
            _ip("netns", "exec", ns, "ip", "link", "set", link, "up")
    except subprocess.CalledProcessError as exc:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot set up network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    yield list(zip(names, links, addresses))
    for ns in names:  # deleting a namespace removes its end of the veth pair, and with it the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_nodes_in_network_namespaces_replicate_and_recover(shm_dir, two_namespaces):
    from tests.support.multiproc import run_ranks

    bases = bases_for(shm_dir, 2)
    prefixes = [["ip", "netns", "exec", ns] for ns, _, _ in two_namespaces]
    envs = [{"GLOO_SOCKET_IFNAME": link, "FLASHPOINT_REPLICATION_HOST": address}
            for _, link, address in two_namespaces]
    master = two_namespaces[0][2]

    def world(scenario: str, **params) -> list[str]:
        return run_ranks("replication_scenarios", scenario, dict(params, bases=bases, ranks_per_node=1),
                         prefixes=prefixes, envs=envs, master_addr=master, master_port=free_port(), timeout=240)

    outputs = world("replicate", steps=[1, 2])
    assert all(s.endswith("replicated failed=[]") for s in statuses(outputs, 2)), outputs
    assert re.search(r"ADDRESSES \[\('10\.231\.77\.1', \d+\), \('10\.231\.77\.2', \d+\)\]", outputs[0]), outputs[0]
    assert object_name(0) in os.listdir(Path(bases[1]) / "step-2")  # pushed across the veth pair
    shutil.rmtree(bases[1])
    outputs = world("restart_load")
    assert all("CHOSEN 2" in out and "LOADED 2 OK" in out for out in outputs), outputs
    assert "Rank 1 fetched 1 of its objects of step 2" in outputs[1], outputs[1]  # node 0's: read by its load


def test_orphaned_uncommitted_directories_are_pruned(shm_dir):
    """Newer than the newest commit, with other nodes' objects and none of this node's: no placement makes
    them a version here (what an older release accepted from a hostile member). Pruned, with their
    directories; a newer directory holding this node's own object (a save in progress) stays."""
    layout = CheckpointLayout(shm_dir)
    topology = NodeTopology((0, 1), rank=1)
    _versions_with_replicas(layout, {1: 5000})
    for step in (7, 9):
        layout.version_dir(step).mkdir()
        (layout.version_dir(step) / object_name(0, 3)).write_bytes(os.urandom(1000))
    layout.version_dir(8).mkdir()
    (layout.version_dir(8) / object_name(1)).write_bytes(b"own, in progress")
    (layout.version_dir(8) / object_name(0)).write_bytes(b"replica")
    layout.version_dir(10).mkdir()  # this node's copy of the version files being written (the record last)
    (layout.version_dir(10) / DCP_METADATA_NAME).write_bytes(b"dcp metadata")
    (layout.version_dir(10) / object_name(0)).write_bytes(b"replica")
    assert prune_foreign_objects(layout, topology, spare_bytes=0) == [7, 9]
    assert layout.version_steps() == [1, 8, 10] and committed_steps(layout) == [1]
    assert sorted(os.listdir(layout.version_dir(8))) == [object_name(0), object_name(1)]
